//! What the GPU test binaries share: opening the device, or saying why not.

use vllm_kernels::cuda::{libs, CudaDevice};

/// GPU 0, or None (printed as SKIPPED) where no CUDA device is usable. With
/// VLLM_REQUIRE_GPU set (the GPU round sets it) a missing device fails instead.
pub fn device() -> Option<CudaDevice> {
    if libs::device_count() == 0 {
        assert!(
            std::env::var_os("VLLM_REQUIRE_GPU").is_none(),
            "VLLM_REQUIRE_GPU is set but no CUDA device is usable"
        );
        eprintln!("SKIPPED: no CUDA device");
        return None;
    }
    Some(CudaDevice::open(0).expect("open GPU 0"))
}
