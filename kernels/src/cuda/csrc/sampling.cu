// Sampling on the GPU: one block per logits row, the CPU sampler's semantics
// (worker/src/sampler.rs) for every parameter it supports, so only token ids (and, when
// asked, a few logprobs) travel back to the host.
//
// `sample_tokens_ex`, per row, in the CPU sampler's order:
// 1. logits processors: the host sends a sparse list of the row's affected tokens
//    (LogitEntry, sorted by token id): logit_bias, min_tokens masking (eos and stop ids),
//    repetition penalty (tokens seen in the prompt or the output) and frequency/presence
//    penalties (output counts). The block computes each entry's processed f32 logit into
//    `values`; the sampler then reads the row through that overlay, so the logits buffer
//    is never written and the processing is done in f32 like the CPU's (not rounded to
//    the activation dtype);
// 2. greedy (first argmax) or temperature → min-p → top-k → top-p → inverse-CDF draw in
//    token-id order from a uniform the host computes per row (the seeded counter-based
//    RNG); a plain temperature row (none of the three) takes the exponential race keyed
//    by that uniform instead;
// 3. raw logprobs (of the unprocessed row, vLLM's default): the log-sum-exp normaliser in
//    f64, the sampled token's logprob and rank (how many tokens are >= it), and the top-k
//    (k <= 20) best first, ties to the lowest id.
//
// Each thread owns a contiguous chunk of the vocabulary and re-reads it in every pass
// (the row stays in L2). Thresholds are found by radix selection over order-preserving
// 32-bit keys of the scaled logits: counts for top-k, f64 probability mass for top-p.
// Ties at the top-p cut keep the lowest ids first, as the CPU's stable order does.
//
// Rows marked PATH_FAST (no entries, no logprobs) are sampled by sampling_fast.cu instead;
// their blocks here return at once. This kernel runs after the fast path, so the top-k /
// top-p rows that path hands back (path set to 0) are sampled here.

#define SAMPLE_THREADS 1024
#define FLT_MAX_F 3.402823466e+38f
#define MAX_LOGPROBS 20
#define NO_TOKEN 0x7fffffff

// LogitEntry flags.
#define ENTRY_REPEAT 1  // seen in the prompt or the output: repetition penalty
#define ENTRY_MASK 2    // min_tokens not reached: an eos or stop token, set to -inf

struct SampleRow {
    float temperature;
    int top_k;  // <= 0: off
    float top_p;
    float min_p;
    double uniform;
};

// `SampleRowEx::path` of a row sampled by sampling_fast.cu (PATH_FAST in sampling_ops.rs).
#define PATH_FAST 1

// One row of `sample_tokens_ex` (SampleRowEx in sampling_ops.rs).
struct SampleRowEx {
    SampleRow base;
    int entry_begin;  // the row's LogitEntry range, sorted by token, tokens unique
    int entry_end;
    float repetition_penalty;
    float frequency_penalty;
    float presence_penalty;
    int logprobs;       // < 0: none; else how many top logprobs (<= MAX_LOGPROBS)
    int logprobs_slot;  // this row's TokenLogprobsOut
    int path;           // PATH_FAST: sampled by sampling_fast.cu instead
};

// One (row, token) the logits processors change.
struct LogitEntry {
    int token;
    int count;       // occurrences in the output (frequency/presence penalties); 0: none
    int flags;       // ENTRY_*
    int bias_begin;  // logit_bias values biases[bias_begin..bias_end), added in order
    int bias_end;
};

struct TokenLogprobsOut {
    float logprob;  // of the sampled token
    int rank;       // 1-based: tokens whose logprob is >= the sampled one's
    int num_top;
    int top_ids[MAX_LOGPROBS];
    float top_logprobs[MAX_LOGPROBS];
};

__device__ __forceinline__ float sanitize(float x) {
    if (x != x) return NEG_INF;
    if (x == __int_as_float(0x7f800000)) return FLT_MAX_F;
    return x;
}

