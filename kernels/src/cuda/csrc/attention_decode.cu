// Paged attention for decode: sequences with exactly one query token this step (the
// semantics of `cpu::attention::paged_attention` for query length 1: the token attends to
// every key of its sequence). vLLM's paged_attention_v2 scheme, tuned for bandwidth:
//
// Grid: (decode sequence, kv head × q split, partition). A block reads its partition of
// the sequence's keys once for the q heads it takes: its kv head's whole GQA group, or at
// small grids one of 2^q_split_log2 equal runs of it (`AttentionPlan::decode_q_split`: a
// group-of-8 block's latency is about 1.4 times a group-of-4's, and the second read of
// the keys comes from L2). Pass 1 computes the scores
// into shared memory (each key is handled by a group of D/8 lanes, 16 bytes per lane),
// pass 2 takes the softmax, pass 3 accumulates V. With several partitions, each writes
// an unnormalised partial (o, m, l) that `paged_attention_decode_combine` merges.
//
// One entry point per (head size, GP): GP is the GQA group rounded up to a power of two,
// so per-thread arrays hold only the group's heads. Registers decide how many blocks an
// SM holds, and with them how many bytes are in flight: a kernel sized for the widest
// group, which also read the block table before every K and V load, ran Qwen3-0.6B's
// group of 2 at 1.2 TB/s; this one reaches 2.6 TB/s (docs/BENCHMARKS.md). The group of 8
// at head size 128 has a second entry point for large grids, below.
//
// (A one-pass kernel with an online softmax, K and V of a key loaded together, ran batches
// of 1 to 8 until this one beat it at every batch and length the bench measured, but for
// one sequence in 32-key partitions, by 0.1 us: docs/BENCHMARKS.md, "Small decode
// batches".)

#define DEC_THREADS 128
#define DEC_WARPS (DEC_THREADS / 32)
#define DEC_UNROLL 4  // keys in flight per lane
#define DEC_DOTS_LIVE 16  // pass 1's dots summed together (score_step)

struct DecodeArgs {
    const scalar_t* q;          // [T, Hq, D]
    const scalar_t* key_cache;  // [num_blocks, block_size, Hkv, D]
    const scalar_t* value_cache;
    const int* block_tables;    // [num_seqs, max_blocks_per_seq]
    const int* seq_lens;        // [num_seqs]
    const int* query_start_loc; // [num_seqs + 1]
    const int* decode_seqs;     // [num_decode] sequences with one query token
    scalar_t* out;              // [T, Hq, D]                     (num_partitions == 1)
    float* part_o;              // [partitions, num_decode, Hq, D] (num_partitions > 1)
    float* part_ml;             // [partitions, num_decode, Hq, 2]
    // [0] keys per partition, [1] the block tables' row width: read from device memory,
    // so that a captured CUDA graph keeps its grid (the partition count) while each replay
    // picks the partition for its longest sequence and stages block tables no wider than
    // its longest sequence needs.
    const int* step_dims;
    int num_decode;
    int num_q_heads;
    int num_kv_heads;
    int q_split_log2;           // log2 of the blocks per kv head, each a run of its group
    int block_size;
    float scale;
};

#if defined(VLLM_DTYPE_F32)
struct Row8 {  // eight consecutive elements of a K or V row, as loaded
    float4 a, b;
};
#else
struct Row8 {
    uint4 a;
};
#endif

__device__ __forceinline__ Row8 load_row8(const scalar_t* p) {
    Row8 r;
#if defined(VLLM_DTYPE_F32)
    r.a = reinterpret_cast<const float4*>(p)[0];
    r.b = reinterpret_cast<const float4*>(p)[1];
#else
    r.a = *reinterpret_cast<const uint4*>(p);
#endif
    return r;
}

