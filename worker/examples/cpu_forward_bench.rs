//! Times the CPU backend's forward pass alone (no engine, no IPC): one prefill of
//! `--input-len` tokens, then `--output-len` greedy decode steps, as `vllm-rs bench latency`
//! runs them, so the two can be compared to see what the serving path adds.
//!
//! `cargo run --release -p vllm-worker --example cpu_forward_bench -- --model FILE.gguf
//! [--dtype bfloat16|float32|float16] [--input-len 32] [--output-len 128] [--iters 3]
//! [--threads N]`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use vllm_kernels::cpu::fast::{default_threads, Isa};
use vllm_worker::backend::{Backend, CpuBackend, StepInputs};
use vllm_worker::config::ModelConfig;
use vllm_worker::kv_cache::KvCache;
use vllm_worker::layers::TensorParallel;
use vllm_worker::models::{variant_for, LlamaForCausalLM};
use vllm_worker::sampler::argmax;
use vllm_worker::weights::{DType, Weights};

const BLOCK_SIZE: usize = 16;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// One step of one sequence: `tokens` at positions `start..`, the cache holding `start`
/// tokens before it, in contiguous blocks.
fn step(tokens: &[u32], start: usize) -> StepInputs {
    let n = tokens.len();
    let total = start + n;
    let blocks = total.div_ceil(BLOCK_SIZE);
    StepInputs {
        input_ids: tokens.iter().map(|&t| t as i32).collect(),
        positions: (start as i32..total as i32).collect(),
        slot_mapping: (start as i32..total as i32).collect(),
        block_tables: (0..blocks as i32).collect(),
        max_blocks_per_seq: blocks,
        seq_lens: vec![total as i32],
        query_start_loc: vec![0, n as i32],
        logits_indices: vec![n as i32 - 1],
    }
}

fn main() -> Result<()> {
    let model = PathBuf::from(arg("--model").context("--model FILE.gguf or DIR")?);
    let dtype = DType::from_flag(arg("--dtype").as_deref())?;
    let input_len: usize = arg("--input-len").map_or(Ok(32), |v| v.parse())?;
    let output_len: usize = arg("--output-len").map_or(Ok(128), |v| v.parse())?;
    let iters: usize = arg("--iters").map_or(Ok(3), |v| v.parse())?;
    let threads: usize = arg("--threads").map_or(Ok(default_threads()), |v| v.parse())?;
    let cfg = ModelConfig::from_model_dir(&model)?;
    let b = CpuBackend::with_kernels(dtype, threads, Isa::detect());
    let started = Instant::now();
    let weights = Weights::open(&model)?;
    let total = input_len + output_len;
    let lm = LlamaForCausalLM::load(
        &b,
        &weights,
        &cfg,
        variant_for(&cfg),
        TensorParallel::SINGLE,
        total,
        |_| {},
    )?;
    println!(
        "{} layers, weights {}, {threads} threads, {:?}; loaded in {:.2} s",
        cfg.num_hidden_layers,
        dtype.name(),
        Isa::detect(),
        started.elapsed().as_secs_f64()
    );
    let mut cache = KvCache::allocate(
        &b,
        cfg.num_hidden_layers,
        total.div_ceil(BLOCK_SIZE),
        BLOCK_SIZE,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )?;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for it in 0..iters + 1 {
        let prompt: Vec<u32> = (0..input_len as u32)
            .map(|i| (i * 7919 + it as u32 * 104_729) % cfg.vocab_size as u32)
            .collect();
        let t = Instant::now();
        let meta = b.upload_step(&step(&prompt, 0))?;
        let hidden = lm.forward(&b, &meta, &mut cache)?;
        let logits = b.to_host(&lm.compute_logits(&b, &hidden, &meta)?)?.data;
        let mut next = argmax(&logits);
        let t_prefill = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for pos in input_len..total - 1 {
            let meta = b.upload_step(&step(&[next], pos))?;
            let hidden = lm.forward(&b, &meta, &mut cache)?;
            next = argmax(&b.to_host(&lm.compute_logits(&b, &hidden, &meta)?)?.data);
        }
        let t_decode = t.elapsed().as_secs_f64() / (output_len - 1).max(1) as f64;
        if it > 0 {
            prefill.push(t_prefill);
            decode.push(t_decode);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "prefill of {input_len}: {:.1} ms ({:.0} tok/s); decode: {:.2} ms/token (mean of {iters})",
        mean(&prefill) * 1e3,
        input_len as f64 / mean(&prefill),
        mean(&decode) * 1e3
    );
    Ok(())
}
