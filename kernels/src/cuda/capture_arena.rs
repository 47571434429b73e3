//! `CaptureArena`: the device memory `CudaOps` hands out while CUDA graphs are captured,
//! and `DeviceBuf`, a buffer from it or from the stream-ordered pool.
//!
//! Inside a capture `cuMemAllocAsync` becomes a graph memory node, and a kernel then
//! depends on the node that allocated its output, not on the kernel before it. That costs
//! a node per tensor, and it keeps programmatic dependent launch (launch.rs) from joining
//! the kernels, since programmatic edges run only from kernel to kernel. With an arena
//! set, `CudaOps` takes its buffers from one allocation made before the captures, and a
//! dropped buffer gives its range back: the graph holds kernels and copies only.
//!
//! Why reuse is safe:
//! - **Within a capture.** A range is reused in stream order, as the pool would reuse it.
//!   A kernel that PDL starts early writes nothing before its `pdl_enter()`, so it never
//!   writes into a range that the kernel before it still reads.
//! - **Across graphs.** Every graph shares the arena: they run one at a time on one
//!   stream, and each capture gives back every range it took.
//!
//! Sizing: a `measuring` arena has no memory. The pool serves the buffers while the arena
//! records the highest offset its ranges reach; `backed` then allocates that much. A
//! request that does not fit falls back to the pool (a memory node again) and is counted.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Result;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use super::device::driver_error;

/// Ranges start at multiples of this (what `cuMemAllocAsync` guarantees).
const ALIGN: usize = 256;

/// An arena, shared by `CudaOps` (while it is set) and the buffers holding its ranges.
#[derive(Clone)]
pub struct CaptureArena(Arc<Mutex<ArenaState>>);

struct ArenaState {
    /// The memory, or None while measuring.
    memory: Option<CudaSlice<u8>>,
    capacity: usize,
    /// Given-back ranges (offset, len), sorted by offset, none touching `top`.
    free: Vec<(usize, usize)>,
    /// Everything from here up is unused.
    top: usize,
    high_water: usize,
    fallbacks: usize,
}

/// A range of an arena, given back when dropped.
struct Lease {
    arena: CaptureArena,
    offset: usize,
    len: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.arena.state().give_back(self.offset, self.len);
    }
}

impl CaptureArena {
    /// An arena without memory, to learn how much a pass needs.
    pub fn measuring() -> Self {
        Self::with(None, usize::MAX)
    }

    /// An arena of `bytes` of device memory.
    pub fn backed(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        // SAFETY: every kernel writes its output before anything reads it (as `alloc`).
        let memory = unsafe { stream.alloc::<u8>(bytes.max(ALIGN)) }
            .map_err(|e| driver_error("allocating the graph capture arena", e))?;
        Ok(Self::with(Some(memory), bytes))
    }

    fn with(memory: Option<CudaSlice<u8>>, capacity: usize) -> Self {
        Self(Arc::new(Mutex::new(ArenaState {
            memory,
            capacity,
            free: Vec::new(),
            top: 0,
            high_water: 0,
            fallbacks: 0,
        })))
    }

    fn state(&self) -> MutexGuard<'_, ArenaState> {
        // A panic while holding the lock leaves consistent state (no step is half done).
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most bytes the ranges have spanned at once.
    pub fn high_water(&self) -> usize {
        self.state().high_water
    }

    /// Requests that did not fit and went to the pool.
    pub fn fallbacks(&self) -> usize {
        self.state().fallbacks
    }

    /// A buffer of `len` elements: a range of the arena (measured only, with the memory
    /// from the pool, while measuring), or the pool's when it does not fit.
    pub(crate) fn alloc<T: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<DeviceBuf<T>> {
        let bytes = len * std::mem::size_of::<T>();
        let (taken, base) = {
            let mut s = self.state();
            let taken = s.take(bytes);
            if taken.is_none() {
                s.fallbacks += 1;
            }
            let base = s.memory.as_ref().map(|m| m.device_ptr(stream).0);
            (taken, base)
        };
        let Some(offset) = taken else {
            return DeviceBuf::pool(stream, len);
        };
        let lease = Some(Lease {
            arena: self.clone(),
            offset,
            len: bytes,
        });
        match base {
            // SAFETY: the range lies inside the arena's memory, which outlives the lease
            // (the lease holds the arena); the buffer never frees it (`DeviceBuf::drop`).
            Some(base) => Ok(DeviceBuf {
                slice: ManuallyDrop::new(unsafe {
                    stream.upgrade_device_ptr::<T>(base + offset as u64, len)
                }),
                from_arena: true,
                lease,
                keep: false,
            }),
            None => {
                let mut buf = DeviceBuf::pool(stream, len)?;
                buf.lease = lease;
                Ok(buf)
            }
        }
    }
}