// Zeros, for keys past the partition: their V must not be stale cache contents (0 · NaN).
__device__ __forceinline__ Row8 zero_row8() {
    Row8 r;
#if defined(VLLM_DTYPE_F32)
    r.a.x = r.a.y = r.a.z = r.a.w = 0.f;
    r.b.x = r.b.y = r.b.z = r.b.w = 0.f;
#else
    r.a.x = r.a.y = r.a.z = r.a.w = 0u;
#endif
    return r;
}

__device__ __forceinline__ void unpack_row8(const Row8& r, float* out) {
#if defined(VLLM_DTYPE_F32)
    out[0] = r.a.x; out[1] = r.a.y; out[2] = r.a.z; out[3] = r.a.w;
    out[4] = r.b.x; out[5] = r.b.y; out[6] = r.b.z; out[7] = r.b.w;
#else
    unpack16(r.a, out);
#endif
}

// Eight consecutive elements as f32 (the address is 8-element aligned).
__device__ __forceinline__ void load8(const scalar_t* p, float* out) {
    unpack_row8(load_row8(p), out);
}

// Where each key of a block's partition lies in the cache (elements from the start of
// its kv head's row), looked up once before pass 1: without it each K and V load waits
// first for its block-table read. Groups of up to two q heads (COMPACT) keep the slot,
// 4 bytes, times the row at each load, and sum pass 3 over the scores' memory: 2,048
// keys take 24 KB, so an SM holds seven blocks, as many as their registers allow, where
// 8-byte offsets held five (Qwen3-0.6B's steps of 128-256 sequences 3-5 % faster).
// Wider groups, whose registers allow no more blocks, keep 8-byte offsets: the compact
// layout took Qwen3-8B's step of 192 sequences 5 % longer (docs/BENCHMARKS.md,
// 2026-11-26).
template <bool COMPACT>
struct KeySlots;
// Offsets from the start of the kv head's row: the lanes' pointers start there
// (`head_offset`).
template <>
struct KeySlots<true> {
    int* slot;
    long long row;
    __device__ static KeySlots at(void* p, long long row) { return {static_cast<int*>(p), row}; }
    __device__ void set(int i, long long slot_i, long long, long long) const {
        slot[i] = (int)slot_i;
    }
    __device__ long long operator[](int i) const { return slot[i] * row; }
    __device__ static long long head_offset(long long head) { return head; }
};
// Offsets from the start of the cache, the kv head's column included (only the pointer
// stays live through the passes: the widest group has no registers to spare).
template <>
struct KeySlots<false> {
    long long* offset;
    __device__ static KeySlots at(void* p, long long) { return {static_cast<long long*>(p)}; }
    __device__ void set(int i, long long slot_i, long long row, long long head) const {
        offset[i] = slot_i * row + head;
    }
    __device__ long long operator[](int i) const { return offset[i]; }
    __device__ static long long head_offset(long long) { return 0; }
};

// This lane's rows of one step's keys (base + grp + NG·u for u < DEC_UNROLL) at their
// cache offsets `slots` (from the partition's first key), zeros past its end.
template <int NG, bool C>
__device__ __forceinline__ void load_step(Row8* rows, const scalar_t* lane,
                                          const KeySlots<C> slots, int base, int k_begin,
                                          int k_end, int grp) {
#pragma unroll
    for (int u = 0; u < DEC_UNROLL; ++u) {
        const int k = base + grp + NG * u;
        rows[u] = k < k_end ? load_row8(lane + slots[k - k_begin]) : zero_row8();
    }
}

// Where pass 1 keeps the score of key k (from the partition's first) for head h. Groups of
// 4 and more keep a key's scores together ([partition][GP]), so that pass 3 reads them in
// one or two accesses where it took one a head (their shared-memory pipe was busy); for
// the smaller groups, which read one or two, the head-major layout ([GP][partition]) kept
// Qwen3-0.6B's kernel at 72 registers where this one took 80 (seven blocks an SM, not six).
template <int GP>
__device__ __forceinline__ constexpr bool key_major() {
    return GP >= 4;
}
template <int GP>
__device__ __forceinline__ int score_index(int k, int h, int partition) {
    return key_major<GP>() ? k * GP + h : h * partition + k;
}

