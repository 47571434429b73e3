//! Sampling on the GPU for the CUDA runner: rows whose parameters the kernel covers
//! (greedy, temperature, min-p, top-k, top-p, seeded or not) are sampled by
//! `sample_tokens` on the device, so only their token ids come back; rows that need
//! logprobs, logit bias, penalties or an active min_tokens still go through the CPU sampler
//! (only their rows are copied to the host).

use anyhow::{ensure, Result};
use vllm_kernels::cuda::SampleRow;
use vllm_protocol::SamplingParams;

use super::{CudaBackend, CudaTensor};
use crate::backend::Backend;
use crate::sampler::seeded_uniform;

/// Whether the GPU kernel implements everything this row asks for.
pub fn gpu_can_sample(params: &SamplingParams, num_output_tokens: usize) -> bool {
    params.logprobs.is_none()
        && params.logit_bias.is_empty()
        && !params.has_penalties()
        && num_output_tokens as u64 >= u64::from(params.min_tokens)
}

/// The kernel's parameters of one row, with its uniform drawn as the CPU sampler would:
/// from (seed, tokens generated so far) when seeded, else from the backend's stream.
pub fn row_params(
    b: &CudaBackend,
    params: &SamplingParams,
    num_output_tokens: usize,
    engine_seed: u64,
) -> SampleRow {
    let uniform = match params.seed {
        Some(seed) => seeded_uniform(seed, num_output_tokens as u64),
        None if !params.is_greedy() => b.next_unseeded_uniform(engine_seed),
        None => 0.0,
    };
    SampleRow {
        temperature: params.temperature,
        top_k: params.top_k_enabled().map(|k| k as i32).unwrap_or(0),
        top_p: params.top_p,
        min_p: params.min_p,
        uniform,
    }
}

/// Samples `rows[i]` from row `row_ids[i]` of `logits` [n, vocab]; returns the tokens.
pub fn sample_rows(
    b: &CudaBackend,
    logits: &CudaTensor,
    row_ids: &[i32],
    rows: &[SampleRow],
) -> Result<Vec<u32>> {
    ensure!(row_ids.len() == rows.len(), "sample_rows: ids vs params");
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let vocab = logits.cols();
    let all_in_order =
        row_ids.len() == logits.rows() && row_ids.iter().enumerate().all(|(i, &r)| r as usize == i);
    let gathered;
    let src = if all_in_order {
        logits
    } else {
        gathered = b.gather_rows(logits, &b.upload_ints(row_ids)?)?;
        &gathered
    };
    let stream = &b.dev.stream;
    let params = stream
        .clone_htod(rows)
        .map_err(|e| anyhow::anyhow!("copying sampling parameters to the GPU: {e:?}"))?;
    let mut out = b.upload_i32(&vec![0; rows.len()])?;
    b.ops
        .sample_tokens(&src.buf, &params, &mut out, rows.len(), vocab)?;
    let tokens = stream
        .clone_dtoh(&out)
        .map_err(|e| anyhow::anyhow!("copying sampled tokens from the GPU: {e:?}"))?;
    Ok(tokens[..rows.len()].iter().map(|&t| t as u32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_with_cpu_only_features_stay_on_the_cpu() {
        let plain = SamplingParams::default();
        assert!(gpu_can_sample(&plain, 0));
        let lp = SamplingParams {
            logprobs: Some(2),
            ..Default::default()
        };
        assert!(!gpu_can_sample(&lp, 0));
        let min = SamplingParams {
            min_tokens: 3,
            ..Default::default()
        };
        assert!(!gpu_can_sample(&min, 2));
        assert!(gpu_can_sample(&min, 3));
        let pen = SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        };
        assert!(!gpu_can_sample(&pen, 5));
    }
}
