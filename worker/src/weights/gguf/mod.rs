//! GGUF checkpoints (llama.cpp's single-file format): `GgufFile` opens one by mmap and
//! answers for its metadata and tensors; the submodules hold the layout parser, the value
//! and tensor types, dequantization, the Hugging Face ↔ llama.cpp tensor names, the model
//! config read from metadata, the tensor source `Weights` draws from, and a small writer
//! for tests.

mod dequant;
mod ggml_type;
mod model_config;
mod names;
mod reader;
mod source;
mod value;
mod writer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use memmap2::Mmap;

pub use dequant::dequantize;
pub use ggml_type::GgmlType;
pub use names::{gguf_name, permuted_heads, unpermute_rows};
pub use reader::{GgufError, TensorInfo, DEFAULT_ALIGNMENT};
pub use source::GgufWeights;
pub use value::{MetadataValue, ValueType};
pub use writer::GgufWriter;

/// One memory-mapped GGUF file: its metadata, tensor infos and tensor data.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    layout: reader::Layout,
    index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.layout.version)
            .field("tensors", &self.layout.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Maps and parses `path`; errors name the file and what is wrong with it.
    pub fn open(path: &Path) -> Result<Self> {
        let mmap = super::map_file(path)?;
        let layout = reader::parse(&mmap).with_context(|| format!("{}", path.display()))?;
        let index = layout
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            layout,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.layout.version
    }

    pub fn alignment(&self) -> u64 {
        self.layout.alignment
    }

    /// Metadata keys in file order.
    pub fn keys(&self) -> &[String] {
        &self.layout.keys
    }

    pub fn metadata(&self, key: &str) -> Option<&MetadataValue> {
        self.layout.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.metadata(key).and_then(MetadataValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.metadata(key).and_then(MetadataValue::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.metadata(key).and_then(MetadataValue::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.metadata(key).and_then(MetadataValue::as_bool)
    }

    /// `general.architecture` ("llama", "qwen2", …).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.layout.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.layout.tensors[i])
    }

    /// The raw bytes of tensor `info` in the mmap (checked to lie inside the file when it
    /// was opened); an error for a type of unknown layout.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        let size = info.ggml_type.bytes_for(info.numel()).ok_or_else(|| {
            anyhow!(
                "tensor `{}`: unsupported GGUF tensor type {}",
                info.name,
                info.ggml_type.name()
            )
        })?;
        let start = self.layout.data_offset + info.offset as usize;
        Ok(&self.mmap[start..start + size])
    }

    /// Tensor `name` dequantized to f32, with its row-major shape.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| anyhow!("{} has no tensor `{name}`", self.path.display()))?;
        let bytes = self.tensor_bytes(info)?;
        let data = dequantize(info.ggml_type, bytes, info.numel())
            .map_err(|e| anyhow!("tensor `{name}`: {e}"))?;
        Ok((info.shape(), data))
    }
}

#[cfg(test)]
mod tests;
