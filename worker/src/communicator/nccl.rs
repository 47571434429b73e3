//! `NcclCommunicator`: the CUDA backend's collectives, NCCL on the backend's one stream, so
//! they are ordered with the kernels around them and the host never waits for them.
//!
//! All-reduces of decode-sized messages take the one-shot kernel over peer memory instead
//! (`CustomAllReduce`, where every pair of the group's GPUs reaches the other's memory and
//! `--disable-custom-all-reduce` is not given): NCCL's latency is most of their cost.
//!
//! A hung collective (a peer stopped or lost) keeps the GPU spinning and the host waiting
//! for ever; [`NcclAbort`] lets the worker's watchdog abort the communicator from another
//! thread, which makes NCCL's kernels return, and the custom all-reduce's barrier leave,
//! so that the step fails instead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{ensure, Context, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use vllm_kernels::cuda::device::driver_error;
use vllm_kernels::cuda::nccl::{DataType, Nccl, RawComm, UniqueId};
use vllm_kernels::cuda::{
    AbortWord, CudaDevice, CudaOps, CustomAllReduce, CustomAllReduceSetup, DType,
};

/// The largest all-reduce the custom kernel takes: 256 decode tokens of a 4096-wide model
/// in bf16 are 2 MiB (see docs/BENCHMARKS.md for where it stops beating NCCL).
pub const CUSTOM_ALL_REDUCE_MAX_BYTES: usize = 2 << 20;

use super::Communicator;
use crate::backend::cuda::CudaTensor;

/// The communicator handle, shared with the watchdog so it can abort it.
pub struct NcclAbort {
    nccl: &'static Nccl,
    comm: RawComm,
    aborted: AtomicBool,
    /// The custom all-reduce's abort word, where it runs.
    custom: OnceLock<Arc<AbortWord>>,
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
            if let Some(word) = self.custom.get() {
                word.set();
            }
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
    custom: Option<CustomAllReduce>,
    stream: Arc<CudaStream>,
    dtype: DType,
    rank: usize,
    world_size: usize,
}

