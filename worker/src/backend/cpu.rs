//! `CpuBackend`: the `Backend` on the host, over `vllm_kernels::cpu`.
//!
//! Serves `--device cpu`, and is the reference the CUDA backend is checked against.
//! Activations, norms, biases and the KV cache are f32. Each 2-D weight is packed at load
//! time for the fast kernels (`cpu::fast`: one thread per core, SIMD picked at run time)
//! in the weight dtype (`--dtype`: f32, bf16 or f16; products are accumulated in f32, and
//! with bf16 weights a layer's input is rounded to bf16 as well, for `vdpbf16ps`), and the
//! MLP's gate/up projection is fused with SiLU·mul. `CpuBackend::reference()`
//! runs the plain reference kernels instead, on dense f32 weights. With a tensor-parallel
//! size above 1, collectives go through the `ShmCommunicator`.

use std::sync::Arc;

use anyhow::{ensure, Result};
use vllm_kernels::cpu as k;
use vllm_kernels::cpu::attention::PagedAttentionShape;
use vllm_kernels::cpu::fast::{self, Isa, PackedMatrix, ThreadPool};

use super::{Backend, StepCapacity, StepInputs, StepMetadata};
use crate::communicator::{Communicator, ShmCommunicator};
use crate::weights::{DType, HostTensor, WeightTensor};

/// A host tensor; `shape[0]` is rows, the product of the rest is columns. Its values are
/// `data` in f32, or (a weight of the fast kernels) `weight`, packed, with `data` empty.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
    weight: Option<Arc<PackedMatrix>>,
}

impl CpuTensor {
    /// An f32 tensor.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        Self {
            shape,
            data,
            weight: None,
        }
    }
    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
    fn matrix(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        Self::new(vec![rows, cols], data)
    }
    /// Output buffers start as NaN so a kernel that skips an element shows up in tests.
    fn poisoned(rows: usize, cols: usize) -> Self {
        Self::matrix(rows, cols, vec![f32::NAN; rows * cols])
    }
    /// The packed weight, if this is one.
    pub fn packed(&self) -> Option<&PackedMatrix> {
        self.weight.as_deref()
    }
    /// The f32 values of a tensor an op reads element by element.
    fn dense(&self) -> Result<&[f32]> {
        ensure!(
            self.weight.is_none(),
            "a packed weight {:?} used where f32 values are needed",
            self.shape
        );
        Ok(&self.data)
    }
}

/// Which kernels run, and in what the fast ones keep weights.
#[derive(Clone)]
enum Kernels {
    /// `vllm_kernels::cpu`'s reference kernels on dense f32 weights.
    Reference,
    Fast {
        weights: DType,
        pool: Arc<ThreadPool>,
        isa: Isa,
    },
}

pub struct CpuBackend {
    /// The tensor-parallel group; `None` at world size 1.
    comm: Option<ShmCommunicator>,
    kernels: Kernels,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A single-rank backend on the fast kernels with f32 weights, one thread per core
    /// (`VLLM_CPU_NUM_THREADS` overrides) and the best SIMD of this CPU (`VLLM_CPU_ISA`
    /// caps it).
    pub fn new() -> Self {
        Self::with_kernels(DType::F32, fast::default_threads(), Isa::detect())
    }

    /// The fast kernels with weights stored in `weights`, on `threads` threads and `isa`.
    pub fn with_kernels(weights: DType, threads: usize, isa: Isa) -> Self {
        Self {
            comm: None,
            kernels: Kernels::Fast {
                weights,
                pool: ThreadPool::shared(threads),
                isa,
            },
        }
    }

    /// A single-rank backend on the plain f32 reference kernels (tests).
    pub fn reference() -> Self {
        Self {
            comm: None,
            kernels: Kernels::Reference,
        }
    }

    /// This backend, its collectives running over `comm`.
    pub fn with_communicator(mut self, comm: ShmCommunicator) -> Self {
        self.comm = Some(comm);
        self
    }

