//! GPU checks of the CUDA backend against the CPU backend, run by `scripts/gpu_round.sh`.
//! They are `#[ignore]`d, so a GPU-less `cargo test` reports them as ignored; the GPU script
//! runs them with `--ignored` and VLLM_REQUIRE_GPU set, which turns a missing GPU into a failure.
//!
//! - the whole model, CUDA (bf16 and f32) vs CPU: a batched step of chunked prefills and
//!   decodes through shuffled blocks; logits max/mean abs diff and greedy agreement;
//! - the GPU sampler vs the CPU sampler on the same rows and uniforms;
//! - `hf_parity_dump` (ignored; driven by scripts/hf_parity.py through env vars): prefill
//!   logits and greedy continuations for the transformers comparison.

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
    let dir = std::env::temp_dir().join("vllm-rs-models").join(preset);
    if !dir.join("config.json").is_file() {
        let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
        let spec = TinyModelSpec::preset(preset).unwrap();
        write_tiny_model(&tmp, &spec).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).unwrap();
    }
    dir
}

/// CUDA vs CPU on one model, with both attention backends (the CUDA-core kernel and the
/// flash kernels) against one CPU run: prints a table row each, checks the bounds.
fn compare_model(preset: &str, dtype: DType, new_tokens: usize, max_abs_bound: f32) {
    let dir = model_dir(preset);
    let spec = TinyModelSpec::preset(preset).unwrap();
    let ps = prompts(6, spec.vocab, 1);
    let cpu = run_batch(&CpuBackend::new(), &dir, &ps, new_tokens, true).unwrap();
    let sixteen_bit = dtype != DType::F32;
    for kernels in [
        AttentionKernels::CUDA_CORE,
        AttentionKernels::flash(sixteen_bit),
    ] {
        let gpu = CudaBackend::new(0, dtype)
            .unwrap()
            .with_attention_kernels(kernels);
        let cuda = run_batch(&gpu, &dir, &ps, new_tokens, true).unwrap();
        check_against_cpu(
            preset,
            dtype,
            kernels,
            &cpu,
            &cuda,
            new_tokens,
            max_abs_bound,
        );
    }
}

