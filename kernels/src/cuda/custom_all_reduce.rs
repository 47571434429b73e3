//! `CustomAllReduce`: the one-shot all-reduce of csrc/custom_all_reduce.cu over the ranks'
//! peer memory (vLLM's custom all-reduce), for decode-sized messages; NCCL keeps the rest.
//!
//! Each rank allocates one buffer (the receive lines of small messages, the staging slots
//! and barrier flags of larger ones: see the kernel's notes), and the ranks swap where
//! theirs is: a CUDA IPC handle between processes, the pointer itself
//! between threads of one process (a handle cannot be opened where it was made; the tests
//! run a rank a thread). Peer access goes over NVLink (or PCIe P2P); NVLink multicast is
//! never used. The kernel's pointers never change, so it is captured in CUDA graphs as is.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Result};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};

use super::capture_arena::DeviceBuf;
use super::device::{driver_error, CudaDevice};
use super::dtype::DType;
use super::launch::{ByValue, KernelLaunch};
use super::ops::{norm_threads, norm_vectorised, CudaOps};

/// The kernel's limits (custom_all_reduce.cu's CAR_* defines).
pub const CUSTOM_ALL_REDUCE_MAX_RANKS: usize = 8;
const BLOCKS: u32 = 32;
const THREADS: u32 = 512;
const FLAG_BYTES: usize = BLOCKS as usize * CUSTOM_ALL_REDUCE_MAX_RANKS * 4;
/// Outputs a rank's row lines hold (`CAR_ROW_LINES`): 8 bytes of lines each, which two
/// 16-byte lines a chunk need at 4-byte outputs (f32), and twice that at 2-byte ones.
const ROW_LINES: usize = 16384;
/// Call counters: one a block, and the row lines' (`CAR_ROW_EPOCH`).
const EPOCHS: usize = BLOCKS as usize + 1;

/// `CarGroup` of custom_all_reduce.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CarGroup {
    data: [u64; CUSTOM_ALL_REDUCE_MAX_RANKS],
    flags: [u64; CUSTOM_ALL_REDUCE_MAX_RANKS],
    lines: [u64; CUSTOM_ALL_REDUCE_MAX_RANKS],
    epochs: u64,
    abort: u64,
    slot_chunks: i64,
    ll_max_chunks: i64,
    rank: i32,
    world_size: i32,
}

/// `CustomAllReduceArgs` of custom_all_reduce.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CustomAllReduceArgs {
    g: CarGroup,
    x: u64,
    chunks: i64,
    lines: i32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte fields, then an i32).
unsafe impl ByValue for CustomAllReduceArgs {}

/// `GemvAllReduceArgs` of custom_all_reduce.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvAllReduceArgs {
    g: CarGroup,
    x: u64,
    w: u64,
    k: i32,
    n: i32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte fields, then two i32).
unsafe impl ByValue for GemvAllReduceArgs {}

/// `CustomAllReduceNormArgs` of custom_all_reduce.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CustomAllReduceNormArgs {
    g: CarGroup,
    x: u64,
    residual: u64,
    weight: u64,
    rows: i32,
    hidden: i32,
    eps: f32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte fields, then i32, i32, f32).
unsafe impl ByValue for CustomAllReduceNormArgs {}

/// The fused all-reduce + residual add + RMSNorm takes at most this many rows: a block a
/// row (CAR_BLOCKS blocks); past it, the plain all-reduce and the norm's own kernel.
const CUSTOM_ALL_REDUCE_NORM_MAX_ROWS: usize = BLOCKS as usize;

/// The low-latency lines (custom_all_reduce.cu) hold messages up to this size: the fused
/// all-reduce + norm takes them (32 rows of a 4096-wide model in bf16), the plain
/// all-reduce up to `LL_PLAIN_MAX_BYTES`, where the staged buffers start to win.
const CUSTOM_ALL_REDUCE_LL_MAX_BYTES: usize = 256 << 10;
const LL_PLAIN_MAX_BYTES: usize = 128 << 10;

