//! The CPU backend's fast kernels on whole tiny models: against the reference kernels, on
//! every ISA and thread count, and with bf16 / f16 weights against f32.

use std::path::Path;

use vllm_fixtures::{write_tiny_model, ModelType, TinyDtype, TinyModelSpec};
use vllm_kernels::cpu::fast::Isa;
use vllm_worker::backend::{Backend, CpuBackend, StepInputs};
use vllm_worker::config::ModelConfig;
use vllm_worker::kv_cache::KvCache;
use vllm_worker::layers::TensorParallel;
use vllm_worker::models::{variant_for, LlamaForCausalLM};
use vllm_worker::sampler::argmax;
use vllm_worker::weights::{DType, Weights};

const BLOCK: usize = 4;

fn tiny(dir: &Path, arch: ModelType, dtype: TinyDtype) {
    let spec = TinyModelSpec {
        seed: 5,
        dtype,
        ..TinyModelSpec::tiny(arch)
    };
    write_tiny_model(dir, &spec).unwrap();
}

/// The logits of a 13-token prefill and of 6 greedy decode steps after it, through a
/// block table in reverse order.
fn run(b: &CpuBackend, dir: &Path) -> Vec<Vec<f32>> {
    let cfg = ModelConfig::from_model_dir(dir).unwrap();
    let weights = Weights::open(dir).unwrap();
    let model = LlamaForCausalLM::load(
        b,
        &weights,
        &cfg,
        variant_for(&cfg),
        TensorParallel::SINGLE,
        64,
        |_| {},
    )
    .unwrap();
    let blocks = 8;
    let mut cache = KvCache::allocate(
        b,
        cfg.num_hidden_layers,
        blocks,
        BLOCK,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    .unwrap();
    let table: Vec<i32> = (0..blocks as i32).rev().collect();
    let slot = |p: usize| table[p / BLOCK] * BLOCK as i32 + (p % BLOCK) as i32;
    let mut tokens: Vec<u32> = (0..13).map(|i| (i * 37 + 11) % 500).collect();
    let mut out = Vec::new();
    let mut start = 0;
    while out.len() < 7 {
        let new = &tokens[start..];
        let n = new.len();
        let inputs = StepInputs {
            input_ids: new.iter().map(|&t| t as i32).collect(),
            positions: (start as i32..(start + n) as i32).collect(),
            slot_mapping: (start..start + n).map(slot).collect(),
            block_tables: table.clone(),
            max_blocks_per_seq: blocks,
            seq_lens: vec![(start + n) as i32],
            query_start_loc: vec![0, n as i32],
            logits_indices: vec![n as i32 - 1],
        };
        let meta = b.upload_step(&inputs).unwrap();
        let hidden = model.forward(b, &meta, &mut cache).unwrap();
        let logits = b
            .to_host(&model.compute_logits(b, &hidden, &meta).unwrap())
            .unwrap()
            .data;
        start += n;
        tokens.push(argmax(&logits));
        out.push(logits);
    }
    out
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

fn greedy(logits: &[Vec<f32>]) -> Vec<u32> {
    logits.iter().map(|l| argmax(l)).collect()
}

const ARCHS: [ModelType; 3] = [ModelType::Qwen3, ModelType::Qwen2, ModelType::Llama];

#[test]
fn fast_kernels_match_the_reference_kernels() {
    for arch in ARCHS {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path(), arch, TinyDtype::F32);
        let reference = run(&CpuBackend::reference(), dir.path());
        let fast = run(&CpuBackend::new(), dir.path());
        let d = max_rel_diff(&fast, &reference);
        assert!(d < 1e-4, "{arch:?}: fast logits differ by {d}");
        assert_eq!(greedy(&fast), greedy(&reference), "{arch:?}");
    }
}

#[test]
fn every_isa_and_thread_count_gives_the_same_bits() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path(), ModelType::Qwen3, TinyDtype::F32);
    for dtype in [DType::F32, DType::BF16] {
        let mut first: Option<Vec<Vec<f32>>> = None;
        for isa in Isa::available() {
            for threads in [1, 3] {
                let got = run(&CpuBackend::with_kernels(dtype, threads, isa), dir.path());
                match &first {
                    None => first = Some(got),
                    Some(f) => assert!(
                        got == *f,
                        "{dtype:?} on {isa:?} with {threads} threads differs from the first run"
                    ),
                }
            }
        }
    }
}

/// A bf16 checkpoint: f32 weights hold its values exactly, so bf16 weights differ from
/// them only by the bf16 rounding of each linear layer's input (and f16 weights not at
/// all but for rounding to f16).
#[test]
fn narrow_weights_of_a_bf16_checkpoint_stay_close() {
    for arch in ARCHS {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path(), arch, TinyDtype::BF16);
        let isa = Isa::detect();
        let f32_run = run(&CpuBackend::with_kernels(DType::F32, 2, isa), dir.path());
        for (dtype, tol) in [(DType::BF16, 0.1), (DType::F16, 0.02)] {
            let got = run(&CpuBackend::with_kernels(dtype, 2, isa), dir.path());
            let d = max_rel_diff(&got[..1], &f32_run[..1]);
            assert!(d < tol, "{arch:?} {dtype:?}: logits differ by {d}");
            assert_eq!(greedy(&got)[0], greedy(&f32_run)[0], "{arch:?} {dtype:?}");
        }
    }
}

/// An f32 checkpoint rounded to bf16 or f16 on load: the prefill's logits close, and the
/// same first greedy token (later steps may follow other tokens).
#[test]
fn narrow_weights_of_an_f32_checkpoint_stay_close() {
    for arch in ARCHS {
        let dir = tempfile::tempdir().unwrap();
        tiny(dir.path(), arch, TinyDtype::F32);
        let isa = Isa::detect();
        let f32_run = run(&CpuBackend::with_kernels(DType::F32, 2, isa), dir.path());
        for (dtype, tol) in [(DType::BF16, 0.1), (DType::F16, 0.02)] {
            let got = run(&CpuBackend::with_kernels(dtype, 2, isa), dir.path());
            let d = max_rel_diff(&got[..1], &f32_run[..1]);
            assert!(d < tol, "{arch:?} {dtype:?}: logits differ by {d}");
            assert!(d > 0.0, "{arch:?} {dtype:?}: no rounding at all?");
            assert_eq!(greedy(&got)[0], greedy(&f32_run)[0], "{arch:?} {dtype:?}");
        }
    }
}
