// GEMMs of decode batches on Hopper's warpgroup tensor cores (bf16 and fp16 builds, sm_90a):
// out[m, n] = x[m, k] · w[n, k]ᵀ for the 2 to 32 rows of a decode step (gemv takes one).
// There the product is a stream of the weights, and cuBLAS's kernels take part in no
// programmatic dependent launch: each starts its weight stream only once the kernel before
// it has drained.
//
// A block (one warpgroup) computes a BM × TG_BN tile of out over one split of k,
// "swapped": 64 rows of w are wgmma's A, x's BM rows its B, so one `wgmma.m64nBMk16` a
// k-step covers the whole batch. A TG_STAGES-deep cp.async pipeline fills the stages in
// the 128-byte swizzle the descriptors name; the first weight stages are issued before the
// PDL wait (weights are no kernel's output). The splits of a tile are one thread-block
// cluster (grid x): each block leaves its f32 partial tile in its shared memory, and after
// a cluster barrier block s sums rows s, s + splits, ... over every block's partial, in
// split order (distributed shared memory), and writes them. No partial goes to global
// memory, and the bits do not depend on timing.
//
// `thin_gemm_silu_m*` takes the fused gate/up weight [2d, k]: a block's A rows are 32 gate
// rows j0..j0+32 and their up rows d+j0.., and it writes silu(gate) * up [m, d], bit for
// bit thin_gemm followed by silu_and_mul (activation.cu), without the [m, 2d] round trip.
//
// Contract (checked by the host, thin_gemm.rs): k is a multiple of 8 (whole 16-byte
// chunks; a partial last k-tile is zero-filled), n is even, x, w and out start 16-byte
// aligned, the grid is (splits, n-tiles) blocks of TG_THREADS in clusters of (splits, 1),
// splits <= TG_MAX_SPLITS.

#if !defined(VLLM_DTYPE_F32)

#define TG_BN 64   // rows of w a block: wgmma's M
#define TG_BK 64   // k of a stage: a staged row is 128 bytes, one swizzle row
#define TG_STAGES 6
#define TG_THREADS 128
#define TG_MAX_SPLITS 8  // a cluster's most blocks (the portable limit)
#define TG_SC_LD (TG_BN + 4)  // f32 per row of the partial tile in shared memory

struct ThinGemmArgs {
    const scalar_t* x;  // [m, k]
    const scalar_t* w;  // [n, k]
    scalar_t* out;      // [m, n], or [m, n / 2] for the SiLU variant
    int m;
    int k;
    int n;
    int k_tiles_per_split;
};

// The row of w that row r of n-tile `tile` stages, and whether it exists. A SiLU tile's
// first half is gate rows, its second half the same rows of up (w's second half).
template <bool SILU>
__device__ __forceinline__ int tg_w_row(int tile, int r, int n) {
    if (!SILU) return tile * TG_BN + r;
    constexpr int H = TG_BN / 2;
    return (r < H ? 0 : n / 2) + tile * H + (r % H);
}

template <bool SILU>
__device__ __forceinline__ bool tg_w_row_valid(int tile, int r, int n) {
    if (!SILU) return tile * TG_BN + r < n;
    constexpr int H = TG_BN / 2;
    return tile * H + (r % H) < n / 2;
}

