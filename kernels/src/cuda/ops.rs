//! `CudaOps`: typed launch wrappers of every kernel of one dtype's module.
//!
//! Floating-point tensors are untyped byte buffers (`CudaSlice<u8>`) holding `dtype`
//! elements; metadata is `CudaSlice<i32>`. Each wrapper checks the buffer sizes against the
//! shape it is given before launching, so a shape bug is an error, not a stray write.

use std::sync::Arc;

use anyhow::{bail, ensure, Result};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
};

use super::attention_plan::{
    AttentionPlan, TileKernel, ATT_THREADS, DEC_THREADS, HEAD_DIMS, PF_THREADS,
};
use super::capture_arena::{CaptureArena, DeviceBuf};
use super::device::{driver_error, CudaDevice};
use super::dtype::DType;
use super::launch::ByValue;
use super::module::{self, BuildSource, Functions};
use super::thin_gemm::ThinGemmKernels;

/// Launches a kernel of `$ops`'s module with `$cfg`, pushing the arguments in the order of
/// the kernel's parameters; an error names the kernel. The kernel is `$ops.f.<name>`, or
/// any `CudaFunction` given as `func => "name"`. The launch is unsafe, hence the `unsafe`
/// at each call: the caller checks every buffer against the sizes the kernel indexes and
/// says so in a SAFETY comment above the call.
macro_rules! launch {
    (unsafe $ops:expr, $name:ident, $cfg:expr; $($arg:expr),+ $(,)?) => {
        launch!(unsafe $ops, &$ops.f.$name => stringify!($name), $cfg; $($arg),+)
    };
    (unsafe $ops:expr, $func:expr => $name:expr, $cfg:expr; $($arg:expr),+ $(,)?) => {{
        let cfg = $cfg;
        let mut kernel = $crate::cuda::launch::KernelLaunch::new(&$ops.stream, $func);
        $(kernel.arg($arg);)+
        // SAFETY: the caller's, stated at the call site.
        unsafe { kernel.launch(cfg, $ops.pdl) }
            .map_err(|e| $crate::cuda::device::driver_error(concat!("launching ", $name), e))
    }};
}
pub(crate) use launch;

/// `AttentionArgs` of attention.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttentionArgs {
    q: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: u64,
    seq_lens: u64,
    query_start_loc: u64,
    tile_seq: u64,
    tile_token: u64,
    out: u64,
    part_o: u64,
    part_ml: u64,
    step_dims: u64,
    num_tokens: i32,
    num_q_heads: i32,
    num_kv_heads: i32,
    block_size: i32,
    tokens_per_tile: i32,
    split_keys: i32,
    scale: f32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte pointers first).
unsafe impl ByValue for AttentionArgs {}

/// Device metadata of one attention launch (see `paged_attention`).
pub struct AttentionMeta<'a> {
    pub block_tables: &'a CudaSlice<i32>,
    /// The block tables' row width, on the host (sizes are checked against it); the
    /// kernels read it from `step_dims`.
    pub max_blocks_per_seq: usize,
    pub seq_lens: &'a CudaSlice<i32>,
    pub query_start_loc: &'a CudaSlice<i32>,
    pub tile_seq: &'a CudaSlice<i32>,
    pub tile_token: &'a CudaSlice<i32>,
    pub decode_seqs: &'a CudaSlice<i32>,
    /// Two i32s on the device: the plan's `decode_partition` and the block tables' row
    /// width (`max_blocks_per_seq`). The kernels read them there, so that a captured
    /// graph's replays may change them: each step's partition, and block tables no wider
    /// than its longest sequence needs (a graph of 256 sequences baked 512-block rows
    /// into a 512 KB copy a step).
    pub step_dims: &'a CudaSlice<i32>,
    pub plan: &'a AttentionPlan,
}

/// The inputs every attention kernel of one launch shares.
struct AttentionCaches<'a> {
    q: &'a CudaSlice<u8>,
    key_cache: &'a CudaSlice<u8>,
    value_cache: &'a CudaSlice<u8>,
    meta: &'a AttentionMeta<'a>,
    dims: AttentionDims,
    scale: f32,
}

/// `DecodeArgs` of attention_decode.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DecodeArgs {
    q: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: u64,
    seq_lens: u64,
    query_start_loc: u64,
    decode_seqs: u64,
    out: u64,
    part_o: u64,
    part_ml: u64,
    step_dims: u64,
    num_decode: i32,
    num_q_heads: i32,
    num_kv_heads: i32,
    q_split_log2: i32,
    block_size: i32,
    scale: f32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte pointers first).
unsafe impl ByValue for DecodeArgs {}

/// Threads of a `qkv_prepare` block (`QKV_WARPS` warps) and the widest head it stages.
const QKV_THREADS: u32 = 128;
const QKV_MAX_HEAD_DIM: usize = 256;
/// The most threads of a `qkv_prepare_wide_token` block (its launch bounds).
const QKV_MAX_THREADS: usize = 1024;

/// Steps whose 16-byte lanes take all of a token's heads in one block
/// (`qkv_prepare_wide_token`, up to `QKV_MAX_THREADS`) rather than `QKV_THREADS` of them:
/// where it was measured to pay. On an H100 with Qwen3-0.6B, nanovllm-256's decode steps
/// of 65–128 sequences ran 4 % faster so (5.89 → 5.66 ms a step); there the decode
/// attention that follows under PDL is about one wave of whole-sequence blocks
/// (`DecodeGrid::whole_sequences`). Steps of 33–64 and 129–256 sequences did not move
/// (two tokens a block at 133–256 lost 0.3 %), of 1–32 ran about 1 % slower, and the
/// kernel alone took 105 against 86 µs at a prefill's 8,060 tokens (ncu, the fastest of
/// 242 launches; docs/BENCHMARKS.md, 2026-11-27).
const QKV_TOKEN_BLOCK_STEPS: std::ops::RangeInclusive<usize> = 65..=128;

/// The lanes a head takes in `qkv_prepare_wide` (16 bytes each), where its chunks are
/// whole: the head a power of two of them, at most a warp, and each rotary half whole
/// chunks. Fewer instructions an element than `qkv_prepare`'s 4-element lanes: on an H100
/// a prefill of 7,245 tokens (Qwen3-0.6B) took 71 µs a layer against 86, decode batches
/// the same time (docs/BENCHMARKS.md).
fn qkv_wide_lanes(head_dim: usize, rotary_dim: usize, dtype_size: usize) -> Option<usize> {
    let chunk = 16 / dtype_size;
    let lanes = head_dim / chunk;
    (head_dim.is_multiple_of(chunk)
        && lanes.is_power_of_two()
        && lanes <= 32
        && rotary_dim.is_multiple_of(2 * chunk))
    .then_some(lanes)
}

