// Thin GEMMs of decode steps: out[m, n] = sum_k x[m, k] * w[n, k] for M <= 8 rows of x.
//
// At a handful of rows a GEMM is a stream of the weights: cuBLAS picks split-K tiles for
// these shapes and moves about 1 TB/s. Here each warp owns R whole rows of w and reads
// them in 16-byte chunks, four chunks per lane in flight, bypassing L1 so that x (M rows,
// a few KB, read by every warp) stays there. Sums are in f32 and each lane's partial
// sums are reduced across the warp at the end, so one output is rounded once.
//
// Contract (checked by the host, gemv.rs): k is a multiple of VEC16, and x, w and out
// start 16-byte aligned.
//
// `early_lines`: the first 128-byte lines of each of its rows of w a warp asks L2 for
// before its PDL wait (0: none). Weights are no kernel's output, so a gemv that follows a
// collective (whose few blocks wait on the peers while HBM idles) can stream part of its
// weights meanwhile; behind a kernel that streams memory itself, it only competes
// (docs/BENCHMARKS.md), so the host asks for it after all-reduces only.

#define GEMV_WARPS 8
constexpr int GEMV_UNROLL = 4;

// acc[m][r] += x[m, chunk c] . w[row r, chunk c]
template <int M, int R>
__device__ __forceinline__ void gemv_chunk(const uint4 (&wv)[R], const uint4* __restrict__ xv,
                                           int chunks, int c, float (&acc)[M][R]) {
    float wf[R][VEC16];
#pragma unroll
    for (int r = 0; r < R; r++) unpack16(wv[r], wf[r]);
#pragma unroll
    for (int m = 0; m < M; m++) {
        float xf[VEC16];
        unpack16(__ldg(xv + m * chunks + c), xf);
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int j = 0; j < VEC16; j++) acc[m][r] = fmaf(xf[j], wf[r][j], acc[m][r]);
        }
    }
}

// acc[m][r] = x[m, :] . w_rows[r][:], reduced across the warp (every lane holds the sums).
template <int M, int R>
__device__ __forceinline__ void gemv_dots(const scalar_t* __restrict__ x,
                                          const uint4* (&wr)[R], int k, float (&acc)[M][R]) {
    const int lane = threadIdx.x & 31;
    const int chunks = k / VEC16;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int m = 0; m < M; m++) {
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = 0.f;
    }
    int c = lane;
    // Every load of GEMV_UNROLL chunks is issued before the first is used.
    for (; c + (GEMV_UNROLL - 1) * 32 < chunks; c += GEMV_UNROLL * 32) {
        uint4 wv[GEMV_UNROLL][R];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
#pragma unroll
            for (int r = 0; r < R; r++) wv[u][r] = load_streamed(wr[r] + c + u * 32);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) gemv_chunk<M, R>(wv[u], xv, chunks, c + u * 32, acc);
    }
    for (; c < chunks; c += 32) {
        uint4 wv[R];
#pragma unroll
        for (int r = 0; r < R; r++) wv[r] = load_streamed(wr[r] + c);
        gemv_chunk<M, R>(wv, xv, chunks, c, acc);
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = warp_sum(acc[m][r]);
    }
}

// The first `lines` 128-byte lines of each row in `wr` into L2 (a hint), a lane a line.
template <int R>
__device__ __forceinline__ void prefetch_rows(const uint4* (&wr)[R], int lines) {
    for (int l = threadIdx.x & 31; l < lines; l += 32) {
#pragma unroll
        for (int r = 0; r < R; r++) prefetch_l2(wr[r] + 8 * l);
    }
}

template <int M, int R>
__device__ __forceinline__ void gemv(const scalar_t* __restrict__ x,
                                     const scalar_t* __restrict__ w,
                                     scalar_t* __restrict__ out, int k, int n,
                                     int early_lines) {
    const long long row0 = ((long long)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * R;
    // Rows past n (the last warp of an odd n) re-read the last row and are not written.
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const long long row = row0 + r < n ? row0 + r : n - 1;
        wr[r] = reinterpret_cast<const uint4*>(w + row * k);
    }
    if (row0 < n) prefetch_rows(wr, early_lines);
    pdl_enter();
    if (row0 >= n) return;
    float acc[M][R];
    gemv_dots<M, R>(x, wr, k, acc);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int m = 0; m < M; m++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row0 + r < n) out[(long long)m * n + row0 + r] = from_f32(acc[m][r]);
        }
    }
}

// gemv_m{M}_r{R}: M rows of x, R rows of w per warp, GEMV_WARPS warps per block.
#define GEMV_KERNEL(M, R)                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                           \
        gemv_m##M##_r##R(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,    \
                         scalar_t* __restrict__ out, int k, int n, int early_lines) {       \
        gemv<M, R>(x, w, out, k, n, early_lines);                                           \
    }
#define GEMV_KERNELS(M) GEMV_KERNEL(M, 1) GEMV_KERNEL(M, 2)
GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(3)
GEMV_KERNELS(4)
GEMV_KERNELS(5)
GEMV_KERNELS(6)
GEMV_KERNELS(7)
GEMV_KERNELS(8)

