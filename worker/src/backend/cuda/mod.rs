//! `CudaBackend`: the `Backend` on one NVIDIA GPU through cudarc: weights, activations and
//! the KV cache in bf16 (fp16 or f32 when asked), GEMMs in cuBLAS with f32 accumulation,
//! every other op a kernel of `vllm_kernels::cuda` compiled by NVRTC.
//!
//! Everything runs on one stream, in order, so ops never wait for the GPU; the host only
//! waits where it reads results back (`to_host`, sampled tokens). Shapes and the
//! host-visible metadata (positions, slots, block tables) are checked on the host before a
//! launch, so bad input is an error rather than a stray memory access.

pub mod gate_up;
pub mod kernel_cache;
pub mod memory;
pub mod pending_step;
pub mod sampling;
pub mod step_buffers;
pub mod tensor;

#[cfg(test)]
mod tests;

use std::cell::{Cell, RefCell};

use anyhow::{bail, ensure, Context, Result};
use vllm_kernels::cpu::attention::PagedAttentionShape;
use vllm_kernels::cuda::gemm::padded_rows;
use vllm_kernels::cuda::{
    AttentionDims, AttentionKernels, AttentionMeta, AttentionPlan, CudaDevice, CudaOps, DType,
    Gemm, GemvNorm, TuningCounts, GEMV_PAYS_MAX_M, THIN_GEMM_MAX_M,
};

use gate_up::{GateUpChoices, GateUpKernel};
use step_buffers::StepBuffers;
pub use tensor::{CudaInts, CudaTensor, DevicePlan};

use super::{Backend, StepCapacity, StepInputs, StepMetadata};
use crate::communicator::nccl::CustomAllReduceMode;
use crate::communicator::{Communicator, NcclCommunicator};
use crate::sampler::seeded_uniform;
use crate::weights::{DummyRegion, HostTensor, WeightTensor};

/// Rows whose products go to our decode-batch GEMM (`thin_gemm`, on Hopper): gemv takes
/// fewer, cuBLAS more (docs/BENCHMARKS.md, "Decode GEMMs on warpgroup tensor cores").
const THIN_GEMM_ROWS: std::ops::RangeInclusive<usize> = (GEMV_PAYS_MAX_M + 1)..=THIN_GEMM_MAX_M;

/// Bytes of its weights a gemv after a collective asks L2 for before it waits for the
/// collective to end. On four H200s 8 MiB took the Qwen3-8B's TP=4 TPOT from 2.08 to
/// 2.06 ms, and 16, 25 or 40 MiB less (docs/BENCHMARKS.md, 2026-11-26).
const EARLY_L2_BYTES: usize = 8 << 20;

/// CUDA devices the driver reports; 0 without a driver (`--device auto`).
pub fn device_count() -> usize {
    vllm_kernels::cuda::libs::device_count()
}

/// (rows, hidden) of a residual add + RMSNorm: `x` and `residual` one shape, each row
/// the weight's length.
fn residual_norm_shape(
    x: &CudaTensor,
    residual: &CudaTensor,
    weight: &CudaTensor,
) -> Result<(usize, usize)> {
    let hidden = weight.numel();
    ensure!(
        x.shape == residual.shape && x.cols() == hidden,
        "residual add + RMSNorm: x {:?}, residual {:?}, weight {hidden}",
        x.shape,
        residual.shape
    );
    Ok((x.rows(), hidden))
}

pub struct CudaBackend {
    pub dev: CudaDevice,
    pub ops: CudaOps,
    gemm: Gemm,
    dtype: DType,
    /// The attention kernels (`--attention-backend`).
    attention: AttentionKernels,
    /// Draws of requests without a seed: a counter-based stream of their own.
    unseeded_draws: Cell<u64>,
    /// The tensor-parallel group; `None` at world size 1.
    comm: Option<NcclCommunicator>,
    /// Whether a collective was launched since the last linear layer: the next gemv then
    /// asks L2 for EARLY_L2_BYTES of its weights while the collective's few blocks wait on
    /// the peers (gemv.cu, `early_lines`).
    after_collective: Cell<bool>,
    /// The one-row gate/up kernel of each shape timed so far.
    gate_up: GateUpChoices,
    /// Where steps are staged, once `reserve_steps` has sized them.
    steps: RefCell<Option<StepSetup>>,
}