/// The blocks of a `qkv_prepare` launch over one token's heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QkvBlocks {
    threads: usize,
    /// Heads a block; a token takes `heads.div_ceil(this)` blocks (the grid's y).
    heads: usize,
    /// Whether a block takes its token's heads whole (`qkv_prepare_wide_token`).
    whole_token: bool,
}

impl QkvBlocks {
    /// A warp a head (`lanes` None), or 32 / `lanes` heads a warp in blocks of
    /// `QKV_THREADS`; at steps of `QKV_TOKEN_BLOCK_STEPS` tokens, a token's `heads` in one
    /// block of whole warps (two or more where they need more than `QKV_MAX_THREADS`).
    fn for_step(tokens: usize, heads: usize, lanes: Option<usize>) -> Self {
        let few = |per_block| Self {
            threads: QKV_THREADS as usize,
            heads: per_block,
            whole_token: false,
        };
        match lanes {
            None => few(QKV_THREADS as usize / 32),
            Some(lanes) if QKV_TOKEN_BLOCK_STEPS.contains(&tokens) => {
                let per_block = heads.min(QKV_MAX_THREADS / lanes);
                Self {
                    threads: (per_block * lanes).next_multiple_of(32),
                    heads: per_block,
                    whole_token: true,
                }
            }
            Some(lanes) => few(QKV_THREADS as usize / lanes),
        }
    }
}

/// The inputs of `CudaOps::qkv_prepare`.
pub struct QkvPrepare<'a> {
    pub qkv: &'a CudaSlice<u8>,
    /// The projection's bias [(Hq + 2 Hkv) · D], added here.
    pub bias: Option<&'a CudaSlice<u8>>,
    pub q_norm: Option<&'a CudaSlice<u8>>,
    pub k_norm: Option<&'a CudaSlice<u8>>,
    pub eps: f32,
    pub positions: &'a CudaSlice<i32>,
    pub cos_sin: &'a CudaSlice<u8>,
    pub rotary_dim: usize,
    pub slot_mapping: &'a CudaSlice<i32>,
    pub key_cache: &'a CudaSlice<u8>,
    pub value_cache: &'a CudaSlice<u8>,
    pub num_tokens: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The projection's input [T, hidden] and its norm's eps, where that norm was deferred
    /// (norm.cu): each row is scaled by the input row's 1 / RMS first.
    pub deferred_norm: Option<(&'a CudaSlice<u8>, usize, f32)>,
}

/// `QkvArgs` of qkv_prepare.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct QkvArgs {
    qkv: u64,
    q_norm: u64,
    k_norm: u64,
    positions: u64,
    cos_sin: u64,
    slot_mapping: u64,
    q_out: u64,
    key_cache: u64,
    value_cache: u64,
    input: u64,
    bias: u64,
    num_q_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    rotary_dim: i32,
    hidden: i32,
    eps: f32,
    input_eps: f32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte pointers first).
unsafe impl ByValue for QkvArgs {}

/// `PrefillArgs` of attention_prefill.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PrefillArgs {
    q: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: u64,
    seq_lens: u64,
    query_start_loc: u64,
    tile_seq: u64,
    tile_token: u64,
    out: u64,
    step_dims: u64,
    num_q_heads: i32,
    num_kv_heads: i32,
    block_size: i32,
    tokens_per_tile: i32,
    scale: f32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte pointers first).
unsafe impl ByValue for PrefillArgs {}

/// Static shape of an attention problem.
#[derive(Debug, Clone, Copy)]
pub struct AttentionDims {
    pub num_tokens: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

pub struct CudaOps {
    pub dtype: DType,
    pub stream: Arc<CudaStream>,
    pub num_sms: usize,
    pub build_source: BuildSource,
    /// Launch our kernels with programmatic dependent launch (launch.rs): on by default
    /// where the device has it (compute capability 9.0 and later); the tests and benches
    /// turn it off to compare.
    pub pdl: bool,
    pub(crate) f: Functions,
    /// The sampler's buffers, kept across steps (sampling_ops.rs).
    pub(crate) sampling: super::sampling_ops::SamplingScratch,
    /// The decode-batch GEMM's kernels (thin_gemm.rs); Hopper (sm_90a), 16-bit dtypes only.
    pub(crate) thin_gemm: Option<ThinGemmKernels>,
    /// Set while graphs are captured (capture_arena.rs).
    capture_arena: std::sync::Mutex<Option<CaptureArena>>,
    _module: Arc<CudaModule>,
}

pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| anyhow::anyhow!("{what} = {v} does not fit the kernels' i32"))
}

fn grid_stride(n: usize, num_sms: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, num_sms * 16);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn rows_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether a tensor-core prefill grid of `blocks` takes d128's two-blocks-an-SM kernel:
/// where the grid is one wave of two blocks an SM, the faster block wins (an H100: a
/// 512-token chat turn over 3,584 cached keys, 256 blocks at Qwen3-8B's heads, 111 -> 93
/// µs); past that the third block an SM does, even at 512 blocks, where a fresh 2,048-token
/// prompt's triangle of tiles lost 3-7 % of its TTFT (docs/BENCHMARKS.md, 2026-11-27).
fn prefill_takes_occ2(head_dim: usize, blocks: usize, num_sms: usize) -> bool {
    head_dim == 128 && blocks <= 2 * num_sms
}