// Order-preserving key of a finite float (-0.0 folded into +0.0 by the caller).
__device__ __forceinline__ unsigned int order_key(float y) {
    const unsigned int b = __float_as_uint(y);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// ---- The exponential race (worker/src/exponential_race.rs, which says why and how) ----
// A plain temperature row's token is the argmax over t of y_t - ln E_t, E_t ~ Exp(1) a
// pure function of the row's uniform and t. Every f32 operation here is rounded on its
// own (__fmul_rn / __fadd_rn: no contraction into FMAs), in the CPU's order, so both get
// the same bits.
#define RACE_NOISE_BOUND 5.6f        // -ln E_t of a token whose top byte is not 0
#define RACE_TAIL_NOISE_BOUND 22.3f  // -ln E_t of any token

struct RaceKey {
    unsigned int k0, k1;
};

// lowbias32: a bijective avalanche mix.
__device__ __forceinline__ unsigned int race_mix32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

// splitmix64's finaliser (`mix64` in worker/src/sampler.rs).
__device__ __forceinline__ unsigned long long race_mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The key of a row from its uniform's 53 bits.
__device__ __forceinline__ RaceKey race_key(double uniform) {
    const unsigned long long k =
        race_mix64((unsigned long long)(uniform * 9007199254740992.0));
    return RaceKey{(unsigned int)k, (unsigned int)(k >> 32)};
}

// The hash word of tokens 4j..4j+4: byte t % 4 is token t's top byte.
__device__ __forceinline__ unsigned int race_coarse_word(RaceKey k, unsigned int j) {
    return race_mix32((j ^ k.k0) * (k.k1 | 1u));
}

__device__ __forceinline__ unsigned int race_byte_of(unsigned int word, int t) {
    return (word >> (8 * (t & 3))) & 0xffu;
}

// ln(1 + f) + e ln 2 for f in [sqrt(1/2) - 1, sqrt(2) - 1): Cephes' logf.
__device__ __forceinline__ float race_ln_core(float f, float e) {
    const float z = __fmul_rn(f, f);
    float p = 7.0376836e-2f;
    p = __fadd_rn(__fmul_rn(p, f), -1.151461e-1f);
    p = __fadd_rn(__fmul_rn(p, f), 1.1676999e-1f);
    p = __fadd_rn(__fmul_rn(p, f), -1.2420141e-1f);
    p = __fadd_rn(__fmul_rn(p, f), 1.4249323e-1f);
    p = __fadd_rn(__fmul_rn(p, f), -1.6668058e-1f);
    p = __fadd_rn(__fmul_rn(p, f), 2.0000715e-1f);
    p = __fadd_rn(__fmul_rn(p, f), -2.4999994e-1f);
    p = __fadd_rn(__fmul_rn(p, f), 3.333333e-1f);
    float y = __fmul_rn(__fmul_rn(p, f), z);
    y = __fadd_rn(y, __fmul_rn(-2.1219444e-4f, e));
    y = __fadd_rn(y, __fmul_rn(-0.5f, z));
    const float r = __fadd_rn(f, y);
    return __fadd_rn(r, __fmul_rn(0.693359375f, e));
}

// ln x of a positive, normal, finite x.
__device__ __forceinline__ float race_ln(float x) {
    const unsigned int bits = __float_as_uint(x);
    int e = (int)(bits >> 23) - 127;
    unsigned int m = (bits & 0x007fffffu) | 0x3f800000u;
    if (m > 0x3fb504f3u) {
        m -= 0x00800000u;
        e += 1;
    }
    return race_ln_core(__fsub_rn(__uint_as_float(m), 1.f), (float)e);
}

// The hash word of token t's low bits of W_t.
__device__ __forceinline__ unsigned int race_fine_word(RaceKey k, int t) {
    return race_mix32(((unsigned int)t ^ k.k1) * (k.k0 | 1u));
}

// W_t of token t from its top byte and fine word: 23 bits and a half, exact in f32.
__device__ __forceinline__ float race_w(unsigned int byte, unsigned int fine) {
    return byte == 0
        ? __fmul_rn(__fadd_rn((float)(fine >> 9), 0.5f), 4.656612873077393e-10f)  // 2^-31
        : __fmul_rn(__fadd_rn((float)((byte << 15) | (fine >> 17)), 0.5f), 1.1920928955078125e-7f);
}

// ln E_t of token t with top byte `byte`: E_t = -ln(1 - W_t).
__device__ __forceinline__ float race_ln_exponential(RaceKey k, int t, unsigned int byte) {
    const float w = race_w(byte, race_fine_word(k, t));
    const float ln_1m_w = w <= 0.2928932f ? race_ln_core(-w, 0.f) : race_ln(__fsub_rn(1.f, w));
    return race_ln(-ln_1m_w);
}

// Token t's score with scaled logit y.
__device__ __forceinline__ float race_score(RaceKey k, int t, float y, unsigned int byte) {
    return __fsub_rn(y, race_ln_exponential(k, t, byte));
}

// The lowest y a token whose noise is at most `bound` needs to possibly beat `best`.
__device__ __forceinline__ float race_score_floor(float best, float bound) {
    return __fsub_rn(__fsub_rn(best, bound), __fmul_rn(fabsf(best), 1.52587890625e-5f));
}

// The y a token with top byte `byte` needs to possibly beat `best`.
__device__ __forceinline__ float race_token_floor(float best, unsigned int byte) {
    return race_score_floor(best, byte == 0 ? RACE_TAIL_NOISE_BOUND : RACE_NOISE_BOUND);
}

template <typename T>
__device__ T warp_inclusive_scan(T v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// Exclusive prefix sum over the block in thread order; `total` gets the block's sum.
template <typename T>
__device__ T block_exclusive_scan(T v, T* total) {
    __shared__ T warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const T incl = warp_inclusive_scan(v);
    T excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0;
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T s = lane < warps ? warp_sums[lane] : (T)0;
        s = warp_inclusive_scan(s);
        warp_sums[lane] = s;
    }
    __syncthreads();
    const T base = warp == 0 ? (T)0 : warp_sums[warp - 1];
    *total = warp_sums[warps - 1];
    __syncthreads();
    return base + excl;
}

template <typename T>
__device__ T block_total(T v) {
    T total;
    block_exclusive_scan(v, &total);
    return total;
}

// Warp argmax: the largest value, ties to the lowest id; every lane gets it.
__device__ __forceinline__ void warp_argmax(float& v, int& id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oi < id)) {
            v = ov;
            id = oi;
        }
    }
}

