//! The CUDA C sources, embedded in the binary and joined into one translation unit (the
//! shared header first), so one NVRTC compile per dtype builds every kernel.

/// (file name, text) in compile order.
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("csrc/common.cuh")),
    ("mma.cuh", include_str!("csrc/mma.cuh")),
    ("embedding.cu", include_str!("csrc/embedding.cu")),
    ("norm.cu", include_str!("csrc/norm.cu")),
    ("rotary.cu", include_str!("csrc/rotary.cu")),
    ("activation.cu", include_str!("csrc/activation.cu")),
    ("cache.cu", include_str!("csrc/cache.cu")),
    ("qkv_prepare.cu", include_str!("csrc/qkv_prepare.cu")),
    ("copy.cu", include_str!("csrc/copy.cu")),
    ("gemv.cu", include_str!("csrc/gemv.cu")),
    ("attention.cu", include_str!("csrc/attention.cu")),
    ("wgmma.cuh", include_str!("csrc/wgmma.cuh")),
    (
        "attention_decode.cu",
        include_str!("csrc/attention_decode.cu"),
    ),
    (
        "attention_prefill.cu",
        include_str!("csrc/attention_prefill.cu"),
    ),
    ("thin_gemm.cu", include_str!("csrc/thin_gemm.cu")),
    ("sampling.cu", include_str!("csrc/sampling.cu")),
    ("sampling_fast.cu", include_str!("csrc/sampling_fast.cu")),
    (
        "custom_all_reduce.cu",
        include_str!("csrc/custom_all_reduce.cu"),
    ),
];

/// The whole translation unit, with `#line` markers so NVRTC errors name the real file.
pub fn translation_unit() -> String {
    let mut tu = String::new();
    for (name, text) in SOURCES {
        tu.push_str(&format!("#line 1 \"{name}\"\n"));
        tu.push_str(text);
        tu.push('\n');
    }
    tu
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_source_is_in_the_unit() {
        let tu = super::translation_unit();
        for (name, _) in super::SOURCES {
            assert!(tu.contains(&format!("\"{name}\"")));
        }
        assert!(tu.contains("HEAD_DIM_KERNELS(paged_attention,"));
        assert!(tu.contains("DECODE_KERNELS(128)"));
        assert!(tu.contains("HEAD_DIM_KERNEL(paged_attention_prefill,"));
    }
}
