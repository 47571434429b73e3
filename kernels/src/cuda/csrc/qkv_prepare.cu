// qkv_prepare: everything between the fused qkv projection and attention, in one launch:
// split the row into q, k and v heads, RMSNorm q and k per head (Qwen3's q_norm and
// k_norm, when given), neox rotary on q and k, and k and v into the paged cache at the
// token's slot (negative slots are padding: nothing is written). q goes to its own
// [T, Hq * D] tensor for attention.
//
// It replaces seven launches per layer (three split_cols, two rms_norm_per_head, rotary,
// reshape_and_cache) that each moved a few kilobytes at batch 1. The arithmetic and its
// roundings are those of the separate kernels, so the result is bit-identical to them:
// the norm's output is rounded to the dtype before the rotary reads it, and each rotary
// product is rounded before the sum (see rotary.cu).
//
// One warp per head, QKV_WARPS heads a block (grid: tokens × head groups), each head
// staged in shared memory so that a lane can read the other half of its rotary pair. A
// head is a chain of dependent loads (row, norm, cos/sin): with one block walking a
// token's 32 heads four at a time the kernel took 12 µs at batch 1 on an H100.
// `qkv_prepare_wide`, below, does the same with 16-byte lanes where a head is whole chunks.
//
// With `input` given, the projection read the raw residual (a deferred input norm,
// norm.cu): every value of the row is first scaled by the 1 / RMS of the token's `input`
// row. The projection's bias (Qwen2), when given, is added here, after that scale, and
// the sum rounded to the dtype once, as a GEMM with a bias epilogue rounds its output
// (without a deferred norm: the bits of a separate bias add on the rounded product).

#define QKV_WARPS 4
#define QKV_MAX_HEAD_DIM 256

struct QkvArgs {
    const scalar_t* qkv;       // [T, (Hq + 2 Hkv) * D]
    const scalar_t* q_norm;    // [D], or null
    const scalar_t* k_norm;    // [D], or null
    const int* positions;      // [T]
    const scalar_t* cos_sin;   // [max_position, rotary_dim]
    const int* slot_mapping;   // [T]
    scalar_t* q_out;           // [T, Hq * D]
    scalar_t* key_cache;       // [num_slots, Hkv * D]
    scalar_t* value_cache;
    const scalar_t* input;     // [T, hidden]: the projection's input, or null
    const scalar_t* bias;      // [(Hq + 2 Hkv) * D], or null
    int num_q_heads;
    int num_kv_heads;
    int head_dim;
    int rotary_dim;
    int hidden;                // of `input`
    float eps;
    float input_eps;           // of the deferred input norm
};

// One head of token t, its lane's V consecutive elements at a time (V = 1 or 4; with 4,
// d and the rotary halves are multiples of 4, so a group never straddles a boundary).
// Element i of a head's projection: scaled (a deferred norm) plus its bias. Without a bias
// it adds -0, which leaves every value as it is (+0 would turn -0 into +0).
__device__ __forceinline__ float qkv_value(float v, float scale, const scalar_t* bias, int i) {
    return v * scale + (bias != nullptr ? to_f32(bias[i]) : -0.f);
}

template <int V>
__device__ __forceinline__ void qkv_prepare_head(const QkvArgs& a, long long t, int head, int slot,
                                                 const scalar_t* src, const scalar_t* w,
                                                 const scalar_t* cs, float scale, float* h) {
    // This head's bias, or null.
    const scalar_t* b = a.bias != nullptr ? a.bias + (long long)head * a.head_dim : nullptr;
    const int lane = threadIdx.x & 31;
    const int hq = a.num_q_heads, hkv = a.num_kv_heads, d = a.head_dim;
    const long long kv_row = (long long)hkv * d;
    const int half = a.rotary_dim / 2;
    const bool is_q = head < hq;
    if (head >= hq + hkv) {  // a v head: copied to the cache as it is
        if (slot >= 0) {
            scalar_t* dst = a.value_cache + slot * kv_row + (long long)(head - hq - hkv) * d;
            for (int i = lane * V; i < d; i += 32 * V) {
                float v[V];
                load_v<V>(src + i, v);
#pragma unroll
                for (int e = 0; e < V; e++) v[e] = qkv_value(v[e], scale, b, i + e);
                store_v<V>(dst + i, v);
            }
        }
        return;
    }
    if (!is_q && slot < 0) return;  // the k of a padding token goes nowhere
    float ss = 0.f;
    for (int i = lane * V; i < d; i += 32 * V) {
        float v[V];
        load_v<V>(src + i, v);
#pragma unroll
        for (int e = 0; e < V; e++) {
            const float x = round_t(qkv_value(v[e], scale, b, i + e));
            h[i + e] = x;
            ss += x * x;
        }
    }
    if (w != nullptr) {
        ss = warp_sum(ss);
        const float inv = 1.f / sqrtf(ss / (float)d + a.eps);
        for (int i = lane * V; i < d; i += 32 * V) {
            float wv[V];
            load_v<V>(w + i, wv);
#pragma unroll
            for (int e = 0; e < V; e++) h[i + e] = round_t(round_t(h[i + e] * inv) * wv[e]);
        }
    }
    __syncwarp();
    scalar_t* dst = is_q ? a.q_out + (t * hq + head) * d
                         : a.key_cache + slot * kv_row + (long long)(head - hq) * d;
    for (int i = lane * V; i < d; i += 32 * V) {
        float o[V];
#pragma unroll
        for (int e = 0; e < V; e++) o[e] = h[i + e];
        if (i < a.rotary_dim) {
            // The pair's cos/sin: this half's index j, and the element of the other half.
            const bool first = i < half;
            const int j = first ? i : i - half;
            float c[V], s[V];
            load_v<V>(cs + j, c);
            load_v<V>(cs + half + j, s);
#pragma unroll
            for (int e = 0; e < V; e++) {
                o[e] = first ? round_t(h[i + e] * c[e]) + round_t(-h[i + e + half] * s[e])
                             : round_t(h[i + e] * c[e]) + round_t(h[j + e] * s[e]);
            }
        }
        store_v<V>(dst + i, o);
    }
}

