// Paged attention for prefill on tensor cores (bf16 and fp16 builds): flash-attention 2
// over the sequence's cached prefix blocks plus this step's tokens, read through the
// block table (the semantics of `cpu::attention::paged_attention`: query token j of a
// sequence with `context_len` cached tokens attends to keys 0..=context_len + j).
//
// A block is PF_ROWS query rows = consecutive query tokens of one sequence × the q heads
// of one GQA group (so each K/V tile is loaded once for the whole group); each of the four
// warps owns 16 rows. Key tiles of PF_KEYS rows are staged in shared memory; S = Q·Kᵀ and
// O += P·V are `mma.m16n8k16` with f32 accumulation, the online softmax runs on the S
// fragments in registers, and P is rounded to the 16-bit type for the P·V product (as
// flash-attention does). The softmax runs in base 2 with the scale folded in (p =
// 2^(s·scale·log2 e − m), one FFMA and one MUFU a score), and masks only the tiles that
// reach past a row's last visible key.
//
// On Hopper (sm_90a) the head sizes 64 and 128 run both products as warpgroup MMAs
// (`wgmma`, the block's four warps one warpgroup over its 64 rows): S with Q's fragments
// from registers and K from shared memory, O with P from registers and V from shared
// memory (N-major). K and V tiles then lie in wgmma's 128-byte swizzle (`wg_tile_offset`)
// instead of padded rows, and the block takes every tile (a warp-uniform skip cannot
// stop a warpgroup's MMA; a warp whose rows see none of a tile's keys masks it whole).

#if !defined(VLLM_DTYPE_F32)

#define PF_WARPS 4
#define PF_THREADS (PF_WARPS * 32)
#define PF_ROWS (PF_WARPS * 16)
#define PF_KEYS 64
#define PF_PAD 8  // u16 padding per smem row: rows start on different banks

// Where a thread's keys k, k + step, k + 2·step, ... lie in the block table: block `q`,
// offset `r` in it. Walking by fixed steps divides by the block size once, not per key
// (an integer division is a ~25-instruction sequence).
struct KeyWalk {
    int q, r, step_q, step_r, bs;
    __device__ __forceinline__ KeyWalk(int k, int step, int block_size)
        : q(k / block_size), r(k % block_size), step_q(step / block_size),
          step_r(step % block_size), bs(block_size) {}
    __device__ __forceinline__ void next() {
        q += step_q;
        r += step_r;
        if (r >= bs) {
            r -= bs;
            ++q;
        }
    }
};

struct PrefillArgs {
    const scalar_t* q;          // [T, Hq, D]
    const scalar_t* key_cache;  // [num_blocks, block_size, Hkv, D]
    const scalar_t* value_cache;
    const int* block_tables;    // [num_seqs, max_blocks_per_seq]
    const int* seq_lens;        // [num_seqs]
    const int* query_start_loc; // [num_seqs + 1]
    const int* tile_seq;        // [num_tiles]
    const int* tile_token;      // [num_tiles] first query token of each tile
    scalar_t* out;              // [T, Hq, D]
    const int* step_dims;       // [1]: the block tables' row width (attention_decode.cu)
    int num_q_heads;
    int num_kv_heads;
    int block_size;
    int tokens_per_tile;
    float scale;
};

// S = Q·Kᵀ for the warp's 16 rows × PF_KEYS keys of the tile in `sk`.
template <int D>
__device__ __forceinline__ void tile_scores(const u16* sk, const unsigned int (&qa)[D / 16][4],
                                            int lane, float (&s)[PF_KEYS / 8][4]) {
    constexpr int KS = D / 16;
    constexpr int LD = D + PF_PAD;
    const int gid = lane >> 2, tig = lane & 3;
    // Two k-steps a load: lane l addresses key n*8 + l%8 at dims 8(l/8) onwards.
    const unsigned int kl = smem_addr(sk) + ((lane & 7) * LD + (lane >> 3) * 8) * 2;
#pragma unroll
    for (int n = 0; n < PF_KEYS / 8; ++n) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks + 1 < KS; ks += 2) {
            unsigned int b[4];
            ldmatrix_x4(b, kl + (n * 8 * LD + ks * 16) * 2);
            mma_16816(s[n], qa[ks], b[0], b[1]);
            mma_16816(s[n], qa[ks + 1], b[2], b[3]);
        }
        if (KS % 2 == 1) {  // D = 16: one k-step
            const u16* krow = &sk[(n * 8 + gid) * LD + (KS - 1) * 16 + tig * 2];
            const unsigned int b0 = *reinterpret_cast<const unsigned int*>(krow);
            const unsigned int b1 = *reinterpret_cast<const unsigned int*>(krow + 8);
            mma_16816(s[n], qa[KS - 1], b0, b1);
        }
    }
}

