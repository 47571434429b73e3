//! Sampling on the GPU for the CUDA runner, for every parameter the CPU sampler
//! (`crate::sampler`) supports: greedy, temperature, top-k, top-p, min-p, repetition /
//! frequency / presence penalties, logit_bias, min_tokens, seeded or unseeded draws, and
//! raw logprobs. One `sample_tokens_ex` call per step (the split-row fast path and the
//! one-block-per-row kernel, sampling_ops.rs); the logits never leave the device, only the
//! tokens and the asked-for logprobs come back.
//!
//! The host turns each request's parameters and token history into a sparse list of the
//! tokens whose logits the processors change ([`push_entries`]: O(history), sorted by
//! token, one entry per token), and the kernel applies them in the CPU sampler's order and
//! f32 arithmetic.

use anyhow::{ensure, Context, Result};
use vllm_kernels::cuda::{
    LogitEntry, SampleRow, SampleRowEx, SamplingBatch, ENTRY_MASK, ENTRY_REPEAT, MAX_LOGPROBS,
};
use vllm_protocol::{SamplingParams, TokenLogprobs};

use super::{CudaBackend, CudaTensor};
use crate::sampler::{seeded_uniform, SamplingRequest};

/// A token id the GPU sampler returned, checked against the vocabulary: a broken kernel
/// fails the step instead of handing out an id past the tokenizer's.
pub fn checked_token(token: i32, vocab: usize) -> Result<u32> {
    ensure!(
        token >= 0 && (token as usize) < vocab,
        "the GPU sampler returned token {token} (vocabulary {vocab})"
    );
    Ok(token as u32)
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

// Kinds of the tokens of a request's history, in the order an entry takes them (a
// token's logit_bias values keep their order: BIAS + their index).
const PROMPT: u32 = 0;
const OUTPUT: u32 = 1;
const MASK: u32 = 2;
const BIAS: u32 = 3;

/// Appends one request's logits-processor entries (sorted by token, one per token) and
/// their logit_bias values, exactly where the CPU sampler changes a logit: logit_bias
/// tokens; eos (unless `ignore_eos`) and stop ids while `min_tokens` is not reached;
/// with penalties, the output tokens with their counts, and for a repetition penalty
/// also the prompt's tokens. Ids outside the vocabulary are ignored, as the CPU does.
pub fn push_entries(
    req: &SamplingRequest,
    vocab: usize,
    entries: &mut Vec<LogitEntry>,
    biases: &mut Vec<f32>,
) {
    let p = req.params;
    let in_vocab = |t: u32| (t as usize) < vocab;
    let mut items: Vec<(u32, u32)> = Vec::new();
    for (i, &(t, _)) in p.logit_bias.iter().enumerate() {
        if in_vocab(t) {
            items.push((t, BIAS + i as u32));
        }
    }
    if (req.output_token_ids.len() as u64) < u64::from(p.min_tokens) {
        let eos: &[u32] = if p.ignore_eos { &[] } else { req.eos_token_ids };
        for &t in eos.iter().chain(&p.stop_token_ids) {
            if in_vocab(t) {
                items.push((t, MASK));
            }
        }
    }
    let repetition = p.repetition_penalty != 1.0;
    if p.has_penalties() {
        items.extend(
            req.output_token_ids
                .iter()
                .filter(|&&t| in_vocab(t))
                .map(|&t| (t, OUTPUT)),
        );
        if repetition {
            items.extend(
                req.prompt_token_ids
                    .iter()
                    .filter(|&&t| in_vocab(t))
                    .map(|&t| (t, PROMPT)),
            );
        }
    }
    items.sort_unstable();
    let mut i = 0;
    while i < items.len() {
        let token = items[i].0;
        let mut e = LogitEntry {
            token: token as i32,
            bias_begin: biases.len() as i32,
            ..Default::default()
        };
        while i < items.len() && items[i].0 == token {
            match items[i].1 {
                PROMPT => e.flags |= ENTRY_REPEAT,
                OUTPUT => {
                    e.count += 1;
                    if repetition {
                        e.flags |= ENTRY_REPEAT;
                    }
                }
                MASK => e.flags |= ENTRY_MASK,
                k => biases.push(p.logit_bias[(k - BIAS) as usize].1),
            }
            i += 1;
        }
        e.bias_end = biases.len() as i32;
        entries.push(e);
    }
}

/// The host side of one step's sampling launch.
#[derive(Debug, Default)]
pub struct HostBatch {
    pub rows: Vec<SampleRowEx>,
    pub entries: Vec<LogitEntry>,
    pub biases: Vec<f32>,
    pub num_logprobs: usize,
}

impl HostBatch {
    /// The batch as the kernels' wrapper takes it.
    pub fn view(&self) -> SamplingBatch<'_> {
        SamplingBatch {
            rows: &self.rows,
            entries: &self.entries,
            biases: &self.biases,
            num_logprobs: self.num_logprobs,
        }
    }

    /// Row `i` for `reqs[i]`, with `base` giving each row's sampling parameters and uniform.
    pub fn build(
        reqs: &[SamplingRequest],
        vocab: usize,
        mut base: impl FnMut(&SamplingRequest) -> SampleRow,
    ) -> Result<Self> {
        let mut batch = HostBatch::default();
        for req in reqs {
            let p = req.params;
            let entry_begin = batch.entries.len();
            push_entries(req, vocab, &mut batch.entries, &mut batch.biases);
            let (logprobs, logprobs_slot) = match p.logprobs {
                Some(k) => {
                    ensure!(
                        k as usize <= MAX_LOGPROBS,
                        "{k} logprobs asked; the GPU sampler returns at most {MAX_LOGPROBS}"
                    );
                    batch.num_logprobs += 1;
                    (k as i32, batch.num_logprobs as i32 - 1)
                }
                None => (-1, 0),
            };
            let index = |n: usize| i32::try_from(n).context("too many sampling entries");
            batch.rows.push(SampleRowEx {
                base: base(req),
                entry_begin: index(entry_begin)?,
                entry_end: index(batch.entries.len())?,
                repetition_penalty: p.repetition_penalty,
                frequency_penalty: p.frequency_penalty,
                presence_penalty: p.presence_penalty,
                logprobs,
                logprobs_slot,
                path: 0,
            });
        }
        ensure!(
            i32::try_from(batch.biases.len()).is_ok(),
            "too many logit_bias values"
        );
        Ok(batch)
    }
}

