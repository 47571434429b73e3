//! The tensor-parallel communicator (DESIGN §7): the collectives that join the ranks of one
//! model, on the backend's own tensors.
//!
//! Two implementations: [`ShmCommunicator`] moves f32 rows through a file every rank of
//! the run maps (the CPU backend, so CI tests tensor parallelism without a GPU), and
//! [`NcclCommunicator`] runs NCCL on the CUDA stream. A collective that a peer never joins
//! fails after the `--execute-model-timeout` instead of hanging the rank for ever.

pub mod nccl;
pub mod shm;

pub use nccl::NcclCommunicator;
pub use shm::ShmCommunicator;

use anyhow::Result;

/// Collectives over the ranks of one tensor-parallel group. Every rank calls the same
/// collectives in the same order, with tensors of the same shape.
pub trait Communicator {
    type Tensor;

    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// `x` becomes the element-wise sum of every rank's `x`. The sum runs in rank order on
    /// every rank, so all ranks hold the same result, bit for bit.
    fn all_reduce(&self, x: &mut Self::Tensor) -> Result<()>;

    /// Every rank's `x` ([rows, cols], one shape on all ranks) stacked in rank order:
    /// [world_size · rows, cols].
    fn all_gather(&self, x: &Self::Tensor) -> Result<Self::Tensor>;

    /// `x` becomes rank `root`'s `x`.
    fn broadcast(&self, x: &mut Self::Tensor, root: usize) -> Result<()>;
}