    /// The fast kernels' pool and ISA, if they run.
    fn fast(&self) -> Option<(&ThreadPool, Isa)> {
        match &self.kernels {
            Kernels::Reference => None,
            Kernels::Fast { pool, isa, .. } => Some((pool, *isa)),
        }
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Ints = Vec<i32>;
    type StepPlan = ();

    fn device_name(&self) -> String {
        "cpu".to_string()
    }
    fn dtype_name(&self) -> &'static str {
        self.weight_dtype().name()
    }
    fn kv_cache_element_bytes(&self) -> usize {
        4
    }

    fn upload(&self, t: &HostTensor) -> Result<CpuTensor> {
        Ok(CpuTensor::new(t.shape.clone(), t.data.clone()))
    }
    fn weight_dtype(&self) -> DType {
        match &self.kernels {
            Kernels::Reference => DType::F32,
            Kernels::Fast { weights, .. } => *weights,
        }
    }
    /// Matrices are packed in the weight dtype; vectors (norms, biases) stay f32.
    fn upload_weight(&self, w: &WeightTensor) -> Result<CpuTensor> {
        match (&self.kernels, w.shape.as_slice()) {
            (Kernels::Fast { weights, isa, .. }, &[rows, cols]) => {
                let layout = fast::matmul::bf16_layout_for(*isa);
                let packed =
                    PackedMatrix::from_le_bytes(&w.bytes(), w.dtype, *weights, rows, cols, layout);
                Ok(CpuTensor {
                    shape: w.shape.clone(),
                    data: Vec::new(),
                    weight: Some(Arc::new(packed)),
                })
            }
            _ => Ok(CpuTensor::new(w.shape.clone(), w.to_f32())),
        }
    }
    /// The CPU keeps nothing per step.
    fn reserve_steps(&self, _: StepCapacity, _: usize, _: usize) -> Result<()> {
        Ok(())
    }
    fn upload_step(&self, inputs: &StepInputs) -> Result<StepMetadata<Self>> {
        Ok(StepMetadata {
            plan: (),
            input_ids: inputs.input_ids.clone(),
            positions: inputs.positions.clone(),
            slot_mapping: inputs.slot_mapping.clone(),
            block_tables: inputs.block_tables.clone(),
            seq_lens: inputs.seq_lens.clone(),
            query_start_loc: inputs.query_start_loc.clone(),
            logits_indices: inputs.logits_indices.clone(),
            samples_every_token: inputs.samples_every_token(),
            num_tokens: inputs.num_tokens(),
            num_seqs: inputs.num_seqs(),
            max_blocks_per_seq: inputs.max_blocks_per_seq,
        })
    }
    fn to_host(&self, t: &CpuTensor) -> Result<HostTensor> {
        let data = match t.packed() {
            Some(w) => w.to_f32(),
            None => t.data.clone(),
        };
        Ok(HostTensor::new(t.shape.clone(), data))
    }

    fn alloc_kv_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<CpuTensor> {
        let n = num_blocks * block_size * num_kv_heads * head_dim;
        Ok(CpuTensor::new(
            vec![num_blocks, block_size, num_kv_heads, head_dim],
            vec![0.0; n],
        ))
    }