/// Samples row `i` of `logits` [reqs.len(), vocab] for `reqs[i]` on the GPU, with the
/// CPU sampler's semantics and output.
pub fn sample(
    b: &CudaBackend,
    logits: &CudaTensor,
    reqs: &[SamplingRequest],
    engine_seed: u64,
) -> Result<Vec<(u32, Option<TokenLogprobs>)>> {
    sample_with(b, logits, reqs, engine_seed, false)
}

/// `sample` without the read-back, for rows that ask for no logprobs: the tokens stay on
/// the device, row `i`'s at index `i` of `out` (the worker's overlapped steps copy them
/// back later, see `pending_step`). Every row's uniform is drawn here, in row order, as
/// `sample` draws it.
pub fn sample_on_device(
    b: &CudaBackend,
    logits: &CudaTensor,
    reqs: &[SamplingRequest],
    engine_seed: u64,
    out: &mut cudarc::driver::CudaSlice<i32>,
) -> Result<()> {
    ensure!(
        logits.rows() == reqs.len() && !reqs.is_empty(),
        "sampling on the device: {} logits rows for {} requests",
        logits.rows(),
        reqs.len()
    );
    let vocab = logits.cols();
    let batch = HostBatch::build(reqs, vocab, |r| {
        row_params(b, r.params, r.output_token_ids.len(), engine_seed)
    })?;
    b.ops
        .sample_tokens_on_device(&logits.buf, vocab, &batch.view(), out)
}

