//! `NcclCommunicator`: the CUDA backend's collectives, NCCL on the backend's one stream, so
//! they are ordered with the kernels around them and the host never waits for them.
//!
//! A hung collective (a peer stopped or lost) keeps the GPU spinning and the host waiting
//! for ever; [`NcclAbort`] lets the worker's watchdog abort the communicator from another
//! thread, which makes NCCL's kernels return so that the step fails instead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use vllm_kernels::cuda::nccl::{DataType, Nccl, RawComm, UniqueId};
use vllm_kernels::cuda::DType;

use super::Communicator;
use crate::backend::cuda::CudaTensor;

/// The communicator handle, shared with the watchdog so it can abort it.
pub struct NcclAbort {
    nccl: &'static Nccl,
    comm: RawComm,
    aborted: AtomicBool,
}

// SAFETY: an ncclComm_t may be aborted from any thread (NCCL's documented way to end a
// hung operation); every other use stays on the owner's thread.
unsafe impl Send for NcclAbort {}
// SAFETY: as above; `aborted` makes the abort happen once.
unsafe impl Sync for NcclAbort {}

impl NcclAbort {
    /// Aborts the communicator: its operations in flight end, and it may not be used again.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the comm is live (not yet aborted), and after this only `Drop`
            // looks at it, which sees `aborted`.
            if let Err(e) = unsafe { self.nccl.comm_abort(self.comm) } {
                tracing::error!("aborting the NCCL communicator: {e:#}");
            }
        }
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl Drop for NcclAbort {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for peers that may be gone.
        self.abort();
    }
}

pub struct NcclCommunicator {
    handle: Arc<NcclAbort>,
    stream: Arc<CudaStream>,
    dtype: DType,
    rank: usize,
    world_size: usize,
}

fn nccl_type(dtype: DType) -> DataType {
    match dtype {
        DType::BF16 => DataType::Bfloat16,
        DType::F16 => DataType::Float16,
        DType::F32 => DataType::Float32,
    }
}

impl NcclCommunicator {
    /// A fresh unique id, made by the rank that proposes the group (rank 0).
    pub fn unique_id() -> Result<Vec<u8>> {
        Ok(Nccl::get()?.unique_id()?.to_bytes())
    }

    /// Joins the group; blocks until all `world_size` ranks have joined. The stream's
    /// context must be current on this thread (it is: the backend bound it).
    pub fn join(
        unique_id: &[u8],
        rank: usize,
        world_size: usize,
        stream: Arc<CudaStream>,
        dtype: DType,
    ) -> Result<Self> {
        let nccl = Nccl::get()?;
        let id = UniqueId::from_bytes(unique_id)?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow::anyhow!("binding the CUDA context before joining NCCL: {e:?}"))?;
        let comm = nccl.comm_init_rank(id, rank, world_size)?;
        tracing::info!(
            rank,
            world_size,
            nccl_version = nccl.version,
            "joined the NCCL group"
        );
        Ok(Self {
            handle: Arc::new(NcclAbort {
                nccl,
                comm,
                aborted: AtomicBool::new(false),
            }),
            stream,
            dtype,
            rank,
            world_size,
        })
    }

    /// For the watchdog.
    pub fn abort_handle(&self) -> Arc<NcclAbort> {
        self.handle.clone()
    }

    fn live(&self) -> Result<(&'static Nccl, RawComm)> {
        ensure!(
            !self.handle.is_aborted(),
            "the NCCL communicator was aborted (a collective hung past the timeout)"
        );
        Ok((self.handle.nccl, self.handle.comm))
    }

    fn raw_stream(&self) -> *mut std::ffi::c_void {
        self.stream.cu_stream() as *mut std::ffi::c_void
    }
}

impl Communicator for NcclCommunicator {
    type Tensor = CudaTensor;

    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, x: &mut CudaTensor) -> Result<()> {
        let (nccl, comm) = self.live()?;
        let n = x.numel();
        let (p, _g) = x.buf.device_ptr_mut(&self.stream);
        // SAFETY: in place over `x`'s n elements of the backend dtype, on its stream.
        unsafe { nccl.all_reduce_sum(p, p, n, nccl_type(self.dtype), comm, self.raw_stream()) }
    }

    fn all_gather(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let (nccl, comm) = self.live()?;
        let n = x.numel();
        let mut shape = x.shape.clone();
        shape[0] *= self.world_size;
        // SAFETY: NCCL writes every element of the output before anything reads it.
        let mut buf = unsafe {
            self.stream
                .alloc::<u8>((n * self.world_size).max(1) * self.dtype.size())
        }
        .map_err(|e| anyhow::anyhow!("allocating the all-gather output: {e:?}"))?;
        {
            let (src, _g0) = x.buf.device_ptr(&self.stream);
            let (dst, _g1) = buf.device_ptr_mut(&self.stream);
            // SAFETY: src holds n elements, dst n · world_size, both on this stream.
            unsafe {
                nccl.all_gather(src, dst, n, nccl_type(self.dtype), comm, self.raw_stream())?
            };
        }
        Ok(CudaTensor {
            shape,
            buf: buf.into(),
        })
    }

    fn broadcast(&self, x: &mut CudaTensor, root: usize) -> Result<()> {
        ensure!(
            root < self.world_size,
            "broadcast from rank {root} of {}",
            self.world_size
        );
        let (nccl, comm) = self.live()?;
        let n = x.numel();
        let (p, _g) = x.buf.device_ptr_mut(&self.stream);
        // SAFETY: in place over `x`'s n elements, on its stream.
        unsafe {
            nccl.broadcast(
                p,
                p,
                n,
                nccl_type(self.dtype),
                root,
                comm,
                self.raw_stream(),
            )
        }
    }
}
