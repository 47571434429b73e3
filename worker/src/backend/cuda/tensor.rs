//! The CUDA backend's tensor handles: `CudaTensor` (a device buffer of the backend's dtype
//! with its shape), `Borrowed` (a handle over memory another owner frees), `CudaInts`
//! (step metadata in the step buffers, with the host copy the backend validates against)
//! and `DevicePlan` (the step's attention plan, on both sides).

use std::cell::Cell;
use std::ops::Deref;

use cudarc::driver::CudaSlice;
use vllm_kernels::cuda::{AttentionPlan, DeviceBuf};

/// A row-major tensor of the backend's dtype; `shape[0]` is rows, the rest is columns.
pub struct CudaTensor {
    pub shape: Vec<usize>,
    pub buf: DeviceBuf<u8>,
}

impl CudaTensor {
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    pub fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A device handle that frees its memory when dropped, unless it is `Borrowed`.
pub trait DeviceHandle {
    /// Drops the handle without freeing the memory.
    fn release(self);
}

impl<T> DeviceHandle for CudaSlice<T> {
    fn release(self) {
        let _ = self.leak();
    }
}

impl DeviceHandle for CudaTensor {
    fn release(self) {
        self.buf.release();
    }
}

/// A handle over memory that another owner allocated and frees (a range of the step
/// buffers, rows of the CUDA graphs' output), so that kernel wrappers and the sampler
/// take it as they take any buffer; dropping it releases the handle only.
pub struct Borrowed<T: DeviceHandle>(Option<T>);

impl<T: DeviceHandle> Borrowed<T> {
    /// # Safety
    /// `handle`'s memory must outlive the `Borrowed`, and nothing may free it through
    /// `handle`.
    pub unsafe fn new(handle: T) -> Self {
        Self(Some(handle))
    }
}

impl<T: DeviceHandle> Deref for Borrowed<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // Only `drop` empties it.
        self.0.as_ref().expect("Borrowed used after drop")
    }
}

impl<T: DeviceHandle> Drop for Borrowed<T> {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            handle.release();
        }
    }
}

/// A range of the step buffers.
pub type DeviceInts = Borrowed<CudaSlice<i32>>;

/// A step's attention plan (the same for every layer) with its tables on the device.
pub struct DevicePlan {
    pub plan: AttentionPlan,
    /// The (q, kv) heads the plan was made for.
    pub heads: (usize, usize),
    pub tile_seq: DeviceInts,
    pub tile_token: DeviceInts,
    pub decode_seqs: DeviceInts,
    pub step_dims: DeviceInts,
    /// The KV cache size the block tables were last checked against (once per step, not
    /// per layer).
    pub blocks_checked: Cell<Option<usize>>,
}

/// Small i32 metadata: the device copy the kernels read and the host copy it came from.
pub struct CudaInts {
    pub dev: DeviceInts,
    pub host: Vec<i32>,
}