    fn embedding(
        &self,
        table: &CpuTensor,
        ids: &Vec<i32>,
        vocab_start: usize,
    ) -> Result<CpuTensor> {
        let hidden = table.cols();
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        let mut out = CpuTensor::poisoned(ids.len(), hidden);
        let Some(w) = table.packed() else {
            k::embedding(&ids, &table.data, vocab_start, hidden, &mut out.data);
            return Ok(out);
        };
        // `k::embedding` on the packed table: its row, or zeros outside the shard.
        for (&id, dst) in ids.iter().zip(out.data.chunks_exact_mut(hidden.max(1))) {
            match (id as usize).checked_sub(vocab_start) {
                Some(r) if r < w.rows() => w.row_into(r, dst),
                _ => dst.fill(0.0),
            }
        }
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        let (m, kk, n) = (x.rows(), x.cols(), w.rows());
        ensure!(
            w.cols() == kk,
            "linear: x has {kk} columns, weight {:?}",
            w.shape
        );
        let mut out = CpuTensor::poisoned(m, n);
        match (w.packed(), self.fast()) {
            (Some(pw), Some((pool, isa))) => {
                fast::matmul::linear(x.dense()?, m, pw, None, &mut out.data, pool, isa)
            }
            _ => k::linear(x.dense()?, w.dense()?, None, m, kk, n, &mut out.data),
        }
        Ok(out)
    }

    fn linear_silu_and_mul(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        match (w.packed(), self.fast()) {
            (Some(pw), Some((pool, isa))) if fast::matmul::fuses_silu_and_mul(pw) => {
                let (m, kk) = (x.rows(), x.cols());
                ensure!(
                    pw.cols() == kk,
                    "linear_silu_and_mul: x has {kk} columns, weight {:?}",
                    w.shape
                );
                let mut out = CpuTensor::poisoned(m, pw.rows() / 2);
                fast::matmul::linear_silu_and_mul(x.dense()?, m, pw, &mut out.data, pool, isa);
                Ok(out)
            }
            _ => self.silu_and_mul(&self.linear(x, w)?),
        }
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let mut out = CpuTensor::poisoned(x.rows(), x.cols());
        k::rms_norm(&x.data, &weight.data, eps, &mut out.data);
        Ok(out)
    }

    fn fused_add_rms_norm(
        &self,
        x: &mut CpuTensor,
        residual: &mut CpuTensor,
        weight: &CpuTensor,
        eps: f32,
    ) -> Result<()> {
        k::fused_add_rms_norm(&mut x.data, &mut residual.data, &weight.data, eps);
        Ok(())
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        let (rows, cols) = (x.rows(), x.cols());
        ensure!(
            widths.iter().sum::<usize>() == cols,
            "split_cols: widths {widths:?} vs {cols} columns"
        );
        let mut parts: Vec<CpuTensor> = widths
            .iter()
            .map(|&w| CpuTensor::matrix(rows, w, Vec::with_capacity(rows * w)))
            .collect();
        for row in x.data.chunks_exact(cols.max(1)) {
            let mut start = 0;
            for (p, &w) in parts.iter_mut().zip(widths) {
                p.data.extend_from_slice(&row[start..start + w]);
                start += w;
            }
        }
        Ok(parts)
    }

    #[allow(clippy::too_many_arguments)]
    fn prepare_qkv(
        &self,
        qkv: &CpuTensor,
        bias: Option<&CpuTensor>,
        heads: &PagedAttentionShape,
        qk_norm: Option<(&CpuTensor, &CpuTensor, f32)>,
        deferred_norm: Option<(&CpuTensor, f32)>,
        positions: &Vec<i32>,
        cos_sin_cache: &CpuTensor,
        key_cache: &mut CpuTensor,
        value_cache: &mut CpuTensor,
        slot_mapping: &Vec<i32>,
    ) -> Result<CpuTensor> {
        ensure!(
            deferred_norm.is_none(),
            "the CPU backend folds no norm into a projection"
        );
        let d = heads.head_dim;
        let (q_cols, kv_cols) = (heads.num_q_heads * d, heads.num_kv_heads * d);
        let mut parts = self
            .split_cols(qkv, &[q_cols, kv_cols, kv_cols])?
            .into_iter();
        let (Some(mut q), Some(mut kt), Some(mut v)) = (parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("split_cols returned fewer than 3 parts");
        };
        if let Some(bias) = bias {
            ensure!(
                bias.data.len() == q_cols + 2 * kv_cols,
                "prepare_qkv: a bias of {} for {} columns",
                bias.data.len(),
                q_cols + 2 * kv_cols
            );
            let (bq, bkv) = bias.data.split_at(q_cols);
            let (bk, bv) = bkv.split_at(kv_cols);
            for (part, b) in [(&mut q, bq), (&mut kt, bk), (&mut v, bv)] {
                for row in part.data.chunks_exact_mut(b.len().max(1)) {
                    row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                }
            }
        }
        if let Some((q_weight, k_weight, eps)) = qk_norm {
            k::rms_norm_per_head(&mut q.data, &q_weight.data, eps);
            k::rms_norm_per_head(&mut kt.data, &k_weight.data, eps);
        }
        super::check_rotary_positions(positions, cos_sin_cache.rows())?;
        k::rotary_embedding_neox(
            positions,
            &mut q.data,
            &mut kt.data,
            d,
            &cos_sin_cache.data,
            cos_sin_cache.cols(),
        );
        let kv_row = key_cache.shape[2..].iter().product();
        k::reshape_and_cache(
            &kt.data,
            &v.data,
            &mut key_cache.data,
            &mut value_cache.data,
            slot_mapping,
            kv_row,
        );
        Ok(q)
    }