fn check_against_cpu(
    preset: &str,
    dtype: DType,
    kernels: AttentionKernels,
    cpu: &BatchRun,
    cuda: &BatchRun,
    new_tokens: usize,
    max_abs_bound: f32,
) {
    let ps = &cpu.continuations;
    let mut worst = Diff {
        max_abs: 0.0,
        mean_abs: 0.0,
    };
    let mut agree = 0;
    let mut total = 0;
    for s in 0..ps.len() {
        let d = diff(&cpu.prefill_logits[s], &cuda.prefill_logits[s]);
        worst.max_abs = worst.max_abs.max(d.max_abs);
        worst.mean_abs = worst.mean_abs.max(d.mean_abs);
        // Decode rows: compare while the two continuations agree (same inputs).
        let same = cpu.continuations[s]
            .iter()
            .zip(&cuda.continuations[s])
            .take_while(|(a, b)| a == b)
            .count();
        for k in 0..same.min(cpu.decode_logits[s].len()) {
            let d = diff(&cpu.decode_logits[s][k], &cuda.decode_logits[s][k]);
            worst.max_abs = worst.max_abs.max(d.max_abs);
            worst.mean_abs = worst.mean_abs.max(d.mean_abs);
        }
        agree += same;
        total += new_tokens;
    }
    println!(
        "MODEL-CHECK {preset:<14} {:<8} {} logits max|d| {:.5} mean|d| {:.6} greedy agree \
         {agree}/{total}",
        dtype.name(),
        if kernels == AttentionKernels::CUDA_CORE {
            "cuda-core"
        } else {
            "flash"
        },
        worst.max_abs,
        worst.mean_abs
    );
    assert!(
        worst.max_abs <= max_abs_bound,
        "{preset} {dtype:?} {kernels:?}: max |logit diff| {} over {max_abs_bound}",
        worst.max_abs
    );
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_model_matches_cpu_backend_in_f32() {
    if !gpu_present() {
        return;
    }
    for preset in ["tiny-qwen3", "tiny-qwen2", "tiny-llama"] {
        compare_model(preset, DType::F32, 12, 2e-3);
    }
    compare_model("qwen3-0.6b", DType::F32, 4, 5e-2);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_model_matches_cpu_backend_in_bf16() {
    if !gpu_present() {
        return;
    }
    for preset in ["tiny-qwen3", "tiny-qwen2", "tiny-llama"] {
        compare_model(preset, DType::BF16, 12, 0.25);
    }
    for preset in ["qwen3-0.6b", "qwen2.5-0.5b", "llama-3.2-1b"] {
        compare_model(preset, DType::BF16, 4, 1.0);
    }
}

/// Rows of logits with ties (values on a coarse grid), as bf16 produces them.
fn sampler_rows(rows: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..rows * vocab)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = (state >> 33) as f32 / (1u64 << 31) as f32;
            ((u * 12.0 - 6.0) * 8.0).round() / 8.0
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gpu_sampler_matches_cpu_sampler() {
    if !gpu_present() {
        return;
    }
    let b = CudaBackend::new(0, DType::BF16).unwrap();
    let cases: Vec<SamplingParams> = vec![
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 5,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            min_p: 0.05,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.6,
            top_k: 50,
            top_p: 0.8,
            min_p: 0.01,
            ..Default::default()
        },
        SamplingParams {
            temperature: 2.0,
            top_p: 0.3,
            ..Default::default()
        },
    ];
    let mut agree = 0;
    let mut total = 0;
    for vocab in [1000usize, 151_936] {
        let rows_per_case = if vocab > 10_000 { 4 } else { 24 };
        for (ci, base) in cases.iter().enumerate() {
            let logits = sampler_rows(rows_per_case, vocab, 7 + ci as u64);
            let t = b
                .upload(&HostTensor::new(vec![rows_per_case, vocab], logits.clone()))
                .unwrap();
            let mut host = b.to_host(&t).unwrap().data; // the bf16 values both sides see
            let params: Vec<SamplingParams> = (0..rows_per_case)
                .map(|r| SamplingParams {
                    seed: Some(1000 + r as u64),
                    ..base.clone()
                })
                .collect();
            let outputs: Vec<Vec<u32>> = (0..rows_per_case).map(|r| vec![1; r % 5]).collect();
            let reqs: Vec<SamplingRequest> = params
                .iter()
                .zip(&outputs)
                .map(|(p, o)| SamplingRequest {
                    params: p,
                    prompt_token_ids: &[],
                    output_token_ids: o,
                    eos_token_ids: &[],
                })
                .collect();
            let gpu: Vec<u32> = sampling::sample_with(&b, &t, &reqs, 0, true)
                .unwrap()
                .into_iter()
                .map(|(t, _)| t)
                .collect();
            let cpu: Vec<u32> = Sampler::new(0)
                .sample(&mut host, vocab, &reqs)
                .into_iter()
                .map(|(t, _)| t)
                .collect();
            let same = gpu.iter().zip(&cpu).filter(|(a, b)| a == b).count();
            if same != gpu.len() {
                println!("SAMPLER case {ci} vocab {vocab}: gpu {gpu:?} cpu {cpu:?}");
            }
            agree += same;
            total += gpu.len();
        }
    }
    println!("SAMPLER-CHECK gpu vs cpu tokens agree {agree}/{total}");
    assert!(
        agree * 100 >= total * 98,
        "GPU sampler agrees with the CPU on {agree}/{total} rows"
    );
}

/// Driven by scripts/hf_parity.py: VLLM_PARITY_MODEL (dir), VLLM_PARITY_PROMPTS (JSON list
/// of token-id lists), VLLM_PARITY_OUT (dir), VLLM_PARITY_NEW_TOKENS, VLLM_PARITY_DTYPE.
/// Writes prefill_logits.f32 (every prompt position, prompts in order) and tokens.json.
#[test]
#[ignore]
fn hf_parity_dump() {
    if !gpu_present() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let model = std::path::PathBuf::from(var("VLLM_PARITY_MODEL"));
    let prompts: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(var("VLLM_PARITY_PROMPTS")).unwrap())
            .unwrap();
    let out = std::path::PathBuf::from(var("VLLM_PARITY_OUT"));
    let new_tokens: usize = std::env::var("VLLM_PARITY_NEW_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let dtype = DType::from_flag(std::env::var("VLLM_PARITY_DTYPE").ok().as_deref()).unwrap();
    let kernels = match std::env::var("VLLM_PARITY_ATTENTION").as_deref() {
        Ok("flash") => AttentionKernels::flash(dtype != DType::F32),
        _ => AttentionKernels::CUDA_CORE,
    };
    let b = CudaBackend::new(0, dtype)
        .unwrap()
        .with_attention_kernels(kernels);
    let started = std::time::Instant::now();
    let run = run_batch(&b, &model, &prompts, new_tokens, false).unwrap();
    let bytes: Vec<u8> = run
        .prefill_logits
        .iter()
        .flat_map(|r| r.iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("prefill_logits.f32"), bytes).unwrap();
    std::fs::write(
        out.join("tokens.json"),
        serde_json::to_string(&run.continuations).unwrap(),
    )
    .unwrap();
    println!(
        "hf_parity_dump: {} prompts, {new_tokens} tokens each, {:.1}s",
        prompts.len(),
        started.elapsed().as_secs_f32()
    );
}

/// Single-request decode latency through the CUDA runner (`execute_model_cuda`: inputs,
/// forward, GPU sampling, token back on the host; no IPC). Presets from
/// VLLM_BENCH_PRESETS (default qwen3-0.6b); a 128-token prompt, then 256 decode steps.
/// A CUDA runner of `preset` in `dtype` (None: bf16) with 64 blocks of 16 tokens, its
/// decode graphs captured unless `enforce_eager`.
fn cuda_runner(
    preset: &str,
    dtype: Option<&str>,
    enforce_eager: bool,
) -> crate::model_runner::ModelRunner<CudaBackend> {
    use crate::model_runner::{ModelRunner, WorkerConfig};
    let cfg = WorkerConfig {
        model_dir: model_dir(preset),
        rank: 0,
        world_size: 1,
        device: "cuda".into(),
        dtype: dtype.map(str::to_string),
        block_size: 16,
        max_model_len: Some(1024),
        max_num_batched_tokens: 2048,
        max_num_seqs: 8,
        kv_cache_memory_bytes: 0,
        gpu_memory_utilization: 0.9,
        num_gpu_blocks_override: Some(64),
        seed: 0,
        load_format: Default::default(),
        attention_backend: Default::default(),
        execute_model_timeout_s: 300.0,
        enforce_eager,
    };
    let mut r = ModelRunner::load_cuda(&cfg, None).unwrap();
    r.profile_cuda().unwrap();
    r.initialize_kv_cache(64).unwrap();
    r.capture_cuda_graphs().unwrap();
    r
}

/// Greedy decoding of `prompts` (one prefill step, then `steps` decode steps of the whole
/// batch) through `execute_model_cuda`: each request's tokens, and each decode step's
/// wall time in ms.
fn greedy_decode(
    r: &mut crate::model_runner::ModelRunner<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<f64>) {
    use vllm_protocol::{CachedRequestData, NewRequestData, SchedulerOutput};
    let per_req = 64 / prompts.len();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: steps as u32 + 1,
        ignore_eos: true,
        ..Default::default()
    };
    let id = |i: usize| format!("r{i}");
    let first = SchedulerOutput {
        scheduled_new_reqs: prompts
            .iter()
            .enumerate()
            .map(|(i, p)| NewRequestData {
                req_id: id(i),
                prompt_token_ids: p.clone(),
                output_token_ids: vec![],
                sampling_params: params.clone(),
                block_ids: (0..per_req as u32)
                    .map(|b| b + (i * per_req) as u32)
                    .collect(),
                num_computed_tokens: 0,
            })
            .collect(),
        num_scheduled_tokens: prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (id(i), p.len() as u32))
            .collect(),
        total_num_scheduled_tokens: prompts.iter().map(|p| p.len() as u32).sum(),
        ..Default::default()
    };
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let record = |out: &mut Vec<Vec<u32>>, o: vllm_protocol::ModelRunnerOutput| {
        for t in o.sampled {
            let i: usize = t.req_id[1..].parse().unwrap();
            out[i].push(t.token_id);
        }
    };
    record(&mut out, r.execute_model_cuda(&first).unwrap());
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps {
        let so = SchedulerOutput {
            step_id: step as u64 + 1,
            scheduled_cached_reqs: prompts
                .iter()
                .enumerate()
                .map(|(i, p)| CachedRequestData {
                    req_id: id(i),
                    new_token_ids: vec![*out[i].last().unwrap()],
                    new_block_ids: vec![],
                    num_computed_tokens: (p.len() + step) as u32,
                    num_output_placeholders: 0,
                })
                .collect(),
            num_scheduled_tokens: (0..prompts.len()).map(|i| (id(i), 1)).collect(),
            total_num_scheduled_tokens: prompts.len() as u32,
            ..Default::default()
        };
        let t = std::time::Instant::now();
        record(&mut out, r.execute_model_cuda(&so).unwrap());
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    (out, times)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_graphs_and_eager_give_identical_greedy_output() {
    if !gpu_present() {
        return;
    }
    for (preset, dtype) in [
        ("tiny-qwen3", Some("float32")),
        ("tiny-llama", Some("float32")),
        ("tiny-qwen3", None),
        ("qwen3-0.6b", None),
    ] {
        // Batches of 1 and 3 (padded to the graph of 4), prompts of 5 to 40 tokens.
        for n in [1usize, 3] {
            let prompts: Vec<Vec<u32>> = (0..n)
                .map(|i| {
                    (0..5 + 17 * i as u32)
                        .map(|j| (j * 31 + 7 + i as u32) % 500)
                        .collect()
                })
                .collect();
            let mut eager = cuda_runner(preset, dtype, true);
            let (want, _) = greedy_decode(&mut eager, &prompts, 40);
            drop(eager);
            let mut graphs = cuda_runner(preset, dtype, false);
            assert!(graphs.num_cuda_graphs() > 0, "{preset}: no graphs captured");
            let (got, _) = greedy_decode(&mut graphs, &prompts, 40);
            assert_eq!(
                got, want,
                "{preset} {dtype:?} batch {n}: graphs differ from eager"
            );
            println!("MATCH graphs == eager: {preset} {dtype:?} batch {n}, 41 tokens each");
        }
    }
}

#[test]
#[ignore]
fn decode_latency_bench() {
    if !gpu_present() {
        return;
    }
    let presets = std::env::var("VLLM_BENCH_PRESETS").unwrap_or_else(|_| "qwen3-0.6b".into());
    for preset in presets.split(',') {
        for enforce_eager in [false, true] {
            let mut r = cuda_runner(preset, None, enforce_eager);
            let prompt: Vec<u32> = (0..128u32).map(|i| (i * 31 + 7) % 1000).collect();
            let (_, mut times) = greedy_decode(&mut r, &[prompt], 256);
            times.sort_by(f64::total_cmp);
            let mean = times.iter().sum::<f64>() / times.len() as f64;
            let mode = if enforce_eager { "eager" } else { "graphs" };
            println!(
                "BENCH decode latency {preset} ({mode}): mean {mean:.3} ms/token, p50 {:.3}, \
                 p90 {:.3} (prompt 128, 256 steps)",
                times[times.len() / 2],
                times[times.len() * 9 / 10],
            );
        }
    }
}

/// The `n` best ids of a row, best first, ties to the lowest id: the tokens that
/// penalties, biases and the min_tokens mask must move for the check to mean something.
fn best_ids(row: &[f32], n: usize) -> Vec<u32> {
    let key = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    ids.sort_by(|&a, &b| {
        key(row[b as usize])
            .total_cmp(&key(row[a as usize]))
            .then(a.cmp(&b))
    });
    ids.truncate(n);
    ids
}

/// One request of the full-parameter check: its parameters and history.
struct FullRow {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    eos: Vec<u32>,
}

/// Template `case` of the full-parameter check on a row whose best ids are `best`
/// (seeded wherever the draw is random, so both samplers draw the same uniform).
fn full_row(case: usize, r: usize, best: &[u32]) -> FullRow {
    let seed = Some(5000 + (case * 100 + r) as u64);
    let b = |i: usize| best[i];
    // A history where the best tokens repeat, in the prompt and in the output.
    let prompt: Vec<u32> = vec![b(0), 3, b(2), b(0), 11, b(3), b(2), b(0), 7];
    let output: Vec<u32> = (0..r % 6)
        .map(|i| [b(0), b(1), b(0), 5, b(4), b(0)][i])
        .collect();
    let mut row = FullRow {
        params: SamplingParams::default(),
        prompt,
        output,
        eos: vec![],
    };
    let p = &mut row.params;
    match case {
        0 => {
            p.temperature = 0.0;
            p.repetition_penalty = 1.5;
        }
        1 => {
            p.temperature = 0.0;
            p.frequency_penalty = 0.7;
            p.presence_penalty = 0.5;
        }
        2 => {
            p.temperature = 0.9;
            p.repetition_penalty = 1.2;
            p.frequency_penalty = 0.3;
            p.presence_penalty = 0.2;
            p.top_k = 40;
        }
        3 => {
            p.temperature = 0.0;
            // Repeated token ids add in order; one forces a token on even rows.
            p.logit_bias = vec![(b(5), 2.0), (b(7), -1.0), (b(5), 0.5), (b(0), -0.25)];
            if r.is_multiple_of(2) {
                p.logit_bias.push((17, 30.0));
            }
        }
        4 => {
            p.temperature = 1.0;
            p.logit_bias = vec![(b(3), 1.5), (b(1), -3.0)];
            p.top_p = 0.9;
            p.min_p = 0.02;
        }
        5 => {
            // min_tokens not reached: eos and stop ids are masked.
            p.temperature = 0.0;
            p.min_tokens = 10;
            p.stop_token_ids = vec![b(1)];
            row.eos = vec![b(0), b(2)];
        }
        6 => {
            // ignore_eos: only the stop ids are masked.
            p.temperature = 0.7;
            p.min_tokens = 8;
            p.ignore_eos = true;
            p.stop_token_ids = vec![b(0)];
            row.eos = vec![b(1)];
        }
        7 => {
            p.temperature = 0.0;
            p.logprobs = Some(0);
        }
        8 => {
            p.temperature = 0.8;
            p.logprobs = Some(1);
            p.repetition_penalty = 1.3;
        }
        9 => {
            p.temperature = 1.2;
            p.logprobs = Some(5);
            p.top_k = 10;
            p.top_p = 0.8;
            p.frequency_penalty = 0.4;
        }
        10 => {
            // Everything at once, greedy.
            p.temperature = 0.0;
            p.logprobs = Some(20);
            p.repetition_penalty = 1.4;
            p.frequency_penalty = -0.5;
            p.presence_penalty = 0.3;
            p.logit_bias = vec![(b(6), 0.75), (b(0), 1.0)];
            p.min_tokens = 100;
            p.stop_token_ids = vec![b(2), 999_999];
            row.eos = vec![b(1)];
        }
        11 => {
            p.temperature = 0.6;
            p.logprobs = Some(20);
            p.presence_penalty = 1.0;
            p.repetition_penalty = 0.8; // < 1: seen tokens are boosted
            p.min_p = 0.05;
            p.top_k = 100;
            p.top_p = 0.95;
        }
        _ => {
            // Seeded temperature sampling with penalties over a long, repetitive output.
            p.temperature = 1.5;
            p.repetition_penalty = 1.1;
            p.frequency_penalty = 0.2;
            p.logprobs = Some(3);
            row.output = (0..30).map(|i| b(i % 4)).collect();
        }
    }
    if !row.params.is_greedy() {
        row.params.seed = seed;
    }
    row
}

const FULL_CASES: usize = 13;

/// Logits of the full-parameter check: coarse-grid rows (ties everywhere); rows 1 and 9
/// (case 9: logprobs) hold NaN and +inf, rows 2 and 10 (case 10: logprobs, processors)
/// are all -inf (no distribution).
fn full_logits(vocab: usize, rows_per_case: usize) -> Vec<f32> {
    let n = FULL_CASES * rows_per_case;
    let mut logits = sampler_rows(n, vocab, 77 + vocab as u64);
    for r in [1, 9] {
        logits[r * vocab + 3] = f32::NAN;
        logits[r * vocab + 10] = f32::INFINITY;
    }
    for r in [2, 10] {
        logits[r * vocab..(r + 1) * vocab].fill(f32::NEG_INFINITY);
    }
    logits
}

fn full_rows(logits: &[f32], vocab: usize) -> Vec<FullRow> {
    (0..logits.len() / vocab)
        .map(|i| {
            let best = best_ids(&logits[i * vocab..(i + 1) * vocab], 8);
            full_row(i % FULL_CASES, i / FULL_CASES, &best)
        })
        .collect()
}

fn full_reqs(rows: &[FullRow]) -> Vec<SamplingRequest<'_>> {
    rows.iter()
        .map(|r| SamplingRequest {
            params: &r.params,
            prompt_token_ids: &r.prompt,
            output_token_ids: &r.output,
            eos_token_ids: &r.eos,
        })
        .collect()
}

