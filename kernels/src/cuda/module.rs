//! Building and loading the kernel module of one dtype: the cache lookup, the NVRTC compile
//! on a miss, the driver load, and the table of kernel functions.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::attention_plan::HEAD_DIMS;
use super::device::{driver_error, CudaDevice};
use super::dtype::DType;
use super::thin_gemm::THIN_GEMM_BLOCK_ROWS;
use super::{cache, nvrtc, sources};

/// Every kernel of `csrc/`: `F` is the loaded `CudaFunction`, or whatever a caller that
/// only checks the names (the NVRTC test) makes of each one.
pub struct Functions<F = CudaFunction> {
    pub embedding: F,
    pub rms_norm: F,
    pub fused_add_rms_norm: F,
    pub rms_norm_per_head: F,
    pub scale_cols: F,
    pub rotary_embedding_neox: F,
    pub silu_and_mul: F,
    pub silu_and_mul_rms: F,
    pub reshape_and_cache: F,
    pub qkv_prepare: F,
    pub qkv_prepare_wide: F,
    pub qkv_prepare_wide_token: F,
    pub split_cols: F,
    pub gather_rows: F,
    pub fill: F,
    pub dummy_fill: F,
    /// `gemv_m{M}_r{R}`, indexed by M - 1 (1..=8 rows of x), then R - 1 (1 or 2 rows of
    /// w per warp).
    pub gemv: [[F; 2]; 8],
    /// `gemv_m1_k{S}`, indexed by log2(S) - 1 (each row's k split over S = 2 or 4 warps).
    pub gemv_split_k: [F; 2],
    /// The gate/up product fused with SiLU-and-mul, one row of x.
    pub gemv_silu_mul_m1: F,
    pub gemv_silu_mul_split_m1: F,
    /// Indexed by head size (`HEAD_DIMS`).
    pub paged_attention: [F; 4],
    pub paged_attention_combine: F,
    /// The decode kernel by head size (16, 32, 64, 128), then GQA group (1, 2, 4, 8).
    pub paged_attention_decode: [[F; 4]; 4],
    /// The group of 8's decode kernel at head size 128 for large grids (four blocks an SM).
    pub paged_attention_decode_d128_g8_occ4: F,
    pub paged_attention_decode_combine: F,
    /// The tensor-core prefill kernel by head size, and its d128 kernel at two blocks an SM
    /// (`_d128_occ2`); bf16 and fp16 modules only.
    pub paged_attention_prefill: Option<([F; 4], F)>,
    /// `thin_gemm_m{BM}` and `thin_gemm_silu_m{BM}` by `THIN_GEMM_BLOCK_ROWS`; bf16 and
    /// fp16 modules only.
    pub thin_gemm: Option<([F; 2], [F; 2])>,
    pub sample_tokens_ex: F,
    pub sample_fast_max: F,
    pub sample_fast_max_race: F,
    pub sample_fast_draw: F,
    pub sample_fast_top: F,
    pub sample_fast_draw_top: F,
    /// The one-shot all-reduce over peer memory (custom_all_reduce.rs).
    pub custom_all_reduce: F,
    pub custom_all_reduce_add_rms_norm: F,
    /// A one-token gemv that sends its outputs to the ranks, and their sum with the norm.
    pub gemv_m1_all_reduce_send: F,
    pub custom_all_reduce_rows_add_rms_norm: F,
}

/// `each` of `items`, in order, as an array: a family of kernels instantiated for each
/// value of a template parameter.
fn family<I, T, const N: usize>(items: [I; N], each: impl FnMut(I) -> Result<T>) -> Result<[T; N]> {
    let found = items.into_iter().map(each).collect::<Result<Vec<T>>>()?;
    found
        .try_into()
        .map_err(|_| anyhow::anyhow!("a kernel family lost a member"))
}

