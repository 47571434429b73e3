// The fast path of GPU sampling: rows without logits processors or logprobs, greedy or
// temperature (+ min-p) sampling, each row split over many blocks so that a decode batch
// fills every SM with 16-byte loads in flight (sampling.cu's one block per row left most
// of the memory system idle). Same semantics as `sample_tokens_ex` and the CPU sampler
// (worker/src/sampler.rs): first argmax; weights exp((double)(y - max_y)) of the scaled
// logits y; min-p drops weights below min_p; inverse CDF in token-id order from the host's
// uniform, f64 accumulation; the same fallbacks at the rounding edges.
//
// Two launches, each over (row, chunk of FAST_CHUNK tokens) blocks; the last block of a
// row to finish (an atomic counter per row, reset by that block for the next launch)
// reduces the row's chunk results, so nothing waits on another block:
// 1. `sample_fast_max`: chunk argmax → the row's argmax (the greedy token, and the
//    fallback and max_y of temperature rows);
// 2. `sample_fast_draw` (temperature rows): chunk mass of the kept tokens → the chunk the
//    target u·total falls in → that chunk walked in id order by its last block.
// Rows with `path != PATH_FAST` are left to `sample_tokens_ex`, and the reverse.

#define FAST_THREADS 256
#define FAST_CHUNK 8192
// Elements of one 16-byte load.
#define FAST_VEC (16 / (int)sizeof(scalar_t))

// exp((double)d) for a finite d <= 0, within a few ulp of the libm value, with about half
// the double-precision instructions of exp() and one 64-bit conversion (those issue at a
// quarter of the f64 rate): a weight pass is bound by the SM's f64 throughput, not by
// memory. 2^(j/64) comes from `tab` (j < 64, in shared memory).
__device__ __forceinline__ double exp_neg(float d, const double* tab) {
    if (d < -700.f) return exp((double)d);  // near underflow: the library's care, rarely taken
    const double x = (double)d;
    // k = rint(x · 64/ln2) by the 1.5·2^52 shifter: k is the low word, no rounding or
    // float-to-int instruction.
    const double shifted = fma(x, 92.332482616893656, 6755399441055744.0);
    const int k = __double2loint(shifted);
    const double kd = shifted - 6755399441055744.0;
    // ln2/64 split so that kd * hi is exact (fdlibm's ln2_hi has 20 trailing zero bits).
    const double r0 = fma(kd, -6.93147180369123816490e-01 / 64.0, x);
    const double r = fma(kd, -1.90821492927058770002e-10 / 64.0, r0);  // |r| <= ln2/128
    double p = 1.0 / 720.0;
    p = fma(p, r, 1.0 / 120.0);
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    // 2^(k/64) = tab[k mod 64] · 2^floor(k/64): the power of two added to the exponent
    // field (no underflow: k/64 >= -1010 here).
    const double t = tab[k & 63];
    const double scaled = __hiloint2double(__double2hiint(t) + ((k >> 6) << 20), __double2loint(t));
    return p * scaled;
}

__device__ __forceinline__ void fill_exp_table(double* tab) {
    if (threadIdx.x < 64) tab[threadIdx.x] = exp2((double)threadIdx.x / 64.0);
    __syncthreads();
}

// Calls f(t, raw logit) for the tokens of [lo, hi) this thread owns, in increasing id
// order within the thread; threads interleave in 16-byte vectors so that a warp's loads
// are coalesced, all of a full chunk's loads issued before the first use.
template <typename F>
__device__ __forceinline__ void for_chunk(const scalar_t* __restrict__ x, int lo, int hi, F f) {
    constexpr int PER = FAST_CHUNK / FAST_VEC / FAST_THREADS;
    const bool aligned = (((unsigned long long)(x + lo)) & 15ull) == 0;
    if (aligned && hi - lo == FAST_CHUNK && blockDim.x == FAST_THREADS) {
        uint4 raw[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k)
            raw[k] = ((const uint4*)(x + lo))[k * FAST_THREADS + threadIdx.x];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const scalar_t* v = (const scalar_t*)&raw[k];
            const int t0 = lo + (k * FAST_THREADS + (int)threadIdx.x) * FAST_VEC;
#pragma unroll
            for (int j = 0; j < FAST_VEC; ++j) f(t0 + j, to_f32(v[j]));
        }
        return;
    }
    // A short last chunk or an unaligned row: one element a step, still coalesced.
    for (int t = lo + (int)threadIdx.x; t < hi; t += blockDim.x) f(t, to_f32(x[t]));
}

// True in every thread of the block that finishes its row last. Thread 0's earlier global
// writes are visible to that block; `counter` is back at 0 for the next launch.
__device__ bool last_block_of_row(unsigned int* counter, int chunks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1u) == (unsigned int)chunks - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ float fast_scaled(float v, float inv_t) {
    v = sanitize(__fmul_rn(v, inv_t));
    return v == 0.f ? 0.f : v;
}

