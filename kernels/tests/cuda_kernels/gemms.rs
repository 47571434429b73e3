//! The GEMMs of decode and prefill: gemv, the fused gate/up gemv, thin_gemm, and
//! cuBLAS / cuBLASLt through `Gemm` (tuned per shape).

use super::*;

/// The thin-GEMM kernel at every row count it takes, both rows-per-warp variants (with and
/// without early L2 hints), odd output counts (a warp's second row past the end) and K
/// without a whole unrolled pass.
/// The output is poisoned one row of x past its end: that row must stay NaN.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gemv_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let vec = 16 / dtype.size();
        let mut r = Lcg(11);
        // f32 sums on both sides in different orders, one rounding of O(1) outputs.
        let t = match dtype {
            DType::F32 => Tol {
                abs: 1e-5,
                rel: 1e-5,
            },
            _ => tol(dtype, 1.0),
        };
        for (k, n) in [
            (1024, 4096),
            (2048, 1024),
            (vec, 1),
            (3 * vec, 33),
            (4096 + 5 * vec, 17),
        ] {
            for m in 1..=vllm_kernels::cuda::GEMV_MAX_M {
                let x = c.round(&r.vec(m * k, 1.0));
                let w = c.round(&r.vec(n * k, 1.0 / (k as f32).sqrt()));
                let mut want = vec![0.0; m * n];
                cpu::linear(&x, &w, None, m, k, n, &mut want);
                let (xd, wd) = (c.upload(&x), c.upload(&w));
                assert!(c.ops.gemv_fits([&xd, &wd, &xd], m, k));
                // Early L2 hints (every line of w, or none) change no value.
                for (rows_per_warp, early_l2) in [(1, 0), (2, 0), (1, 1 << 30), (2, 1 << 30)] {
                    let mut out = c.poisoned((m + 1) * n);
                    c.ops
                        .gemv_with_rows(&xd, &wd, &mut out, (m, k, n), rows_per_warp, early_l2)
                        .unwrap();
                    let got = c.download(&out, (m + 1) * n);
                    let what = format!("gemv m={m} k={k} n={n} r={rows_per_warp} early {early_l2}");
                    assert_close(&what, dtype, &got[..m * n], &want, t);
                    assert!(
                        got[m * n..].iter().all(|v| v.is_nan()),
                        "{what}: wrote past its output"
                    );
                }
                // One row with each row of w split over 2 or 4 warps.
                let split_cases = [(2, 0), (4, 0), (2, 1 << 30), (4, 1 << 30)];
                for (parts, early_l2) in split_cases.into_iter().filter(|_| m == 1) {
                    let mut out = c.poisoned(2 * n);
                    c.ops
                        .gemv_split_k(&xd, &wd, &mut out, (k, n), parts, early_l2)
                        .unwrap();
                    let got = c.download(&out, 2 * n);
                    let what = format!("gemv k={k} n={n} split over {parts} early {early_l2}");
                    assert_close(&what, dtype, &got[..n], &want, t);
                    assert!(
                        got[n..].iter().all(|v| v.is_nan()),
                        "{what}: wrote past its output"
                    );
                }
            }
        }
        // What it does not take: too many rows, a ragged row.
        let buf = c.upload(&vec![0.5; 9 * 64]);
        assert!(!c.ops.gemv_fits([&buf, &buf, &buf], 9, 64));
        assert!(!c.ops.gemv_fits([&buf, &buf, &buf], 1, vec + 1));
    }
}

