//! Finding the CUDA libraries at run time: nothing links CUDA at build time (cudarc's
//! dynamic loading), so this module checks, before first use, that the driver, NVRTC and
//! cuBLAS can be loaded, and turns a missing one into a one-line error that says what is
//! missing and how to point at it (`CUDA_HOME`, `LD_LIBRARY_PATH`).
//!
//! cudarc looks libraries up by name only (the loader's search path); when `CUDA_HOME`
//! (or `/usr/local/cuda`) holds them, we load them first by full path, so that the
//! by-name lookup then finds the already-loaded copy.

use std::path::PathBuf;
use std::sync::OnceLock;

use anyhow::{bail, Result};

/// The CUDA toolkit folder: `$CUDA_HOME`, `$CUDA_PATH`, else `/usr/local/cuda`.
pub fn cuda_home() -> PathBuf {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .find_map(|v| std::env::var_os(v).filter(|s| !s.is_empty()))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"))
}

/// Loads `name` from the toolkit's lib folders, if present, with RTLD_GLOBAL, and keeps it
/// loaded for the life of the process.
fn preload(name: &str) {
    let home = cuda_home();
    for dir in ["lib64", "lib", "targets/x86_64-linux/lib"] {
        let path = home.join(dir).join(name);
        if !path.is_file() {
            continue;
        }
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: dlopen of a CUDA library by path; the handle is deliberately leaked so
        // the library stays loaded, as cudarc expects of its own handles.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            tracing::debug!(path = %path.display(), "preloaded CUDA library");
            return;
        }
    }
}

/// Preloads the toolkit's libraries once (cuBLASLt before cuBLAS, which needs it).
fn preload_toolkit() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        for lib in ["libnvrtc.so.13", "libcublasLt.so.13", "libcublas.so.13"] {
            preload(lib);
        }
    });
}

fn hint() -> String {
    format!(
        "set CUDA_HOME to the CUDA 13 toolkit (now {}) or add its lib64 folder to LD_LIBRARY_PATH",
        cuda_home().display()
    )
}

/// The driver (`libcuda.so`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Checks the driver, NVRTC and cuBLAS, in that order.
pub fn check_libraries() -> Result<()> {
    preload_toolkit();
    if !driver_present() {
        bail!(
            "CUDA driver library libcuda.so not found: install the NVIDIA driver, or add the \
             folder holding libcuda.so.1 to LD_LIBRARY_PATH"
        );
    }
    check_nvrtc()?;
    // SAFETY: only tries to dlopen the library by name.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        bail!("cuBLAS (libcublas.so.13) not found: {}", hint());
    }
    Ok(())
}

/// Checks NVRTC alone: all that compiling the kernels needs (`vllm-rs compile-kernels`
/// runs without a GPU or driver).
pub fn check_nvrtc() -> Result<()> {
    preload_toolkit();
    // SAFETY: only tries to dlopen the library by name.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("NVRTC (libnvrtc.so.13) not found: {}", hint());
    }
    Ok(())
}

/// Number of CUDA devices, 0 when there is no driver or it reports none (`--device auto`).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}
