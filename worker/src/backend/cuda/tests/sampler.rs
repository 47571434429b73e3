//! The GPU sampler against the CPU sampler: plain rows, every parameter (penalties, bias,
//! min_tokens, logprobs), the split-row fast path (its top-k / top-p merge included), and
//! one step's sampling time.

use super::*;
use vllm_kernels::cuda::{SampleRowEx, SamplingBatch};

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

/// The fast path (rows without processors or logprobs: greedy, temperature, min-p) vs the
/// CPU sampler, exactly: seeded draws over coarse-grid rows (ties everywhere), rows with
/// NaN and +inf, all -inf rows, a race row whose finite logits all overflow as they are
/// scaled, a vocabulary whose bf16 rows are not 16-byte aligned
/// (the scalar loads) and one with a short last chunk. Top-p rows sit in the same batch
/// (over these flat rows mostly handed to the general kernel), so both kernels write rows.
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
            // Finite logits that all overflow to -inf once scaled (row 19 races at T = 0.6):
            // the token is the raw argmax, the CPU's fallback.
            logits[19 * vocab..20 * vocab].fill(-3.0e38);
            logits[19 * vocab + vocab / 3] = -2.5e38;
            let t = b.upload(&HostTensor::new(vec![n, vocab], logits)).unwrap();
            let host = b.to_host(&t).unwrap().data;
            // With top-p rows the batch takes the top kernels (plain temperature rows raced
            // in the first); with plain temperature rows, `sample_fast_max_race` races
            // those and `sample_fast_draw` draws the min-p rows; with neither,
            // `sample_fast_max` and its finish take the maxima.
            for batch in ["top", "race", "max"] {
                let top_batch = batch == "top";
                let params: Vec<SamplingParams> = (0..n)
                    .map(|r| {
                        let (temperature, min_p, top_p) = match r % 6 {
                            0 => (0.0, 0.0, 1.0),
                            2 => (1.0, 0.05, 1.0),
                            4 => (0.3, 0.2, 1.0),
                            _ if batch == "max" => (0.0, 0.0, 1.0),
                            1 => (0.6, 0.0, 1.0),
                            3 => (1.7, 0.0, 1.0),
                            _ if top_batch => (0.8, 0.0, 0.9), // top-p: mostly handed back
                            _ => (1.1, 0.0, 1.0),
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
                let reqs = without_history(&params);
                let gpu = sampling::sample_with(&b, &t, &reqs, 0, true).unwrap();
                let cpu = Sampler::new(0).sample(&mut host.clone(), vocab, &reqs);
                for (r, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
                    if g.0 == c.0 {
                        agree += 1;
                    } else {
                        println!(
                            "SAMPLER-FAST {} vocab {vocab} {batch} batch row {r}: gpu {} cpu {}",
                            dtype.name(),
                            g.0,
                            c.0
                        );
                    }
                    total += 1;
                }
            }
        }
    }
    println!("SAMPLER-FAST-CHECK gpu vs cpu tokens agree {agree}/{total}");
    assert_eq!(agree, total, "the fast GPU sampler differs from the CPU");
}

/// One request per parameter set, with no prompt, output or eos tokens.
fn without_history(params: &[SamplingParams]) -> Vec<SamplingRequest<'_>> {
    params
        .iter()
        .map(|p| SamplingRequest {
            params: p,
            prompt_token_ids: &[],
            output_token_ids: &[],
            eos_token_ids: &[],
        })
        .collect()
}

/// Logits of the top-k / top-p check: coarse-grid rows (ties everywhere) where most rows
/// get a few row-specific spikes (two of them tied), so that their top-p mass sits in a few
/// tokens, as a model's does; every fifth row stays flat (top-p there leaves the
/// candidates: handed back). Row 3: NaN and +inf; row 8: all -inf; row 13: spikes and
/// -inf.
fn top_logits(rows: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let mut logits = sampler_rows(rows, vocab, seed);
    for r in 0..rows {
        if r % 5 == 4 {
            continue;
        }
        let row = &mut logits[r * vocab..(r + 1) * vocab];
        for (i, v) in [14.0f32, 13.0, 13.0, 12.5, 12.0].into_iter().enumerate() {
            row[(r * 7919 + i * 104_729) % vocab] = v;
        }
    }
    for (i, v) in [
        (1, f32::NAN),
        (vocab - 3, f32::INFINITY),
        (vocab / 2, f32::NAN),
    ] {
        logits[3 * vocab + i] = v;
    }
    logits[8 * vocab..9 * vocab].fill(f32::NEG_INFINITY);
    for i in (0..vocab).step_by(3) {
        logits[13 * vocab + i] = f32::NEG_INFINITY;
    }
    logits
}

