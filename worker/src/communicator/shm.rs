//! `ShmCommunicator`: the CPU backend's collectives, through one file that every rank of
//! the run maps into memory (`<run_dir>/tensor-parallel.shm`).
//!
//! The file holds one arrival counter per rank (each on its own cache line) and one data
//! slot per rank. A collective moves its data through the slots in chunks: each rank
//! writes its chunk into its own slot, waits at a barrier until every rank has written,
//! reads what it needs from all slots, and waits at a second barrier so that no rank
//! overwrites a slot another is still reading. The barrier is a generation count: rank r
//! publishes "I reached barrier g" and waits until every counter reaches g. No lock, no
//! process-shared mutex, and a peer that never arrives is named in the timeout error.

use std::cell::Cell;
use std::fs::OpenOptions;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use memmap2::MmapRaw;

use super::Communicator;
use crate::backend::cpu::CpuTensor;

/// Bytes of the header: one 64-byte line per rank, for at most this many ranks.
const MAX_RANKS: usize = 64;
const HEADER_BYTES: usize = MAX_RANKS * 64;
/// f32 elements per rank per chunk (1 MiB).
const SLOT_ELEMS: usize = 1 << 18;

pub struct ShmCommunicator {
    map: MmapRaw,
    rank: usize,
    world_size: usize,
    /// The last barrier this rank reached; every rank passes the same barriers in order.
    generation: Cell<u64>,
    timeout: Duration,
}

impl ShmCommunicator {
    /// Maps (creating it if this rank is first) the group's file at `path`.
    pub fn open(path: &Path, rank: usize, world_size: usize, timeout: Duration) -> Result<Self> {
        ensure!(
            (1..=MAX_RANKS).contains(&world_size) && rank < world_size,
            "shared-memory communicator: rank {rank} of {world_size} (at most {MAX_RANKS} ranks)"
        );
        let len = HEADER_BYTES + world_size * SLOT_ELEMS * 4;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        // Every rank sets the same length; a new file reads as zeros, so all counters
        // start at generation 0 whichever rank comes first.
        file.set_len(len as u64)
            .with_context(|| format!("sizing {}", path.display()))?;
        let map = MmapRaw::map_raw(&file).with_context(|| format!("mapping {}", path.display()))?;
        Ok(Self {
            map,
            rank,
            world_size,
            generation: Cell::new(0),
            timeout,
        })
    }

    fn arrival(&self, rank: usize) -> &AtomicU64 {
        debug_assert!(rank < self.world_size);
        // SAFETY: the header lies inside the mapping, each counter on its own 64-byte
        // line (so aligned for AtomicU64); other processes touch it only atomically.
        unsafe { &*(self.map.as_mut_ptr().add(rank * 64) as *const AtomicU64) }
    }

    fn slot(&self, rank: usize) -> *mut f32 {
        debug_assert!(rank < self.world_size);
        // SAFETY: slot `rank` lies inside the mapping (see `open`'s length).
        unsafe {
            self.map
                .as_mut_ptr()
                .add(HEADER_BYTES + rank * SLOT_ELEMS * 4) as *mut f32
        }
    }

    fn write_own_slot(&self, data: &[f32]) {
        debug_assert!(data.len() <= SLOT_ELEMS);
        // SAFETY: only this rank writes its slot, and no rank reads it between the
        // barrier that ended the last chunk and the barrier that follows this write.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.slot(self.rank), data.len()) }
    }

    fn read_slot(&self, rank: usize, len: usize) -> &[f32] {
        debug_assert!(len <= SLOT_ELEMS);
        // SAFETY: called between the two barriers of a chunk, when no rank writes.
        unsafe { std::slice::from_raw_parts(self.slot(rank), len) }
    }

