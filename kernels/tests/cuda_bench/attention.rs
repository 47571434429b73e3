//! Decode attention at a serving batch's shapes: the kernels and their plans, and the
//! partition choices of small batches of long sequences.

use super::*;

pub(super) fn attention(dev: &CudaDevice, ops: &CudaOps) {
    let blocks_per_seq = (CONTEXT + 1).div_ceil(BS);
    let num_blocks = SEQS * blocks_per_seq;
    // Blocks of a sequence spread over the cache, as after many allocations.
    let block_tables: Vec<i32> = (0..SEQS * blocks_per_seq)
        .map(|i| ((i * 7919) % num_blocks) as i32)
        .collect();
    let kv = num_blocks * BS * HKV * D;
    let key_cache = random(dev, kv, 1);
    let value_cache = random(dev, kv, 2);
    let q = random(dev, SEQS * HQ * D, 3);
    let seq_lens = vec![(CONTEXT + 1) as i32; SEQS];
    let qsl: Vec<i32> = (0..=SEQS as i32).collect();
    let bt = dev.stream.clone_htod(&block_tables).expect("upload");
    let bytes = (SEQS * (CONTEXT + 1) * HKV * D * 2 * 2) as f64;
    for (name, kernels) in [
        ("cuda-core", AttentionKernels::CUDA_CORE),
        ("flash", AttentionKernels::flash(true)),
    ] {
        let plan = AttentionPlan::new(&qsl, &seq_lens, HQ, HKV, ops.num_sms, kernels).unwrap();
        let inputs = PlanInputs::new(dev, &seq_lens, &qsl, blocks_per_seq, &plan);
        let meta = inputs.meta(&bt, &plan);
        let dims = AttentionDims {
            num_tokens: SEQS,
            num_q_heads: HQ,
            num_kv_heads: HKV,
            head_dim: D,
            block_size: BS,
        };
        let mut out = ops.alloc(SEQS * HQ * D).unwrap();
        let s = time(dev, 20, || {
            ops.paged_attention(&q, &key_cache, &value_cache, &meta, dims, 0.088, &mut out)
                .unwrap()
        });
        let what = format!(
            "attention {name} decode {SEQS}x{} (partitions {})",
            CONTEXT + 1,
            plan.decode_partitions
        );
        report(&what, s, bytes);
        report("  x 28 layers", s * LAYERS as f64, bytes * LAYERS as f64);
    }
}

/// Decode attention alone at the shapes of issue 11: batch 256 × 601 keys, batch 256
/// of 100 to 1,023 keys (nanovllm-256's mix of lengths, as `decode_batch_bench` in the
/// worker) and batch 1 × 384 keys (single-request latency, the combine included), for
/// Qwen3-0.6B (16 q / 8 kv heads) and Qwen3-8B (32 / 8), head size 128, bf16. Each row
/// also tries other keys per partition than the plan's (`part N`: one partition of 2048
/// was the batch-256 CUDA graph's before `DEC_MIN_GRID_PARTITIONS`), and prints the
/// largest difference from the output of the plan's own partitions.
///
///   cuda_bench decode_attention --ignored --nocapture   (scripts/gpu_round.sh kernel-bench)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh kernel-bench runs it"]
fn decode_attention() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let ragged = spread(256, 100, 1023);
    let big = [2048, 1024, 512, 256, 128];
    let cases: [(Vec<i32>, &[usize]); 3] = [
        (vec![601; 256], &big),
        (ragged, &big),
        (vec![384], &[64, 128, 256]),
    ];
    for (lens, partitions) in cases {
        decode_plan_rows(&dev, &ops, "decode_attention", lens, partitions, true);
    }
}