/// The full-parameter check means something only if the processors change tokens: the
/// CPU sampler with and without penalties, bias and min_tokens must differ on at least a
/// quarter of the rows (runs without a GPU).
#[test]
fn full_sampler_rows_are_moved_by_the_processors() {
    for (vocab, rows_per_case) in [(1000usize, 8usize), (151_936, 2)] {
        let mut logits = full_logits(vocab, rows_per_case);
        let rows = full_rows(&logits, vocab);
        let reqs = full_reqs(&rows);
        let plain: Vec<SamplingParams> = rows
            .iter()
            .map(|r| SamplingParams {
                repetition_penalty: 1.0,
                frequency_penalty: 0.0,
                presence_penalty: 0.0,
                logit_bias: Vec::new(),
                min_tokens: 0,
                ..r.params.clone()
            })
            .collect();
        let plain_reqs: Vec<SamplingRequest> = reqs
            .iter()
            .zip(&plain)
            .map(|(r, p)| SamplingRequest { params: p, ..*r })
            .collect();
        let unprocessed = Sampler::new(0).sample(&mut logits.clone(), vocab, &plain_reqs);
        let processed = Sampler::new(0).sample(&mut logits, vocab, &reqs);
        let moved = processed
            .iter()
            .zip(&unprocessed)
            .filter(|(a, b)| a.0 != b.0)
            .count();
        println!("vocab {vocab}: {moved}/{} rows moved", rows.len());
        assert!(
            moved * 4 >= rows.len(),
            "only {moved}/{} rows moved",
            rows.len()
        );
    }
}