/// The step buffers and the (local) attention heads every step is planned for.
struct StepSetup {
    buffers: StepBuffers,
    num_q_heads: usize,
    num_kv_heads: usize,
}

impl CudaBackend {
    /// Opens GPU `rank` (one process per GPU: rank r takes GPU r) and builds the kernels
    /// of `dtype`.
    pub fn new(rank: u32, dtype: DType) -> Result<Self> {
        let dev = CudaDevice::open(rank as usize)?;
        let ops = CudaOps::new(&dev, dtype)?;
        let gemm = Gemm::new(dev.stream.clone(), dtype)?;
        Ok(Self {
            dev,
            ops,
            gemm,
            dtype,
            attention: AttentionKernels::flash(dtype != DType::F32),
            unseeded_draws: Cell::new(0),
            comm: None,
            after_collective: Cell::new(false),
            gate_up: GateUpChoices::default(),
            steps: RefCell::new(None),
        })
    }

    /// Joins the tensor-parallel group of `unique_id` as `rank` of `world_size`; blocks
    /// until every rank has joined.
    pub fn join_group(
        &mut self,
        unique_id: &[u8],
        rank: u32,
        world_size: u32,
        custom_all_reduce: CustomAllReduceMode,
    ) -> Result<()> {
        self.comm = Some(NcclCommunicator::join(
            unique_id,
            rank as usize,
            world_size as usize,
            (&self.dev, &self.ops),
            custom_all_reduce,
        )?);
        Ok(())
    }

    pub fn communicator(&self) -> Option<&NcclCommunicator> {
        self.comm.as_ref()
    }

    /// Runs `f` with GEMM tuning on: each new GEMM shape gets its fastest cuBLASLt
    /// algorithm (`Gemm::tuning`). For eager runs only, never inside a capture.
    pub fn tuning_gemms<R>(&self, f: impl FnOnce() -> R) -> R {
        self.gemm.tuning(f)
    }

    /// Runs `f`, the worst-case step, with cuBLAS's prefill kernels loaded at every row
    /// count an eager step can run (`Gemm::warming`).
    pub fn warming_gemms<R>(&self, f: impl FnOnce() -> R) -> R {
        self.gemm.warming(f)
    }

    /// GEMM shapes tuned so far: how many, won by cuBLASLt, timed rather than recorded.
    pub fn gemm_tuning_counts(&self) -> TuningCounts {
        self.gemm.tuning_counts()
    }

    /// Runs attention with `kernels` instead of the flash default.
    pub fn with_attention_kernels(mut self, kernels: AttentionKernels) -> Self {
        self.attention = kernels;
        self
    }