/// Whether the group's all-reduces may take the custom kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CustomAllReduceMode {
    /// Where the GPUs reach each other's memory.
    Auto,
    /// NCCL only (`--disable-custom-all-reduce`).
    Disabled,
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

    /// Joins the group; blocks until all `world_size` ranks have joined, and then until
    /// they have swapped the custom all-reduce's buffers.
    pub fn join(
        unique_id: &[u8],
        rank: usize,
        world_size: usize,
        (dev, ops): (&CudaDevice, &CudaOps),
        mode: CustomAllReduceMode,
    ) -> Result<Self> {
        let (stream, dtype) = (dev.stream.clone(), ops.dtype);
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
        let mut group = Self {
            handle: Arc::new(NcclAbort {
                nccl,
                comm,
                aborted: AtomicBool::new(false),
                custom: OnceLock::new(),
            }),
            custom: None,
            stream,
            dtype,
            rank,
            world_size,
        };
        let why_nccl = group.set_up_custom_all_reduce(dev, ops, mode)?;
        tracing::info!(
            rank,
            custom_all_reduce = group.custom.is_some(),
            max_bytes = CUSTOM_ALL_REDUCE_MAX_BYTES,
            "all-reduce of small messages: {}",
            match &why_nccl {
                None => "one-shot kernel over peer memory".to_string(),
                Some(why) => format!("NCCL ({why})"),
            }
        );
        Ok(group)
    }

    /// Sets up the custom all-reduce where `mode` and the GPUs allow; otherwise why not.
    /// A rank that cannot set it up (IPC refused in a container, memory) does not fail
    /// the group: every rank agrees, warns, and keeps NCCL (`CustomAllReduce::connect`).
    fn set_up_custom_all_reduce(
        &mut self,
        dev: &CudaDevice,
        ops: &CudaOps,
        mode: CustomAllReduceMode,
    ) -> Result<Option<String>> {
        if mode == CustomAllReduceMode::Disabled {
            return Ok(Some("--disable-custom-all-reduce".into()));
        }
        let (rank, world_size) = (self.rank, self.world_size);
        // The same answer on every rank (one topology); a rank whose query itself fails
        // still takes part in the exchanges, as a failed setup.
        let reachable = CustomAllReduce::peers_reachable(world_size);
        if let Ok(false) = reachable {
            return Ok(Some("the GPUs cannot reach each other's memory".into()));
        }
        let local = reachable.and_then(|_| {
            CustomAllReduce::allocate(dev, ops, rank, world_size, CUSTOM_ALL_REDUCE_MAX_BYTES)
        });
        let setup = CustomAllReduce::connect(local, rank, world_size, |bytes| {
            self.all_gather_bytes(bytes)
        })
        .context("swapping the custom all-reduce's buffers between the ranks")?;
        match setup {
            CustomAllReduceSetup::Ready(custom) => {
                let _ = self.handle.custom.set(custom.abort_word());
                self.custom = Some(*custom);
                Ok(None)
            }
            CustomAllReduceSetup::Unavailable(why) => {
                tracing::warn!(
                    rank,
                    "the custom all-reduce could not be set up, so NCCL takes every \
                     all-reduce (--disable-custom-all-reduce skips the attempt): {why}"
                );
                Ok(Some(format!("the custom all-reduce's setup failed: {why}")))
            }
        }
    }

    /// Every rank's `bytes` (one length on all ranks), in rank order, through NCCL.
    pub(crate) fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let (nccl, comm) = self.live()?;
        let send = self
            .stream
            .clone_htod(bytes)
            .map_err(|e| driver_error("uploading the peer record", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(bytes.len() * self.world_size)
            .map_err(|e| driver_error("allocating the peer records", e))?;
        {
            let (src, _g0) = send.device_ptr(&self.stream);
            let (dst, _g1) = recv.device_ptr_mut(&self.stream);
            // SAFETY: src holds bytes.len() bytes, dst world_size times that, on this stream.
            unsafe {
                nccl.all_gather(
                    src,
                    dst,
                    bytes.len(),
                    DataType::Uint8,
                    comm,
                    self.raw_stream(),
                )?
            };
        }
        self.stream
            .clone_dtoh(&recv)
            .map_err(|e| driver_error("downloading the peer records", e))
    }

    /// The all-reduce of `x` fused with `residual += x; x = rms_norm(residual)`, where
    /// the custom kernel takes it (false: the caller runs the two).
    pub fn all_reduce_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        residual: &mut CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<bool> {
        let (rows, hidden) = (x.rows(), x.cols());
        let Some(custom) = self.custom.as_ref().filter(|c| c.fits_norm(rows, hidden)) else {
            return Ok(false);
        };
        self.live()?;
        custom.all_reduce_add_rms_norm(
            &mut x.buf,
            &mut residual.buf,
            &weight.buf,
            rows,
            hidden,
            eps,
        )?;
        Ok(true)
    }

    /// The custom all-reduce, where it takes one token's `k` → `n` row-parallel projection
    /// with the norm after it (`CustomAllReduce::gemv_add_rms_norm`).
    pub fn custom_gemv_norm(
        &self,
        ops: &CudaOps,
        k: usize,
        n: usize,
    ) -> Result<Option<&CustomAllReduce>> {
        let Some(custom) = self.custom.as_ref().filter(|c| c.fits_gemv_norm(ops, k, n)) else {
            return Ok(None);
        };
        self.live()?;
        Ok(Some(custom))
    }

    /// Whether small all-reduces take the custom kernel.
    pub fn custom_all_reduce_on(&self) -> bool {
        self.custom.is_some()
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
        let bytes = n * self.dtype.size();
        if let Some(custom) = self.custom.as_ref().filter(|c| c.fits(bytes)) {
            return custom.all_reduce(&mut x.buf, bytes);
        }
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
