//! NVRTC: compiles one CUDA C translation unit to a CUBIN for the device's architecture.
//!
//! A CUBIN (rather than PTX) is what we cache: loading it costs the driver no further
//! compilation, so a warm start compiles nothing at all.

use std::ffi::{CStr, CString};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result, sys};

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// Owns an `nvrtcProgram` and destroys it on drop.
struct Program {
    prog: sys::nvrtcProgram,
    // The program may point into these until it is destroyed.
    _src: CString,
    _name: CString,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program and destroyed only here.
        let _ = unsafe { result::destroy_program(self.prog) };
    }
}

impl Program {
    fn log(&self) -> String {
        // SAFETY: a valid program.
        match unsafe { result::get_program_log(self.prog) } {
            Ok(log) => {
                let bytes: Vec<u8> = log.iter().map(|&c| c as u8).collect();
                CStr::from_bytes_until_nul(&bytes)
                    .map(|c| c.to_string_lossy().into_owned())
                    .unwrap_or_default()
            }
            Err(_) => String::new(),
        }
    }

    fn cubin(&self) -> Result<Vec<u8>> {
        let mut size = 0usize;
        // SAFETY: a compiled program; the buffer is sized by NVRTC itself.
        unsafe { sys::nvrtcGetCUBINSize(self.prog, &mut size) }
            .result()
            .map_err(|e| anyhow!("nvrtcGetCUBINSize: {e:?}"))?;
        if size == 0 {
            bail!("NVRTC produced no CUBIN (was a real sm_XY architecture given?)");
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds `size` bytes as NVRTC asked.
        unsafe { sys::nvrtcGetCUBIN(self.prog, buf.as_mut_ptr() as *mut _) }
            .result()
            .map_err(|e| anyhow!("nvrtcGetCUBIN: {e:?}"))?;
        Ok(buf)
    }
}

/// Compiles `source` (named `name` in messages) with `options` to a CUBIN. A compile error
/// returns NVRTC's log.
pub fn compile_cubin(source: &str, name: &str, options: &[String]) -> Result<Vec<u8>> {
    let src = CString::new(source).context("kernel source holds a NUL byte")?;
    let cname = CString::new(name).context("kernel name holds a NUL byte")?;
    let prog = result::create_program(&src, Some(&cname))
        .map_err(|e| anyhow!("nvrtcCreateProgram({name}): {e:?}"))?;
    let prog = Program {
        prog,
        _src: src,
        _name: cname,
    };
    // SAFETY: a freshly created program.
    if let Err(e) = unsafe { result::compile_program(prog.prog, options) } {
        bail!(
            "NVRTC failed to compile {name} ({e:?}) with {options:?}:\n{}",
            prog.log()
        );
    }
    let log = prog.log();
    if !log.trim().is_empty() {
        tracing::debug!(name, "NVRTC log: {log}");
    }
    prog.cubin()
}
