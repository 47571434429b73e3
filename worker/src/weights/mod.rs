//! Weight loading: `*.safetensors` through mmap, one file or shards listed by
//! `model.safetensors.index.json` (bf16, f16 and f32 tensors), a GGUF file (`gguf`:
//! llama.cpp names and quantizations, mapped to Hugging Face names and dequantized), or
//! random "dummy" weights (`--load-format dummy`) generated from the names and shapes the
//! model asks for.
//!
//! A weight stays in its checkpoint dtype as raw little-endian bytes (`WeightTensor`),
//! borrowed from the mmap until a shard is narrowed or fused; the backend converts it only
//! when its own dtype differs (`Backend::upload_weight`). So a bf16 checkpoint reaches a
//! bf16 GPU as a plain copy of the file's bytes. `HostTensor` (f32) is for everything else:
//! rotary tables, test data, `Backend::to_host`.

mod dummy;
pub mod gguf;
mod safetensors;
mod tensor;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::path::Path;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;

pub use crate::config::LoadFormat;
use crate::model_path::ModelPath;
pub use dummy::{DummyRegion, DUMMY_SEED};
pub use safetensors::index_shards;
use safetensors::SafetensorsWeights;
pub use tensor::{HostTensor, WeightTensor};
pub use vllm_kernels::cuda::DType;

/// Where the model's weights come from: the memory-mapped safetensors files of one
/// checkpoint (and where each tensor lives), a GGUF file, or a seeded generator
/// (`--load-format dummy`).
pub struct Weights {
    source: Source,
}

enum Source {
    Checkpoint(SafetensorsWeights),
    /// Every tensor asked for, generated in `dtype` from `seed` and its name.
    Dummy {
        seed: u64,
        dtype: DType,
    },
    /// A GGUF file, read under Hugging Face names.
    Gguf(gguf::GgufWeights),
}

impl Weights {
    /// The weights of `dir` in `format`: the checkpoint's safetensors or GGUF file
    /// (`auto`), its safetensors (`safetensors`), or random ones generated in `dtype`
    /// (`dummy`, which reads no file).
    pub fn load(dir: &Path, format: LoadFormat, dtype: DType) -> Result<Self> {
        match format {
            LoadFormat::Auto => Self::open(dir),
            LoadFormat::Safetensors => match ModelPath::resolve(dir) {
                Ok(ModelPath::Gguf(file)) => bail!(
                    "--load-format safetensors, but the model is the GGUF file {} (use auto)",
                    file.display()
                ),
                _ => Self::open_safetensors(dir),
            },
            LoadFormat::Dummy => Ok(Self::dummy(DUMMY_SEED, dtype)),
        }
    }

    /// Random weights: each tensor the model asks for is generated from `seed` and its name
    /// (so it is the same whatever the load order), directly in `dtype`.
    pub fn dummy(seed: u64, dtype: DType) -> Self {
        Self {
            source: Source::Dummy { seed, dtype },
        }
    }

    /// Opens the GGUF file `dir` names (`ModelPath`), else the folder's safetensors.
    pub fn open(dir: &Path) -> Result<Self> {
        match ModelPath::resolve(dir) {
            Ok(ModelPath::Gguf(file)) => Ok(Self {
                source: Source::Gguf(gguf::GgufWeights::open(&file)?),
            }),
            _ => Self::open_safetensors(dir),
        }
    }

    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`,
    /// or else every `*.safetensors` in `dir`.
    pub fn open_safetensors(dir: &Path) -> Result<Self> {
        Ok(Self {
            source: Source::Checkpoint(SafetensorsWeights::open(dir)?),
        })
    }

    /// Whether tensor `name` exists (dummy weights have every tensor).
    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Checkpoint(s) => s.contains(name),
            Source::Dummy { .. } => true,
            Source::Gguf(g) => g.contains(name),
        }
    }

    /// Tensor `name` in its checkpoint dtype, checked against `expected_shape` (borrowed
    /// from the mmap), or generated with that shape for dummy weights.
    pub fn get(&self, name: &str, expected_shape: &[usize]) -> Result<WeightTensor<'_>> {
        match &self.source {
            Source::Checkpoint(s) => s.get(name, expected_shape),
            &Source::Dummy { seed, dtype } => {
                Ok(dummy::generate(seed, name, expected_shape, dtype))
            }
            Source::Gguf(g) => g.get(name, expected_shape),
        }
    }
}

/// Maps a checkpoint file (safetensors or GGUF) read-only.
pub(crate) fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the checkpoint is read-only input; like every mmap-based loader we assume no
    // one truncates it while the worker runs.
    unsafe { Mmap::map(&file) }.with_context(|| format!("cannot mmap {}", path.display()))
}
