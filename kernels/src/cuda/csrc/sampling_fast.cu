// The fast path of GPU sampling: rows without logits processors or logprobs, greedy or
// temperature (+ min-p) sampling, each row split over many blocks so that a decode batch
// fills every SM with 16-byte loads in flight (sampling.cu's one block per row left most
// of the memory system idle). Same semantics as `sample_tokens_ex` and the CPU sampler
// (worker/src/sampler.rs): first argmax; a plain temperature row's exponential race
// (worker/src/exponential_race.rs); for min-p, weights exp((double)y - (double)max_y) of
// the scaled logits y, those below min_p dropped, and the inverse CDF in token-id order
// from the host's uniform, f64 accumulation; the same fallbacks at the rounding edges.
//
// Each launch is over (row, chunk of FAST_CHUNK tokens; DRAW_CHUNK in `sample_fast_draw`,
// MAX_CHUNK in `sample_fast_max`) blocks; the last block of a row to finish (an atomic
// counter per row, reset by that block for the next launch) reduces the row's chunk
// results, so nothing waits on another block:
// 1. `sample_fast_max`: chunk argmax → the row's argmax (the greedy token, and the fallback
//    and max_y of min-p rows), the chunks' maxima merged by a 64-bit atomic max and the
//    row's last block reading the result. `sample_fast_max_race`, the same for batches
//    with plain temperature rows (no min-p, top-k or top-p), races those: the chunk's
//    best score instead of its maximum logit, so the merged key is the row's token.
// 2. `sample_fast_draw` (min-p rows, which need max_y before any weight): chunk mass of
//    the kept tokens → the same search and walk.
// Batches with top-k / top-p rows use `sample_fast_top` and `sample_fast_draw_top`
// instead, the same work plus those rows' candidates and merge (below); the second
// launch only when some row needs it.
// Rows with `path != PATH_FAST` are left to `sample_tokens_ex` (launched after these, so
// it also samples the top rows handed back), and the reverse.

#define FAST_THREADS 256
// 16,384 rather than 8,192: half the blocks, each row's partials and last-block finish
// half as many, which took 4-30 % off the max and top kernels on the H100
// (docs/BENCHMARKS.md). `sample_fast_draw` (min-p rows) keeps 8,192: at 16,384 it ran
// 10-22 % slower, whether it held its chunk whole or in two parts (its row's walk of the
// chosen chunk, by one block, doubles). `sample_fast_max`, whose blocks have no tail but
// thread 0's, is fastest at 8,192 too (32 registers: 8 blocks an SM; docs/BENCHMARKS.md).
#define FAST_CHUNK 16384
#define DRAW_CHUNK 8192
#define MAX_CHUNK 8192
// Elements of one 16-byte load.
#define FAST_VEC (16 / (int)sizeof(scalar_t))

// exp(x) for -708 <= x <= 0, within a few ulp of the libm value, with about half the
// double-precision instructions of exp() and no branch: a weight pass is bound by the
// SM's f64 pipe, not by memory. 2^(j/64) comes from `tab` (j < 64, in shared memory).
__device__ __forceinline__ double exp_core(double x, const double* tab) {
    // k = rint(x · 64/ln2) by the 1.5·2^52 shifter: k is the low word, no rounding or
    // float-to-int instruction.
    const double shifted = fma(x, 92.332482616893656, 6755399441055744.0);
    const int k = __double2loint(shifted);
    const double kd = shifted - 6755399441055744.0;
    // ln2/64 split so that kd * hi is exact (fdlibm's ln2_hi has 20 trailing zero bits).
    const double r0 = fma(kd, -6.93147180369123816490e-01 / 64.0, x);
    const double r = fma(kd, -1.90821492927058770002e-10 / 64.0, r0);  // |r| <= ln2/128
    // Degree 5: r^6/720 < 3.5e-17, a sixth of an ulp of the result.
    double p = 1.0 / 120.0;
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    // 2^(k/64) = tab[k mod 64] · 2^floor(k/64): the power of two added to the exponent
    // field (no underflow: k/64 >= -1022 here).
    const double t = tab[k & 63];
    const double scaled = __hiloint2double(__double2hiint(t) + ((k >> 6) << 20), __double2loint(t));
    return p * scaled;
}

// exp(x) for x <= 0, the library's care near underflow.
__device__ __forceinline__ double exp_neg(double x, const double* tab) {
    return x < -700.0 ? exp(x) : exp_core(x, tab);
}

__device__ __forceinline__ void fill_exp_table(double* tab) {
    if (threadIdx.x < 64) tab[threadIdx.x] = exp2((double)threadIdx.x / 64.0);
    __syncthreads();
}

// 16-byte vectors of a full chunk a thread loads.
#define FAST_PER (FAST_CHUNK / FAST_VEC / FAST_THREADS)
#define DRAW_PER (DRAW_CHUNK / FAST_VEC / FAST_THREADS)
#define MAX_PER (MAX_CHUNK / FAST_VEC / FAST_THREADS)

// The first token of this thread's k-th 16-byte vector of a chunk starting at lo.
__device__ __forceinline__ int vector_token(int lo, int k) {
    return lo + (k * FAST_THREADS + (int)threadIdx.x) * FAST_VEC;
}

// This thread's 16-byte vectors of [lo, hi): threads interleave in vectors, so that a
// warp's loads are coalesced, all issued before the first use (none past hi: the row is
// whole vectors). STREAMED: past L1 (`load_streamed`).
template <int N, bool STREAMED = false>
__device__ __forceinline__ void load_vectors(const scalar_t* __restrict__ x, int lo, int hi,
                                             uint4 (&raw)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int t0 = vector_token(lo, k);
        const uint4* v = reinterpret_cast<const uint4*>(x + t0);
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        if (STREAMED) raw[k] = t0 < hi ? load_streamed(v) : zero;
        else raw[k] = t0 < hi ? *v : zero;
    }
}

// Calls f(t, raw logit) for this thread's tokens of [lo, hi) held in `raw`, in increasing
// id order.
template <int N, typename F>
__device__ __forceinline__ void for_vectors(const uint4 (&raw)[N], int lo, int hi, F f) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int t0 = vector_token(lo, k);
        if (t0 >= hi) break;
        const scalar_t* v = (const scalar_t*)&raw[k];
#pragma unroll
        for (int j = 0; j < FAST_VEC; ++j) f(t0 + j, to_f32(v[j]));
    }
}

// Calls f(t, raw logit) for this thread's tokens of one chunk (N vectors a thread:
// FAST_PER or DRAW_PER) in increasing id order: from the registers `cur` (`vec`), or
// loaded one at a time (rows that are not whole, aligned 16-byte vectors).
template <int N = FAST_PER>
struct ChunkTokens {
    const uint4 (&cur)[N];
    const scalar_t* x;
    int lo, hi;
    bool vec;
    template <typename F>
    __device__ __forceinline__ void operator()(F f) const {
        if (vec) for_vectors(cur, lo, hi, f);
        else for (int t = lo + (int)threadIdx.x; t < hi; t += blockDim.x) f(t, to_f32(x[t]));
    }
    // The thread's first token (NO_TOKEN: none).
    __device__ __forceinline__ int first() const {
        const int t = lo + (int)threadIdx.x * (vec ? FAST_VEC : 1);
        return t < hi ? t : NO_TOKEN;
    }
};