// A head's constants into L2 before the wait, a lane of the head (`lane`) a 128-byte line:
// its norm weights, then its cos/sin row. Only for a few tokens, where the kernel is one
// chain of loads: at 256 tokens the prefetches took it from 6.6 to 20.5 µs (H100,
// docs/BENCHMARKS.md).
__device__ __forceinline__ void prefetch_head_constants(const scalar_t* w, const scalar_t* cs,
                                                        int d, int rotary_dim, int lane) {
    const int line = 128 / (int)sizeof(scalar_t);
    const int w_lines = w != nullptr ? (d + line - 1) / line : 0;
    const int cs_lines = (rotary_dim + line - 1) / line;
    if (gridDim.x <= PREFETCH_MAX_ROWS) {
        if (lane < w_lines) {
            prefetch_l2(w + lane * line);
        } else if (lane < w_lines + cs_lines) {
            prefetch_l2(cs + (lane - w_lines) * line);
        }
    }
}

// The token's 1 / RMS of the deferred input norm, 1 without one; in every thread of the
// block, before the wait (the input is the residual, two kernels back).
__device__ __forceinline__ float qkv_input_scale(const QkvArgs& a, long long t) {
    return a.input != nullptr ? row_inv_rms(a.input + t * a.hidden, a.hidden, a.input_eps) : 1.f;
}

extern "C" __global__ void __launch_bounds__(QKV_WARPS * 32) qkv_prepare(QkvArgs a) {
    __shared__ float staged[QKV_WARPS][QKV_MAX_HEAD_DIM];
    const long long t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hq = a.num_q_heads, hkv = a.num_kv_heads, d = a.head_dim;
    const int heads = hq + 2 * hkv;
    const int head = blockIdx.y * QKV_WARPS + warp;
    const float scale = qkv_input_scale(a, t);
    if (head >= heads) return;
    // The step's inputs and the weights, read (or brought into L2) before the wait
    // (common.cuh): the position, then the cos/sin row it picks.
    const int slot = a.slot_mapping[t];
    const scalar_t* row = a.qkv + t * heads * d;
    const scalar_t* cs = a.cos_sin + (long long)a.positions[t] * a.rotary_dim;
    float* h = staged[warp];
    const scalar_t* src = row + (long long)head * d;
    const scalar_t* w = head < hq ? a.q_norm : a.k_norm;
    prefetch_head_constants(w, cs, d, a.rotary_dim, lane);
    pdl_enter();
    // Lanes take 4 consecutive elements (one 8-byte access in bf16) where a head and the
    // rotary halves are whole groups of 4, else one.
    if (d % 4 == 0 && a.rotary_dim % 8 == 0) {
        qkv_prepare_head<4>(a, t, head, slot, src, w, cs, scale, h);
    } else {
        qkv_prepare_head<1>(a, t, head, slot, src, w, cs, scale, h);
    }
}