extern "C" __global__ void __launch_bounds__(FAST_THREADS)
    sample_fast_max(const scalar_t* __restrict__ logits, int vocab,
                    const SampleRowEx* __restrict__ params, float* part_val, int* part_id,
                    unsigned int* counters, float* row_max, int* row_fallback,
                    int* __restrict__ out_tokens) {
    const int row = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    if (params[row].path != PATH_FAST) return;
    const scalar_t* x = logits + (long long)row * vocab;
    const int lo = chunk * FAST_CHUNK, hi = min(vocab, lo + FAST_CHUNK);
    float best = NEG_INF;
    int best_id = NO_TOKEN;
    for_chunk(x, lo, hi, [&](int t, float raw) {
        const float v = sanitize(raw);
        if (v > best || best_id == NO_TOKEN) {
            best = v;
            best_id = t;
        }
    });
    block_argmax(best, best_id, NO_TOKEN);
    const long long slot = (long long)row * chunks + chunk;
    if (threadIdx.x == 0) {
        part_val[slot] = best;
        part_id[slot] = best_id;
    }
    if (!last_block_of_row(&counters[row], chunks)) return;
    if (threadIdx.x != 0) return;
    // Chunks in id order, each its first maximum: the strict > keeps the row's first.
    const volatile float* pv = part_val + (long long)row * chunks;
    const volatile int* pi = part_id + (long long)row * chunks;
    float m = pv[0];
    int id = pi[0];
    for (int c = 1; c < chunks; ++c) {
        if (pv[c] > m) {
            m = pv[c];
            id = pi[c];
        }
    }
    const SampleRow p = params[row].base;
    row_fallback[row] = id;
    if (p.temperature < 1e-5f) {
        out_tokens[row] = id;
        row_max[row] = NEG_INF;
        return;
    }
    const float max_y = fast_scaled(m, 1.f / p.temperature);
    row_max[row] = max_y;
    if (max_y == NEG_INF) out_tokens[row] = id;  // nothing finite: the argmax, as the CPU
}

// The kept weight of one scaled logit (0: dropped), and whether it counts as kept.
__device__ __forceinline__ bool fast_weight(float raw, float inv_t, float max_y, double min_p,
                                            const double* tab, double& w) {
    const float y = fast_scaled(sanitize(raw), inv_t);
    if (y == NEG_INF) return false;
    w = exp_neg(__fsub_rn(y, max_y), tab);
    return !(min_p > 0.0 && w < min_p);
}

extern "C" __global__ void __launch_bounds__(FAST_THREADS)
    sample_fast_draw(const scalar_t* __restrict__ logits, int vocab,
                     const SampleRowEx* __restrict__ params, const float* row_max,
                     const int* row_fallback, double* part_mass, int* part_last,
                     unsigned int* counters, int* __restrict__ out_tokens) {
    const int row = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const SampleRow p = params[row].base;
    if (params[row].path != PATH_FAST || p.temperature < 1e-5f) return;
    const float max_y = row_max[row];
    if (max_y == NEG_INF) return;  // sample_fast_max wrote the token
    __shared__ double tab[64];
    fill_exp_table(tab);
    const float inv_t = 1.f / p.temperature;
    const double min_p = p.min_p > 0.f ? (double)p.min_p : 0.0;
    const scalar_t* x = logits + (long long)row * vocab;
    const int lo = chunk * FAST_CHUNK, hi = min(vocab, lo + FAST_CHUNK);
    double mass = 0.0;
    int last = -1;
    for_chunk(x, lo, hi, [&](int t, float raw) {
        double w;
        if (!fast_weight(raw, inv_t, max_y, min_p, tab, w)) return;
        mass += w;
        if (w > 0.0) last = t;
    });
    const double chunk_mass = block_total(mass);
    __shared__ int chunk_last;
    if (threadIdx.x == 0) chunk_last = -1;
    __syncthreads();
    if (last >= 0) atomicMax(&chunk_last, last);
    __syncthreads();
    const long long base = (long long)row * chunks;
    if (threadIdx.x == 0) {
        part_mass[base + chunk] = chunk_mass;
        part_last[base + chunk] = chunk_last;
    }
    if (!last_block_of_row(&counters[row], chunks)) return;

    // The row: total, the chunk holding the target, and the last kept token (the answer
    // when rounding leaves the target past every token).
    __shared__ int found_s, token_s;
    __shared__ double before_s, target_s;
    if (threadIdx.x == 0) {
        const volatile double* pm = part_mass + base;
        const volatile int* pl = part_last + base;
        double total = 0.0;
        int last_any = -1;
        for (int c = 0; c < chunks; ++c) {
            total += pm[c];
            last_any = max(last_any, pl[c]);
        }
        const int fallback = row_fallback[row];
        const bool ok = total > 0.0 && total < 1.0e308;
        const double target = p.uniform * total;
        int found = -1;
        double before = 0.0;
        for (int c = 0; ok && c < chunks; ++c) {
            const double m = pm[c];
            if (m > 0.0 && before <= target && target < before + m) {
                found = c;
                break;
            }
            before += m;
        }
        found_s = found;
        before_s = before;
        target_s = target;
        token_s = !ok ? fallback : (last_any >= 0 ? last_any : fallback);
        if (found >= 0) token_s = part_last[base + found];  // rounding inside the chunk
    }
    __syncthreads();
    const int found = found_s;
    if (found >= 0) {
        // Walk the chunk in id order: segments of FAST_THREADS × FAST_VEC tokens, each
        // thread a contiguous FAST_VEC of them, a block scan per segment.
        const double target = target_s;
        double running = before_s;
        const int c_lo = found * FAST_CHUNK, c_hi = min(vocab, c_lo + FAST_CHUNK);
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
}