impl<F> Functions<F> {
    /// Every kernel of the `dtype` module, each obtained from `lookup` by its
    /// `extern "C"` name: the one list of names that loading and the NVRTC test share.
    pub fn lookup(dtype: DType, mut f: impl FnMut(&str) -> Result<F>) -> Result<Self> {
        Ok(Self {
            embedding: f("embedding")?,
            rms_norm: f("rms_norm")?,
            fused_add_rms_norm: f("fused_add_rms_norm")?,
            rms_norm_per_head: f("rms_norm_per_head")?,
            scale_cols: f("scale_cols")?,
            rotary_embedding_neox: f("rotary_embedding_neox")?,
            silu_and_mul: f("silu_and_mul")?,
            silu_and_mul_rms: f("silu_and_mul_rms")?,
            reshape_and_cache: f("reshape_and_cache")?,
            qkv_prepare: f("qkv_prepare")?,
            qkv_prepare_wide: f("qkv_prepare_wide")?,
            qkv_prepare_wide_token: f("qkv_prepare_wide_token")?,
            split_cols: f("split_cols")?,
            gather_rows: f("gather_rows")?,
            fill: f("fill")?,
            dummy_fill: f("dummy_fill")?,
            gemv: family([1, 2, 3, 4, 5, 6, 7, 8], |m| {
                family([1, 2], |r| f(&format!("gemv_m{m}_r{r}")))
            })?,
            gemv_split_k: family([2, 4], |s| f(&format!("gemv_m1_k{s}")))?,
            gemv_silu_mul_m1: f("gemv_silu_mul_m1")?,
            gemv_silu_mul_split_m1: f("gemv_silu_mul_split_m1")?,
            paged_attention: family(HEAD_DIMS, |d| f(&format!("paged_attention_d{d}")))?,
            paged_attention_combine: f("paged_attention_combine")?,
            // By head size, then padded GQA group.
            paged_attention_decode: family(HEAD_DIMS, |d| {
                family([1, 2, 4, 8], |g| {
                    f(&format!("paged_attention_decode_d{d}_g{g}"))
                })
            })?,
            paged_attention_decode_d128_g8_occ4: f("paged_attention_decode_d128_g8_occ4")?,
            paged_attention_decode_combine: f("paged_attention_decode_combine")?,
            paged_attention_prefill: match dtype {
                DType::F32 => None,
                _ => Some((
                    family(HEAD_DIMS, |d| f(&format!("paged_attention_prefill_d{d}")))?,
                    f("paged_attention_prefill_d128_occ2")?,
                )),
            },
            thin_gemm: match dtype {
                DType::F32 => None,
                _ => Some((
                    family(THIN_GEMM_BLOCK_ROWS, |bm| f(&format!("thin_gemm_m{bm}")))?,
                    family(THIN_GEMM_BLOCK_ROWS, |bm| {
                        f(&format!("thin_gemm_silu_m{bm}"))
                    })?,
                )),
            },
            sample_tokens_ex: f("sample_tokens_ex")?,
            sample_fast_max: f("sample_fast_max")?,
            sample_fast_max_race: f("sample_fast_max_race")?,
            sample_fast_draw: f("sample_fast_draw")?,
            sample_fast_top: f("sample_fast_top")?,
            sample_fast_draw_top: f("sample_fast_draw_top")?,
            custom_all_reduce: f("custom_all_reduce")?,
            custom_all_reduce_add_rms_norm: f("custom_all_reduce_add_rms_norm")?,
            gemv_m1_all_reduce_send: f("gemv_m1_all_reduce_send")?,
            custom_all_reduce_rows_add_rms_norm: f("custom_all_reduce_rows_add_rms_norm")?,
        })
    }
}

/// How the module was obtained (logged, and reported by the startup benchmark).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildSource {
    Cache,
    Compiled,
}

/// NVRTC options of one build: architecture, dtype, and precise math (the CPU reference
/// is the judge, so no fast-math). The optimiser runs on 8 threads: a fixed count, so
/// that every machine builds the same CUBIN (docs/CUDA_NOTES.md).
pub fn compile_options(arch: &str, dtype: DType) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
        "--split-compile=8".to_string(),
        dtype.define().to_string(),
    ]
}

/// A CUBIN of the kernels and where the kernel cache keeps it.
pub struct Cubin {
    pub bytes: Vec<u8>,
    pub source: BuildSource,
    pub path: PathBuf,
    /// Why a fresh compile is not in the cache (None: it was stored, or read from it).
    pub store_error: Option<std::io::Error>,
}

/// The CUBIN of `dtype` for `arch`, from the kernel cache (`cache::cache_dir`) or freshly
/// compiled (and then cached).
pub fn cubin(arch: &str, dtype: DType) -> Result<Cubin> {
    cubin_in(&cache::cache_dir(), arch, dtype)
}

/// The same with the cache in `dir`. Needs NVRTC only, no GPU: `vllm-rs compile-kernels`
/// fills a cache ahead of a server's first start.
pub fn cubin_in(dir: &Path, arch: &str, dtype: DType) -> Result<Cubin> {
    let tu = sources::translation_unit();
    let options = compile_options(arch, dtype);
    let (major, minor) = nvrtc::version()?;
    let nvrtc_version = format!("{major}.{minor}");
    let joined = options.join(" ");
    let key = cache::fnv1a(&[tu.as_bytes(), joined.as_bytes(), nvrtc_version.as_bytes()]);
    let path = cache::entry_path(dir, &format!("{arch}-{}", dtype.name()), key);
    if let Some(bytes) = cache::load(&path) {
        tracing::debug!(path = %path.display(), "kernel cache hit");
        return Ok(Cubin {
            bytes,
            source: BuildSource::Cache,
            path,
            store_error: None,
        });
    }
    let started = Instant::now();
    let bytes = nvrtc::compile_cubin(&tu, "vllm_kernels.cu", &options)?;
    tracing::info!(
        arch,
        dtype = dtype.name(),
        seconds = started.elapsed().as_secs_f32(),
        cache = %path.display(),
        "compiled CUDA kernels with NVRTC"
    );
    let store_error = cache::store(&path, &bytes).err();
    Ok(Cubin {
        bytes,
        source: BuildSource::Compiled,
        path,
        store_error,
    })
}

/// Loads the module of `dtype` on `dev` and looks up every kernel.
pub fn load(dev: &CudaDevice, dtype: DType) -> Result<(Arc<CudaModule>, Functions, BuildSource)> {
    let Cubin {
        bytes,
        source,
        path,
        store_error,
    } = cubin(&dev.arch(), dtype)?;
    if let Some(e) = store_error {
        // Only the next start pays: it compiles again.
        tracing::warn!(path = %path.display(), "cannot write the kernel cache: {e}");
    }
    let module = dev
        .ctx
        .load_module(Ptx::from_binary(bytes))
        .map_err(|e| driver_error("loading the kernel CUBIN", e))?;
    let functions = Functions::lookup(dtype, |name| {
        module
            .load_function(name)
            .map_err(|e| driver_error(&format!("looking up kernel {name}"), e))
            .context("the kernel cache may be stale: delete it (see VLLM_RS_KERNEL_CACHE)")
    })?;
    Ok((module, functions, source))
}