// Block argmax (ties to the lowest id; `empty_id` marks a thread without a candidate);
// every thread gets it. Safe to call repeatedly.
__device__ void block_argmax(float& v, int& id, int empty_id) {
    __shared__ float vals[32];
    __shared__ int ids[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    warp_argmax(v, id);
    if (lane == 0) {
        vals[warp] = v;
        ids[warp] = id;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? vals[lane] : NEG_INF;
    id = lane < (int)(blockDim.x >> 5) ? ids[lane] : empty_id;
    warp_argmax(v, id);
    __syncthreads();
}

struct RowView {
    const scalar_t* x;
    int lo, hi;
    // Processed logits of the row's LogitEntry tokens (sorted by token), which replace x
    // there; e_lo is this thread's first entry at or after lo.
    const LogitEntry* ent;
    const float* val;
    int e_begin, e_end, e_lo;
    float inv_t;
    float max_y;
    double max_y_d;  // (double)max_y, converted once (a conversion issues at a quarter rate)
    double min_p;
    unsigned int topk_key;  // keep keys >= this (0: off)
    // top-p cut: keys > cut_key kept; keys == cut_key kept for the first cut_ties ids.
    bool top_p_on;
    unsigned int cut_key;
    int cut_ties;

    // The processed, sanitised logit of token t. Within a pass the thread visits its
    // tokens in increasing order with a cursor `e` that starts at e_lo.
    __device__ float logit(int t, int& e) const {
        if (e < e_end && ent[e].token == t) return val[e++];
        return sanitize(to_f32(x[t]));
    }
    // The same, for one token out of order.
    __device__ float logit_at(int t) const {
        int b = e_begin, n = e_end;
        while (b < n) {
            const int m = (b + n) >> 1;
            if (ent[m].token < t) b = m + 1;
            else n = m;
        }
        if (b < e_end && ent[b].token == t) return val[b];
        return sanitize(to_f32(x[t]));
    }
    __device__ float scaled(float v) const {
        v = sanitize(v * inv_t);
        return v == 0.f ? 0.f : v;
    }
    __device__ float y(int t, int& e) const { return scaled(logit(t, e)); }
    // The CPU's weight: exp of the difference, exact in f64.
    __device__ double weight(float v) const { return exp((double)v - max_y_d); }
    // Survives min-p, top-k and top-p. `rank` counts the ties at the top-p cut met so far
    // in id order (the first `cut_ties` of them are kept).
    __device__ bool kept(float v, int& rank) const {
        if (!base(v)) return false;
        if (!top_p_on) return true;
        const unsigned int key = order_key(v);
        if (key < cut_key) return false;
        return key != cut_key || rank++ < cut_ties;
    }
    // Survives min-p and top-k (and is finite).
    __device__ bool base(float v) const {
        if (v == NEG_INF) return false;
        if (min_p > 0.0 && weight(v) < min_p) return false;
        return order_key(v) >= topk_key;
    }
};

// The view of one row: this thread's chunk, and its first entry (entries may be null
// when e_begin == e_end).
__device__ void init_row_view(RowView& r, const scalar_t* x, int vocab, const LogitEntry* ent,
                              const float* val, int e_begin, int e_end) {
    r.x = x;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    r.lo = min(vocab, (int)threadIdx.x * chunk);
    r.hi = min(vocab, r.lo + chunk);
    r.ent = ent;
    r.val = val;
    r.e_begin = e_begin;
    r.e_end = e_end;
    int b = e_begin, n = e_end;
    while (b < n) {
        const int m = (b + n) >> 1;
        if (ent[m].token < r.lo) b = m + 1;
        else n = m;
    }
    r.e_lo = b;
    r.inv_t = 1.f;
    r.max_y = NEG_INF;
    r.max_y_d = (double)NEG_INF;
    r.min_p = 0.0;
    r.topk_key = 0;
    r.top_p_on = false;
    r.cut_key = 0;
    r.cut_ties = 0;
}

// The key of the k-th largest base candidate (radix select, 8 bits a pass).
__device__ unsigned int select_kth_key(const RowView& r, int k) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned int chosen;
    __shared__ int remaining_s;
    unsigned int prefix = 0, mask = 0;
    if (threadIdx.x == 0) remaining_s = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            if (!r.base(v)) continue;
            const unsigned int key = order_key(v);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int remaining = remaining_s;
            unsigned int cum = 0, digit = 0;
            for (int b = 255; b >= 0; --b) {
                if (cum + hist[b] >= (unsigned int)remaining) {
                    digit = b;
                    remaining -= cum;
                    break;
                }
                cum += hist[b];
            }
            remaining_s = remaining;
            chosen = digit;
        }
        __syncthreads();
        prefix |= chosen << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

// The top-p cut: the key whose tie group first brings the sorted mass to `target`, the
// mass strictly above it, and how many of its ties (lowest ids first) are kept.
__device__ void select_top_p_cut(RowView& r, double target) {
    __shared__ double hist[256];
    __shared__ unsigned int chosen;
    __shared__ double above_s;
    unsigned int prefix = 0, mask = 0;
    if (threadIdx.x == 0) above_s = 0.0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0.0;
        __syncthreads();
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            if (!r.base(v)) continue;
            const unsigned int key = order_key(v);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], r.weight(v));
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double cum = above_s;
            int digit = -1, last_nonempty = -1;
            double before_last = cum;
            for (int b = 255; b >= 0; --b) {
                if (hist[b] == 0.0) continue;
                if (cum + hist[b] >= target) {
                    digit = b;
                    break;
                }
                last_nonempty = b;
                before_last = cum;
                cum += hist[b];
            }
            if (digit < 0) {  // rounding left the target above everything: keep it all
                digit = last_nonempty < 0 ? 0 : last_nonempty;
                cum = before_last;
            }
            above_s = cum;
            chosen = (unsigned int)digit;
        }
        __syncthreads();
        prefix |= chosen << shift;
        mask |= 255u << shift;
    }
    int ties = 0;
    float tie_value = 0.f;
    {
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            if (r.base(v) && order_key(v) == prefix) {
                ++ties;
                tie_value = v;
            }
        }
    }
    __shared__ float tie_value_s;
    if (ties > 0) tie_value_s = tie_value;  // every writer writes the same value
    const int total_ties = block_total(ties);
    __shared__ int keep_s;
    if (threadIdx.x == 0) {
        // The CPU adds the tied weights one by one in id order; so do we.
        const double w = r.weight(tie_value_s);
        double mass = above_s;
        int keep = 0;
        while (keep < total_ties) {
            mass += w;
            ++keep;
            if (mass >= target) break;
        }
        keep_s = keep;
    }
    __syncthreads();
    r.cut_key = prefix;
    r.cut_ties = keep_s;
}

