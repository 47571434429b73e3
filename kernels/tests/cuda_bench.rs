//! Kernel benchmarks at the shapes of a batch-256 decode step of Qwen3-0.6B (the
//! nanovllm-256 throughput run), each printed as a `BENCH` line with its time and its
//! bytes over that time, so a step's cost can be split by kernel:
//!
//!   cuda_bench --ignored --nocapture        (scripts/gpu_round.sh kernel-bench)
//!
//! Ignored like every GPU test (nothing to measure without a GPU); the numbers are
//! figures, not assertions.

mod common;

use std::time::Instant;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use vllm_kernels::cuda::{
    AttentionDims, AttentionKernels, AttentionMeta, AttentionPlan, CudaDevice, CudaOps, DType,
    Gemm, SampleRow, SampleRowEx, SamplingBatch,
};

const SEQS: usize = 256;
const CONTEXT: usize = 600;
const HIDDEN: usize = 1024;
const HQ: usize = 16;
const HKV: usize = 8;
const D: usize = 128;
const BS: usize = 16;
const VOCAB: usize = 151_936;
const LAYERS: usize = 28;

/// Mean seconds of `f` over `iters` runs after `iters / 4 + 1` warm-up runs.
fn time(dev: &CudaDevice, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters / 4 + 1 {
        f();
    }
    dev.synchronize().expect("sync");
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    dev.synchronize().expect("sync");
    t.elapsed().as_secs_f64() / iters as f64
}

/// Mean seconds of one `f`, from a CUDA graph of `iters` calls replayed five times after a
/// warm-up replay: kernels back to back without the host's launch cost, which is larger
/// than a thin GEMM of a few microseconds. The first call runs outside the capture, so
/// cuBLAS's first-call setup is not captured.
fn time_graph(dev: &CudaDevice, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    dev.synchronize().expect("sync");
    let stream = &dev.stream;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    for _ in 0..iters {
        f();
    }
    let graph = stream
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture")
        .expect("a graph");
    graph.launch().expect("replay");
    dev.synchronize().expect("sync");
    let t = Instant::now();
    for _ in 0..5 {
        graph.launch().expect("replay");
    }
    dev.synchronize().expect("sync");
    t.elapsed().as_secs_f64() / (5 * iters) as f64
}

fn report(what: &str, seconds: f64, bytes: f64) {
    println!(
        "BENCH kernel {what:<52} {:>9.1} us {:>7.0} GB/s",
        seconds * 1e6,
        bytes / seconds / 1e9
    );
}

/// Random values in [-1, 1).
fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Random bf16 data (values in [-1, 1)), so no kernel runs on zeros.
fn random(dev: &CudaDevice, n: usize, seed: u64) -> CudaSlice<u8> {
    dev.stream
        .clone_htod(&DType::BF16.encode(&random_values(n, seed)))
        .expect("upload")
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh kernel-bench runs it"]
fn decode_step_kernels() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    attention(&dev, &ops);
    sampling(&dev, &ops);
    gemms(&dev);
}

/// The sampling benchmarks alone (`scripts/gpu_round.sh sampling-bench` runs them, then
/// each case under ncu).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh sampling-bench runs it"]
fn sampling_kernels() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    sampling(&dev, &ops);
}