// Sums v[N] over the TG lanes of a key group (TG a power of two dividing 32) with N - 1
// shuffles where one sum per value takes N · log2(TG): at each of the first levels a lane
// keeps half of its values and sends the other half to its partner, which keeps the
// other half. On return a lane holds in v[0, max(N / TG, 1)) the sums of the values from
// index `group_first<N, TG>(sub)` on.
template <int N, int TG>
__device__ __forceinline__ void group_sum_transposed(float (&v)[N], int sub) {
#pragma unroll
    for (int o = TG / 2, n = N; o > 0; o >>= 1) {
        if (n > 1) {
            const bool upper = sub & o;
#pragma unroll
            for (int j = 0; j < n / 2; ++j) {
                const float send = upper ? v[j] : v[j + n / 2];
                const float keep = upper ? v[j + n / 2] : v[j];
                v[j] = keep + __shfl_xor_sync(0xffffffffu, send, o);
            }
            n /= 2;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
    }
}

// The index of the first value lane `sub` holds after `group_sum_transposed`.
template <int N, int TG>
__device__ __forceinline__ int group_first(int sub) {
    int first = 0;
#pragma unroll
    for (int o = TG / 2, n = N; o > 0 && n > 1; o >>= 1, n /= 2)
        if (sub & o) first += n / 2;
    return first;
}

// Pass 1's scores of one step (DEC_UNROLL keys a key group) into `scores`, and their
// running max per head into m. The dots of UC keys at a time, index u · GP + h, are summed
// over the key's lanes together: N - 1 shuffles where one sum per dot takes N · log2(TG)
// (N = UC · GP, at most DEC_DOTS_LIVE so that the group of 8 does not spill). Shuffles
// share the shared-memory pipe, whose waits were half the kernel's stalls: summing them
// together took 4-23 % off Qwen3-8B's kernel and 15-26 % off the group of 8's, and 1-7 %
// off Qwen3-0.6B's small batches (docs/BENCHMARKS.md, 2026-11-26). Each sum pairs the
// same lanes in the same order as one butterfly per dot did.
template <int TG, int NG, int GP>
__device__ __forceinline__ void score_step(const Row8* rows, const float (&q)[GP][8],
                                           float (&m)[GP], float* scores, int partition,
                                           int base, int k_begin, int k_end, int grp, int sub,
                                           int g) {
    constexpr int UC = DEC_DOTS_LIVE / GP < DEC_UNROLL ? DEC_DOTS_LIVE / GP : DEC_UNROLL;
    constexpr int N = UC * GP;
    // Where lanes hold the same sum (N < TG), the first of them stores it.
    constexpr int HELD = N >= TG ? N / TG : 1;
    const bool writer = N >= TG || (sub & (TG / N - 1)) == 0;
    const int first = group_first<N, TG>(sub);
#pragma unroll
    for (int u0 = 0; u0 < DEC_UNROLL; u0 += UC) {
        float dot[N];
#pragma unroll
        for (int u = 0; u < UC; ++u) {
            float kf[8];
            unpack_row8(rows[u0 + u], kf);
#pragma unroll
            for (int h = 0; h < GP; ++h) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d += q[h][e] * kf[e];
                dot[u * GP + h] = d;
            }
        }
        group_sum_transposed<N, TG>(dot, sub);
#pragma unroll
        for (int r = 0; r < HELD; ++r) {
            const int j = first + r, hj = j % GP;
            const int k = base + grp + NG * (u0 + j / GP);
            if (hj < g && k < k_end) {
                // m[hj] by a run-time index would put m[] in local memory.
#pragma unroll
                for (int h = 0; h < GP; ++h)
                    if (h == hj) m[h] = fmaxf(m[h], dot[r]);
                if (writer) scores[score_index<GP>(k - k_begin, hj, partition)] = dot[r];
            }
        }
    }
}

