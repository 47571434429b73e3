//! `GgufWeights`: the tensors of a GGUF file under their Hugging Face names, as the model
//! code asks for them: F32, F16 and BF16 tensors are borrowed from the mmap as they are,
//! quantized ones are dequantized to f32 (the backend then converts to its own dtype), and
//! Llama's q/k projections get llama.cpp's row permutation undone.

use std::borrow::Cow;
use std::path::Path;

use anyhow::{anyhow, bail, Result};

use super::{gguf_name, permuted_heads, unpermute_rows, GgmlType, GgufFile};
use crate::weights::{DType, WeightTensor};

pub struct GgufWeights {
    file: GgufFile,
    /// `(n_head, n_head_kv)` for a Llama file, whose q and k rows were permuted.
    permuted: Option<(usize, usize)>,
}

impl GgufWeights {
    pub fn open(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let permuted = match file.architecture() {
            Some(arch @ "llama") => {
                let heads = file
                    .get_u64(&format!("{arch}.attention.head_count"))
                    .ok_or_else(|| anyhow!("{}: no {arch}.attention.head_count", path.display()))?
                    as usize;
                let kv = file
                    .get_u64(&format!("{arch}.attention.head_count_kv"))
                    .map_or(heads, |v| v as usize);
                Some((heads, kv))
            }
            _ => None,
        };
        tracing::debug!(
            tensors = file.tensors().len(),
            path = %path.display(),
            "opened GGUF checkpoint"
        );
        Ok(Self { file, permuted })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn contains(&self, hf_name: &str) -> bool {
        gguf_name(hf_name).is_some_and(|n| self.file.tensor_info(&n).is_some())
    }

    /// Tensor `hf_name` (a Hugging Face name), checked against `expected_shape`.
    pub fn get(&self, hf_name: &str, expected_shape: &[usize]) -> Result<WeightTensor<'_>> {
        let name = gguf_name(hf_name)
            .ok_or_else(|| anyhow!("checkpoint has no tensor `{hf_name}` (no GGUF name)"))?;
        let info = self
            .file
            .tensor_info(&name)
            .ok_or_else(|| anyhow!("checkpoint has no tensor `{hf_name}` (GGUF `{name}`)"))?;
        let shape = info.shape();
        if shape != expected_shape {
            bail!("tensor `{hf_name}` (GGUF `{name}`) has shape {shape:?}, expected {expected_shape:?}");
        }
        let bytes = self.file.tensor_bytes(info)?;
        let tensor = match info.ggml_type {
            GgmlType::F32 => WeightTensor::new(shape, DType::F32, Cow::Borrowed(bytes)),
            GgmlType::F16 => WeightTensor::new(shape, DType::F16, Cow::Borrowed(bytes)),
            GgmlType::BF16 => WeightTensor::new(shape, DType::BF16, Cow::Borrowed(bytes)),
            ty => {
                let values = super::dequantize(ty, bytes, info.numel())
                    .map_err(|e| anyhow!("tensor `{hf_name}` (GGUF `{name}`): {e}"))?;
                WeightTensor::new(shape, DType::F32, Cow::Owned(DType::F32.encode(&values)))
            }
        };
        let heads = self
            .permuted
            .and_then(|(h, kv)| permuted_heads(hf_name, h, kv));
        match heads {
            None => Ok(tensor),
            Some(heads) => {
                let raw = tensor.bytes();
                let row_bytes = raw.len() / tensor.shape[0].max(1);
                let bytes = unpermute_rows(&raw, row_bytes, heads)
                    .map_err(|e| anyhow!("tensor `{hf_name}`: {e}"))?;
                Ok(WeightTensor::new(
                    tensor.shape,
                    tensor.dtype,
                    Cow::Owned(bytes),
                ))
            }
        }
    }
}
