//! The CUDA backend's tensor handles: `CudaTensor` (a device buffer of the backend's dtype
//! with its shape), `CudaInts` (step metadata in the step buffers, with the host copy the
//! backend validates against) and `DevicePlan` (the step's attention plan, on both sides).

use std::cell::Cell;

use cudarc::driver::CudaSlice;
use vllm_kernels::cuda::AttentionPlan;

use super::step_buffers::DeviceInts;

/// A row-major tensor of the backend's dtype; `shape[0]` is rows, the rest is columns.
pub struct CudaTensor {
    pub shape: Vec<usize>,
    pub buf: CudaSlice<u8>,
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

/// A step's attention plan (the same for every layer) with its tables on the device.
pub struct DevicePlan {
    pub plan: AttentionPlan,
    /// The (q, kv) heads the plan was made for.
    pub heads: (usize, usize),
    pub tile_seq: DeviceInts,
    pub tile_token: DeviceInts,
    pub decode_seqs: DeviceInts,
    pub decode_partition: DeviceInts,
    /// The KV cache size the block tables were last checked against (once per step, not
    /// per layer).
    pub blocks_checked: Cell<Option<usize>>,
}

/// Small i32 metadata: the device copy the kernels read and the host copy it came from.
pub struct CudaInts {
    pub dev: DeviceInts,
    pub host: Vec<i32>,
}