// Key k's GP probabilities, in as few accesses as the layout allows (a key's scores start
// 16-byte aligned: the scores start at a multiple of 32 keys' slots).
template <int GP>
__device__ __forceinline__ void load_probs(const float* scores, int k, int partition,
                                           float (&p)[GP]) {
    if (key_major<GP>()) {
#pragma unroll
        for (int i = 0; i < GP / 4; ++i) {
            const float4 v = reinterpret_cast<const float4*>(scores + k * GP)[i];
            p[4 * i] = v.x, p[4 * i + 1] = v.y, p[4 * i + 2] = v.z, p[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int h = 0; h < GP; ++h) p[h] = scores[score_index<GP>(k, h, partition)];
    }
}

// Pass 2: each head's scores of the block's n_keys into exp(score - the block's max), the
// max of each head into s_block_max and each warp's sums into s_sum. Thread tid keeps head
// tid % GP where a key's scores are together (DEC_THREADS is a multiple of GP), so that
// consecutive threads read consecutive words; else it walks every head.
template <int GP>
__device__ __forceinline__ void softmax_scores(float* scores, const float (&s_max)[DEC_WARPS][GP],
                                               float (&s_sum)[DEC_WARPS][GP],
                                               float* s_block_max, int n_keys, int partition,
                                               int g) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float mh[GP];
#pragma unroll
    for (int h = 0; h < GP; ++h) {
        mh[h] = s_max[0][h];
#pragma unroll
        for (int w = 1; w < DEC_WARPS; ++w) mh[h] = fmaxf(mh[h], s_max[w][h]);
        if (tid == 0 && h < g) s_block_max[h] = mh[h];
    }
    if (key_major<GP>()) {
        const int ht = tid % GP;
        float mt = NEG_INF, s = 0.f;
#pragma unroll
        for (int h = 0; h < GP; ++h)
            if (h == ht) mt = mh[h];
        if (ht < g) {
            for (int idx = tid; idx < n_keys * GP; idx += DEC_THREADS) {
                const float p = __expf(scores[idx] - mt);
                scores[idx] = p;
                s += p;
            }
        }
#pragma unroll
        for (int o = 16; o >= GP; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane < GP && lane < g) s_sum[warp][lane] = s;
        return;
    }
#pragma unroll
    for (int h = 0; h < GP; ++h) {
        if (h >= g) break;
        float s = 0.f;
        for (int k = tid; k < n_keys; k += DEC_THREADS) {
            float& score = scores[score_index<GP>(k, h, partition)];
            score = __expf(score - mh[h]);
            s += score;
        }
        s = warp_sum(s);
        if (lane == 0) s_sum[warp][h] = s;
    }
}

