//! CUDA graphs against eager execution (identical greedy output), and the decode latency
//! of the runner with and without them.

use super::*;

/// A CUDA runner of `preset` in `dtype` (None: bf16) with 64 blocks of 16 tokens, its
/// decode graphs captured unless `enforce_eager`.
pub(super) fn cuda_runner(
    preset: &str,
    dtype: Option<&str>,
    enforce_eager: bool,
) -> crate::model_runner::ModelRunner<CudaBackend> {
    cuda_runner_pdl(preset, dtype, enforce_eager, true)
}

/// `cuda_runner` with programmatic dependent launch on or off (where the device has it).
fn cuda_runner_pdl(
    preset: &str,
    dtype: Option<&str>,
    enforce_eager: bool,
    pdl: bool,
) -> crate::model_runner::ModelRunner<CudaBackend> {
    runner_for(preset, dtype, enforce_eager, pdl, RunnerShape::default())
}

/// The sizes a test runner is built for, and its attention kernels.
#[derive(Clone, Copy)]
struct RunnerShape {
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
    num_blocks: usize,
    attention_backend: crate::config::AttentionBackend,
}

impl Default for RunnerShape {
    fn default() -> Self {
        Self {
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            max_model_len: 1024,
            num_blocks: 64,
            attention_backend: Default::default(),
        }
    }
}

/// A runner of `shape` with its KV cache and (unless `enforce_eager`) its graphs.
fn runner_for(
    preset: &str,
    dtype: Option<&str>,
    enforce_eager: bool,
    pdl: bool,
    shape: RunnerShape,
) -> crate::model_runner::ModelRunner<CudaBackend> {
    let model = (model_dir(preset), crate::config::LoadFormat::Auto);
    runner_at(model, dtype, enforce_eager, pdl, shape)
}

/// `runner_for` the model folder given, its weights read as `load_format` says.
fn runner_at(
    (model_dir, load_format): (std::path::PathBuf, crate::config::LoadFormat),
    dtype: Option<&str>,
    enforce_eager: bool,
    pdl: bool,
    shape: RunnerShape,
) -> crate::model_runner::ModelRunner<CudaBackend> {
    use crate::model_runner::{ModelRunner, WorkerConfig};
    let cfg = WorkerConfig {
        model_dir,
        rank: 0,
        world_size: 1,
        device: "cuda".into(),
        dtype: dtype.map(str::to_string),
        block_size: 16,
        max_model_len: Some(shape.max_model_len as u32),
        max_num_batched_tokens: shape.max_num_batched_tokens as u32,
        max_num_seqs: shape.max_num_seqs as u32,
        kv_cache_memory_bytes: 0,
        gpu_memory_utilization: 0.9,
        num_gpu_blocks_override: Some(shape.num_blocks as u32),
        seed: 0,
        load_format,
        attention_backend: shape.attention_backend,
        execute_model_timeout_s: 300.0,
        enforce_eager,
        disable_custom_all_reduce: false,
    };
    let mut r = ModelRunner::load_cuda(&cfg, None).unwrap();
    r.backend_mut().ops.pdl &= pdl;
    r.profile_cuda().unwrap();
    r.initialize_kv_cache(shape.num_blocks as u32).unwrap();
    r.capture_cuda_graphs().unwrap();
    r
}

/// Greedy decoding of `prompts` (one prefill step, then `steps` decode steps of the whole
/// batch) through `execute_model_cuda`: each request's tokens, and each decode step's
/// wall time in ms. The runner's 64 blocks are split evenly between the prompts.
fn greedy_decode(
    r: &mut crate::model_runner::ModelRunner<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<f64>) {
    let (out, _, times) = greedy_decode_in(r, prompts, steps, 64 / prompts.len());
    (out, times)
}