    /// `StepBuffers::copy_into_input_ids` on the step staged last.
    pub fn copy_into_input_ids(
        &self,
        runs: &[crate::overlap::CopyRun],
        src: &cudarc::driver::CudaSlice<i32>,
    ) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let setup = self.steps.borrow();
        let setup = setup
            .as_ref()
            .context("copying into a step's inputs before reserve_steps")?;
        setup.buffers.copy_into_input_ids(runs, src)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The next uniform of the stream of unseeded requests (`seed` is the engine's).
    pub fn next_unseeded_uniform(&self, seed: u64) -> f64 {
        let n = self.unseeded_draws.get();
        self.unseeded_draws.set(n + 1);
        // A different key than any request seed's stream would use by accident.
        seeded_uniform(seed ^ 0x005E_ED0F_C0DA_u64, n)
    }

    /// Room for `shape`, whose rows, past a decode batch, are rounded up as cuBLAS runs
    /// them (`padded_rows`), so that any such tensor can be a GEMM's operand or output.
    fn tensor(&self, shape: Vec<usize>) -> Result<CudaTensor> {
        let numel: usize = shape.iter().product();
        let elems = match shape[..] {
            [rows, _, ..] if rows > 0 => padded_rows(rows) * (numel / rows),
            _ => numel,
        };
        let buf = self.ops.alloc(elems)?;
        Ok(CudaTensor { shape, buf })
    }
}

/// Every block a sequence reads lies inside the pool, and every row is long enough.
fn check_block_tables(
    meta: &StepMetadata<CudaBackend>,
    shape: &PagedAttentionShape,
    num_cache_blocks: usize,
) -> Result<()> {
    if meta.plan.blocks_checked.get() == Some(num_cache_blocks) {
        return Ok(());
    }
    let width = shape.max_blocks_per_seq;
    ensure!(
        meta.block_tables.host.len() == meta.num_seqs * width,
        "block_tables: {} entries for {} sequences of {width}",
        meta.block_tables.host.len(),
        meta.num_seqs
    );
    for (s, &len) in meta.seq_lens.host.iter().enumerate() {
        let used = (len.max(0) as usize).div_ceil(shape.block_size);
        ensure!(
            used <= width,
            "sequence {s}: {len} tokens need {used} blocks, the table holds {width}"
        );
        let row = &meta.block_tables.host[s * width..s * width + used];
        if let Some(&b) = row
            .iter()
            .find(|&&b| b < 0 || b as usize >= num_cache_blocks)
        {
            bail!("sequence {s}: block {b} outside the KV cache of {num_cache_blocks} blocks");
        }
    }
    meta.plan.blocks_checked.set(Some(num_cache_blocks));
    Ok(())
}

impl CudaBackend {
    /// `Backend::linear`, a gemv asking L2 for `early_l2` bytes of w before it waits.
    fn linear_early(&self, x: &CudaTensor, w: &CudaTensor, early_l2: usize) -> Result<CudaTensor> {
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        ensure!(
            w.cols() == k,
            "linear: x has {k} columns, weight {:?}",
            w.shape
        );
        let mut out = self.tensor(vec![m, n])?;
        // Decode batches stream the weights through our own kernels; cuBLAS takes the rest
        // (docs/BENCHMARKS.md, "Thin GEMMs").
        if THIN_GEMM_ROWS.contains(&m)
            && self.ops.thin_gemm_fits([&x.buf, &w.buf, &out.buf], m, k, n)
        {
            self.ops
                .thin_gemm(&x.buf, &w.buf, &mut out.buf, (m, k, n), None)?;
        } else if m <= GEMV_PAYS_MAX_M && self.ops.gemv_fits([&x.buf, &w.buf, &out.buf], m, k) {
            self.ops
                .gemv(&x.buf, &w.buf, &mut out.buf, (m, k, n), early_l2)?;
        } else {
            self.gemm.linear(&x.buf, &w.buf, &mut out.buf, m, k, n)?;
        }
        Ok(out)
    }

    /// `linear_all_reduce_add_rms_norm` of one token in the custom all-reduce's two
    /// kernels (`CustomAllReduce::gemv_add_rms_norm`), where they take it; `None`: not run.
    fn gemv_all_reduce_add_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        residual: &mut CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<Option<CudaTensor>> {
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        let Some(comm) = &self.comm else {
            return Ok(None);
        };
        if m != 1 || w.cols() != k {
            return Ok(None);
        }
        let Some(custom) = comm.custom_gemv_norm(&self.ops, k, n)? else {
            return Ok(None);
        };
        let mut out = self.tensor(vec![1, n])?;
        if !self.ops.gemv_fits([&x.buf, &w.buf, &out.buf], 1, k) {
            return Ok(None);
        }
        residual_norm_shape(&out, residual, weight)?;
        // This projection never follows a collective; the next one does.
        self.take_early_l2();
        let p = GemvNorm {
            x: &x.buf,
            w: &w.buf,
            k,
            n,
            residual: &mut residual.buf,
            weight: &weight.buf,
            eps,
        };
        custom.gemv_add_rms_norm(&self.ops, p, &mut out.buf)?;
        self.after_collective.set(true);
        Ok(Some(out))
    }