    /// Waits until every rank has reached this barrier, or fails after the timeout naming
    /// the ranks that did not come.
    fn barrier(&self, what: &str) -> Result<()> {
        let generation = self.generation.get() + 1;
        self.generation.set(generation);
        self.arrival(self.rank).store(generation, Ordering::Release);
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            let missing: Vec<usize> = (0..self.world_size)
                .filter(|&r| self.arrival(r).load(Ordering::Acquire) < generation)
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            spins += 1;
            if spins < 200 {
                std::hint::spin_loop();
                continue;
            }
            // Ranks may outnumber cores (TP=4 on a 2-core machine): stop spinning soon.
            if started.elapsed() > self.timeout {
                bail!(
                    "tensor-parallel {what}: rank(s) {missing:?} did not join within {:.0} s \
                     (a peer hangs or died); giving up on the group",
                    self.timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Sum of every rank's `x`, in place, added in rank order.
    pub fn all_reduce_f32(&self, x: &mut [f32]) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        for chunk in x.chunks_mut(SLOT_ELEMS) {
            self.write_own_slot(chunk);
            self.barrier("all-reduce")?;
            let n = chunk.len();
            chunk.copy_from_slice(self.read_slot(0, n));
            for r in 1..self.world_size {
                for (o, v) in chunk.iter_mut().zip(self.read_slot(r, n)) {
                    *o += v;
                }
            }
            self.barrier("all-reduce")?;
        }
        Ok(())
    }

    /// Every rank's `x` (all of one length), concatenated in rank order.
    pub fn all_gather_f32(&self, x: &[f32]) -> Result<Vec<f32>> {
        let n = x.len();
        let mut out = vec![0.0; n * self.world_size];
        for (c, chunk) in x.chunks(SLOT_ELEMS).enumerate() {
            self.write_own_slot(chunk);
            self.barrier("all-gather")?;
            for r in 0..self.world_size {
                let at = r * n + c * SLOT_ELEMS;
                out[at..at + chunk.len()].copy_from_slice(self.read_slot(r, chunk.len()));
            }
            self.barrier("all-gather")?;
        }
        Ok(out)
    }

    /// `x` becomes rank `root`'s `x`.
    pub fn broadcast_f32(&self, x: &mut [f32], root: usize) -> Result<()> {
        ensure!(
            root < self.world_size,
            "broadcast from rank {root} of {}",
            self.world_size
        );
        for chunk in x.chunks_mut(SLOT_ELEMS) {
            if self.rank == root {
                self.write_own_slot(chunk);
            }
            self.barrier("broadcast")?;
            if self.rank != root {
                chunk.copy_from_slice(self.read_slot(root, chunk.len()));
            }
            self.barrier("broadcast")?;
        }
        Ok(())
    }
}

impl Communicator for ShmCommunicator {
    type Tensor = CpuTensor;

    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, x: &mut CpuTensor) -> Result<()> {
        self.all_reduce_f32(&mut x.data)
    }

    fn all_gather(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let mut shape = x.shape.clone();
        shape[0] *= self.world_size;
        Ok(CpuTensor::new(shape, self.all_gather_f32(&x.data)?))
    }

    fn broadcast(&self, x: &mut CpuTensor, root: usize) -> Result<()> {
        self.broadcast_f32(&mut x.data, root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f(rank)` on `n` threads, each with its own mapping of one file, as the worker
    /// processes would.
    fn on_ranks<T: Send>(
        n: usize,
        timeout: Duration,
        f: impl Fn(ShmCommunicator) -> T + Sync,
    ) -> Vec<T> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tp.shm");
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let (f, path) = (&f, &path);
                    s.spawn(move || f(ShmCommunicator::open(path, rank, n, timeout).unwrap()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Values that differ per rank and per element, larger than one slot so chunks are used.
    fn rank_data(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + rank * 13) % 101) as f32 * 0.37 - 11.0)
            .collect()
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        let len = SLOT_ELEMS * 2 + 123;
        let results = on_ranks(3, Duration::from_secs(30), |c| {
            let mut x = rank_data(c.rank(), len);
            c.all_reduce_f32(&mut x).unwrap();
            // A second collective right after must not see stale data.
            let mut y = vec![c.rank() as f32 + 1.0; 5];
            c.all_reduce_f32(&mut y).unwrap();
            (x, y)
        });
        let (r0, r1, r2) = (rank_data(0, len), rank_data(1, len), rank_data(2, len));
        let expected: Vec<f32> = (0..len).map(|i| (r0[i] + r1[i]) + r2[i]).collect();
        for (x, y) in &results {
            assert_eq!(x, &expected, "bit-identical on every rank");
            assert_eq!(y, &vec![6.0; 5]);
        }
    }

    #[test]
    fn all_gather_stacks_ranks_in_order() {
        let len = SLOT_ELEMS + 9;
        let results = on_ranks(4, Duration::from_secs(30), |c| {
            let t = CpuTensor::new(vec![1, len], rank_data(c.rank(), len));
            c.all_gather(&t).unwrap()
        });
        let expected: Vec<f32> = (0..4).flat_map(|r| rank_data(r, len)).collect();
        for t in results {
            assert_eq!(t.shape, vec![4, len]);
            assert_eq!(t.data, expected);
        }
    }

    #[test]
    fn broadcast_copies_the_root() {
        let results = on_ranks(3, Duration::from_secs(30), |c| {
            let mut x = rank_data(c.rank(), 1000);
            c.broadcast_f32(&mut x, 2).unwrap();
            x
        });
        for x in results {
            assert_eq!(x, rank_data(2, 1000));
        }
    }

    #[test]
    fn a_missing_rank_times_out_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tp.shm");
        let c = ShmCommunicator::open(&path, 0, 3, Duration::from_millis(200)).unwrap();
        // Rank 1 arrives, rank 2 never does.
        let peer = ShmCommunicator::open(&path, 1, 3, Duration::from_millis(200)).unwrap();
        let t = std::thread::spawn(move || peer.all_reduce_f32(&mut [1.0]).map(|_| ()));
        let err = c.all_reduce_f32(&mut [1.0]).unwrap_err().to_string();
        assert!(err.contains("rank(s) [2] did not join"), "{err}");
        assert!(t.join().unwrap().is_err());
    }
}