/// `greedy_decode` with `per_req` blocks for each prompt, also returning the prefill
/// step's wall time in ms.
fn greedy_decode_in(
    r: &mut crate::model_runner::ModelRunner<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
    per_req: usize,
) -> (Vec<Vec<u32>>, f64, Vec<f64>) {
    use vllm_protocol::{CachedRequestData, NewRequestData, SchedulerOutput};
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
    // Under `ncu --profile-from-start off` only the decode steps are profiled, or only
    // the prefill step with VLLM_PROFILE_PREFILL set; without a profiler attached these
    // calls do nothing.
    let profile_prefill = std::env::var_os("VLLM_PROFILE_PREFILL").is_some();
    // SAFETY: plain driver calls on the runner's current context; stopping a stopped
    // profiler does nothing.
    let profiling = |on: bool| unsafe {
        if on {
            cudarc::driver::sys::cuProfilerStart()
        } else {
            cudarc::driver::sys::cuProfilerStop()
        }
    };
    profiling(profile_prefill);
    let t = std::time::Instant::now();
    record(&mut out, r.execute_model_cuda(&first).unwrap());
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    profiling(!profile_prefill);
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
    profiling(false);
    (out, prefill_ms, times)
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_graphs_and_eager_give_identical_greedy_output() {
    if !gpu_present() {
        return;
    }
    use crate::config::AttentionBackend::{CudaCore, Flash};
    for (preset, dtype, attention_backend) in [
        ("tiny-qwen3", Some("float32"), Flash),
        ("tiny-llama", Some("float32"), Flash),
        // A qkv bias, added by qkv_prepare (after the deferred norm's scale at 37).
        ("tiny-qwen2", None, Flash),
        ("tiny-qwen3", None, Flash),
        ("qwen3-0.6b", None, Flash),
        // Decode steps on the tile kernel (the graphs replay it too).
        ("tiny-qwen3", None, CudaCore),
    ] {
        // Batches of 1 and 3 (padded to the graph of 4), prompts of 5 to 56 tokens: each
        // step's block tables as wide as its longest sequence needs, 1 to 6 blocks. 37
        // (the graph of 40) runs its projections on cuBLAS, and so defers its norms where
        // the backend folds them (llama.rs).
        for n in [1usize, 3, 37] {
            let shape = RunnerShape {
                attention_backend,
                max_num_seqs: n.max(8).next_multiple_of(8),
                num_blocks: 8 * n.max(8),
                ..RunnerShape::default()
            };
            let prompts: Vec<Vec<u32>> = (0..n)
                .map(|i| {
                    (0..5 + 17 * (i % 4) as u32)
                        .map(|j| (j * 31 + 7 + i as u32) % 500)
                        .collect()
                })
                .collect();
            let per_req = shape.num_blocks / n;
            let mut eager = runner_for(preset, dtype, true, true, shape);
            let (want, _, _) = greedy_decode_in(&mut eager, &prompts, 40, per_req);
            drop(eager);
            let mut graphs = runner_for(preset, dtype, false, true, shape);
            assert!(graphs.num_cuda_graphs() > 0, "{preset}: no graphs captured");
            let (got, _, _) = greedy_decode_in(&mut graphs, &prompts, 40, per_req);
            assert_eq!(
                got, want,
                "{preset} {dtype:?} {attention_backend:?} batch {n}: graphs differ from eager"
            );
            println!(
                "MATCH graphs == eager: {preset} {dtype:?} {attention_backend:?} batch {n}, \
                 41 tokens each"
            );
        }
    }
}

/// Every graph's buffers come from the capture arena, also where a smaller bucket's split
/// decode grid takes more attention partials than the largest bucket's grid of whole
/// sequences (Qwen3-0.6B at `--max-num-seqs` 96: bucket 64's 8 partitions of 64 rows
/// against bucket 96's 4 of 96).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn every_graph_buffer_fits_the_capture_arena() {
    if !gpu_present() {
        return;
    }
    for max_num_seqs in [8, 96, 256] {
        let shape = RunnerShape {
            max_num_seqs,
            num_blocks: 2 * max_num_seqs,
            ..RunnerShape::default()
        };
        let r = runner_for("qwen3-0.6b", None, false, true, shape);
        assert!(r.num_cuda_graphs() > 0);
        assert_eq!(
            r.cuda_graph_allocation_nodes(),
            0,
            "--max-num-seqs {max_num_seqs}: buffers allocated inside a capture"
        );
        println!("ARENA --max-num-seqs {max_num_seqs}: every graph buffer in the arena");
    }
}