// The chunk's first argmax of the sanitised logits (every thread gets it). Compared raw:
// a NaN is never larger and +inf is larger than any finite logit, as after sanitize,
// unless a finite logit equals +inf's stand-in FLT_MAX (f32 logits only): a chunk whose
// maximum is +inf is compared again, sanitised. A thread's first token stands for its
// all -inf / NaN tokens, so that such a chunk gives its first token, as the CPU.
template <int N>
__device__ __forceinline__ void block_chunk_argmax(const ChunkTokens<N>& visit, float& best,
                                                   int& best_id) {
    best = NEG_INF;
    best_id = NO_TOKEN;
    visit([&](int t, float raw) {
        if (raw > best) {
            best = raw;
            best_id = t;
        }
    });
    if (best_id == NO_TOKEN) best_id = visit.first();
    block_argmax(best, best_id, NO_TOKEN);
    if (best != __int_as_float(0x7f800000)) return;
    best = NEG_INF;
    best_id = NO_TOKEN;
    visit([&](int t, float raw) {
        const float v = sanitize(raw);
        if (v > best || best_id == NO_TOKEN) {
            best = v;
            best_id = t;
        }
    });
    block_argmax(best, best_id, NO_TOKEN);
}

// The tokens of chunk `chunk` of `row`, chunks of N vectors a thread. Where the rows are
// whole, aligned vectors, its vectors are loaded into `raw` here, or by the caller later
// when not `load`.
template <int N = FAST_PER, bool STREAMED = false>
__device__ __forceinline__ ChunkTokens<N> chunk_tokens(const scalar_t* __restrict__ logits,
                                                      int vocab, int row, int chunk,
                                                      uint4 (&raw)[N], bool load = true) {
    constexpr int len = N * FAST_VEC * FAST_THREADS;
    const scalar_t* x = logits + (long long)row * vocab;
    const int lo = chunk * len, hi = min(vocab, lo + len);
    const bool vec = vocab % FAST_VEC == 0 && aligned16(logits) && blockDim.x == FAST_THREADS;
    if (vec && load) load_vectors<N, STREAMED>(x, lo, hi, raw);
    return ChunkTokens<N>{raw, x, lo, hi, vec};
}

// One thread counts its block in to the row's `counter`: true for the row's last block,
// which puts the counter back at 0 for the next launch. The count releases the thread's
// earlier writes (and those a block barrier ordered before them), and in the last block
// acquires every other block's: no separate fences (__threadfence() is sequentially
// consistent, and cost greedy sampling 0.4 µs a launch on the H100).
__device__ __forceinline__ bool counts_in_last(unsigned int* counter, int chunks) {
    const bool last = atom_add_acq_rel(counter, 1u) == (unsigned int)chunks - 1;
    if (last) *counter = 0;
    return last;
}

// True in every thread of the block that finishes its row last. The block's earlier global
// writes are visible to that block; `counter` is back at 0 for the next launch.
__device__ bool last_block_of_row(unsigned int* counter, int chunks) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) last = counts_in_last(counter, chunks);
    __syncthreads();
    return last;
}

__device__ __forceinline__ float fast_scaled(float v, float inv_t) {
    v = sanitize(__fmul_rn(v, inv_t));
    return v == 0.f ? 0.f : v;
}

// A row the merge samples: a draw with top-k or top-p on (as the kernels test them).
__device__ __forceinline__ bool is_top_row(const SampleRow& p) {
    return !(p.temperature < 1e-5f) && (p.top_k > 0 || p.top_p < 1.f);
}

// A row drawn by the exponential race: temperature without min-p, top-k or top-p
// (`SampleRowEx::races` on the host).
__device__ __forceinline__ bool race_row(const SampleRow& p) {
    return !(p.temperature < 1e-5f) && !(p.min_p > 0.f) && !is_top_row(p);
}

// The first argmax of a row's sanitised logits, by one thread: a race row's token when
// none of its scaled logits is finite (only logits that overflow as they are scaled leave
// that), as the CPU's fallback; never on a hot path.
__device__ int row_first_argmax(const scalar_t* __restrict__ x, int vocab) {
    float best = NEG_INF;
    int id = 0;
    for (int t = 0; t < vocab; ++t) {
        const float v = sanitize(to_f32(x[t]));
        if (v > best) {
            best = v;
            id = t;
        }
    }
    return id;
}

// A row whose argmax `id` (logit m) is known: where `write`, the greedy token, or the
// draw's fallback and max_y (NEG_INF: the token is written, nothing left to draw).
// A race row's (m, id) is its winner (score, token), whose token is written (not in a
// batch without race rows: RACES false keeps that branch out of `sample_fast_max`'s
// registers). Returns max_y.
template <bool RACES = true>
__device__ __forceinline__ float finish_row(int row, float m, int id, const SampleRow& p,
                                            bool write, const scalar_t* __restrict__ x,
                                            int vocab, float* row_max, int* row_fallback,
                                            int* out_tokens) {
    if (RACES && race_row(p)) {
        if (write) {
            out_tokens[row] = m == NEG_INF ? row_first_argmax(x, vocab) : id;
            row_max[row] = NEG_INF;
        }
        return NEG_INF;
    }
    const float max_y = p.temperature < 1e-5f ? NEG_INF : fast_scaled(m, 1.f / p.temperature);
    if (write) {
        row_fallback[row] = id;
        row_max[row] = max_y;
        // Greedy, or nothing finite: the argmax, as the CPU.
        if (max_y == NEG_INF) out_tokens[row] = id;
    }
    return max_y;
}

// Warp 0 of a row's last block: the row's argmax from its chunks' partials, a lane a
// chunk so that their loads are in flight together (ids rise with the chunk, so the warp
// argmax's ties to the lowest id keep the row's first maximum). Lane 0 writes the greedy
// token, or the draw's fallback and max_y (NEG_INF: the token is written, nothing left to
// draw). Every lane gets max_y.
__device__ float finish_row_max(int row, int chunks, const float* part_val, const int* part_id,
                                const SampleRow& p, const scalar_t* __restrict__ x, int vocab,
                                float* row_max, int* row_fallback, int* out_tokens) {
    const long long base = (long long)row * chunks;
    float m = NEG_INF;
    int id = NO_TOKEN;
    for (int c = (int)threadIdx.x; c < chunks; c += 32) {
        const float v = __ldcg(part_val + base + c);
        const int i = __ldcg(part_id + base + c);
        if (v > m || id == NO_TOKEN) {
            m = v;
            id = i;
        }
    }
    warp_argmax(m, id);
    return finish_row(row, m, id, p, threadIdx.x == 0, x, vocab, row_max, row_fallback,
                      out_tokens);
}

// After a chunk's argmax: thread 0 records it, and in the row's last block warp 0 finishes
// the row (`finish_row_max`). False in every other block; in the last, true with the row's
// max_y in every thread.
__device__ __forceinline__ bool record_chunk_max(int row, int chunk, int chunks, float best,
                                                 int best_id, const SampleRow& p,
                                                 const scalar_t* __restrict__ x, int vocab,
                                                 float* part_val, int* part_id,
                                                 unsigned int* counters, float* row_max,
                                                 int* row_fallback, int* out_tokens,
                                                 float& max_y) {
    const long long slot = (long long)row * chunks + chunk;
    if (threadIdx.x == 0) {
        part_val[slot] = best;
        part_id[slot] = best_id;
    }
    if (!last_block_of_row(&counters[row], chunks)) return false;
    __shared__ float max_y_s;
    if (threadIdx.x < 32) {
        const float y =
            finish_row_max(row, chunks, part_val, part_id, p, x, vocab, row_max, row_fallback,
                           out_tokens);
        if (threadIdx.x == 0) max_y_s = y;
    }
    __syncthreads();
    max_y = max_y_s;
    return true;
}

