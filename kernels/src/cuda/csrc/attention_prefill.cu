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

// O += P·V for the tile in `sv`, P = 2^(S·scale_log2 - m_use) rounded to 16 bits; the row
// sums `l` rescaled by `alpha` and summed.
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
    // P (rounded to 16 bits) as the A operand of P·V, 16 keys per k-step.
#pragma unroll
    for (int kk = 0; kk < PF_KEYS / 16; ++kk) {
        unsigned int pa[4];
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
        // A operand order: a0 (gid, k lo), a1 (gid+8, k lo), a2 (gid, k hi), a3 (gid+8, k hi).
        const unsigned int pfrag[4] = {pa[0], pa[1], pa[2], pa[3]};
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            unsigned int b[4];
            ldmatrix_x4_trans(b, vl + (kk * 16 * LD + np * 16) * 2);
            mma_16816(o[2 * np], pfrag, b[0], b[1]);
            mma_16816(o[2 * np + 1], pfrag, b[2], b[3]);
        }
    }
}

template <int D>
__device__ void paged_attention_prefill_impl(const PrefillArgs& a) {
    constexpr int KS = D / 16;  // k-steps of Q·Kᵀ
    constexpr int NT = D / 8;   // n-tiles of O
    constexpr int LD = D + PF_PAD;
    __shared__ __align__(16) u16 sk[PF_KEYS * LD];
    __shared__ __align__(16) u16 sv[PF_KEYS * LD];

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
    const auto copy = [&](bool issue, u16* dst, const char* column, int buf) {
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
        const unsigned int at = smem_addr(&dst[first * LD + d]);
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            cp_async16(at + STEP * i * LD * 2, column + (unsigned long long)row[i] * 16);
        }
        cp_async_commit();
    };
    lookup(0, 0);
    __syncthreads();
    copy(true, sk, k_column, 0);
    copy(true, sv, v_column, 0);
    for (int k0 = 0, buf = 1; k0 < tile_keys; k0 += PF_KEYS, buf ^= 1) {
        const bool more = k0 + PF_KEYS < tile_keys;
        if (more) lookup(k0 + PF_KEYS, buf);
        cp_async_wait<1>();  // K(i); V(i) may be in flight
        __syncthreads();
        // Every key of this tile is masked for the warp: it only takes part in the copies.
        const bool skip = k0 >= warp_keys;

        float s[PF_KEYS / 8][4];
        float m_use[2], alpha[2];
        if (!skip) {
            tile_scores<D>(sk, qa, lane, s);
            online_softmax<D>(s, k0, tig, limit, k0 + PF_KEYS > warp_seen, scale_log2, m,
                              m_use, alpha, o);
        }
        __syncthreads();  // every warp is done with K(i)
        copy(more, sk, k_column, buf);
        cp_async_wait<1>();  // V(i); K(i + 1) may be in flight
        __syncthreads();
        if (!skip) {
            accumulate_pv<D>(sv, s, scale_log2, m_use, alpha, lane, l, o);
        }
        __syncthreads();  // every warp is done with V(i)
        copy(more, sv, v_column, buf);
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

HEAD_DIM_KERNELS(paged_attention_prefill, paged_attention_prefill_impl, PF_THREADS, PrefillArgs)

#endif  // !VLLM_DTYPE_F32
