// Paged attention: one kernel for prefill chunks, prefix-cache hits and decode, reading
// K and V through each sequence's block table (the semantics of the CPU reference
// `cpu::attention::paged_attention`: query token j of a sequence with `context_len`
// cached tokens attends causally to keys 0..=context_len + j).
//
// Work unit: a tile of up to ATT_ROWS query rows = consecutive query tokens of one
// sequence × the q heads of one GQA group, so each K/V row is read once per tile and
// shared by every head of its group. Grid: (tile, kv head, split). Keys stream through
// shared memory ATT_KEYS at a time (one key per lane), with an f32 online softmax.
// Long contexts with few tiles (decode) are split over the keys: each split writes an
// unnormalised partial (o, m, l) and `paged_attention_combine` merges them.
//
// First version on CUDA cores; the tensor-core (mma) prefill path comes later.

#define ATT_WARPS 4
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_ROWS 16
#define ATT_ROWS_PER_WARP (ATT_ROWS / ATT_WARPS)
#define ATT_KEYS 32

// The cache slot of key `k` of a sequence, through its block table row.
__device__ __forceinline__ long long cache_slot(const int* table, int k, int block_size) {
    return (long long)table[k / block_size] * block_size + k % block_size;
}

struct AttentionArgs {
    const scalar_t* q;          // [T, Hq, D]
    const scalar_t* key_cache;  // [num_blocks, block_size, Hkv, D]
    const scalar_t* value_cache;
    const int* block_tables;    // [num_seqs, max_blocks_per_seq]
    const int* seq_lens;        // [num_seqs]
    const int* query_start_loc; // [num_seqs + 1]
    const int* tile_seq;        // [num_tiles] sequence of each tile
    const int* tile_token;      // [num_tiles] first query token (batch index) of each tile
    scalar_t* out;              // [T, Hq, D]            (num_splits == 1)
    float* part_o;              // [splits, T, Hq, D]    (num_splits > 1)
    float* part_ml;             // [splits, T, Hq, 2]
    const int* step_dims;       // [1]: the block tables' row width (attention_decode.cu)
    int num_tokens;
    int num_q_heads;
    int num_kv_heads;
    int block_size;
    int tokens_per_tile;
    int split_keys;
    float scale;
};

template <int D>
__device__ void paged_attention_tile(const AttentionArgs& a) {
    // Output columns per lane: lane + 32 * j; for D < 32 the upper lanes own none.
    constexpr int PER_LANE = D >= 32 ? D / 32 : 1;
    const bool owns_col = D >= 32 || (threadIdx.x & 31) < D;
    __shared__ float sq[ATT_ROWS][D];
    __shared__ float sk[ATT_KEYS][D + 1];
    __shared__ float sv[ATT_KEYS][D];

    const int tile = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seq = a.tile_seq[tile];
    const int t0 = a.tile_token[tile];
    const int q_begin = a.query_start_loc[seq], q_end = a.query_start_loc[seq + 1];
    const int context_len = a.seq_lens[seq] - (q_end - q_begin);
    const int ntok = min(a.tokens_per_tile, q_end - t0);
    const int group = a.num_q_heads / a.num_kv_heads;
    const int rows = ntok * group;
    // Keys the tile's last token sees (exclusive end), then this split's share.
    const int tile_keys = context_len + (t0 - q_begin) + ntok;
    const int k_begin = split * a.split_keys;
    const int k_end = min(tile_keys, k_begin + a.split_keys);
    const int* table = a.block_tables + (long long)seq * a.step_dims[1];
    const long long kv_row = (long long)a.num_kv_heads * D;

    for (int i = tid; i < ATT_ROWS * D; i += ATT_THREADS) {
        const int r = i / D, d = i - r * D;
        float v = 0.f;
        if (r < rows) {
            const int t = t0 + r / group, h = kvh * group + r % group;
            v = to_f32(a.q[((long long)t * a.num_q_heads + h) * D + d]) * a.scale;
        }
        sq[r][d] = v;
    }

    float m[ATT_ROWS_PER_WARP], l[ATT_ROWS_PER_WARP], acc[ATT_ROWS_PER_WARP][PER_LANE];
    int limit[ATT_ROWS_PER_WARP];  // keys < limit are visible to the row (causal)
#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; ++i) {
        const int r = warp + ATT_WARPS * i;
        m[i] = NEG_INF;
        l[i] = 0.f;
        limit[i] = r < rows ? context_len + (t0 - q_begin) + r / group + 1 : 0;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) acc[i][j] = 0.f;
    }

    for (int c0 = k_begin; c0 < k_end; c0 += ATT_KEYS) {
        __syncthreads();  // the previous chunk is consumed (and sq is written)
        for (int i = tid; i < ATT_KEYS * (D / 4); i += ATT_THREADS) {
            const int c = i / (D / 4), d = (i - c * (D / 4)) * 4;
            const int p = c0 + c;
            float kv[4] = {0.f, 0.f, 0.f, 0.f}, vv[4] = {0.f, 0.f, 0.f, 0.f};
            if (p < k_end) {
                const long long slot = cache_slot(table, p, a.block_size);
                const long long off = slot * kv_row + (long long)kvh * D + d;
                load4(a.key_cache + off, kv);
                load4(a.value_cache + off, vv);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                sk[c][d + e] = kv[e];
                sv[c][d + e] = vv[e];
            }
        }
        __syncthreads();

        const int p = c0 + lane;
        float prob[ATT_ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < ATT_ROWS_PER_WARP; ++i) {
            const int r = warp + ATT_WARPS * i;
            prob[i] = 0.f;
            if (r >= rows) continue;  // uniform across the warp
            float dot = 0.f;
#pragma unroll 8
            for (int d = 0; d < D; ++d) dot += sq[r][d] * sk[lane][d];
            const float score = (p < k_end && p < limit[i]) ? dot : NEG_INF;
            const float m_new = fmaxf(m[i], warp_max(score));
            if (m_new == NEG_INF) continue;  // nothing visible yet in this row
            const float alpha = __expf(m[i] - m_new);  // exp(-inf) = 0 on the first chunk
            prob[i] = __expf(score - m_new);
            l[i] = l[i] * alpha + warp_sum(prob[i]);
            m[i] = m_new;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) acc[i][j] *= alpha;
        }