/// Decode attention at the later states of nanovllm-256 (prompts of 100–1,023 tokens,
/// outputs of 100–1,024, so as sequences finish the batch shrinks and the rest grow), and
/// at small batches of long sequences, as `decode_attention`: the plan (what the model's
/// CUDA graph of the batch's bucket runs, `DecodeGrid`) against fixed partitions.
///
///   cuda_bench decode_attention_late --ignored --nocapture   (gpu_round.sh decode-late)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh decode-late runs it"]
fn decode_attention_late() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    for lens in [
        spread(192, 300, 1_600),
        spread(128, 600, 1_900),
        spread(64, 1_000, 2_000),
        spread(32, 1_200, 2_000),
        spread(16, 1_200, 2_000),
        spread(8, 1_500, 2_000),
        spread(8, 300, 600),
        spread(4, 1_000, 2_000),
        spread(2, 1_000, 2_000),
        vec![384],
        vec![1_000],
        vec![2_000],
        vec![8_000],
    ] {
        let partitions = [2048, 1024, 512, 256, 128, 64, 32];
        decode_plan_rows(&dev, &ops, "decode_late", lens, &partitions, false);
    }
}

/// Decode attention at nanovllm-256's middle states, 64–128 sequences: around the grid's
/// switch to whole sequences (`DecodeGrid::whole_sequences`, from 66 sequences of 8 kv heads
/// on an H100: a block per sequence and kv head, about one wave of blocks). B sequences are
/// alive at about step 100 + 924 · (1 − B/256), so they hold that many keys past prompts of
/// 100–1,023. The plan against fixed partitions, as `decode_attention_late`.
///
///   cuda_bench decode_attention_mid --ignored --nocapture
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_attention_mid() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let partitions = [2048, 1024, 512, 256];
    for seqs in [64, 72, 88, 104, 128] {
        let lens = nanovllm_batch(seqs, 100 + 924 * (256 - seqs as i32) / 256);
        decode_plan_rows(&dev, &ops, "decode_mid", lens, &partitions, false);
    }
}

/// What the fixed grid's partitions past every sequence's end cost a whole-sequence grid:
/// its plan (at least `DEC_MIN_GRID_PARTITIONS`, all but the first exiting at once)
/// against one partition of 2,048 keys, alternating four times, at nanovllm-256's states
/// (a step earlier than `decode_attention_mid`'s).
///
///   cuda_bench decode_attention_empty_partitions --ignored --nocapture
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_attention_empty_partitions() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    for _ in 0..4 {
        for seqs in [256, 192, 128, 104, 88, 72] {
            let lens = nanovllm_batch(seqs, 924 * (256 - seqs as i32) / 256);
            decode_plan_rows(&dev, &ops, "decode_empty", lens, &[2048], false);
        }
    }
}

/// Decode attention with each kv head's GQA group split over 1, 2, 4 or 8 blocks
/// (`AttentionPlan::split_decode_group`; the rows of one shape share the planned
/// partitions): Qwen3-0.6B's heads (16 q / 8 kv), Qwen3-8B's (32 / 8), a group of
/// 8 over 8 kv heads (Qwen3-32B, Llama-3.1-70B), and the TP=4 ranks of Llama-3.1-70B
/// (16 / 2) and of Qwen3-8B (8 / 2). Each row: µs, and the largest difference from the
/// unsplit output.
///
///   cuda_bench decode_attention_q_split --ignored --nocapture   (gpu_round.sh decode-q-split)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh decode-q-split runs it"]
fn decode_attention_q_split() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    for lens in [
        vec![200],
        vec![384],
        vec![1_000],
        vec![4_000],
        spread(2, 1_000, 2_000),
        spread(4, 1_000, 2_000),
        spread(8, 300, 600),
        spread(8, 1_500, 2_000),
        spread(16, 1_200, 2_000),
        spread(32, 1_200, 2_000),
        spread(64, 1_000, 2_000),
        spread(128, 600, 1_900),
        spread(256, 100, 1_023),
    ] {
        let mut shape = DecodeShape::new(&dev, lens);
        for (model, hq, hkv) in [
            ("0.6B", HQ, HKV),
            ("8B", 32, HKV),
            ("g8", 64, HKV),
            ("70B/4", 16, 2),
            ("8B/4", 8, 2),
        ] {
            shape.set_heads(&dev, hq, hkv);
            let group = hq / hkv;
            let plan = shape.plan(&ops, None);
            // The whole group's output (split 1, the first run), which the others match.
            let mut reference = None;
            for split in [1, 2, 4, 8]
                .into_iter()
                .filter(|s| group.is_multiple_of(*s))
            {
                let mut split_plan = plan.clone();
                split_plan.split_decode_group(group, split).unwrap();
                let (s, out) = shape.run(&dev, &ops, &split_plan);
                let reference: &Vec<f32> = reference.get_or_insert_with(|| out.clone());
                println!(
                    "BENCH decode_q_split {model} {}x{} part {}x{} split {split} (g{}){} \
                     {:>8.2} us max|diff| {:.2e}",
                    shape.seqs,
                    shape.keys,
                    plan.decode_partitions,
                    plan.decode_partition,
                    split_plan.decode_group,
                    if split == plan.decode_q_split {
                        " plan"
                    } else {
                        ""
                    },
                    s * 1e6,
                    max_abs_diff(&out, reference)
                );
            }
        }
    }
}

