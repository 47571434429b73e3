//! `CpuBackend`: the `Backend` over `vllm_kernels::cpu`, everything in f32.
//!
//! Serves `--device cpu` and is the reference the CUDA backend is checked against. With a
//! tensor-parallel size above 1, its collectives go through the `ShmCommunicator`.

use anyhow::{ensure, Result};
use vllm_kernels::cpu as k;
use vllm_kernels::cpu::attention::PagedAttentionShape;

use super::{Backend, StepMetadata};
use crate::communicator::{Communicator, ShmCommunicator};
use crate::weights::{DType, HostTensor, WeightTensor};

/// A host f32 tensor; `shape[0]` is rows, the product of the rest is columns.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl CpuTensor {
    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
    fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
    fn matrix(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        Self {
            shape: vec![rows, cols],
            data,
        }
    }
    /// Output buffers start as NaN so a kernel that skips an element shows up in tests.
    fn poisoned(rows: usize, cols: usize) -> Self {
        Self::matrix(rows, cols, vec![f32::NAN; rows * cols])
    }
}

#[derive(Default)]
pub struct CpuBackend {
    /// The tensor-parallel group; `None` at world size 1.
    comm: Option<ShmCommunicator>,
}

impl CpuBackend {
    /// A single-rank backend.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend whose collectives run over `comm`.
    pub fn with_communicator(comm: ShmCommunicator) -> Self {
        Self { comm: Some(comm) }
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Ints = Vec<i32>;

    fn device_name(&self) -> String {
        "cpu".to_string()
    }
    fn dtype_name(&self) -> &'static str {
        "float32"
    }
    fn kv_cache_element_bytes(&self) -> usize {
        4
    }

    fn upload(&self, t: &HostTensor) -> Result<CpuTensor> {
        Ok(CpuTensor {
            shape: t.shape.clone(),
            data: t.data.clone(),
        })
    }
    fn weight_dtype(&self) -> DType {
        DType::F32
    }
    fn upload_weight(&self, w: &WeightTensor) -> Result<CpuTensor> {
        Ok(CpuTensor {
            shape: w.shape.clone(),
            data: w.to_f32(),
        })
    }
    fn upload_ints(&self, data: &[i32]) -> Result<Vec<i32>> {
        Ok(data.to_vec())
    }
    fn to_host(&self, t: &CpuTensor) -> Result<HostTensor> {
        Ok(HostTensor::new(t.shape.clone(), t.data.clone()))
    }

    fn alloc_kv_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<CpuTensor> {
        let n = num_blocks * block_size * num_kv_heads * head_dim;
        Ok(CpuTensor {
            shape: vec![num_blocks, block_size, num_kv_heads, head_dim],
            data: vec![0.0; n],
        })
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
        k::embedding(&ids, &table.data, vocab_start, hidden, &mut out.data);
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        let (m, kk, n) = (x.rows(), x.cols(), w.rows());
        ensure!(
            w.cols() == kk,
            "linear: x has {kk} columns, weight {:?}",
            w.shape
        );
        let mut out = CpuTensor::poisoned(m, n);
        k::linear(
            &x.data,
            &w.data,
            bias.map(|b| b.data.as_slice()),
            m,
            kk,
            n,
            &mut out.data,
        );
        Ok(out)
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

    fn rms_norm_per_head(&self, x: &mut CpuTensor, weight: &CpuTensor, eps: f32) -> Result<()> {
        k::rms_norm_per_head(&mut x.data, &weight.data, eps);
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

    fn rotary_embedding(
        &self,
        positions: &Vec<i32>,
        q: &mut CpuTensor,
        kt: &mut CpuTensor,
        head_dim: usize,
        cos_sin_cache: &CpuTensor,
    ) -> Result<()> {
        let rotary_dim = cos_sin_cache.cols();
        super::check_rotary_positions(positions, cos_sin_cache.rows())?;
        k::rotary_embedding_neox(
            positions,
            &mut q.data,
            &mut kt.data,
            head_dim,
            &cos_sin_cache.data,
            rotary_dim,
        );
        Ok(())
    }

    fn reshape_and_cache(
        &self,
        key: &CpuTensor,
        value: &CpuTensor,
        key_cache: &mut CpuTensor,
        value_cache: &mut CpuTensor,
        slot_mapping: &Vec<i32>,
    ) -> Result<()> {
        let kv_row = key_cache.shape[2..].iter().product();
        k::reshape_and_cache(
            &key.data,
            &value.data,
            &mut key_cache.data,
            &mut value_cache.data,
            slot_mapping,
            kv_row,
        );
        Ok(())
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
        k::paged_attention(
            &q.data,
            &key_cache.data,
            &value_cache.data,
            &meta.block_tables,
            &meta.seq_lens,
            &meta.query_start_loc,
            shape,
            scale,
            &mut out.data,
        );
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