    /// EARLY_L2_BYTES if a collective came since the last linear layer, else 0; either
    /// way the next linear layer starts afresh.
    fn take_early_l2(&self) -> usize {
        if self.after_collective.replace(false) {
            EARLY_L2_BYTES
        } else {
            0
        }
    }

    /// A tensor of `shape` from bytes already in the backend's dtype (at least one element
    /// is allocated: empty buffers are not allocatable).
    fn upload_bytes(&self, shape: &[usize], bytes: &[u8]) -> Result<CudaTensor> {
        ensure!(
            bytes.len() == shape.iter().product::<usize>() * self.dtype.size(),
            "upload: {} bytes for a {shape:?} tensor of {}",
            bytes.len(),
            self.dtype.name()
        );
        let buf = if bytes.is_empty() {
            self.ops.alloc(1)?
        } else {
            self.dev
                .stream
                .clone_htod(bytes)
                .map_err(|e| anyhow::anyhow!("copying a {shape:?} tensor to the GPU: {e:?}"))?
                .into()
        };
        Ok(CudaTensor {
            shape: shape.to_vec(),
            buf,
        })
    }

    /// A dummy weight of `shape`, its `regions` (stacked by rows) drawn on the GPU.
    fn draw_dummy(&self, shape: &[usize], regions: &[DummyRegion]) -> Result<CudaTensor> {
        let numel: usize = shape.iter().product();
        let mut buf = self.ops.alloc(numel.max(1))?;
        let mut at = 0;
        for r in regions {
            self.ops.dummy_fill(
                &mut buf,
                at,
                r.key,
                r.mean,
                r.scale,
                r.full_cols,
                (r.row0, r.col0),
                (r.rows, r.cols),
            )?;
            at += r.rows * r.cols;
        }
        ensure!(
            at == numel,
            "dummy weight {shape:?}: regions hold {at} elements"
        );
        Ok(CudaTensor {
            shape: shape.to_vec(),
            buf,
        })
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Ints = CudaInts;
    type StepPlan = DevicePlan;

    fn device_name(&self) -> String {
        format!("cuda:{}", self.dev.ordinal)
    }
    fn dtype_name(&self) -> &'static str {
        self.dtype.name()
    }
    fn kv_cache_element_bytes(&self) -> usize {
        self.dtype.size()
    }

    fn upload(&self, t: &HostTensor) -> Result<CudaTensor> {
        self.upload_bytes(&t.shape, &self.dtype.encode(&t.data))
    }

    fn weight_dtype(&self) -> DType {
        self.dtype
    }

    /// A weight of the backend's dtype goes to the GPU straight from its bytes (the
    /// checkpoint's mmap, for an unsharded tensor); another dtype is converted on the host
    /// in parallel chunks first.
    fn upload_weight(&self, w: &WeightTensor) -> Result<CudaTensor> {
        match w.dummy_regions() {
            // Drawn on the GPU: a 70B model's dummy shard in a second, not minutes.
            Some(regions) if w.dtype == self.dtype => self.draw_dummy(&w.shape, regions),
            _ => self.upload_bytes(&w.shape, &w.bytes_as(self.dtype)),
        }
    }

    /// Allocates the step buffers for steps up to `capacity`, planned for this rank's
    /// attention heads. Steps are uploaded one at a time: each overwrites the last one's
    /// arrays, so a `StepMetadata` is dead once the next step is uploaded.
    fn reserve_steps(
        &self,
        capacity: StepCapacity,
        num_q_heads: usize,
        num_kv_heads: usize,
    ) -> Result<()> {
        let buffers = StepBuffers::new(&self.dev.stream, capacity)?;
        *self.steps.borrow_mut() = Some(StepSetup {
            buffers,
            num_q_heads,
            num_kv_heads,
        });
        Ok(())
    }