/// The GPU sampler with every parameter vs the CPU sampler, on one batch of mixed rows
/// (coarse-grid logits, so ties everywhere; rows with NaN and +inf, rows all -inf); the
/// outputs are poisoned before the launch and the logits must come out untouched.
/// Returns (tokens agreeing, rows, logprob rows agreeing, logprob rows, max |dlogprob|).
fn full_sampler_case(b: &CudaBackend, vocab: usize, rows_per_case: usize) -> [f64; 5] {
    let n = FULL_CASES * rows_per_case;
    let t = b
        .upload(&HostTensor::new(
            vec![n, vocab],
            full_logits(vocab, rows_per_case),
        ))
        .unwrap();
    let host = b.to_host(&t).unwrap().data; // the values both sides see
    let rows = full_rows(&host, vocab);
    let reqs = full_reqs(&rows);
    let gpu = sampling::sample_with(b, &t, &reqs, 0, true).unwrap();
    let after = b.to_host(&t).unwrap().data;
    assert!(
        after
            .iter()
            .zip(&host)
            .all(|(a, h)| a.to_bits() == h.to_bits()),
        "the GPU sampler modified the logits"
    );
    let cpu = Sampler::new(0).sample(&mut host.clone(), vocab, &reqs);
    let close = |a: f32, b: f32| a == b || (a - b).abs() <= 1e-4;
    let (mut agree, mut lp_agree, mut lp_rows, mut worst) = (0, 0, 0, 0f32);
    for (i, ((gt, gl), (ct, cl))) in gpu.iter().zip(&cpu).enumerate() {
        let case = i % FULL_CASES;
        if gt == ct {
            agree += 1;
        } else {
            println!("SAMPLER-FULL vocab {vocab} row {i} case {case}: gpu {gt} cpu {ct}");
        }
        assert_eq!(gl.is_some(), cl.is_some(), "row {i}: logprobs presence");
        if let (Some(g), Some(c)) = (gl, cl) {
            lp_rows += 1;
            let mut ok = g.token_id == c.token_id
                && close(g.logprob, c.logprob)
                && g.rank == c.rank
                && g.top.len() == c.top.len();
            for (&(gi, gv), &(ci, cv)) in g.top.iter().zip(&c.top) {
                ok &= gi == ci && close(gv, cv);
                if gv != cv {
                    worst = worst.max((gv - cv).abs());
                }
            }
            if g.logprob != c.logprob {
                worst = worst.max((g.logprob - c.logprob).abs());
            }
            if ok {
                lp_agree += 1;
            } else {
                println!("SAMPLER-FULL vocab {vocab} row {i} case {case}: gpu {g:?} cpu {c:?}");
            }
        }
    }
    [
        agree as f64,
        n as f64,
        lp_agree as f64,
        lp_rows as f64,
        f64::from(worst),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gpu_sampler_matches_cpu_sampler_with_every_parameter() {
    if !gpu_present() {
        return;
    }
    for dtype in [DType::F32, DType::BF16] {
        let b = CudaBackend::new(0, dtype).unwrap();
        for (vocab, rows_per_case) in [(1000usize, 8usize), (151_936, 2)] {
            let [agree, n, lp_agree, lp_rows, worst] = full_sampler_case(&b, vocab, rows_per_case);
            println!(
                "SAMPLER-FULL-CHECK {} vocab {vocab}: tokens agree {agree}/{n}, logprobs \
                 agree {lp_agree}/{lp_rows}, max |dlogprob| {worst:.2e}",
                dtype.name()
            );
            assert_eq!(agree, n, "{dtype:?} vocab {vocab}: tokens differ");
            assert_eq!(
                lp_agree, lp_rows,
                "{dtype:?} vocab {vocab}: logprobs differ"
            );
        }
    }
}

/// Every row through the processors, and a row without any entry next to one with many:
/// the batch's entry ranges and logprobs slots stay with their rows whatever the order.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gpu_sampler_rows_keep_their_entries_and_slots() {
    if !gpu_present() {
        return;
    }
    let b = CudaBackend::new(0, DType::F32).unwrap();
    let vocab = 64;
    let n = 6;
    let logits: Vec<f32> = (0..n * vocab)
        .map(|i| ((i * 37) % 64) as f32 / 8.0)
        .collect();
    let t = b
        .upload(&HostTensor::new(vec![n, vocab], logits.clone()))
        .unwrap();
    // Row r forces token 10 + r by a bias, every other row asks for logprobs.
    let params: Vec<SamplingParams> = (0..n)
        .map(|r| SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(10 + r as u32, 100.0)],
            logprobs: (r % 2 == 1).then_some(r as u32),
            repetition_penalty: if r == 3 { 2.0 } else { 1.0 },
            ..Default::default()
        })
        .collect();
    let prompt: Vec<u32> = (0..40).collect();
    let reqs: Vec<SamplingRequest> = params
        .iter()
        .map(|p| SamplingRequest {
            params: p,
            prompt_token_ids: &prompt,
            output_token_ids: &[],
            eos_token_ids: &[],
        })
        .collect();
    let gpu = sampling::sample_with(&b, &t, &reqs, 0, true).unwrap();
    let cpu = Sampler::new(0).sample(&mut logits.clone(), vocab, &reqs);
    let shape = |lp: &Option<vllm_protocol::TokenLogprobs>| {
        lp.as_ref()
            .map(|l| (l.rank, l.top.iter().map(|&(t, _)| t).collect::<Vec<_>>()))
    };
    for (r, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        assert_eq!(g.0, 10 + r as u32, "row {r}");
        assert_eq!(g.0, c.0, "row {r}");
        assert_eq!(shape(&g.1), shape(&c.1), "row {r}");
        if let (Some(g), Some(c)) = (&g.1, &c.1) {
            assert!((g.logprob - c.logprob).abs() <= 1e-4, "row {r}");
        }
    }
    println!("SAMPLER-ROWS-CHECK ok");
}