/// Threads for a one-block-per-row reduction over `cols`: a multiple of 32, at most 1024.
fn row_threads(cols: usize) -> u32 {
    (cols.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Whether a norm's row of `hidden` takes norm.cu's vectorised path: whole 16-byte chunks,
/// one a thread, that fit a block.
pub(crate) fn norm_vectorised(hidden: usize, dtype: DType) -> bool {
    let vec = dtype.vec16();
    hidden.is_multiple_of(vec) && hidden / vec <= 1024
}

/// Threads of a norm's row: one 16-byte chunk each on the vectorised path, else
/// `row_threads`. The fused all-reduce + norm launches as many, so that its sums match.
pub(crate) fn norm_threads(hidden: usize, dtype: DType) -> u32 {
    if norm_vectorised(hidden, dtype) {
        row_threads(hidden / dtype.vec16())
    } else {
        row_threads(hidden)
    }
}

impl CudaOps {
    /// Builds (or loads from the cache) the module of `dtype` for `dev`.
    pub fn new(dev: &CudaDevice, dtype: DType) -> Result<Self> {
        let (module, f, build_source) = module::load(dev, dtype)?;
        // thin_gemm.cu's kernels are wgmma kernels: built for sm_90a, traps elsewhere.
        let thin_gemm = match &f.thin_gemm {
            Some((plain, silu)) if dev.arch() == "sm_90a" => {
                Some(ThinGemmKernels::new(plain.clone(), silu.clone())?)
            }
            _ => None,
        };
        Ok(Self {
            dtype,
            stream: dev.stream.clone(),
            num_sms: dev.num_sms,
            build_source,
            pdl: dev.compute_capability.0 >= 9,
            f,
            sampling: Default::default(),
            thin_gemm,
            capture_arena: Default::default(),
            _module: module,
        })
    }

    pub(crate) fn check(&self, buf: &CudaSlice<u8>, elems: usize, what: &str) -> Result<()> {
        let need = elems * self.dtype.size();
        ensure!(
            buf.len() >= need,
            "{what}: buffer of {} bytes, {elems} {} elements need {need}",
            buf.len(),
            self.dtype.name()
        );
        Ok(())
    }

    /// Whether every buffer starts 16-byte aligned (what 16-byte vector loads ask).
    pub(crate) fn aligned16(&self, bufs: &[&CudaSlice<u8>]) -> bool {
        bufs.iter().all(|b| {
            let (p, _g) = b.device_ptr(&self.stream);
            p.is_multiple_of(16)
        })
    }

    fn check_ints(buf: &CudaSlice<i32>, n: usize, what: &str) -> Result<()> {
        ensure!(buf.len() >= n, "{what}: {} ints, need {n}", buf.len());
        Ok(())
    }

    /// Allocates `elems` elements of the dtype, uninitialised.
    /// Room for `elems` elements of the dtype: from the capture arena while one is set,
    /// else from the stream-ordered pool. The contents are undefined.
    pub fn alloc(&self, elems: usize) -> Result<DeviceBuf<u8>> {
        self.alloc_of::<u8>(elems.max(1) * self.dtype.size())
    }

    fn alloc_of<T: cudarc::driver::DeviceRepr>(&self, len: usize) -> Result<DeviceBuf<T>> {
        match self.arena_slot()?.as_ref() {
            Some(a) => a.alloc(&self.stream, len),
            None => DeviceBuf::pool(&self.stream, len),
        }
    }

    /// Runs `f` with the buffers of `alloc` and of the attention partials taken from
    /// `arena` (the graph captures, capture_arena.rs); the pool serves them again after,
    /// whether `f` succeeded or not.
    pub fn with_capture_arena<R>(
        &self,
        arena: &CaptureArena,
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        *self.arena_slot()? = Some(arena.clone());
        let out = f();
        *self.arena_slot()? = None;
        out
    }

    fn arena_slot(&self) -> Result<std::sync::MutexGuard<'_, Option<CaptureArena>>> {
        self.capture_arena
            .lock()
            .map_err(|_| anyhow::anyhow!("a panic held the capture arena"))
    }

    pub fn alloc_zeros(&self, elems: usize) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(elems.max(1) * self.dtype.size())
            .map_err(|e| driver_error(&format!("allocating {elems} elements"), e))
    }

    /// `out[t] = table[ids[t] - vocab_start]`, zeros outside the shard.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding(
        &self,
        ids: &CudaSlice<i32>,
        table: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        num_tokens: usize,
        hidden: usize,
        vocab_start: usize,
        shard_rows: usize,
    ) -> Result<()> {
        if num_tokens == 0 {
            return Ok(());
        }
        Self::check_ints(ids, num_tokens, "embedding ids")?;
        self.check(table, shard_rows * hidden, "embedding table")?;
        self.check(out, num_tokens * hidden, "embedding out")?;
        let (h, vs, rows) = (
            i32_of(hidden, "hidden")?,
            i32_of(vocab_start, "vocab_start")?,
            i32_of(shard_rows, "vocab rows")?,
        );
        // SAFETY: sizes checked above; the kernel reads ids[t] for t < grid.
        launch!(unsafe self, embedding, rows_cfg(num_tokens, 256); ids, table, out, &h, &vs, &rows)
    }

    pub fn rms_norm(
        &self,
        x: &CudaSlice<u8>,
        weight: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        self.check(x, rows * hidden, "rms_norm x")?;
        self.check(weight, hidden, "rms_norm weight")?;
        self.check(out, rows * hidden, "rms_norm out")?;
        let h = i32_of(hidden, "hidden")?;
        // SAFETY: sizes checked above.
        launch!(unsafe self, rms_norm, rows_cfg(rows, norm_threads(hidden, self.dtype));
            x, weight, out, &h, &eps)
    }

    pub fn fused_add_rms_norm(
        &self,
        x: &mut CudaSlice<u8>,
        residual: &mut CudaSlice<u8>,
        weight: &CudaSlice<u8>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        self.check(x, rows * hidden, "fused_add_rms_norm x")?;
        self.check(residual, rows * hidden, "fused_add_rms_norm residual")?;
        self.check(weight, hidden, "fused_add_rms_norm weight")?;
        let h = i32_of(hidden, "hidden")?;
        // SAFETY: sizes checked above.
        launch!(unsafe self, fused_add_rms_norm, rows_cfg(rows, norm_threads(hidden, self.dtype));
            x, residual, weight, &h, &eps)
    }

    /// In place over `num_heads_total` heads of `head_dim`.
    pub fn rms_norm_per_head(
        &self,
        x: &mut CudaSlice<u8>,
        weight: &CudaSlice<u8>,
        num_heads_total: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<()> {
        if num_heads_total == 0 {
            return Ok(());
        }
        self.check(x, num_heads_total * head_dim, "rms_norm_per_head x")?;
        self.check(weight, head_dim, "rms_norm_per_head weight")?;
        let (n, d) = (
            i32_of(num_heads_total, "heads")?,
            i32_of(head_dim, "head_dim")?,
        );
        // SAFETY: sizes checked above; 4 heads (warps) per block.
        launch!(unsafe self, rms_norm_per_head, rows_cfg(num_heads_total.div_ceil(4), 128);
            x, weight, &n, &d, &eps)
    }

    /// Neox rotary of q [T, q_heads, D] and k [T, k_heads, D] in place. Positions must
    /// be inside the table (the caller checks them on the host).
    #[allow(clippy::too_many_arguments)]
    pub fn rotary_embedding_neox(
        &self,
        positions: &CudaSlice<i32>,
        q: &mut CudaSlice<u8>,
        k: &mut CudaSlice<u8>,
        cos_sin: &CudaSlice<u8>,
        num_tokens: usize,
        num_q_heads: usize,
        num_k_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
    ) -> Result<()> {
        if num_tokens == 0 {
            return Ok(());
        }
        ensure!(
            rotary_dim <= head_dim && rotary_dim.is_multiple_of(2),
            "rotary: rotary_dim {rotary_dim} vs head_dim {head_dim}"
        );
        Self::check_ints(positions, num_tokens, "rotary positions")?;
        self.check(q, num_tokens * num_q_heads * head_dim, "rotary q")?;
        self.check(k, num_tokens * num_k_heads * head_dim, "rotary k")?;
        let (qh, kh, d, r) = (
            i32_of(num_q_heads, "q heads")?,
            i32_of(num_k_heads, "k heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(rotary_dim, "rotary_dim")?,
        );
        // SAFETY: sizes checked above; positions are checked by the caller.
        launch!(unsafe self, rotary_embedding_neox, rows_cfg(num_tokens, 256);
            positions, q, k, cos_sin, &qh, &kh, &d, &r)
    }

    /// [rows, 2d] → [rows, d].
    pub fn silu_and_mul(
        &self,
        x: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        rows: usize,
        d: usize,
    ) -> Result<()> {
        if rows * d == 0 {
            return Ok(());
        }
        self.check(x, rows * 2 * d, "silu_and_mul x")?;
        self.check(out, rows * d, "silu_and_mul out")?;
        let (r, dd) = (rows as i64, i32_of(d, "d")?);
        // Threads for 16-byte chunks where d is whole chunks (activation.cu).
        let vec = self.dtype.vec16();
        let elems = if d.is_multiple_of(vec) {
            rows * d / vec
        } else {
            rows * d
        };
        // SAFETY: sizes checked above.
        launch!(unsafe self, silu_and_mul, grid_stride(elems, self.num_sms); x, out, &r, &dd)
    }

    /// `silu_and_mul` of a gate/up product x [rows, 2d] of the raw residual `src`
    /// [rows, hidden] (a deferred norm: the norm's weight is in the product's columns),
    /// each row first scaled by `src`'s row 1 / RMS.
    #[allow(clippy::too_many_arguments)]
    pub fn silu_and_mul_rms(
        &self,
        x: &CudaSlice<u8>,
        src: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        rows: usize,
        (d, hidden): (usize, usize),
        eps: f32,
    ) -> Result<()> {
        if rows * d == 0 {
            return Ok(());
        }
        self.check(x, rows * 2 * d, "silu_and_mul_rms x")?;
        self.check(src, rows * hidden, "silu_and_mul_rms src")?;
        self.check(out, rows * d, "silu_and_mul_rms out")?;
        let (dd, h) = (i32_of(d, "d")?, i32_of(hidden, "hidden")?);
        // A row a block, a thread a 16-byte chunk of the output (activation.cu), up to 512.
        let vec = self.dtype.vec16();
        let chunks = if d.is_multiple_of(vec) { d / vec } else { d };
        let threads = row_threads(chunks).min(512);
        // SAFETY: sizes checked above.
        launch!(unsafe self, silu_and_mul_rms, rows_cfg(rows, threads); x, src, out, &dd, &h, &eps)
    }

    /// w [rows, cols] *= g [cols] column by column, rounded to the dtype: a norm's weight
    /// folded into the projection after it.
    pub fn scale_cols(
        &self,
        w: &mut CudaSlice<u8>,
        g: &CudaSlice<u8>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        if rows * cols == 0 {
            return Ok(());
        }
        self.check(w, rows * cols, "scale_cols w")?;
        self.check(g, cols, "scale_cols g")?;
        let (r, c) = (rows as i64, i32_of(cols, "cols")?);
        // SAFETY: sizes checked above.
        launch!(unsafe self, scale_cols, grid_stride(rows * cols, self.num_sms); w, g, &r, &c)
    }

    /// Writes K and V rows [T, kv_row] at their slots; negative slots are skipped.
    #[allow(clippy::too_many_arguments)]
    pub fn reshape_and_cache(
        &self,
        key: &CudaSlice<u8>,
        value: &CudaSlice<u8>,
        key_cache: &mut CudaSlice<u8>,
        value_cache: &mut CudaSlice<u8>,
        slot_mapping: &CudaSlice<i32>,
        num_tokens: usize,
        kv_row: usize,
    ) -> Result<()> {
        if num_tokens == 0 {
            return Ok(());
        }
        self.check(key, num_tokens * kv_row, "reshape_and_cache key")?;
        self.check(value, num_tokens * kv_row, "reshape_and_cache value")?;
        Self::check_ints(slot_mapping, num_tokens, "slot_mapping")?;
        ensure!(
            key_cache.len() == value_cache.len(),
            "reshape_and_cache: K and V caches differ in size"
        );
        let row = i32_of(kv_row, "kv_row")?;
        // SAFETY: sizes checked above; slots are checked against the pool by the caller.
        launch!(unsafe self, reshape_and_cache, rows_cfg(num_tokens, 256);
            key, value, key_cache, value_cache, slot_mapping, &row)
    }

    /// q [T, Hq·D] from the fused projection `qkv` [T, (Hq + 2 Hkv)·D]: q and k normed
    /// per head (when weights are given) and rotated, k and v written to the cache at
    /// their slots (csrc/qkv_prepare.cu).
    pub fn qkv_prepare(&self, a: &QkvPrepare, q_out: &mut CudaSlice<u8>) -> Result<()> {
        let t = a.num_tokens;
        if t == 0 {
            return Ok(());
        }
        let (hq, hkv, d) = (a.num_q_heads, a.num_kv_heads, a.head_dim);
        ensure!(
            d <= QKV_MAX_HEAD_DIM && a.rotary_dim <= d && a.rotary_dim.is_multiple_of(2),
            "qkv_prepare: head_dim {d} (at most {QKV_MAX_HEAD_DIM}), rotary_dim {}",
            a.rotary_dim
        );
        self.check(a.qkv, t * (hq + 2 * hkv) * d, "qkv_prepare qkv")?;
        self.check(q_out, t * hq * d, "qkv_prepare q")?;
        for w in [a.q_norm, a.k_norm].into_iter().flatten() {
            self.check(w, d, "qkv_prepare norm weight")?;
        }
        if let Some((input, hidden, _)) = a.deferred_norm {
            self.check(input, t * hidden, "qkv_prepare input")?;
        }
        if let Some(bias) = a.bias {
            self.check(bias, (hq + 2 * hkv) * d, "qkv_prepare bias")?;
        }
        Self::check_ints(a.positions, t, "qkv_prepare positions")?;
        Self::check_ints(a.slot_mapping, t, "qkv_prepare slot_mapping")?;
        ensure!(
            a.key_cache.len() == a.value_cache.len(),
            "qkv_prepare: K and V caches differ in size"
        );
        let s = &self.stream;
        let (qkv, _g0) = a.qkv.device_ptr(s);
        let (qn, _g1) = a.q_norm.map(|w| w.device_ptr(s)).unzip();
        let (kn, _g2) = a.k_norm.map(|w| w.device_ptr(s)).unzip();
        let (pos, _g3) = a.positions.device_ptr(s);
        let (cs, _g4) = a.cos_sin.device_ptr(s);
        let (slots, _g5) = a.slot_mapping.device_ptr(s);
        let (q, _g6) = q_out.device_ptr(s);
        let (kc, _g7) = a.key_cache.device_ptr(s);
        let (vc, _g8) = a.value_cache.device_ptr(s);
        let (input, _g9) = a.deferred_norm.map(|(x, _, _)| x.device_ptr(s)).unzip();
        let (bias, _g10) = a.bias.map(|b| b.device_ptr(s)).unzip();
        let (hidden, input_eps) = a.deferred_norm.map_or((0, 0.0), |(_, h, e)| (h, e));
        let args = QkvArgs {
            qkv,
            q_norm: qn.unwrap_or(0),
            k_norm: kn.unwrap_or(0),
            positions: pos,
            cos_sin: cs,
            slot_mapping: slots,
            q_out: q,
            key_cache: kc,
            value_cache: vc,
            input: input.unwrap_or(0),
            bias: bias.unwrap_or(0),
            num_q_heads: i32_of(hq, "q heads")?,
            num_kv_heads: i32_of(hkv, "kv heads")?,
            head_dim: i32_of(d, "head_dim")?,
            rotary_dim: i32_of(a.rotary_dim, "rotary_dim")?,
            hidden: i32_of(hidden, "hidden")?,
            eps: a.eps,
            input_eps,
        };
        let pointers = [
            qkv,
            qn.unwrap_or(0),
            kn.unwrap_or(0),
            cs,
            q,
            kc,
            vc,
            bias.unwrap_or(0),
        ];
        let lanes = qkv_wide_lanes(d, a.rotary_dim, self.dtype.size())
            .filter(|_| pointers.iter().all(|p| p % 16 == 0));
        let heads = hq + 2 * hkv;
        let blocks = QkvBlocks::for_step(t, heads, lanes);
        // The wide kernel stages its heads in dynamic shared memory, 16 bytes of elements
        // a thread as f32.
        let staging = blocks.threads * 16 / self.dtype.size() * std::mem::size_of::<f32>();
        let cfg = LaunchConfig {
            grid_dim: (t as u32, heads.div_ceil(blocks.heads) as u32, 1),
            block_dim: (blocks.threads as u32, 1, 1),
            shared_mem_bytes: if lanes.is_some() { staging as u32 } else { 0 },
        };
        // SAFETY: sizes checked above; positions and slots are checked against the
        // rotary table and the cache by the caller; the wide kernel's 16-byte chunks are
        // whole and aligned (`qkv_wide_lanes`, the pointers).
        if blocks.whole_token {
            launch!(unsafe self, qkv_prepare_wide_token, cfg; &args)
        } else if lanes.is_some() {
            launch!(unsafe self, qkv_prepare_wide, cfg; &args)
        } else {
            launch!(unsafe self, qkv_prepare, cfg; &args)
        }
    }

    /// out [rows, width] = x[:, start..start + width] of x [rows, cols].
    pub fn split_cols(
        &self,
        x: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        rows: usize,
        cols: usize,
        start: usize,
        width: usize,
    ) -> Result<()> {
        if rows * width == 0 {
            return Ok(());
        }
        ensure!(
            start + width <= cols,
            "split_cols: {start}+{width} > {cols}"
        );
        self.check(x, rows * cols, "split_cols x")?;
        self.check(out, rows * width, "split_cols out")?;
        let (r, c, s, w) = (
            rows as i64,
            i32_of(cols, "cols")?,
            i32_of(start, "start")?,
            i32_of(width, "width")?,
        );
        // SAFETY: sizes checked above.
        launch!(unsafe self, split_cols, grid_stride(rows * width, self.num_sms);
            x, out, &r, &c, &s, &w)
    }

    /// out[i] = x[indices[i]] for `n` rows of `cols` (indices checked by the caller).
    pub fn gather_rows(
        &self,
        x: &CudaSlice<u8>,
        indices: &CudaSlice<i32>,
        out: &mut CudaSlice<u8>,
        n: usize,
        cols: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        Self::check_ints(indices, n, "gather_rows indices")?;
        self.check(out, n * cols, "gather_rows out")?;
        let c = i32_of(cols, "cols")?;
        // SAFETY: out checked above; indices are checked against x's rows by the caller.
        launch!(unsafe self, gather_rows, rows_cfg(n, 256); x, indices, out, &c)
    }

    /// Copies a `height` × `width_bytes` block between two device buffers with row pitches
    /// `src_pitch` and `dst_pitch`, starting at byte offsets `src_at` and `dst_at`.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_2d(
        &self,
        src: &CudaSlice<u8>,
        src_at: usize,
        src_pitch: usize,
        dst: &mut CudaSlice<u8>,
        dst_at: usize,
        dst_pitch: usize,
        width_bytes: usize,
        height: usize,
    ) -> Result<()> {
        if height == 0 || width_bytes == 0 {
            return Ok(());
        }
        let end = |at: usize, pitch: usize| at + (height - 1) * pitch + width_bytes;
        ensure!(
            end(src_at, src_pitch) <= src.len() && end(dst_at, dst_pitch) <= dst.len(),
            "copy_2d: {height} rows of {width_bytes} bytes outside the buffers"
        );
        let s = &self.stream;
        let (sp, _g0) = src.device_ptr(s);
        let (dp, _g1) = dst.device_ptr_mut(s);
        let copy = cudarc::driver::sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: sp + src_at as u64,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dp + dst_at as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width_bytes,
            Height: height,
        };
        // SAFETY: both blocks lie inside their buffers (checked above), on this stream.
        unsafe { cudarc::driver::sys::cuMemcpy2DAsync_v2(&copy, s.cu_stream()) }
            .result()
            .map_err(|e| driver_error("cuMemcpy2DAsync", e))
    }

    /// Sets `n` elements to `value` (NaN to poison outputs in tests).
    pub fn fill(&self, y: &mut CudaSlice<u8>, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.check(y, n, "fill")?;
        let nn = n as i64;
        // SAFETY: size checked above.
        launch!(unsafe self, fill, grid_stride(n, self.num_sms); y, &nn, &value)
    }

    /// Draws a region of a `--load-format dummy` tensor (see `dummy_fill` in copy.cu) into
    /// `rows * cols` elements of `y` from element `at` on.
    #[allow(clippy::too_many_arguments)]
    pub fn dummy_fill(
        &self,
        y: &mut CudaSlice<u8>,
        at: usize,
        key: u64,
        mean: f32,
        scale: f32,
        full_cols: usize,
        (row0, col0): (usize, usize),
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        self.check(y, at + n, "dummy_fill")?;
        let (ptr, _guard) = y.device_ptr_mut(&self.stream);
        let out = ptr + (at * self.dtype.size()) as u64;
        let [full_cols, row0, col0, rows, cols] =
            [full_cols, row0, col0, rows, cols].map(|v| v as i64);
        // SAFETY: elements at..at + n lie inside `y` (checked above).
        launch!(unsafe self, dummy_fill, grid_stride(n, self.num_sms);
            &out, &key, &mean, &scale, &full_cols, &row0, &col0, &rows, &cols)
    }

    /// Paged attention of q [T, Hq, D] over the caches, into out [T, Hq, D]: the decode
    /// kernel for the plan's one-token sequences, then the tile kernel for the rest.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &CudaSlice<u8>,
        key_cache: &CudaSlice<u8>,
        value_cache: &CudaSlice<u8>,
        meta: &AttentionMeta,
        dims: AttentionDims,
        scale: f32,
        out: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let rows = dims.num_tokens * dims.num_q_heads;
        if rows == 0 {
            return Ok(());
        }
        let Some(d_index) = HEAD_DIMS.iter().position(|&d| d == dims.head_dim) else {
            bail!(
                "paged attention: head_dim {} has no kernel (supported: {HEAD_DIMS:?})",
                dims.head_dim
            );
        };
        self.check(q, rows * dims.head_dim, "attention q")?;
        self.check(out, rows * dims.head_dim, "attention out")?;
        ensure!(
            key_cache.len() == value_cache.len(),
            "attention: K and V caches differ in size"
        );
        let num_seqs = meta.seq_lens.len();
        Self::check_ints(meta.query_start_loc, num_seqs + 1, "query_start_loc")?;
        Self::check_ints(
            meta.block_tables,
            num_seqs * meta.max_blocks_per_seq,
            "block_tables",
        )?;
        let plan = meta.plan;
        Self::check_ints(meta.tile_seq, plan.num_tiles(), "tile_seq")?;
        Self::check_ints(meta.tile_token, plan.num_tiles(), "tile_token")?;
        Self::check_ints(meta.decode_seqs, plan.decode_seqs.len(), "decode_seqs")?;
        Self::check_ints(meta.step_dims, 2, "step_dims")?;
        let caches = AttentionCaches {
            q,
            key_cache,
            value_cache,
            meta,
            dims,
            scale,
        };
        // The CUDA-core tiles go first: their split combine rewrites every row, and the
        // decode kernel then writes the decode rows.
        if plan.num_tiles() > 0 {
            match (plan.tile_kernel, &self.f.paged_attention_prefill) {
                (TileKernel::TensorCore, Some((by_head_dim, d128_occ2))) => {
                    let blocks = plan.num_tiles() * dims.num_kv_heads;
                    let func = if prefill_takes_occ2(dims.head_dim, blocks, self.num_sms) {
                        d128_occ2
                    } else {
                        &by_head_dim[d_index]
                    };
                    self.attention_tiles_tensor_core(func, &caches, out)?
                }
                (TileKernel::TensorCore, None) => {
                    bail!("paged attention: no tensor-core kernel in the f32 module")
                }
                (TileKernel::CudaCore, _) => {
                    self.attention_tiles_cuda_core(d_index, &caches, out)?
                }
            }
        }
        if !plan.decode_seqs.is_empty() {
            self.attention_decode(d_index, &caches, out)?;
        }
        Ok(())
    }

    /// f32 scratch for the partials of a split attention.
    fn partials(&self, n: usize) -> Result<DeviceBuf<f32>> {
        // Every partial a combine reads is written by the attention kernel first.
        self.alloc_of::<f32>(n.max(1))
    }

    fn attention_decode(
        &self,
        d_index: usize,
        c: &AttentionCaches,
        out: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let (plan, dims, meta) = (c.meta.plan, c.dims, c.meta);
        let num_decode = plan.decode_seqs.len();
        ensure!(
            num_decode <= 65_535,
            "paged attention: {num_decode} decode sequences in one step, past the grid's 65,535"
        );
        // The kernel keeps each key's cache slot as an i32.
        let slot_bytes = dims.num_kv_heads * dims.head_dim * self.dtype.size();
        ensure!(
            c.key_cache.len() / slot_bytes.max(1) <= i32::MAX as usize,
            "paged attention: a layer's KV cache of {} bytes has more slots than the decode \
             kernel's i32 (lower --gpu-memory-utilization)",
            c.key_cache.len()
        );
        let parts = plan.decode_partitions;
        let part_rows = parts * num_decode * dims.num_q_heads;
        let (part_o, part_ml) = if parts > 1 {
            (
                Some(self.partials(part_rows * dims.head_dim)?),
                Some(self.partials(part_rows * 2)?),
            )
        } else {
            (None, None)
        };
        {
            let s = &self.stream;
            let (q_p, _g0) = c.q.device_ptr(s);
            let (kc_p, _g1) = c.key_cache.device_ptr(s);
            let (vc_p, _g2) = c.value_cache.device_ptr(s);
            let (bt_p, _g3) = meta.block_tables.device_ptr(s);
            let (sl_p, _g4) = meta.seq_lens.device_ptr(s);
            let (qs_p, _g5) = meta.query_start_loc.device_ptr(s);
            let (ds_p, _g6) = meta.decode_seqs.device_ptr(s);
            let (sd_p, _g10) = meta.step_dims.device_ptr(s);
            let (out_p, _g7) = out.device_ptr(s);
            let (po_p, _g8) = part_o.as_ref().map(|p| p.device_ptr(s)).unzip();
            let (pm_p, _g9) = part_ml.as_ref().map(|p| p.device_ptr(s)).unzip();
            let args = DecodeArgs {
                q: q_p,
                key_cache: kc_p,
                value_cache: vc_p,
                block_tables: bt_p,
                seq_lens: sl_p,
                query_start_loc: qs_p,
                decode_seqs: ds_p,
                out: out_p,
                part_o: po_p.unwrap_or(0),
                part_ml: pm_p.unwrap_or(0),
                step_dims: sd_p,
                num_decode: i32_of(num_decode, "decode sequences")?,
                num_q_heads: i32_of(dims.num_q_heads, "q heads")?,
                num_kv_heads: i32_of(dims.num_kv_heads, "kv heads")?,
                q_split_log2: plan.decode_q_split.trailing_zeros() as i32,
                block_size: i32_of(dims.block_size, "block_size")?,
                scale: c.scale,
            };
            let q_blocks = dims.num_kv_heads * plan.decode_q_split;
            let cfg = LaunchConfig {
                // The sequence varies slowest, so blocks start in the plan's order of decode
                // sequences, the longest first (AttentionPlan::new).
                grid_dim: (q_blocks as u32, parts as u32, num_decode as u32),
                block_dim: (DEC_THREADS, 1, 1),
                shared_mem_bytes: plan.decode_shared_bytes(dims.head_dim) as u32,
            };
            let g = plan.decode_group_index();
            let func = if plan.decode_four_blocks_an_sm(dims.head_dim) {
                &self.f.paged_attention_decode_d128_g8_occ4
            } else {
                &self.f.paged_attention_decode[d_index][g]
            };
            // SAFETY: buffer sizes checked by `paged_attention`; block tables and seq_lens
            // are checked on the host by the caller, which holds their host copies.
            launch!(unsafe self, func => "paged_attention_decode", cfg; &args)?;
        }
        if let (Some(po), Some(pm)) = (&part_o, &part_ml) {
            let (nd, hq, d, np) = (
                i32_of(num_decode, "decode sequences")?,
                i32_of(dims.num_q_heads, "q heads")?,
                i32_of(dims.head_dim, "head_dim")?,
                i32_of(parts, "partitions")?,
            );
            // A block per row, or at large batches a warp per row: most of those rows
            // were written whole by the decode kernel, and thousands of blocks that only
            // look up a length took 7 us a layer (batch 256, Qwen3-0.6B).
            let rows = num_decode * dims.num_q_heads;
            let (cfg, row_threads) = if rows >= 8 * self.num_sms {
                (rows_cfg(rows.div_ceil(4), 128), 32i32)
            } else {
                (rows_cfg(rows, dims.head_dim as u32), dims.head_dim as i32)
            };
            // SAFETY: partials sized for (partitions, decode rows) above; the combine
            // reads the partitions below min(parts, ceil(seq_len / partition)), and
            // rows past `rows` exit.
            launch!(unsafe self, paged_attention_decode_combine, cfg;
                po, pm, meta.decode_seqs, meta.query_start_loc, meta.seq_lens,
                meta.step_dims, out, &nd, &hq, &d, &np, &row_threads)?;
        }
        Ok(())
    }

    fn attention_tiles_tensor_core(
        &self,
        func: &CudaFunction,
        c: &AttentionCaches,
        out: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let (plan, dims, meta) = (c.meta.plan, c.dims, c.meta);
        // The kernel keeps a key's row offset in 16-byte units in 32 bits.
        ensure!(
            c.key_cache.len() as u64 <= 1 << 36,
            "attention: a layer's KV cache of {} bytes is past the prefill kernel's 64 GiB",
            c.key_cache.len()
        );
        let s = &self.stream;
        let (q_p, _g0) = c.q.device_ptr(s);
        let (kc_p, _g1) = c.key_cache.device_ptr(s);
        let (vc_p, _g2) = c.value_cache.device_ptr(s);
        let (bt_p, _g3) = meta.block_tables.device_ptr(s);
        let (sl_p, _g4) = meta.seq_lens.device_ptr(s);
        let (qs_p, _g5) = meta.query_start_loc.device_ptr(s);
        let (ts_p, _g6) = meta.tile_seq.device_ptr(s);
        let (tt_p, _g7) = meta.tile_token.device_ptr(s);
        let (out_p, _g8) = out.device_ptr(s);
        let (sd_p, _g9) = meta.step_dims.device_ptr(s);
        let args = PrefillArgs {
            q: q_p,
            key_cache: kc_p,
            value_cache: vc_p,
            block_tables: bt_p,
            seq_lens: sl_p,
            query_start_loc: qs_p,
            tile_seq: ts_p,
            tile_token: tt_p,
            out: out_p,
            step_dims: sd_p,
            num_q_heads: i32_of(dims.num_q_heads, "q heads")?,
            num_kv_heads: i32_of(dims.num_kv_heads, "kv heads")?,
            block_size: i32_of(dims.block_size, "block_size")?,
            tokens_per_tile: i32_of(plan.tokens_per_tile, "tokens_per_tile")?,
            scale: c.scale,
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.num_tiles() as u32, dims.num_kv_heads as u32, 1),
            block_dim: (PF_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as in `attention_decode`.
        launch!(unsafe self, func => "paged_attention_prefill", cfg; &args)
    }

    fn attention_tiles_cuda_core(
        &self,
        d_index: usize,
        c: &AttentionCaches,
        out: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let (plan, dims, meta) = (c.meta.plan, c.dims, c.meta);
        let rows = dims.num_tokens * dims.num_q_heads;
        let splits = plan.num_splits;
        let (part_o, part_ml) = if splits > 1 {
            (
                Some(self.partials(splits * rows * dims.head_dim)?),
                Some(self.partials(splits * rows * 2)?),
            )
        } else {
            (None, None)
        };
        let func = &self.f.paged_attention[d_index];
        {
            let s = &self.stream;
            let (q_p, _g0) = c.q.device_ptr(s);
            let (kc_p, _g1) = c.key_cache.device_ptr(s);
            let (vc_p, _g2) = c.value_cache.device_ptr(s);
            let (bt_p, _g3) = meta.block_tables.device_ptr(s);
            let (sl_p, _g4) = meta.seq_lens.device_ptr(s);
            let (qs_p, _g5) = meta.query_start_loc.device_ptr(s);
            let (ts_p, _g6) = meta.tile_seq.device_ptr(s);
            let (tt_p, _g7) = meta.tile_token.device_ptr(s);
            let (out_p, _g8) = out.device_ptr(s);
            let (po_p, _g9) = part_o.as_ref().map(|p| p.device_ptr(s)).unzip();
            let (pm_p, _g10) = part_ml.as_ref().map(|p| p.device_ptr(s)).unzip();
            let (sd_p, _g11) = meta.step_dims.device_ptr(s);
            let args = AttentionArgs {
                q: q_p,
                key_cache: kc_p,
                value_cache: vc_p,
                block_tables: bt_p,
                seq_lens: sl_p,
                query_start_loc: qs_p,
                tile_seq: ts_p,
                tile_token: tt_p,
                out: out_p,
                part_o: po_p.unwrap_or(0),
                part_ml: pm_p.unwrap_or(0),
                step_dims: sd_p,
                num_tokens: i32_of(dims.num_tokens, "num_tokens")?,
                num_q_heads: i32_of(dims.num_q_heads, "q heads")?,
                num_kv_heads: i32_of(dims.num_kv_heads, "kv heads")?,
                block_size: i32_of(dims.block_size, "block_size")?,
                tokens_per_tile: i32_of(plan.tokens_per_tile, "tokens_per_tile")?,
                split_keys: plan.split_keys.min(i32::MAX as usize) as i32,
                scale: c.scale,
            };
            let cfg = LaunchConfig {
                grid_dim: (
                    plan.num_tiles() as u32,
                    dims.num_kv_heads as u32,
                    splits as u32,
                ),
                block_dim: (ATT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as in `attention_decode`. The pointer guards end with this scope,
            // before `out` is borrowed again.
            launch!(unsafe self, func => "paged_attention", cfg; &args)?;
        }
        if let (Some(po), Some(pm)) = (&part_o, &part_ml) {
            let (nr, d, ns) = (
                i32_of(rows, "rows")?,
                i32_of(dims.head_dim, "head_dim")?,
                i32_of(splits, "splits")?,
            );
            // SAFETY: partials sized for (splits, rows) above.
            launch!(unsafe self, paged_attention_combine, rows_cfg(rows, dims.head_dim as u32);
                po, pm, out, &nr, &d, &ns)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{prefill_takes_occ2, qkv_wide_lanes, QkvBlocks};

    #[test]
    fn small_d128_prefill_grids_take_the_two_block_kernel() {
        // Grids of the bench on an H100 (132 SMs): a chat turn's 128 and 256 blocks fit
        // one wave of two an SM; a 2,048-token prompt's 512 and more do not.
        for blocks in [1, 128, 256, 264] {
            assert!(prefill_takes_occ2(128, blocks, 132), "{blocks}");
        }
        for blocks in [265, 512, 1024, 1816, 2048, 4096] {
            assert!(!prefill_takes_occ2(128, blocks, 132), "{blocks}");
        }
        assert!(!prefill_takes_occ2(64, 128, 132));
    }

    #[test]
    fn qkv_prepare_takes_a_tokens_heads_in_one_block_at_65_to_128_tokens() {
        let blocks = |threads, heads, whole_token| QkvBlocks {
            threads,
            heads,
            whole_token,
        };
        // Qwen3-0.6B in bf16: 32 heads of 16 lanes, 8 a block, or a token's 32 in 512 threads.
        assert_eq!(QkvBlocks::for_step(64, 32, Some(16)), blocks(128, 8, false));
        assert_eq!(QkvBlocks::for_step(65, 32, Some(16)), blocks(512, 32, true));
        assert_eq!(
            QkvBlocks::for_step(128, 32, Some(16)),
            blocks(512, 32, true)
        );
        assert_eq!(
            QkvBlocks::for_step(129, 32, Some(16)),
            blocks(128, 8, false)
        );
        // A token's threads are rounded up to whole warps; more than 1,024 of them split
        // over blocks (80 heads: 64 and 16).
        assert_eq!(QkvBlocks::for_step(70, 35, Some(16)), blocks(576, 35, true));
        assert_eq!(
            QkvBlocks::for_step(70, 80, Some(16)),
            blocks(1024, 64, true)
        );
        // f32's 32 lanes a head; a warp a head where the lanes are not 16-byte chunks.
        assert_eq!(QkvBlocks::for_step(70, 12, Some(32)), blocks(384, 12, true));
        assert_eq!(QkvBlocks::for_step(70, 32, None), blocks(128, 4, false));
    }

    #[test]
    fn wide_qkv_prepare_takes_heads_of_whole_aligned_chunks() {
        // Qwen3 / Llama heads of 128: 16 lanes of 8 in bf16 and f16, 32 of 4 in f32.
        assert_eq!(qkv_wide_lanes(128, 128, 2), Some(16));
        assert_eq!(qkv_wide_lanes(128, 128, 4), Some(32));
        // Partial rotary whose halves are whole chunks, and none at all.
        assert_eq!(qkv_wide_lanes(64, 32, 2), Some(8));
        assert_eq!(qkv_wide_lanes(128, 0, 2), Some(16));
        // A half of 12 elements, a head of 36, a head wider than a warp of chunks.
        assert_eq!(qkv_wide_lanes(128, 24, 2), None);
        assert_eq!(qkv_wide_lanes(36, 36, 2), None);
        assert_eq!(qkv_wide_lanes(36, 36, 4), None);
        assert_eq!(qkv_wide_lanes(512, 512, 2), None);
    }
}
