//! Safetensors checkpoints: `model.safetensors`, or the shards that
//! `model.safetensors.index.json` lists, memory-mapped; tensors are borrowed from the map in
//! their stored dtype (bf16, f16 or f32).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::{map_file, DType, WeightTensor};

/// The shard files `model.safetensors.index.json` at `index` names, sorted, each once.
pub fn index_shards(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| anyhow!("{}: missing `weight_map`", index.display()))?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// The memory-mapped files of one checkpoint, and which file holds each tensor.
pub(crate) struct SafetensorsWeights {
    files: Vec<(PathBuf, Mmap)>,
    location: HashMap<String, usize>,
}

impl SafetensorsWeights {
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`,
    /// or else every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index.is_file() {
            index_shards(&index)?
                .into_iter()
                .map(|f| dir.join(f))
                .collect()
        } else if dir.join("model.safetensors").is_file() {
            vec![dir.join("model.safetensors")]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("cannot list {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if paths.is_empty() {
            bail!("no *.safetensors weights in {}", dir.display());
        }
        let mut files = Vec::new();
        let mut location = HashMap::new();
        for path in paths {
            let mmap = map_file(&path)?;
            let st = SafeTensors::deserialize(&mmap)
                .map_err(|e| anyhow!("{} is not a valid safetensors file: {e}", path.display()))?;
            for name in st.names() {
                location.insert(name.to_string(), files.len());
            }
            files.push((path, mmap));
        }
        tracing::debug!(
            tensors = location.len(),
            files = files.len(),
            "opened safetensors checkpoint"
        );
        Ok(Self { files, location })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// Tensor `name`, checked against `expected_shape`, borrowed from the mmap.
    pub fn get(&self, name: &str, expected_shape: &[usize]) -> Result<WeightTensor<'_>> {
        let (files, location) = (&self.files, &self.location);
        let &file = location
            .get(name)
            .ok_or_else(|| anyhow!("checkpoint has no tensor `{name}`"))?;
        let (path, mmap) = &files[file];
        let st = SafeTensors::deserialize(mmap).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let view = st
            .tensor(name)
            .map_err(|e| anyhow!("{}: tensor `{name}`: {e}", path.display()))?;
        if view.shape() != expected_shape {
            bail!(
                "tensor `{name}` has shape {:?}, expected {:?}",
                view.shape(),
                expected_shape
            );
        }
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            other => {
                bail!("tensor `{name}` has unsupported dtype {other:?} (supported: BF16, F16, F32)")
            }
        };
        Ok(WeightTensor::new(
            view.shape().to_vec(),
            dtype,
            Cow::Borrowed(view.data()),
        ))
    }
}