    /// Plans the step's attention and stages everything in the step buffers: one copy.
    fn upload_step(&self, inputs: &StepInputs) -> Result<StepMetadata<Self>> {
        let mut setup = self.steps.borrow_mut();
        let setup = setup
            .as_mut()
            .context("the CUDA backend runs a step only after reserve_steps")?;
        let heads = (setup.num_q_heads, setup.num_kv_heads);
        let plan = AttentionPlan::new(
            &inputs.query_start_loc,
            &inputs.seq_lens,
            heads.0,
            heads.1,
            self.dev.num_sms,
            self.attention,
        )?;
        let staged = setup.buffers.stage(inputs, &plan)?;
        let ints = |dev, host: &[i32]| CudaInts {
            dev,
            host: host.to_vec(),
        };
        Ok(StepMetadata {
            plan: DevicePlan {
                plan,
                heads,
                tile_seq: staged.tile_seq,
                tile_token: staged.tile_token,
                decode_seqs: staged.decode_seqs,
                step_dims: staged.step_dims,
                blocks_checked: Cell::new(None),
            },
            input_ids: ints(staged.input_ids, &inputs.input_ids),
            positions: ints(staged.positions, &inputs.positions),
            slot_mapping: ints(staged.slot_mapping, &inputs.slot_mapping),
            block_tables: ints(staged.block_tables, &inputs.block_tables),
            seq_lens: ints(staged.seq_lens, &inputs.seq_lens),
            query_start_loc: ints(staged.query_start_loc, &inputs.query_start_loc),
            logits_indices: ints(staged.logits_indices, &inputs.logits_indices),
            samples_every_token: inputs.samples_every_token(),
            num_tokens: inputs.num_tokens(),
            num_seqs: inputs.num_seqs(),
            max_blocks_per_seq: inputs.max_blocks_per_seq,
        })
    }

    fn to_host(&self, t: &CudaTensor) -> Result<HostTensor> {
        let bytes = t.numel() * self.dtype.size();
        let mut all = self
            .dev
            .stream
            .clone_dtoh(&*t.buf)
            .map_err(|e| anyhow::anyhow!("copying a {:?} tensor from the GPU: {e:?}", t.shape))
            .context("a kernel of this step may have failed")?;
        all.truncate(bytes);
        Ok(HostTensor::new(t.shape.clone(), self.dtype.decode(&all)))
    }

    fn alloc_kv_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<CudaTensor> {
        let shape = vec![num_blocks, block_size, num_kv_heads, head_dim];
        let buf = self
            .ops
            .alloc_zeros(shape.iter().product())
            .with_context(|| format!("allocating a KV cache layer of {num_blocks} blocks"))?;
        Ok(CudaTensor {
            shape,
            buf: buf.into(),
        })
    }

    fn embedding(
        &self,
        table: &CudaTensor,
        ids: &CudaInts,
        vocab_start: usize,
    ) -> Result<CudaTensor> {
        let (n, hidden) = (ids.host.len(), table.cols());
        let mut out = self.tensor(vec![n, hidden])?;
        self.ops.embedding(
            &ids.dev,
            &table.buf,
            &mut out.buf,
            n,
            hidden,
            vocab_start,
            table.rows(),
        )?;
        Ok(out)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaTensor) -> Result<CudaTensor> {
        let early_l2 = self.take_early_l2();
        self.linear_early(x, w, early_l2)
    }

    fn rms_norm(&self, x: &CudaTensor, weight: &CudaTensor, eps: f32) -> Result<CudaTensor> {
        let hidden = weight.numel();
        ensure!(
            x.cols() == hidden,
            "rms_norm: x {:?}, weight {hidden}",
            x.shape
        );
        let mut out = self.tensor(vec![x.rows(), hidden])?;
        self.ops
            .rms_norm(&x.buf, &weight.buf, &mut out.buf, x.rows(), hidden, eps)?;
        Ok(out)
    }

    fn fused_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        residual: &mut CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<()> {
        let (rows, hidden) = residual_norm_shape(x, residual, weight)?;
        self.ops.fused_add_rms_norm(
            &mut x.buf,
            &mut residual.buf,
            &weight.buf,
            rows,
            hidden,
            eps,
        )
    }