// The kept weight of one scaled logit (0: dropped), and whether it counts as kept.
__device__ __forceinline__ bool fast_weight(float raw, float inv_t, float max_y, double min_p,
                                            const double* tab, double& w) {
    const float y = fast_scaled(sanitize(raw), inv_t);
    if (y == NEG_INF) return false;
    w = exp_neg((double)y - (double)max_y, tab);
    return !(min_p > 0.0 && w < min_p);
}

// ---- sample_fast_max: one block per (row, chunk). ----

// Every fast launch lays its grid out as (chunk, row): a row's chunks are consecutive
// blocks, so rows finish, and draw or merge, while later rows still stream.
__device__ __forceinline__ void fast_block(int& row, int& chunk, int& chunks) {
    row = blockIdx.y;
    chunk = blockIdx.x;
    chunks = gridDim.x;
}

// The largest `v` (>= -1) of the block (every thread gets it).
__device__ __forceinline__ int block_max_int(int v) {
    __shared__ int m;
    if (threadIdx.x == 0) m = -1;
    __syncthreads();
    atomicMax(&m, v);
    __syncthreads();
    const int r = m;
    __syncthreads();
    return r;
}

// The row's draw from its chunks' masses of kept tokens, `part_mass`: the total, the chunk
// holding the target u·total, and that chunk walked in id order with the CPU's weights;
// when rounding leaves the target past every weight, the last kept token, as the CPU.
// Writes out_tokens[row]. The whole block.
__device__ void draw_row(int row, int chunks, int chunk_len, int vocab,
                         const scalar_t* __restrict__ x, const SampleRow& p, float max_y,
                         int fallback, const double* part_mass, const int* part_last,
                         const double* tab, int* __restrict__ out_tokens) {
    const float inv_t = 1.f / p.temperature;
    const double min_p = p.min_p > 0.f ? (double)p.min_p : 0.0;
    const long long base = (long long)row * chunks;
    __shared__ int found_s, token_s;
    __shared__ double before_s, target_s;
    if (threadIdx.x < 32) {
        // A lane a chunk, 32 at a time: chunk c holds [start, end) of the row's cumulative
        // mass, start the scan of the chunks before it; the segments' ends tile exactly.
        const int lane = threadIdx.x;
        const auto mass_of = [&](int c) {
            return c < chunks ? __ldcg(part_mass + base + c) : 0.0;
        };
        const auto scan = [&](double m, double running, double& start, double& end) {
            const double incl = warp_inclusive_scan(m);
            const double excl = __shfl_up_sync(0xffffffffu, incl, 1);
            start = running + (lane == 0 ? 0.0 : excl);
            end = running + incl;
            return __shfl_sync(0xffffffffu, end, 31);
        };
        // The total first, summed as the search below sums it.
        double total = 0.0, start, end;
        int last_any = -1;
        for (int c0 = 0; c0 < chunks; c0 += 32) {
            const double m = mass_of(c0 + lane);
            total = scan(m, total, start, end);
            if (m > 0.0) last_any = max(last_any, __ldcg(part_last + base + c0 + lane));
        }
        last_any = __reduce_max_sync(0xffffffffu, last_any);
        const bool ok = total > 0.0 && total < 1.0e308;
        const double target = p.uniform * total;
        int found = -1;
        double before = 0.0, running = 0.0;
        for (int c0 = 0; ok && found < 0 && c0 < chunks; c0 += 32) {
            const double m = mass_of(c0 + lane);
            running = scan(m, running, start, end);
            const unsigned int hits =
                __ballot_sync(0xffffffffu, m > 0.0 && start <= target && target < end);
            if (hits != 0) {
                const int first = __ffs(hits) - 1;
                found = c0 + first;
                before = __shfl_sync(0xffffffffu, start, first);
            }
        }
        if (lane == 0) {
            found_s = found;
            before_s = before;
            target_s = target;
            token_s = !ok ? fallback : (last_any >= 0 ? last_any : fallback);
            if (found >= 0) token_s = __ldcg(part_last + base + found);  // rounding inside the chunk
        }
    }
    __syncthreads();
    const int found = found_s;
    if (found >= 0) {
        // Walk the chunk in id order: segments of FAST_THREADS × FAST_VEC tokens, each
        // thread a contiguous FAST_VEC of them, a block scan per segment.
        const double target = target_s;
        double running = before_s;
        const int c_lo = found * chunk_len, c_hi = min(vocab, c_lo + chunk_len);
        __shared__ int answer;
        if (threadIdx.x == 0) answer = -1;
        __syncthreads();
        for (int seg = c_lo; seg < c_hi; seg += FAST_THREADS * FAST_VEC) {
            const int t_lo = min(c_hi, seg + (int)threadIdx.x * FAST_VEC);
            const int t_hi = min(c_hi, t_lo + FAST_VEC);
            double m = 0.0;
            int my_last = -1;
            for (int t = t_lo; t < t_hi; ++t) {
                double w;
                if (!fast_weight(to_f32(x[t]), inv_t, max_y, min_p, tab, w)) continue;
                m += w;
                if (w > 0.0) my_last = t;
            }
            double seg_total;
            const double excl = block_exclusive_scan(m, &seg_total);
            const double acc0 = running + excl;
            if (m > 0.0 && acc0 <= target && target < acc0 + m) {
                double acc = acc0;
                int got = -1;
                for (int t = t_lo; t < t_hi && got < 0; ++t) {
                    double w;
                    if (!fast_weight(to_f32(x[t]), inv_t, max_y, min_p, tab, w)) continue;
                    acc += w;
                    if (acc > target) got = t;
                }
                answer = got >= 0 ? got : my_last;
            }
            __syncthreads();
            if (answer >= 0) break;
            running += seg_total;
        }
        if (threadIdx.x == 0 && answer >= 0) token_s = answer;
    }
    __syncthreads();
    if (threadIdx.x == 0) out_tokens[row] = token_s;
    __syncthreads();
}

// The exact race score, out of line: few vectors need it, and inlined at each of a
// thread's vectors it would multiply the kernel's code.
__device__ __noinline__ float race_score_out_of_line(RaceKey key, int t, float y,
                                                     unsigned int byte) {
    return race_score(key, t, y, byte);
}

