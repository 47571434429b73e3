//! The CUDA backend's tensor handles: `CudaTensor` (a device buffer of the backend's dtype
//! with its shape) and `CudaInts` (step metadata on the device, with the host copy the
//! backend validates against and plans attention launches from).

use std::cell::OnceCell;

use cudarc::driver::CudaSlice;
use vllm_kernels::cuda::AttentionPlan;

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

/// An attention plan with its tile tables on the device.
pub struct DevicePlan {
    pub plan: AttentionPlan,
    pub tile_seq: CudaSlice<i32>,
    pub tile_token: CudaSlice<i32>,
    pub decode_seqs: CudaSlice<i32>,
}

/// Small i32 metadata: the device copy the kernels read and the host copy it came from.
pub struct CudaInts {
    pub dev: CudaSlice<i32>,
    pub host: Vec<i32>,
    /// Filled by the first attention layer of a step (on `query_start_loc`) and reused by
    /// the others: the plan is the same for every layer.
    pub attention_plan: OnceCell<DevicePlan>,
}
