// How fast can a decode grid read a paged KV cache? A probe, not part of the engine: it
// reads Qwen3-0.6B's layout ([blocks, 16, 8 kv heads, 128] bf16) with a block per (kv
// head, sequence), longest sequence first, as the decode kernel's plan does, three ways:
//  plain: the decode kernel's loads (16 lanes a key, 16 bytes a lane, 4 keys a lane a
//         step, loaded a step ahead), K then V, the rows xor-summed (no math); also over
//         head-major blocks ([blocks, 8, 16, 128]), a layout the engine does not use;
//  bulk<R>: a producer warp issues one cp.async.bulk of 256 bytes a key (32 keys a
//         stage) into a ring of R stages on mbarriers; four consumer warps read each
//         stage from shared memory and release it;
//  contig: a grid-stride read of the same bytes, contiguous.
// On the GPU machine, `scripts/gpu_round.sh kv-read-probe` builds it with nvcc and runs it
// (docs/BENCHMARKS.md, 2026-11-27, "Decode attention at its gather's ceiling").
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <numeric>
#include <random>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

constexpr int BS = 16, HKV = 8, D = 128, ROW = D * 2;  // bytes of one head's row
constexpr int MAXK = 2048;

__device__ __forceinline__ unsigned fold(uint4 r) { return r.x ^ r.y ^ r.z ^ r.w; }

template <bool HEAD_MAJOR>
__global__ void __launch_bounds__(128) plain(const char* __restrict__ K, const char* __restrict__ V,
                                             const int* bt, int btw, const int* lens, const int* order,
                                             unsigned* out) {
    __shared__ int slots[MAXK];
    const int h = blockIdx.x, i = order[blockIdx.z], n = lens[i], tid = threadIdx.x;
    for (int k = tid; k < n; k += 128) slots[k] = bt[i * btw + k / BS] * BS + k % BS;
    __syncthreads();
    const int grp = tid / 16, sub = tid % 16;
    unsigned x = 0;
    for (int pass = 0; pass < 2; ++pass) {
        // Token-major blocks ([blocks, 16, heads, D], the engine's) put a key's row of this
        // head every HKV rows; head-major ones ([blocks, heads, 16, D]) put a block's 16
        // rows of one head together (4 KB).
        const char* C = (pass ? V : K) + (HEAD_MAJOR ? (size_t)h * BS * ROW : (size_t)h * ROW) + sub * 16;
        auto at = [&](int slot) {
            return HEAD_MAJOR ? (size_t)(slot / BS) * (HKV * BS * ROW) + (size_t)(slot % BS) * ROW
                              : (size_t)slot * (HKV * ROW);
        };
        uint4 rows[4];
        auto load = [&](uint4* r, int base) {
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int k = base + grp + 8 * u;
                r[u] = k < n ? *reinterpret_cast<const uint4*>(C + at(slots[k]))
                             : make_uint4(0, 0, 0, 0);
            }
        };
        load(rows, 0);
        for (int base = 0; base < n; base += 32) {
            uint4 next[4];
            load(next, base + 32);
#pragma unroll
            for (int u = 0; u < 4; ++u) { x += fold(rows[u]); rows[u] = next[u]; }
        }
    }
    if (x == 0x12345678u) out[blockIdx.z * HKV + h] = x;
}

__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, int c) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(c));
}
__device__ __forceinline__ void mbar_expect(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, int parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT%=;\n}\n" ::"r"(sa(b)),
        "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)),
                 "l"(src), "r"(bytes), "r"(sa(b)) : "memory");
}

template <int R>
__global__ void __launch_bounds__(160) bulkk(const char* __restrict__ K, const char* __restrict__ V,
                                             const int* bt, int btw, const int* lens, const int* order,
                                             unsigned* out) {
    extern __shared__ __align__(128) char smem[];
    char* ring = smem;                                             // [R][32 keys][256 B]
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + R * 32 * ROW);
    unsigned long long* empty = full + R;
    int* slots = reinterpret_cast<int*>(empty + R);
    const int h = blockIdx.x, i = order[blockIdx.z], n = lens[i], tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    for (int k = tid; k < n; k += 160) slots[k] = bt[i * btw + k / BS] * BS + k % BS;
    if (tid < R) { mbar_init(&full[tid], 1); mbar_init(&empty[tid], 4); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    const int T = (n + 31) / 32, S = 2 * T;
    if (warp == 4) {
        for (int t = 0; t < S; ++t) {
            const int s = t % R;
            if (t >= R) mbar_wait(&empty[s], ((t / R) - 1) & 1);
            const int kb = (t % T) * 32, nk = min(32, n - kb);
            const char* C = (t < T ? K : V) + (size_t)h * ROW;
            if (lane == 0) mbar_expect(&full[s], nk * ROW);
            __syncwarp();
            if (lane < nk) bulk(ring + (s * 32 + lane) * ROW, C + (size_t)slots[kb + lane] * (HKV * ROW), ROW, &full[s]);
        }
        return;
    }
    unsigned x = 0;
    for (int t = 0; t < S; ++t) {
        const int s = t % R;
        mbar_wait(&full[s], (t / R) & 1);
        const int nk = min(32, n - (t % T) * 32);
        const uint4* st = reinterpret_cast<const uint4*>(ring + s * 32 * ROW);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int idx = tid + 128 * j;
            if (idx / 16 < nk) x += fold(st[idx]);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
    }
    if (x == 0x12345678u) out[blockIdx.z * HKV + h] = x;
}