// The exponential race over the row (some y finite): every token's score, no pruning.
__device__ int race_token(const RowView& r, double uniform, int vocab) {
    const RaceKey key = race_key(uniform);
    float best = NEG_INF;
    int best_id = vocab;
    int e = r.e_lo;
    for (int t = r.lo; t < r.hi; ++t) {
        const float y = r.y(t, e);
        if (y == NEG_INF) continue;
        const float s = race_score(key, t, y, race_byte_of(race_coarse_word(key, t >> 2), t));
        if (best_id == vocab || s > best) {
            best = s;
            best_id = t;
        }
    }
    block_argmax(best, best_id, vocab);
    return best_id;
}

// The token of one row (the same value in every thread of the block).
__device__ int choose_token(RowView& r, const SampleRow& p, int vocab) {
    // Argmax of the processed row, ties to the lowest id: the greedy token and the
    // fallback of every other path.
    float best = NEG_INF;
    int best_id = vocab;
    {
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.logit(t, e);
            if (v > best || best_id == vocab) {
                best = v;
                best_id = t;
            }
        }
    }
    block_argmax(best, best_id, vocab);
    const int fallback = best_id >= vocab ? 0 : best_id;
    if (p.temperature < 1e-5f) return fallback;
    r.inv_t = 1.f / p.temperature;
    r.min_p = p.min_p > 0.f ? (double)p.min_p : 0.0;
    r.max_y = r.scaled(r.logit_at(fallback));
    r.max_y_d = (double)r.max_y;
    if (r.max_y == NEG_INF) return fallback;
    if (p.top_k <= 0 && !(p.top_p < 1.f) && !(r.min_p > 0.0)) return race_token(r, p.uniform, vocab);

    if (p.top_k > 0) {
        int count = 0;
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) count += r.base(r.y(t, e)) ? 1 : 0;
        if (p.top_k < block_total(count)) r.topk_key = select_kth_key(r, p.top_k);
    }
    if (p.top_p < 1.f) {
        double mass = 0.0;
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            if (r.base(v)) mass += r.weight(v);
        }
        const double total = block_total(mass);
        select_top_p_cut(r, (double)p.top_p * total);
        r.top_p_on = true;
    }

    // Rank of this chunk's first tie at the top-p cut, in id order.
    int tie_rank = 0;
    if (r.top_p_on) {
        int ties = 0;
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            ties += (r.base(v) && order_key(v) == r.cut_key) ? 1 : 0;
        }
        int unused;
        tie_rank = block_exclusive_scan(ties, &unused);
    }
    // Mass of the kept tokens of this chunk, then the inverse CDF in id order.
    double mass = 0.0;
    int last_kept = -1;
    {
        int rank = tie_rank;
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            if (!r.kept(v, rank)) continue;
            const double w = r.weight(v);
            mass += w;
            if (w > 0.0) last_kept = t;
        }
    }
    double total;
    const double before = block_exclusive_scan(mass, &total);
    __shared__ int answer;
    __shared__ int last_any;
    __shared__ int token_s;
    if (threadIdx.x == 0) {
        answer = -1;
        last_any = -1;
    }
    __syncthreads();
    if (last_kept >= 0) atomicMax(&last_any, last_kept);
    const bool ok = total > 0.0 && total < 1.0e308;
    const double target = p.uniform * total;
    if (ok && mass > 0.0 && before <= target && target < before + mass) {
        double acc = before;
        int rank = tie_rank;
        int e = r.e_lo;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t, e);
            if (!r.kept(v, rank)) continue;
            acc += r.weight(v);
            if (acc > target) {
                answer = t;
                break;
            }
        }
        if (answer < 0) answer = last_kept;  // rounding at the chunk's end
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int token = answer;
        if (!ok) token = fallback;
        else if (token < 0) token = last_any >= 0 ? last_any : fallback;
        token_s = token;
    }
    __syncthreads();
    return token_s;
}