// 2^x on the MUFU alone: `exp2f` and `__expf` add a range check and two multiplies a
// call so that results below 2^-126 come out denormal, which a probability can round to 0.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The online softmax of a tile's raw scores: mask past each row's `limit` where the tile
// reaches it (`masked`, warp-uniform), take the row maxima over the quad in units of
// scale·log2 e, and rescale O by 2^(m_old - m_new) (`alpha`; the row sums are rescaled in
// `accumulate_pv`) when a row's maximum moved.
template <int D>
__device__ __forceinline__ void online_softmax(float (&s)[PF_KEYS / 8][4], int k0, int tig,
                                               const int (&limit)[2], bool masked,
                                               float scale_log2, float (&m)[2],
                                               float (&m_use)[2], float (&alpha)[2],
                                               float (&o)[D / 8][4]) {
    constexpr int NT = D / 8;
    if (masked) {
#pragma unroll
        for (int n = 0; n < PF_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + n * 8 + tig * 2 + (e & 1);
                s[n][e] = key < limit[e >> 1] ? s[n][e] : NEG_INF;
            }
        }
    }
    float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < PF_KEYS / 8; ++n) {
        tile_max[0] = fmaxf(tile_max[0], fmaxf(s[n][0], s[n][1]));
        tile_max[1] = fmaxf(tile_max[1], fmaxf(s[n][2], s[n][3]));
    }
    bool moved = false;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], 1));
        tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], 2));
        // The scale is positive, so the largest raw score is the largest scaled one.
        const float m_new = fmaxf(m[j], tile_max[j] * scale_log2);
        // A row with nothing visible yet keeps m = -inf; use 0 so exp2() gives 0, not NaN.
        m_use[j] = m_new == NEG_INF ? 0.f : m_new;
        alpha[j] = exp2_ftz(m[j] - m_use[j]);
        moved |= m_new != m[j];
        m[j] = m_new;
    }
    // Where no row's maximum moved, alpha is 2^0 = 1 and O stays as it is: in a long
    // prompt most tiles after the first few.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
    }
}

// P = 2^(S·scale_log2 - m_use) of key step `kk` (16 keys), rounded to 16 bits as the A
// fragment of P·V: a0 (gid, k lo), a1 (gid+8, k lo), a2 (gid, k hi), a3 (gid+8, k hi).
// The row sums `l` gain the unrounded values.
__device__ __forceinline__ void p_fragment(const float (&s)[PF_KEYS / 8][4], int kk,
                                           float scale_log2, const float (&m_use)[2],
                                           float (&l)[2], unsigned int (&pa)[4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float* sn = s[2 * kk + half];
        const float p0 = exp2_ftz(fmaf(sn[0], scale_log2, -m_use[0]));
        const float p1 = exp2_ftz(fmaf(sn[1], scale_log2, -m_use[0]));
        const float p2 = exp2_ftz(fmaf(sn[2], scale_log2, -m_use[1]));
        const float p3 = exp2_ftz(fmaf(sn[3], scale_log2, -m_use[1]));
        l[0] += p0 + p1;
        l[1] += p2 + p3;
        pa[2 * half] = pack2(p0, p1);      // row gid,     keys tig*2 (+8·half)
        pa[2 * half + 1] = pack2(p2, p3);  // row gid + 8
    }
}