impl ArenaState {
    /// The offset of `bytes` free bytes, first fit, or None.
    fn take(&mut self, bytes: usize) -> Option<usize> {
        let len = bytes.max(1).next_multiple_of(ALIGN);
        if let Some(i) = self.free.iter().position(|&(_, l)| l >= len) {
            let (offset, l) = self.free[i];
            if l == len {
                self.free.remove(i);
            } else {
                self.free[i] = (offset + len, l - len);
            }
            return Some(offset);
        }
        if self.capacity - self.top < len {
            return None;
        }
        let offset = self.top;
        self.top += len;
        self.high_water = self.high_water.max(self.top);
        Some(offset)
    }

    fn give_back(&mut self, offset: usize, bytes: usize) {
        let len = bytes.max(1).next_multiple_of(ALIGN);
        let i = self.free.partition_point(|&(o, _)| o < offset);
        self.free.insert(i, (offset, len));
        // Join with the next range, then the previous one.
        if i + 1 < self.free.len() && offset + len == self.free[i + 1].0 {
            self.free[i].1 += self.free.remove(i + 1).1;
        }
        let mut i = i;
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == offset {
            self.free[i - 1].1 += self.free.remove(i).1;
            i -= 1;
        }
        if self.free[i].0 + self.free[i].1 == self.top {
            self.top = self.free.remove(i).0;
        }
    }
}

/// Device memory of `T`s: the pool's (freed stream-ordered when dropped) or an arena's
/// range (given back when dropped). Dereferences to the `CudaSlice` the kernels take.
pub struct DeviceBuf<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// Whether `slice` is a view of an arena's memory (never freed through it).
    from_arena: bool,
    lease: Option<Lease>,
    /// Set by `release`: drop neither frees nor gives back.
    keep: bool,
}

impl<T: DeviceRepr> DeviceBuf<T> {
    pub(crate) fn pool(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        // SAFETY: every kernel writes its whole output before anyone reads it; tests
        // poison outputs with `fill` to check exactly that.
        let slice = unsafe { stream.alloc::<T>(len) }
            .map_err(|e| driver_error(&format!("allocating {len} elements"), e))?;
        Ok(slice.into())
    }
}

impl<T> DeviceBuf<T> {
    /// Drops the handle without freeing the memory or giving it back (memory another
    /// owner frees, see the worker's `Borrowed`).
    pub fn release(mut self) {
        self.keep = true;
    }

    /// Whether the memory is an arena's range (which outlives the buffer) rather than
    /// the pool's.
    pub fn from_arena(&self) -> bool {
        self.from_arena
    }
}

impl<T> From<CudaSlice<T>> for DeviceBuf<T> {
    fn from(slice: CudaSlice<T>) -> Self {
        Self {
            slice: ManuallyDrop::new(slice),
            from_arena: false,
            lease: None,
            keep: false,
        }
    }
}

impl<T> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is not touched again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        if self.keep {
            std::mem::forget(self.lease.take());
            let _ = slice.leak();
        } else if self.from_arena {
            let _ = slice.leak();
        } else {
            drop(slice);
        }
        // The lease (if any) gives the range back after the memory is let go.
    }
}

impl<T> Deref for DeviceBuf<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DeviceBuf<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> ArenaState {
        ArenaState {
            memory: None,
            capacity: 10 * ALIGN,
            free: Vec::new(),
            top: 0,
            high_water: 0,
            fallbacks: 0,
        }
    }

    #[test]
    fn ranges_are_reused_and_joined() {
        let mut s = state();
        let a = s.take(1).unwrap();
        let b = s.take(ALIGN + 1).unwrap();
        let c = s.take(ALIGN).unwrap();
        assert_eq!((a, b, c), (0, ALIGN, 3 * ALIGN));
        assert_eq!(s.high_water, 4 * ALIGN);
        s.give_back(b, ALIGN + 1);
        // First fit: the hole b left.
        assert_eq!(s.take(ALIGN), Some(ALIGN));
        s.give_back(ALIGN, ALIGN);
        s.give_back(a, 1);
        assert_eq!(s.free, vec![(0, 3 * ALIGN)]);
        // Giving back the top range joins everything and lowers the top.
        s.give_back(c, ALIGN);
        assert!(s.free.is_empty());
        assert_eq!(s.top, 0);
        assert_eq!(s.high_water, 4 * ALIGN);
    }

    #[test]
    fn a_request_past_the_capacity_is_refused() {
        let mut s = state();
        assert_eq!(s.take(10 * ALIGN), Some(0));
        assert_eq!(s.take(1), None);
        s.give_back(0, 10 * ALIGN);
        assert_eq!(s.take(5 * ALIGN), Some(0));
    }
}
