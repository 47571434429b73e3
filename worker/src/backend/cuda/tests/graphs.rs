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
    r.backend_mut().ops.pdl &= pdl;
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
            let (_, mut times) = greedy_decode(&mut r, &[prompt], 256);
            times.sort_by(f64::total_cmp);
            let mean = times.iter().sum::<f64>() / times.len() as f64;
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