// The race over one chunk of a plain temperature row (worker/src/exponential_race.rs): the
// winner (score, id), ties to the lowest id, in every thread; a chunk with no finite y
// gives its first token at -inf. Over whole 16-byte vectors, each thread first scores one
// token (of its first vector, the one with the lowest top byte: the likeliest large
// noise), and the block's best of those, `lim`, bounds the rest. A vector is passed over
// when its largest y plus the noise bound of its bytes cannot reach `lim`, as nearly every
// vector is; else its tokens that might are marked (of a tail byte, only its position: one
// lane in 32 has one) and looked at after the loop, one a lane per round, against their own
// bounds before any is scored (looked at where found, a lane's rare token held its whole
// warp, and the kernel ran at half its read speed).
template <int N>
__device__ __forceinline__ void block_chunk_race(const ChunkTokens<N>& visit, const SampleRow& p,
                                                 float& best, int& best_id) {
    static_assert(N * FAST_VEC <= 64, "a thread's candidates are a 64-bit mask");
    const RaceKey key = race_key(p.uniform);
    const float inv_t = 1.f / p.temperature;
    best = NEG_INF;
    best_id = NO_TOKEN;
    // Token t where it may beat `lim`. Its bound first: W >= its top byte B / 256 (B >= 1),
    // or its W itself (B = 0), and E >= W, so -ln E <= -ln W (__logf's error, ~1e-6 here,
    // is covered by 0.01). The bootstrap's token comes out of id order, hence the explicit
    // tie to the lower id.
    const auto consider = [&](int t, float raw, float lim) {
        const float y = fast_scaled(sanitize(raw), inv_t);
        const unsigned int byte = race_byte_of(race_coarse_word(key, (unsigned int)t >> 2), t);
        if (y == NEG_INF || y < race_token_floor(lim, byte)) return;
        const float w = byte != 0 ? __fmul_rn((float)byte, 3.90625e-3f)  // B / 256
                                  : race_w(0, race_fine_word(key, t));
        if (y < race_score_floor(lim, __fadd_rn(-__logf(w), 0.01f))) return;
        const float s = race_score_out_of_line(key, t, y, byte);
        if (best_id == NO_TOKEN || s > best || (s == best && t < best_id)) {
            best = s;
            best_id = t;
        }
    };
    if (!visit.vec) {
        visit([&](int t, float raw) { consider(t, raw, NEG_INF); });
    } else {
        const int first = vector_token(visit.lo, 0);
        if (first < visit.hi) {
            const unsigned int w0 = race_coarse_word(key, (unsigned int)first >> 2);
            const unsigned int w1 =
                FAST_VEC > 4 ? race_coarse_word(key, ((unsigned int)first >> 2) + 1) : w0;
            const scalar_t* v = (const scalar_t*)&visit.cur[0];
            int i = 0;
            float raw = to_f32(v[0]);
#pragma unroll
            for (int j = 1; j < FAST_VEC; ++j) {
                if (race_byte_of(j < 4 ? w0 : w1, j) < race_byte_of(i < 4 ? w0 : w1, i)) {
                    i = j;
                    raw = to_f32(v[j]);
                }
            }
            consider(first + i, raw, NEG_INF);
        }
        const float lim = block_max(best);
        const float floor_y = race_score_floor(lim, RACE_NOISE_BOUND);
        const float floor_tail = race_score_floor(lim, RACE_TAIL_NOISE_BOUND);
        // Bit b of a word's four tokens where its byte b may be 0 (0x80 of each such byte,
        // gathered; a byte above a zero byte may show too, which `consider` sorts out).
        const auto zero_bytes = [](unsigned int w) {
            const unsigned int z = (w - 0x01010101u) & ~w & 0x80808080u;
            return ((z >> 7) * 0x00204081u) >> 21 & 0xfu;
        };
        unsigned long long marked = 0;  // bit k·FAST_VEC + j: vector k's token j
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const int t0 = vector_token(visit.lo, k);
            if (t0 >= visit.hi) break;
            const scalar_t* v = (const scalar_t*)&visit.cur[k];
            float raw_max = NEG_INF;
#pragma unroll
            for (int j = 0; j < FAST_VEC; ++j) raw_max = fmaxf(raw_max, to_f32(v[j]));
            const float y_max = __fmul_rn(raw_max, inv_t);  // >= every token's scaled y
            if (y_max < floor_tail) continue;
            const unsigned int w0 = race_coarse_word(key, (unsigned int)t0 >> 2);
            const unsigned int w1 =
                FAST_VEC > 4 ? race_coarse_word(key, ((unsigned int)t0 >> 2) + 1) : w0;
            if (y_max >= floor_y) {
                // A token of any byte may win: each one whose y reaches its bound.
#pragma unroll
                for (int j = 0; j < FAST_VEC; ++j) {
                    const unsigned int byte = race_byte_of(j < 4 ? w0 : w1, j);
                    const float y = __fmul_rn(to_f32(v[j]), inv_t);
                    if (y >= (byte == 0 ? floor_tail : floor_y))
                        marked |= 1ull << (k * FAST_VEC + j);
                }
            } else {
                const unsigned long long tail =
                    zero_bytes(w0) | (FAST_VEC > 4 ? zero_bytes(w1) << 4 : 0u);
                marked |= tail << (k * FAST_VEC);
            }
        }
        for (; marked != 0; marked &= marked - 1) {
            const int e = __ffsll((long long)marked) - 1;
            const int t = vector_token(visit.lo, e / FAST_VEC) + e % FAST_VEC;
            consider(t, to_f32(visit.x[t]), lim);
        }
    }
    if (best_id == NO_TOKEN) best_id = visit.first();
    block_argmax(best, best_id, NO_TOKEN);
}

// Batches without top rows: in `sample_fast_max` a block's thread 0 posts its chunk's
// argmax (a race row's winner, in `sample_fast_max_race`) to the row's 64-bit key with one
// atomic max and counts in, while the rest of the block exits; in the row's last block
// thread 0 reads and clears the key and finishes the row. With no barrier or all-thread fence in a block's tail (a quarter of
// this kernel's stall samples when every block stored partials, fenced and counted in), the
// chunk is 8,192 tokens, 8 blocks an SM.
//
// The key orders as the CPU's first argmax: the logit's (or score's) bits mapped to an
// unsigned order above, the id's complement below (ties to the lowest id). A chunk's
// maximum is never NaN (block_chunk_argmax, nor a score), and -0 is keyed as +0, which a
// float compare ties with it.
// 0, below every key, is the empty key a row's last block leaves for the next launch.
__device__ __forceinline__ unsigned long long argmax_key(float v, int id) {
    const unsigned int b = __float_as_uint(v == 0.f ? 0.f : v);
    const unsigned int ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)ord << 32) | (0xffffffffu - (unsigned int)id);
}