/// Time of one GPU sampling step (launch, copies and host work) for a full decode batch
/// of Qwen's vocabulary: plain rows, then every row with penalties over a 1k-token
/// history, logit_bias, min_tokens and 20 logprobs. Prints SAMPLER-TIME.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gpu_sampler_step_time() {
    if !gpu_present() {
        return;
    }
    let b = CudaBackend::new(0, DType::BF16).unwrap();
    let (n, vocab) = (256usize, 151_936usize);
    let t = b
        .upload(&HostTensor::new(vec![n, vocab], sampler_rows(n, vocab, 3)))
        .unwrap();
    let prompt: Vec<u32> = (0..1000u32).map(|i| (i * 7919) % vocab as u32).collect();
    let output: Vec<u32> = (0..200u32).map(|i| (i * 104_729) % vocab as u32).collect();
    let plain = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(1),
        ..Default::default()
    };
    let full = SamplingParams {
        repetition_penalty: 1.1,
        frequency_penalty: 0.2,
        presence_penalty: 0.1,
        logit_bias: vec![(5, 1.0), (6, -1.0)],
        min_tokens: 1000,
        stop_token_ids: vec![7],
        logprobs: Some(20),
        ..plain.clone()
    };
    for (what, params) in [("plain", &plain), ("every parameter", &full)] {
        let reqs: Vec<SamplingRequest> = (0..n)
            .map(|_| SamplingRequest {
                params,
                prompt_token_ids: &prompt,
                output_token_ids: &output,
                eos_token_ids: &[2],
            })
            .collect();
        sampling::sample(&b, &t, &reqs, 0).unwrap(); // warm-up
        let iters = 20;
        let started = std::time::Instant::now();
        for _ in 0..iters {
            sampling::sample(&b, &t, &reqs, 0).unwrap();
        }
        let ms = started.elapsed().as_secs_f64() * 1e3 / f64::from(iters);
        println!("SAMPLER-TIME {n} rows × {vocab}, {what}: {ms:.3} ms/step");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn dummy_weights_drawn_on_the_gpu_equal_the_host_draw() {
    if !gpu_present() {
        return;
    }
    for dtype in [DType::BF16, DType::F32] {
        let gpu = CudaBackend::new(0, dtype).expect("cuda backend");
        let weights = Weights::dummy(crate::weights::DUMMY_SEED, dtype);
        let name = "model.layers.0.mlp.gate_proj.weight";
        // Several 16,384-element blocks, a row shard, a column shard and a fused pair.
        let full = weights.get(name, &[300, 1000]).expect("dummy");
        let cases = [
            full.clone(),
            full.clone().narrow(0, 37, 200),
            full.clone().narrow(1, 500, 500),
            crate::weights::WeightTensor::cat_rows(vec![
                full.clone().narrow(0, 0, 100),
                weights
                    .get("model.layers.0.mlp.up_proj.weight", &[300, 1000])
                    .expect("dummy")
                    .narrow(0, 150, 100),
            ]),
            weights.get("model.norm.weight", &[4096]).expect("dummy"),
        ];
        for (i, w) in cases.iter().enumerate() {
            assert!(w.dummy_regions().is_some(), "case {i} stays lazy");
            let on_gpu = gpu
                .to_host(&gpu.upload_weight(w).expect("upload"))
                .expect("to host");
            assert_eq!(
                on_gpu.data,
                w.to_f32(),
                "case {i} ({dtype:?}): GPU draw != host draw"
            );
        }
    }
}

/// Runs `f(rank, backend)` on one thread per GPU, the backends joined in one NCCL group.
fn on_gpus<T: Send>(n: usize, f: impl Fn(usize, &CudaBackend) -> T + Sync) -> Vec<T> {
    let id = crate::communicator::NcclCommunicator::unique_id().expect("NCCL unique id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, id) = (&f, &id);
                s.spawn(move || {
                    let mut b = CudaBackend::new(rank as u32, DType::BF16).expect("backend");
                    b.join_group(id, rank as u32, n as u32).expect("join");
                    f(rank, &b)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// Values that differ per rank and element, exact in bf16 and in their sums.
fn rank_values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 5) % 61) as f32 * 0.25 - 7.0)
        .collect()
}

fn gpus_for_collectives() -> Option<usize> {
    let n = libs::device_count();
    if n >= 2 {
        return Some(n.min(8));
    }
    assert!(
        std::env::var_os("VLLM_REQUIRE_GPUS").is_none(),
        "VLLM_REQUIRE_GPUS is set but {n} GPU(s) are usable"
    );
    eprintln!("SKIPPED: NCCL collectives need 2 GPUs, found {n}");
    None
}

#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn nccl_collectives_match_the_host() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    let len = 3 * 4096 + 5;
    let results = on_gpus(n, |rank, b| {
        let comm = b.communicator().expect("joined");
        let mut x = b
            .upload(&HostTensor::new(vec![1, len], rank_values(rank, len)))
            .expect("up");
        comm.all_reduce(&mut x).expect("all-reduce");
        let g = comm
            .all_gather(
                &b.upload(&HostTensor::new(vec![1, 3], vec![rank as f32; 3]))
                    .expect("up"),
            )
            .expect("all-gather");
        let mut c = b
            .upload(&HostTensor::new(vec![4], vec![rank as f32 + 1.0; 4]))
            .expect("up");
        comm.broadcast(&mut c, n - 1).expect("broadcast");
        (
            b.to_host(&x).expect("x").data,
            b.to_host(&g).expect("g").data,
            b.to_host(&c).expect("c").data,
        )
    });
    let sum: Vec<f32> = (0..len)
        .map(|i| (0..n).map(|r| rank_values(r, len)[i]).sum())
        .collect();
    let gathered: Vec<f32> = (0..n).flat_map(|r| [r as f32; 3]).collect();
    for (rank, (x, g, c)) in results.iter().enumerate() {
        assert_eq!(x, &sum, "rank {rank}: all-reduce");
        assert_eq!(g, &gathered, "rank {rank}: all-gather");
        assert_eq!(
            c,
            &vec![n as f32; 4],
            "rank {rank}: broadcast from the last rank"
        );
    }
    println!("NCCL-CHECK {n} GPUs: all-reduce, all-gather, broadcast equal the host");
}