/// The fused gate/up product with SiLU-and-mul, an output in one warp or split over two, is
/// bit for bit the thin GEMM followed by `silu_and_mul` (each checked against the CPU on
/// its own), and writes nothing past its output.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gemv_silu_mul_is_gemv_then_silu_and_mul() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let vec = 16 / dtype.size();
        let mut r = Lcg(13);
        for (k, d) in [(1024, 3072), (vec, 1), (3 * vec, 33), (4096 + 5 * vec, 17)] {
            let x = c.round(&r.vec(k, 1.0));
            // Gate/up outputs of a few units, so silu's both sides are exercised.
            let w = c.round(&r.vec(2 * d * k, 4.0 / (k as f32).sqrt()));
            let (xd, wd) = (c.upload(&x), c.upload(&w));
            let mut gate_up = c.poisoned(2 * d);
            c.ops
                .gemv_with_rows(&xd, &wd, &mut gate_up, (1, k, 2 * d), 1, 0)
                .unwrap();
            let mut unfused = c.poisoned(d);
            c.ops.silu_and_mul(&gate_up, &mut unfused, 1, d).unwrap();
            let want = c.download(&unfused, d);
            assert!(
                want.iter().all(|v| v.is_finite()),
                "gemv_silu_mul {dtype:?} k={k} d={d}: unfused path not finite"
            );
            for split in [false, true] {
                let mut fused = c.poisoned(d + 1);
                // With early L2 hints for every line of w, which change no value.
                c.ops
                    .gemv_silu_mul(&xd, &wd, &mut fused, (k, d), split, 1 << 30)
                    .unwrap();
                let got = c.download(&fused, d + 1);
                let what = format!("gemv_silu_mul {dtype:?} k={k} d={d} split {split}");
                for (j, (a, b)) in got[..d].iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{what}: output {j}: {a} vs {b}");
                }
                assert!(got[d].is_nan(), "{what}: wrote past its output");
            }
        }
    }
}