#pragma unroll
        for (int i = 0; i < ATT_ROWS_PER_WARP; ++i) {
            const int r = warp + ATT_WARPS * i;
            if (r >= rows) continue;
            for (int c = 0; c < ATT_KEYS; ++c) {
                const float pc = __shfl_sync(0xffffffffu, prob[i], c);
                if (!owns_col) continue;
#pragma unroll
                for (int j = 0; j < PER_LANE; ++j) acc[i][j] += pc * sv[c][lane + 32 * j];
            }
        }
    }

#pragma unroll
    for (int i = 0; i < ATT_ROWS_PER_WARP; ++i) {
        const int r = warp + ATT_WARPS * i;
        if (r >= rows) continue;
        const int t = t0 + r / group, h = kvh * group + r % group;
        const long long row = (long long)t * a.num_q_heads + h;
        if (gridDim.z == 1) {
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j)
                if (owns_col) a.out[row * D + lane + 32 * j] = from_f32(acc[i][j] * inv);
        } else {
            const long long prow = (long long)split * a.num_tokens * a.num_q_heads + row;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j)
                if (owns_col) a.part_o[prow * D + lane + 32 * j] = acc[i][j];
            if (lane == 0) {
                a.part_ml[prow * 2] = m[i];
                a.part_ml[prow * 2 + 1] = l[i];
            }
        }
    }
}

HEAD_DIM_KERNELS(paged_attention, paged_attention_tile, ATT_THREADS, AttentionArgs)

// Merges the splits' partials of every (token, q head): one block of head_dim threads.
extern "C" __global__ void paged_attention_combine(const float* __restrict__ part_o,
                                                   const float* __restrict__ part_ml,
                                                   scalar_t* __restrict__ out, int num_rows,
                                                   int head_dim, int num_splits) {
    pdl_enter();
    const long long row = blockIdx.x;
    float m_max = NEG_INF;
    for (int s = 0; s < num_splits; ++s)
        m_max = fmaxf(m_max, part_ml[((long long)s * num_rows + row) * 2]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int s = 0; s < num_splits; ++s) {
            const long long prow = (long long)s * num_rows + row;
            const float ms = part_ml[prow * 2];
            if (ms == NEG_INF) continue;  // this split saw no key of the row
            const float w = __expf(ms - m_max);
            den += w * part_ml[prow * 2 + 1];
            num += w * part_o[prow * head_dim + d];
        }
        out[row * head_dim + d] = from_f32(den > 0.f ? num / den : 0.f);
    }
}