// The row's logits processors, in the CPU sampler's order and f32 arithmetic (no fused
// multiply-adds): sanitise → logit_bias → min_tokens → repetition → frequency/presence →
// sanitise. One thread per entry; ends with a barrier, so the block sees every value.
__device__ void process_entries(const scalar_t* x, const SampleRowEx& p,
                                const LogitEntry* __restrict__ ent,
                                const float* __restrict__ biases, float* values) {
    for (int e = p.entry_begin + (int)threadIdx.x; e < p.entry_end; e += blockDim.x) {
        const LogitEntry en = ent[e];
        float v = sanitize(to_f32(x[en.token]));
        for (int b = en.bias_begin; b < en.bias_end; ++b) v = __fadd_rn(v, biases[b]);
        if (en.flags & ENTRY_MASK) v = NEG_INF;
        if (en.flags & ENTRY_REPEAT) {
            const float rp = p.repetition_penalty;
            v = v > 0.f ? __fdiv_rn(v, rp) : __fmul_rn(v, rp);
        }
        if (en.count > 0) {
            const float pen = __fadd_rn(__fmul_rn(p.frequency_penalty, (float)en.count),
                                        p.presence_penalty);
            v = __fsub_rn(v, pen);
        }
        values[e] = sanitize(v);
    }
    __syncthreads();
}

