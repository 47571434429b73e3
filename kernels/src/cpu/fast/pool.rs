//! `ThreadPool`: a persistent pool of one thread per core that runs one parallel loop at a
//! time, for the fast CPU kernels.
//!
//! A batch-1 decode step of a small model is ~150 parallel loops of 20–200 µs each, so the
//! cost of starting a loop matters as much as the loop: threads are spawned once, and
//! between loops they spin (for `VLLM_CPU_SPIN_US`, 1 ms by default) before they sleep on a
//! condition variable, so consecutive loops of a step start in well under a microsecond.
//! The calling thread works too: a pool of N threads spawns N − 1.
//!
//! Tasks are claimed one at a time from a shared counter, so a thread that the OS delays
//! (a busy shared machine) only delays the tasks it has already claimed. One caller uses
//! the pool at a time; a second caller (another backend in the same process, or a task
//! that itself calls `run`) runs its loop serially instead of waiting.

use std::collections::HashMap;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Threads of the default pool: `VLLM_CPU_NUM_THREADS`, else one per core the process may
/// use.
pub fn default_threads() -> usize {
    std::env::var("VLLM_CPU_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn spin_time() -> Duration {
    let us = std::env::var("VLLM_CPU_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1000);
    Duration::from_micros(us)
}

/// Spins between `yield_now` calls of a waiting thread (about a microsecond).
const YIELD_EVERY: u32 = 64;

/// The job the workers see: a type-erased `&F` and the function that calls it.
type Call = unsafe fn(*const (), usize);

unsafe fn call_closure<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    // SAFETY: `data` is the `&F` that `run` published, alive until every reader is gone.
    unsafe { (*(data as *const F))(i) }
}

struct Shared {
    /// `epoch << 1 | open`: a new job gets a new epoch; open while its tasks may be claimed.
    state: AtomicU64,
    job_data: AtomicPtr<()>,
    job_call: AtomicPtr<()>,
    tasks: AtomicUsize,
    /// The next task index to claim.
    next: AtomicUsize,
    /// Tasks finished.
    done: AtomicUsize,
    /// Workers between joining a job and leaving it: the caller may not return (and free
    /// the closure) while one may still read the job.
    readers: AtomicUsize,
    sleepers: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    spin: Duration,
}

impl Shared {
    fn is_new_job(&self, state: u64, seen: u64) -> bool {
        state & 1 == 1 && state >> 1 != seen
    }

    /// Claims and runs tasks of the current job until none is left.
    fn work(&self, data: *const (), call: Call, tasks: usize) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= tasks {
                return;
            }
            // SAFETY: `call` and `data` were published together for this job, and the
            // caller keeps the closure alive until `done` reaches `tasks`.
            if catch_unwind(AssertUnwindSafe(|| unsafe { call(data, i) })).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }

    fn worker_loop(&self) {
        let mut seen = 0u64;
        loop {
            // Wait for a job this worker has not joined: spin, then sleep.
            let started = Instant::now();
            let mut spins = 0u32;
            loop {
                if self.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if self.is_new_job(self.state.load(Ordering::Acquire), seen) {
                    break;
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(YIELD_EVERY) {
                    if started.elapsed() > self.spin {
                        self.sleep(seen);
                        break;
                    }
                    // On a busy machine, let a runnable thread of this core go first.
                    std::thread::yield_now();
                }
                std::hint::spin_loop();
            }
            // Join (Dekker with the caller's close: SeqCst on both sides).
            self.readers.fetch_add(1, Ordering::SeqCst);
            let state = self.state.load(Ordering::SeqCst);
            if self.is_new_job(state, seen) {
                seen = state >> 1;
                let data = self.job_data.load(Ordering::Relaxed) as *const ();
                let call = self.job_call.load(Ordering::Relaxed);
                let tasks = self.tasks.load(Ordering::Relaxed);
                // SAFETY: `job_call` only ever holds a `Call` (see `run`).
                let call: Call = unsafe { std::mem::transmute::<*mut (), Call>(call) };
                self.work(data, call, tasks);
            }
            self.readers.fetch_sub(1, Ordering::Release);
        }
    }

    fn sleep(&self, seen: u64) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.shutdown.load(Ordering::SeqCst)
            && !self.is_new_job(self.state.load(Ordering::SeqCst), seen)
        {
            guard = self.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        drop(guard);
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the one caller whose loop the workers run.
    caller: Mutex<()>,
    epoch: AtomicU64,
}

impl ThreadPool {
    /// A pool of `threads` threads in all: the caller and `threads - 1` spawned workers.
    pub fn new(threads: usize) -> Self {
        Self::with_spin(threads, spin_time())
    }

    /// A pool whose idle workers spin for `spin` before they sleep.
    pub fn with_spin(threads: usize, spin: Duration) -> Self {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job_data: AtomicPtr::new(std::ptr::null_mut()),
            job_call: AtomicPtr::new(std::ptr::null_mut()),
            tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            readers: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin,
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("vllm-cpu-{i}"))
                    .spawn(move || s.worker_loop())
                    .expect("cannot spawn a CPU kernel thread")
            })
            .collect();
        Self {
            shared,
            workers,
            caller: Mutex::new(()),
            epoch: AtomicU64::new(0),
        }
    }

    /// The process's pool of `threads` threads, created on first use and shared by every
    /// backend that asks for the same size.
    pub fn shared(threads: usize) -> Arc<ThreadPool> {
        static POOLS: OnceLock<Mutex<HashMap<usize, Arc<ThreadPool>>>> = OnceLock::new();
        let pools = POOLS.get_or_init(Default::default);
        let mut pools = pools.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(
            pools
                .entry(threads.max(1))
                .or_insert_with(|| Arc::new(ThreadPool::new(threads))),
        )
    }

    /// Threads that run a loop, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` once for every `i` in `0..tasks`, spread over the pool's threads, and
    /// returns when all have returned. A panic in a task is re-raised here.
    pub fn run<F: Fn(usize) + Sync>(&self, tasks: usize, f: F) {
        let guard = match self.caller.try_lock() {
            Ok(g) if tasks > 1 && !self.workers.is_empty() => g,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let s = &*self.shared;
        let epoch = self.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        s.job_data
            .store(&f as *const F as *const () as *mut (), Ordering::Relaxed);
        s.job_call
            .store(call_closure::<F> as Call as *mut (), Ordering::Relaxed);
        s.tasks.store(tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.state.store(epoch << 1 | 1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        s.work(
            &f as *const F as *const (),
            call_closure::<F> as Call,
            tasks,
        );
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < tasks {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(YIELD_EVERY) {
                std::thread::yield_now();
            }
            std::hint::spin_loop();
        }
        // Close the job, then wait for every worker that joined it to leave.
        s.state.store(epoch << 1, Ordering::SeqCst);
        while s.readers.load(Ordering::SeqCst) > 0 {
            std::hint::spin_loop();
        }
        let panicked = s.panicked.load(Ordering::Relaxed);
        drop(guard);
        if panicked {
            resume_unwind(Box::new("a task of the CPU thread pool panicked"));
        }
    }

    /// `f(start, end)` over `0..n` cut into about `chunks` contiguous ranges, in parallel.
    pub fn for_ranges<F: Fn(usize, usize) + Sync>(&self, n: usize, chunks: usize, f: F) {
        let chunks = chunks.clamp(1, n.max(1));
        let per = n.div_ceil(chunks);
        self.run(n.div_ceil(per.max(1)), |c| {
            f(c * per, ((c + 1) * per).min(n))
        });
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for tasks in [0, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn many_short_loops_and_sleeping_workers() {
        let pool = ThreadPool::with_spin(2, Duration::ZERO);
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            if round % 500 == 0 {
                std::thread::sleep(Duration::from_millis(2)); // let the worker sleep
            }
            pool.run(4, |i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 6);
    }

    #[test]
    fn nested_and_concurrent_callers_run_serially() {
        let pool = Arc::new(ThreadPool::new(2));
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        pool.run(3, |_| {
                            pool.run(2, |_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 200 * 6);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_goes_on() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, |i| assert!(i != 5, "task five"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(8, |_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn ranges_cover_without_overlap() {
        let pool = ThreadPool::new(2);
        for (n, chunks) in [(10, 3), (1, 4), (0, 2), (100, 100), (7, 1)] {
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_ranges(n, chunks, |a, b| {
                for s in &seen[a..b] {
                    s.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(seen.iter().all(|s| s.load(Ordering::Relaxed) == 1));
        }
    }
}