/// The mean of `times`, and `times` sorted (for its percentiles).
fn mean_and_sorted(mut times: Vec<f64>) -> (f64, Vec<f64>) {
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    times.sort_by(f64::total_cmp);
    (mean, times)
}

/// Single-request decode latency through the CUDA runner (`execute_model_cuda`: inputs,
/// forward, GPU sampling, token back on the host; no IPC). Presets from
/// VLLM_BENCH_PRESETS (default qwen3-0.6b); a 128-token prompt, then 256 decode steps.
#[test]
#[ignore]
fn decode_latency_bench() {
    if !gpu_present() {
        return;
    }
    let presets = std::env::var("VLLM_BENCH_PRESETS").unwrap_or_else(|_| "qwen3-0.6b".into());
    for preset in presets.split(',') {
        for (enforce_eager, pdl) in [(false, true), (false, false), (true, true), (true, false)] {
            let mut r = cuda_runner_pdl(preset, None, enforce_eager, pdl);
            let prompt: Vec<u32> = (0..128u32).map(|i| (i * 31 + 7) % 1000).collect();
            let (_, times) = greedy_decode(&mut r, &[prompt], 256);
            let (mean, times) = mean_and_sorted(times);
            let mode = match (enforce_eager, r.backend_mut().ops.pdl) {
                (false, true) => "graphs",
                (false, false) => "graphs, no PDL",
                (true, true) => "eager",
                (true, false) => "eager, no PDL",
            };
            println!(
                "BENCH decode latency {preset} ({mode}): mean {mean:.3} ms/token, p50 {:.3}, \
                 p90 {:.3} (prompt 128, 256 steps)",
                times[times.len() / 2],
                times[times.len() * 9 / 10],
            );
        }
    }
}

/// Decode-step time at a serving batch through the CUDA runner, graphs on: VLLM_BENCH_BATCH
/// sequences (default 256) of the Qwen3-0.6B shape with prompts of 100 to 1,023 tokens
/// (nanovllm-256's range), then VLLM_BENCH_STEPS decode steps (default 32). Run under
/// `ncu --profile-from-start off` it profiles the decode steps only (the `batch-bench`
/// stage of scripts/gpu_round.sh). VLLM_BENCH_MODEL names another model folder (its
/// config.json; random weights), e.g. one of `tp-rank-latency`'s rank shapes.
#[test]
#[ignore]
fn decode_batch_bench() {
    if !gpu_present() {
        return;
    }
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (batch, steps) = (env("VLLM_BENCH_BATCH", 256), env("VLLM_BENCH_STEPS", 32));
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|i| {
            let len = 100 + (i * 379) % 924;
            (0..len as u32)
                .map(|j| (j * 31 + 7 + i as u32) % 1000)
                .collect()
        })
        .collect();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps + 1;
    let per_req = longest.div_ceil(16);
    let shape = RunnerShape {
        max_num_seqs: batch,
        max_num_batched_tokens: prompts.iter().map(Vec::len).sum::<usize>().max(2048),
        max_model_len: per_req * 16,
        num_blocks: per_req * batch,
        ..RunnerShape::default()
    };
    let (name, model) = match std::env::var_os("VLLM_BENCH_MODEL") {
        Some(dir) => (
            dir.to_string_lossy().into_owned(),
            (dir.into(), crate::config::LoadFormat::Dummy),
        ),
        None => (
            "qwen3-0.6b".to_string(),
            (model_dir("qwen3-0.6b"), crate::config::LoadFormat::Auto),
        ),
    };
    let mut r = runner_at(model, None, false, true, shape);
    let (_, prefill_ms, times) = greedy_decode_in(&mut r, &prompts, steps, per_req);
    let (mean, times) = mean_and_sorted(times);
    let tokens = prompts.iter().map(Vec::len).sum::<usize>();
    let keys = tokens / batch;
    println!(
        "BENCH prefill step {name}, {tokens} tokens of {batch} prompts (eager, the \
         shapes' first run): {prefill_ms:.3} ms"
    );
    println!(
        "BENCH decode step {name} batch {batch} (mean prompt {keys}, graphs): mean {mean:.3} \
         ms/step, p50 {:.3} ({steps} steps)",
        times[times.len() / 2]
    );
}