    fn paged_attention(
        &self,
        q: &CpuTensor,
        key_cache: &CpuTensor,
        value_cache: &CpuTensor,
        meta: &StepMetadata<Self>,
        shape: &PagedAttentionShape,
        scale: f32,
    ) -> Result<CpuTensor> {
        let mut out = CpuTensor::poisoned(q.rows(), q.cols());
        let (q, kc, vc) = (q.dense()?, key_cache.dense()?, value_cache.dense()?);
        match self.fast() {
            Some((pool, isa)) => fast::attention::paged_attention(
                q,
                kc,
                vc,
                &meta.block_tables,
                &meta.seq_lens,
                &meta.query_start_loc,
                shape,
                scale,
                &mut out.data,
                pool,
                isa,
            ),
            None => k::paged_attention(
                q,
                kc,
                vc,
                &meta.block_tables,
                &meta.seq_lens,
                &meta.query_start_loc,
                shape,
                scale,
                &mut out.data,
            ),
        }
        Ok(out)
    }

    fn silu_and_mul(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let d = x.cols() / 2;
        let mut out = CpuTensor::poisoned(x.rows(), d);
        k::silu_and_mul(&x.data, d, &mut out.data);
        Ok(out)
    }

    fn gather_rows(&self, x: &CpuTensor, indices: &Vec<i32>) -> Result<CpuTensor> {
        let cols = x.cols();
        let mut data = Vec::with_capacity(indices.len() * cols);
        for &i in indices {
            ensure!(
                i >= 0 && (i as usize) < x.rows(),
                "gather_rows: row {i} of {}",
                x.rows()
            );
            data.extend_from_slice(&x.data[i as usize * cols..(i as usize + 1) * cols]);
        }
        Ok(CpuTensor::matrix(indices.len(), cols, data))
    }

    fn all_reduce(&self, x: &mut CpuTensor) -> Result<()> {
        match &self.comm {
            Some(c) => c.all_reduce(x),
            None => Ok(()),
        }
    }

    fn all_gather_cols(&self, x: CpuTensor) -> Result<CpuTensor> {
        let Some(comm) = &self.comm else {
            return Ok(x);
        };
        let (rows, cols, n) = (x.rows(), x.cols(), comm.world_size());
        // [n · rows, cols] in rank order → [rows, n · cols].
        let stacked = comm.all_gather(&x)?;
        let mut out = CpuTensor::poisoned(rows, n * cols);
        for (r, part) in stacked.data.chunks_exact((rows * cols).max(1)).enumerate() {
            for (row, src) in part.chunks_exact(cols.max(1)).enumerate() {
                let at = row * n * cols + r * cols;
                out.data[at..at + cols].copy_from_slice(src);
            }
        }
        Ok(out)
    }
}