__global__ void contig(const uint4* __restrict__ p, size_t n, unsigned* out) {
    unsigned x = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        x += fold(a) + fold(b) + fold(c) + fold(d);
    }
    for (; i < n; i += stride) x += fold(p[i]);
    if (x == 0x12345678u) out[0] = x;
}

template <typename F>
float time_ms(F f, int reps = 10) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    f(); f();
    CK(cudaEventRecord(a));
    for (int r = 0; r < reps; ++r) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGetLastError());
    return ms / reps;
}

int main() {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<std::pair<const char*, std::vector<int>>> cases;
    auto spread = [](int n, int lo, int hi) { std::vector<int> v; for (int i = 0; i < n; ++i) v.push_back(lo + (i * 379) % (hi - lo + 1)); return v; };
    cases.push_back({"256x562~ (100-1023)", spread(256, 100, 1023)});
    cases.push_back({"192x947~ (300-1600)", spread(192, 300, 1600)});
    cases.push_back({"128x1248~ (600-1900)", spread(128, 600, 1900)});
    cases.push_back({"256x601", std::vector<int>(256, 601)});
    unsigned* out; CK(cudaMalloc(&out, 1 << 20));
    for (auto& [name, lens] : cases) {
        const int seqs = lens.size();
        int btw = 0; size_t blocks = 0;
        for (int n : lens) { btw = std::max(btw, (n + BS - 1) / BS); blocks += (n + BS - 1) / BS; }
        std::vector<int> perm(blocks); std::iota(perm.begin(), perm.end(), 0);
        std::mt19937 rng(7); std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int> bt((size_t)seqs * btw, 0); size_t next = 0;
        for (int i = 0; i < seqs; ++i) for (int b = 0; b < (lens[i] + BS - 1) / BS; ++b) bt[(size_t)i * btw + b] = perm[next++];
        std::vector<int> order(seqs); std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lens[a] > lens[b]; });
        const size_t cache_bytes = blocks * BS * HKV * ROW;
        char *K, *V; int *dbt, *dl, *dord;
        CK(cudaMalloc(&K, cache_bytes)); CK(cudaMalloc(&V, cache_bytes));
        CK(cudaMemset(K, 1, cache_bytes)); CK(cudaMemset(V, 2, cache_bytes));
        CK(cudaMalloc(&dbt, bt.size() * 4)); CK(cudaMalloc(&dl, seqs * 4)); CK(cudaMalloc(&dord, seqs * 4));
        CK(cudaMemcpy(dbt, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dl, lens.data(), seqs * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dord, order.data(), seqs * 4, cudaMemcpyHostToDevice));
        double bytes = 0; for (int n : lens) bytes += (double)n * ROW * HKV * 2;
        dim3 grid(HKV, 1, seqs);
        auto rep = [&](const char* what, float ms) { printf("BENCH kv_read_probe %-22s %-12s %8.1f us %6.3f TB/s\n", name, what, ms * 1e3, bytes / (ms * 1e-3) / 1e12); };
        rep("plain", time_ms([&] { plain<false><<<grid, 128>>>(K, V, dbt, btw, dl, dord, out); }));
        rep("plain head-major", time_ms([&] { plain<true><<<grid, 128>>>(K, V, dbt, btw, dl, dord, out); }));
        auto run_bulk = [&](auto kern, int R, const char* what) {
            const int sm = R * 32 * ROW + 2 * R * 8 + MAXK * 4;
            CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
            rep(what, time_ms([&] { kern<<<grid, 160, sm>>>(K, V, dbt, btw, dl, dord, out); }));
        };
        run_bulk(bulkk<2>, 2, "bulk R=2");
        run_bulk(bulkk<3>, 3, "bulk R=3");
        run_bulk(bulkk<4>, 4, "bulk R=4");
        run_bulk(bulkk<6>, 6, "bulk R=6");
        rep("plain", time_ms([&] { plain<false><<<grid, 128>>>(K, V, dbt, btw, dl, dord, out); }));
        rep("plain head-major", time_ms([&] { plain<true><<<grid, 128>>>(K, V, dbt, btw, dl, dord, out); }));
        // The same bytes read contiguously (the K cache, then V, as one span each).
        const size_t n16 = (size_t)(bytes / 2) / 16;
        for (int bps : {4, 8, 16}) {
            char w[32]; snprintf(w, sizeof w, "contig %d/SM", bps);
            rep(w, time_ms([&] { contig<<<sms * bps, 256>>>((const uint4*)K, n16, out); contig<<<sms * bps, 256>>>((const uint4*)V, n16, out); }));
        }
        CK(cudaFree(K)); CK(cudaFree(V)); CK(cudaFree(dbt)); CK(cudaFree(dl)); CK(cudaFree(dord));
    }
    printf("BENCH kv_read_probe done\n");
    return 0;
}
