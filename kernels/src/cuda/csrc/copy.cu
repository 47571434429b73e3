// Data movement: column slices (q/k/v split), row gathers (logits rows), and fills
// (test poisoning).

// out [rows, width] = x[:, start:start + width] of x [rows, cols].
extern "C" __global__ void split_cols(const scalar_t* __restrict__ x,
                                      scalar_t* __restrict__ out, long long rows, int cols,
                                      int start, int width) {
    pdl_enter();
    const long long n = rows * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width;
        out[i] = x[r * cols + start + (i - r * width)];
    }
}

// out[i] = x[indices[i]], rows of `cols`. One block per output row.
extern "C" __global__ void gather_rows(const scalar_t* __restrict__ x,
                                       const int* __restrict__ indices,
                                       scalar_t* __restrict__ out, int cols) {
    pdl_enter();
    const scalar_t* src = x + (long long)indices[blockIdx.x] * cols;
    scalar_t* dst = out + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void fill(scalar_t* __restrict__ y, long long n, float value) {
    pdl_enter();
    const scalar_t v = from_f32(value);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = v;
    }
}

// `--load-format dummy` on the GPU: rows row0.. and columns col0.. of a seeded random
// tensor whose rows are full_cols long, into out [rows, cols]. Element e (row-major in the
// whole tensor) is draw (e % 16384) + 1 of the splitmix64 stream of block e / 16384, its
// four 16-bit fields summed (Irwin-Hall), exactly as worker/src/weights/dummy.rs draws it:
// the same integer hash and the same two f32 roundings (no fused multiply-add).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void dummy_fill(scalar_t* __restrict__ out, unsigned long long key,
                                      float mean, float scale, long long full_cols,
                                      long long row0, long long col0, long long rows,
                                      long long cols) {
    pdl_enter();
    const unsigned long long golden = 0x9E3779B97F4A7C15ull;
    const long long n = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cols;
        const unsigned long long e =
            (unsigned long long)((row0 + r) * full_cols + col0 + (i - r * cols));
        const unsigned long long block = e >> 14;
        const unsigned long long state = mix64((key ^ (block * 0xD1B54A32D192ED03ull)) + golden);
        const unsigned long long x = mix64(state + ((e & 16383ull) + 1ull) * golden);
        const unsigned long long sum =
            (x & 0xFFFFull) + ((x >> 16) & 0xFFFFull) + ((x >> 32) & 0xFFFFull) + (x >> 48);
        out[i] = from_f32(__fadd_rn(mean, __fmul_rn((float)sum - 131070.0f, scale)));
    }
}
