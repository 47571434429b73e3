// Data movement: column slices (q/k/v split), row gathers (logits rows), bias add,
// and fills (test poisoning).

// out [rows, width] = x[:, start:start + width] of x [rows, cols].
extern "C" __global__ void split_cols(const scalar_t* __restrict__ x,
                                      scalar_t* __restrict__ out, long long rows, int cols,
                                      int start, int width) {
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
    const scalar_t* src = x + (long long)indices[blockIdx.x] * cols;
    scalar_t* dst = out + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// y[r, j] += bias[j] (in f32, rounded once).
extern "C" __global__ void add_bias(scalar_t* __restrict__ y, const scalar_t* __restrict__ bias,
                                    long long rows, int cols) {
    const long long n = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = from_f32(to_f32(y[i]) + to_f32(bias[i % cols]));
    }
}

extern "C" __global__ void fill(scalar_t* __restrict__ y, long long n, float value) {
    const scalar_t v = from_f32(value);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = v;
    }
}