    fn split_cols(&self, x: &CudaTensor, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        let (rows, cols) = (x.rows(), x.cols());
        ensure!(
            widths.iter().sum::<usize>() == cols,
            "split_cols: widths {widths:?} vs {cols} columns"
        );
        let mut start = 0;
        let mut parts = Vec::with_capacity(widths.len());
        for &w in widths {
            let mut part = self.tensor(vec![rows, w])?;
            self.ops
                .split_cols(&x.buf, &mut part.buf, rows, cols, start, w)?;
            parts.push(part);
            start += w;
        }
        Ok(parts)
    }

    #[allow(clippy::too_many_arguments)]
    fn prepare_qkv(
        &self,
        qkv: &CudaTensor,
        bias: Option<&CudaTensor>,
        heads: &PagedAttentionShape,
        qk_norm: Option<(&CudaTensor, &CudaTensor, f32)>,
        deferred_norm: Option<(&CudaTensor, f32)>,
        positions: &CudaInts,
        cos_sin_cache: &CudaTensor,
        key_cache: &mut CudaTensor,
        value_cache: &mut CudaTensor,
        slot_mapping: &CudaInts,
    ) -> Result<CudaTensor> {
        let t = positions.host.len();
        let (hq, hkv, d) = (heads.num_q_heads, heads.num_kv_heads, heads.head_dim);
        ensure!(
            qkv.rows() == t && qkv.cols() == (hq + 2 * hkv) * d && slot_mapping.host.len() == t,
            "prepare_qkv: qkv {:?} for {t} tokens of {hq} + 2 × {hkv} heads of {d}",
            qkv.shape
        );
        ensure!(
            key_cache.shape[2..].iter().product::<usize>() == hkv * d,
            "prepare_qkv: cache {:?} for {hkv} kv heads of {d}",
            key_cache.shape
        );
        crate::backend::check_rotary_positions(&positions.host, cos_sin_cache.rows())?;
        let num_slots = key_cache.shape[0] * key_cache.shape[1];
        if let Some(&s) = slot_mapping.host.iter().find(|&&s| s >= num_slots as i32) {
            bail!("prepare_qkv: slot {s} outside the cache of {num_slots} slots");
        }
        if let Some((x, _)) = deferred_norm {
            ensure!(
                x.rows() == t,
                "prepare_qkv: input {:?} for {t} tokens",
                x.shape
            );
        }
        let mut q = self.tensor(vec![t, hq * d])?;
        let args = vllm_kernels::cuda::QkvPrepare {
            qkv: &qkv.buf,
            bias: bias.map(|b| &*b.buf),
            q_norm: qk_norm.map(|(w, _, _)| &*w.buf),
            k_norm: qk_norm.map(|(_, w, _)| &*w.buf),
            eps: qk_norm.map_or(0.0, |(_, _, eps)| eps),
            positions: &positions.dev,
            cos_sin: &cos_sin_cache.buf,
            rotary_dim: cos_sin_cache.cols(),
            slot_mapping: &slot_mapping.dev,
            key_cache: &key_cache.buf,
            value_cache: &value_cache.buf,
            num_tokens: t,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            deferred_norm: deferred_norm.map(|(x, eps)| (&*x.buf, x.cols(), eps)),
        };
        self.ops.qkv_prepare(&args, &mut q.buf)?;
        Ok(q)
    }

