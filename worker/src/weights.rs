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

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use vllm_kernels::cuda::dtype::par_blocks;

pub use crate::config::LoadFormat;
use crate::model_path::ModelPath;
pub use dummy::{DummyRegion, DUMMY_SEED};
pub use vllm_kernels::cuda::DType;

/// Bytes per block of the parallel copies that fuse weights.
const COPY_BLOCK: usize = 1 << 20;

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

/// A weight as little-endian bytes of `dtype`, row-major: borrowed from the checkpoint's
/// mmap where possible, owned once narrowed along columns or fused, or (dummy weights) not
/// drawn yet.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightTensor<'a> {
    pub shape: Vec<usize>,
    pub dtype: DType,
    data: WeightData<'a>,
}

#[derive(Debug, Clone, PartialEq)]
enum WeightData<'a> {
    Bytes(Cow<'a, [u8]>),
    /// Dummy values, drawn only when the bytes are asked for (or on the GPU by the CUDA
    /// backend): row blocks stacked in order.
    Dummy(Vec<DummyRegion>),
}

impl<'a> WeightTensor<'a> {
    pub fn new(shape: Vec<usize>, dtype: DType, bytes: Cow<'a, [u8]>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>() * dtype.size(), bytes.len());
        Self {
            shape,
            dtype,
            data: WeightData::Bytes(bytes),
        }
    }

    fn dummy(shape: Vec<usize>, dtype: DType, regions: Vec<DummyRegion>) -> Self {
        Self {
            shape,
            dtype,
            data: WeightData::Dummy(regions),
        }
    }

    /// `t` encoded in `dtype` (tests, and f32 data that must go through `upload_weight`).
    pub fn from_host(t: &HostTensor, dtype: DType) -> WeightTensor<'static> {
        WeightTensor::new(t.shape.clone(), dtype, Cow::Owned(dtype.encode(&t.data)))
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The regions of a dummy weight not drawn yet, stacked by rows.
    pub fn dummy_regions(&self) -> Option<&[DummyRegion]> {
        match &self.data {
            WeightData::Dummy(regions) => Some(regions),
            WeightData::Bytes(_) => None,
        }
    }

