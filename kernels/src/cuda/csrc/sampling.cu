// Sampling on the GPU: one block per logits row, the CPU sampler's semantics
// (worker/src/sampler.rs) for greedy, temperature, min-p, top-k and top-p with an
// inverse-CDF draw in token-id order from a uniform the host computes per row (the seeded
// counter-based RNG), so only token ids travel back to the host.
//
// Each thread owns a contiguous chunk of the vocabulary and re-reads it in every pass
// (the row stays in L2). Thresholds are found by radix selection over order-preserving
// 32-bit keys of the scaled logits: counts for top-k, f64 probability mass for top-p.
// Ties at the top-p cut keep the lowest ids first, as the CPU's stable order does.

#define SAMPLE_THREADS 1024
#define FLT_MAX_F 3.402823466e+38f

struct SampleRow {
    float temperature;
    int top_k;  // <= 0: off
    float top_p;
    float min_p;
    double uniform;
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

struct RowView {
    const scalar_t* x;
    int lo, hi;
    float inv_t;
    float max_y;
    double min_p;
    unsigned int topk_key;  // keep keys >= this (0: off)
    // top-p cut: keys > cut_key kept; keys == cut_key kept for the first cut_ties ids.
    bool top_p_on;
    unsigned int cut_key;
    int cut_ties;

    __device__ float y(int t) const {
        float v = sanitize(sanitize(to_f32(x[t])) * inv_t);
        return v == 0.f ? 0.f : v;
    }
    __device__ double weight(float v) const { return exp((double)(v - max_y)); }
    // Survives min-p and top-k (and is finite).
    __device__ bool base(float v) const {
        if (v == NEG_INF) return false;
        if (min_p > 0.0 && weight(v) < min_p) return false;
        return order_key(v) >= topk_key;
    }
};

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
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t);
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
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t);
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
    for (int t = r.lo; t < r.hi; ++t) {
        const float v = r.y(t);
        if (r.base(v) && order_key(v) == prefix) {
            ++ties;
            tie_value = v;
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

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_tokens(const scalar_t* __restrict__ logits, int vocab,
                  const SampleRow* __restrict__ params, int* __restrict__ out_tokens) {
    const int row = blockIdx.x;
    const SampleRow p = params[row];
    RowView r;
    r.x = logits + (long long)row * vocab;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    r.lo = min(vocab, (int)threadIdx.x * chunk);
    r.hi = min(vocab, r.lo + chunk);

    // Argmax of the sanitised row, ties to the lowest id: the greedy token and the
    // fallback of every other path.
    float best = NEG_INF;
    int best_id = vocab;
    for (int t = r.lo; t < r.hi; ++t) {
        const float v = sanitize(to_f32(r.x[t]));
        if (v > best || best_id == vocab) {
            best = v;
            best_id = t;
        }
    }
    {
        __shared__ float vals[32];
        __shared__ int ids[32];
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ov > best || (ov == best && oi < best_id)) {
                best = ov;
                best_id = oi;
            }
        }
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        if (lane == 0) {
            vals[warp] = best;
            ids[warp] = best_id;
        }
        __syncthreads();
        best = lane < (int)(blockDim.x >> 5) ? vals[lane] : NEG_INF;
        best_id = lane < (int)(blockDim.x >> 5) ? ids[lane] : vocab;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
            if (ov > best || (ov == best && oi < best_id)) {
                best = ov;
                best_id = oi;
            }
        }
    }
    const int fallback = best_id >= vocab ? 0 : best_id;
    if (p.temperature < 1e-5f) {
        if (threadIdx.x == 0) out_tokens[row] = fallback;
        return;
    }
    r.inv_t = 1.f / p.temperature;
    r.max_y = NEG_INF;
    r.min_p = p.min_p > 0.f ? (double)p.min_p : 0.0;
    r.topk_key = 0;
    r.top_p_on = false;
    r.cut_key = 0;
    r.cut_ties = 0;
    r.max_y = r.y(fallback);
    if (r.max_y == NEG_INF) {
        if (threadIdx.x == 0) out_tokens[row] = fallback;
        return;
    }

    if (p.top_k > 0) {
        int count = 0;
        for (int t = r.lo; t < r.hi; ++t) count += r.base(r.y(t)) ? 1 : 0;
        if (p.top_k < block_total(count)) r.topk_key = select_kth_key(r, p.top_k);
    }
    if (p.top_p < 1.f) {
        double mass = 0.0;
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t);
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
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t);
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
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t);
            if (!r.base(v)) continue;
            if (r.top_p_on) {
                const unsigned int key = order_key(v);
                if (key < r.cut_key) continue;
                if (key == r.cut_key && rank++ >= r.cut_ties) continue;
            }
            const double w = r.weight(v);
            mass += w;
            if (w > 0.0) last_kept = t;
        }
    }
    double total;
    const double before = block_exclusive_scan(mass, &total);
    __shared__ int answer;
    __shared__ int last_any;
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
        for (int t = r.lo; t < r.hi; ++t) {
            const float v = r.y(t);
            if (!r.base(v)) continue;
            if (r.top_p_on) {
                const unsigned int key = order_key(v);
                if (key < r.cut_key) continue;
                if (key == r.cut_key && rank++ >= r.cut_ties) continue;
            }
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
        out_tokens[row] = token;
    }
}