// The same work with 16-byte lanes: a head's d / VEC16 lanes (a power of two, at most a
// warp) each take VEC16 consecutive elements, so a warp prepares 32 / that heads (Qwen3's
// and Llama's heads of 128 in bf16: 16 lanes, two heads). The host picks it where every
// chunk is whole and aligned, and sizes the block: a few heads, or at decode batches
// where it pays a token's heads (ops.rs, `QKV_TOKEN_BLOCK_STEPS`); a multiple of 32
// threads, at most 1,024 (`QKV_MAX_THREADS`), staging in dynamic shared memory VEC16
// floats a thread. The products and roundings are qkv_prepare's; only the norm's sum of
// squares adds in another order. Two entry points: bounded at 1,024 threads, ptxas gives
// the kernel 46 registers where 128 threads leave it 40 (12 blocks an SM, not 10).
__device__ __forceinline__ void qkv_prepare_wide_impl(const QkvArgs& a) {
    extern __shared__ float qkv_staged[];
    const int hq = a.num_q_heads, hkv = a.num_kv_heads, d = a.head_dim;
    const int lanes = d / VEC16;
    const int local = threadIdx.x / lanes, hl = threadIdx.x % lanes;
    const int head = blockIdx.y * (blockDim.x / lanes) + local;
    const int lane = threadIdx.x & 31;
    const unsigned int mask =
        lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << (lane & ~(lanes - 1));
    const long long t = blockIdx.x;
    // The step's inputs and the weights before the wait (common.cuh), as qkv_prepare.
    const int slot = a.slot_mapping[t];
    const scalar_t* cs = a.cos_sin + (long long)a.positions[t] * a.rotary_dim;
    const scalar_t* w = head < hq ? a.q_norm : a.k_norm;
    prefetch_head_constants(w, cs, d, a.rotary_dim, hl);
    const float scale = qkv_input_scale(a, t);
    const int i = hl * VEC16;
    // This lane's chunk of the head's bias, a weight: loaded before the wait (-0 without
    // one, as in qkv_value).
    float bias[VEC16];
    const bool biased = a.bias != nullptr && head < hq + 2 * hkv;
    if (biased) {
        unpack16(*reinterpret_cast<const uint4*>(a.bias + (long long)head * d + i), bias);
    } else {
#pragma unroll
        for (int e = 0; e < VEC16; e++) bias[e] = -0.f;
    }
    pdl_enter();
    if (head >= hq + 2 * hkv) return;  // whole head groups leave together
    const scalar_t* src = a.qkv + (t * (hq + 2 * hkv) + head) * d + i;
    const long long kv_row = (long long)hkv * d;
    if (head >= hq + hkv) {  // a v head: copied to the cache as it is
        if (slot >= 0) {
            scalar_t* dst = a.value_cache + slot * kv_row + (long long)(head - hq - hkv) * d + i;
            uint4 v = *reinterpret_cast<const uint4*>(src);
            if (a.input != nullptr || biased) {
                float x[VEC16];
                unpack16(v, x);
#pragma unroll
                for (int e = 0; e < VEC16; e++) x[e] = x[e] * scale + bias[e];
                v = pack16(x);
            }
            *reinterpret_cast<uint4*>(dst) = v;
        }
        return;
    }
    const bool is_q = head < hq;
    if (!is_q && slot < 0) return;  // the k of a padding token goes nowhere
    float x[VEC16];
    unpack16(*reinterpret_cast<const uint4*>(src), x);
#pragma unroll
    for (int e = 0; e < VEC16; e++) x[e] = round_t(x[e] * scale + bias[e]);
    if (w != nullptr) {
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < VEC16; e++) ss += x[e] * x[e];
        for (int o = lanes / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(mask, ss, o);
        const float inv = 1.f / sqrtf(ss / (float)d + a.eps);
        float wv[VEC16];
        unpack16(*reinterpret_cast<const uint4*>(w + i), wv);
#pragma unroll
        for (int e = 0; e < VEC16; e++) x[e] = round_t(round_t(x[e] * inv) * wv[e]);
    }
    // The head staged so that a lane can read the other half of its rotary pairs.
    float* h = qkv_staged + local * d;
#pragma unroll
    for (int e = 0; e < VEC16; e++) h[i + e] = x[e];
    __syncwarp(mask);
    if (i < a.rotary_dim) {
        const int half = a.rotary_dim / 2;
        const bool first = i < half;
        const int j = first ? i : i - half;
        float c[VEC16], s[VEC16];
        unpack16(*reinterpret_cast<const uint4*>(cs + j), c);
        unpack16(*reinterpret_cast<const uint4*>(cs + half + j), s);
#pragma unroll
        for (int e = 0; e < VEC16; e++) {
            x[e] = first ? round_t(x[e] * c[e]) + round_t(-h[i + e + half] * s[e])
                         : round_t(x[e] * c[e]) + round_t(h[j + e] * s[e]);
        }
    }
    scalar_t* dst = is_q ? a.q_out + (t * hq + head) * d
                         : a.key_cache + slot * kv_row + (long long)(head - hq) * d;
    *reinterpret_cast<uint4*>(dst + i) = pack16(x);
}

// A few heads a block (`QKV_THREADS`), and a token's heads a block (`QKV_TOKEN_BLOCK_STEPS`).
extern "C" __global__ void __launch_bounds__(QKV_WARPS * 32) qkv_prepare_wide(QkvArgs a) {
    qkv_prepare_wide_impl(a);
}
extern "C" __global__ void __launch_bounds__(1024) qkv_prepare_wide_token(QkvArgs a) {
    qkv_prepare_wide_impl(a);
}