// log p of a raw logit given the row's log-sum-exp; -inf rather than NaN for a row
// without a distribution, as the CPU.
__device__ __forceinline__ float raw_logprob(float v, double lse) {
    const double d = (double)v - lse;
    return d != d ? NEG_INF : (float)d;
}

// Raw logprobs of one row (the unprocessed, sanitised logits): the normaliser, the
// sampled token's logprob and rank, and the top k best first, ties to the lowest id.
// Each thread keeps its chunk's top k (a sorted list), then k rounds of a block argmax
// over the lists' heads merge them.
__device__ void row_logprobs(const scalar_t* x, int lo, int hi, int token, int k,
                             TokenLogprobsOut* out) {
    k = max(0, min(k, MAX_LOGPROBS));
    float tv[MAX_LOGPROBS];
    int ti[MAX_LOGPROBS];
    int n = 0;
    float mx = NEG_INF;
    for (int t = lo; t < hi; ++t) {
        const float v = sanitize(to_f32(x[t]));
        mx = fmaxf(mx, v);
        // Ids arrive in increasing order, so an equal value never displaces a kept one.
        if (k == 0 || (n == k && !(v > tv[k - 1]))) continue;
        int pos = n < k ? n : k - 1;
        while (pos > 0 && v > tv[pos - 1]) {
            tv[pos] = tv[pos - 1];
            ti[pos] = ti[pos - 1];
            --pos;
        }
        tv[pos] = v;
        ti[pos] = t;
        if (n < k) ++n;
    }
    mx = block_max(mx);
    const float sampled = sanitize(to_f32(x[token]));
    double sum = 0.0;
    int at_least = 0;
    for (int t = lo; t < hi; ++t) {
        const float v = sanitize(to_f32(x[t]));
        if (mx != NEG_INF) sum += exp((double)(v - mx));
        at_least += v >= sampled ? 1 : 0;
    }
    sum = block_total(sum);
    at_least = block_total(at_least);
    const double lse = mx == NEG_INF ? (double)NEG_INF : (double)mx + log(sum);

    int head = 0, num_top = 0;
    for (int round = 0; round < k; ++round) {
        float bv = head < n ? tv[head] : NEG_INF;
        int bi = head < n ? ti[head] : NO_TOKEN;
        block_argmax(bv, bi, NO_TOKEN);
        if (bi == NO_TOKEN) break;  // fewer tokens than k
        if (head < n && ti[head] == bi) ++head;
        if (threadIdx.x == 0) {
            out->top_ids[round] = bi;
            out->top_logprobs[round] = raw_logprob(bv, lse);
        }
        num_top = round + 1;
    }
    if (threadIdx.x == 0) {
        out->logprob = raw_logprob(sampled, lse);
        out->rank = max(at_least, 1);
        out->num_top = num_top;
    }
}

// Every parameter: logits processors through `entries` (processed values written to
// `values`, one per entry), sampling, and raw logprobs for rows with logprobs >= 0.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_tokens_ex(const scalar_t* __restrict__ logits, int vocab,
                     const SampleRowEx* __restrict__ params,
                     const LogitEntry* __restrict__ entries, const float* __restrict__ biases,
                     float* values, int* __restrict__ out_tokens,
                     TokenLogprobsOut* __restrict__ out_logprobs) {
    pdl_enter();
    const int row = blockIdx.x;
    const SampleRowEx p = params[row];
    if (p.path == PATH_FAST) return;  // sampling_fast.cu's row
    const scalar_t* x = logits + (long long)row * vocab;
    process_entries(x, p, entries, biases, values);
    RowView r;
    init_row_view(r, x, vocab, entries, values, p.entry_begin, p.entry_end);
    const int token = choose_token(r, p.base, vocab);
    if (threadIdx.x == 0) out_tokens[row] = token;
    if (p.logprobs >= 0) row_logprobs(x, r.lo, r.hi, token, p.logprobs, out_logprobs + p.logprobs_slot);
}