/// A host word the device reads (pinned, mapped): set it and the kernel's barrier stops
/// waiting. The watchdog sets it from its own thread when a step hangs.
pub struct AbortWord {
    host: *mut u32,
    dev: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: the word is pinned host memory, accessed through an atomic on the host and read
// by the device; freeing it (Drop) happens once, on whichever thread drops the last owner.
unsafe impl Send for AbortWord {}
// SAFETY: as above; every host access is atomic.
unsafe impl Sync for AbortWord {}

impl AbortWord {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let mut host = std::ptr::null_mut();
        // SAFETY: out-pointer for one u32 of pinned, device-mapped memory.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP) };
        r.result()
            .map_err(|e| driver_error("allocating the all-reduce abort word", e))?;
        let host = host as *mut u32;
        // SAFETY: `host` is 4 writable bytes, just allocated, not shared yet.
        unsafe { host.write(0) };
        let mut dev = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) };
        if let Err(e) = r.result() {
            // SAFETY: allocated above, not shared yet.
            unsafe { sys::cuMemFreeHost(host.cast()) };
            return Err(driver_error("mapping the all-reduce abort word", e));
        }
        Ok(Self {
            host,
            dev,
            ctx: ctx.clone(),
        })
    }

    /// The word as an atomic: the watchdog's thread sets it while the worker's reads it.
    fn word(&self) -> &AtomicU32 {
        // SAFETY: a live, 4-byte aligned pinned word (freed only in Drop, after every
        // owner is gone), only ever accessed through this atomic on the host.
        unsafe { AtomicU32::from_ptr(self.host) }
    }

    pub fn set(&self) {
        self.word().store(1, Ordering::SeqCst);
    }

    pub fn is_set(&self) -> bool {
        self.word().load(Ordering::SeqCst) != 0
    }
}