__device__ __forceinline__ void key_argmax(unsigned long long k, float& v, int& id) {
    const unsigned int ord = (unsigned int)(k >> 32);
    v = __uint_as_float((ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord);
    id = (int)(0xffffffffu - (unsigned int)k);
}

// After a chunk's argmax (a race row's winner): thread 0 posts it to the row's key and
// counts in, and in the row's last block reads and clears the key and finishes the row.
// The whole block calls it; every thread but 0 returns at once.
template <bool RACES>
__device__ __forceinline__ void post_chunk_max(int row, int chunks, float best, int best_id,
                                               const SampleRow& p, const scalar_t* __restrict__ x,
                                               int vocab, unsigned long long* row_key,
                                               unsigned int* counters, float* row_max,
                                               int* row_fallback, int* __restrict__ out_tokens) {
    if (threadIdx.x != 0) return;
    red_max_u64(row_key + row, argmax_key(best, best_id));
    if (!counts_in_last(counters + row, chunks)) return;
    float m;
    int id;
    key_argmax(atomicExch(row_key + row, 0ull), m, id);
    finish_row<RACES>(row, m, id, p, true, x, vocab, row_max, row_fallback, out_tokens);
}

// A block of `sample_fast_max` takes one (row, chunk). Grid: (chunk, row).
extern "C" __global__ void __launch_bounds__(FAST_THREADS)
    sample_fast_max(const scalar_t* __restrict__ logits, int vocab,
                    const SampleRowEx* __restrict__ params, unsigned long long* row_key,
                    unsigned int* counters, float* row_max, int* row_fallback,
                    int* __restrict__ out_tokens) {
    pdl_enter();
    int row, chunk, chunks;
    fast_block(row, chunk, chunks);
    uint4 regs[MAX_PER];
    // Past L1: 30.9 -> 30.1 µs at 256 rows on the H100.
    const ChunkTokens<MAX_PER> visit =
        chunk_tokens<MAX_PER, true>(logits, vocab, row, chunk, regs);
    if (params[row].path != PATH_FAST) return;
    float best;
    int best_id;
    block_chunk_argmax(visit, best, best_id);
    post_chunk_max<false>(row, chunks, best, best_id, params[row].base, visit.x, vocab, row_key,
                          counters, row_max, row_fallback, out_tokens);
}

// `sample_fast_max` with a race row's winner for its argmax, the row's parameters read
// together while the chunk loads. Grid: (chunk, row).
extern "C" __global__ void __launch_bounds__(FAST_THREADS)
    sample_fast_max_race(const scalar_t* __restrict__ logits, int vocab,
                         const SampleRowEx* __restrict__ params, unsigned long long* row_key,
                         unsigned int* counters, float* row_max, int* row_fallback,
                         int* __restrict__ out_tokens) {
    pdl_enter();
    int row, chunk, chunks;
    fast_block(row, chunk, chunks);
    uint4 regs[MAX_PER];
    const ChunkTokens<MAX_PER> visit =
        chunk_tokens<MAX_PER, true>(logits, vocab, row, chunk, regs);
    const SampleRowEx pe = params[row];
    if (pe.path != PATH_FAST) return;
    float best;
    int best_id;
    if (race_row(pe.base)) block_chunk_race(visit, pe.base, best, best_id);
    else block_chunk_argmax(visit, best, best_id);
    post_chunk_max<true>(row, chunks, best, best_id, pe.base, visit.x, vocab, row_key, counters,
                         row_max, row_fallback, out_tokens);
}

// ---- Top-k / top-p rows (`is_top_row`): candidates, then an exact merge per row. ----
//
// In `sample_fast_top` each warp keeps the largest of its 2,048 tokens (up to TOP_WCAP,
// every token at or above a threshold, so ties are never split) and records a bound:
// every token of the warp whose total-order key is >= the bound is a candidate. Above the
// row's largest bound (`lim` once scaled) the candidates are therefore complete: the
// "region", an upper set of the row. The row's last block sorts the region (best first,
// ties to the lowest id: the CPU's total_cmp order) and applies min-p, top-k and top-p
// and the draw as worker/src/sampler.rs does, its f64 sums a warp's (equal to the CPU's
// up to f64 rounding, as the min-p draw's). That is exact whenever the kept set lies
// in the region: top-k with k <= the region's size, min-p cutting inside it, or top-p
// reached inside it. Top-p over a min-p set that leaves the region needs the row's total
// mass: bounds of it decide the cut when they agree (a peaked row), else
// `sample_fast_draw_top` sums it and merges again.
// Anything else (flat rows, ties past the capacities) goes to `sample_tokens_ex`
// (path set to 0), never to an approximation.

#define FAST_WARPS (FAST_THREADS / 32)
#define FAST_ELEMS (FAST_CHUNK / FAST_THREADS)  // tokens a thread holds in registers
#define TOP_J 16                                // lanes whose maxima set a warp's threshold
#define TOP_WCAP 32                             // candidates a warp may keep
#define TOP_MERGE 2048                          // region tokens a row's merge may sort
// A position in the merge (< TOP_MERGE); the ids of top rows' tokens take the other 21
// bits of a 32-bit key (TOP_MAX_VOCAB in sampling_ops.rs).
#define TOP_RANK_BITS 11
// Blocks an SM the top kernels are compiled for: up to 80 registers, which they need (at
// ptxas's own choice, 64, they spilled; at 2 blocks an SM the top kernel ran 18 % slower);
// 3 × 32 KB of loads in flight an SM.
#define TOP_MIN_BLOCKS 3
#define BOUND_ALL 0u                            // every finite token of the warp is kept
// Outcomes of a merge besides a token (>= 0).
#define TOP_TOTAL -1    // needs the row's total mass
#define TOP_GENERAL -2  // cannot be exact here: sample_tokens_ex

// The float of an `order_key`.
__device__ __forceinline__ float key_value(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The id of register element e of this thread (`chunk_floats`'s layout).
__device__ __forceinline__ int elem_id(bool full, int lo, int e) {
    return full ? lo + ((e / FAST_VEC) * FAST_THREADS + (int)threadIdx.x) * FAST_VEC + e % FAST_VEC
                : lo + (int)threadIdx.x + e * FAST_THREADS;
}

// A thread's candidates are a 64-bit mask of its register elements.
static_assert(FAST_ELEMS == 64, "warp_candidates masks 64 elements a thread");

// This thread's raw tokens of the chunk in registers (-inf where absent), in increasing id
// order: from `visit`'s vectors where the chunk is whole 16-byte vectors (returns true:
// `elem_id`'s vector layout), else loaded one a thread in turn. Not sanitised:
// `lane_argmax` sanitises the rare warp that needs it.
__device__ __forceinline__ bool chunk_floats(const ChunkTokens<>& visit, float (&v)[FAST_ELEMS]) {
    if (visit.vec && visit.hi - visit.lo == FAST_CHUNK) {
#pragma unroll
        for (int k = 0; k < FAST_PER; ++k) {
            const uint4 raw = visit.cur[k];
            const scalar_t* r = (const scalar_t*)&raw;
#pragma unroll
            for (int j = 0; j < FAST_VEC; ++j) v[k * FAST_VEC + j] = to_f32(r[j]);
        }
        return true;
    }
#pragma unroll
    for (int e = 0; e < FAST_ELEMS; ++e) {
        const int t = visit.lo + (int)threadIdx.x + e * FAST_THREADS;
        v[e] = t < visit.hi ? to_f32(visit.x[t]) : NEG_INF;
    }
    return false;
}

// The thread's first maximum of v by register index (ids rise with it; tokens past hi are
// -inf), its index in `best_e` (0 where none beats -inf: the first token, as the CPU).
// A NaN never wins and never passes a candidate's >=, as sanitize's -inf; only +inf, which
// sanitize makes FLT_MAX (tied with a finite FLT_MAX), needs the sanitised values, so a
// warp holding one sanitises its registers and looks again.
__device__ __forceinline__ float lane_argmax(float (&v)[FAST_ELEMS], int& best_e) {
    float best = NEG_INF;
    best_e = 0;
#pragma unroll
    for (int e = 0; e < FAST_ELEMS; ++e) {
        if (v[e] > best) {
            best = v[e];
            best_e = e;
        }
    }
    if (!__any_sync(0xffffffffu, best == __int_as_float(0x7f800000))) return best;
    best = NEG_INF;
    best_e = 0;
#pragma unroll
    for (int e = 0; e < FAST_ELEMS; ++e) {
        v[e] = sanitize(v[e]);
        if (v[e] > best) {
            best = v[e];
            best_e = e;
        }
    }
    return best;
}

// The 32 keys of a warp sorted largest first: lane j gets the (j+1)-th largest (bitonic,
// by shuffles).
__device__ __forceinline__ unsigned int warp_sort_desc(unsigned int key) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const unsigned int other = __shfl_xor_sync(0xffffffffu, key, j);
            // An ascending network's pair keeps (min, max) in a rising run; flipped here,
            // so the last run falls.
            const bool keep_max = ((lane & j) == 0) == ((lane & k) == 0);
            key = keep_max ? max(key, other) : min(key, other);
        }
    }
    return key;
}

