// Shared definitions of every kernel: the activation dtype, its conversions, reductions.
//
// The sources are compiled by NVRTC without any CUDA header (so a machine with only the
// driver and libnvrtc runs them): 16-bit floats are stored as `unsigned short` and
// converted with single PTX instructions. The dtype is chosen at compile time with
// -DVLLM_DTYPE_BF16 (default), -DVLLM_DTYPE_F16 or -DVLLM_DTYPE_F32; one module is
// built per dtype, so every kernel name exists once per module.

typedef unsigned short u16;

#define NEG_INF __int_as_float(0xff800000)

#if defined(VLLM_DTYPE_F32)
typedef float scalar_t;
__device__ __forceinline__ float to_f32(scalar_t x) { return x; }
__device__ __forceinline__ scalar_t from_f32(float x) { return x; }
#elif defined(VLLM_DTYPE_F16)
typedef u16 scalar_t;
__device__ __forceinline__ float to_f32(scalar_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ scalar_t from_f32(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
typedef u16 scalar_t;
__device__ __forceinline__ float to_f32(scalar_t x) {
    return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ scalar_t from_f32(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#endif

// Programmatic dependent launch (kernels/src/cuda/launch.rs). Every kernel calls
// pdl_enter() before it reads what an earlier kernel wrote or writes anything: it waits
// until the kernel before it on the stream has completed with its writes visible (at once
// when the launch did not ask for PDL), then lets the next kernel be scheduled, whose
// blocks wait in their own pdl_enter(). Since each kernel waits for its predecessor
// before completing, a kernel also sees the writes of every kernel before that one.
//
// What no kernel writes may be read before it: the step's inputs (positions, slot
// mapping, sequence lengths, block tables: copied from the host before the step's first
// kernel) and the weights. The small kernels of a batch-1 step read those first, so the
// chains of dependent loads they start (a sequence's length, then its block table)
// overlap the kernel before them instead of following it.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// *p = max(*p, v), no value returned (a `red`: the thread does not wait for it).
__device__ __forceinline__ void red_max_u64(unsigned long long* p, unsigned long long v) {
    asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// atomicAdd whose write releases this thread's earlier memory operations and whose read
// acquires those released to it: a count between blocks without separate fences.
__device__ __forceinline__ unsigned int atom_add_acq_rel(unsigned int* p, unsigned int v) {
    unsigned int old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(p), "r"(v)
                 : "memory");
    return old;
}

// A 16-byte chunk read once (a gemv's weights, greedy sampling's logits): not kept in L1,
// which keeps what is read again (a gemv's x). Read-only for the kernel's whole run.
__device__ __forceinline__ uint4 load_streamed(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Brings the 128-byte line holding p into L2 (a hint: no value, no fault). Pays in a
// kernel of a few rows (a batch-1 step's chain of short kernels; with hundreds of blocks
// prefetching the same lines it made them slower), and for lines a block reads first,
// asked for before its PDL wait (the decode kernel's first keys).
#define PREFETCH_MAX_ROWS 8
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Rounds through the activation dtype: where PyTorch (HF and vLLM) materialises an
// intermediate in bf16, we round the same value the same way.
__device__ __forceinline__ float round_t(float x) { return to_f32(from_f32(x)); }

// silu(g) * u as PyTorch's `act(gate) * up` computes it in the dtype: silu rounded to the
// dtype before the multiply (the product is rounded where the caller stores it). The
// activation and every GEMM epilogue that fuses it (gemv, thin_gemm) share it, so that
// the fused kernels stay bit for bit silu_and_mul.
__device__ __forceinline__ float silu_mul(float g, float u) {
    return round_t(g / (1.f + expf(-g))) * u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. Safe to call repeatedly.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int num_warps = blockDim.x >> 5;
    v = (lane < num_warps) ? partial[lane] : 0.f;
    return warp_sum(v);
}

// Max over the whole block, with the same contract as `block_sum`.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int num_warps = blockDim.x >> 5;
    v = (lane < num_warps) ? partial[lane] : NEG_INF;
    return warp_max(v);
}

// Four consecutive elements as f32 (the address is 4-element aligned).
__device__ __forceinline__ void load4(const scalar_t* p, float* out) {
#if defined(VLLM_DTYPE_F32)
    float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
#else
    uint2 v = *reinterpret_cast<const uint2*>(p);
    out[0] = to_f32((u16)(v.x & 0xffffu));
    out[1] = to_f32((u16)(v.x >> 16));
    out[2] = to_f32((u16)(v.y & 0xffffu));
    out[3] = to_f32((u16)(v.y >> 16));
#endif
}

#if !defined(VLLM_DTYPE_F32)
// Two values rounded to the 16-bit dtype, packed in one word (lo in the low half).
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    return (unsigned int)from_f32(lo) | ((unsigned int)from_f32(hi) << 16);
}
#endif

// Four consecutive elements from f32, rounded to the dtype (the address is 4-element
// aligned).
__device__ __forceinline__ void store4(scalar_t* p, const float* v) {
#if defined(VLLM_DTYPE_F32)
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
#else
    *reinterpret_cast<uint2*>(p) = make_uint2(pack2(v[0], v[1]), pack2(v[2], v[3]));
#endif
}

// V (1 or 4) consecutive elements as f32, and back.
template <int V>
__device__ __forceinline__ void load_v(const scalar_t* p, float* out) {
    if (V == 4) {
        load4(p, out);
    } else {
        out[0] = to_f32(*p);
    }
}
template <int V>
__device__ __forceinline__ void store_v(scalar_t* p, const float* v) {
    if (V == 4) {
        store4(p, v);
    } else {
        *p = from_f32(v[0]);
    }
}

// Elements of one 16-byte load.
constexpr int VEC16 = 16 / (int)sizeof(scalar_t);

// The VEC16 elements of a 16-byte chunk as f32.
__device__ __forceinline__ void unpack16(const uint4& v, float* f) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#if defined(VLLM_DTYPE_F32)
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = __uint_as_float(w[i]);
#else
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = to_f32((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = to_f32((u16)(w[i] >> 16));
    }
#endif
}

// The converse of unpack16: VEC16 values rounded to the dtype, as one 16-byte chunk.
__device__ __forceinline__ uint4 pack16(const float* f) {
    unsigned int w[4];
#if defined(VLLM_DTYPE_F32)
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = __float_as_uint(f[i]);
#else
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = pack2(f[2 * i], f[2 * i + 1]);
#endif
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Whether every pointer starts on a 16-byte boundary (the vectorised paths' contract).
__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
    return ((((unsigned long long)a) | ((unsigned long long)b) | ((unsigned long long)c)) & 15ull) == 0;
}
__device__ __forceinline__ bool aligned16(const void* a) { return aligned16(a, a, a); }

// The `extern "C"` entry points of a kernel templated on the head size: NAME_d16, _d32,
// _d64 and _d128 (the sizes `attention_plan.rs` lists in HEAD_DIMS).
#define HEAD_DIM_KERNEL(NAME, IMPL, THREADS, ARGS, D)                   \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME##_d##D(ARGS a) { \
        pdl_enter();                                                    \
        IMPL<D>(a);                                                     \
    }
#define HEAD_DIM_KERNELS(NAME, IMPL, THREADS, ARGS) \
    HEAD_DIM_KERNEL(NAME, IMPL, THREADS, ARGS, 16)  \
    HEAD_DIM_KERNEL(NAME, IMPL, THREADS, ARGS, 32)  \
    HEAD_DIM_KERNEL(NAME, IMPL, THREADS, ARGS, 64)  \
    HEAD_DIM_KERNEL(NAME, IMPL, THREADS, ARGS, 128)
