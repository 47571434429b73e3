// RMSNorm: plain, fused with the residual add, and per attention head (Qwen3 q/k norm).
// Sums of squares in f32; the normalised value is rounded to the dtype before the
// weight multiply, as HF's `weight * hidden.to(dtype)` and vLLM's kernels do.

// A row of one 16-byte chunk per thread: the launch gives a row hidden / VEC16 threads
// (norm_threads in ops.rs) when hidden is whole chunks, and the values stay in registers
// between the sum of squares and the scaling. Otherwise a strided loop.
__device__ __forceinline__ bool norm_vectorised(int hidden, const void* a, const void* b,
                                                const void* c) {
    return hidden % VEC16 == 0 && hidden <= (int)blockDim.x * VEC16 && aligned16(a, b, c);
}

// This thread's 16-byte chunk of the weight, for the vectorised path's end, which the
// caller loads early: this file's kernels before their wait (weights are no kernel's
// output, common.cuh). Read after the row's sum, it was one more round trip between the
// sum and the store (docs/BENCHMARKS.md, 2026-11-26).
__device__ __forceinline__ uint4 norm_weight_chunk(const scalar_t* weight, bool mine) {
    return mine ? reinterpret_cast<const uint4*>(weight)[threadIdx.x] : make_uint4(0u, 0u, 0u, 0u);
}

// The vectorised path's end, in every thread of the block: the row's sum of squares from
// each thread's part `ss`, then this thread's chunk `v` (when it has one) scaled by the
// inverse RMS, rounded, times its weight chunk (`norm_weight_chunk`), into `dst`.
__device__ __forceinline__ void norm_chunk_out(float (&v)[VEC16], float ss, bool mine, int hidden,
                                               float eps, uint4 w_chunk, scalar_t* dst) {
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
    if (!mine) return;
    float w[VEC16];
    unpack16(w_chunk, w);
#pragma unroll
    for (int j = 0; j < VEC16; j++) v[j] = round_t(v[j] * inv) * w[j];
    reinterpret_cast<uint4*>(dst)[threadIdx.x] = pack16(v);
}

extern "C" __global__ void rms_norm(const scalar_t* __restrict__ x,
                                    const scalar_t* __restrict__ weight,
                                    scalar_t* __restrict__ out, int hidden, float eps) {
    const bool vectorised = norm_vectorised(hidden, x, weight, out);
    const int c = threadIdx.x;
    const bool mine = c * VEC16 < hidden;
    const uint4 w_chunk = norm_weight_chunk(weight, vectorised && mine);
    pdl_enter();
    const scalar_t* xr = x + (long long)blockIdx.x * hidden;
    scalar_t* dst = out + (long long)blockIdx.x * hidden;
    if (vectorised) {
        float v[VEC16], ss = 0.f;
        if (mine) {
            unpack16(reinterpret_cast<const uint4*>(xr)[c], v);
#pragma unroll
            for (int j = 0; j < VEC16; j++) ss += v[j] * v[j];
        }
        norm_chunk_out(v, ss, mine, hidden, eps, w_chunk, dst);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = from_f32(round_t(to_f32(xr[i]) * inv) * to_f32(weight[i]));
    }
}

// residual += x (rounded to the dtype, as a bf16 add is); x = rms_norm(residual).
extern "C" __global__ void fused_add_rms_norm(scalar_t* __restrict__ x,
                                              scalar_t* __restrict__ residual,
                                              const scalar_t* __restrict__ weight, int hidden,
                                              float eps) {
    const bool vectorised = norm_vectorised(hidden, x, residual, weight);
    const int c = threadIdx.x;
    const bool mine = c * VEC16 < hidden;
    const uint4 w_chunk = norm_weight_chunk(weight, vectorised && mine);
    // Otherwise the weights into L2 before the wait, a 128-byte line a thread, for a few
    // rows only (as in qkv_prepare.cu).
    const int line = 128 / (int)sizeof(scalar_t);
    if (!vectorised && gridDim.x <= PREFETCH_MAX_ROWS && c < (hidden + line - 1) / line)
        prefetch_l2(weight + c * line);
    pdl_enter();
    scalar_t* xr = x + (long long)blockIdx.x * hidden;
    scalar_t* rr = residual + (long long)blockIdx.x * hidden;
    if (vectorised) {
        float z[VEC16], ss = 0.f;
        if (mine) {
            float r[VEC16];
            unpack16(reinterpret_cast<const uint4*>(xr)[c], z);
            unpack16(reinterpret_cast<const uint4*>(rr)[c], r);
#pragma unroll
            for (int j = 0; j < VEC16; j++) {
                z[j] = round_t(z[j] + r[j]);
                ss += z[j] * z[j];
            }
            reinterpret_cast<uint4*>(rr)[c] = pack16(z);
        }
        norm_chunk_out(z, ss, mine, hidden, eps, w_chunk, xr);
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const scalar_t z = from_f32(to_f32(xr[i]) + to_f32(rr[i]));
        rr[i] = z;
        const float v = to_f32(z);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        xr[i] = from_f32(round_t(to_f32(rr[i]) * inv) * to_f32(weight[i]));
    }
}

// In place over `num_heads_total` heads of `head_dim` (rows × heads flattened); one warp
// per head.
extern "C" __global__ void rms_norm_per_head(scalar_t* __restrict__ x,
                                             const scalar_t* __restrict__ weight,
                                             int num_heads_total, int head_dim, float eps) {
    pdl_enter();
    const int warps = blockDim.x >> 5;
    const long long head = (long long)blockIdx.x * warps + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (head >= num_heads_total) return;
    scalar_t* h = x + head * head_dim;
    float ss = 0.f;
    for (int i = lane; i < head_dim; i += 32) {
        const float v = to_f32(h[i]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) {
        h[i] = from_f32(round_t(to_f32(h[i]) * inv) * to_f32(weight[i]));
    }
}

// A deferred RMSNorm (llama.rs, `forward_deferred`): the norm's weight is folded into the
// columns of the projection after it (scale_cols, at load), the projection reads the raw
// residual, and the kernel after the projection scales each row by the residual row's
// 1 / RMS (row_inv_rms). The same product as norm-then-project, rounded elsewhere; the
// norm's own launch, a kernel boundary between two cuBLAS GEMMs, is gone.

// 1 / RMS of `row` (`hidden` elements, eps inside the root), in every thread of the block
// (all must call it). It reads only the row, so a kernel may call it before its wait
// where the row was written two kernels back: the kernel between waited for that one
// before it let this one start (common.cuh).
__device__ float row_inv_rms(const scalar_t* row, int hidden, float eps) {
    float ss = 0.f;
    if (hidden % VEC16 == 0 && aligned16(row)) {
        for (int c = threadIdx.x; c < hidden / VEC16; c += blockDim.x) {
            float v[VEC16];
            unpack16(reinterpret_cast<const uint4*>(row)[c], v);
#pragma unroll
            for (int j = 0; j < VEC16; j++) ss += v[j] * v[j];
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            const float v = to_f32(row[i]);
            ss += v * v;
        }
    }
    ss = block_sum(ss);
    return 1.f / sqrtf(ss / (float)hidden + eps);
}

// w[r, c] *= g[c] over a [rows, cols] weight, rounded once to the dtype: a norm's weight
// folded into the columns of the projection after it (at load, not on the hot path).
extern "C" __global__ void scale_cols(scalar_t* __restrict__ w, const scalar_t* __restrict__ g,
                                      long long rows, int cols) {
    pdl_enter();
    const long long n = rows * cols;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        w[i] = from_f32(to_f32(w[i]) * to_f32(g[i % cols]));
    }
}
