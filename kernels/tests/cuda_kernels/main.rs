//! Every CUDA kernel against its CPU reference, in bf16, fp16 and f32, on fresh random
//! inputs: odd sizes, sequences crossing block boundaries, shuffled blocks, GQA, split
//! decode, and outputs poisoned with NaN before each launch (a skipped element shows).
//!
//! Inputs are rounded to the dtype first and the CPU reference runs on the rounded values,
//! so the bounds measure the kernels, not the input quantisation. Every test is `#[ignore]`d
//! (cargo reports it as ignored where there is no GPU); `scripts/gpu_round.sh` runs them with
//! `--ignored` and VLLM_REQUIRE_GPU set, so a missing device fails there instead of passing.
//! One module a kind of kernel; this file holds the device, the random inputs and the
//! tolerances they share.

mod attention;
#[path = "../common/mod.rs"]
mod common;
mod gemms;
mod sampling;
mod small_kernels;

use cudarc::driver::CudaSlice;
use vllm_kernels::cpu;
use vllm_kernels::cpu::attention::PagedAttentionShape;
use vllm_kernels::cuda::{
    AttentionDims, AttentionKernels, AttentionMeta, AttentionPlan, CudaDevice, CudaOps, DType,
    Gemm, SampleRowEx, SamplingBatch, THIN_GEMM_MAX_M,
};

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

struct Gpu {
    dev: CudaDevice,
}

fn gpu() -> Option<Gpu> {
    common::device().map(|dev| Gpu { dev })
}

/// A seeded generator of values in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (((self.next() + 1.0) * 0.5) * n as f32) as usize % n.max(1)
    }
}

/// Per-dtype bound: |got - want| <= abs + rel * |want|.
#[derive(Clone, Copy)]
struct Tol {
    abs: f32,
    rel: f32,
}

fn tol(dtype: DType, ulps: f32) -> Tol {
    let eps = match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        DType::F32 => 1e-6,
    };
    Tol {
        abs: eps * ulps,
        rel: eps * ulps,
    }
}

fn assert_close(what: &str, dtype: DType, got: &[f32], want: &[f32], t: Tol) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            !g.is_nan(),
            "{what} {dtype:?}: NaN at {i} (want {w}): element not written?"
        );
        let excess = (g - w).abs() - (t.abs + t.rel * w.abs());
        if excess > worst.0 {
            worst = (excess, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= 0.0,
        "{what} {dtype:?}: element {i}: got {}, want {} (bound {} + {}·|want|)",
        got[i],
        want[i],
        t.abs,
        t.rel
    );
}

struct Ctx<'a> {
    gpu: &'a Gpu,
    ops: CudaOps,
    dtype: DType,
}

impl<'a> Ctx<'a> {
    fn new(gpu: &'a Gpu, dtype: DType) -> Self {
        Self {
            gpu,
            ops: CudaOps::new(&gpu.dev, dtype).expect("build kernels"),
            dtype,
        }
    }
    fn round(&self, v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| self.dtype.round(x)).collect()
    }
    fn upload(&self, v: &[f32]) -> CudaSlice<u8> {
        self.gpu
            .dev
            .stream
            .clone_htod(&self.dtype.encode(v))
            .expect("upload")
    }
    fn ints(&self, v: &[i32]) -> CudaSlice<i32> {
        self.gpu.dev.stream.clone_htod(v).expect("upload ints")
    }
    fn poisoned(&self, n: usize) -> CudaSlice<u8> {
        let mut b = self
            .gpu
            .dev
            .stream
            .alloc_zeros(n * self.dtype.size())
            .expect("alloc");
        self.ops.fill(&mut b, n, f32::NAN).expect("fill");
        b
    }
    fn download(&self, b: &CudaSlice<u8>, n: usize) -> Vec<f32> {
        let bytes = self.gpu.dev.stream.clone_dtoh(b).expect("download");
        self.dtype.decode(&bytes[..n * self.dtype.size()])
    }
}