template <int D, int GP>
__device__ void paged_attention_decode_impl(const DecodeArgs& a) {
    constexpr int TG = D / 8;               // lanes per key
    constexpr int NG = DEC_THREADS / TG;    // keys per block per step
    constexpr bool COMPACT = GP <= 2;  // DEC_COMPACT_MAX_GROUP in attention_plan.rs sizes it
    extern __shared__ long long dec_smem[];
    const int partition = a.step_dims[0];
    float* scores = reinterpret_cast<float*>(reinterpret_cast<char*>(dec_smem) +
                                             partition * (COMPACT ? 4 : 8));  // score_index
    // The cross-warp sum of pass 3's accumulators: over the scores once they are used.
    float* red = COMPACT ? scores : scores + GP * partition;  // [DEC_WARPS][GP][D]
    __shared__ float s_max[DEC_WARPS][GP];
    __shared__ float s_sum[DEC_WARPS][GP];
    // The block's max of each head, for the partial's row: read by a head picked at run
    // time, which from registers would put m[] in local memory.
    __shared__ float s_block_max[GP];

    const int kvh = blockIdx.x >> a.q_split_log2, part = blockIdx.y, i = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = tid / TG, sub = tid % TG;
    const int seq = a.decode_seqs[i];
    const int token = a.query_start_loc[seq];
    const int seq_len = a.seq_lens[seq];
    // The block's q heads: g of them, from blockIdx.x · g (its kv head's group in order).
    const int g = (a.num_q_heads / a.num_kv_heads) >> a.q_split_log2;
    const int k_begin = part * partition;
    const int k_end = min(seq_len, k_begin + partition);
    // A sequence that fits in one partition is written here whole; the combine passes
    // over it (at large batches the plan takes partitions that hold most sequences).
    const bool whole = gridDim.y == 1 || seq_len <= partition;
    const long long q_row0 = (long long)token * a.num_q_heads + (long long)blockIdx.x * g;
    // Partial rows are indexed by decode sequence, not by token.
    const long long p_row0 =
        ((long long)part * a.num_decode + i) * a.num_q_heads + (long long)blockIdx.x * g;

    if (k_begin >= k_end) {  // this partition lies past the sequence's end
        pdl_enter();
        if (gridDim.y > 1 && tid < g) {
            a.part_ml[(p_row0 + tid) * 2] = NEG_INF;
            a.part_ml[(p_row0 + tid) * 2 + 1] = 0.f;
        }
        return;
    }

    // The keys' cache offsets come from the step's inputs alone, so they are looked up
    // before the wait, while the kernel before finishes (common.cuh); q and the newest
    // key are that kernel's output.
    const int* table = a.block_tables + (long long)seq * a.step_dims[1];
    const long long kv_row = (long long)a.num_kv_heads * D, head = (long long)kvh * D;
    const KeySlots<COMPACT> slots = KeySlots<COMPACT>::at(dec_smem, kv_row);  // [partition]
    for (int k = k_begin + tid; k < k_end; k += DEC_THREADS)
        slots.set(k - k_begin, cache_slot(table, k, a.block_size), kv_row, head);
    // The partition's first keys asked into L2 before the wait too: HBM idles while the
    // kernel before (qkv_prepare) runs, and the blocks resident then start pass 1 from
    // L2. A line a thread; the newest key, which that kernel writes, may be among them
    // (L2 is where its write lands, so the hint reads nothing stale).
    __syncthreads();  // the slots, for the hint and every pass
    {
        constexpr int ROW_BYTES = D * (int)sizeof(scalar_t);
        constexpr int LINES = ROW_BYTES > 128 ? ROW_BYTES / 128 : 1;
        const int k = k_begin + tid / LINES;
        if (k < k_end)
            prefetch_l2(a.key_cache + KeySlots<COMPACT>::head_offset(head) + slots[k - k_begin] +
                        (tid % LINES) * (128 / (int)sizeof(scalar_t)));
    }
    pdl_enter();
    float q[GP][8];
#pragma unroll
    for (int h = 0; h < GP; ++h) {
        if (h < g) {
            load8(a.q + (q_row0 + h) * D + sub * 8, q[h]);
#pragma unroll
            for (int e = 0; e < 8; ++e) q[h][e] *= a.scale;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) q[h][e] = 0.f;
        }
    }
    // This lane's 8 columns of a key row.
    const long long lane_start = KeySlots<COMPACT>::head_offset(head) + sub * 8;
    const scalar_t* k_lane = a.key_cache + lane_start;
    const scalar_t* v_lane = a.value_cache + lane_start;

    // Pass 1: scores. Every lane runs the same number of steps (shuffles need the whole
    // warp); keys past the end are loaded as zeros and not stored. Each step's rows load
    // a step ahead, so a lane keeps one step of loads in flight while it scores another.
    constexpr int STEP = NG * DEC_UNROLL;
    float m[GP];
