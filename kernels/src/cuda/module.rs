//! Building and loading the kernel module of one dtype: the cache lookup, the NVRTC compile
//! on a miss, the driver load, and the table of kernel functions.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::device::{driver_error, CudaDevice};
use super::dtype::DType;
use super::{cache, nvrtc, sources};

/// Every kernel of `csrc/`, by its `extern "C"` name.
pub struct Functions {
    pub embedding: CudaFunction,
    pub rms_norm: CudaFunction,
    pub fused_add_rms_norm: CudaFunction,
    pub rms_norm_per_head: CudaFunction,
    pub rotary_embedding_neox: CudaFunction,
    pub silu_and_mul: CudaFunction,
    pub reshape_and_cache: CudaFunction,
    pub qkv_prepare: CudaFunction,
    pub split_cols: CudaFunction,
    pub gather_rows: CudaFunction,
    pub add_bias: CudaFunction,
    pub fill: CudaFunction,
    pub dummy_fill: CudaFunction,
    /// Indexed by head size (`HEAD_DIMS`).
    pub paged_attention: [CudaFunction; 4],
    pub paged_attention_combine: CudaFunction,
    /// The decode kernel by head size (16, 32, 64, 128).
    /// Indexed by head size, then GQA group (1, 2, 4, 8).
    pub paged_attention_decode: [[CudaFunction; 4]; 4],
    pub paged_attention_decode_combine: CudaFunction,
    /// The tensor-core prefill kernel by head size; bf16 and fp16 modules only.
    pub paged_attention_prefill: Option<[CudaFunction; 4]>,
    pub sample_tokens_ex: CudaFunction,
    pub sample_fast_max: CudaFunction,
    pub sample_fast_draw: CudaFunction,
}

/// How the module was obtained (logged, and reported by the startup benchmark).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildSource {
    Cache,
    Compiled,
}

/// NVRTC options of one build: architecture, dtype, and precise math (the CPU reference
/// is the judge, so no fast-math).
pub fn compile_options(arch: &str, dtype: DType) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
        dtype.define().to_string(),
    ]
}

/// The CUBIN of `dtype` for `arch`, from the cache or freshly compiled (and then cached).
pub fn cubin(arch: &str, dtype: DType) -> Result<(Vec<u8>, BuildSource)> {
    let tu = sources::translation_unit();
    let options = compile_options(arch, dtype);
    let (major, minor) = nvrtc::version()?;
    let nvrtc_version = format!("{major}.{minor}");
    let joined = options.join(" ");
    let key = cache::fnv1a(&[tu.as_bytes(), joined.as_bytes(), nvrtc_version.as_bytes()]);
    let path = cache::entry_path(
        &cache::cache_dir(),
        &format!("{arch}-{}", dtype.name()),
        key,
    );
    if let Some(bytes) = cache::load(&path) {
        tracing::debug!(path = %path.display(), "kernel cache hit");
        return Ok((bytes, BuildSource::Cache));
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
    cache::store(&path, &bytes);
    Ok((bytes, BuildSource::Compiled))
}

/// Loads the module of `dtype` on `dev` and looks up every kernel.
pub fn load(dev: &CudaDevice, dtype: DType) -> Result<(Arc<CudaModule>, Functions, BuildSource)> {
    let (bytes, source) = cubin(&dev.arch(), dtype)?;
    let module = dev
        .ctx
        .load_module(Ptx::from_binary(bytes))
        .map_err(|e| driver_error("loading the kernel CUBIN", e))?;
    let f = |name: &str| -> Result<CudaFunction> {
        module
            .load_function(name)
            .map_err(|e| driver_error(&format!("looking up kernel {name}"), e))
            .context("the kernel cache may be stale: delete it (see VLLM_RS_KERNEL_CACHE)")
    };
    // `{name}_d16` … `{name}_d128`, in HEAD_DIMS order.
    let head_dims = |name: &str| -> Result<[CudaFunction; 4]> {
        Ok([
            f(&format!("{name}_d16"))?,
            f(&format!("{name}_d32"))?,
            f(&format!("{name}_d64"))?,
            f(&format!("{name}_d128"))?,
        ])
    };
    // The decode kernels of one head size, by padded group (1, 2, 4, 8).
    let decode_kernels = |d: usize| -> Result<[CudaFunction; 4]> {
        Ok([
            f(&format!("paged_attention_decode_d{d}_g1"))?,
            f(&format!("paged_attention_decode_d{d}_g2"))?,
            f(&format!("paged_attention_decode_d{d}_g4"))?,
            f(&format!("paged_attention_decode_d{d}_g8"))?,
        ])
    };
    let functions = Functions {
        embedding: f("embedding")?,
        rms_norm: f("rms_norm")?,
        fused_add_rms_norm: f("fused_add_rms_norm")?,
        rms_norm_per_head: f("rms_norm_per_head")?,
        rotary_embedding_neox: f("rotary_embedding_neox")?,
        silu_and_mul: f("silu_and_mul")?,
        reshape_and_cache: f("reshape_and_cache")?,
        qkv_prepare: f("qkv_prepare")?,
        split_cols: f("split_cols")?,
        gather_rows: f("gather_rows")?,
        add_bias: f("add_bias")?,
        fill: f("fill")?,
        dummy_fill: f("dummy_fill")?,
        paged_attention: head_dims("paged_attention")?,
        paged_attention_combine: f("paged_attention_combine")?,
        paged_attention_decode: [
            decode_kernels(16)?,
            decode_kernels(32)?,
            decode_kernels(64)?,
            decode_kernels(128)?,
        ],
        paged_attention_decode_combine: f("paged_attention_decode_combine")?,
        paged_attention_prefill: match dtype {
            DType::F32 => None,
            _ => Some(head_dims("paged_attention_prefill")?),
        },
        sample_tokens_ex: f("sample_tokens_ex")?,
        sample_fast_max: f("sample_fast_max")?,
        sample_fast_draw: f("sample_fast_draw")?,
    };
    Ok((module, functions, source))
}
