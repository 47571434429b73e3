//! The CPU sampler: turns one row of logits per request into the next token, with vLLM V1's
//! semantics and order, and is the reference the GPU sampling kernel is checked against.
//!
//! Per row, in vLLM V1's order: raw logprobs (vLLM's default `logprobs_mode =
//! "raw_logprobs"`: log-softmax of the model's logits before any processing) → logit_bias
//! → min_tokens (eos and stop ids masked) → repetition, frequency and presence penalties →
//! greedy argmax when temperature < 1e-5, else temperature → min-p → top-k → top-p →
//! inverse-CDF draw, or for a plain temperature row (none of the three) the exponential
//! race (`exponential_race.rs`: vLLM's own draw, one pass). vLLM V1 applies min-p (an
//! argmax-invariant logits processor) before top-k/top-p; we follow it.
//!
//! Randomness: a seeded request draws its uniform from a counter-based hash of
//! (seed, number of tokens already generated), so its tokens do not depend on the batch it
//! shares, the step it runs in, or a preemption and recompute. An unseeded request draws
//! from the sampler's own generator.

use vllm_protocol::{SamplingParams, TokenLogprobs};

use crate::exponential_race::{race_token, RaceKey};

/// What the sampler needs to know about one request of the batch.
pub struct SamplingRequest<'a> {
    pub params: &'a SamplingParams,
    pub prompt_token_ids: &'a [u32],
    pub output_token_ids: &'a [u32],
    /// The model's eos ids: masked while `min_tokens` is not reached (unless `ignore_eos`).
    pub eos_token_ids: &'a [u32],
}

/// Samples next tokens for a batch of requests. Holds only the generator of unseeded
/// requests, so it is cheap to create and owns no per-request state.
pub struct Sampler {
    /// splitmix64 state for requests without a seed.
    state: u64,
}

impl Sampler {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// logits: one row per request, row-major [reqs.len() × vocab_size]; rows may be
    /// modified in place. Returns the sampled token and, when asked, its logprobs.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        vocab_size: usize,
        reqs: &[SamplingRequest],
    ) -> Vec<(u32, Option<TokenLogprobs>)> {
        assert_eq!(
            logits.len(),
            reqs.len() * vocab_size,
            "sampler: logits must hold one row of vocab_size per request"
        );
        if vocab_size == 0 {
            return reqs.iter().map(|_| (0, None)).collect();
        }
        logits
            .chunks_exact_mut(vocab_size)
            .zip(reqs)
            .map(|(row, req)| {
                // Drawn for every random request, even unseeded ones, so the sampler's
                // stream advances the same way whatever the row's content.
                let uniform = match req.params.seed {
                    Some(seed) => seeded_uniform(seed, req.output_token_ids.len() as u64),
                    None if !req.params.is_greedy() => self.next_uniform(),
                    None => 0.0,
                };
                sample_row(row, req, uniform)
            })
            .collect()
    }

    fn next_uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        to_unit(mix64(self.state))
    }
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finaliser: a bijective avalanche mix of 64 bits.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform of a seeded request at one step: a pure function of (seed, step), so the
/// GPU kernel can compute the same value.
pub fn seeded_uniform(seed: u64, step: u64) -> f64 {
    let key = mix64(seed.wrapping_add(GOLDEN_GAMMA));
    to_unit(mix64(key ^ step.wrapping_mul(GOLDEN_GAMMA)))
}

/// The top 53 bits as a double in [0, 1).
fn to_unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Processes one row and picks its token.
fn sample_row(
    row: &mut [f32],
    req: &SamplingRequest,
    uniform: f64,
) -> (u32, Option<TokenLogprobs>) {
    sanitize(row);
    let params = req.params;
    // Raw logprobs are of the model's own output, so keep it before any processing.
    let raw = params.logprobs.map(|_| row.to_vec());

    apply_logit_bias(row, &params.logit_bias);
    if (req.output_token_ids.len() as u64) < u64::from(params.min_tokens) {
        apply_min_tokens(row, params, req.eos_token_ids);
    }
    if params.has_penalties() {
        apply_penalties(row, params, req.prompt_token_ids, req.output_token_ids);
    }

    // Bias and penalties can push a huge logit past f32's range.
    sanitize(row);
    let token = if params.is_greedy() {
        argmax(row)
    } else {
        sample_random(row, params, uniform)
    };
    let logprobs = params
        .logprobs
        .zip(raw)
        .map(|(k, raw)| token_logprobs(&raw, token, k as usize));
    (token, logprobs)
}