#pragma unroll
    for (int h = 0; h < GP; ++h) m[h] = NEG_INF;
    Row8 rows[DEC_UNROLL];
    load_step<NG>(rows, k_lane, slots, k_begin, k_begin, k_end, grp);
    for (int base = k_begin; base < k_end; base += STEP) {
        Row8 next[DEC_UNROLL];
        load_step<NG>(next, k_lane, slots, base + STEP, k_begin, k_end, grp);
        score_step<TG, NG, GP>(rows, q, m, scores, partition, base, k_begin, k_end, grp, sub, g);
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u) rows[u] = next[u];
    }
    // Pass 3's first V rows load while pass 2 runs.
    load_step<NG>(rows, v_lane, slots, k_begin, k_begin, k_end, grp);

    // Pass 2: the block's max and the exponentials.
#pragma unroll
    for (int h = 0; h < GP; ++h) {
        if (h >= g) break;
        const float wm = warp_max(m[h]);
        if (lane == 0) s_max[warp][h] = wm;
    }
    __syncthreads();  // also publishes the scores
    softmax_scores<GP>(scores, s_max, s_sum, s_block_max, k_end - k_begin, partition, g);
    __syncthreads();  // publishes the probabilities and the partial sums

    // Pass 3: o = Σ p · v, each lane owning 8 columns of its key group.
    float acc[GP][8];
#pragma unroll
    for (int h = 0; h < GP; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
    for (int base = k_begin; base < k_end; base += STEP) {
        Row8 next[DEC_UNROLL];
        load_step<NG>(next, v_lane, slots, base + STEP, k_begin, k_end, grp);
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u) {
            const int k = base + grp + NG * u;
            if (k >= k_end) continue;
            float vf[8], p[GP];
            unpack_row8(rows[u], vf);
            load_probs<GP>(scores, k - k_begin, partition, p);
#pragma unroll
            for (int h = 0; h < GP; ++h) {
                if (h >= g) break;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[h][e] += p[h] * vf[e];
            }
        }
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; ++u) rows[u] = next[u];
    }
    // Sum the key groups: first inside the warp (lanes with the same `sub`), then across
    // warps through shared memory (the scores', once every warp is past pass 3).
    if (COMPACT) __syncthreads();
#pragma unroll
    for (int h = 0; h < GP; ++h) {
        if (h >= g) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
#pragma unroll
            for (int o = TG; o < 32; o <<= 1) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], o);
        }
        if (lane < TG) {
#pragma unroll
            for (int e = 0; e < 8; ++e) red[(warp * GP + h) * D + sub * 8 + e] = acc[h][e];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < g * D; idx += DEC_THREADS) {
        const int h = idx / D, d = idx - h * D;
        float o = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
            o += red[(w * GP + h) * D + d];
            l += s_sum[w][h];
        }
        if (whole) {
            a.out[(q_row0 + h) * D + d] = from_f32(l > 0.f ? o / l : 0.f);
        } else {
            a.part_o[(p_row0 + h) * D + d] = o;
            if (d == 0) {
                a.part_ml[(p_row0 + h) * 2] = s_block_max[h];
                a.part_ml[(p_row0 + h) * 2 + 1] = l;
            }
        }
    }
}

#define DECODE_KERNEL(D, GP)                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS)                             \
        paged_attention_decode_d##D##_g##GP(DecodeArgs a) {                               \
        paged_attention_decode_impl<D, GP>(a);                                            \
    }
#define DECODE_KERNELS(D) \
    DECODE_KERNEL(D, 1) DECODE_KERNEL(D, 2) DECODE_KERNEL(D, 4) DECODE_KERNEL(D, 8)
DECODE_KERNELS(16)
DECODE_KERNELS(32)
DECODE_KERNELS(64)
DECODE_KERNELS(128)

// The group of 8 at head size 128, capped at four blocks an SM for grids of many blocks
// (when the host takes it, and why: `AttentionPlan::decode_four_blocks_an_sm`).
extern "C" __global__ void __launch_bounds__(DEC_THREADS, 4)
    paged_attention_decode_d128_g8_occ4(DecodeArgs a) {
    paged_attention_decode_impl<128, 8>(a);
}

// exp(m - ref): the weight of a softmax state whose max is m against a larger max ref;
// 0 for a state that has seen no key yet (m = -inf), without the NaN of -inf - -inf.
__device__ __forceinline__ float dec_rescale(float m, float ref) {
    return m == NEG_INF ? 0.f : __expf(m - ref);
}

