//! `vllm-rs compile-kernels`: its flags; the worker crate's `kernel_cache` does the work
//! (the CUDA kernels compiled into the kernel cache ahead of a server's first start).

use std::path::PathBuf;

use anyhow::{ensure, Result};
use vllm_worker::backend::cuda::kernel_cache::compile_kernels;

#[derive(Debug, clap::Args)]
pub struct CompileKernelsArgs {
    /// The GPU architecture, as a server names it: sm_90a for H100 and H200, sm_80 for A100.
    #[arg(long, default_value = "sm_90a")]
    pub arch: String,
    /// The dtypes to compile, comma-separated (bfloat16, float16, float32).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bfloat16,float16,float32"
    )]
    pub dtype: Vec<String>,
    /// The kernel cache folder (else $VLLM_RS_KERNEL_CACHE, else ~/.cache/vllm-rs/kernels,
    /// where a server looks).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
}

/// `sm_` and the digits of a compute capability, with `a` for architecture-specific
/// features (NVRTC's own error for a bad one names no flag).
fn check_arch(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    let digits = digits.strip_suffix('a').unwrap_or(digits);
    ensure!(
        digits.len() >= 2 && digits.bytes().all(|b| b.is_ascii_digit()),
        "--arch {arch}: expected sm_ and a compute capability, such as sm_90a (H100, H200)"
    );
    Ok(())
}

pub fn run(args: &CompileKernelsArgs) -> Result<()> {
    check_arch(&args.arch)?;
    let lines = compile_kernels(&args.arch, &args.dtype, args.cache_dir.as_deref())?;
    lines.iter().for_each(|l| println!("{l}"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_must_name_a_compute_capability() {
        assert!(check_arch("sm_90").is_ok());
        assert!(check_arch("sm_90a").is_ok());
        assert!(check_arch("sm_100").is_ok());
        for bad in [
            "90",
            "sm_",
            "sm_9",
            "compute_90",
            "sm_9a",
            "sm_a",
            "sm_90aa",
        ] {
            assert!(check_arch(bad).is_err(), "{bad}");
        }
    }
}
