//! Kernel benchmarks at the shapes of a batch-256 decode step of Qwen3-0.6B (the
//! nanovllm-256 throughput run), each printed as a `BENCH` line with its time and its
//! bytes over that time, so a step's cost can be split by kernel:
//!
//!   cuda_bench --ignored --nocapture        (scripts/gpu_round.sh kernel-bench)
//!
//! Ignored like every GPU test (nothing to measure without a GPU); the numbers are
//! figures, not assertions. One module a kind of kernel (attention, sampling, GEMMs, a
//! whole layer's overlap); this file holds the timing and reporting they share.

mod attention;
#[path = "../common/mod.rs"]
mod common;
mod decode_shape;
mod gemms;
mod layer_overlap;
mod qkv_prepare;
mod sampling;

use std::time::Instant;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use vllm_kernels::cuda::{
    AttentionDims, AttentionKernels, AttentionMeta, AttentionPlan, CudaDevice, CudaOps, DType,
    Gemm, SampleRow, SampleRowEx, SamplingBatch,
};

use attention::attention;
use decode_shape::{DecodeShape, PlanInputs};
use gemms::gemms;
use sampling::sampling;

const SEQS: usize = 256;
const CONTEXT: usize = 600;
const HIDDEN: usize = 1024;
const HQ: usize = 16;
const HKV: usize = 8;
const D: usize = 128;
const BS: usize = 16;
const VOCAB: usize = 151_936;
const LAYERS: usize = 28;

/// Mean seconds of `f` over `iters` runs after `iters / 4 + 1` warm-up runs.
fn time(dev: &CudaDevice, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters / 4 + 1 {
        f();
    }
    dev.synchronize().expect("sync");
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    dev.synchronize().expect("sync");
    t.elapsed().as_secs_f64() / iters as f64
}

/// Mean seconds of one `f`, from a CUDA graph of `iters` calls replayed five times after a
/// warm-up replay: kernels back to back without the host's launch cost, which is larger
/// than a thin GEMM of a few microseconds. The first call runs outside the capture, so
/// cuBLAS's first-call setup is not captured.
fn time_graph(dev: &CudaDevice, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    dev.synchronize().expect("sync");
    let stream = &dev.stream;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    for _ in 0..iters {
        f();
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("a graph");
    graph.launch().expect("replay");
    dev.synchronize().expect("sync");
    let t = Instant::now();
    for _ in 0..5 {
        graph.launch().expect("replay");
    }
    dev.synchronize().expect("sync");
    t.elapsed().as_secs_f64() / (5 * iters) as f64
}

fn report(what: &str, seconds: f64, bytes: f64) {
    println!(
        "BENCH kernel {what:<52} {:>9.1} us {:>7.0} GB/s",
        seconds * 1e6,
        bytes / seconds / 1e9
    );
}

/// `n` sequence lengths spread over lo..=hi by a fixed stride (nanovllm-256's prompts are
/// `spread(256, 100, 1023)`), the same every run.
fn spread(n: usize, lo: i32, hi: i32) -> Vec<i32> {
    (0..n as i32)
        .map(|i| lo + (i * 379) % (hi - lo + 1))
        .collect()
}

/// Random values in [-1, 1).
fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Random bf16 data (values in [-1, 1)), so no kernel runs on zeros.
fn random(dev: &CudaDevice, n: usize, seed: u64) -> CudaSlice<u8> {
    dev.stream
        .clone_htod(&DType::BF16.encode(&random_values(n, seed)))
        .expect("upload")
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh kernel-bench runs it"]
fn decode_step_kernels() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    attention(&dev, &ops);
    sampling(&dev, &ops);
    gemms(&dev);
}

/// The sampling benchmarks alone (`scripts/gpu_round.sh sampling-bench` runs them, then
/// each case under ncu).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh sampling-bench runs it"]
fn sampling_kernels() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    sampling(&dev, &ops);
}