// O += P·V for the tile in `sv`, P as `p_fragment` makes it; the row sums `l` rescaled by
// `alpha` and summed.
template <int D>
__device__ __forceinline__ void accumulate_pv(const u16* sv, const float (&s)[PF_KEYS / 8][4],
                                              float scale_log2, const float (&m_use)[2],
                                              const float (&alpha)[2], int lane, float (&l)[2],
                                              float (&o)[D / 8][4]) {
    constexpr int NT = D / 8;
    constexpr int LD = D + PF_PAD;
    // Rescaled here, where it meets the tile's first sum: one fma, as in the kernel before
    // the K/V pipeline, whose output bits this keeps.
    l[0] *= alpha[0];
    l[1] *= alpha[1];
    // V's B fragments, two n-tiles a load, transposed by ldmatrix: lane l addresses
    // key kk*16 + l%8 (+8 for lanes 8-15 and 24-31) at dims 8(2np + l/16) onwards.
    const unsigned int vl =
        smem_addr(sv) + (((lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8) * 2;
#pragma unroll
    for (int kk = 0; kk < PF_KEYS / 16; ++kk) {
        unsigned int pfrag[4];
        p_fragment(s, kk, scale_log2, m_use, l, pfrag);
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned int b[4];
            ldmatrix_x4_trans(b, vl + (kk * 16 * LD + np * 16) * 2);
            mma_16816(o[2 * np], pfrag, b[0], b[1]);
            mma_16816(o[2 * np + 1], pfrag, b[2], b[3]);
        }
    }
}

// Whether this module's prefill runs the warpgroup MMAs (the header): built for sm_90a.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_PREFILL true
#else
#define WG_PREFILL false
#endif

// A K or V tile in wgmma's 128-byte swizzle: the head's 64-element column blocks one after
// another (WG_COLUMN_BYTES each), a key's 128 bytes of a block a row, 16-byte chunk c of
// key r at chunk c ^ (r % 8). The tile starts 1024-byte aligned.
#define WG_COLUMN_BYTES (PF_KEYS * 128)
__device__ __forceinline__ unsigned int wg_tile_offset(int key, int chunk) {
    return (chunk / 8) * WG_COLUMN_BYTES + key * 128 + (((chunk % 8) ^ (key & 7)) << 4);
}

// The tile's copies have landed, for every thread and (WG) for wgmma's async proxy too.
template <bool WG>
__device__ __forceinline__ void kv_tile_landed() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (WG) fence_proxy_async_smem();
#endif
    __syncthreads();
}