impl Drop for AbortWord {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`; no kernel reads it once its owners are gone.
            unsafe { sys::cuMemFreeHost(self.host.cast()) };
        }
    }
}

/// What a rank tells the others about its buffer: its process, the buffer's address in
/// it, and the buffer's IPC handle.
const RECORD_BYTES: usize = 8 + 8 + 64;

/// This process among the ranks': its pid and its pid namespace (two containers may each
/// have a process of the same pid; only one process may use the other's addresses).
fn process_id() -> u64 {
    let ns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ns_hash = super::cache::fnv1a(&[ns.as_bytes()]) as u32;
    (u64::from(ns_hash) << 32) | u64::from(std::process::id())
}

fn record(process: u64, ptr: u64, handle: &sys::CUipcMemHandle) -> [u8; RECORD_BYTES] {
    let mut r = [0u8; RECORD_BYTES];
    r[..8].copy_from_slice(&process.to_le_bytes());
    r[8..16].copy_from_slice(&ptr.to_le_bytes());
    for (d, s) in r[16..].iter_mut().zip(handle.reserved.iter()) {
        *d = *s as u8;
    }
    r
}

fn parse_record(r: &[u8]) -> (u64, u64, sys::CUipcMemHandle) {
    let process = u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
    let ptr = u64::from_le_bytes(r[8..16].try_into().unwrap_or_default());
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in handle.reserved.iter_mut().zip(r[16..].iter()) {
        *d = *s as std::ffi::c_char;
    }
    (process, ptr, handle)
}

/// One rank's buffer before the ranks have swapped theirs (`CustomAllReduce::allocate`).
pub struct LocalBuffer {
    car: CustomAllReduce,
    handle: sys::CUipcMemHandle,
}

/// What `CustomAllReduce::connect` came to; the same on every rank of the group.
pub enum CustomAllReduceSetup {
    Ready(Box<CustomAllReduce>),
    /// Some rank could not take part (why: this rank's own error, or which rank failed).
    Unavailable(String),
}

pub struct CustomAllReduce {
    func: CudaFunction,
    func_norm: CudaFunction,
    func_gemv_send: CudaFunction,
    func_rows_norm: CudaFunction,
    dtype: DType,
    stream: Arc<CudaStream>,
    pdl: bool,
    /// This rank's buffer: two staging slots of `slot_bytes`, the flags, the receive
    /// lines, then the row lines.
    own: sys::CUdeviceptr,
    /// The peers' buffers opened from IPC handles (closed on drop).
    opened: Vec<sys::CUdeviceptr>,
    /// What every launch passes: every rank's buffer as this process addresses it, the
    /// counters, the abort word; fixed once the ranks have swapped their buffers.
    group: CarGroup,
    /// The counters `group` points at, held so that they live as long as it does.
    _epochs: CudaSlice<u32>,
    abort: Arc<AbortWord>,
    slot_bytes: usize,
}

impl CustomAllReduce {
    /// Whether every pair of the first `world_size` GPUs can reach each other's memory
    /// (rank r runs on GPU r). The same answer on every rank, so that either all ranks or
    /// none go on to the exchange.
    pub fn peers_reachable(world_size: usize) -> Result<bool> {
        if !(2..=CUSTOM_ALL_REDUCE_MAX_RANKS).contains(&world_size) {
            return Ok(false);
        }
        for a in 0..world_size {
            for b in (0..world_size).filter(|&b| b != a) {
                let mut can = 0;
                // SAFETY: out-pointer; ordinals below the device count (the backends opened them).
                let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a as i32, b as i32) };
                r.result()
                    .map_err(|e| driver_error("cuDeviceCanAccessPeer", e))?;
                if can == 0 {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Sets the group up, or agrees with every other rank that it cannot: `local` is this
    /// rank's `allocate` (an error there is not the end: the rank still takes part in both
    /// exchanges, so that no peer waits for it), and `exchange` takes this rank's bytes and
    /// returns every rank's, in rank order (a collective every rank calls, twice). Every
    /// rank comes out with the same answer: ready on all, or unavailable on all. An error
    /// is an exchange that failed (the group itself is broken).
    pub fn connect(
        local: Result<LocalBuffer>,
        rank: usize,
        world_size: usize,
        mut exchange: impl FnMut(&[u8]) -> Result<Vec<u8>>,
    ) -> Result<CustomAllReduceSetup> {
        // A rank that could not allocate sends a null record (no process has id 0).
        let null = sys::CUipcMemHandle { reserved: [0; 64] };
        let mine = match &local {
            Ok(l) => record(process_id(), l.car.own, &l.handle),
            Err(_) => record(0, 0, &null),
        };
        let records = exchange(&mine)?;
        ensure!(
            records.len() == RECORD_BYTES * world_size,
            "custom all-reduce: {} bytes of peer records, expected {}",
            records.len(),
            RECORD_BYTES * world_size
        );
        let records: Vec<_> = records.chunks(RECORD_BYTES).map(parse_record).collect();
        let local = match local {
            Err(e) => return Ok(CustomAllReduceSetup::Unavailable(format!("{e:#}"))),
            Ok(l) => l,
        };
        if let Some(r) = records.iter().position(|&(_, ptr, _)| ptr == 0) {
            return Ok(CustomAllReduceSetup::Unavailable(format!(
                "rank {r} could not allocate its buffer"
            )));
        }
        let mut car = local.car;
        let opened = car.open_peers(rank, &records);
        let statuses = exchange(&[opened.is_ok() as u8])?;
        ensure!(
            statuses.len() == world_size,
            "custom all-reduce: {} status bytes, expected {world_size}",
            statuses.len()
        );
        if let Err(e) = opened {
            return Ok(CustomAllReduceSetup::Unavailable(format!("{e:#}")));
        }
        match statuses.iter().position(|&ok| ok != 1) {
            Some(r) => Ok(CustomAllReduceSetup::Unavailable(format!(
                "rank {r} could not open its peers' buffers"
            ))),
            None => Ok(CustomAllReduceSetup::Ready(Box::new(car))),
        }
    }

    /// This rank's part of the group (messages up to `max_bytes`): its buffer, cleared,
    /// and the IPC handle peers in other processes open it by; `connect` swaps them. Call
    /// only where `peers_reachable`.
    pub fn allocate(
        dev: &CudaDevice,
        ops: &CudaOps,
        rank: usize,
        world_size: usize,
        max_bytes: usize,
    ) -> Result<LocalBuffer> {
        ensure!(
            rank < world_size && world_size <= CUSTOM_ALL_REDUCE_MAX_RANKS,
            "custom all-reduce: rank {rank} of {world_size}"
        );
        let slot_bytes = max_bytes.next_multiple_of(16);
        // Two call slots of every rank's lines (16 bytes carry 8 of x), and of its row lines.
        let lines_bytes = 2 * world_size * (2 * CUSTOM_ALL_REDUCE_LL_MAX_BYTES + 8 * ROW_LINES);
        let bytes = 2 * slot_bytes + FLAG_BYTES + lines_bytes;
        dev.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the context", e))?;
        let epochs = dev
            .stream
            .alloc_zeros::<u32>(EPOCHS)
            .map_err(|e| driver_error("allocating the all-reduce counters", e))?;
        let abort = Arc::new(AbortWord::new(&dev.ctx)?);
        let mut own = 0;
        // SAFETY: out-pointer. A plain allocation: IPC cannot export pool memory. From here
        // `car` owns it, and its Drop frees it on every error path below.
        unsafe { sys::cuMemAlloc_v2(&mut own, bytes) }
            .result()
            .map_err(|e| driver_error("allocating the custom all-reduce buffer", e))?;
        let group = CarGroup {
            data: [0; CUSTOM_ALL_REDUCE_MAX_RANKS],
            flags: [0; CUSTOM_ALL_REDUCE_MAX_RANKS],
            lines: [0; CUSTOM_ALL_REDUCE_MAX_RANKS],
            epochs: epochs.device_ptr(&dev.stream).0,
            abort: abort.dev,
            slot_chunks: (slot_bytes / 16) as i64,
            ll_max_chunks: (CUSTOM_ALL_REDUCE_LL_MAX_BYTES / 16) as i64,
            rank: rank as i32,
            world_size: world_size as i32,
        };
        let car = Self {
            func: ops.f.custom_all_reduce.clone(),
            func_norm: ops.f.custom_all_reduce_add_rms_norm.clone(),
            func_gemv_send: ops.f.gemv_m1_all_reduce_send.clone(),
            func_rows_norm: ops.f.custom_all_reduce_rows_add_rms_norm.clone(),
            dtype: ops.dtype,
            stream: ops.stream.clone(),
            pdl: ops.pdl,
            own,
            opened: Vec::new(),
            group,
            _epochs: epochs,
            abort,
            slot_bytes,
        };
        // Flags start at zero on every rank before any rank can write one: the exchange
        // in `connect` is the first thing all ranks wait for together.
        // SAFETY: `own` holds `bytes` bytes.
        unsafe { sys::cuMemsetD8_v2(own, 0, bytes) }
            .result()
            .map_err(|e| driver_error("clearing the custom all-reduce buffer", e))?;
        // The memset and the counters' clear run on different streams: wait for both.
        dev.ctx
            .synchronize()
            .map_err(|e| driver_error("synchronizing", e))?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: out-pointer; `own` is a cuMemAlloc allocation of this context.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, own) }
            .result()
            .map_err(|e| driver_error("cuIpcGetMemHandle", e))?;
        Ok(LocalBuffer { car, handle })
    }

    /// Every rank's buffer into the group's pointers: this rank's own, a same-process
    /// rank's by peer access, another process's by its IPC handle.
    fn open_peers(
        &mut self,
        rank: usize,
        records: &[(u64, u64, sys::CUipcMemHandle)],
    ) -> Result<()> {
        let me = process_id();
        let slot_bytes = self.slot_bytes as u64;
        for (r, &(process, ptr, handle)) in records.iter().enumerate() {
            let addr = if r == rank {
                self.own
            } else if process == me {
                self.enable_peer_access(r)?;
                ptr
            } else {
                let mut p = 0;
                // SAFETY: out-pointer; the handle is the peer's live allocation.
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut p,
                        handle,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                }
                .result()
                .map_err(|e| driver_error(&format!("opening rank {r}'s IPC handle"), e))?;
                self.opened.push(p);
                p
            };
            // Two staging slots, the flags, then the lines (the kernel's layout).
            self.group.data[r] = addr;
            self.group.flags[r] = addr + 2 * slot_bytes;
            self.group.lines[r] = self.group.flags[r] + FLAG_BYTES as u64;
        }
        Ok(())
    }

    /// Peer access to GPU `peer`'s primary context, for a rank in this same process. Raw
    /// driver calls: cudarc's context handle would make the peer's context current.
    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        let mut device = 0;
        let mut peer_ctx = std::ptr::null_mut();
        // SAFETY: out-pointers; `peer` is a rank's ordinal, below the device count.
        unsafe {
            sys::cuDeviceGet(&mut device, peer as i32)
                .result()
                .map_err(|e| driver_error("cuDeviceGet", e))?;
            sys::cuDevicePrimaryCtxRetain(&mut peer_ctx, device)
                .result()
                .map_err(|e| driver_error("retaining the peer's context", e))?;
        }
        // SAFETY: our context is current (bound in `new`); the peer's is retained.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) };
        // SAFETY: retained above; the peer's own backend keeps it alive.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(driver_error(
                "cuCtxEnablePeerAccess",
                e.result().expect_err("not a success"),
            )),
        }
    }

    /// The word that stops a waiting barrier (for the watchdog).
    pub fn abort_word(&self) -> Arc<AbortWord> {
        self.abort.clone()
    }

    /// Whether `x` of `bytes` can take this path: whole 16-byte chunks that fit a slot.
    pub fn fits(&self, bytes: usize) -> bool {
        bytes > 0 && bytes.is_multiple_of(16) && bytes <= self.slot_bytes
    }

    /// The group a launch passes, while the watchdog has not aborted it.
    fn group(&self) -> Result<CarGroup> {
        ensure!(
            !self.abort.is_set(),
            "the custom all-reduce was aborted (a collective hung past the timeout)"
        );
        Ok(self.group)
    }

    /// A 16-byte aligned device buffer's address.
    fn aligned(&self, buf: &CudaSlice<u8>, what: &str) -> Result<u64> {
        let p = buf.device_ptr(&self.stream).0;
        ensure!(
            p % 16 == 0,
            "custom all-reduce: {what} is not 16-byte aligned"
        );
        Ok(p)
    }

    /// Launches `func` on the group's fixed grid.
    fn launch<A: ByValue>(&self, func: &CudaFunction, threads: u32, args: &A) -> Result<()> {
        self.launch_grid(func, BLOCKS, threads, args)
    }

    /// Launches `func` on `blocks` blocks.
    fn launch_grid<A: ByValue>(
        &self,
        func: &CudaFunction,
        blocks: u32,
        threads: u32,
        args: &A,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut kernel = KernelLaunch::new(&self.stream, func);
        kernel.arg(args);
        // SAFETY: the callers check every buffer against the sizes the kernel indexes;
        // every rank's buffer holds two slots of `slot_bytes`, the flags, the lines and
        // the row lines, and `epochs` EPOCHS counters.
        unsafe { kernel.launch(cfg, self.pdl) }
            .map_err(|e| driver_error("launching the custom all-reduce", e))
    }

    /// `x` (the first `bytes` of it) becomes the sum of every rank's, in place, on the
    /// stream. Every rank must make the same calls, in the same order, with the same sizes.
    pub fn all_reduce(&self, x: &mut DeviceBuf<u8>, bytes: usize) -> Result<()> {
        ensure!(
            self.fits(bytes) && bytes <= x.len(),
            "custom all-reduce of {bytes} bytes (buffer {}, slot {})",
            x.len(),
            self.slot_bytes
        );
        let args = CustomAllReduceArgs {
            g: self.group()?,
            x: self.aligned(x, "x")?,
            chunks: (bytes / 16) as i64,
            lines: (bytes <= LL_PLAIN_MAX_BYTES) as i32,
        };
        self.launch(&self.func, THREADS, &args)
    }

    /// Whether `all_reduce_add_rms_norm` takes `rows` of `hidden`: a thread a 16-byte
    /// chunk of a row, a block a row, the low-latency lines.
    pub fn fits_norm(&self, rows: usize, hidden: usize) -> bool {
        let bytes = rows * hidden * self.dtype.size();
        (1..=CUSTOM_ALL_REDUCE_NORM_MAX_ROWS).contains(&rows)
            && norm_vectorised(hidden, self.dtype)
            && self.fits(bytes)
            && bytes <= CUSTOM_ALL_REDUCE_LL_MAX_BYTES
    }

    /// The all-reduce of `x` [rows, hidden], then `residual += x; x = rms_norm(residual)`
    /// (`CudaOps::fused_add_rms_norm`), in one kernel; the same bits as the two.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm(
        &self,
        x: &mut CudaSlice<u8>,
        residual: &mut CudaSlice<u8>,
        weight: &CudaSlice<u8>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(
            self.fits_norm(rows, hidden),
            "custom all-reduce + norm of {rows} x {hidden}"
        );
        let bytes = rows * hidden * self.dtype.size();
        ensure!(
            x.len() >= bytes
                && residual.len() >= bytes
                && weight.len() >= hidden * self.dtype.size(),
            "custom all-reduce + norm: buffers smaller than {rows} x {hidden}"
        );
        let args = CustomAllReduceNormArgs {
            g: self.group()?,
            x: self.aligned(x, "x")?,
            residual: self.aligned(residual, "the residual")?,
            weight: self.aligned(weight, "the weight")?,
            rows: rows as i32,
            hidden: hidden as i32,
            eps,
        };
        self.launch(&self.func_norm, norm_threads(hidden, self.dtype), &args)
    }
}

/// One token's row-parallel projection and the norm after it, as
/// `CustomAllReduce::gemv_add_rms_norm` takes them: `out [1, n] = x [1, k] · w [n, k]ᵀ`
/// summed over the ranks, then `residual += out; out = rms_norm(residual) · weight`.
pub struct GemvNorm<'a> {
    pub x: &'a CudaSlice<u8>,
    pub w: &'a CudaSlice<u8>,
    pub k: usize,
    pub n: usize,
    pub residual: &'a mut CudaSlice<u8>,
    pub weight: &'a CudaSlice<u8>,
    pub eps: f32,
}

impl CustomAllReduce {
    /// Whether `gemv_add_rms_norm` takes a product of `k` → `n` for one token: the one
    /// warp a row gemv `ops.gemv` would run, and a row the row lines and the fused norm
    /// hold.
    pub fn fits_gemv_norm(&self, ops: &CudaOps, k: usize, n: usize) -> bool {
        n <= ROW_LINES
            && n.is_multiple_of(super::gemv::GEMV_WARPS)
            && ops.gemv_one_warp_a_row(k, n)
            && self.fits_norm(1, n)
    }

    /// `p`'s projection with its all-reduce, residual add and RMSNorm, into `out` [1, n]:
    /// two kernels, the gemv sending each output to every rank as it is summed (the row
    /// lines of custom_all_reduce.cu). The same bits as `ops.gemv` then
    /// `all_reduce_add_rms_norm`.
    pub fn gemv_add_rms_norm(
        &self,
        ops: &CudaOps,
        p: GemvNorm<'_>,
        out: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let (k, n) = (p.k, p.n);
        ensure!(
            self.fits_gemv_norm(ops, k, n),
            "custom all-reduce: a gemv of {k} -> {n} and its norm"
        );
        let (ki, _) = ops.gemv_checked("gemv + all-reduce", [p.x, p.w, out], (1, k, n), n, 0)?;
        ensure!(
            p.residual.len() >= n * self.dtype.size() && p.weight.len() >= n * self.dtype.size(),
            "gemv + all-reduce + norm: residual or weight smaller than {n}"
        );
        let g = self.group()?;
        let send = GemvAllReduceArgs {
            g,
            x: self.aligned(p.x, "x")?,
            w: self.aligned(p.w, "w")?,
            k: ki,
            n: n as i32,
        };
        let blocks = n.div_ceil(super::gemv::GEMV_WARPS) as u32;
        self.launch_grid(
            &self.func_gemv_send,
            blocks,
            super::gemv::GEMV_THREADS,
            &send,
        )?;
        let norm = CustomAllReduceNormArgs {
            g,
            x: self.aligned(out, "out")?,
            residual: self.aligned(p.residual, "the residual")?,
            weight: self.aligned(p.weight, "the weight")?,
            rows: 1,
            hidden: n as i32,
            eps: p.eps,
        };
        self.launch_grid(&self.func_rows_norm, 1, norm_threads(n, self.dtype), &norm)
    }
}

impl Drop for CustomAllReduce {
    fn drop(&mut self) {
        if self.stream.context().bind_to_thread().is_err() {
            return;
        }
        // Peers may still read our buffer in a call in flight; let this stream's finish.
        let _ = self.stream.synchronize();
        for &p in &self.opened {
            // SAFETY: opened in `new`, closed once.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
        // SAFETY: allocated in `new`, freed once; no kernel of this stream uses it now.
        unsafe { sys::cuMemFree_v2(self.own) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_records_round_trip() {
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        for (i, b) in handle.reserved.iter_mut().enumerate() {
            *b = (i as i32 * 37 - 100) as std::ffi::c_char;
        }
        let process = process_id();
        assert_eq!(process as u32, std::process::id());
        let bytes = record(process, 0x7f00_dead_beef_0010, &handle);
        let (back_process, ptr, back) = parse_record(&bytes);
        assert_eq!(back_process, process);
        assert_eq!(ptr, 0x7f00_dead_beef_0010);
        assert_eq!(back.reserved, handle.reserved);
    }

    #[test]
    fn the_arguments_have_the_kernels_layout() {
        // custom_all_reduce.cu: CarGroup is 3 arrays of 8 pointers, 4 eight-byte fields and
        // 2 ints (232 bytes); the argument structs follow it, padded to 8 bytes as nvcc does.
        let group = 3 * 64 + 4 * 8 + 2 * 4;
        assert_eq!(std::mem::size_of::<CarGroup>(), group);
        assert_eq!(
            std::mem::size_of::<CustomAllReduceArgs>(),
            group + 2 * 8 + 4 + 4
        );
        assert_eq!(
            std::mem::size_of::<CustomAllReduceNormArgs>(),
            group + 3 * 8 + 3 * 4 + 4
        );
        assert_eq!(
            std::mem::size_of::<GemvAllReduceArgs>(),
            group + 2 * 8 + 2 * 4
        );
    }
}
