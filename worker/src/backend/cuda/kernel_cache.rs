//! The kernel cache filled ahead of time (`vllm-rs compile-kernels`): the CUBINs a
//! `CudaBackend` would compile at its first start, compiled with NVRTC alone (no GPU or
//! driver), e.g. while a container image is built or before a GPU round. An entry is keyed
//! by the kernels' source, the architecture, the options and NVRTC's major.minor, so a
//! server of the same build with the same NVRTC finds it and compiles nothing.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use vllm_kernels::cuda::{cache, libs, module, DType};

/// Compiles (or finds) the kernels of each of `dtypes` (`--dtype` names) for `arch` in
/// `dir` (None: where a server looks); one line per dtype says what was done and where.
/// A compile that cannot be stored is an error: the cache is what this command is for.
pub fn compile_kernels(arch: &str, dtypes: &[String], dir: Option<&Path>) -> Result<Vec<String>> {
    let dtypes = dtypes
        .iter()
        .map(|d| {
            ensure!(d != "auto", "--dtype auto: name the dtypes to compile");
            DType::from_flag(Some(d))
        })
        .collect::<Result<Vec<_>>>()?;
    let dir = dir.map_or_else(cache::cache_dir, Path::to_path_buf);
    // Before the compiles, so that a folder that cannot be made fails at once.
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot write the kernel cache {}", dir.display()))?;
    libs::check_nvrtc()?;
    dtypes
        .into_iter()
        .map(|dtype| {
            let cubin = module::cubin_in(&dir, arch, dtype)?;
            if let Some(e) = cubin.store_error {
                bail!(
                    "cannot write the kernel cache {}: {e}",
                    cubin.path.display()
                );
            }
            Ok(format!(
                "{arch} {}: {:?}, {} bytes, {}",
                dtype.name(),
                cubin.source,
                cubin.bytes.len(),
                cubin.path.display()
            ))
        })
        .collect()
}