/// The parameters of row `r` of the top-k / top-p check: k = 1, k over the candidates'
/// capacity, p = 1, top-p alone (which needs the row's whole mass), min-p with each, and
/// greedy and plain temperature rows in the same batch.
fn top_params(r: usize) -> SamplingParams {
    let (temperature, top_k, top_p, min_p) = match r % 12 {
        0 => (0.6, 20, 0.95, 0.0),
        1 => (1.0, 1, 1.0, 0.0),
        2 => (0.8, 3000, 1.0, 0.0),
        3 => (0.9, 50, 1.0, 0.0),
        4 => (0.7, 0, 0.9, 0.0),
        5 => (1.2, 0, 0.5, 0.02),
        6 => (0.6, 40, 0.8, 0.01),
        7 => (0.0, 20, 0.95, 0.0),
        8 => (0.7, 0, 0.999, 0.0),
        9 => (0.6, -1, 1.0, 0.0),
        10 => (1.5, 3000, 0.97, 0.1),
        _ => (0.6, 200, 0.0, 0.0),
    };
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        seed: Some(7000 + r as u64),
        ..Default::default()
    }
}

/// Top-k / top-p rows on the fast path vs the CPU sampler, exactly, in bf16 and f32 over
/// vocabularies of 1,000, 50,001 and 151,936: the merge's tokens where it is exact, the
/// general kernel's where the fast path hands a row back. Prints how many rows were handed
/// back; at least one top row must stay on the fast path in each batch.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gpu_top_sampler_matches_cpu_sampler() {
    if !gpu_present() {
        return;
    }
    let (mut agree, mut total) = (0, 0);
    for dtype in [DType::BF16, DType::F32] {
        let b = CudaBackend::new(0, dtype).unwrap();
        for vocab in [1000usize, 50_001, 151_936] {
            let n = 120;
            let logits = top_logits(n, vocab, 57 + vocab as u64);
            let t = b.upload(&HostTensor::new(vec![n, vocab], logits)).unwrap();
            let host = b.to_host(&t).unwrap().data;
            let params: Vec<SamplingParams> = (0..n).map(top_params).collect();
            let reqs = without_history(&params);
            let rows: Vec<SampleRowEx> = params
                .iter()
                .map(|p| SampleRowEx::plain(sampling::row_params(&b, p, 0, 0)))
                .collect();
            let top_rows = rows.iter().filter(|r| r.is_top()).count();
            let gpu = b
                .ops
                .sample_tokens_ex(&t.buf, vocab, &SamplingBatch::plain(&rows), true)
                .unwrap();
            let cpu = Sampler::new(0).sample(&mut host.clone(), vocab, &reqs);
            println!(
                "SAMPLER-TOP {} vocab {vocab}: {} of {top_rows} top rows handed back",
                dtype.name(),
                gpu.handed_back
            );
            assert!(gpu.handed_back < top_rows, "every top row was handed back");
            for (r, (g, c)) in gpu.tokens.iter().zip(&cpu).enumerate() {
                if *g == c.0 as i32 {
                    agree += 1;
                } else {
                    println!(
                        "SAMPLER-TOP {} vocab {vocab} row {r} ({:?}): gpu {g} cpu {}",
                        dtype.name(),
                        params[r],
                        c.0
                    );
                }
                total += 1;
            }
        }
    }
    println!("SAMPLER-TOP-CHECK gpu vs cpu tokens agree {agree}/{total}");
    assert_eq!(
        agree, total,
        "the top-k / top-p fast path differs from the CPU"
    );
}