    /// The raw bytes in `self.dtype` (a dummy weight is drawn now).
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        match &self.data {
            WeightData::Bytes(b) => Cow::Borrowed(b),
            WeightData::Dummy(regions) => Cow::Owned(dummy::draw(regions, self.dtype)),
        }
    }

    /// The values in f32 (converted in parallel chunks).
    pub fn to_f32(&self) -> Vec<f32> {
        self.dtype.decode(&self.bytes())
    }

    pub fn to_host(&self) -> HostTensor {
        HostTensor::new(self.shape.clone(), self.to_f32())
    }

    /// The bytes in `dtype`: these very bytes when the dtype is already `dtype`, else a
    /// parallel conversion.
    pub fn bytes_as(&self, dtype: DType) -> Cow<'_, [u8]> {
        let bytes = self.bytes();
        if self.dtype == dtype {
            bytes
        } else {
            Cow::Owned(self.dtype.convert(&bytes, dtype))
        }
    }

    /// Rows `start..start + len` along dimension 0 or 1 of a 1-D or 2-D tensor (the
    /// tensor-parallel shard of a weight), cut from the raw bytes. Along dimension 0 the
    /// shard of a borrowed tensor is still borrowed.
    pub fn narrow(self, dim: usize, start: usize, len: usize) -> WeightTensor<'a> {
        if let WeightData::Dummy(regions) = &self.data {
            let regions = dummy::narrow(regions, &self.shape, dim, start, len);
            let mut shape = self.shape;
            shape[dim] = len;
            return WeightTensor::dummy(shape, self.dtype, regions);
        }
        let es = self.dtype.size();
        match (self.shape.len(), dim) {
            (_, 0) => {
                assert!(
                    start + len <= self.shape[0],
                    "narrow: rows {start}..{} of shape {:?}",
                    start + len,
                    self.shape
                );
                if start == 0 && len == self.shape[0] {
                    return self;
                }
                let row: usize = self.shape[1..].iter().product::<usize>() * es;
                let mut shape = self.shape;
                shape[0] = len;
                let range = start * row..(start + len) * row;
                let bytes = match self.data {
                    WeightData::Bytes(Cow::Borrowed(b)) => Cow::Borrowed(&b[range]),
                    WeightData::Bytes(Cow::Owned(b)) => Cow::Owned(b[range].to_vec()),
                    WeightData::Dummy(_) => unreachable!("handled above"),
                };
                WeightTensor::new(shape, self.dtype, bytes)
            }
            (2, 1) => {
                let (r, c) = (self.shape[0], self.shape[1]);
                assert!(
                    start + len <= c,
                    "narrow: columns {start}..{} of shape {:?}",
                    start + len,
                    self.shape
                );
                if start == 0 && len == c {
                    return self;
                }
                let mut out = Vec::with_capacity(r * len * es);
                for row in self.bytes().chunks_exact(c * es) {
                    out.extend_from_slice(&row[start * es..(start + len) * es]);
                }
                WeightTensor::new(vec![r, len], self.dtype, Cow::Owned(out))
            }
            _ => panic!("narrow: unsupported dim {dim} of shape {:?}", self.shape),
        }
    }

    /// Concatenation along dimension 0 (fusing q/k/v or gate/up) of the raw bytes; parts
    /// of different dtypes (a mixed checkpoint) meet in f32. One part is returned as is.
    pub fn cat_rows(mut parts: Vec<WeightTensor<'a>>) -> WeightTensor<'a> {
        assert!(!parts.is_empty(), "cat_rows of no tensors");
        if parts.len() == 1 {
            return parts.pop().unwrap_or_else(|| unreachable!());
        }
        let mut shape = parts[0].shape.clone();
        assert!(
            parts.iter().all(|p| p.shape[1..] == shape[1..]),
            "cat_rows: mismatched shapes {:?}",
            parts.iter().map(|p| &p.shape).collect::<Vec<_>>()
        );
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        if parts.iter().all(|p| p.dtype == parts[0].dtype) {
            if let Some(regions) = parts
                .iter()
                .map(|p| p.dummy_regions().map(<[_]>::to_vec))
                .collect::<Option<Vec<_>>>()
            {
                return WeightTensor::dummy(shape, parts[0].dtype, regions.concat());
            }
        }
        let dtype = if parts.iter().all(|p| p.dtype == parts[0].dtype) {
            parts[0].dtype
        } else {
            DType::F32
        };
        let total = parts.iter().map(|p| p.numel()).sum::<usize>() * dtype.size();
        // Zeroed pages are mapped lazily, so the parallel copy also spreads the faults.
        let mut out = vec![0u8; total];
        let mut rest = out.as_mut_slice();
        for p in &parts {
            let src = p.bytes_as(dtype);
            let (dst, tail) = rest.split_at_mut(src.len());
            par_blocks(dst, COPY_BLOCK, |i, d| {
                d.copy_from_slice(&src[i * COPY_BLOCK..i * COPY_BLOCK + d.len()])
            });
            rest = tail;
        }
        WeightTensor::new(shape, dtype, Cow::Owned(out))
    }
}

/// Where the model's weights come from: the memory-mapped safetensors files of one
/// checkpoint (and where each tensor lives), a GGUF file, or a seeded generator
/// (`--load-format dummy`).
pub struct Weights {
    source: Source,
}