/// The decode-batch GEMM (thin_gemm.rs, Hopper only) in bf16 and fp16: every block size,
/// one split and many (a tile's splits one cluster, summed in split order through
/// distributed shared memory), rows and columns past a tile, a partial last k-tile; the
/// output is poisoned one row past its end, which must stay NaN.
/// Splits change only the order of f32 sums, and a repeat gives the same bits (graphs
/// replay the eager run's bits). The SiLU variant is bit for bit thin_gemm then
/// `silu_and_mul`.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn thin_gemm_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in [DType::BF16, DType::F16] {
        let c = Ctx::new(&g, dtype);
        if !c.ops.has_thin_gemm() {
            eprintln!(
                "SKIPPED: thin_gemm is a Hopper (sm_90a) kernel; this is {}",
                g.dev.arch()
            );
            return;
        }
        let mut r = Lcg(23);
        for (m, k, n) in [
            (1, 1024, 4096),
            (2, 64, 64),
            (5, 1032, 72),
            (9, 1024, 6144),
            (16, 2048, 1024),
            (17, 1024, 130),
            (24, 520, 200),
            (32, 1000, 392),
            (32, 3072, 1024),
        ] {
            let x = c.round(&r.vec(m * k, 1.0));
            let w = c.round(&r.vec(n * k, 4.0 / (k as f32).sqrt()));
            let mut want = vec![0.0; m * n];
            cpu::linear(&x, &w, None, m, k, n, &mut want);
            let (xd, wd) = (c.upload(&x), c.upload(&w));
            assert!(c.ops.thin_gemm_fits([&xd, &wd, &xd], m, k, n));
            let mut first: Option<Vec<f32>> = None;
            for splits in [None, Some(1), Some(7), None] {
                let mut out = c.poisoned((m + 1) * n);
                c.ops
                    .thin_gemm(&xd, &wd, &mut out, (m, k, n), splits)
                    .unwrap();
                let got = c.download(&out, (m + 1) * n);
                let what = format!("thin_gemm m={m} k={k} n={n} splits={splits:?}");
                assert_close(&what, dtype, &got[..m * n], &want, linear_tol(dtype));
                assert!(
                    got[m * n..].iter().all(|v| v.is_nan()),
                    "{what}: wrote past its output"
                );
                match (&first, splits) {
                    (None, _) => first = Some(got),
                    (Some(f), None) => assert!(same_bits(f, &got), "{what}: a repeat differs"),
                    _ => {}
                }
            }
            // The fused activation over the same product read as gate/up halves; it takes
            // an even d only.
            let d = n / 2;
            if d % 2 == 1 {
                let mut out = c.poisoned(m * d);
                let odd = c
                    .ops
                    .thin_gemm_silu_mul(&xd, &wd, &mut out, (m, k, d), None);
                assert!(odd.is_err(), "thin_gemm_silu_mul took an odd d = {d}");
                continue;
            }
            let mut gate_up = c.poisoned(m * n);
            c.ops
                .thin_gemm(&xd, &wd, &mut gate_up, (m, k, n), None)
                .unwrap();
            let mut unfused = c.poisoned(m * d);
            c.ops.silu_and_mul(&gate_up, &mut unfused, m, d).unwrap();
            let mut fused = c.poisoned((m + 1) * d);
            c.ops
                .thin_gemm_silu_mul(&xd, &wd, &mut fused, (m, k, d), None)
                .unwrap();
            let (want, got) = (c.download(&unfused, m * d), c.download(&fused, (m + 1) * d));
            let what = format!("thin_gemm_silu_mul {dtype:?} m={m} k={k} d={d}");
            assert!(
                want.iter().all(|v| v.is_finite()),
                "{what}: unfused not finite"
            );
            for (j, (a, b)) in got[..m * d].iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: output {j}: {a} vs {b}");
            }
            assert!(
                got[m * d..].iter().all(|v| v.is_nan()),
                "{what}: wrote past its output"
            );
        }
        // What it does not take: no rows, too many rows, ragged k, odd n.
        let buf = c.upload(&vec![0.5; 257 * 64]);
        assert!(!c.ops.thin_gemm_fits([&buf, &buf, &buf], 0, 64, 64));
        assert!(!c
            .ops
            .thin_gemm_fits([&buf, &buf, &buf], THIN_GEMM_MAX_M + 1, 64, 64));
        assert!(!c.ops.thin_gemm_fits([&buf, &buf, &buf], 4, 60, 64));
        assert!(!c.ops.thin_gemm_fits([&buf, &buf, &buf], 4, 64, 63));
    }
    let f32_ops = CudaOps::new(&g.dev, DType::F32).unwrap();
    let buf = g.dev.stream.alloc_zeros::<u8>(4 * 64 * 4).unwrap();
    assert!(!f32_ops.thin_gemm_fits([&buf, &buf, &buf], 4, 64, 64));
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn linear_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let gemm = Gemm::new(g.dev.stream.clone(), dtype).unwrap();
        let mut r = Lcg(7);
        for (m, k, n) in [(1, 257, 129), (7, 1024, 3072), (130, 96, 33)] {
            let x = c.round(&r.vec(m * k, 1.0));
            let w = c.round(&r.vec(n * k, 1.0 / (k as f32).sqrt()));
            let mut want = vec![0.0; m * n];
            cpu::linear(&x, &w, None, m, k, n, &mut want);
            let mut out = c.poisoned(m * n);
            gemm.linear(&c.upload(&x), &c.upload(&w), &mut out, m, k, n)
                .unwrap();
            let out = c.download(&out, m * n);
            assert_close("linear", dtype, &out, &want, linear_tol(dtype));
        }
    }
}

