// How quiet this machine's CPUs are: THREADS threads each run the same fixed integer work in
// chunks (about 25 us on an idle core) for SECONDS, and count the chunks that took over
// three times the thread's fastest. A busy or throttled host (the GPU machines are KVM guests)
// slows every core at once, the engine's host work with it: on one machine an eager step's
// launches then took 5-17 ms instead of 1.5 (docs/BENCHMARKS.md, "The TTFT tail's stalls
// are the host's"). gpu_round.sh's `info` stage runs it so each round's figures come with it.
//
// usage: host_noise THREADS SECONDS
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

struct result {
    unsigned long seed;
    long chunks, slow;
    double best, worst, lost;  // seconds: fastest chunk, slowest, and time over the fastest
};

static double seconds;

static void* spin(void* arg) {
    struct result* r = arg;
    unsigned long x = r->seed;
    r->best = 1e9;
    const double t0 = now();
    // A chunk runs from the last one's end to its own: one clock read a chunk.
    for (double s = t0, e; s - t0 < seconds; s = e) {
        for (int i = 0; i < 20000; i++) x = x * 6364136223846793005ul + 1442695040888963407ul;
        e = now();
        const double d = e - s;
        // The first second only finds the fastest chunk (clocks ramp up).
        if (d < r->best) r->best = d;
        if (e - t0 < 1.0) continue;
        r->chunks++;
        if (d > 3 * r->best) r->slow++;
        if (d > r->worst) r->worst = d;
        r->lost += d - r->best;
    }
    // Keeps the loop's result live.
    if (x == 42) printf(" ");
    return NULL;
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: host_noise THREADS SECONDS\n");
        return 2;
    }
    const int threads = atoi(argv[1]);
    seconds = atof(argv[2]);
    if (threads < 1 || threads > 64 || seconds < 2) {
        fprintf(stderr, "host_noise: 1-64 threads, at least 2 seconds\n");
        return 2;
    }
    pthread_t th[64];
    struct result r[64] = {{0}};
    for (int i = 0; i < threads; i++) {
        r[i].seed = (unsigned long)i + 1;
        pthread_create(&th[i], NULL, spin, &r[i]);
    }
    long chunks = 0, slow = 0;
    double worst = 0, lost = 0, best = 1e9;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        chunks += r[i].chunks;
        slow += r[i].slow;
        lost += r[i].lost;
        if (r[i].worst > worst) worst = r[i].worst;
        if (r[i].best < best) best = r[i].best;
    }
    const double measured = threads * (seconds - 1.0);
    printf("host noise: %d threads x %.0f s, chunk %.1f us at best; %ld of %ld chunks over 3x "
           "(%.1f a second a thread), slowest %.0f us, %.2f %% of the time lost\n",
           threads, seconds, best * 1e6, slow, chunks, slow / measured, worst * 1e6,
           100.0 * lost / measured);
    return 0;
}
