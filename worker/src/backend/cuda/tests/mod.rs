//! GPU checks of the CUDA backend against the CPU backend, run by `scripts/gpu_round.sh`.
//! They are `#[ignore]`d, so a GPU-less `cargo test` reports them as ignored; the GPU script
//! runs them with `--ignored` and VLLM_REQUIRE_GPU set, which turns a missing GPU into a failure.
//!
//! - the whole model, CUDA (bf16 and f32) vs CPU: a batched step of chunked prefills and
//!   decodes through shuffled blocks; logits max/mean abs diff and greedy agreement;
//! - the GPU sampler vs the CPU sampler on the same rows and uniforms;
//! - `hf_parity_dump` (ignored; driven by scripts/hf_parity.py through env vars): prefill
//!   logits and greedy continuations for the transformers comparison;
//! - CUDA graphs against eager, and the NCCL collectives;
//! - overlapped steps (`--async-scheduling`) against the same steps run one at a time.
//!
//! One file per concept (`model`, `sampler`, `parity`, `graphs`, `collectives`,
//! `overlap`); this one holds what they share.

use std::path::Path;

use anyhow::{ensure, Result};
use vllm_kernels::cuda::{libs, AttentionKernels, DType};
use vllm_protocol::SamplingParams;

use super::{sampling, CudaBackend};
use crate::backend::{Backend, CpuBackend, StepCapacity, StepInputs};
use crate::communicator::Communicator;
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::layers::TensorParallel;
use crate::models::{variant_for, LlamaForCausalLM};
use crate::sampler::argmax;
use crate::sampler::{Sampler, SamplingRequest};
use crate::weights::{HostTensor, Weights};
use vllm_fixtures::{write_tiny_model, TinyModelSpec};

/// Whether a GPU is there; `VLLM_REQUIRE_GPU=1` (set by scripts/gpu_round.sh) turns a
/// missing one into a failure, so a GPU round can never pass by skipping.
fn gpu_present() -> bool {
    if libs::device_count() > 0 {
        return true;
    }
    assert!(
        std::env::var_os("VLLM_REQUIRE_GPU").is_none(),
        "VLLM_REQUIRE_GPU is set but no CUDA device is usable"
    );
    eprintln!("SKIPPED: no CUDA device");
    false
}

/// What one backend made of a batch of prompts.
pub struct BatchRun {
    /// Per prompt: logits [prompt_len, vocab] of every prompt position (flattened).
    pub prefill_logits: Vec<Vec<f32>>,
    /// Per prompt: greedy continuation.
    pub continuations: Vec<Vec<u32>>,
    /// Per prompt and decode step: the logits row its token was chosen from (the first
    /// token's row is the last prefill row).
    pub decode_logits: Vec<Vec<Vec<f32>>>,
}

/// Runs `prompts` together on backend `b`: the prefill in two chunks (so the second attends
/// to a cached prefix), then batched greedy decode steps until each prompt has
/// `new_tokens` new tokens, every sequence in interleaved blocks. `keep_decode_logits`
/// keeps every decode row (for the CPU comparison; large for big vocabularies).
pub fn run_batch<B: Backend>(
    b: &B,
    model_dir: &Path,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    keep_decode_logits: bool,
) -> Result<BatchRun> {
    const BS: usize = 16;
    let cfg = ModelConfig::from_model_dir(model_dir)?;
    ensure!(
        new_tokens >= 1 && prompts.iter().all(|p| p.len() >= 2),
        "run_batch: prompts of at least 2 tokens and at least 1 new token"
    );
    let max_len = prompts.iter().map(Vec::len).max().unwrap_or(1) + new_tokens;
    let weights = Weights::open(model_dir)?;
    let model = LlamaForCausalLM::load(
        b,
        &weights,
        &cfg,
        variant_for(&cfg),
        TensorParallel::SINGLE,
        max_len,
        |_| {},
    )?;
    let blocks_per_seq = max_len.div_ceil(BS);
    let num_blocks = blocks_per_seq * prompts.len();
    let total_tokens: usize = prompts.iter().map(Vec::len).sum::<usize>() + prompts.len();
    b.reserve_steps(
        StepCapacity {
            max_num_tokens: total_tokens,
            max_num_seqs: prompts.len(),
            max_blocks_per_seq: blocks_per_seq,
        },
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )?;
    // Sequence s owns blocks s, s + n, s + 2n, … (interleaved, never contiguous).
    let table = |s: usize| -> Vec<i32> {
        (0..blocks_per_seq)
            .map(|j| (j * prompts.len() + (prompts.len() - 1 - s)) as i32)
            .collect()
    };
    let mut cache = KvCache::allocate(
        b,
        cfg.num_hidden_layers,
        num_blocks,
        BS,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )?;
    let vocab = cfg.vocab_size;
    let mut seqs: Vec<Vec<u32>> = prompts.to_vec();
    let mut done: Vec<usize> = vec![0; prompts.len()];
    let mut run = BatchRun {
        prefill_logits: vec![Vec::new(); prompts.len()],
        continuations: vec![Vec::new(); prompts.len()],
        decode_logits: vec![Vec::new(); prompts.len()],
    };
    // Steps: the prompts' first halves, their second halves (both with logits at every
    // position), then new_tokens - 1 batched decode steps.
    let half: Vec<usize> = prompts.iter().map(|p| p.len() / 2).collect();
    let mut plan: Vec<Vec<usize>> = vec![
        half.clone(),
        prompts
            .iter()
            .zip(&half)
            .map(|(p, h)| p.len() - h)
            .collect(),
    ];
    plan.extend((1..new_tokens).map(|_| vec![1; prompts.len()]));
    for (step_no, counts) in plan.iter().enumerate() {
        let prefill = step_no < 2;
        let mut inputs = StepInputs {
            max_blocks_per_seq: blocks_per_seq,
            query_start_loc: vec![0],
            ..Default::default()
        };
        let mut active = Vec::new();
        for (s, &n) in counts.iter().enumerate() {
            if n == 0 {
                continue;
            }
            active.push(s);
            let t = table(s);
            for p in done[s]..done[s] + n {
                inputs.input_ids.push(seqs[s][p] as i32);
                inputs.positions.push(p as i32);
                inputs
                    .slot_mapping
                    .push(t[p / BS] * BS as i32 + (p % BS) as i32);
            }
            inputs.block_tables.extend(&t);
            inputs.seq_lens.push((done[s] + n) as i32);
            let start = *inputs.query_start_loc.last().unwrap_or(&0);
            inputs.query_start_loc.push(start + n as i32);
            if prefill {
                inputs.logits_indices.extend(start..start + n as i32);
            } else {
                inputs.logits_indices.push(start + n as i32 - 1);
            }
        }
        if active.is_empty() {
            continue;
        }
        let meta = b.upload_step(&inputs)?;
        let hidden = model.forward(b, &meta, &mut cache)?;
        let logits = b.to_host(&model.compute_logits(b, &hidden, &meta)?)?.data;
        let mut rows = logits.chunks_exact(vocab.max(1));
        for &s in &active {
            let n = counts[s];
            let take = if prefill { n } else { 1 };
            for _ in 0..take {
                let r = rows
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("missing logits row"))?;
                if prefill {
                    run.prefill_logits[s].extend_from_slice(r);
                } else {
                    let tok = argmax(r);
                    if keep_decode_logits {
                        run.decode_logits[s].push(r.to_vec());
                    }
                    run.continuations[s].push(tok);
                    seqs[s].push(tok);
                }
            }
            done[s] += n;
        }
        // The prompt's first generated token comes from its last prefill row.
        if step_no == 1 {
            for (s, seq) in seqs.iter_mut().enumerate() {
                let rows = &run.prefill_logits[s];
                let tok = argmax(&rows[rows.len() - vocab..]);
                run.continuations[s].push(tok);
                seq.push(tok);
            }
        }
    }
    Ok(run)
}