/// The lengths of `seqs` sequences, `step` tokens past prompts spread over 100–1,023.
fn nanovllm_batch(seqs: usize, step: i32) -> Vec<i32> {
    spread(seqs, step + 100, step + 1023)
}

/// One `BENCH <bench>` row per (model, plan) for sequences of `lens` keys: the planned
/// partition first, then each of `partitions` (skipping those past the shared memory a
/// block takes without opting in, or, for one sequence, which keeps the grid's partition
/// count, too short for its keys), each with its largest difference from the planned
/// output. `batch_order`: ragged batches also run each plan in the batch's own order
/// instead of longest first.
fn decode_plan_rows(
    dev: &CudaDevice,
    ops: &CudaOps,
    bench: &str,
    lens: Vec<i32>,
    partitions: &[usize],
    batch_order: bool,
) {
    let (seqs, mean) = (lens.len(), lens.iter().sum::<i32>() as usize / lens.len());
    let mut shape = DecodeShape::new(dev, lens);
    let ragged = shape.keys != mean;
    for (model, hq) in [("0.6B", HQ), ("8B", 32), ("g8", 64)] {
        shape.set_q_heads(dev, hq);
        let reference_plan = shape.plan(ops, None);
        let (_, reference) = shape.run(dev, ops, &reference_plan);
        let row = |what: &str, plan: &AttentionPlan| {
            let (s, out) = shape.run(dev, ops, plan);
            let diff = max_abs_diff(&out, &reference);
            println!(
                "BENCH {bench} {what:<52} {:>8.2} us {:>6.3} TB/s max|diff| {diff:.2e}",
                s * 1e6,
                shape.bytes() / s / 1e12
            );
        };
        let planned = std::iter::once(None).chain(partitions.iter().map(|&p| Some(p)));
        for partition in planned {
            let plan = shape.plan(ops, partition);
            // The kernel's static shared memory (about 1 KB) counts against the same 48 KB
            // a launch may take without opting in.
            if plan.decode_shared_bytes(D) + 2 * 1024 > 48 * 1024
                || plan.decode_partitions * plan.decode_partition < shape.keys
            {
                continue;
            }
            let what = format!(
                "decode {model} {seqs}x{mean}{} {} part {}x{}",
                if ragged { "~" } else { "" },
                if partition.is_none() { "plan" } else { "fixed" },
                plan.decode_partitions,
                plan.decode_partition
            );
            row(&what, &plan);
            if batch_order && ragged {
                // The plan's longest-first order against the batch's own.
                let mut in_batch_order = plan.clone();
                in_batch_order.decode_seqs.sort();
                row(&format!("{what} batch order"), &in_batch_order);
            }
        }
    }
}

/// The largest |a - b|, NaN if any element is NaN.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| {
        let d = (x - y).abs();
        if m.is_nan() || d.is_nan() {
            f32::NAN
        } else {
            m.max(d)
        }
    })
}

