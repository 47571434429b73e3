//! The CUDA sources compile with NVRTC for Hopper in every dtype. Needs only libnvrtc (no
//! GPU), so it also runs on a build machine that has NVRTC; without it, it says SKIPPED.

use vllm_kernels::cuda::{libs, module, nvrtc, sources, DType};

#[test]
#[ignore = "needs NVRTC: scripts/gpu_round.sh runs it with --ignored"]
fn kernels_compile_for_sm90_in_every_dtype() {
    // SAFETY: only tries to dlopen the library by name.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        // scripts/test.sh and the GPU round set these: there, a missing NVRTC is a failure.
        let required = ["VLLM_REQUIRE_NVRTC", "VLLM_REQUIRE_GPU"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        assert!(!required, "NVRTC (libnvrtc.so.13) not found and required");
        eprintln!(
            "SKIPPED: NVRTC (libnvrtc.so.13) not found; {}",
            libs::cuda_home().display()
        );
        return;
    }
    let tu = sources::translation_unit();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let options = module::compile_options("sm_90", dtype);
        match nvrtc::compile_cubin(&tu, "vllm_kernels.cu", &options) {
            Ok(cubin) => {
                assert!(cubin.len() > 1000, "{dtype:?}: tiny cubin");
                // Every name the loader will look up, from the loader's own list.
                module::Functions::lookup(dtype, |name| {
                    let symbol = format!("{name}\0");
                    anyhow::ensure!(
                        cubin.windows(symbol.len()).any(|w| w == symbol.as_bytes()),
                        "{dtype:?}: no kernel {name} in the CUBIN"
                    );
                    Ok(())
                })
                .unwrap();
            }
            Err(e) => panic!("{dtype:?}: {e:#}"),
        }
    }
}
