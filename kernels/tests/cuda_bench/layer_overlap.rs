//! Two half batches of a decode step on two streams against one batch (dual-batch overlap).

use super::*;

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
        self.before_attention(ops, gemm, w, l);
        self.attention(ops);
        self.after_attention(ops, gemm, w, l);
    }

    /// The norm and the qkv GEMM.
    fn before_attention(&mut self, ops: &CudaOps, gemm: &Gemm, w: &LayerWeights, l: usize) {
        let (m, c) = (self.rows, l % w.qkv.len());
        self.add_norm(ops, w);
        gemm.linear(&self.hidden, &w.qkv[c], &mut self.qkv, m, HIDDEN, QKV_N)
            .unwrap();
    }

    fn attention(&mut self, ops: &CudaOps) {
        let sh = &self.shape;
        let meta = self.inputs.meta(&sh.tables[0], &self.plan);
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
    }

    /// o_proj, the norm and the MLP.
    fn after_attention(&mut self, ops: &CudaOps, gemm: &Gemm, w: &LayerWeights, l: usize) {
        let (m, c) = (self.rows, l % w.qkv.len());
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
    // Keys of the sequences: 100-1,023 (nanovllm-256's first decode steps), or the range
    // VLLM_BENCH_KEYS ("300-1600") asks for.
    let (lo, hi) = std::env::var("VLLM_BENCH_KEYS")
        .ok()
        .and_then(|r| {
            let (lo, hi) = r.split_once('-')?;
            Some((lo.parse::<i32>().ok()?, hi.parse::<i32>().ok()?))
        })
        .unwrap_or((100, 1023));
    let lens = spread(SEQS, lo, hi);
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
    // The halves' attentions one after the other, each half's GEMMs and small kernels
    // under the other's attention: A's attention of layer l waits for B's of layer l - 1,
    // B's for A's of layer l (each `join` waits for what the other stream has queued so
    // far, so the launches are queued in this order).
    let mut staggered = |ops: &CudaOps, side_ops: &CudaOps| {
        side.join(&dev.stream).expect("fork");
        for l in 0..LAYERS {
            a.before_attention(ops, &gemm, &weights, l);
            if l > 0 {
                dev.stream.join(&side).expect("after B's attention");
            }
            a.attention(ops);
            if l > 0 {
                b.after_attention(side_ops, &side_gemm, &weights, l - 1);
            }
            b.before_attention(side_ops, &side_gemm, &weights, l);
            side.join(&dev.stream).expect("after A's attention");
            b.attention(side_ops);
            a.after_attention(ops, &gemm, &weights, l);
        }
        b.after_attention(side_ops, &side_gemm, &weights, LAYERS - 1);
        dev.stream.join(&side).expect("join");
    };
    step(
        "2 x 128, two streams, attentions staggered",
        time_graph(&dev, 1, || staggered(&ops, &side_ops)),
    );
    let (mut plain, mut side_plain) = (
        CudaOps::new(&dev, DType::BF16).expect("build kernels"),
        CudaOps::new(&dev, DType::BF16).expect("build kernels"),
    );
    (plain.pdl, side_plain.pdl, side_plain.stream) = (false, false, side.clone());
    step(
        "2 x 128, two streams, staggered, no PDL",
        time_graph(&dev, 1, || staggered(&plain, &side_plain)),
    );
    step(
        "256, one batch, no PDL",
        time_graph(&dev, 1, || {
            (0..LAYERS).for_each(|l| full.layer(&plain, &gemm, &weights, l))
        }),
    );
    step(
        "128 alone, one stream",
        time_graph(&dev, 1, || {
            (0..LAYERS).for_each(|l| a.layer(&ops, &gemm, &weights, l))
        }),
    );
}