/// Prefill attention (the tensor-core tiles of `paged_attention_prefill`): nanovllm-256's
/// prefill step (14 prompts of 100–1,023 tokens, ~8,000), one long prompt, and chunks
/// after cached prefixes, at Qwen3-0.6B's and Qwen3-8B's heads (8 kv heads of 128). Each
/// row prints µs a call, TFLOP/s (causal: 4·D FLOPs a q head and visible key), and the
/// largest difference from the CUDA-core kernel's output (f32 math, unrounded P).
///
///   cuda_bench prefill_attention --ignored --nocapture
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_attention() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    // `VLLM_BENCH_CASE`: only the row of that name (one row under ncu).
    let only = std::env::var("VLLM_BENCH_CASE").unwrap_or_default();
    let nanovllm: Vec<(usize, usize)> = spread(14, 100, 1023)
        .iter()
        .map(|&n| (n as usize, 0))
        .collect();
    for (name, seqs) in [
        ("14 prompts of 100-1,023", nanovllm),
        ("1 prompt of 8,192", vec![(8192, 0)]),
        ("2,048 after 6,144 cached", vec![(2048, 6144)]),
        // A 32,768-token prompt's last chunk, and a chat turn after a cached conversation.
        ("8,192 after 24,576 cached", vec![(8192, 24576)]),
        ("512 after 3,584 cached", vec![(512, 3584)]),
    ] {
        for (model, hq) in [("0.6B", HQ), ("8B", 32)] {
            let what = format!("{model} {name}");
            if only.is_empty() || what == only {
                prefill_row(&dev, &ops, &what, hq, &seqs);
            }
        }
    }
}

/// One `BENCH prefill_attention` row: sequences of (new tokens, cached tokens), their
/// blocks spread over the cache.
fn prefill_row(dev: &CudaDevice, ops: &CudaOps, what: &str, hq: usize, seqs: &[(usize, usize)]) {
    let tokens: usize = seqs.iter().map(|&(n, _)| n).sum();
    let seq_lens: Vec<i32> = seqs.iter().map(|&(n, c)| (n + c) as i32).collect();
    let qsl: Vec<i32> = std::iter::once(0)
        .chain(seqs.iter().scan(0, |t, &(n, _)| {
            *t += n as i32;
            Some(*t)
        }))
        .collect();
    let max_blocks = seq_lens
        .iter()
        .map(|&l| (l as usize).div_ceil(BS))
        .max()
        .unwrap();
    let num_blocks = seqs.len() * max_blocks;
    let tables: Vec<i32> = (0..num_blocks)
        .map(|i| ((i * 7919) % num_blocks) as i32)
        .collect();
    let kv = num_blocks * BS * HKV * D;
    let (key_cache, value_cache) = (random(dev, kv, 1), random(dev, kv, 2));
    let q = random(dev, tokens * hq * D, 3);
    let bt = dev.stream.clone_htod(&tables).expect("upload");
    let flops: f64 = seqs
        .iter()
        .map(|&(n, c)| (n * c + n * (n + 1) / 2) as f64 * (hq * D * 4) as f64)
        .sum();
    let dims = AttentionDims {
        num_tokens: tokens,
        num_q_heads: hq,
        num_kv_heads: HKV,
        head_dim: D,
        block_size: BS,
    };
    let run = |kernels: AttentionKernels, iters: usize| {
        let plan = AttentionPlan::new(&qsl, &seq_lens, hq, HKV, ops.num_sms, kernels).unwrap();
        let inputs = PlanInputs::new(dev, &seq_lens, &qsl, max_blocks, &plan);
        let meta = inputs.meta(&bt, &plan);
        let mut out = ops.alloc(tokens * hq * D).unwrap();
        let s = time(dev, iters, || {
            ops.paged_attention(&q, &key_cache, &value_cache, &meta, dims, 0.088, &mut out)
                .unwrap()
        });
        let bytes = dev.stream.clone_dtoh(&*out).expect("download");
        (s, bytes)
    };
    let (s, out) = run(AttentionKernels::flash(true), 20);
    let (_, reference) = run(AttentionKernels::CUDA_CORE, 1);
    let diff = max_abs_diff(&DType::BF16.decode(&out), &DType::BF16.decode(&reference));
    // The output's bits, to compare builds of the kernel.
    let bits = out.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    println!(
        "BENCH prefill_attention {what:<32} {tokens:>6} tokens {:>9.1} us {:>6.1} TFLOP/s max|diff| {diff:.2e} bits {bits:016x}",
        s * 1e6,
        flops / s / 1e12,
    );
}