// One warp's candidates into `slot`: every finite token >= the J-th largest lane maximum
// for the largest J in 16, 8, 4, 2, 1 whose tokens fit TOP_WCAP; none, with a bound above
// the warp's maximum, when even its maximum is tied more often than that. `x`: the row's
// logits, whose candidates are read again (registers cannot be indexed by a variable).
__device__ __forceinline__ void warp_candidates(const float (&v)[FAST_ELEMS], float lane_max,
                                                bool full, int lo,
                                                const scalar_t* __restrict__ x, long long slot,
                                                unsigned long long* cand, int* cand_n,
                                                unsigned int* cand_bound) {
    const int lane = threadIdx.x & 31;
    // Lane i: the key of the (i+1)-th largest lane maximum (never NaN: see lane_argmax).
    const unsigned int kth = warp_sort_desc(order_key(lane_max));
    // Candidates: the finite tokens >= t, a bit each in `mask`. With t_cmp (t, or -FLT_MAX
    // for a -inf t) one comparison decides (a NaN is never >=).
    float t = NEG_INF, t_cmp = -FLT_MAX_F;
    int count = 0, level = 31 - __clz(TOP_J);
    unsigned int mask[2];
    for (; level >= 0; --level) {
        t = key_value(__shfl_sync(0xffffffffu, kth, (1 << level) - 1));
        t_cmp = t == NEG_INF ? -FLT_MAX_F : t;
        mask[0] = mask[1] = 0u;
#pragma unroll
        for (int e = 0; e < FAST_ELEMS; ++e)
            if (v[e] >= t_cmp) mask[e / 32] |= 1u << (e % 32);
        count = __reduce_add_sync(0xffffffffu, __popc(mask[0]) + __popc(mask[1]));
        if (count <= TOP_WCAP) break;
    }
    if (level < 0) {  // the maximum alone overflows: nothing kept, complete above it
        if (lane == 0) {
            cand_n[slot] = 0;
            cand_bound[slot] = __shfl_sync(0xffffffffu, kth, 0) + 1;
        }
        return;
    }
    const int n = __popc(mask[0]) + __popc(mask[1]);
    int pos = warp_inclusive_scan(n) - n;
    unsigned long long* out = cand + slot * TOP_WCAP;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        for (unsigned int bits = mask[h]; bits != 0; bits &= bits - 1) {
            const int id = elem_id(full, lo, h * 32 + __ffs(bits) - 1);
            out[pos++] = ((unsigned long long)id << 32) | __float_as_uint(sanitize(to_f32(x[id])));
        }
    }
    if (lane == 0) {
        cand_n[slot] = count;
        // A -inf threshold: fewer than J lanes hold a finite token, all of them kept.
        cand_bound[slot] = t == NEG_INF ? BOUND_ALL : order_key(t);
    }
}

// Sorts a[0..n) ascending, n a power of two (bitonic; the whole block).
template <typename T>
__device__ void block_sort(T* a, int n) {
    __syncthreads();
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const T ai = a[i], al = a[l];
                    if ((ai > al) == ((i & k) == 0)) {
                        a[i] = al;
                        a[l] = ai;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Sort key of a region token: best first by the CPU's total_cmp of y, ties to the lowest
// id.
__device__ __forceinline__ unsigned long long value_key(float y, int id) {
    return ((unsigned long long)(~order_key(y)) << 32) | (unsigned int)id;
}
__device__ __forceinline__ float value_key_y(unsigned long long k) {
    return key_value(~(unsigned int)(k >> 32));
}
// The CPU's weight: exp of the difference, in f64 (exact there).
__device__ __forceinline__ double top_weight(float y, float max_y) {
    return exp((double)y - (double)max_y);
}

__device__ __forceinline__ int next_pow2(int n) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
}

// The first i in [lo, hi) where `holds` (true, then false) is false.
template <typename P>
__device__ __forceinline__ int first_false(int lo, int hi, P holds) {
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (holds(mid)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// The region of a row into `sorted` (unsorted yet): its candidates with y > lim. A warp a
// slot, one candidate a lane, TOP_BATCH slots' loads in flight; returns the count (which
// may exceed TOP_MERGE: only the first TOP_MERGE are stored).
#define TOP_BATCH 8
// Regions up to this size are sorted whole; larger ones of top-k rows are cut first.
#define TOP_SORT_ALL 256
__device__ __forceinline__ int gather_region(const unsigned long long* cand, const int* cand_n,
                                             long long base, int slots, float inv_t, float lim,
                                             unsigned long long* sorted) {
    __shared__ int count_s;
    if (threadIdx.x == 0) count_s = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int s0 = warp * TOP_BATCH; s0 < slots; s0 += warps * TOP_BATCH) {
        int n[TOP_BATCH];
        unsigned long long e[TOP_BATCH];
#pragma unroll
        for (int k = 0; k < TOP_BATCH; ++k) n[k] = s0 + k < slots ? __ldcg(cand_n + base + s0 + k) : 0;
#pragma unroll
        for (int k = 0; k < TOP_BATCH; ++k)
            e[k] = lane < n[k] ? __ldcg(cand + (base + s0 + k) * TOP_WCAP + lane) : 0ull;
#pragma unroll
        for (int k = 0; k < TOP_BATCH; ++k) {
            const float y = sanitize(__fmul_rn(__uint_as_float((unsigned int)e[k]), inv_t));
            const bool in = lane < n[k] && y > lim;
            const unsigned int ballot = __ballot_sync(0xffffffffu, in);
            if (ballot == 0) continue;
            int at = 0;
            if (lane == 0) at = atomicAdd(&count_s, __popc(ballot));
            at = __shfl_sync(0xffffffffu, at, 0) + __popc(ballot & ((1u << lane) - 1u));
            if (in && at < TOP_MERGE) sorted[at] = value_key(y, (int)(e[k] >> 32));
        }
    }
    __syncthreads();
    return count_s;
}

// Top-k rows: keeps, in place, only the region tokens whose y is at least the k-th
// largest (a radix selection over the value keys' high words, one histogram bin a thread;
// ties of either zero stay, as the CPU's top-k keeps them), so that the sort orders the
// few hundred tokens top-k can keep, not thousands. `tmp`: TOP_MERGE scratch keys.
// Returns how many are kept (>= k). The whole block; blockDim.x == 256.
__device__ __forceinline__ int keep_top_k(unsigned long long* sorted, int c, int k,
                                          unsigned long long* tmp) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned int digit_s;
    __shared__ int remaining_s, kept_s;
    unsigned int prefix = 0, mask = 0;
    int remaining = k;  // the k-th smallest key (best first) among those under `prefix`
    for (int shift = 24; shift >= 0; shift -= 8) {
        hist[threadIdx.x] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < c; i += blockDim.x) {
            const unsigned int key = (unsigned int)(sorted[i] >> 32);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        const int h = (int)hist[threadIdx.x];
        int total;
        const int before = block_exclusive_scan(h, &total);
        if (before < remaining && remaining <= before + h) {
            digit_s = threadIdx.x;
            remaining_s = remaining - before;
        }
        __syncthreads();
        prefix |= digit_s << shift;
        mask |= 255u << shift;
        remaining = remaining_s;
    }
    const float thr = key_value(~prefix);
    if (threadIdx.x == 0) kept_s = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const unsigned long long e = sorted[i];
        if (value_key_y(e) >= thr) tmp[atomicAdd(&kept_s, 1)] = e;
    }
    __syncthreads();
    const int kept = kept_s;
    for (int i = threadIdx.x; i < kept; i += blockDim.x) sorted[i] = tmp[i];
    __syncthreads();
    return kept;
}