/// NaN becomes -inf (never chosen) and +inf the largest finite value, so a broken row
/// cannot poison a softmax with NaN.
fn sanitize(row: &mut [f32]) {
    for x in row.iter_mut() {
        if x.is_nan() {
            *x = f32::NEG_INFINITY;
        } else if *x == f32::INFINITY {
            *x = f32::MAX;
        }
    }
}

fn apply_logit_bias(row: &mut [f32], bias: &[(u32, f32)]) {
    for &(token, b) in bias {
        if let Some(x) = row.get_mut(token as usize) {
            *x += b;
        }
    }
}

/// Masks every token that would end the request before `min_tokens`, as vLLM's
/// MinTokensLogitsProcessor does with `all_stop_token_ids` (eos only unless `ignore_eos`).
fn apply_min_tokens(row: &mut [f32], params: &SamplingParams, eos_token_ids: &[u32]) {
    let eos: &[u32] = if params.ignore_eos {
        &[]
    } else {
        eos_token_ids
    };
    for &token in eos.iter().chain(&params.stop_token_ids) {
        if let Some(x) = row.get_mut(token as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// vLLM's `apply_penalties`: repetition over prompt and output (divide positive logits,
/// multiply the others), then subtract frequency × count and presence × seen, both over the
/// output only.
fn apply_penalties(row: &mut [f32], params: &SamplingParams, prompt: &[u32], output: &[u32]) {
    let vocab = row.len();
    let counts = sorted_counts(output, vocab);
    if params.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = prompt
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        seen.extend(counts.iter().map(|&(t, _)| t));
        seen.sort_unstable();
        seen.dedup();
        let r = params.repetition_penalty;
        for t in seen {
            let x = &mut row[t as usize];
            *x = if *x > 0.0 { *x / r } else { *x * r };
        }
    }
    for (t, n) in counts {
        row[t as usize] -= params.frequency_penalty * n as f32 + params.presence_penalty;
    }
}

/// (token, occurrences) of the in-vocabulary tokens of `ids`, by token id.
fn sorted_counts(ids: &[u32], vocab: usize) -> Vec<(u32, u32)> {
    let mut sorted: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&t| (t as usize) < vocab)
        .collect();
    sorted.sort_unstable();
    let mut counts: Vec<(u32, u32)> = Vec::new();
    for t in sorted {
        match counts.last_mut() {
            Some((last, n)) if *last == t => *n += 1,
            _ => counts.push((t, 1)),
        }
    }
    counts
}

/// The first index of the largest value (ties go to the lowest id, as torch.argmax).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Temperature, then the exponential race for a plain row; else min-p, top-k, top-p and an
/// inverse-CDF draw over what is left.
fn sample_random(row: &mut [f32], params: &SamplingParams, uniform: f64) -> u32 {
    let fallback = argmax(row);
    let inv_t = 1.0 / params.temperature;
    for x in row.iter_mut() {
        *x *= inv_t;
    }
    // A tiny temperature can overflow a huge logit to +inf, which would poison the softmax.
    sanitize(row);
    let max = row[fallback as usize];
    if max == f32::NEG_INFINITY {
        return fallback; // everything is masked: nothing better to do than vLLM's argmax
    }
    // As the kernels decide it (`race_row`): a NaN min-p or top-p is off.
    let (min_p_on, top_k, top_p_on) = (
        params.min_p > 0.0,
        params.top_k_enabled(),
        params.top_p < 1.0,
    );
    if !min_p_on && top_k.is_none() && !top_p_on {
        return race_token(row, RaceKey::of_uniform(uniform)).unwrap_or(fallback);
    }
    // Candidates: token ids with a finite logit, in id order.
    let mut cand: Vec<u32> = (0..row.len() as u32)
        .filter(|&t| row[t as usize] > f32::NEG_INFINITY)
        .collect();
    if min_p_on {
        apply_min_p(&mut cand, row, max, params.min_p);
    }
    if let Some(k) = top_k {
        apply_top_k(&mut cand, row, k);
    }
    if top_p_on {
        apply_top_p(&mut cand, row, max, params.top_p);
    }
    draw(&cand, row, max, uniform).unwrap_or(fallback)
}

/// A scaled logit's unnormalised probability: exp(y - max) with the difference taken in
/// f64 (exact for any two f32s within 2^29 of each other's magnitude), so that a GPU
/// kernel may factor it as exp(y - m) · exp(m - max) through any m and stay within f64
/// rounding of this.
fn weight(y: f32, max: f32) -> f64 {
    (f64::from(y) - f64::from(max)).exp()
}

/// Drops tokens whose probability is below min_p × the top probability; the top token
/// always survives, since its ratio is 1.
fn apply_min_p(cand: &mut Vec<u32>, row: &[f32], max: f32, min_p: f32) {
    let min_p = f64::from(min_p);
    cand.retain(|&t| weight(row[t as usize], max) >= min_p);
}

/// Keeps tokens whose logit is at least the k-th largest (ties at the threshold stay, as in
/// vLLM's mask on the sorted logits).
fn apply_top_k(cand: &mut Vec<u32>, row: &[f32], k: usize) {
    if k >= cand.len() {
        return;
    }
    let mut values: Vec<f32> = cand.iter().map(|&t| row[t as usize]).collect();
    let (_, kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let threshold = *kth;
    cand.retain(|&t| row[t as usize] >= threshold);
}

/// Keeps the smallest set of most likely tokens whose renormalised mass reaches top_p,
/// always at least the top token.
fn apply_top_p(cand: &mut Vec<u32>, row: &[f32], max: f32, top_p: f32) {
    let weight_of = |t: u32| weight(row[t as usize], max);
    let total: f64 = cand.iter().map(|&t| weight_of(t)).sum();
    let mut by_prob = cand.clone();
    // Best first; ties to the lowest id, so the cut is deterministic.
    by_prob.sort_unstable_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let target = f64::from(top_p) * total;
    let mut mass = 0.0;
    let mut keep = by_prob.len();
    for (i, &t) in by_prob.iter().enumerate() {
        mass += weight_of(t);
        if mass >= target {
            keep = i + 1;
            break;
        }
    }
    by_prob.truncate(keep);
    by_prob.sort_unstable();
    *cand = by_prob;
}

/// Inverse CDF over the candidates' renormalised probabilities, in token id order, with
/// f64 accumulation. None when no candidate has weight.
fn draw(cand: &[u32], row: &[f32], max: f32, uniform: f64) -> Option<u32> {
    let weights: Vec<f64> = cand.iter().map(|&t| weight(row[t as usize], max)).collect();
    let total: f64 = weights.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let target = uniform * total;
    let mut acc = 0.0;
    for (&t, &w) in cand.iter().zip(&weights) {
        acc += w;
        if acc > target {
            return Some(t);
        }
    }
    // Rounding left the target at the very top: take the last token with weight.
    cand.iter()
        .zip(&weights)
        .rev()
        .find(|&(_, &w)| w > 0.0)
        .map(|(&t, _)| t)
}

/// Logprobs of the raw row: the sampled token's, its rank (vLLM counts the tokens whose
/// logprob is ≥ the sampled one's, so ties rank it last among equals), and the top k.
fn token_logprobs(raw: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let lse = log_sum_exp(raw);
    // An all -inf row has no distribution: report -inf rather than NaN.
    let logprob = |t: u32| match f64::from(raw[t as usize]) - lse {
        lp if lp.is_nan() => f32::NEG_INFINITY,
        lp => lp as f32,
    };
    let sampled = raw[token as usize];
    let rank = raw.iter().filter(|&&x| x >= sampled).count().max(1) as u32;
    let top = top_k_ids(raw, k)
        .into_iter()
        .map(|t| (t, logprob(t)))
        .collect();
    TokenLogprobs {
        token_id: token,
        logprob: logprob(token),
        rank,
        top,
    }
}

/// log Σ exp(x) in f64; -inf for an all -inf row.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
    f64::from(max) + sum.ln()
}

/// The k largest entries, best first, ties to the lowest id. k is small (≤ 20), so one
/// pass with a sorted k-buffer beats sorting the vocabulary.
fn top_k_ids(row: &[f32], k: usize) -> Vec<u32> {
    let mut top: Vec<u32> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (i, &x) in row.iter().enumerate() {
        if top.len() == k && x <= row[top[k - 1] as usize] {
            continue;
        }
        let pos = top.partition_point(|&t| row[t as usize] >= x);
        top.insert(pos, i as u32);
        top.truncate(k);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn random_logits(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-5.0f32..5.0)).collect()
    }

    fn req<'a>(params: &'a SamplingParams, output: &'a [u32]) -> SamplingRequest<'a> {
        SamplingRequest {
            params,
            prompt_token_ids: &[],
            output_token_ids: output,
            eos_token_ids: &[],
        }
    }

    /// Samples one row with `params`, on a copy of `logits`.
    fn sample_one(
        sampler: &mut Sampler,
        logits: &[f32],
        params: &SamplingParams,
        output: &[u32],
    ) -> (u32, Option<TokenLogprobs>) {
        let mut row = logits.to_vec();
        sampler
            .sample(&mut row, logits.len(), &[req(params, output)])
            .remove(0)
    }

    fn reference_argmax(row: &[f32]) -> u32 {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        row.iter().position(|&x| x == max).unwrap() as u32
    }

    fn softmax(row: &[f32], t: f32) -> Vec<f64> {
        let scaled: Vec<f32> = row.iter().map(|&x| x / t).collect();
        let lse = log_sum_exp(&scaled);
        scaled.iter().map(|&x| (f64::from(x) - lse).exp()).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut sampler = Sampler::new(0);
        let params = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        for _ in 0..50 {
            let logits = random_logits(&mut rng, 1000);
            assert_eq!(
                sample_one(&mut sampler, &logits, &params, &[]).0,
                reference_argmax(&logits)
            );
        }
    }

    #[test]
    fn greedy_ties_go_to_lowest_id() {
        let mut sampler = Sampler::new(0);
        let params = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        assert_eq!(
            sample_one(&mut sampler, &[1.0, 3.0, 0.5, 3.0], &params, &[]).0,
            1
        );
    }

    /// Filters that leave only the top token must behave as greedy, whatever the seed.
    #[test]
    fn degenerate_filters_are_greedy() {
        let mut rng = StdRng::seed_from_u64(2);
        let mut sampler = Sampler::new(7);
        let cases = [
            SamplingParams {
                top_k: 1,
                ..Default::default()
            },
            SamplingParams {
                top_p: 1e-6,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.0,
                ..Default::default()
            },
        ];
        for params in &cases {
            for i in 0..50 {
                let logits = random_logits(&mut rng, 500);
                let seeded = SamplingParams {
                    seed: Some(i),
                    ..params.clone()
                };
                assert_eq!(
                    sample_one(&mut sampler, &logits, params, &[]).0,
                    reference_argmax(&logits),
                    "{params:?}"
                );
                assert_eq!(
                    sample_one(&mut sampler, &logits, &seeded, &[]).0,
                    reference_argmax(&logits),
                    "{params:?}"
                );
            }
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_across_batches_and_samplers() {
        let mut rng = StdRng::seed_from_u64(3);
        let vocab = 200;
        let target = random_logits(&mut rng, vocab);
        let seeded = SamplingParams {
            seed: Some(42),
            temperature: 1.5,
            ..Default::default()
        };
        let other = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let output: Vec<u32> = vec![5, 6, 7];

        let alone = sample_one(&mut Sampler::new(0), &target, &seeded, &output).0;
        for position in 0..3 {
            let mut sampler = Sampler::new(position as u64 + 100);
            let mut batch = Vec::new();
            let mut reqs = Vec::new();
            for slot in 0..3 {
                if slot == position {
                    batch.extend_from_slice(&target);
                    reqs.push(req(&seeded, &output));
                } else {
                    batch.extend(random_logits(&mut rng, vocab));
                    reqs.push(req(&other, &[]));
                }
            }
            assert_eq!(sampler.sample(&mut batch, vocab, &reqs)[position].0, alone);
        }
        // The draw depends on the step: across steps the same seed is not stuck on one token.
        let tokens: std::collections::HashSet<u32> = (0..50)
            .map(|step| sample_one(&mut Sampler::new(0), &target, &seeded, &vec![0; step]).0)
            .collect();
        assert!(tokens.len() > 5);
    }

    #[test]
    fn unseeded_sampling_follows_the_sampler_seed() {
        let mut rng = StdRng::seed_from_u64(4);
        let logits = random_logits(&mut rng, 100);
        let params = SamplingParams::default();
        let run = |seed| {
            let mut sampler = Sampler::new(seed);
            (0..20)
                .map(|_| sample_one(&mut sampler, &logits, &params, &[]).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(9), run(9));
        assert_ne!(run(9), run(10));
    }

    #[test]
    fn seeded_frequencies_match_softmax() {
        let logits = [1.0f32, 0.5, -0.3, 2.0, 0.0];
        let t = 0.8;
        let expected = softmax(&logits, t);
        let n = 20_000;
        let mut counts = [0usize; 5];
        let mut sampler = Sampler::new(0);
        for seed in 0..n {
            let params = SamplingParams {
                seed: Some(seed as u64),
                temperature: t,
                ..Default::default()
            };
            counts[sample_one(&mut sampler, &logits, &params, &[]).0 as usize] += 1;
        }
        for (c, p) in counts.iter().zip(&expected) {
            let freq = *c as f64 / n as f64;
            // 5 standard deviations of a binomial frequency at p ≤ 0.5 with n = 20k is ≤ 0.018.
            assert!((freq - p).abs() < 0.015, "freq {freq} vs p {p}");
        }
    }

    #[test]
    fn top_k_and_top_p_never_emit_excluded_tokens() {
        let mut rng = StdRng::seed_from_u64(5);
        let mut sampler = Sampler::new(5);
        for i in 0..200 {
            let logits = random_logits(&mut rng, 50);
            let probs = softmax(&logits, 1.0);
            let mut order: Vec<usize> = (0..50).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));

            let top_k = SamplingParams {
                top_k: 5,
                seed: Some(i),
                ..Default::default()
            };
            let t = sample_one(&mut sampler, &logits, &top_k, &[]).0 as usize;
            assert!(order[..5].contains(&t));

            let top_p = SamplingParams {
                top_p: 0.5,
                seed: Some(i),
                ..Default::default()
            };
            let mut mass = 0.0;
            let nucleus: Vec<usize> = order
                .iter()
                .copied()
                .take_while(|&j| {
                    let before = mass;
                    mass += probs[j];
                    before < 0.5
                })
                .collect();
            let t = sample_one(&mut sampler, &logits, &top_p, &[]).0 as usize;
            assert!(nucleus.contains(&t), "{t} not in {nucleus:?}");
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = [0.0f32, -0.1, -5.0, -6.0];
        let mut sampler = Sampler::new(0);
        for seed in 0..500 {
            let params = SamplingParams {
                min_p: 0.1,
                seed: Some(seed),
                ..Default::default()
            };
            assert!(sample_one(&mut sampler, &logits, &params, &[]).0 < 2);
        }
    }

    #[test]
    fn penalties_change_exactly_the_expected_logits() {
        let mut rng = StdRng::seed_from_u64(6);
        let vocab = 20;
        let mut logits = random_logits(&mut rng, vocab);
        logits[3] = 2.0;
        logits[4] = -2.0;
        let original = logits.clone();
        let prompt = [3u32, 4, 9, 9];
        let output = [4u32, 7, 7, 7, 25]; // 25 is out of the vocabulary: ignored
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        apply_penalties(&mut logits, &params, &prompt, &output);
        let rep = |x: f32| if x > 0.0 { x / 2.0 } else { x * 2.0 };
        for t in 0..vocab {
            let expected = match t {
                3 | 9 => rep(original[t]),
                4 => rep(original[t]) - 0.5 - 0.25,
                7 => rep(original[t]) - 1.5 - 0.25,
                _ => original[t],
            };
            assert_eq!(logits[t], expected, "token {t}");
        }
        assert_eq!(logits[3], 1.0);
        assert_eq!(logits[4], -4.0 - 0.75);
    }

    #[test]
    fn logit_bias_can_force_a_token() {
        let mut rng = StdRng::seed_from_u64(7);
        let logits = random_logits(&mut rng, 300);
        let mut sampler = Sampler::new(0);
        for temperature in [0.0, 1.0] {
            let params = SamplingParams {
                temperature,
                logit_bias: vec![(123, 100.0)],
                ..Default::default()
            };
            for _ in 0..20 {
                assert_eq!(sample_one(&mut sampler, &logits, &params, &[]).0, 123);
            }
        }
    }

    #[test]
    fn min_tokens_blocks_eos_and_stop_ids() {
        let mut logits = vec![0.0f32; 10];
        logits[2] = 50.0; // eos
        logits[5] = 40.0; // stop token id
        let params = SamplingParams {
            temperature: 0.0,
            min_tokens: 3,
            stop_token_ids: vec![5],
            ..Default::default()
        };
        let mut sampler = Sampler::new(0);
        let with = |output: &[u32], params: &SamplingParams, sampler: &mut Sampler| {
            let mut row = logits.clone();
            let r = SamplingRequest {
                params,
                prompt_token_ids: &[],
                output_token_ids: output,
                eos_token_ids: &[2],
            };
            sampler.sample(&mut row, 10, &[r])[0].0
        };
        assert_ne!(with(&[1, 1], &params, &mut sampler), 2);
        assert_ne!(with(&[1, 1], &params, &mut sampler), 5);
        assert_eq!(with(&[1, 1, 1], &params, &mut sampler), 2);
        let ignore = SamplingParams {
            ignore_eos: true,
            ..params.clone()
        };
        assert_eq!(
            with(&[1], &ignore, &mut sampler),
            2,
            "ignore_eos leaves eos alone, as vLLM"
        );
    }

    #[test]
    fn logprobs_are_normalised_ranked_and_raw() {
        let mut rng = StdRng::seed_from_u64(8);
        let vocab = 1000;
        let mut sampler = Sampler::new(3);
        for i in 0..30 {
            let logits = random_logits(&mut rng, vocab);
            let params = SamplingParams {
                logprobs: Some(5),
                temperature: 0.7,
                repetition_penalty: 1.3,
                seed: Some(i),
                ..Default::default()
            };
            let (token, lp) = sample_one(&mut sampler, &logits, &params, &[1, 2, 3]);
            let lp = lp.expect("logprobs asked");
            let expected = softmax(&logits, 1.0);
            // All logprobs of the raw row sum to one.
            let all: Vec<f32> = expected.iter().map(|p| p.ln() as f32).collect();
            assert!(log_sum_exp(&all).abs() < 1e-4);
            assert_eq!(lp.token_id, token);
            assert!((f64::from(lp.logprob) - expected[token as usize].ln()).abs() < 1e-4);
            let better = logits
                .iter()
                .filter(|&&x| x > logits[token as usize])
                .count();
            assert_eq!(lp.rank as usize, better + 1);
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            let top: Vec<u32> = lp.top.iter().map(|&(t, _)| t).collect();
            assert_eq!(top, order[..5]);
            for &(t, l) in &lp.top {
                assert!((f64::from(l) - expected[t as usize].ln()).abs() < 1e-4);
            }
        }
        let params = SamplingParams {
            logprobs: Some(0),
            ..Default::default()
        };
        let (_, lp) = sample_one(&mut sampler, &random_logits(&mut rng, vocab), &params, &[]);
        assert!(lp.expect("logprobs asked").top.is_empty());
    }

    #[test]
    fn nan_and_inf_do_not_panic() {
        let mut sampler = Sampler::new(0);
        let rows: [&[f32]; 4] = [
            &[f32::NAN, 1.0, f32::INFINITY, 0.0],
            &[f32::NAN; 4],
            &[f32::NEG_INFINITY; 4],
            &[f32::INFINITY, f32::INFINITY, 0.0, f32::NAN],
        ];
        for row in rows {
            for temperature in [0.0, 1.0] {
                let params = SamplingParams {
                    temperature,
                    top_p: 0.9,
                    top_k: 2,
                    min_p: 0.1,
                    logprobs: Some(2),
                    ..Default::default()
                };
                let (t, _) = sample_one(&mut sampler, row, &params, &[]);
                assert!(t < 4);
            }
        }
        let (t, _) = sample_one(&mut sampler, rows[0], &SamplingParams::default(), &[]);
        assert_eq!(t, 2, "+inf dominates");
    }
}