// Byte offset of 16-byte chunk c of staged row r in the 128-byte swizzle (a stage's tiles
// start 1024-byte aligned): the chunk moves to c ^ (r % 8), as wgmma's descriptors expect.
__device__ __forceinline__ int tg_swizzled(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Enqueues k-tile `kt` of w's tile rows into a pipeline stage.
template <bool SILU>
__device__ __forceinline__ void tg_load_w(const ThinGemmArgs& a, char* sw, int tile, int kt) {
    constexpr int CHUNKS = TG_BK / 8;  // 16-byte chunks of a staged row
#pragma unroll
    for (int i = 0; i < TG_BN * CHUNKS / TG_THREADS; ++i) {
        const int c = threadIdx.x + i * TG_THREADS, r = c / CHUNKS;
        const int col = kt * TG_BK + (c % CHUNKS) * 8;
        const bool ok = tg_w_row_valid<SILU>(tile, r, a.n) && col < a.k;
        const long long off = ok ? (long long)tg_w_row<SILU>(tile, r, a.n) * a.k + col : 0;
        cp_async16(sw + tg_swizzled(r, c % CHUNKS), a.w + off, ok ? 16 : 0);
    }
}

// The same for k-tile `kt` of x's BM rows (rows past m are zeros).
template <int BM>
__device__ __forceinline__ void tg_load_x(const ThinGemmArgs& a, char* sx, int kt) {
    constexpr int CHUNKS = TG_BK / 8;
#pragma unroll
    for (int i = 0; i < (BM * CHUNKS + TG_THREADS - 1) / TG_THREADS; ++i) {
        const int c = threadIdx.x + i * TG_THREADS, r = c / CHUNKS;
        if (c >= BM * CHUNKS) break;
        const int col = kt * TG_BK + (c % CHUNKS) * 8;
        const bool ok = r < a.m && col < a.k;
        const long long off = ok ? (long long)r * a.k + col : 0;
        cp_async16(sx + tg_swizzled(r, c % CHUNKS), a.x + off, ok ? 16 : 0);
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void tg_cluster_sync() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n\t"
        "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The two floats at `p` (this block's shared memory, 8-byte aligned) in the cluster's
// block `rank`. No memory clobber: the cluster barriers order these loads, and without
// one a block's loads of every split are in flight together.
__device__ __forceinline__ float2 tg_peer_load2(const float* p, unsigned int rank) {
    unsigned int remote;
    float2 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(remote));
    return v;
}

// Sum over the cluster's partial tiles of elements (r, c) and (r, c + 1), in split order,
// rounded to the dtype; unsplit, the tile's own (already rounded) values.
__device__ __forceinline__ float2 tg_tile_sum2(const float* sc, int r, int c, int splits) {
    const float* p = sc + r * TG_SC_LD + c;
    if (splits == 1) return *reinterpret_cast<const float2*>(p);
    float2 v[TG_MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < TG_MAX_SPLITS; ++s)
        if (s < splits) v[s] = tg_peer_load2(p, s);
    float2 sum = v[0];
#pragma unroll
    for (int s = 1; s < TG_MAX_SPLITS; ++s) {
        if (s < splits) {
            sum.x += v[s].x;
            sum.y += v[s].y;
        }
    }
    return make_float2(round_t(sum.x), round_t(sum.y));
}

// Block `rank` of the cluster writes rows rank, rank + splits, ... of the finished tile:
// out's columns, or silu(gate) * up of its two halves. A thread takes a pair of columns
// (of each half, with SiLU).
template <int BM, bool SILU>
__device__ __forceinline__ void tg_write_rows(const ThinGemmArgs& a, const float* sc, int tile,
                                              int rank, int splits) {
    constexpr int PAIRS = SILU ? TG_BN / 4 : TG_BN / 2;  // a row's column pairs
    const int rows = (BM - rank + splits - 1) / splits;
    for (int i = threadIdx.x; i < rows * PAIRS; i += TG_THREADS) {
        const int r = rank + (i / PAIRS) * splits, c = (i % PAIRS) * 2;
        if (r >= a.m) break;  // later items have later rows
        if (!SILU) {
            const int col = tile * TG_BN + c;
            if (col >= a.n) continue;
            const float2 v = tg_tile_sum2(sc, r, c, splits);
            *reinterpret_cast<unsigned int*>(a.out + (long long)r * a.n + col) =
                (unsigned int)from_f32(v.x) | ((unsigned int)from_f32(v.y) << 16);
        } else {
            constexpr int H = TG_BN / 2;
            const int d = a.n / 2, col = tile * H + c;
            if (col >= d) continue;
            const float2 g = tg_tile_sum2(sc, r, c, splits), u = tg_tile_sum2(sc, r, H + c, splits);
            a.out[(long long)r * d + col] = from_f32(silu_mul(g.x, u.x));
            if (col + 1 < d) a.out[(long long)r * d + col + 1] = from_f32(silu_mul(g.y, u.y));
        }
    }
}

template <int BM, bool SILU>
__device__ void thin_gemm_impl(const ThinGemmArgs& a) {
    constexpr int W_BYTES = TG_BN * TG_BK * 2, STAGE = W_BYTES + BM * TG_BK * 2;
    extern __shared__ __align__(16) unsigned char tg_raw[];
    // The swizzle is of address bits: stages start 1024-byte aligned (the host adds 1 KB).
    char* smem = reinterpret_cast<char*>(tg_raw) + ((1024 - (smem_addr(tg_raw) & 1023)) & 1023);

    const int split = blockIdx.x, splits = gridDim.x, tile = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k_tiles = (a.k + TG_BK - 1) / TG_BK;
    const int kt0 = split * a.k_tiles_per_split;
    const int nkt = max(0, min(a.k_tiles_per_split, k_tiles - kt0));

    float acc[BM / 2];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[i] = 0.f;

    // The weights' first stages load before the PDL wait (common.cuh), x's after it. One
    // commit group per stage, empty ones included, so that group t holds k-tile t (group 0
    // also the other early weight stages).
#pragma unroll
    for (int s = 0; s < TG_STAGES - 1; ++s)
        if (s < nkt) tg_load_w<SILU>(a, smem + s * STAGE, tile, kt0 + s);
    pdl_enter();
#pragma unroll
    for (int s = 0; s < TG_STAGES - 1; ++s) {
        if (s < nkt) tg_load_x<BM>(a, smem + s * STAGE + W_BYTES, kt0 + s);
        cp_async_commit();
    }
    for (int t = 0; t < nkt; ++t) {
        cp_async_wait<TG_STAGES - 2>();  // k-tile t has landed (this thread's copies)
        fence_proxy_async_smem();
        __syncthreads();  // everyone's copies of t, and the wgmma of t - 1 is done
        const int next = t + TG_STAGES - 1;
        if (next < nkt) {
            char* st = smem + (next % TG_STAGES) * STAGE;
            tg_load_w<SILU>(a, st, tile, kt0 + next);
            tg_load_x<BM>(a, st + W_BYTES, kt0 + next);
        }
        cp_async_commit();
        const char* sw = smem + (t % TG_STAGES) * STAGE;
        wgmma_pin<BM / 2>(acc);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < TG_BK / 16; ++ks)  // 16 k = 32 bytes into the swizzled rows
            wgmma_k16<BM>(acc, wgmma_desc_sw128(smem_addr(sw + ks * 32), 16),
                          wgmma_desc_sw128(smem_addr(sw + W_BYTES + ks * 32), 16));
        wgmma_commit();
        wgmma_wait_all();
        wgmma_pin<BM / 2>(acc);
    }
    cp_async_wait<0>();  // only empty groups are left, but leave none in flight
    __syncthreads();     // the stages become the partial tile `sc`

    // Accumulator 4j + e of a thread: w row 16 warp + lane / 4 + 8 (e / 2), x row
    // 8j + 2 (lane % 4) + e % 2. Unsplit, it is rounded here.
    float* sc = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
        const int j = i >> 2, e = i & 3;
        const int c = warp * 16 + (lane >> 2) + 8 * (e >> 1);
        const int r = 8 * j + 2 * (lane & 3) + (e & 1);
        sc[r * TG_SC_LD + c] = splits > 1 ? acc[i] : round_t(acc[i]);
    }
    // Every block's partial is in place before any block reads it; and no block leaves
    // (its shared memory) while another may still read it.
    if (splits > 1) tg_cluster_sync(); else __syncthreads();
    tg_write_rows<BM, SILU>(a, sc, tile, split, splits);
    if (splits > 1) tg_cluster_sync();
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// thin_gemm_m{BM} and thin_gemm_silu_m{BM}: BM rows of x (the batch, padded). Built for
// sm_90a only; elsewhere they trap, and the host never launches them (thin_gemm.rs).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TG_BODY(BM, SILU) thin_gemm_impl<BM, SILU>(a)
#else
#define TG_BODY(BM, SILU) __trap()
#endif
#define THIN_GEMM_KERNELS(BM)                                                                   \
    extern "C" __global__ void __launch_bounds__(TG_THREADS) thin_gemm_m##BM(ThinGemmArgs a) {    \
        TG_BODY(BM, false);                                                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(TG_THREADS)                                    \
        thin_gemm_silu_m##BM(ThinGemmArgs a) {                                                  \
        TG_BODY(BM, true);                                                                      \
    }
THIN_GEMM_KERNELS(16)
THIN_GEMM_KERNELS(32)

#endif  // !VLLM_DTYPE_F32