/// All-reduce latency at the model's message sizes (hidden 4096 bf16 × tokens), through
/// the communicator the model uses, as `BENCH allreduce` lines.
#[test]
#[ignore = "needs 2 CUDA GPUs: scripts/gpu_round.sh runs it with --ignored"]
fn nccl_all_reduce_bench() {
    let Some(n) = gpus_for_collectives() else {
        return;
    };
    let hidden = 4096;
    let rows = on_gpus(n, |rank, b| {
        let comm = b.communicator().expect("joined");
        let mut out = Vec::new();
        for tokens in [1usize, 8, 32, 128, 256, 1024, 4096] {
            let mut x = b
                .upload(&HostTensor::new(
                    vec![tokens, hidden],
                    rank_values(rank, tokens * hidden),
                ))
                .expect("upload");
            for _ in 0..20 {
                comm.all_reduce(&mut x).expect("warm-up");
            }
            b.dev.synchronize().expect("sync");
            let iters = if tokens <= 256 { 500 } else { 100 };
            let t = std::time::Instant::now();
            for _ in 0..iters {
                comm.all_reduce(&mut x).expect("all-reduce");
            }
            b.dev.synchronize().expect("sync");
            out.push((tokens, t.elapsed().as_secs_f64() / iters as f64));
        }
        out
    });
    for (i, &(tokens, _)) in rows[0].iter().enumerate() {
        let secs = rows.iter().map(|r| r[i].1).fold(0.0, f64::max);
        let bytes = (tokens * hidden * 2) as f64;
        // nccl-tests' bus bandwidth of an all-reduce: bytes · 2(n-1)/n over the time.
        let busbw = bytes * 2.0 * (n - 1) as f64 / n as f64 / secs / 1e9;
        println!(
            "BENCH allreduce ranks={n} tokens={tokens} bytes={bytes:.0} time={:.2}us busbw={busbw:.1}GB/s",
            secs * 1e6
        );
    }
}

