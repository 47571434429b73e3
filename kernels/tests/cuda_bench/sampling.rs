//! The sampler over a decode batch of Qwen's vocabulary: greedy, temperature, top-k / top-p
//! and min-p, over flat, peaked and normal logits.

use super::*;

/// `sample_tokens_ex` over a decode batch of Qwen's vocabulary, the whole call (uploads,
/// launches, read-back of the tokens). Every row takes the split-row fast path; top-k /
/// top-p rows merge candidates, and hand a row to the one-block-per-row kernel when the
/// merge cannot be exact: top-p alone over the flat random logits always does ("falls
/// back"), so it is timed again over peaked logits (one row-specific spike of +12, as a
/// model's confident row). Flat logits in bf16 tie by the hundred at the top (uniform in
/// [-1, 1): about 300 tokens a bf16 value near 1), which no trained model's do, so top-k
/// is timed again over normal logits (standard deviation 2.5, as a model's bulk: about
/// one token a value at the 20th largest). The floor is one read of the logits (78 MB:
/// about 26 us at 3 TB/s).
pub(super) fn sampling(dev: &CudaDevice, ops: &CudaOps) {
    // `VLLM_BENCH_CASE`: only the case of that name (one case under ncu).
    let only = std::env::var("VLLM_BENCH_CASE").unwrap_or_default();
    // `VLLM_BENCH_ROWS`: a smaller batch (the first rows of the logits).
    let seqs = std::env::var("VLLM_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(SEQS, |n| n.clamp(1, SEQS));
    let logits = random(dev, SEQS * VOCAB, 4);
    let peaked = peaked(dev, 4);
    let normal = normal(dev, 4);
    let bytes = (seqs * VOCAB * 2) as f64;
    for (name, temperature, top_k, top_p, min_p, x) in [
        ("greedy", 0.0, -1, 1.0, 0.0, &logits),
        ("temperature 0.6", 0.6, -1, 1.0, 0.0, &logits),
        ("temperature 0.6 min-p 0.05", 0.6, -1, 1.0, 0.05, &logits),
        ("t 0.6 top-k 20 top-p 0.95", 0.6, 20, 0.95, 0.0, &logits),
        (
            "t 0.6 top-p 0.9 (flat: falls back)",
            0.6,
            -1,
            0.9,
            0.0,
            &logits,
        ),
        ("t 0.6 top-p 0.9 (peaked)", 0.6, -1, 0.9, 0.0, &peaked),
        (
            "t 0.6 top-k 20 top-p 0.95 (peaked)",
            0.6,
            20,
            0.95,
            0.0,
            &peaked,
        ),
        (
            "t 0.6 top-k 20 top-p 0.95 (normal)",
            0.6,
            20,
            0.95,
            0.0,
            &normal,
        ),
    ] {
        if !only.is_empty() && name != only {
            continue;
        }
        // Each row its own uniform, as requests have: the race's pruning depends on the
        // key, and one key for every row gave every row the same chunks' luck.
        let rows: Vec<SampleRowEx> = (0..seqs)
            .map(|r| {
                SampleRowEx::plain(SampleRow {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    uniform: ((r as f64 + 0.37) * 0.618_033_988_749_895).fract(),
                })
            })
            .collect();
        let batch = SamplingBatch::plain(&rows);
        // One checked call first: how many rows the fast path handed back.
        let back = ops.sample_tokens_ex(x, VOCAB, &batch, true).unwrap();
        let s = time(dev, 20, || {
            ops.sample_tokens_ex(x, VOCAB, &batch, false).unwrap();
        });
        report(&format!("sample_tokens_ex {name} {seqs}x{VOCAB}"), s, bytes);
        // As the worker's overlapped steps sample: nothing waits for the tokens, so the
        // calls queue back to back and this is the GPU's time a call (the rows' copy in,
        // the launches with their dependent-launch overlap, the tokens' copy out).
        let mut out = dev.stream.alloc_zeros::<i32>(seqs).unwrap();
        let s = time(dev, 50, || {
            ops.sample_tokens_on_device(x, VOCAB, &batch, &mut out)
                .unwrap();
        });
        report(&format!("sample_tokens_on_device {name}"), s, bytes);
        println!(
            "BENCH sampling   {name}: {} of {seqs} rows handed to the general kernel",
            back.handed_back
        );
    }
}

/// Logits of a normal distribution (mean 0, standard deviation 2.5; Box-Muller over
/// `random_values`), in bf16.
fn normal(dev: &CudaDevice, seed: u64) -> CudaSlice<u8> {
    let u = random_values(SEQS * VOCAB * 2, seed);
    let v: Vec<f32> = u
        .chunks_exact(2)
        .map(|p| {
            // [-1, 1) to (0, 1]: the log is finite.
            let (a, b) = ((1.0 - p[0]) / 2.0, (p[1] + 1.0) / 2.0);
            2.5 * (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
        })
        .collect();
    dev.stream
        .clone_htod(&DType::BF16.encode(&v))
        .expect("upload")
}

/// `random`'s logits with one spike of +12 per row (at a row-specific token).
fn peaked(dev: &CudaDevice, seed: u64) -> CudaSlice<u8> {
    let mut v = random_values(SEQS * VOCAB, seed);
    for r in 0..SEQS {
        v[r * VOCAB + (r * 7919) % VOCAB] = 12.0;
    }
    dev.stream
        .clone_htod(&DType::BF16.encode(&v))
        .expect("upload")
}
