// A one-shot all-reduce over peer memory (vLLM's custom all-reduce, one stage), for the
// small messages of decode steps, where NCCL's latency (about 11 µs a call) is most of
// the cost. Every rank reads all ranks' x and sums them in rank order in f32, so all
// ranks hold the same bits. Two ways to move x:
//
// - Low-latency lines (NCCL's LL protocol), for the smallest messages: each rank stores
//   its x straight into every rank's receive buffer as 16-byte lines of 8 data bytes and two
//   copies of the call number, and readers poll their own memory until a line carries
//   this call's number. No fence and no barrier: one NVLink crossing a call. (A 16-byte
//   store may land as two 8-byte halves, so each half carries the number.)
// - Staged, past that: each rank copies its x into its own staging buffer, the ranks meet
//   at a barrier of flags written into each other's memory, and every rank reads the
//   peers' buffers. Half the bytes of the lines, two more crossings: on two H100s the
//   lines took 4.7 µs a call at 8-64 KB and the staged buffers 6.0-6.3, but at 256 KB
//   7.2 against 6.3 (docs/BENCHMARKS.md); the host picks (`lines`).
//
// The grid is always CAR_BLOCKS blocks, and block b of every rank handles the same
// 16-byte chunks of x on every rank. Each block keeps its own call counter (`epochs`,
// this rank's memory), the same on every rank because every rank makes the same calls.
// Buffers alternate between two slots by the counter's parity, so that no rank writes a
// slot a peer may still read: a rank starts call e only after its call e-1 read something
// the peers wrote in their call e-1, which they wrote after their `pdl_enter`, so after
// every read of call e-2 had ended. Call numbers wrap after 2^32 calls (hours of decode),
// so they are compared for equality only, skip 0, and a reader clears every line and
// flag it has read: none keeps an old number until that number comes round again.
//
// A peer that never arrives (a process died) would keep a block waiting; it also polls
// `abort`, host memory the worker's watchdog sets when a step hangs, and leaves. The step
// then fails (the watchdog reports it), as with NCCL's own abort.
//
// `custom_all_reduce_add_rms_norm` is the same all-reduce (low-latency lines) fused with
// the residual add and RMSNorm that follow every row-parallel projection
// (fused_add_rms_norm of norm.cu, bit for bit): a block a row, saving the norm's launch.
//
// For one token the projection itself can send its outputs (row lines, below): each
// block of `gemv_m1_all_reduce_send` stores its outputs into every rank's row lines as
// soon as they are summed, and `custom_all_reduce_rows_add_rms_norm` sums, adds and norms
// them. The projection's output never goes through this rank's memory first, and most of
// it has crossed NVLink by the time the projection's grid ends.

#define CAR_MAX_RANKS 8
#define CAR_BLOCKS 32
#define CAR_THREADS 512
// The row lines' outputs (a row of at most this many), and their call counter: one past
// the blocks' counters.
#define CAR_ROW_LINES 16384
#define CAR_ROW_EPOCH CAR_BLOCKS

// The group: what every call of either kernel shares.
struct CarGroup {
    const scalar_t* data[CAR_MAX_RANKS];  // every rank's two staging slots
    unsigned int* flags[CAR_MAX_RANKS];   // every rank's flags: [CAR_BLOCKS][CAR_MAX_RANKS]
    uint4* lines[CAR_MAX_RANKS];          // every rank's receive lines: [2][world][ll_lines],
                                          // then its row lines: [2][world][CAR_ROW_LINES / 2]
    unsigned int* epochs;                 // this rank's [CAR_BLOCKS + 1] call counters
    const unsigned int* abort;            // host-mapped; nonzero: leave
    long long slot_chunks;                // 16-byte chunks of one staging slot
    long long ll_max_chunks;              // 16-byte chunks of x the lines hold
    int rank;
    int world_size;
};

struct CustomAllReduceArgs {
    CarGroup g;
    scalar_t* x;       // [n] this rank's x; the sum, in place
    long long chunks;  // 16-byte chunks of x
    int lines;         // nonzero: low-latency lines (chunks <= ll_max_chunks), else staged
};

struct GemvAllReduceArgs {
    CarGroup g;
    const scalar_t* x;  // [k] this rank's input
    const scalar_t* w;  // [n, k] this rank's weight
    int k;
    int n;  // at most CAR_ROW_LINES
};

struct CustomAllReduceNormArgs {
    CarGroup g;
    scalar_t* x;         // [rows, hidden] this rank's x; the normed sum, in place
    scalar_t* residual;  // [rows, hidden] += the sum
    const scalar_t* weight;
    int rows;    // at most CAR_BLOCKS
    int hidden;  // whole 16-byte chunks, one a thread
    float eps;
};