/// `linear_add` (cuBLAS's β = 1, in place) against the CPU's product added to the old
/// output, untuned and tuned on first use (a shape tuned inside `linear_add` is timed
/// into a scratch output: the sum below would show each timed run added again).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn linear_add_adds_the_product_into_its_output() {
    let Some(g) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("vllm-rs-gemm-add-{}", std::process::id()));
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(23);
        for tune in [false, true] {
            let gemm = Gemm::with_choices_in(g.dev.stream.clone(), dtype, &dir).unwrap();
            for (m, k, n) in [(1, 257, 129), (40, 2048, 1024), (256, 3072, 1024)] {
                let x = c.round(&r.vec(m * k, 1.0));
                let w = c.round(&r.vec(n * k, 1.0 / (k as f32).sqrt()));
                let residual = c.round(&r.vec(m * n, 4.0));
                let mut product = vec![0.0; m * n];
                cpu::linear(&x, &w, None, m, k, n, &mut product);
                let want: Vec<f32> = residual.iter().zip(&product).map(|(a, p)| a + p).collect();
                let (xd, wd, mut out) = (c.upload(&x), c.upload(&w), c.upload(&residual));
                let mut run = || gemm.linear_add(&xd, &wd, &mut out, m, k, n);
                if tune {
                    gemm.tuning(run).unwrap();
                } else {
                    run().unwrap();
                }
                let got = c.download(&out, m * n);
                let what = format!("linear_add [{m}, {k}, {n}] tuned {tune}");
                // One rounding of the sum, whose values are up to ~4 times the product's.
                assert_close(&what, dtype, &got, &want, tol(dtype, 3.0));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GEMM's tolerance against the CPU: f32 accumulation on both sides, so the output
/// rounding (and the order of the sums) is all that differs; outputs are O(1).
fn linear_tol(dtype: DType) -> Tol {
    match dtype {
        DType::F32 => Tol {
            abs: 1e-5,
            rel: 1e-5,
        },
        _ => tol(dtype, 1.5),
    }
}

/// GEMMs tuned on first use (`Gemm::tuning`, as the CUDA graphs' warm-up runs do): the
/// output of the tuning call (the winner's, cuBLASLt's or cuBLAS's) is close to the CPU's,
/// a later call of the same shape gives the same bits, as a graph replay must, and so does
/// a new `Gemm` that takes the choices from the record on disk without timing any. The
/// shapes are Qwen3-0.6B's at decode batches, plus odd ones.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn tuned_linear_matches_cpu_and_keeps_its_choice() {
    let Some(g) = gpu() else { return };
    // A record of this test's own, so an earlier run's choices cannot stand in for timing.
    let dir = std::env::temp_dir().join(format!("vllm-rs-gemm-choices-{}", std::process::id()));
    let shapes = [
        (256, 1024, 4096),
        (16, 2048, 1024),
        (256, 3072, 1024),
        (72, 1024, 6144),
        (130, 96, 33),
    ];
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(17);
        let operands: Vec<_> = shapes
            .iter()
            .map(|&(m, k, n)| {
                let x = c.round(&r.vec(m * k, 1.0));
                let w = c.round(&r.vec(n * k, 1.0 / (k as f32).sqrt()));
                (x, w)
            })
            .collect();
        // The first Gemm times every shape; the second loads what the first recorded.
        let mut first_outputs = Vec::new();
        for pass in 0..2 {
            let gemm = Gemm::with_choices_in(g.dev.stream.clone(), dtype, &dir).unwrap();
            for (i, (&(m, k, n), (x, w))) in shapes.iter().zip(&operands).enumerate() {
                let (xd, wd) = (c.upload(x), c.upload(w));
                let mut tuned = c.poisoned(m * n);
                gemm.tuning(|| gemm.linear(&xd, &wd, &mut tuned, m, k, n))
                    .unwrap();
                let tuned = c.download(&tuned, m * n);
                let mut want = vec![0.0; m * n];
                cpu::linear(x, w, None, m, k, n, &mut want);
                assert_close("tuned linear", dtype, &tuned, &want, linear_tol(dtype));
                let mut again = c.poisoned(m * n);
                gemm.linear(&xd, &wd, &mut again, m, k, n).unwrap();
                let again = c.download(&again, m * n);
                let what = format!("{dtype:?} [{m}, {k}] x [{n}, {k}], pass {pass}");
                assert!(same_bits(&tuned, &again), "{what}: a second call differs");
                if pass == 0 {
                    first_outputs.push(tuned);
                } else {
                    assert!(
                        same_bits(&tuned, &first_outputs[i]),
                        "{what}: differs from pass 0"
                    );
                }
            }
            let counts = gemm.tuning_counts();
            // f32 keeps cuBLAS's exact-f32 default and tunes nothing.
            let tuned = if dtype == DType::F32 { 0 } else { shapes.len() };
            let timed = if pass == 0 { tuned } else { 0 };
            assert_eq!(
                (counts.shapes, counts.timed),
                (tuned, timed),
                "{dtype:?} pass {pass}"
            );
            println!("TUNED {dtype:?} pass {pass}: {counts:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