enum Source {
    Checkpoint {
        files: Vec<(PathBuf, Mmap)>,
        location: HashMap<String, usize>,
    },
    /// Every tensor asked for, generated in `dtype` from `seed` and its name.
    Dummy { seed: u64, dtype: DType },
    /// A GGUF file, read under Hugging Face names.
    Gguf(gguf::GgufWeights),
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the checkpoint is read-only input; like every mmap-based loader we assume no
    // one truncates it while the worker runs.
    unsafe { Mmap::map(&file) }.with_context(|| format!("cannot mmap {}", path.display()))
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
        Ok(Self {
            source: Source::Checkpoint { files, location },
        })
    }

    /// Whether tensor `name` exists (dummy weights have every tensor).
    pub fn contains(&self, name: &str) -> bool {
        match &self.source {
            Source::Checkpoint { location, .. } => location.contains_key(name),
            Source::Dummy { .. } => true,
            Source::Gguf(g) => g.contains(name),
        }
    }

    /// Tensor `name` in its checkpoint dtype, checked against `expected_shape` (borrowed
    /// from the mmap), or generated with that shape for dummy weights.
    pub fn get(&self, name: &str, expected_shape: &[usize]) -> Result<WeightTensor<'_>> {
        let (files, location) = match &self.source {
            Source::Checkpoint { files, location } => (files, location),
            &Source::Dummy { seed, dtype } => {
                return Ok(dummy::generate(seed, name, expected_shape, dtype))
            }
            Source::Gguf(g) => return g.get(name, expected_shape),
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Backend, CpuBackend};
    use crate::tiny_model::{write_safetensors, TinyDtype};

    fn host(shape: Vec<usize>, seed: u32) -> HostTensor {
        let n = shape.iter().product();
        let data = (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect();
        HostTensor::new(shape, data)
    }

    /// `t` rounded through `dtype`, as the f32 path saw a checkpoint of that dtype.
    fn rounded(t: &HostTensor, dtype: DType) -> HostTensor {
        HostTensor::new(
            t.shape.clone(),
            t.data.iter().map(|&v| dtype.round(v)).collect(),
        )
    }

    #[test]
    fn raw_narrow_and_cat_equal_the_f32_path() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let a = host(vec![12, 10], 1);
            let b = host(vec![5, 10], 2);
            let (ra, rb) = (rounded(&a, dtype), rounded(&b, dtype));
            let wa = WeightTensor::from_host(&a, dtype);
            let wb = WeightTensor::from_host(&b, dtype);
            assert_eq!(wa.to_host(), ra);

            assert_eq!(wa.clone().narrow(0, 3, 4).to_host(), ra.narrow(0, 3, 4));
            assert_eq!(wa.clone().narrow(1, 2, 5).to_host(), ra.narrow(1, 2, 5));
            assert_eq!(wa.clone().narrow(0, 0, 12), wa);
            let bias = host(vec![9], 3);
            assert_eq!(
                WeightTensor::from_host(&bias, dtype)
                    .narrow(0, 4, 5)
                    .to_host(),
                rounded(&bias, dtype).narrow(0, 4, 5)
            );

            let cat =
                WeightTensor::cat_rows(vec![wa.clone().narrow(0, 1, 3), wb.clone(), wa.clone()]);
            assert_eq!(cat.dtype, dtype);
            assert_eq!(
                cat.to_host(),
                HostTensor::cat_rows(&[ra.narrow(0, 1, 3), rb.clone(), ra.clone()])
            );
            assert_eq!(WeightTensor::cat_rows(vec![wb.clone()]), wb);
        }
        // Parts over several copy blocks.
        let (a, b) = (host(vec![1000, 700], 7), host(vec![300, 700], 8));
        let cat = WeightTensor::cat_rows(vec![
            WeightTensor::from_host(&a, DType::BF16),
            WeightTensor::from_host(&b, DType::BF16),
        ]);
        assert_eq!(
            cat.to_host(),
            HostTensor::cat_rows(&[rounded(&a, DType::BF16), rounded(&b, DType::BF16)])
        );
        // Parts of different dtypes meet in f32.
        let a = host(vec![2, 3], 4);
        let mixed = WeightTensor::cat_rows(vec![
            WeightTensor::from_host(&a, DType::BF16),
            WeightTensor::from_host(&a, DType::F32),
        ]);
        assert_eq!(mixed.dtype, DType::F32);
        assert_eq!(
            mixed.to_host(),
            HostTensor::cat_rows(&[rounded(&a, DType::BF16), a.clone()])
        );
    }

    #[test]
    fn bf16_checkpoint_bytes_pass_through_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let a = host(vec![8, 6], 5);
        let tensors = vec![("w".to_string(), a.shape.clone(), a.data.clone())];
        write_safetensors(
            &dir.path().join("model.safetensors"),
            &tensors,
            TinyDtype::BF16,
        )
        .unwrap();
        let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        let weights = Weights::open(dir.path()).unwrap();
        let w = weights.get("w", &[8, 6]).unwrap();
        assert_eq!(w.dtype, DType::BF16);
        let expected = DType::BF16.encode(&a.data);
        assert_eq!(w.bytes().as_ref(), expected.as_slice());
        // Borrowed from the mmap, not copied: the same bytes end the file.
        assert!(matches!(w.bytes(), Cow::Borrowed(_)));
        assert!(file.ends_with(&expected));
        assert!(matches!(w.bytes_as(DType::BF16), Cow::Borrowed(b) if b == expected.as_slice()));
        let rows = w.clone().narrow(0, 2, 3);
        assert!(matches!(rows.bytes(), Cow::Borrowed(_)));
        assert_eq!(rows.bytes().as_ref(), &expected[2 * 6 * 2..5 * 6 * 2]);
        // Converted only when asked for another dtype; the CPU backend gets f32.
        assert_eq!(
            w.bytes_as(DType::F32).as_ref(),
            DType::F32.encode(&rounded(&a, DType::BF16).data).as_slice()
        );
        let cpu = CpuBackend::new();
        let t = cpu.upload_weight(&w).unwrap();
        assert_eq!(cpu.to_host(&t).unwrap(), rounded(&a, DType::BF16));
    }

    #[test]
    fn loader_errors_name_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", Weights::open(dir.path()).err().unwrap());
        assert!(err.contains("no *.safetensors weights"), "{err}");
        // Dummy weights read no file.
        let dummy = Weights::load(dir.path(), LoadFormat::Dummy, DType::BF16).unwrap();
        assert!(dummy.contains("anything"));
        assert_eq!(dummy.get("x.weight", &[3, 4]).unwrap().shape, [3, 4]);
        assert!(Weights::load(dir.path(), LoadFormat::Auto, DType::BF16).is_err());

        let a = host(vec![4, 2], 6);
        let tensors = vec![("w".to_string(), a.shape.clone(), a.data.clone())];
        write_safetensors(
            &dir.path().join("model.safetensors"),
            &tensors,
            TinyDtype::F16,
        )
        .unwrap();
        let weights = Weights::load(dir.path(), LoadFormat::Safetensors, DType::F32).unwrap();
        let err = weights.get("v", &[4, 2]).err().unwrap().to_string();
        assert!(err.contains("checkpoint has no tensor `v`"), "{err}");
        let err = weights.get("w", &[2, 4]).err().unwrap().to_string();
        assert!(err.contains("has shape [4, 2], expected [2, 4]"), "{err}");
        assert_eq!(weights.get("w", &[4, 2]).unwrap().dtype, DType::F16);

        let ints: Vec<u8> = (0..8i32).flat_map(|i| i.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::I32, vec![8], &ints).unwrap();
        safetensors::serialize_to_file(
            vec![("i".to_string(), view)],
            None,
            &dir.path().join("model.safetensors"),
        )
        .unwrap();
        let weights = Weights::open(dir.path()).unwrap();
        let err = weights.get("i", &[8]).err().unwrap().to_string();
        assert!(err.contains("unsupported dtype I32"), "{err}");
    }

    #[test]
    fn a_model_loads_from_dummy_weights_and_runs() {
        use crate::config::Architecture;
        use crate::layers::TensorParallel;
        use crate::models::{variant_for, LlamaForCausalLM};
        use crate::tiny_model::{write_tiny_model, TinyModelSpec};
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(dir.path(), &TinyModelSpec::tiny(Architecture::Qwen2)).unwrap();
        std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
        let cfg = crate::config::ModelConfig::from_model_dir(dir.path()).unwrap();
        let b = CpuBackend::new();
        let weights = Weights::load(dir.path(), LoadFormat::Dummy, b.weight_dtype()).unwrap();
        let load = || {
            LlamaForCausalLM::load(
                &b,
                &weights,
                &cfg,
                variant_for(&cfg),
                TensorParallel::SINGLE,
                16,
                |_| {},
            )
        };
        assert!(load().is_ok());
        let err = match Weights::load(dir.path(), LoadFormat::Auto, b.weight_dtype()) {
            Ok(_) => panic!("loaded weights from a folder without any"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("no *.safetensors weights"), "{err}");
    }
}