fn prompts(n: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let len = 3 + (i * 7 + seed as usize) % 37;
            (0..len)
                .map(|j| ((i as u64 * 7919 + j as u64 * 104_729 + seed * 31) % vocab as u64) as u32)
                .collect()
        })
        .collect()
}

#[derive(Debug)]
struct Diff {
    max_abs: f32,
    mean_abs: f32,
}

fn diff(a: &[f32], b: &[f32]) -> Diff {
    assert_eq!(a.len(), b.len(), "diff: lengths");
    let mut max_abs = 0f32;
    let mut sum = 0f64;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y).abs();
        assert!(!d.is_nan(), "NaN in logits");
        max_abs = max_abs.max(d);
        sum += f64::from(d);
    }
    Diff {
        max_abs,
        mean_abs: (sum / a.len().max(1) as f64) as f32,
    }
}

/// The random model of `preset` (seed 0, as `vllm-rs make-tiny-model --preset` writes
/// it) under the temp folder, written once and shared by the tests and the GPU round.
fn model_dir(preset: &str) -> std::path::PathBuf {
    model_dir_in(&std::env::temp_dir().join("vllm-rs-models"), preset)
}

/// `model_dir` under `root`. Tests that run at once may each write the model: each writes
/// a folder of its own and renames it into place, and the first rename wins (a folder that
/// is there already is never removed while another test may read it).
fn model_dir_in(root: &Path, preset: &str) -> std::path::PathBuf {
    let dir = root.join(preset);
    if !dir.join("config.json").is_file() {
        let writer = format!("{}-{:?}", std::process::id(), std::thread::current().id());
        let tmp = dir.with_extension(format!("tmp{}", writer.replace(['(', ')'], "")));
        let spec = TinyModelSpec::preset(preset).unwrap();
        write_tiny_model(&tmp, &spec).unwrap();
        if std::fs::rename(&tmp, &dir).is_err() {
            if !dir.join("config.json").is_file() {
                // A stale folder of an interrupted run, not another writer's model.
                std::fs::remove_dir_all(&dir).unwrap();
                std::fs::rename(&tmp, &dir).unwrap();
            } else {
                std::fs::remove_dir_all(&tmp).unwrap();
            }
        }
    }
    dir
}

/// Tests writing the same model at once all get it whole (a GPU run without
/// `--test-threads=1` once failed three graph tests here).
#[test]
fn concurrent_writers_of_a_model_each_get_it_whole() {
    let root = std::env::temp_dir().join(format!("vllm-rs-model-dir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let dirs: Vec<_> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..4)
            .map(|_| s.spawn(|| model_dir_in(&root, "tiny-qwen3")))
            .collect();
        writers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    for dir in &dirs {
        ModelConfig::from_model_dir(dir).unwrap();
        assert_eq!(dir, &root.join("tiny-qwen3"));
    }
    let left: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
    assert_eq!(left.len(), 1, "temporary folders left behind: {left:?}");
    std::fs::remove_dir_all(&root).unwrap();
}

mod collectives;
mod graphs;
mod model;
mod overlap;
mod parity;
mod sampler;