#define COMBINE_CHUNK 16  // partials of a row loaded together

// Merges the partitions of every (decode sequence, q head) into the token's output row,
// `row_threads` threads a row (blockDim.x / row_threads rows a block). Only the partitions
// holding keys of the sequence are read: a fixed grid sized for long sequences leaves most
// of them empty for short ones (a batch-1 grid has 33 partitions, a 384-key sequence fills
// 12 of 32 keys), and a row whose sequence fits in one partition was written by the decode
// kernel, so at large batches most rows only look up their sequence's length.
extern "C" __global__ void paged_attention_decode_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_ml,
    const int* __restrict__ decode_seqs, const int* __restrict__ query_start_loc,
    const int* __restrict__ seq_lens, const int* __restrict__ step_dims,
    scalar_t* __restrict__ out, int num_decode, int num_q_heads, int head_dim,
    int num_partitions, int row_threads) {
    const long long rows = (long long)num_decode * num_q_heads;
    const long long row =
        (long long)blockIdx.x * (blockDim.x / row_threads) + threadIdx.x / row_threads;
    if (row >= rows) return;
    // The step's inputs, read before the wait (common.cuh); the partials after it.
    const int i = row / num_q_heads, h = row % num_q_heads;
    const int seq = decode_seqs[i];
    const int p = step_dims[0];
    const int live = min(num_partitions, (seq_lens[seq] + p - 1) / p);
    if (live == 1) return;  // the decode kernel wrote this row itself
    const long long out_row = (long long)query_start_loc[seq] * num_q_heads + h;
    pdl_enter();
    // Partitions COMBINE_CHUNK at a time, every load of a chunk issued before the first is
    // used: a row of a batch-1 step has 12 or more partials, and loads taken four at a
    // time made the combine a chain of six round trips. A slot past `live` reads as an
    // empty partial (max -inf, weight 0), which adds exactly 0.
    float m_max = NEG_INF;
    for (int s0 = 0; s0 < live; s0 += COMBINE_CHUNK) {
        float mv[COMBINE_CHUNK];
#pragma unroll
        for (int j = 0; j < COMBINE_CHUNK; ++j)
            mv[j] = part_ml[((long long)min(s0 + j, live - 1) * rows + row) * 2];
#pragma unroll
        for (int j = 0; j < COMBINE_CHUNK; ++j) m_max = fmaxf(m_max, mv[j]);
    }
    for (int d = threadIdx.x % row_threads; d < head_dim; d += row_threads) {
        float num = 0.f, den = 0.f;
        for (int s0 = 0; s0 < live; s0 += COMBINE_CHUNK) {
            float mv[COMBINE_CHUNK], lv[COMBINE_CHUNK], ov[COMBINE_CHUNK];
            // Slots past `live` load the last partial again (no predicate on the loads,
            // which ptxas then issues together) and count with weight 0.
#pragma unroll
            for (int j = 0; j < COMBINE_CHUNK; ++j) {
                const long long prow = (long long)min(s0 + j, live - 1) * rows + row;
                mv[j] = part_ml[prow * 2];
                lv[j] = part_ml[prow * 2 + 1];
                ov[j] = part_o[prow * head_dim + d];
            }
            // Left alone, ptxas interleaves each load with the sums that use it, a few
            // loads in flight at a time; the barrier (whole warps share a row count when a
            // row takes a multiple of 32 threads) keeps the sums after every load.
            if ((row_threads & 31) == 0) __syncwarp();
#pragma unroll
            for (int j = 0; j < COMBINE_CHUNK; ++j) {
                const float w = s0 + j < live ? dec_rescale(mv[j], m_max) : 0.f;
                den += w * lv[j];
                num += w * ov[j];
            }
        }
        out[out_row * head_dim + d] = from_f32(den > 0.f ? num / den : 0.f);
    }
}