// gemv_m1_r1 with each row's k split over S consecutive warps of a block, which meet in
// shared memory (summed in part order, so a row's bits depend on S only). A warp reads its
// row in steps of four 16-byte loads a lane, each step a round trip, so a product of few
// long rows (the 8B's TP=4 qkv: 1,536 rows of 4,096, 12 warps an SM, four steps each)
// keeps too few bytes in flight; S times the warps, each with an S-th of the steps, keep
// more. A block of GEMV_WARPS warps makes GEMV_WARPS / S rows. The host picks S (gemv.rs).
template <int S>
__device__ __forceinline__ void gemv_split_k(const scalar_t* __restrict__ x,
                                             const scalar_t* __restrict__ w,
                                             scalar_t* __restrict__ out, int k, int n,
                                             int early_lines) {
    constexpr int ROWS = GEMV_WARPS / S;
    __shared__ float sums[GEMV_WARPS];
    const int warp = threadIdx.x >> 5, part = warp % S;
    const long long row0 = (long long)blockIdx.x * ROWS;
    // Rows past n (the last block) re-read the last row and are not written; every warp
    // still reaches the barrier.
    const long long row = min(row0 + warp / S, (long long)n - 1);
    const int chunks = k / VEC16;
    const int c0 = part * chunks / S, c1 = (part + 1) * chunks / S;
    const uint4* wr[1] = {reinterpret_cast<const uint4*>(w + row * k) + c0};
    // The row's first `early_lines` lines, of which this part holds those past c0.
    prefetch_rows(wr, max(0, min(early_lines - c0 / 8, (c1 - c0 + 7) / 8)));
    pdl_enter();
    float acc[1][1];
    gemv_dots<1, 1>(x + (long long)c0 * VEC16, wr, (c1 - c0) * VEC16, acc);
    if ((threadIdx.x & 31) == 0) sums[warp] = acc[0][0];
    __syncthreads();
    if (threadIdx.x < ROWS && row0 + threadIdx.x < n) {
        float sum = 0.f;
#pragma unroll
        for (int p = 0; p < S; ++p) sum += sums[threadIdx.x * S + p];
        out[row0 + threadIdx.x] = from_f32(sum);
    }
}

#define GEMV_SPLIT_K_KERNEL(S)                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                           \
        gemv_m1_k##S(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,        \
                     scalar_t* __restrict__ out, int k, int n, int early_lines) {           \
        gemv_split_k<S>(x, w, out, k, n, early_lines);                                      \
    }
GEMV_SPLIT_K_KERNEL(2)
GEMV_SPLIT_K_KERNEL(4)

// The MLP's gate/up product fused with SiLU-and-mul for one row of x:
// out[j] = silu(x . w[j]) * (x . w[d + j]) for the fused weight w [2d, k]. One warp per
// output reads its gate and up rows together. Both products are rounded to the dtype
// before silu_and_mul's arithmetic (activation.cu), so the result is bit for bit that of
// gemv_m1 followed by silu_and_mul, one launch and one round trip of [1, 2d] fewer.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_silu_mul_m1(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                     scalar_t* __restrict__ out, int k, int d, int early_lines) {
    const long long j = (long long)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const uint4* wr[2] = {reinterpret_cast<const uint4*>(w + j * k),
                          reinterpret_cast<const uint4*>(w + (d + j) * k)};
    if (j < d) prefetch_rows(wr, early_lines);
    pdl_enter();
    if (j >= d) return;
    float acc[1][2];
    gemv_dots<1, 2>(x, wr, k, acc);
    if ((threadIdx.x & 31) != 0) return;
    const float g = round_t(acc[0][0]);
    const float u = round_t(acc[0][1]);
    out[j] = from_f32(silu_mul(g, u));
}

// gemv_silu_mul_m1 with the gate and up rows of an output in two warps of one block
// instead of one warp: each warp streams one row, as gemv_m1_r1 does, and the two sums
// meet in shared memory. A block of GEMV_WARPS warps makes GEMV_WARPS / 2 outputs. The
// same bits as gemv_silu_mul_m1 (each row's sum is gemv_dots<1, 1>'s, in the same order).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_silu_mul_split_m1(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                           scalar_t* __restrict__ out, int k, int d, int early_lines) {
    constexpr int PAIRS = GEMV_WARPS / 2;
    __shared__ float sums[GEMV_WARPS];
    const int warp = threadIdx.x >> 5, pair = warp % PAIRS;
    const long long j0 = (long long)blockIdx.x * PAIRS;
    // Outputs past d (the last block) re-read the last row and are not written; every
    // warp still reaches the barrier.
    const long long j = j0 + pair < d ? j0 + pair : d - 1;
    const long long row = warp < PAIRS ? j : d + j;
    const uint4* wr[1] = {reinterpret_cast<const uint4*>(w + row * k)};
    prefetch_rows(wr, early_lines);
    pdl_enter();
    float acc[1][1];
    gemv_dots<1, 1>(x, wr, k, acc);
    if ((threadIdx.x & 31) == 0) sums[warp] = acc[0][0];
    __syncthreads();
    if (threadIdx.x < PAIRS && j0 + threadIdx.x < d) {
        const float g = round_t(sums[threadIdx.x]);
        const float u = round_t(sums[PAIRS + threadIdx.x]);
        out[j0 + threadIdx.x] = from_f32(silu_mul(g, u));
    }
}