// S = Q·Kᵀ for the block's 64 rows × PF_KEYS keys as one warpgroup, K in the swizzle at
// shared address `sk`; the same output layout as `tile_scores`.
template <int D>
__device__ __forceinline__ void tile_scores_wg(unsigned int sk, const unsigned int (&qa)[D / 16][4],
                                               float (&s)[PF_KEYS / 8][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {  // 16 dims = 32 bytes into a column block's rows
        const unsigned int at = sk + (ks / 4) * WG_COLUMN_BYTES + (ks % 4) * 32;
        wgmma_rs_k16<PF_KEYS, 0>(&s[0][0], qa[ks], wgmma_desc_sw128(at, 16), ks > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    wgmma_pin<PF_KEYS / 2>(&s[0][0]);
#endif
}

// `accumulate_pv` as one warpgroup, V N-major in the swizzle at shared address `sv`: the
// same P, row sums and output layout.
template <int D>
__device__ __forceinline__ void accumulate_pv_wg(unsigned int sv, const float (&s)[PF_KEYS / 8][4],
                                                 float scale_log2, const float (&m_use)[2],
                                                 const float (&alpha)[2], float (&l)[2],
                                                 float (&o)[D / 8][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    l[0] *= alpha[0];
    l[1] *= alpha[1];
    unsigned int pfrag[PF_KEYS / 16][4];
#pragma unroll
    for (int kk = 0; kk < PF_KEYS / 16; ++kk) p_fragment(s, kk, scale_log2, m_use, l, pfrag[kk]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < PF_KEYS / 16; ++kk) {  // 16 keys = two 8-row groups of 1024 bytes
        const unsigned int at = sv + kk * 16 * 128;
        wgmma_rs_k16<D, 1>(&o[0][0], pfrag[kk], wgmma_desc_sw128(at, WG_COLUMN_BYTES), 1);
    }
    wgmma_commit();
    wgmma_wait_all();
    wgmma_pin<D / 2>(&o[0][0]);
#endif
}

// WG: the products as warpgroup MMAs (sm_90a, D a multiple of 64; the header).
template <int D, bool WG>
__device__ void paged_attention_prefill_impl(const PrefillArgs& a) {
    constexpr int KS = D / 16;  // k-steps of Q·Kᵀ
    constexpr int NT = D / 8;   // n-tiles of O
    constexpr int LD = WG ? D : D + PF_PAD;
    // K's tile then V's; wgmma's swizzle is of address bits, so WG's start 1024-byte aligned.
    __shared__ __align__(16) unsigned char kv_raw[2 * PF_KEYS * LD * 2 + (WG ? 1024 : 0)];
    const unsigned int kv_base = smem_addr(kv_raw);
    const unsigned int sk_at = WG ? (kv_base + 1023) & ~1023u : kv_base;
    const unsigned int sv_at = sk_at + PF_KEYS * LD * 2;
    const u16* sk = reinterpret_cast<const u16*>(kv_raw + (sk_at - kv_base));
    const u16* sv = reinterpret_cast<const u16*>(kv_raw + (sv_at - kv_base));

    const int tile = blockIdx.x, kvh = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int seq = a.tile_seq[tile];
    const int t0 = a.tile_token[tile];
    const int q_begin = a.query_start_loc[seq], q_end = a.query_start_loc[seq + 1];
    const int context_len = a.seq_lens[seq] - (q_end - q_begin);
    const int group = a.num_q_heads / a.num_kv_heads;
    const int ntok = min(a.tokens_per_tile, q_end - t0);
    const int rows = ntok * group;
    const int tile_keys = context_len + (t0 - q_begin) + ntok;  // keys the last token sees
    const int* table = a.block_tables + (long long)seq * a.step_dims[1];
    const long long kv_row = (long long)a.num_kv_heads * D;

    // This thread's two rows (gid and gid + 8 of the warp's 16) and their key limits.
    int limit[2];
    long long qrow[2];
    bool valid[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int r = warp * 16 + gid + 8 * j;
        valid[j] = r < rows;
        const int t = t0 + (valid[j] ? r / group : 0);
        const int h = kvh * group + (valid[j] ? r % group : 0);
        qrow[j] = (long long)t * a.num_q_heads + h;
        limit[j] = valid[j] ? context_len + (t - q_begin) + 1 : 0;
    }
    // Q fragments (A operand, row-major 16×16 per k-step), straight from global memory.
    unsigned int qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const unsigned int* p =
                reinterpret_cast<const unsigned int*>(a.q + qrow[j] * D + ks * 16 + tig * 2);
            qa[ks][j] = valid[j] ? p[0] : 0u;      // cols tig*2, +1
            qa[ks][j + 2] = valid[j] ? p[4] : 0u;  // cols tig*2 + 8, +9
        }
    }

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    // Keys any row of the warp sees: warp-uniform, since mma.sync and the shuffles need
    // every lane of the warp.
    int warp_keys = max(limit[0], limit[1]);
    // Keys every row of the warp sees: tiles below it need no mask.
    int warp_seen = min(valid[0] ? limit[0] : 0x7fffffff, valid[1] ? limit[1] : 0x7fffffff);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        warp_keys = max(warp_keys, __shfl_xor_sync(0xffffffffu, warp_keys, o));
        warp_seen = min(warp_seen, __shfl_xor_sync(0xffffffffu, warp_seen, o));
    }
    const float scale_log2 = a.scale * 1.4426950408889634f;

    // K and V tiles load on a pipeline of two half-steps: V(i) lands while S(i) and its
    // softmax are computed, and K(i + 1) while P·V(i) is.
    constexpr int CHUNKS = PF_KEYS * (D / 8) / PF_THREADS;
    constexpr int STEP = PF_THREADS / (D / 8);
    static_assert(PF_THREADS % (D / 8) == 0, "a thread's chunks share their columns");
    static_assert(PF_THREADS >= PF_KEYS, "a tile's keys are looked up a thread each");
    // A tile's keys are looked up once, a thread a key, into `key_row`: the key's row in the
    // K and V caches, in 16-byte units from the cache's start (the host keeps a layer's
    // cache below 64 GiB), laid out so that a copying thread's keys first + STEP·i lie
    // together. Two buffers: tile i + 1's are written while tile i's V copy may still
    // read its own. Thread `tid` takes key k0 + tid (`KeyWalk`: dividing by the block size
    // for each key, with each table load's use right behind it, was most of the kernel's
    // stalls). A key past `tile_keys` reads the row of an earlier key of the sequence
    // instead: it is masked for every row, so its p is 0 and its finite K and V add nothing.
    __shared__ __align__(16) unsigned int key_row[2][PF_KEYS];
    const int last_block = (tile_keys - 1) / a.block_size;
    const unsigned int row_units = (unsigned int)(kv_row * sizeof(scalar_t) / 16);
    KeyWalk walk(tid, PF_KEYS, a.block_size);
    const auto lookup = [&](int k0, int buf) {
        if (tid < PF_KEYS) {
            const bool in = k0 + tid < tile_keys;
            const int block = table[min(walk.q, last_block)];
            const unsigned int slot = block * a.block_size + (in ? walk.r : 0);
            key_row[buf][(tid % STEP) * CHUNKS + tid / STEP] = slot * row_units;
            walk.next();
        }
    };
    // A thread copies the same 8 columns `d` of its keys first + STEP·i. An empty group
    // where there is no next tile keeps the waits' counts uniform.
    const int first = tid / (D / 8), d = (tid % (D / 8)) * 8;
    const char* k_column = reinterpret_cast<const char*>(a.key_cache + (long long)kvh * D + d);
    const char* v_column = reinterpret_cast<const char*>(a.value_cache + (long long)kvh * D + d);
    // Where the thread's first chunk lands in a tile, and the step between its keys (WG:
    // its keys are first + STEP·i, all of them ≡ first mod 8, so one swizzled column).
    const unsigned int chunk_at = WG ? wg_tile_offset(first, d / 8) : (first * LD + d) * 2;
    const unsigned int key_step = (WG ? 128 : LD * 2) * STEP;
    const auto copy = [&](bool issue, unsigned int dst, const char* column, int buf) {
        if (!issue) {
            cp_async_commit();
            return;
        }
        unsigned int row[CHUNKS];
        if constexpr (CHUNKS % 4 == 0) {
#pragma unroll
            for (int i = 0; i < CHUNKS; i += 4) {
                const uint4 r4 = *reinterpret_cast<const uint4*>(&key_row[buf][first * CHUNKS + i]);
                row[i] = r4.x, row[i + 1] = r4.y, row[i + 2] = r4.z, row[i + 3] = r4.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i) row[i] = key_row[buf][first * CHUNKS + i];
        }
        const unsigned int at = dst + chunk_at;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            cp_async16(at + key_step * i, column + (unsigned long long)row[i] * 16);
        }
        cp_async_commit();
    };
    lookup(0, 0);
    __syncthreads();
    copy(true, sk_at, k_column, 0);
    copy(true, sv_at, v_column, 0);
    for (int k0 = 0, buf = 1; k0 < tile_keys; k0 += PF_KEYS, buf ^= 1) {
        const bool more = k0 + PF_KEYS < tile_keys;
        if (more) lookup(k0 + PF_KEYS, buf);
        cp_async_wait<1>();  // K(i); V(i) may be in flight
        kv_tile_landed<WG>();
        // Every key of this tile is masked for the warp: it only takes part in the copies.
        const bool skip = !WG && k0 >= warp_keys;

        float s[PF_KEYS / 8][4];
        float m_use[2], alpha[2];
        if (!skip) {
            if constexpr (WG) tile_scores_wg<D>(sk_at, qa, s);
            else tile_scores<D>(sk, qa, lane, s);
            online_softmax<D>(s, k0, tig, limit, k0 + PF_KEYS > warp_seen, scale_log2, m,
                              m_use, alpha, o);
        }
        __syncthreads();  // every warp is done with K(i)
        copy(more, sk_at, k_column, buf);
        cp_async_wait<1>();  // V(i); K(i + 1) may be in flight
        kv_tile_landed<WG>();
        if (!skip) {
            if constexpr (WG) accumulate_pv_wg<D>(sv_at, s, scale_log2, m_use, alpha, l, o);
            else accumulate_pv<D>(sv, s, scale_log2, m_use, alpha, lane, l, o);
        }
        __syncthreads();  // every warp is done with V(i)
        copy(more, sv_at, v_column, buf);
    }

    // Normalise by the row sums (summed over the quad) and store.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 1);
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 2);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if (!valid[j]) continue;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        unsigned int* dst = reinterpret_cast<unsigned int*>(a.out + qrow[j] * D + tig * 2);
#pragma unroll
        for (int n = 0; n < NT; ++n) dst[n * 4] = pack2(o[n][2 * j] * inv, o[n][2 * j + 1] * inv);
    }
}