// Warp-parallel walks of a merge: running sums 32 terms at a time (a warp scan), equal to
// the CPU's one-at-a-time sums up to f64 rounding, as any other order of them.
//
// The first i in [0, n) where the running sum of w(0..i) reaches `target` (> when
// `strict`, else >=), and that sum in `at`; n and the whole sum when it never does. Every
// lane of the warp gets both.
template <typename W>
__device__ __forceinline__ int warp_first_crossing(int n, W w, double target, bool strict,
                                                   double& at) {
    const int lane = threadIdx.x & 31;
    double running = 0.0;
    for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        const double incl = running + warp_inclusive_scan(i < n ? w(i) : 0.0);
        const bool cross = i < n && (strict ? incl > target : incl >= target);
        const unsigned int hits = __ballot_sync(0xffffffffu, cross);
        if (hits != 0) {
            const int first = __ffs(hits) - 1;
            at = __shfl_sync(0xffffffffu, incl, first);
            return i0 + first;
        }
        running = __shfl_sync(0xffffffffu, incl, 31);
    }
    at = running;
    return n;
}

// Σ w(i) over [0, n) (every lane of the warp gets it).
template <typename W>
__device__ __forceinline__ double warp_sum(int n, W w) {
    double sum = 0.0;
    for (int i = threadIdx.x & 31; i < n; i += 32) sum += w(i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return sum;
}

// The row's token from its candidates, or why not (TOP_TOTAL, TOP_GENERAL). `total`: the
// row's kept mass (sample_fast_draw_top), < 0 when not known yet. The whole block.
__device__ __forceinline__ int top_merge(int row, int chunks, int vocab, const SampleRow& p,
                                         float max_y, int fallback, double total,
                                         const unsigned long long* cand, const int* cand_n,
                                         const unsigned int* cand_bound) {
    __shared__ unsigned long long sorted[TOP_MERGE];
    __shared__ double weight[TOP_MERGE];       // of sorted[i]
    __shared__ unsigned int by_id[TOP_MERGE];  // id << TOP_RANK_BITS | i: S or K by id
    __shared__ unsigned int bound_s;
    __shared__ int decision_s, m_s, q_s, token_s;
    const float inv_t = 1.f / p.temperature;
    const int slots = chunks * FAST_WARPS;
    const long long base = (long long)row * slots;
    if (threadIdx.x == 0) bound_s = BOUND_ALL;
    __syncthreads();
    unsigned int b = BOUND_ALL;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) b = max(b, __ldcg(cand_bound + base + s));
    atomicMax(&bound_s, b);
    __syncthreads();
    // Every token with y > lim is a candidate (y = the CPU's scaled logit, -0 kept).
    const float lim = bound_s == BOUND_ALL
                          ? NEG_INF
                          : sanitize(__fmul_rn(key_value(bound_s), inv_t));
    int c = gather_region(cand, cand_n, base, slots, inv_t, lim, sorted);
    if (c == 0 || c > TOP_MERGE) return TOP_GENERAL;
    // Top-k keeps nothing below its k-th largest (min-p and top-p only cut more), so the
    // rest of the region can go before the sort (`weight` is free until after it).
    if (p.top_k > 0 && c > p.top_k && c > TOP_SORT_ALL)
        c = keep_top_k(sorted, c, p.top_k, reinterpret_cast<unsigned long long*>(weight));
    const int n = next_pow2(c);
    for (int i = c + threadIdx.x; i < n; i += blockDim.x) sorted[i] = ~0ull;
    block_sort(sorted, n);
    double mine = 0.0;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        weight[i] = top_weight(value_key_y(sorted[i]), max_y);
        mine += weight[i];
    }
    // The region's mass, in any order: only a bound of the row's (below).
    const double region_mass = block_total(mine);

    // Which prefix of `sorted` is S (min-p, then top-k), or the top-p cut when S leaves the
    // region; m: how many of `sorted` to order by id. Warp 0, every lane the same values.
    if (threadIdx.x < 32) {
        int decision = 0, m = 0, q = -1;  // decision 0: go on
        const double min_p = p.min_p > 0.f ? (double)p.min_p : 0.0;
        // The region's tokens that min-p keeps: a prefix, weights falling.
        const int u = min_p > 0.0 ? first_false(0, c, [&](int i) { return weight[i] >= min_p; })
                                  : c;
        // The min-p set lies in the region: the region is the whole row, or min-p drops
        // the bound itself (and so everything at or below it).
        const bool u_inside =
            lim == NEG_INF || (min_p > 0.0 && top_weight(lim, max_y) < min_p);
        int s = -1;
        if (value_key_y(sorted[0]) != max_y) {
            decision = TOP_GENERAL;  // the row's maximum is not in the region
        } else if (p.top_k > 0 && c >= p.top_k) {
            // The k-th largest is in the region, so is every token >= it (ties stay).
            const float thr = value_key_y(sorted[p.top_k - 1]);
            const int sk =
                first_false(p.top_k, c, [&](int i) { return value_key_y(sorted[i]) >= thr; });
            s = min(sk, u);
        } else if (u_inside) {
            s = u;  // no more kept tokens than k: top-k keeps them all
        } else if (p.top_k > 0) {
            decision = TOP_GENERAL;
        }
        if (decision == 0 && s >= 0) {
            m = s;
        } else if (decision == 0 && total < 0.0) {
            // Top-p over the whole min-p set (every region token is in it) without its
            // mass: it lies between the region's and that plus every other token at the
            // bound's weight (1e-9: far above the f64 rounding of either sum). The cut
            // grows with the mass, so where both bounds give the same cut, so does the
            // CPU's mass; otherwise sample_fast_draw_top sums the row.
            const double lo = region_mass * (1.0 - 1e-9);
            const double hi =
                (region_mass + (double)(vocab - c) * top_weight(lim, max_y)) * (1.0 + 1e-9);
            const double t_lo = (double)p.top_p * lo, t_hi = (double)p.top_p * hi;
            double mass;
            const int i = warp_first_crossing(c, [&](int j) { return weight[j]; }, t_lo, false,
                                              mass);
            if (i < c && mass >= t_hi) m = q = i + 1;
            else decision = TOP_TOTAL;
        } else if (decision == 0) {
            // Top-p over the whole min-p set (every region token is in it): the cut must
            // fall inside the region.
            double mass;
            const int i = warp_first_crossing(c, [&](int j) { return weight[j]; },
                                              (double)p.top_p * total, false, mass);
            if (i == c) decision = TOP_GENERAL;
            m = q = i + 1;
        }
        if (threadIdx.x == 0) {
            decision_s = decision;
            m_s = m;
            q_s = q;
        }
    }
    __syncthreads();
    if (decision_s != 0) return decision_s;
    const int m = m_s;
    const int nb = next_pow2(m);
    for (int i = threadIdx.x; i < nb; i += blockDim.x)
        by_id[i] = i < m ? ((unsigned int)sorted[i] << TOP_RANK_BITS) | (unsigned int)i : ~0u;
    block_sort(by_id, nb);

    // The cut and the draw, by warp 0 (every lane the same values).
    if (threadIdx.x < 32) {
        const auto rank = [&](int i) { return (int)(by_id[i] & ((1u << TOP_RANK_BITS) - 1u)); };
        double at;
        int q = q_s;
        if (q < 0 && p.top_p < 1.f) {
            // Top-p over S: its mass, then the walk in sorted order.
            const double sum = warp_sum(m, [&](int i) { return weight[rank(i)]; });
            q = min(m, warp_first_crossing(m, [&](int i) { return weight[i]; },
                                           (double)p.top_p * sum, false, at) + 1);
        } else if (q < 0) {
            q = m;
        }
        // The kept tokens: the first q of `sorted`, drawn in id order as the CPU does.
        const auto kept = [&](int i) {
            const int r = rank(i);
            return r < q ? weight[r] : 0.0;
        };
        const double sum = warp_sum(m, kept);
        int tok = fallback;
        if (sum > 0.0 && sum < 1.0e308) {
            const int i = warp_first_crossing(m, kept, p.uniform * sum, true, at);
            int pick = i;
            if (i == m) {  // rounding at the top: the last kept token with a weight
                pick = -1;
                for (int j = threadIdx.x; j < m; j += 32)
                    if (kept(j) > 0.0) pick = j;
                pick = __reduce_max_sync(0xffffffffu, pick);
            }
            if (pick >= 0) tok = (int)(by_id[pick] >> TOP_RANK_BITS);
        }
        if (threadIdx.x == 0) token_s = tok;
    }
    __syncthreads();
    return token_s;
}

