//! The CUDA sources compile with NVRTC for Hopper (sm_90a, what an H100 or H200 server
//! builds, in every dtype; sm_90 without wgmma in bf16), into a kernel cache that
//! gives the same CUBIN back on the next call (and a cache that cannot be written is
//! reported). Needs only libnvrtc (no GPU), so it also runs on a build machine that has
//! NVRTC; without it, it says SKIPPED.

use vllm_kernels::cuda::{libs, module, DType};

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
    // Through the kernel cache, as `vllm-rs compile-kernels` and a server's start go: the
    // first call compiles and stores, the second finds the same bytes under the same key.
    let cache = tempfile::tempdir().expect("tempdir");
    let builds = [
        ("sm_90a", DType::BF16),
        ("sm_90a", DType::F16),
        ("sm_90a", DType::F32),
        ("sm_90", DType::BF16),
    ];
    for (arch, dtype) in builds {
        let cubin = match module::cubin_in(cache.path(), arch, dtype) {
            Ok(c) => c,
            Err(e) => panic!("{arch} {dtype:?}: {e:#}"),
        };
        assert_eq!(cubin.source, module::BuildSource::Compiled, "{dtype:?}");
        assert!(
            cubin.store_error.is_none(),
            "{dtype:?}: {:?}",
            cubin.store_error
        );
        assert!(cubin.bytes.len() > 1000, "{dtype:?}: tiny cubin");
        // Every name the loader will look up, from the loader's own list.
        module::Functions::lookup(dtype, |name| {
            let symbol = format!("{name}\0");
            anyhow::ensure!(
                cubin
                    .bytes
                    .windows(symbol.len())
                    .any(|w| w == symbol.as_bytes()),
                "{dtype:?}: no kernel {name} in the CUBIN"
            );
            Ok(())
        })
        .unwrap();
        let again = module::cubin_in(cache.path(), arch, dtype).unwrap();
        assert_eq!(again.source, module::BuildSource::Cache, "{dtype:?}");
        assert_eq!(
            (again.bytes, again.path),
            (cubin.bytes, cubin.path),
            "{dtype:?}"
        );
    }
    // A compile that cannot be stored still gives its CUBIN, and says why it is not in the
    // cache: `vllm-rs compile-kernels` fails on that, a server logs it.
    let file = cache.path().join("a-file");
    std::fs::write(&file, b"not a folder").expect("write");
    let cubin = module::cubin_in(&file, "sm_90", DType::F32).unwrap();
    assert_eq!(cubin.source, module::BuildSource::Compiled);
    assert!(cubin.store_error.is_some(), "stored under a file");
}
