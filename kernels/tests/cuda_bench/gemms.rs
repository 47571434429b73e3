//! Decode GEMMs: cuBLAS against our `gemv` and `thin_gemm` at the layer shapes of the
//! models, and of one rank's shard under tensor parallelism.

use super::*;

pub(super) fn gemms(dev: &CudaDevice) {
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

/// An index into `copies` weight copies, one further each call (from 1), so that each
/// call of a timed product reads another copy.
fn rotation(copies: usize) -> impl FnMut() -> usize {
    let mut i = 0;
    move || {
        i = (i + 1) % copies;
        i
    }
}

/// The bf16 bytes of an (m, k, n) product: its weight, x and out.
fn product_bytes(m: usize, k: usize, n: usize) -> f64 {
    ((n * k + m * k + m * n) * 2) as f64
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
/// the Llama-3.1-70B shape at TP=4 (`rank_shapes`), as `thin_gemms` times them.
///
///   cuda_bench tp_rank_gemvs --ignored --nocapture    (scripts/gpu_round.sh tp-gemv)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh tp-gemv runs it"]
fn tp_rank_gemvs() {
    const LLAMA_70B: [GemmShape; 5] = [
        ("qkv_proj", 8192, 10240),
        ("o_proj", 8192, 8192),
        ("gate_up_proj", 8192, 57344),
        ("down_proj", 28672, 8192),
        ("lm_head", 8192, 128_256),
    ];
    let qwen3_8b = MODEL_GEMMS[1].1;
    let models: Vec<(String, [GemmShape; 5])> = [
        ("8B", qwen3_8b, 2),
        ("8B", qwen3_8b, 4),
        ("70B", LLAMA_70B, 4),
    ]
    .into_iter()
    .map(|(model, shapes, tp)| (format!("{model} TP={tp}"), rank_shapes(shapes, tp)))
    .collect();
    gemv_table(&models, &[1]);
}

/// One rank's part of each GEMM at `tp`: the column-parallel ones (qkv, gate/up and the
/// vocabulary-parallel LM head, padded as the model pads it) split their outputs, the
/// row-parallel ones (o, down) their inputs.
fn rank_shapes(shapes: [GemmShape; 5], tp: usize) -> [GemmShape; 5] {
    shapes.map(|(name, k, n)| match name {
        "o_proj" | "down_proj" => (name, k / tp, n),
        _ => (name, k, n.div_ceil(tp)),
    })
}

/// cuBLAS against `gemv` (both rows-per-warp variants and the one it picks) for each
/// model's shapes at each batch `ms`, and the layer's sum.
fn gemv_table<S: std::fmt::Display>(models: &[(S, [GemmShape; 5])], ms: &[usize]) {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    for (model, shapes) in models {
        for &m in ms {
            let (mut layer_blas, mut layer_gemv, mut layer_bytes) = (0.0, 0.0, 0.0);
            for &(name, k, n) in shapes {
                let bytes = product_bytes(m, k, n);
                let ws = weight_copies(&dev, n * k);
                let x = random(&dev, m * k, 5);
                let mut out = ops.alloc(m * n).unwrap();
                let mut turn = rotation(ws.len());
                let mut next = || &ws[turn()];
                let blas = time_graph(&dev, 40, || {
                    gemm.linear(&x, next(), &mut out, m, k, n).unwrap()
                });
                let what = format!("{model} {name} m={m} [{k}->{n}]");
                report(&format!("{what} cublas"), blas, bytes);
                for rows_per_warp in [1, 2] {
                    let t = time_graph(&dev, 40, || {
                        ops.gemv_with_rows(&x, next(), &mut out, (m, k, n), rows_per_warp, 0)
                            .unwrap()
                    });
                    report(&format!("{what} gemv r{rows_per_warp}"), t, bytes);
                }
                if m == 1 {
                    for parts in [2, 4] {
                        let t = time_graph(&dev, 40, || {
                            ops.gemv_split_k(&x, next(), &mut out, (k, n), parts, 0)
                                .unwrap()
                        });
                        report(&format!("{what} gemv k/{parts}"), t, bytes);
                    }
                }
                let picked = time_graph(&dev, 40, || {
                    ops.gemv(&x, next(), &mut out, (m, k, n), 0).unwrap()
                });
                report(&format!("{what} gemv picked"), picked, bytes);
                if name == "gate_up_proj" && m == 1 {
                    // The activation in the GEMM's epilogue against its own launch.
                    let mut act = ops.alloc(n / 2).unwrap();
                    let unfused = time_graph(&dev, 40, || {
                        let w = next();
                        ops.gemv(&x, w, &mut out, (m, k, n), 0).unwrap();
                        ops.silu_and_mul(&out, &mut act, 1, n / 2).unwrap()
                    });
                    report(&format!("{what} gemv + silu_and_mul"), unfused, bytes);
                    for split in [false, true] {
                        let fused = time_graph(&dev, 40, || {
                            ops.gemv_silu_mul(&x, next(), &mut act, (k, n / 2), split, 0)
                                .unwrap()
                        });
                        report(&format!("{what} gemv_silu_mul split={split}"), fused, bytes);
                    }
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
            for (mi, m) in MS.into_iter().enumerate() {
                let bytes = product_bytes(m, k, n);
                let x = random(&dev, m * k, 5);
                let mut out = ops.alloc(m * n).unwrap();
                let mut act = ops.alloc(m * n / 2).unwrap();
                let mut turn = rotation(ws.len());
                let mut next = || &ws[turn()];
                gemm.tuning(|| gemm.linear(&x, &ws[0], &mut out, m, k, n).unwrap());
                // One row: the model's gemv stands where cuBLAS does at more rows.
                let blas = time_graph(&dev, 40, || {
                    if m == 1 {
                        ops.gemv(&x, next(), &mut out, (m, k, n), 0).unwrap()
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
                            ops.gemv_silu_mul(&x, next(), &mut act, (k, n / 2), false, 0)
                                .unwrap()
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

/// Every algorithm cuBLASLt's heuristic offers (up to 64; it gave 8 on an H100) for the
/// layer GEMMs of Qwen3-0.6B and Qwen3-8B at decode batches of 64–256 rows, each timed with
/// its weights from HBM (rotating through 256 MB of copies, in a CUDA graph), against
/// cuBLAS's default and against the algorithm that tuning picks today (`Gemm::tuning`,
/// which times one operand over and over, so a 0.6B weight is read from L2). Prints each
/// product's three times (`BENCH`) and its fastest candidates (`CAND`), then each model's
/// layer sums.
///
///   cuda_bench gemm_candidates --ignored --nocapture    (scripts/gpu_round.sh gemm-candidates)
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh gemm-candidates runs it"]
fn gemm_candidates() {
    let Some(dev) = common::device() else { return };
    let plain = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    // Today's tuning, with a record of its own that starts empty: every product is a shape
    // of its own, so each is timed once, on its first call under `tuning`.
    let record = std::env::temp_dir().join(format!("gemm-candidates-{}", std::process::id()));
    let tuned = Gemm::with_choices_in(dev.stream.clone(), DType::BF16, &record).unwrap();
    const MS: [usize; 4] = [64, 128, 192, 256];
    for (model, shapes) in MODEL_GEMMS {
        let mut layer = [(0.0, 0.0, 0.0); MS.len()];
        for (name, k, n) in shapes.into_iter().filter(|s| s.0 != "lm_head") {
            let ws = weight_copies(&dev, n * k);
            for (mi, m) in MS.into_iter().enumerate() {
                let what = format!("{model} {name} m={m} [{k}->{n}]");
                let (default, today, best) =
                    survey_product(&dev, (&plain, &tuned), &ws, (m, k, n), &what);
                layer[mi].0 += default;
                layer[mi].1 += today;
                layer[mi].2 += best.min(default);
            }
        }
        for (m, (default, today, best)) in MS.into_iter().zip(layer) {
            println!(
                "BENCH candidates {model} layer GEMMs m={m}: default {:.1} us, today {:.1} us, \
                 best (cold) {:.1} us",
                default * 1e6,
                today * 1e6,
                best * 1e6
            );
        }
    }
    std::fs::remove_dir_all(&record).ok();
}

/// One product of `gemm_candidates`: seconds for cuBLAS's default (`plain`, never tuned),
/// for today's choice (`tuned`) and for the fastest heuristic candidate, each call reading
/// the next of the weight copies `ws`. Prints them and the three fastest.
fn survey_product(
    dev: &CudaDevice,
    (plain, tuned): (&Gemm, &Gemm),
    ws: &[CudaSlice<u8>],
    (m, k, n): (usize, usize, usize),
    what: &str,
) -> (f64, f64, f64) {
    use cudarc::driver::DevicePtr;
    use vllm_kernels::cuda::lt_matmul::Operands;
    // More than the heuristic has given for any shape (8 on an H100).
    const ASKED: usize = 64;
    let x = random(dev, m * k, 5);
    let mut out = dev.stream.alloc_zeros::<u8>(m * n * 2).unwrap();
    let mut next = rotation(ws.len());
    let default = time_graph(dev, 40, || {
        plain.linear(&x, &ws[next()], &mut out, m, k, n).unwrap()
    });
    tuned.tuning(|| tuned.linear(&x, &ws[0], &mut out, m, k, n).unwrap());
    let today = time_graph(dev, 40, || {
        tuned.linear(&x, &ws[next()], &mut out, m, k, n).unwrap()
    });
    let lt = plain.lt().expect("bf16 has cuBLASLt");
    let ptr = |b: &CudaSlice<u8>| b.device_ptr(&dev.stream).0;
    let (xp, yp) = (ptr(&x), ptr(&out));
    let wp: Vec<u64> = ws.iter().map(ptr).collect();
    let mut timed: Vec<(f64, usize, String)> = lt
        .candidates_for((m, k, n), ASKED)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let s = time_graph(dev, 40, || {
                let ops = Operands {
                    x: xp,
                    w: wp[next()],
                    y: yp,
                };
                lt.run_candidate(&c, ops).unwrap()
            });
            (s, rank, c.label)
        })
        .collect();
    timed.sort_by(|a, b| a.0.total_cmp(&b.0));
    let best = timed.first().map_or(f64::INFINITY, |t| t.0);
    println!(
        "BENCH candidates {what}: default {:.2} us, today {:.2} us, best of {} {:.2} us",
        default * 1e6,
        today * 1e6,
        timed.len(),
        best * 1e6
    );
    for (s, rank, label) in timed.iter().take(3) {
        println!("CAND   {:.2} us  #{rank} {label}", s * 1e6);
    }
    (default, today, best)
}

/// Qwen3-0.6B's layer GEMMs (cuBLAS, as the model tunes them) at decode batches of 64–256
/// rows with the weight in L2 (one copy, read over and over) against from HBM (rotating
/// through 256 MB of copies): how much of a product's time is its weight's trip from HBM.
///
///   cuda_bench layer_gemms_l2 --ignored --nocapture
#[test]
#[ignore = "needs a CUDA GPU"]
fn layer_gemms_l2() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
    let (_, shapes) = MODEL_GEMMS[0];
    for m in [64, 128, 256] {
        let (mut hot_sum, mut cold_sum) = (0.0, 0.0);
        for (name, k, n) in &shapes[..4] {
            let (k, n) = (*k, *n);
            let ws = weight_copies(&dev, n * k);
            let x = random(&dev, m * k, 5);
            let mut out = ops.alloc(m * n).unwrap();
            gemm.tuning(|| gemm.linear(&x, &ws[0], &mut out, m, k, n).unwrap());
            let hot = time_graph(&dev, 40, || {
                gemm.linear(&x, &ws[0], &mut out, m, k, n).unwrap()
            });
            let mut next = rotation(ws.len());
            let cold = time_graph(&dev, 40, || {
                gemm.linear(&x, &ws[next()], &mut out, m, k, n).unwrap()
            });
            let bytes = product_bytes(m, k, n);
            report(&format!("0.6B {name} m={m} weight in L2"), hot, bytes);
            report(&format!("0.6B {name} m={m} weight from HBM"), cold, bytes);
            (hot_sum, cold_sum) = (hot_sum + hot, cold_sum + cold);
        }
        println!(
            "BENCH layer m={m}: in L2 {:.1} us, from HBM {:.1} us",
            hot_sum * 1e6,
            cold_sum * 1e6
        );
    }
}

/// The host time of each prefill GEMM's first use at a row count, less its second use: more
/// than a millisecond is cuBLAS loading a kernel (docs/BENCHMARKS.md, "A prefill step that
/// stalls the host"). First the layer GEMMs of Qwen3-0.6B and Qwen3-8B at 8,192 rows under
/// `Gemm::warming`, as the start-up's worst-case step runs them (o_proj and down_proj with
/// β = 1, as the model does), then at row counts no step ran.
///
///   cuda_bench gemm_first_use --ignored --nocapture
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_first_use() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    const MAX_ROWS: usize = 8192;
    for (model, shapes) in &MODEL_GEMMS {
        let gemm = Gemm::new(dev.stream.clone(), DType::BF16).unwrap();
        let layer = &shapes[..4];
        let max_k = layer.iter().map(|s| s.1).max().unwrap_or(1);
        let max_n = layer.iter().map(|s| s.2).max().unwrap_or(1);
        let x = random(&dev, MAX_ROWS * max_k, 5);
        let ws: Vec<_> = layer
            .iter()
            .map(|&(_, k, n)| random(&dev, n * k, 6))
            .collect();
        let mut out = ops.alloc(MAX_ROWS * max_n).unwrap();
        // Host milliseconds of each layer GEMM at m rows.
        let mut layer_at = |m: usize| -> Vec<f64> {
            layer
                .iter()
                .zip(&ws)
                .map(|(&(name, k, n), w)| {
                    dev.synchronize().expect("sync");
                    let t = Instant::now();
                    if name == "o_proj" || name == "down_proj" {
                        gemm.linear_add(&x, w, &mut out, m, k, n).unwrap();
                    } else {
                        gemm.linear(&x, w, &mut out, m, k, n).unwrap();
                    }
                    dev.synchronize().expect("sync");
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect()
        };
        let t = Instant::now();
        gemm.warming(|| layer_at(MAX_ROWS));
        println!(
            "BENCH {model} warming at {MAX_ROWS} rows: {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let (mut loads, mut worst) = (0, 0.0f64);
        let counts = [
            5813, 4095, 6143, 3001, 7777, 1000, 333, 2049, 257, 700, 1500, 4500,
        ];
        for m in counts {
            let (first, second) = (layer_at(m), layer_at(m));
            for ((name, _, _), (a, b)) in layer.iter().zip(first.iter().zip(&second)) {
                if a - b > 1.0 {
                    println!("BENCH {model} first use m={m}: {name} {a:.1} ms, then {b:.1}");
                    loads += 1;
                }
                worst = worst.max(a - b);
            }
        }
        println!(
            "BENCH {model} after warming: {} row counts, {loads} loads, most {worst:.1} ms over the second use",
            counts.len()
        );
    }
}
