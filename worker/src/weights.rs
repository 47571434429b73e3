//! Checkpoint loading: `*.safetensors` through mmap, one file or shards listed by
//! `model.safetensors.index.json`; bf16, f16 and f32 tensors, converted to f32 on the host
//! as they are read (the backend then uploads them in its own dtype).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

/// A tensor on the host in f32, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }

    /// Rows `start..start + len` along dimension 0 or 1 of a 1-D or 2-D tensor (the
    /// tensor-parallel shard of a weight).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> HostTensor {
        match (self.shape.len(), dim) {
            (_, 0) => {
                let row: usize = self.shape[1..].iter().product();
                let mut shape = self.shape.clone();
                shape[0] = len;
                HostTensor::new(shape, self.data[start * row..(start + len) * row].to_vec())
            }
            (2, 1) => {
                let (r, c) = (self.shape[0], self.shape[1]);
                let data = (0..r)
                    .flat_map(|i| {
                        self.data[i * c + start..i * c + start + len]
                            .iter()
                            .copied()
                    })
                    .collect();
                HostTensor::new(vec![r, len], data)
            }
            _ => panic!("narrow: unsupported dim {dim} of shape {:?}", self.shape),
        }
    }

    /// Concatenation along dimension 0 (fusing q/k/v or gate/up).
    pub fn cat_rows(parts: &[HostTensor]) -> HostTensor {
        let mut shape = parts[0].shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        HostTensor::new(
            shape,
            parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
        )
    }
}

/// The memory-mapped safetensors files of one checkpoint and where each tensor lives.
pub struct Weights {
    files: Vec<(PathBuf, Mmap)>,
    location: HashMap<String, usize>,
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the checkpoint is read-only input; like every mmap-based loader we assume no
    // one truncates it while the worker runs.
    unsafe { Mmap::map(&file) }.with_context(|| format!("cannot mmap {}", path.display()))
}

impl Weights {
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`,
    /// or else every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index.is_file() {
            let text = std::fs::read_to_string(&index)
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
            files.into_iter().map(|f| dir.join(f)).collect()
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

    /// Tensor `name` in f32, checked against `expected_shape`.
    pub fn get(&self, name: &str, expected_shape: &[usize]) -> Result<HostTensor> {
        let &file = self
            .location
            .get(name)
            .ok_or_else(|| anyhow!("checkpoint has no tensor `{name}`"))?;
        let (path, mmap) = &self.files[file];
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
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            other => {
                bail!("tensor `{name}` has unsupported dtype {other:?} (supported: BF16, F16, F32)")
            }
        };
        Ok(HostTensor::new(view.shape().to_vec(), data))
    }
}