/// The fast path (rows without processors or logprobs: greedy, temperature, min-p) vs the
/// CPU sampler, exactly: seeded draws over coarse-grid rows (ties everywhere), rows with
/// NaN and +inf, all -inf rows, a vocabulary whose bf16 rows are not 16-byte aligned
/// (the scalar loads) and one with a short last chunk. General rows (top-p) sit in the
/// same batch, so both kernels write their own rows.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gpu_fast_sampler_matches_cpu_sampler() {
    if !gpu_present() {
        return;
    }
    let mut agree = 0;
    let mut total = 0;
    for dtype in [DType::BF16, DType::F32] {
        let b = CudaBackend::new(0, dtype).unwrap();
        for vocab in [1000usize, 50_001, 151_936] {
            let n = 96;
            let mut logits = sampler_rows(n, vocab, 31 + vocab as u64);
            for r in [3, 40] {
                logits[r * vocab + 1] = f32::NAN;
                logits[r * vocab + vocab - 2] = f32::INFINITY;
            }
            for r in [7, 12] {
                logits[r * vocab..(r + 1) * vocab].fill(f32::NEG_INFINITY);
            }
            let t = b.upload(&HostTensor::new(vec![n, vocab], logits)).unwrap();
            let host = b.to_host(&t).unwrap().data;
            let params: Vec<SamplingParams> = (0..n)
                .map(|r| {
                    let (temperature, min_p, top_p) = match r % 6 {
                        0 => (0.0, 0.0, 1.0),
                        1 => (0.6, 0.0, 1.0),
                        2 => (1.0, 0.05, 1.0),
                        3 => (1.7, 0.0, 1.0),
                        4 => (0.3, 0.2, 1.0),
                        _ => (0.8, 0.0, 0.9), // the general kernel
                    };
                    SamplingParams {
                        temperature,
                        min_p,
                        top_p,
                        seed: Some(9000 + r as u64),
                        ..Default::default()
                    }
                })
                .collect();
            let reqs: Vec<SamplingRequest> = params
                .iter()
                .map(|p| SamplingRequest {
                    params: p,
                    prompt_token_ids: &[],
                    output_token_ids: &[],
                    eos_token_ids: &[],
                })
                .collect();
            let gpu = sampling::sample_with(&b, &t, &reqs, 0, true).unwrap();
            let cpu = Sampler::new(0).sample(&mut host.clone(), vocab, &reqs);
            for (r, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
                if g.0 == c.0 {
                    agree += 1;
                } else {
                    println!(
                        "SAMPLER-FAST {} vocab {vocab} row {r}: gpu {} cpu {}",
                        dtype.name(),
                        g.0,
                        c.0
                    );
                }
                total += 1;
            }
        }
    }
    println!("SAMPLER-FAST-CHECK gpu vs cpu tokens agree {agree}/{total}");
    assert_eq!(agree, total, "the fast GPU sampler differs from the CPU");
}