// Thread 0 records a merge's outcome: the token, or the row handed to sample_tokens_ex
// (launched after the fast path); TOP_TOTAL leaves max_y for sample_fast_draw_top.
__device__ __forceinline__ void top_finish(int row, int outcome, SampleRowEx* params,
                                           float* row_max, int* out_tokens) {
    if (threadIdx.x != 0) return;
    if (outcome >= 0) out_tokens[row] = outcome;
    if (outcome == TOP_GENERAL) params[row].path = 0;
    if (outcome != TOP_TOTAL) row_max[row] = NEG_INF;
}

// sample_fast_max for a batch with top rows: their chunks also record candidates, and
// their last block merges them.
extern "C" __global__ void __launch_bounds__(FAST_THREADS, TOP_MIN_BLOCKS)
    sample_fast_top(const scalar_t* __restrict__ logits, int vocab, SampleRowEx* params,
                    float* part_val, int* part_id, unsigned long long* cand, int* cand_n,
                    unsigned int* cand_bound, unsigned int* counters, float* row_max,
                    int* row_fallback, int* __restrict__ out_tokens) {
    pdl_enter();
    int row, chunk, chunks;
    fast_block(row, chunk, chunks);
    // Loads first, as in fast_max: a top row converts the same vectors (chunk_floats).
    uint4 regs[FAST_PER];
    const ChunkTokens<> visit = chunk_tokens(logits, vocab, row, chunk, regs);
    if (params[row].path != PATH_FAST) return;
    const SampleRow p = params[row].base;
    const bool top = is_top_row(p);
    const int lo = visit.lo, hi = visit.hi;
    float best;
    int best_id;
    if (top) {
        float v[FAST_ELEMS];
        const bool full = chunk_floats(visit, v);
        int best_e;
        best = lane_argmax(v, best_e);
        best_id = elem_id(full, lo, best_e);
        if (best_id >= hi) best_id = NO_TOKEN;
        const long long slot =
            ((long long)row * chunks + chunk) * FAST_WARPS + (threadIdx.x >> 5);
        warp_candidates(v, best, full, lo, visit.x, slot, cand, cand_n, cand_bound);
        block_argmax(best, best_id, NO_TOKEN);
    } else if (race_row(p)) {
        block_chunk_race(visit, p, best, best_id);
    } else {
        block_chunk_argmax(visit, best, best_id);
    }
    float max_y;
    if (!record_chunk_max(row, chunk, chunks, best, best_id, p, visit.x, vocab, part_val,
                          part_id, counters, row_max, row_fallback, out_tokens, max_y))
        return;
    if (!top || max_y == NEG_INF) return;
    const int outcome = top_merge(row, chunks, vocab, p, max_y, row_fallback[row], -1.0, cand,
                                  cand_n, cand_bound);
    top_finish(row, outcome, params, row_max, out_tokens);
}

// The draw pass; TOP: top rows waiting for their total (TOP_TOTAL) are merged again.
template <bool TOP>
__device__ void fast_draw(const scalar_t* __restrict__ logits, int vocab, SampleRowEx* params,
                          const float* row_max, const int* row_fallback, double* part_mass,
                          int* part_last, unsigned int* counters, int* __restrict__ out_tokens,
                          const unsigned long long* cand, const int* cand_n,
                          const unsigned int* cand_bound, float* row_max_out) {
    int row, chunk, chunks;
    fast_block(row, chunk, chunks);
    // Every row of a min-p batch draws here, so its chunk is loaded before the row's
    // parameters are read; a top batch's rows seldom draw (TOP_TOTAL), so they load after.
    // The top batch's chunks are the top kernel's, whose candidate slots it reads.
    constexpr int per = TOP ? FAST_PER : DRAW_PER;
    uint4 regs[per];
    const ChunkTokens<per> visit = chunk_tokens(logits, vocab, row, chunk, regs, !TOP);
    const SampleRow p = params[row].base;
    if (params[row].path != PATH_FAST || p.temperature < 1e-5f) return;
    const float max_y = row_max[row];
    if (max_y == NEG_INF) return;  // sample_fast_max wrote the token
    if (TOP && visit.vec) load_vectors(visit.x, visit.lo, visit.hi, regs);
    __shared__ double tab[64];
    fill_exp_table(tab);
    const float inv_t = 1.f / p.temperature;
    const double min_p = p.min_p > 0.f ? (double)p.min_p : 0.0;
    const scalar_t* x = visit.x;
    double mass = 0.0;
    int last = -1;
    visit([&](int t, float raw) {
        double w;
        if (!fast_weight(raw, inv_t, max_y, min_p, tab, w)) return;
        mass += w;
        if (w > 0.0) last = t;
    });
    const double chunk_mass = block_total(mass);
    const int chunk_last = block_max_int(last);
    const long long base = (long long)row * chunks;
    if (threadIdx.x == 0) {
        part_mass[base + chunk] = chunk_mass;
        part_last[base + chunk] = chunk_last;
    }
    if (!last_block_of_row(&counters[row], chunks)) return;
    if constexpr (TOP) {
        if (is_top_row(p)) {
            __shared__ double total_s;
            if (threadIdx.x == 0) {
                const volatile double* pm = part_mass + base;
                double total = 0.0;
                for (int c = 0; c < chunks; ++c) total += pm[c];
                total_s = total;
            }
            __syncthreads();
            const int outcome = top_merge(row, chunks, vocab, p, max_y, row_fallback[row], total_s,
                                          cand, cand_n, cand_bound);
            top_finish(row, outcome == TOP_TOTAL ? TOP_GENERAL : outcome, params, row_max_out,
                       out_tokens);
            return;
        }
    }

    draw_row(row, chunks, per * FAST_VEC * FAST_THREADS, vocab, x, p, max_y, row_fallback[row],
             part_mass, part_last, tab, out_tokens);
}

extern "C" __global__ void __launch_bounds__(FAST_THREADS)
    sample_fast_draw(const scalar_t* __restrict__ logits, int vocab, SampleRowEx* params,
                     const float* row_max, const int* row_fallback, double* part_mass,
                     int* part_last, unsigned int* counters, int* __restrict__ out_tokens) {
    pdl_enter();
    fast_draw<false>(logits, vocab, params, row_max, row_fallback, part_mass, part_last,
                     counters, out_tokens, nullptr, nullptr, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(FAST_THREADS, TOP_MIN_BLOCKS)
    sample_fast_draw_top(const scalar_t* __restrict__ logits, int vocab, SampleRowEx* params,
                         float* row_max, const int* row_fallback, double* part_mass,
                         int* part_last, unsigned int* counters, int* __restrict__ out_tokens,
                         const unsigned long long* cand, const int* cand_n,
                         const unsigned int* cand_bound) {
    pdl_enter();
    fast_draw<true>(logits, vocab, params, row_max, row_fallback, part_mass, part_last,
                    counters, out_tokens, cand, cand_n, cand_bound, row_max);
}