/// `sample`, with the kernel's outputs poisoned (NaN, -1) before the launch when
/// `poison` (tests).
pub fn sample_with(
    b: &CudaBackend,
    logits: &CudaTensor,
    reqs: &[SamplingRequest],
    engine_seed: u64,
    poison: bool,
) -> Result<Vec<(u32, Option<TokenLogprobs>)>> {
    ensure!(
        logits.rows() == reqs.len(),
        "sampling: {} logits rows for {} requests",
        logits.rows(),
        reqs.len()
    );
    let vocab = logits.cols();
    if reqs.is_empty() || vocab == 0 {
        return Ok(reqs.iter().map(|_| (0, None)).collect());
    }
    let batch = HostBatch::build(reqs, vocab, |r| {
        row_params(b, r.params, r.output_token_ids.len(), engine_seed)
    })?;
    let out = b
        .ops
        .sample_tokens_ex(&logits.buf, vocab, &batch.view(), poison)?;
    batch
        .rows
        .iter()
        .zip(&out.tokens)
        .map(|(row, &token)| {
            let token = checked_token(token, vocab)?;
            let logprobs = if row.logprobs >= 0 {
                let lp = &out.logprobs[row.logprobs_slot as usize];
                ensure!(
                    lp.rank >= 1 && lp.num_top >= 0 && lp.num_top <= row.logprobs,
                    "the GPU sampler returned broken logprobs (rank {}, {} top for {})",
                    lp.rank,
                    lp.num_top,
                    row.logprobs
                );
                let n = lp.num_top as usize;
                Some(TokenLogprobs {
                    token_id: token,
                    logprob: lp.logprob,
                    rank: lp.rank as u32,
                    top: lp.top_ids[..n]
                        .iter()
                        .zip(&lp.top_logprobs[..n])
                        .map(|(&t, &l)| (t as u32, l))
                        .collect(),
                })
            } else {
                None
            };
            Ok((token, logprobs))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(
        params: &'a SamplingParams,
        prompt: &'a [u32],
        output: &'a [u32],
        eos: &'a [u32],
    ) -> SamplingRequest<'a> {
        SamplingRequest {
            params,
            prompt_token_ids: prompt,
            output_token_ids: output,
            eos_token_ids: eos,
        }
    }

    fn entries_of(r: &SamplingRequest, vocab: usize) -> (Vec<LogitEntry>, Vec<f32>) {
        let (mut e, mut b) = (Vec::new(), Vec::new());
        push_entries(r, vocab, &mut e, &mut b);
        (e, b)
    }

    fn ent(token: i32, count: i32, flags: i32, bias: (i32, i32)) -> LogitEntry {
        LogitEntry {
            token,
            count,
            flags,
            bias_begin: bias.0,
            bias_end: bias.1,
        }
    }

    #[test]
    fn plain_requests_have_no_entries() {
        let p = SamplingParams {
            min_tokens: 2,
            ..Default::default()
        };
        // min_tokens reached, no penalties, no bias: nothing to process.
        let (e, b) = entries_of(&req(&p, &[1, 2, 3], &[4, 5], &[0]), 10);
        assert!(e.is_empty() && b.is_empty());
    }

    #[test]
    fn penalties_dedup_count_and_mark_the_prompt() {
        let p = SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            ..Default::default()
        };
        // Prompt 3, 4, 9, 9; output 4, 7, 7, 7 and 25 (outside a vocabulary of 20).
        let r = req(&p, &[9, 3, 4, 9, 30], &[4, 7, 25, 7, 7], &[0]);
        let (e, b) = entries_of(&r, 20);
        assert!(b.is_empty());
        assert_eq!(
            e,
            vec![
                ent(3, 0, ENTRY_REPEAT, (0, 0)),
                ent(4, 1, ENTRY_REPEAT, (0, 0)),
                ent(7, 3, ENTRY_REPEAT, (0, 0)),
                ent(9, 0, ENTRY_REPEAT, (0, 0)),
            ]
        );
        // Without a repetition penalty, the prompt does not count.
        let p = SamplingParams {
            presence_penalty: 0.2,
            ..Default::default()
        };
        let (e, _) = entries_of(&req(&p, &[9, 3], &[4, 7, 7], &[0]), 20);
        assert_eq!(e, vec![ent(4, 1, 0, (0, 0)), ent(7, 2, 0, (0, 0))]);
    }

    #[test]
    fn bias_and_min_tokens_merge_with_penalties() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            min_tokens: 5,
            stop_token_ids: vec![6, 2],
            logit_bias: vec![(6, 1.5), (1, -2.0), (6, 0.25), (99, 3.0)],
            ..Default::default()
        };
        let r = req(&p, &[1], &[2, 2], &[2, 8]);
        let (e, b) = entries_of(&r, 10);
        // Bias values grouped per token, in the request's order; 99 is out of the vocabulary.
        assert_eq!(b, vec![-2.0, 1.5, 0.25]);
        assert_eq!(
            e,
            vec![
                ent(1, 0, ENTRY_REPEAT, (0, 1)),
                ent(2, 2, ENTRY_REPEAT | ENTRY_MASK, (1, 1)),
                ent(6, 0, ENTRY_MASK, (1, 3)),
                ent(8, 0, ENTRY_MASK, (3, 3)),
            ]
        );
        // min_tokens reached: no mask; ignore_eos keeps eos but not the stop ids masked.
        let (e, _) = entries_of(&req(&p, &[1], &[2, 2, 2, 2, 2], &[2, 8]), 10);
        assert!(e.iter().all(|e| e.flags & ENTRY_MASK == 0));
        let ignore = SamplingParams {
            ignore_eos: true,
            ..p.clone()
        };
        let (e, _) = entries_of(&req(&ignore, &[], &[], &[2, 8]), 10);
        let masked: Vec<i32> = e
            .iter()
            .filter(|e| e.flags & ENTRY_MASK != 0)
            .map(|e| e.token)
            .collect();
        assert_eq!(masked, vec![2, 6]);
    }

    #[test]
    fn batch_rows_point_at_their_entries_and_slots() {
        let plain = SamplingParams::default();
        let lp = SamplingParams {
            logprobs: Some(5),
            presence_penalty: 1.0,
            ..Default::default()
        };
        let lp0 = SamplingParams {
            logprobs: Some(0),
            ..Default::default()
        };
        let reqs = [
            req(&lp, &[], &[3, 3], &[]),
            req(&plain, &[], &[1], &[]),
            req(&lp0, &[], &[], &[]),
        ];
        let batch = HostBatch::build(&reqs, 10, |_| SampleRow::default()).unwrap();
        assert_eq!(batch.num_logprobs, 2);
        let r = &batch.rows;
        assert_eq!((r[0].entry_begin, r[0].entry_end), (0, 1));
        assert_eq!((r[1].entry_begin, r[1].entry_end), (1, 1));
        assert_eq!((r[0].logprobs, r[0].logprobs_slot), (5, 0));
        assert_eq!(r[1].logprobs, -1);
        assert_eq!((r[2].logprobs, r[2].logprobs_slot), (0, 1));
        assert_eq!(batch.entries, vec![ent(3, 2, 0, (0, 0))]);
        batch.view().validate(10).unwrap();
        let too_many = SamplingParams {
            logprobs: Some(21),
            ..Default::default()
        };
        assert!(HostBatch::build(&[req(&too_many, &[], &[], &[])], 10, |_| {
            SampleRow::default()
        })
        .is_err());
    }
}