    fn paged_attention(
        &self,
        q: &CudaTensor,
        key_cache: &CudaTensor,
        value_cache: &CudaTensor,
        meta: &StepMetadata<Self>,
        shape: &PagedAttentionShape,
        scale: f32,
    ) -> Result<CudaTensor> {
        let num_tokens = meta.num_tokens;
        ensure!(
            q.numel() == num_tokens * shape.num_q_heads * shape.head_dim,
            "paged_attention: q {:?} for {num_tokens} tokens",
            q.shape
        );
        let dp = &meta.plan;
        ensure!(
            dp.heads == (shape.num_q_heads, shape.num_kv_heads),
            "paged_attention: {}/{} heads, the step was planned for {:?}",
            shape.num_q_heads,
            shape.num_kv_heads,
            dp.heads
        );
        check_block_tables(meta, shape, key_cache.shape[0])?;
        let mut out = self.tensor(vec![num_tokens, shape.num_q_heads * shape.head_dim])?;
        let am = AttentionMeta {
            block_tables: &meta.block_tables.dev,
            max_blocks_per_seq: shape.max_blocks_per_seq,
            seq_lens: &meta.seq_lens.dev,
            query_start_loc: &meta.query_start_loc.dev,
            tile_seq: &dp.tile_seq,
            tile_token: &dp.tile_token,
            decode_seqs: &dp.decode_seqs,
            step_dims: &dp.step_dims,
            plan: &dp.plan,
        };
        let dims = AttentionDims {
            num_tokens,
            num_q_heads: shape.num_q_heads,
            num_kv_heads: shape.num_kv_heads,
            head_dim: shape.head_dim,
            block_size: shape.block_size,
        };
        self.ops.paged_attention(
            &q.buf,
            &key_cache.buf,
            &value_cache.buf,
            &am,
            dims,
            scale,
            &mut out.buf,
        )?;
        Ok(out)
    }

    fn silu_and_mul(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let d = x.cols() / 2;
        let mut out = self.tensor(vec![x.rows(), d])?;
        self.ops.silu_and_mul(&x.buf, &mut out.buf, x.rows(), d)?;
        Ok(out)
    }

    fn linear_silu_and_mul(&self, x: &CudaTensor, w: &CudaTensor) -> Result<CudaTensor> {
        let (m, k, d) = (x.rows(), x.cols(), w.rows() / 2);
        ensure!(
            w.cols() == k && w.rows().is_multiple_of(2),
            "linear_silu_and_mul: x has {k} columns, gate/up weight {:?}",
            w.shape
        );
        let early_l2 = self.take_early_l2();
        // Decode batches fuse the activation into the GEMM's epilogue (gemv at one row,
        // thin_gemm from two); the output is allocated only then (inside a captured graph
        // an unused one is two more nodes).
        if THIN_GEMM_ROWS.contains(&m) && d.is_multiple_of(2) && self.ops.has_thin_gemm() {
            let mut out = self.tensor(vec![m, d])?;
            if self
                .ops
                .thin_gemm_fits([&x.buf, &w.buf, &out.buf], m, k, 2 * d)
            {
                self.ops
                    .thin_gemm_silu_mul(&x.buf, &w.buf, &mut out.buf, (m, k, d), None)?;
                return Ok(out);
            }
        } else if m <= GEMV_PAYS_MAX_M {
            let kernel = self.gate_up_kernel(x, w, (k, d))?;
            let unfused = kernel == GateUpKernel::Unfused;
            let mut out = self.tensor(vec![m, if unfused { 2 * d } else { d }])?;
            if self.ops.gemv_fits([&x.buf, &w.buf, &out.buf], m, k) {
                if unfused {
                    // A warp a row, never k split over warps: the fused kernels' sums, so
                    // that the three give the same bits.
                    let shape = (m, k, 2 * d);
                    self.ops
                        .gemv_with_rows(&x.buf, &w.buf, &mut out.buf, shape, 1, early_l2)?;
                    return self.silu_and_mul(&out);
                }
                let split = kernel == GateUpKernel::Split;
                self.ops
                    .gemv_silu_mul(&x.buf, &w.buf, &mut out.buf, (k, d), split, early_l2)?;
                return Ok(out);
            }
        }
        self.silu_and_mul(&self.linear_early(x, w, early_l2)?)
    }

    /// At size 1 and in bf16 or f32: in f16 a raw residual's products may pass its 65,504
    /// where the normed ones would not.
    fn folds_norms(&self) -> bool {
        self.comm.is_none() && self.dtype != DType::F16
    }

    /// Where cuBLAS takes the projections: its kernels take no part in PDL, so a norm
    /// between two of them is a whole kernel boundary, which the deferred chain removes
    /// (docs/BENCHMARKS.md, "Norms folded into the projections"). Our own GEMMs below
    /// that chain under PDL and keep the norms.
    fn defers_norms(&self, rows: usize) -> bool {
        let ours_up_to = if self.ops.has_thin_gemm() {
            THIN_GEMM_MAX_M
        } else {
            GEMV_PAYS_MAX_M
        };
        rows > ours_up_to
    }