// The warpgroup kernel where the module is built for sm_90a and the head size allows it.
template <int D>
__device__ void paged_attention_prefill_for(const PrefillArgs& a) {
    paged_attention_prefill_impl<D, WG_PREFILL && D % 64 == 0>(a);
}

HEAD_DIM_KERNEL(paged_attention_prefill, paged_attention_prefill_for, PF_THREADS, PrefillArgs, 16)
HEAD_DIM_KERNEL(paged_attention_prefill, paged_attention_prefill_for, PF_THREADS, PrefillArgs, 32)
HEAD_DIM_KERNEL(paged_attention_prefill, paged_attention_prefill_for, PF_THREADS, PrefillArgs, 64)
// d128 as HEAD_DIM_KERNEL writes it, with the blocks an SM asked of the warpgroup kernel:
// three at 168 registers. `_occ2` leaves them unbounded (186, two an SM), faster a block:
// the host takes it for grids of one wave at two an SM (ops.rs, `prefill_takes_occ2`).
extern "C" __global__ void __launch_bounds__(PF_THREADS, WG_PREFILL ? 3 : 1)
    paged_attention_prefill_d128(PrefillArgs a) {
    pdl_enter();
    paged_attention_prefill_for<128>(a);
}
extern "C" __global__ void __launch_bounds__(PF_THREADS)
    paged_attention_prefill_d128_occ2(PrefillArgs a) {
    pdl_enter();
    paged_attention_prefill_for<128>(a);
}

#endif  // !VLLM_DTYPE_F32