__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// *p = 0 if *p == expected, atomically at system scope.
__device__ __forceinline__ void clear_if_sys(const unsigned int* p, unsigned int expected) {
    unsigned int old;
    asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(old)
                 : "l"(p), "r"(expected), "r"(0u)
                 : "memory");
}

// Not through L1, which does not see the peers' writes.
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void store_volatile(uint4* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// Whether the watchdog asked us to leave; read over PCIe (about a microsecond), so only
// once every 4,096 tries of a wait.
__device__ __forceinline__ bool aborted(const CarGroup& g, unsigned int tries) {
    return (tries & 4095u) == 0u && *(volatile const unsigned int*)g.abort != 0u;
}

// The call number after e: of the other parity (the slots alternate) and never 0, the
// tag of a cleared line. It wraps after 2^32 calls (hours of decode at TP=2), so call
// numbers are only ever compared for equality.
__device__ __forceinline__ unsigned int car_next(unsigned int e) {
    return e == 0xffffffffu ? 2u : e + 1u;
}

// This block's call number (after pdl_enter: the last call's kernel has completed).
__device__ __forceinline__ unsigned int car_begin(const CarGroup& g) {
    __shared__ unsigned int s_epoch;
    if (threadIdx.x == 0) s_epoch = car_next(g.epochs[blockIdx.x]);
    __syncthreads();
    return s_epoch;
}

__device__ __forceinline__ void car_end(const CarGroup& g, unsigned int epoch) {
    if (threadIdx.x == 0) g.epochs[blockIdx.x] = epoch;
}

// Rank r's chunk into the sum, in f32; ranks come in order, rank 0 first.
__device__ __forceinline__ void add_rank(float (&acc)[VEC16], uint4 chunk, int r) {
    float v[VEC16];
    unpack16(chunk, v);
#pragma unroll
    for (int e = 0; e < VEC16; ++e) acc[e] = r == 0 ? v[e] : acc[e] + v[e];
}

// ---- Low-latency lines ----

// Where rank `dst` receives rank `src`'s line pair of chunk i in this call: in the lines,
// or in the row lines (`rows`, below).
__device__ __forceinline__ uint4* ll_at(const CarGroup& g, int dst, int src,
                                        unsigned int epoch, long long i, bool rows = false) {
    const long long lines = 2 * g.ll_max_chunks;
    uint4* base = g.lines[dst];
    long long stride = lines;
    if (rows) {
        base += 2LL * g.world_size * lines;
        stride = CAR_ROW_LINES / 2;  // 8 bytes an output: a chunk's two lines for any dtype
    }
    return base + ((long long)(epoch & 1) * g.world_size + src) * stride + 2 * i;
}

// Chunk v of x, sent to every rank as two lines tagged with the call number.
__device__ __forceinline__ void ll_send(const CarGroup& g, unsigned int epoch, long long i,
                                        uint4 v) {
    const uint4 lo = make_uint4(v.x, epoch, v.y, epoch), hi = make_uint4(v.z, epoch, v.w, epoch);
    for (int r = 0; r < g.world_size; ++r) {
        uint4* p = ll_at(g, r, g.rank, epoch, i);
        store_volatile(p, lo);
        store_volatile(p + 1, hi);
    }
}

// One received line, once it carries this call's number in both halves.
__device__ __forceinline__ uint2 ll_wait(const CarGroup& g, const uint4* p, unsigned int epoch) {
    uint4 v = load_volatile(p);
    for (unsigned int tries = 1; v.y != epoch || v.w != epoch; ++tries) {
        if (aborted(g, tries)) break;
        v = load_volatile(p);
    }
    return make_uint2(v.x, v.z);
}

// Chunk i summed over the ranks in rank order, in f32, from this rank's lines. Each line
// read is cleared, so that no line keeps a tag until its call number comes round again.
__device__ __forceinline__ void ll_sum(const CarGroup& g, unsigned int epoch, long long i,
                                       float (&acc)[VEC16], bool rows = false) {
    const uint4 cleared = make_uint4(0u, 0u, 0u, 0u);
    for (int r = 0; r < g.world_size; ++r) {
        uint4* p = ll_at(g, g.rank, r, epoch, i, rows);
        const uint2 lo = ll_wait(g, p, epoch), hi = ll_wait(g, p + 1, epoch);
        store_volatile(p, cleared);
        store_volatile(p + 1, cleared);
        add_rank(acc, make_uint4(lo.x, lo.y, hi.x, hi.y), r);
    }
}

// Chunk i's sum over the ranks' lines (`rows`: the row lines), rounded to the dtype and
// added to the residual's chunk `r_chunk` as a bf16 add is, stored back as the residual,
// then the row normed into `dst` as fused_add_rms_norm's vectorised path does (the same
// block size, so the same sums). The whole block; `mine`: this thread holds chunk i.
__device__ __forceinline__ void ll_sum_add_rms_norm(const CustomAllReduceNormArgs& a,
                                                    unsigned int epoch, long long i, bool mine,
                                                    uint4 r_chunk, bool rows, scalar_t* dst) {
    float z[VEC16], ss = 0.f;
    if (mine) {
        float r[VEC16];
        unpack16(r_chunk, r);
        ll_sum(a.g, epoch, i, z, rows);
#pragma unroll
        for (int j = 0; j < VEC16; j++) {
            z[j] = round_t(round_t(z[j]) + r[j]);
            ss += z[j] * z[j];
        }
        reinterpret_cast<uint4*>(a.residual)[i] = pack16(z);
    }
    // The weight's load overlaps the row's sum (loaded before the kernel's wait, as
    // norm.cu's kernels do, it held registers through the peers' wait: a 32-byte stack).
    norm_chunk_out(z, ss, mine, a.hidden, a.eps, norm_weight_chunk(a.weight, mine), dst);
}

// ---- Row lines: a one-row gemv's outputs, sent as they are made ----
//
// The gemv's block of GEMV_WARPS outputs (a warp each) meets in shared memory and goes to
// every rank as the lines above carry x: a 16-byte chunk as two lines tagged with the
// call's number, here in a region of their own (`ll_at`'s `rows`). The sender and the
// receiver of a call agree on its number through `epochs[CAR_ROW_EPOCH]`, which only the
// receiver writes, at its end.
//
// Why a slot is free when a sender writes it: rank A's gemv of call e runs after A's
// receiver of call e-1 has read rank B's lines of e-1, which B's gemv sent after its PDL
// wait, so after B's receiver of e-2, the last reader of that slot on B, had completed.

// ---- Staged buffers and a barrier ----

// Rank r's staging slot of this call.
__device__ __forceinline__ uint4* staged_slot(const CarGroup& g, int r, unsigned int epoch) {
    return const_cast<uint4*>(reinterpret_cast<const uint4*>(g.data[r])) +
           (long long)(epoch & 1) * g.slot_chunks;
}

// Tells every rank that this block's chunks are staged, then waits for every rank's word.
// A peer may already be a call ahead (it passed this barrier on our word and went on), so
// its word may read the next call's number; any other value is an older staged call's.
__device__ __forceinline__ void staged_barrier(const CarGroup& g, unsigned int epoch) {
    __syncthreads();
    const int b = blockIdx.x, t = threadIdx.x;
    if (t < g.world_size) {
        store_release_sys(g.flags[t] + b * CAR_MAX_RANKS + g.rank, epoch);
        const unsigned int* word = g.flags[g.rank] + b * CAR_MAX_RANKS + t;
        const unsigned int ahead = car_next(epoch);
        for (unsigned int tries = 1;; ++tries) {
            const unsigned int v = load_acquire_sys(word);
            if (v == ahead || aborted(g, tries)) break;
            if (v == epoch) {
                // Cleared, as a line is, unless the peer has already moved it on.
                clear_if_sys(word, epoch);
                break;
            }
        }
    }
    __syncthreads();
}

// Chunk i summed over the ranks' staged slots in rank order, in f32.
__device__ __forceinline__ void staged_sum(const CarGroup& g, unsigned int epoch, long long i,
                                           float (&acc)[VEC16]) {
    for (int r = 0; r < g.world_size; ++r)
        add_rank(acc, load_volatile(staged_slot(g, r, epoch) + i), r);
}

// ---- The kernels ----

extern "C" __global__ void __launch_bounds__(CAR_THREADS)
    custom_all_reduce(const CustomAllReduceArgs a) {
    pdl_enter();
    const unsigned int epoch = car_begin(a.g);
    const long long stride = (long long)CAR_BLOCKS * CAR_THREADS;
    const long long first = (long long)blockIdx.x * CAR_THREADS + threadIdx.x;
    uint4* x = reinterpret_cast<uint4*>(a.x);
    const bool lines = a.lines != 0;
    if (lines) {
        for (long long i = first; i < a.chunks; i += stride) ll_send(a.g, epoch, i, x[i]);
    } else {
        uint4* mine = staged_slot(a.g, a.g.rank, epoch);
        for (long long i = first; i < a.chunks; i += stride) mine[i] = x[i];
        staged_barrier(a.g, epoch);
    }
    for (long long i = first; i < a.chunks; i += stride) {
        float acc[VEC16];
        if (lines)
            ll_sum(a.g, epoch, i, acc);
        else
            staged_sum(a.g, epoch, i, acc);
        x[i] = pack16(acc);
    }
    car_end(a.g, epoch);
}

// gemv_m1_r1 (gemv.cu) whose blocks send their outputs to every rank's row lines instead
// of writing them: the same sums, so the same bits. n is a multiple of GEMV_WARPS (the
// host checks), so that a block's outputs are whole chunks. The call's number is read
// before the PDL wait: its last writer, the receiver of the call before, completed
// kernels ago (the kernel before this one has passed its own wait).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_m1_all_reduce_send(const GemvAllReduceArgs a) {
    constexpr int CHUNKS = GEMV_WARPS / VEC16;
    __shared__ uint4 outs[CHUNKS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long row0 = (long long)blockIdx.x * GEMV_WARPS;
    const uint4* wr[1] = {reinterpret_cast<const uint4*>(a.w + (row0 + warp) * a.k)};
    const unsigned int epoch = car_next(a.g.epochs[CAR_ROW_EPOCH]);
    pdl_enter();
    float acc[1][1];
    gemv_dots<1, 1>(a.x, wr, a.k, acc);
    if (lane == 0) reinterpret_cast<scalar_t*>(outs)[warp] = from_f32(acc[0][0]);
    __syncthreads();
    // Lane l of warp 0: line l % 2 of chunk l / 2 % CHUNKS to rank l / (2 CHUNKS).
    if (warp == 0 && lane < 2 * CHUNKS * a.g.world_size) {
        const int r = lane / (2 * CHUNKS), ch = lane / 2 % CHUNKS, half = lane % 2;
        const uint4 v = outs[ch];
        const uint4 line = half == 0 ? make_uint4(v.x, epoch, v.y, epoch)
                                     : make_uint4(v.z, epoch, v.w, epoch);
        store_volatile(ll_at(a.g, r, a.g.rank, epoch, row0 / VEC16 + ch, true) + half, line);
    }
}

// The row lines' sum of one token, then `residual += sum; x = rms_norm(residual)`, as
// custom_all_reduce_add_rms_norm (thread c: chunk c). It waits for the sender's grid like
// any kernel: by then most lines have landed, sent while the sender's later blocks still
// streamed their rows. (Not waiting, and polling the lines while the sender runs, was
// slower on the Qwen3-8B's TP=4 shapes and faster on the 70B's, docs/BENCHMARKS.md.)
extern "C" __global__ void __launch_bounds__(1024)
    custom_all_reduce_rows_add_rms_norm(const CustomAllReduceNormArgs a) {
    pdl_enter();
    __shared__ unsigned int s_epoch;
    if (threadIdx.x == 0) s_epoch = car_next(a.g.epochs[CAR_ROW_EPOCH]);
    __syncthreads();
    const unsigned int epoch = s_epoch;
    const int c = threadIdx.x;
    const bool mine = c < a.hidden / VEC16;
    const uint4 r_chunk =
        mine ? reinterpret_cast<const uint4*>(a.residual)[c] : make_uint4(0u, 0u, 0u, 0u);
    ll_sum_add_rms_norm(a, epoch, c, mine, r_chunk, true, a.x);
    if (threadIdx.x == 0) a.g.epochs[CAR_ROW_EPOCH] = epoch;
}

// Row b in block b; thread c holds chunk c of the row (`ll_sum_add_rms_norm`). The
// residual chunk loads while the peers' lines travel.
extern "C" __global__ void __launch_bounds__(1024)
    custom_all_reduce_add_rms_norm(const CustomAllReduceNormArgs a) {
    pdl_enter();
    const unsigned int epoch = car_begin(a.g);
    const int row = blockIdx.x, hc = a.hidden / VEC16, c = threadIdx.x;
    const bool mine = row < a.rows && c < hc;
    const long long i = (long long)row * hc + c;
    uint4 r_chunk = make_uint4(0u, 0u, 0u, 0u);
    if (mine) {
        ll_send(a.g, epoch, i, reinterpret_cast<const uint4*>(a.x)[i]);
        r_chunk = reinterpret_cast<const uint4*>(a.residual)[i];
    }
    if (row < a.rows)
        ll_sum_add_rms_norm(a, epoch, i, mine, r_chunk, false, a.x + (long long)row * a.hidden);
    car_end(a.g, epoch);
}