    fn fold_norm_weight(&self, w: &mut CudaTensor, g: &CudaTensor) -> Result<()> {
        let (rows, cols) = (w.rows(), w.cols());
        ensure!(
            g.numel() == cols,
            "fold_norm_weight: norm of {} for a weight {:?}",
            g.numel(),
            w.shape
        );
        self.ops.scale_cols(&mut w.buf, &g.buf, rows, cols)
    }

    fn linear_add(&self, x: &CudaTensor, w: &CudaTensor, residual: &mut CudaTensor) -> Result<()> {
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        ensure!(
            self.comm.is_none(),
            "linear_add: a row-parallel product is summed over the ranks before the add"
        );
        ensure!(
            w.cols() == k && residual.rows() == m && residual.cols() == n,
            "linear_add: x {:?}, weight {:?}, residual {:?}",
            x.shape,
            w.shape,
            residual.shape
        );
        self.take_early_l2();
        self.gemm
            .linear_add(&x.buf, &w.buf, &mut residual.buf, m, k, n)
    }

    fn linear_rms_silu_and_mul(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (m, d) = (x.rows(), w.rows() / 2);
        let gate_up = self.linear(x, w)?;
        let mut out = self.tensor(vec![m, d])?;
        self.ops
            .silu_and_mul_rms(&gate_up.buf, &x.buf, &mut out.buf, m, (d, x.cols()), eps)?;
        Ok(out)
    }

    fn gather_rows(&self, x: &CudaTensor, indices: &CudaInts) -> Result<CudaTensor> {
        if let Some(&i) = indices
            .host
            .iter()
            .find(|&&i| i < 0 || i as usize >= x.rows())
        {
            bail!("gather_rows: row {i} of {}", x.rows());
        }
        let (n, cols) = (indices.host.len(), x.cols());
        let mut out = self.tensor(vec![n, cols])?;
        self.ops
            .gather_rows(&x.buf, &indices.dev, &mut out.buf, n, cols)?;
        Ok(out)
    }

    fn all_reduce(&self, x: &mut CudaTensor) -> Result<()> {
        match &self.comm {
            Some(c) => {
                self.after_collective.set(true);
                c.all_reduce(x)
            }
            None => Ok(()),
        }
    }

    fn all_reduce_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        residual: &mut CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<()> {
        if let Some(c) = &self.comm {
            residual_norm_shape(x, residual, weight)?;
            if c.all_reduce_add_rms_norm(x, residual, weight, eps)? {
                self.after_collective.set(true);
                return Ok(());
            }
        }
        self.all_reduce(x)?;
        self.fused_add_rms_norm(x, residual, weight, eps)
    }

    fn linear_all_reduce_add_rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        residual: &mut CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        if let Some(out) = self.gemv_all_reduce_add_rms_norm(x, w, residual, weight, eps)? {
            return Ok(out);
        }
        let mut y = self.linear(x, w)?;
        self.all_reduce_add_rms_norm(&mut y, residual, weight, eps)?;
        Ok(y)
    }

    fn all_gather_cols(&self, x: CudaTensor) -> Result<CudaTensor> {
        let Some(comm) = &self.comm else {
            return Ok(x);
        };
        let (rows, cols, n) = (x.rows(), x.cols(), comm.world_size());
        let stacked = comm.all_gather(&x)?;
        if rows == 1 {
            // [n, 1, cols] is already [1, n · cols].
            return Ok(CudaTensor {
                shape: vec![1, n * cols],
                buf: stacked.buf,
            });
        }
        let mut out = self.tensor(vec![rows, n * cols])?;
        let es = self.dtype.size();
        for r in 0..n {
            // Rank r's [rows, cols] block goes to columns r·cols.. of every row.
            self.ops.copy_2d(
                &stacked.buf,
                r * rows * cols * es,
                cols * es,
                &mut out.buf,
                r * cols * es,
                n * cols * es,
                cols * es,
                rows,
            )?;
        }
        Ok(out)
    }
}