fn attention(dev: &CudaDevice, ops: &CudaOps) {
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
    let ints = |v: &[i32]| dev.stream.clone_htod(v).expect("upload");
    let (bt, sl, ql) = (ints(&block_tables), ints(&seq_lens), ints(&qsl));
    let bytes = (SEQS * (CONTEXT + 1) * HKV * D * 2 * 2) as f64;
    for (name, kernels) in [
        ("cuda-core", AttentionKernels::CUDA_CORE),
        ("flash", AttentionKernels::flash(true)),
    ] {
        let plan = AttentionPlan::new(&qsl, &seq_lens, HQ, HKV, ops.num_sms, kernels).unwrap();
        let (ts, tt, ds, dp) = (
            ints(&plan.tile_seq),
            ints(&plan.tile_token),
            ints(&plan.decode_seqs),
            ints(&[plan.decode_partition as i32]),
        );
        let meta = AttentionMeta {
            block_tables: &bt,
            max_blocks_per_seq: blocks_per_seq,
            seq_lens: &sl,
            query_start_loc: &ql,
            tile_seq: &ts,
            tile_token: &tt,
            decode_seqs: &ds,
            decode_partition: &dp,
            plan: &plan,
        };
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

/// The step inputs an `AttentionPlan` reads, on the device.
struct PlanInputs {
    seq_lens: CudaSlice<i32>,
    query_start_loc: CudaSlice<i32>,
    tile_seq: CudaSlice<i32>,
    tile_token: CudaSlice<i32>,
    decode_seqs: CudaSlice<i32>,
    decode_partition: CudaSlice<i32>,
}

/// One decode-only attention shape for `decode_attention`: `copies` caches of `seqs`
/// sequences of `keys` keys each (blocks spread over the cache), so that the calls of a
/// small shape cycle through more bytes than the 50 MB L2 holds.
struct DecodeShape {
    seqs: usize,
    keys: usize,
    hq: usize,
    blocks_per_seq: usize,
    q: CudaSlice<u8>,
    key_cache: CudaSlice<u8>,
    value_cache: CudaSlice<u8>,
    /// One block table per copy of the cache.
    tables: Vec<CudaSlice<i32>>,
    seq_lens: Vec<i32>,
    qsl: Vec<i32>,
}

impl DecodeShape {
    /// Decode sequences of the given lengths.
    fn new(dev: &CudaDevice, seq_lens: Vec<i32>) -> Self {
        let (seqs, keys) = (
            seq_lens.len(),
            seq_lens.iter().copied().max().unwrap_or(1) as usize,
        );
        let blocks_per_seq = keys.div_ceil(BS);
        let per_copy = seqs * blocks_per_seq;
        let bytes = per_copy * BS * HKV * D * 2 * 2;
        let copies = ((256 << 20) / bytes).clamp(1, 64);
        let num_blocks = per_copy * copies;
        let kv = num_blocks * BS * HKV * D;
        let tables = (0..copies)
            .map(|c| {
                let t: Vec<i32> = (0..per_copy)
                    .map(|i| (c * per_copy + (i * 7919) % per_copy) as i32)
                    .collect();
                dev.stream.clone_htod(&t).expect("upload")
            })
            .collect();
        Self {
            seqs,
            keys,
            hq: 0,
            blocks_per_seq,
            q: random(dev, 1, 3),
            key_cache: random(dev, kv, 1),
            value_cache: random(dev, kv, 2),
            tables,
            seq_lens,
            qsl: (0..=seqs as i32).collect(),
        }
    }

    /// The model's q heads (over the same caches: both models have 8 kv heads of 128).
    fn set_q_heads(&mut self, dev: &CudaDevice, hq: usize) {
        self.hq = hq;
        self.q = random(dev, self.seqs * hq * D, 3);
    }

    /// K and V bytes one call reads.
    fn bytes(&self) -> f64 {
        let keys: i32 = self.seq_lens.iter().sum();
        (keys as usize * HKV * D * 2 * 2) as f64
    }

    /// The flash plan; `partition` replaces its keys per partition: at batch 1 the
    /// fixed grid keeps its partition count (a different `DEC_MIN_PARTITION`), at larger
    /// batches the keys are split over just enough partitions, with shared memory for
    /// that partition.
    fn plan(&self, ops: &CudaOps, partition: Option<usize>) -> AttentionPlan {
        let kernels = AttentionKernels::flash(true);
        let mut plan = AttentionPlan::new(
            &self.qsl,
            &self.seq_lens,
            self.hq,
            HKV,
            ops.num_sms,
            kernels,
        )
        .unwrap();
        if let Some(p) = partition {
            plan.decode_partition = p;
            if self.seqs > 1 {
                plan.decode_partitions = self.keys.div_ceil(p);
                plan.decode_smem_partition = p;
            } else {
                plan.decode_smem_partition = plan.decode_smem_partition.max(p);
            }
        }
        plan
    }

    /// The step inputs `plan` reads, on the device.
    fn upload(&self, dev: &CudaDevice, plan: &AttentionPlan) -> PlanInputs {
        let ints = |v: &[i32]| dev.stream.clone_htod(v).expect("upload");
        PlanInputs {
            seq_lens: ints(&self.seq_lens),
            query_start_loc: ints(&self.qsl),
            tile_seq: ints(&plan.tile_seq),
            tile_token: ints(&plan.tile_token),
            decode_seqs: ints(&plan.decode_seqs),
            decode_partition: ints(&[plan.decode_partition as i32]),
        }
    }

    /// The attention metadata of `plan` over the cache copy of `table`.
    fn meta<'a>(
        &self,
        table: &'a CudaSlice<i32>,
        inputs: &'a PlanInputs,
        plan: &'a AttentionPlan,
    ) -> AttentionMeta<'a> {
        AttentionMeta {
            block_tables: table,
            max_blocks_per_seq: self.blocks_per_seq,
            seq_lens: &inputs.seq_lens,
            query_start_loc: &inputs.query_start_loc,
            tile_seq: &inputs.tile_seq,
            tile_token: &inputs.tile_token,
            decode_seqs: &inputs.decode_seqs,
            decode_partition: &inputs.decode_partition,
            plan,
        }
    }

    fn dims(&self) -> AttentionDims {
        AttentionDims {
            num_tokens: self.seqs,
            num_q_heads: self.hq,
            num_kv_heads: HKV,
            head_dim: D,
            block_size: BS,
        }
    }

    /// Mean seconds of one call with `plan` (in a CUDA graph, cycling over the copies),
    /// and the output of the last call.
    fn run(&self, dev: &CudaDevice, ops: &CudaOps, plan: &AttentionPlan) -> (f64, Vec<f32>) {
        let inputs = self.upload(dev, plan);
        let metas: Vec<AttentionMeta> = self
            .tables
            .iter()
            .map(|bt| self.meta(bt, &inputs, plan))
            .collect();
        let dims = self.dims();
        let mut out = ops.alloc(self.seqs * self.hq * D).unwrap();
        let mut i = 0;
        let iters = if self.seqs > 1 { 10 } else { 200 };
        let s = time_graph(dev, iters, || {
            i = (i + 1) % metas.len();
            let (k, v) = (&self.key_cache, &self.value_cache);
            ops.paged_attention(&self.q, k, v, &metas[i], dims, 0.088, &mut out)
                .unwrap()
        });
        // The output of copy 0, comparable across kernels (each copy holds other values).
        ops.paged_attention(
            &self.q,
            &self.key_cache,
            &self.value_cache,
            &metas[0],
            dims,
            0.088,
            &mut out,
        )
        .unwrap();
        let bytes = dev.stream.clone_dtoh(&*out).expect("download");
        (s, DType::BF16.decode(&bytes))
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
    let ragged: Vec<i32> = (0..256).map(|i| 100 + (i * 379) % 924).collect();
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
    let spread = |n: usize, lo: i32, hi: i32| -> Vec<i32> {
        (0..n as i32)
            .map(|i| lo + (i * 379) % (hi - lo + 1))
            .collect()
    };
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
    for (model, hq) in [("0.6B", HQ), ("8B", 32)] {
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
            if plan.decode_shared_bytes(D) > 48 * 1024
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
fn sampling(dev: &CudaDevice, ops: &CudaOps) {
    // `VLLM_BENCH_CASE`: only the case of that name (one case under ncu).
    let only = std::env::var("VLLM_BENCH_CASE").unwrap_or_default();
    let logits = random(dev, SEQS * VOCAB, 4);
    let peaked = peaked(dev, 4);
    let normal = normal(dev, 4);
    let bytes = (SEQS * VOCAB * 2) as f64;
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
        let row = SampleRowEx::plain(SampleRow {
            temperature,
            top_k,
            top_p,
            min_p,
            uniform: 0.37,
        });
        let rows = vec![row; SEQS];
        let batch = SamplingBatch::plain(&rows);
        // One checked call first: how many rows the fast path handed back.
        let back = ops.sample_tokens_ex(x, VOCAB, &batch, true).unwrap();
        let s = time(dev, 20, || {
            ops.sample_tokens_ex(x, VOCAB, &batch, false).unwrap();
        });
        report(&format!("sample_tokens_ex {name} {SEQS}x{VOCAB}"), s, bytes);
        // As the worker's overlapped steps sample: nothing waits for the tokens, so the
        // calls queue back to back and this is the GPU's time a call (the rows' copy in,
        // the launches with their dependent-launch overlap, the tokens' copy out).
        let mut out = dev.stream.alloc_zeros::<i32>(SEQS).unwrap();
        let s = time(dev, 50, || {
            ops.sample_tokens_on_device(x, VOCAB, &batch, &mut out)
                .unwrap();
        });
        report(&format!("sample_tokens_on_device {name}"), s, bytes);
        println!(
            "BENCH sampling   {name}: {} of {SEQS} rows handed to the general kernel",
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

fn gemms(dev: &CudaDevice) {
    let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    let ops = CudaOps::new(dev, DType::BF16).expect("build kernels");
    let mut per_layer = 0.0;
    let mut per_layer_bytes = 0.0;
    for (name, k, n, count) in [
        ("qkv_proj", HIDDEN, (HQ + 2 * HKV) * D, LAYERS),
        ("o_proj", HQ * D, HIDDEN, LAYERS),
        ("gate_up_proj", HIDDEN, 2 * 3072, LAYERS),
        ("down_proj", 3072, HIDDEN, LAYERS),
        ("lm_head", HIDDEN, VOCAB, 1),
    ] {
        let x = random(dev, SEQS * k, 5);
        let w = random(dev, n * k, 6);
        let mut out = ops.alloc(SEQS * n).unwrap();
        let s = time(dev, 20, || {
            gemm.linear(&x, &w, &mut out, SEQS, k, n).unwrap()
        });
        let bytes = ((n * k + SEQS * k + SEQS * n) * 2) as f64;
        let flops = 2.0 * (SEQS * k * n) as f64;
        report(&format!("gemm {name} [{SEQS}x{k}]x[{n}x{k}]T"), s, bytes);
        println!(
            "BENCH kernel   {:.0} TFLOP/s; x {count}: {:.1} us",
            flops / s / 1e12,
            s * count as f64 * 1e6
        );
        if count == LAYERS {
            per_layer += s;
            per_layer_bytes += bytes;
        }
    }
    report(
        "gemms of 28 layers",
        per_layer * LAYERS as f64,
        per_layer_bytes * LAYERS as f64,
    );
}

/// A GEMM of a model: (name, k, n).
type GemmShape = (&'static str, usize, usize);

/// The layer GEMMs and LM head of Qwen3-0.6B and Qwen3-8B.
const MODEL_GEMMS: [(&str, [GemmShape; 5]); 2] = [
    (
        "0.6B",
        [
            ("qkv_proj", 1024, 4096),
            ("o_proj", 2048, 1024),
            ("gate_up_proj", 1024, 6144),
            ("down_proj", 3072, 1024),
            ("lm_head", 1024, VOCAB),
        ],
    ),
    (
        "8B",
        [
            ("qkv_proj", 4096, 6144),
            ("o_proj", 4096, 4096),
            ("gate_up_proj", 4096, 24576),
            ("down_proj", 12288, 4096),
            ("lm_head", 4096, VOCAB),
        ],
    ),
];

/// Copies of one random bf16 matrix of `elems` filling 256 MB (1 to 64 of them), for a
/// GEMM bench to read a different one each call: the 50 MB L2 then holds none, and the
/// figures are HBM figures. Made on the device (generating each on the host would take
/// longer than the whole benchmark).
fn weight_copies(dev: &CudaDevice, elems: usize) -> Vec<CudaSlice<u8>> {
    let w0 = random(dev, elems, 100);
    let copies = ((256 << 20) as f64 / (elems * 2) as f64)
        .ceil()
        .clamp(1.0, 64.0) as usize;
    (0..copies)
        .map(|_| dev.stream.clone_dtod(&w0).expect("copy weights"))
        .collect()
}

/// Decode GEMMs at batch 1–8, cuBLAS against the thin-GEMM kernel (both rows-per-warp
/// variants and the one `gemv` picks), for the layer shapes of Qwen3-0.6B and Qwen3-8B.
/// Each call reads a different copy of the weights, 256 MB in all, so the 50 MB L2 holds
/// none of them and the figures are HBM figures; calls are timed inside a CUDA graph, as
/// the model's decode steps run, so the host's launch cost is not in them.
///
///   cuda_bench thin_gemms --ignored --nocapture    (scripts/gpu_round.sh kernel-bench)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh kernel-bench runs it"]
fn thin_gemms() {
    gemv_table(&MODEL_GEMMS, &[1, 2, 4, 8]);
}

/// One rank's decode GEMMs under tensor parallelism, at batch 1: Qwen3-8B at TP=2 and 4,
/// the Llama-3.1-70B shape at TP=4 (column shards of qkv and gate_up, row shards of o
/// and down, the vocabulary-parallel LM head), as `thin_gemms` times them.
///
///   cuda_bench tp_rank_gemvs --ignored --nocapture    (scripts/gpu_round.sh tp-gemv)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh tp-gemv runs it"]
fn tp_rank_gemvs() {
    const TP_GEMMS: [(&str, [GemmShape; 5]); 3] = [
        (
            "8B TP=2",
            [
                ("qkv_proj", 4096, 3072),
                ("o_proj", 2048, 4096),
                ("gate_up_proj", 4096, 12288),
                ("down_proj", 6144, 4096),
                ("lm_head", 4096, VOCAB / 2),
            ],
        ),
        (
            "8B TP=4",
            [
                ("qkv_proj", 4096, 1536),
                ("o_proj", 1024, 4096),
                ("gate_up_proj", 4096, 6144),
                ("down_proj", 3072, 4096),
                ("lm_head", 4096, VOCAB / 4),
            ],
        ),
        (
            "70B TP=4",
            [
                ("qkv_proj", 8192, 2560),
                ("o_proj", 2048, 8192),
                ("gate_up_proj", 8192, 14336),
                ("down_proj", 7168, 8192),
                ("lm_head", 8192, 128256 / 4),
            ],
        ),
    ];
    gemv_table(&TP_GEMMS, &[1]);
}

/// cuBLAS against `gemv` (both rows-per-warp variants and the one it picks) for each
/// model's shapes at each batch `ms`, and the layer's sum.
fn gemv_table(models: &[(&str, [GemmShape; 5])], ms: &[usize]) {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    for &(model, shapes) in models {
        for &m in ms {
            let (mut layer_blas, mut layer_gemv, mut layer_bytes) = (0.0, 0.0, 0.0);
            for (name, k, n) in shapes {
                let bytes = ((n * k + m * k + m * n) * 2) as f64;
                let ws = weight_copies(&dev, n * k);
                let copies = ws.len();
                let x = random(&dev, m * k, 5);
                let mut out = ops.alloc(m * n).unwrap();
                let mut i = 0;
                let mut next = || {
                    i = (i + 1) % copies;
                    &ws[i]
                };
                let blas = time_graph(&dev, 40, || {
                    gemm.linear(&x, next(), &mut out, m, k, n).unwrap()
                });
                let mut rows = [0.0; 2];
                for (r, t) in rows.iter_mut().enumerate() {
                    *t = time_graph(&dev, 40, || {
                        ops.gemv_with_rows(&x, next(), &mut out, (m, k, n), r + 1)
                            .unwrap()
                    });
                }
                let picked = time_graph(&dev, 40, || {
                    ops.gemv(&x, next(), &mut out, m, k, n).unwrap()
                });
                let what = format!("{model} {name} m={m} [{k}->{n}]");
                report(&format!("{what} cublas"), blas, bytes);
                report(&format!("{what} gemv r1"), rows[0], bytes);
                report(&format!("{what} gemv r2"), rows[1], bytes);
                report(&format!("{what} gemv picked"), picked, bytes);
                if name == "gate_up_proj" && m == 1 {
                    // The activation in the GEMM's epilogue against its own launch.
                    let mut act = ops.alloc(n / 2).unwrap();
                    let unfused = time_graph(&dev, 40, || {
                        let w = next();
                        ops.gemv(&x, w, &mut out, m, k, n).unwrap();
                        ops.silu_and_mul(&out, &mut act, 1, n / 2).unwrap()
                    });
                    let fused = time_graph(&dev, 40, || {
                        ops.gemv_silu_mul(&x, next(), &mut act, k, n / 2).unwrap()
                    });
                    report(&format!("{what} gemv + silu_and_mul"), unfused, bytes);
                    report(&format!("{what} gemv_silu_mul"), fused, bytes);
                }
                if name != "lm_head" {
                    layer_blas += blas;
                    layer_gemv += picked;
                    layer_bytes += bytes;
                }
            }
            report(
                &format!("{model} layer GEMMs m={m} cublas"),
                layer_blas,
                layer_bytes,
            );
            report(
                &format!("{model} layer GEMMs m={m} gemv"),
                layer_gemv,
                layer_bytes,
            );
        }
    }
}

/// The weights of one layer's four GEMMs (Qwen3-0.6B), `copies` of them so that a step of
/// 28 layers reads them from HBM as the model does, and the norm's weight.
struct LayerWeights {
    qkv: Vec<CudaSlice<u8>>,
    o: Vec<CudaSlice<u8>>,
    gate_up: Vec<CudaSlice<u8>>,
    down: Vec<CudaSlice<u8>>,
    norm: CudaSlice<u8>,
}

const QKV_N: usize = (HQ + 2 * HKV) * D;
const INTER: usize = 3072;

impl LayerWeights {
    fn new(dev: &CudaDevice) -> Self {
        let copies = 8; // 8 × 31.5 MB: past the 50 MB L2
        let many = |n: usize, k: usize, seed: u64| -> Vec<CudaSlice<u8>> {
            (0..copies)
                .map(|c| random(dev, n * k, seed + c as u64))
                .collect()
        };
        Self {
            qkv: many(QKV_N, HIDDEN, 200),
            o: many(HIDDEN, HQ * D, 300),
            gate_up: many(2 * INTER, HIDDEN, 400),
            down: many(HIDDEN, INTER, 500),
            norm: random(dev, HIDDEN, 600),
        }
    }
}

/// One batch's decode layer: the norms, GEMMs and SiLU at its rows around decode attention
/// over its sequences (qkv_prepare and the combine left out), with its own activations.
struct LayerBatch {
    rows: usize,
    shape: DecodeShape,
    plan: AttentionPlan,
    inputs: PlanInputs,
    hidden: CudaSlice<u8>,
    residual: CudaSlice<u8>,
    qkv: CudaSlice<u8>,
    attn: CudaSlice<u8>,
    gate_up: CudaSlice<u8>,
    act: CudaSlice<u8>,
}

impl LayerBatch {
    fn new(dev: &CudaDevice, ops: &CudaOps, seq_lens: Vec<i32>) -> Self {
        // Activations are random data, not allocations of `ops`'s pool: the two
        // streams' batches must not share a stream-ordered allocation.
        let rows = seq_lens.len();
        let mut shape = DecodeShape::new(dev, seq_lens);
        shape.set_q_heads(dev, HQ);
        let plan = shape.plan(ops, None);
        let inputs = shape.upload(dev, &plan);
        Self {
            rows,
            hidden: random(dev, rows * HIDDEN, 7),
            residual: random(dev, rows * HIDDEN, 8),
            qkv: random(dev, rows * QKV_N, 9),
            attn: random(dev, rows * HQ * D, 10),
            gate_up: random(dev, rows * 2 * INTER, 11),
            act: random(dev, rows * INTER, 12),
            shape,
            plan,
            inputs,
        }
    }

    /// The residual add and RMS norm before attention and before the MLP.
    fn add_norm(&mut self, ops: &CudaOps, w: &LayerWeights) {
        let (x, r, m) = (&mut self.hidden, &mut self.residual, self.rows);
        ops.fused_add_rms_norm(x, r, &w.norm, m, HIDDEN, 1e-6)
            .unwrap();
    }

    /// Layer `l`'s launches, on the streams of `ops` and `gemm`.
    fn layer(&mut self, ops: &CudaOps, gemm: &Gemm, w: &LayerWeights, l: usize) {
        let (m, c) = (self.rows, l % w.qkv.len());
        self.add_norm(ops, w);
        gemm.linear(&self.hidden, &w.qkv[c], &mut self.qkv, m, HIDDEN, QKV_N)
            .unwrap();
        let sh = &self.shape;
        let meta = sh.meta(&sh.tables[0], &self.inputs, &self.plan);
        ops.paged_attention(
            &sh.q,
            &sh.key_cache,
            &sh.value_cache,
            &meta,
            sh.dims(),
            0.088,
            &mut self.attn,
        )
        .unwrap();
        gemm.linear(&self.attn, &w.o[c], &mut self.hidden, m, HQ * D, HIDDEN)
            .unwrap();
        self.add_norm(ops, w);
        gemm.linear(
            &self.hidden,
            &w.gate_up[c],
            &mut self.gate_up,
            m,
            HIDDEN,
            2 * INTER,
        )
        .unwrap();
        ops.silu_and_mul(&self.gate_up, &mut self.act, m, INTER)
            .unwrap();
        gemm.linear(&self.act, &w.down[c], &mut self.hidden, m, INTER, HIDDEN)
            .unwrap();
    }
}

/// A design probe for nanovllm-256: does a decode step split into two half batches, each
/// on its own stream, overlap one half's GEMMs and small kernels with the other's
/// attention? 28 layers of Qwen3-0.6B's decode work (`LayerBatch`) at 256 sequences of
/// 100–1,023 keys, as one batch, and as two halves of 128 (alternate sequences) one after
/// the other and on two streams, each step a CUDA graph.
///
///   cuda_bench dual_batch_overlap --ignored --nocapture   (scripts/gpu_round.sh kernel-bench)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh kernel-bench runs it"]
fn dual_batch_overlap() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let mut side_ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let side = dev.ctx.new_stream().expect("a second stream");
    side_ops.stream = side.clone();
    let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    let side_gemm = Gemm::new(side.clone(), DType::BF16).unwrap();
    let weights = LayerWeights::new(&dev);
    let lens: Vec<i32> = (0..SEQS as i32).map(|i| 100 + (i * 379) % 924).collect();
    let half =
        |parity: usize| -> Vec<i32> { lens.iter().copied().skip(parity).step_by(2).collect() };
    let mut full = LayerBatch::new(&dev, &ops, lens.clone());
    let (mut a, mut b) = (
        LayerBatch::new(&dev, &ops, half(0)),
        LayerBatch::new(&dev, &ops, half(1)),
    );
    // The model's GEMMs take their tuned choices (its graphs' warm-up tunes); so do these.
    gemm.tuning(|| {
        full.layer(&ops, &gemm, &weights, 0);
        a.layer(&ops, &gemm, &weights, 0);
    });
    side_gemm.tuning(|| b.layer(&side_ops, &side_gemm, &weights, 0));
    side.synchronize().expect("sync");
    let bytes = full.shape.bytes() * LAYERS as f64;
    let step = |name: &str, s: f64| {
        println!(
            "BENCH dual_batch {name:<44} {:>8.3} ms a step ({:.2} TB/s of K and V)",
            s * 1e3,
            bytes / s / 1e12
        );
    };
    step(
        "256, one batch",
        time_graph(&dev, 1, || {
            (0..LAYERS).for_each(|l| full.layer(&ops, &gemm, &weights, l))
        }),
    );
    step(
        "2 x 128, one stream",
        time_graph(&dev, 1, || {
            for l in 0..LAYERS {
                a.layer(&ops, &gemm, &weights, l);
                b.layer(&ops, &gemm, &weights, l);
            }
        }),
    );
    step(
        "2 x 128, two streams",
        time_graph(&dev, 1, || {
            side.join(&dev.stream).expect("fork");
            for l in 0..LAYERS {
                a.layer(&ops, &gemm, &weights, l);
                b.layer(&side_ops, &side_gemm, &weights, l);
            }
            dev.stream.join(&side).expect("join");
        }),
    );
    step(
        "128 alone, one stream",
        time_graph(&dev, 1, || {
            (0..LAYERS).for_each(|l| a.layer(&ops, &gemm, &weights, l))
        }),
    );
}

/// Decode GEMMs at batch 1–32 (Hopper): cuBLAS (after tuning, as the model's graphs run
/// it; gemv at one row) against our warpgroup kernel (`thin_gemm`) at its planned splits,
/// half and twice as many, and the gate/up product with SiLU-and-mul fused against cuBLAS
/// followed by `silu_and_mul`; then each model's four layer GEMMs summed. Weights rotate
/// through 256 MB of copies, so the figures are HBM figures, timed inside a CUDA graph.
///
///   cuda_bench decode_gemms --ignored --nocapture    (scripts/gpu_round.sh gemm-bench)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh gemm-bench runs it"]
fn decode_gemms() {
    use vllm_kernels::cuda::thin_gemm::ThinGemmPlan;
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    if !ops.has_thin_gemm() {
        eprintln!(
            "SKIPPED: thin_gemm is a Hopper (sm_90a) kernel; this is {}",
            dev.arch()
        );
        return;
    }
    let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    const MS: [usize; 6] = [1, 2, 4, 8, 16, 32]; // THIN_GEMM_MAX_M
    for (model, shapes) in MODEL_GEMMS {
        // Per m: the layer's GEMMs by cuBLAS, by thin_gemm, and their bytes.
        let mut layer = [(0.0, 0.0, 0.0); MS.len()];
        for (name, k, n) in shapes {
            let ws = weight_copies(&dev, n * k);
            let copies = ws.len();
            for (mi, m) in MS.into_iter().enumerate() {
                let bytes = ((n * k + m * k + m * n) * 2) as f64;
                let x = random(&dev, m * k, 5);
                let mut out = ops.alloc(m * n).unwrap();
                let mut act = ops.alloc(m * n / 2).unwrap();
                let mut i = 0;
                let mut next = || {
                    i = (i + 1) % copies;
                    &ws[i]
                };
                gemm.tuning(|| gemm.linear(&x, &ws[0], &mut out, m, k, n).unwrap());
                // One row: the model's gemv stands where cuBLAS does at more rows.
                let blas = time_graph(&dev, 40, || {
                    if m == 1 {
                        ops.gemv(&x, next(), &mut out, m, k, n).unwrap()
                    } else {
                        gemm.linear(&x, next(), &mut out, m, k, n).unwrap()
                    }
                });
                let what = format!("{model} {name} m={m} [{k}->{n}]");
                let base = if m == 1 { "gemv" } else { "cublas" };
                report(&format!("{what} {base}"), blas, bytes);
                let plan = ThinGemmPlan::new((m, k, n), ops.num_sms, None);
                let mut ours = f64::INFINITY;
                for splits in [plan.splits, plan.splits.div_ceil(2), plan.splits * 2] {
                    let s = time_graph(&dev, 40, || {
                        ops.thin_gemm(&x, next(), &mut out, (m, k, n), Some(splits))
                            .unwrap()
                    });
                    report(&format!("{what} thin_gemm splits={splits}"), s, bytes);
                    if splits == plan.splits {
                        ours = s;
                    }
                }
                let (mut blas_layer, mut ours_layer) = (blas, ours);
                if name == "gate_up_proj" {
                    let unfused = time_graph(&dev, 40, || {
                        if m == 1 {
                            ops.gemv_silu_mul(&x, next(), &mut act, k, n / 2).unwrap()
                        } else {
                            gemm.linear(&x, next(), &mut out, m, k, n).unwrap();
                            ops.silu_and_mul(&out, &mut act, m, n / 2).unwrap()
                        }
                    });
                    let fused = time_graph(&dev, 40, || {
                        ops.thin_gemm_silu_mul(&x, next(), &mut act, (m, k, n / 2), None)
                            .unwrap()
                    });
                    report(&format!("{what} {base} + silu_and_mul"), unfused, bytes);
                    report(&format!("{what} thin_gemm_silu_mul"), fused, bytes);
                    (blas_layer, ours_layer) = (unfused, fused);
                }
                if name != "lm_head" {
                    layer[mi].0 += blas_layer;
                    layer[mi].1 += ours_layer;
                    layer[mi].2 += bytes;
                }
            }
        }
        for (m, (blas, ours, bytes)) in MS.into_iter().zip(layer) {
            let base = if m == 1 { "gemv" } else { "cublas" };
            report(&format!("{model} layer GEMMs m={m} {base}"), blas, bytes);
            report(&format!("{model} layer GEMMs m={m} thin_gemm"), ours, bytes);
        }
    }
}
