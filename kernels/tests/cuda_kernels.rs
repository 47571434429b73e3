//! Every CUDA kernel against its CPU reference, in bf16, fp16 and f32, on fresh random
//! inputs: odd sizes, sequences crossing block boundaries, shuffled blocks, GQA, split
//! decode, and outputs poisoned with NaN before each launch (a skipped element shows).
//!
//! Inputs are rounded to the dtype first and the CPU reference runs on the rounded values,
//! so the bounds measure the kernels, not the input quantisation. Every test is `#[ignore]`d
//! (cargo reports it as ignored where there is no GPU); `scripts/gpu_round.sh` runs them with
//! `--ignored` and VLLM_REQUIRE_GPU set, so a missing device fails there instead of passing.

mod common;

use cudarc::driver::CudaSlice;
use vllm_kernels::cpu;
use vllm_kernels::cpu::attention::PagedAttentionShape;
use vllm_kernels::cuda::{
    AttentionDims, AttentionKernels, AttentionMeta, AttentionPlan, CudaDevice, CudaOps, DType,
    Gemm, SampleRowEx, SamplingBatch, THIN_GEMM_MAX_M,
};

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

struct Gpu {
    dev: CudaDevice,
}

fn gpu() -> Option<Gpu> {
    common::device().map(|dev| Gpu { dev })
}

/// A seeded generator of values in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (((self.next() + 1.0) * 0.5) * n as f32) as usize % n.max(1)
    }
}

/// Per-dtype bound: |got - want| <= abs + rel * |want|.
#[derive(Clone, Copy)]
struct Tol {
    abs: f32,
    rel: f32,
}

fn tol(dtype: DType, ulps: f32) -> Tol {
    let eps = match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        DType::F32 => 1e-6,
    };
    Tol {
        abs: eps * ulps,
        rel: eps * ulps,
    }
}

fn assert_close(what: &str, dtype: DType, got: &[f32], want: &[f32], t: Tol) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            !g.is_nan(),
            "{what} {dtype:?}: NaN at {i} (want {w}): element not written?"
        );
        let excess = (g - w).abs() - (t.abs + t.rel * w.abs());
        if excess > worst.0 {
            worst = (excess, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= 0.0,
        "{what} {dtype:?}: element {i}: got {}, want {} (bound {} + {}·|want|)",
        got[i],
        want[i],
        t.abs,
        t.rel
    );
}

struct Ctx<'a> {
    gpu: &'a Gpu,
    ops: CudaOps,
    dtype: DType,
}

impl<'a> Ctx<'a> {
    fn new(gpu: &'a Gpu, dtype: DType) -> Self {
        Self {
            gpu,
            ops: CudaOps::new(&gpu.dev, dtype).expect("build kernels"),
            dtype,
        }
    }
    fn round(&self, v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| self.dtype.round(x)).collect()
    }
    fn upload(&self, v: &[f32]) -> CudaSlice<u8> {
        self.gpu
            .dev
            .stream
            .clone_htod(&self.dtype.encode(v))
            .expect("upload")
    }
    fn ints(&self, v: &[i32]) -> CudaSlice<i32> {
        self.gpu.dev.stream.clone_htod(v).expect("upload ints")
    }
    fn poisoned(&self, n: usize) -> CudaSlice<u8> {
        let mut b = self
            .gpu
            .dev
            .stream
            .alloc_zeros(n * self.dtype.size())
            .expect("alloc");
        self.ops.fill(&mut b, n, f32::NAN).expect("fill");
        b
    }
    fn download(&self, b: &CudaSlice<u8>, n: usize) -> Vec<f32> {
        let bytes = self.gpu.dev.stream.clone_dtoh(b).expect("download");
        self.dtype.decode(&bytes[..n * self.dtype.size()])
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn embedding_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(1);
        let (rows, hidden, start) = (37, 67, 5);
        let table = c.round(&r.vec(rows * hidden, 1.0));
        let ids: Vec<i32> = (0..29).map(|_| r.below(50) as i32).collect();
        let mut want = vec![f32::NAN; ids.len() * hidden];
        let uids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        cpu::embedding(&uids, &table, start, hidden, &mut want);
        let mut out = c.poisoned(ids.len() * hidden);
        c.ops
            .embedding(
                &c.ints(&ids),
                &c.upload(&table),
                &mut out,
                ids.len(),
                hidden,
                start,
                rows,
            )
            .unwrap();
        let got = c.download(&out, want.len());
        assert_close("embedding", dtype, &got, &want, tol(dtype, 0.0));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn rms_norms_match_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(2);
        // Rows of whole 16-byte chunks take the vectorised path (one chunk a thread), the
        // others the strided loop.
        for (rows, hidden) in [(7, 1037), (3, 4099), (1, 64), (5, 1024), (2, 8192)] {
            let x = c.round(&r.vec(rows * hidden, 2.0));
            let w = c.round(&r.vec(hidden, 1.0));
            let mut want = vec![0.0; x.len()];
            cpu::rms_norm(&x, &w, 1e-6, &mut want);
            let mut out = c.poisoned(x.len());
            c.ops
                .rms_norm(&c.upload(&x), &c.upload(&w), &mut out, rows, hidden, 1e-6)
                .unwrap();
            assert_close(
                "rms_norm",
                dtype,
                &c.download(&out, x.len()),
                &want,
                tol(dtype, 2.0),
            );

            // Fused: residual += x; x = norm(residual).
            let res = c.round(&r.vec(rows * hidden, 2.0));
            let (mut wx, mut wres) = (x.clone(), res.clone());
            cpu::fused_add_rms_norm(&mut wx, &mut wres, &w, 1e-6);
            let (mut dx, mut dres) = (c.upload(&x), c.upload(&res));
            c.ops
                .fused_add_rms_norm(&mut dx, &mut dres, &c.upload(&w), rows, hidden, 1e-6)
                .unwrap();
            assert_close(
                "fused_add_rms_norm residual",
                dtype,
                &c.download(&dres, x.len()),
                &wres,
                tol(dtype, 1.0),
            );
            assert_close(
                "fused_add_rms_norm x",
                dtype,
                &c.download(&dx, x.len()),
                &wx,
                tol(dtype, 3.0),
            );
        }
        for (heads, head_dim) in [(13 * 5, 128), (9, 16), (3, 64)] {
            let x = c.round(&r.vec(heads * head_dim, 3.0));
            let w = c.round(&r.vec(head_dim, 1.0));
            let mut want = x.clone();
            cpu::rms_norm_per_head(&mut want, &w, 1e-6);
            let mut dx = c.upload(&x);
            c.ops
                .rms_norm_per_head(&mut dx, &c.upload(&w), heads, head_dim, 1e-6)
                .unwrap();
            assert_close(
                "rms_norm_per_head",
                dtype,
                &c.download(&dx, x.len()),
                &want,
                tol(dtype, 2.0),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn rotary_matches_cpu_plain_and_llama3() {
    let Some(g) = gpu() else { return };
    let llama3 = cpu::Llama3RopeScaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(3);
        for (head_dim, theta, scaling) in [
            (64, 500_000.0, Some(llama3)),
            (128, 1_000_000.0, None),
            (16, 10_000.0, None),
        ] {
            let (t, qh, kh, max_pos) = (9, 7, 3, 5000);
            let inv = cpu::compute_inv_freq(head_dim, theta, scaling);
            let cache = c.round(&cpu::compute_cos_sin_cache(&inv, max_pos));
            let positions: Vec<i32> = (0..t).map(|_| r.below(max_pos) as i32).collect();
            let q = c.round(&r.vec(t * qh * head_dim, 2.0));
            let k = c.round(&r.vec(t * kh * head_dim, 2.0));
            let (mut wq, mut wk) = (q.clone(), k.clone());
            cpu::rotary_embedding_neox(&positions, &mut wq, &mut wk, head_dim, &cache, head_dim);
            let (mut dq, mut dk) = (c.upload(&q), c.upload(&k));
            c.ops
                .rotary_embedding_neox(
                    &c.ints(&positions),
                    &mut dq,
                    &mut dk,
                    &c.upload(&cache),
                    t,
                    qh,
                    kh,
                    head_dim,
                    head_dim,
                )
                .unwrap();
            assert_close(
                "rotary q",
                dtype,
                &c.download(&dq, q.len()),
                &wq,
                tol(dtype, 2.0),
            );
            assert_close(
                "rotary k",
                dtype,
                &c.download(&dk, k.len()),
                &wk,
                tol(dtype, 2.0),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn silu_and_mul_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(4);
        // d of whole 16-byte chunks: the vectorised path; 333: one element a step.
        for (rows, d) in [(11, 333), (7, 3072)] {
            let x = c.round(&r.vec(rows * 2 * d, 4.0));
            let mut want = vec![0.0; rows * d];
            cpu::silu_and_mul(&x, d, &mut want);
            let mut out = c.poisoned(rows * d);
            c.ops
                .silu_and_mul(&c.upload(&x), &mut out, rows, d)
                .unwrap();
            assert_close(
                "silu_and_mul",
                dtype,
                &c.download(&out, want.len()),
                &want,
                tol(dtype, 2.0),
            );
        }
    }
}

/// `qkv_prepare` (split, q/k per-head RMSNorm, neox rotary, k and v into the cache, one
/// launch) against the CPU's split, `rms_norm_per_head`, `rotary_embedding_neox` and
/// `reshape_and_cache`: head sizes whose lanes take 4 elements and one (36) whose lanes
/// take one, partial rotary, with and without the norms, and a padding slot whose k and
/// v go nowhere (the caches start random, so a stray or missing write shows).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn qkv_prepare_matches_cpu() {
    use vllm_kernels::cuda::QkvPrepare;
    let Some(g) = gpu() else { return };
    let (t, hq, hkv, max_pos, num_slots, eps) = (9, 4, 2, 64, 24, 1e-6);
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(29);
        for (d, rotary_dim, norm) in [(128, 128, true), (64, 32, false), (36, 36, true)] {
            let (q_row, kv_row) = (hq * d, hkv * d);
            let qkv = c.round(&r.vec(t * (q_row + 2 * kv_row), 2.0));
            let (qw, kw) = (c.round(&r.vec(d, 1.0)), c.round(&r.vec(d, 1.0)));
            let cos_sin = c.round(&r.vec(max_pos * rotary_dim, 1.0));
            let positions: Vec<i32> = (0..t).map(|_| r.below(max_pos) as i32).collect();
            let mut slots: Vec<i32> = (0..num_slots as i32).collect();
            for i in (1..slots.len()).rev() {
                slots.swap(i, r.below(i + 1));
            }
            slots.truncate(t);
            slots[2] = -1;
            let kc0 = c.round(&r.vec(num_slots * kv_row, 1.0));
            let vc0 = c.round(&r.vec(num_slots * kv_row, 1.0));

            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            for row in qkv.chunks(q_row + 2 * kv_row) {
                q.extend_from_slice(&row[..q_row]);
                k.extend_from_slice(&row[q_row..q_row + kv_row]);
                v.extend_from_slice(&row[q_row + kv_row..]);
            }
            if norm {
                cpu::rms_norm_per_head(&mut q, &qw, eps);
                cpu::rms_norm_per_head(&mut k, &kw, eps);
            }
            cpu::rotary_embedding_neox(&positions, &mut q, &mut k, d, &cos_sin, rotary_dim);
            let (mut wk, mut wv) = (kc0.clone(), vc0.clone());
            cpu::reshape_and_cache(&k, &v, &mut wk, &mut wv, &slots, kv_row);

            let (qwd, kwd) = (c.upload(&qw), c.upload(&kw));
            let (qkvd, csd) = (c.upload(&qkv), c.upload(&cos_sin));
            let (posd, slotd) = (c.ints(&positions), c.ints(&slots));
            let (kc, vc) = (c.upload(&kc0), c.upload(&vc0));
            let mut q_out = c.poisoned(t * q_row);
            let args = QkvPrepare {
                qkv: &qkvd,
                q_norm: norm.then_some(&qwd),
                k_norm: norm.then_some(&kwd),
                eps,
                positions: &posd,
                cos_sin: &csd,
                rotary_dim,
                slot_mapping: &slotd,
                key_cache: &kc,
                value_cache: &vc,
                num_tokens: t,
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim: d,
            };
            c.ops.qkv_prepare(&args, &mut q_out).unwrap();
            let what =
                |part: &str| format!("qkv_prepare d={d} rotary={rotary_dim} norm={norm} {part}");
            // Products rounded to the dtype before their sum (rotary.cu) against f32 sums.
            let t4 = tol(dtype, 4.0);
            assert_close(&what("q"), dtype, &c.download(&q_out, t * q_row), &q, t4);
            assert_close(&what("k cache"), dtype, &c.download(&kc, wk.len()), &wk, t4);
            assert_close(
                &what("v cache"),
                dtype,
                &c.download(&vc, wv.len()),
                &wv,
                tol(dtype, 0.0),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn reshape_and_cache_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(5);
        let (blocks, bs, kv_row) = (5, 4, 2 * 16);
        let slots_total = blocks * bs;
        // 13 tokens at distinct shuffled slots, two of them padding (-1).
        let mut slots: Vec<i32> = (0..slots_total as i32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, r.below(i + 1));
        }
        slots.truncate(13);
        slots[3] = -1;
        slots[9] = -1;
        let key = c.round(&r.vec(13 * kv_row, 1.0));
        let value = c.round(&r.vec(13 * kv_row, 1.0));
        let kc0 = c.round(&r.vec(slots_total * kv_row, 1.0));
        let vc0 = c.round(&r.vec(slots_total * kv_row, 1.0));
        let (mut wk, mut wv) = (kc0.clone(), vc0.clone());
        cpu::reshape_and_cache(&key, &value, &mut wk, &mut wv, &slots, kv_row);
        let (mut dk, mut dv) = (c.upload(&kc0), c.upload(&vc0));
        c.ops
            .reshape_and_cache(
                &c.upload(&key),
                &c.upload(&value),
                &mut dk,
                &mut dv,
                &c.ints(&slots),
                13,
                kv_row,
            )
            .unwrap();
        assert_close(
            "key cache",
            dtype,
            &c.download(&dk, wk.len()),
            &wk,
            tol(dtype, 0.0),
        );
        assert_close(
            "value cache",
            dtype,
            &c.download(&dv, wv.len()),
            &wv,
            tol(dtype, 0.0),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn copies_match_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(6);
        let (rows, cols) = (7, 45);
        let x = c.round(&r.vec(rows * cols, 1.0));
        let dx = c.upload(&x);
        // split_cols: columns 10..10+21
        let mut out = c.poisoned(rows * 21);
        c.ops.split_cols(&dx, &mut out, rows, cols, 10, 21).unwrap();
        let want: Vec<f32> = (0..rows)
            .flat_map(|i| x[i * cols + 10..i * cols + 31].to_vec())
            .collect();
        assert_close(
            "split_cols",
            dtype,
            &c.download(&out, want.len()),
            &want,
            tol(dtype, 0.0),
        );
        // gather_rows
        let idx = [6, 0, 3, 3];
        let mut out = c.poisoned(idx.len() * cols);
        c.ops
            .gather_rows(&dx, &c.ints(&idx), &mut out, idx.len(), cols)
            .unwrap();
        let want: Vec<f32> = idx
            .iter()
            .flat_map(|&i| x[i as usize * cols..(i as usize + 1) * cols].to_vec())
            .collect();
        assert_close(
            "gather_rows",
            dtype,
            &c.download(&out, want.len()),
            &want,
            tol(dtype, 0.0),
        );
        // add_bias
        let bias = c.round(&r.vec(cols, 1.0));
        let mut y = c.upload(&x);
        c.ops
            .add_bias(&mut y, &c.upload(&bias), rows, cols)
            .unwrap();
        let want: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, v)| v + bias[i % cols])
            .collect();
        assert_close(
            "add_bias",
            dtype,
            &c.download(&y, want.len()),
            &want,
            tol(dtype, 1.0),
        );
    }
}

/// The thin-GEMM kernel at every row count it takes, both rows-per-warp variants, odd
/// output counts (a warp's second row past the end) and K without a whole unrolled pass.
/// The output is poisoned one row of x past its end: that row must stay NaN.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn gemv_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let vec = 16 / dtype.size();
        let mut r = Lcg(11);
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
                for rows_per_warp in [1, 2] {
                    let mut out = c.poisoned((m + 1) * n);
                    c.ops
                        .gemv_with_rows(&xd, &wd, &mut out, (m, k, n), rows_per_warp)
                        .unwrap();
                    let got = c.download(&out, (m + 1) * n);
                    let what = format!("gemv m={m} k={k} n={n} r={rows_per_warp}");
                    // f32 sums on both sides in different orders, one rounding of O(1)
                    // outputs.
                    let t = match dtype {
                        DType::F32 => Tol {
                            abs: 1e-5,
                            rel: 1e-5,
                        },
                        _ => tol(dtype, 1.0),
                    };
                    assert_close(&what, dtype, &got[..m * n], &want, t);
                    assert!(
                        got[m * n..].iter().all(|v| v.is_nan()),
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

/// The fused gate/up product with SiLU-and-mul is bit for bit the thin GEMM followed by
/// `silu_and_mul` (each checked against the CPU on its own), and writes nothing past its
/// output.
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
                .gemv_with_rows(&xd, &wd, &mut gate_up, (1, k, 2 * d), 1)
                .unwrap();
            let mut unfused = c.poisoned(d);
            c.ops.silu_and_mul(&gate_up, &mut unfused, 1, d).unwrap();
            let mut fused = c.poisoned(d + 1);
            c.ops.gemv_silu_mul(&xd, &wd, &mut fused, k, d).unwrap();
            let (want, got) = (c.download(&unfused, d), c.download(&fused, d + 1));
            let what = format!("gemv_silu_mul {dtype:?} k={k} d={d}");
            assert!(
                want.iter().all(|v| v.is_finite()),
                "{what}: unfused path not finite"
            );
            for (j, (a, b)) in got[..d].iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{what}: output {j}: {a} vs {b}");
            }
            assert!(got[d].is_nan(), "{what}: wrote past its output");
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

/// One attention scenario: sequences (context_len, query_len), GQA shape, block size.
fn attention_case(
    c: &Ctx,
    r: &mut Lcg,
    seqs: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
    bs: usize,
) {
    let sixteen_bit = c.dtype != DType::F32;
    attention_case_with(c, r, seqs, hq, hkv, d, bs, AttentionKernels::CUDA_CORE);
    let flash = AttentionKernels::flash(sixteen_bit);
    attention_case_with(c, r, seqs, hq, hkv, d, bs, flash);
}

#[allow(clippy::too_many_arguments)]
fn attention_case_with(
    c: &Ctx,
    r: &mut Lcg,
    seqs: &[(usize, usize)],
    hq: usize,
    hkv: usize,
    d: usize,
    bs: usize,
    kernels: AttentionKernels,
) {
    let num_seqs = seqs.len();
    let max_len = seqs.iter().map(|(c, q)| c + q).max().unwrap();
    let max_blocks = max_len.div_ceil(bs);
    let num_blocks = max_blocks * num_seqs + 3;
    // Shuffled block ids for every sequence.
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.below(i + 1));
    }
    let block_tables: Vec<i32> = (0..num_seqs)
        .flat_map(|s| ids[s * max_blocks..(s + 1) * max_blocks].to_vec())
        .collect();
    let kv_row = hkv * d;
    let kc = c.round(&r.vec(num_blocks * bs * kv_row, 1.0));
    let vc = c.round(&r.vec(num_blocks * bs * kv_row, 1.0));
    let mut qsl = vec![0i32];
    let mut seq_lens = Vec::new();
    for &(ctx, q) in seqs {
        qsl.push(qsl.last().unwrap() + q as i32);
        seq_lens.push((ctx + q) as i32);
    }
    let t = *qsl.last().unwrap() as usize;
    let q = c.round(&r.vec(t * hq * d, 2.0));
    let shape = PagedAttentionShape {
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        max_blocks_per_seq: max_blocks,
    };
    let scale = 1.0 / (d as f32).sqrt();
    let mut want = vec![f32::NAN; t * hq * d];
    cpu::paged_attention(
        &q,
        &kc,
        &vc,
        &block_tables,
        &seq_lens,
        &qsl,
        &shape,
        scale,
        &mut want,
    );
    let plan = AttentionPlan::new(&qsl, &seq_lens, hq, hkv, c.ops.num_sms, kernels).unwrap();
    let meta = AttentionMeta {
        block_tables: &c.ints(&block_tables),
        max_blocks_per_seq: max_blocks,
        seq_lens: &c.ints(&seq_lens),
        query_start_loc: &c.ints(&qsl),
        tile_seq: &c.ints(&plan.tile_seq),
        tile_token: &c.ints(&plan.tile_token),
        decode_seqs: &c.ints(&plan.decode_seqs),
        decode_partition: &c.ints(&[plan.decode_partition as i32]),
        plan: &plan,
    };
    let dims = AttentionDims {
        num_tokens: t,
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
    };
    let mut out = c.poisoned(t * hq * d);
    c.ops
        .paged_attention(
            &c.upload(&q),
            &c.upload(&kc),
            &c.upload(&vc),
            &meta,
            dims,
            scale,
            &mut out,
        )
        .unwrap();
    let what = format!(
        "paged_attention seqs {seqs:?} hq {hq} hkv {hkv} d {d} bs {bs} tiles {:?} splits {} \
         decode partitions {}×{}",
        plan.tile_kernel, plan.num_splits, plan.decode_partitions, plan.decode_partition
    );
    // Outputs are convex combinations of V rows (|v| <= 1): an absolute bound.
    let t = match c.dtype {
        DType::F32 => Tol {
            abs: 2e-5,
            rel: 0.0,
        },
        dt => tol(dt, 2.0),
    };
    assert_close(&what, c.dtype, &c.download(&out, want.len()), &want, t);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn paged_attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(8);
        // A mixed step: fresh prefill, chunk over a cached prefix crossing blocks,
        // decodes (one with a single key), a prefill longer than several tiles.
        let mixed = [(0, 37), (45, 20), (100, 1), (0, 1), (16, 16), (3, 70)];
        attention_case(&c, &mut r, &mixed, 16, 8, 128, 16); // Qwen3-0.6B's group
        attention_case(&c, &mut r, &mixed, 14, 2, 64, 16); // Qwen2.5-0.5B's group of 7
        attention_case(&c, &mut r, &mixed, 32, 8, 64, 16); // Llama 3.2 1B's group of 4
        attention_case(&c, &mut r, &mixed, 4, 2, 16, 4); // the tiny models
        attention_case(&c, &mut r, &mixed, 8, 8, 32, 5); // MHA, odd block size
                                                         // Long decodes of few sequences: the split (flash-decoding) path.
        attention_case(&c, &mut r, &[(3000, 1), (1234, 1)], 16, 8, 128, 16);
        attention_case(&c, &mut r, &[(4099, 1)], 32, 8, 64, 16);
        // Decodes only, as a padded graph batch has them: a single key beside long ones
        // (most partitions of the fixed grid lie past their sequence's end).
        attention_case(&c, &mut r, &[(0, 1), (2000, 1), (5, 1)], 16, 8, 128, 16);
        // A full decode batch of mixed lengths (two 512-key partitions, some sequences
        // ending in the first), and long prefills over cached prefixes (many key tiles,
        // the causal edge inside a tile).
        let batch: Vec<(usize, usize)> = (0..64).map(|i| (13 * i + i * i % 700, 1)).collect();
        attention_case(&c, &mut r, &batch, 16, 8, 128, 16);
        attention_case(
            &c,
            &mut r,
            &[(300, 200), (0, 129), (1000, 3)],
            16,
            8,
            128,
            16,
        );
        attention_case(&c, &mut r, &[(77, 150), (0, 65)], 14, 2, 64, 16);
        // A batch that fills the SMs several times: long single-partition decode blocks.
        let wide: Vec<(usize, usize)> = (0..140).map(|i| ((i * 97) % 1300 + 600, 1)).collect();
        attention_case(&c, &mut r, &wide, 8, 4, 64, 16);
        // The same at Qwen3-8B's heads: partitions of 1,024 keys, so that the sequences
        // that fit are written whole by their block and the longer ones are combined.
        attention_case(&c, &mut r, &wide, 32, 8, 128, 16);
        // Qwen3-8B's group of 4 and Llama-3.1-70B's of 8 at head size 128 (the decode
        // kernels' tuning variants exist there only): decodes of mixed lengths, split too.
        let decodes = [(600, 1), (0, 1), (1500, 1), (37, 1)];
        attention_case(&c, &mut r, &decodes, 32, 8, 128, 16);
        attention_case(&c, &mut r, &decodes, 64, 8, 128, 16);
        attention_case(&c, &mut r, &[(2500, 1)], 32, 8, 128, 16);
        // One sequence short enough for batch 1's shortest partitions (32 keys), at groups
        // 4 and 8 and an odd block size.
        attention_case(&c, &mut r, &[(700, 1)], 32, 8, 128, 16);
        attention_case(&c, &mut r, &[(300, 1)], 64, 8, 128, 16);
        attention_case(&c, &mut r, &[(200, 1)], 8, 8, 32, 5);
        // A group of 16: decodes fall back to tiles.
        attention_case(&c, &mut r, &[(50, 1), (10, 30)], 16, 1, 64, 16);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn greedy_sampling_is_the_first_argmax() {
    let Some(g) = gpu() else { return };
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(9);
        let (rows, vocab) = (8, 151_936);
        let mut x = c.round(&r.vec(rows * vocab, 4.0));
        // Row 1: a tie for the maximum (the lower id wins); row 2: NaN and +inf.
        x[vocab + 7] = 100.0;
        x[vocab + 9000] = 100.0;
        x[2 * vocab + 5] = f32::NAN;
        x[2 * vocab + 77] = f32::INFINITY;
        // Row 3: a tie across chunks (8,192 tokens a block), met last-chunk first.
        for t in [150_000, 40_000, 20_000] {
            x[3 * vocab + t] = 100.0;
        }
        // Row 4: -0 and +0 tie as floats compare, across chunks: the first wins.
        x[4 * vocab..5 * vocab].fill(-1.0);
        x[4 * vocab + 30_000] = -0.0;
        x[4 * vocab + 100_000] = 0.0;
        // Rows 5 and 6: nothing finite (all -inf; all NaN): token 0.
        x[5 * vocab..6 * vocab].fill(f32::NEG_INFINITY);
        x[6 * vocab..7 * vocab].fill(f32::NAN);
        // Row 7: -inf but for one finite logit in the last chunk.
        x[7 * vocab..8 * vocab].fill(f32::NEG_INFINITY);
        x[7 * vocab + 151_000] = -3.0;
        // Plain greedy rows: no logits-processor entries, no logprobs.
        let params = vec![SampleRowEx::plain(Default::default()); rows];
        let batch = SamplingBatch::plain(&params);
        let got = c
            .ops
            .sample_tokens_ex(&c.upload(&x), vocab, &batch, true)
            .unwrap()
            .tokens;
        for row in 0..rows {
            let rowv = &x[row * vocab..(row + 1) * vocab];
            let mut best = 0;
            for (i, &v) in rowv.iter().enumerate() {
                let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
                let b = if rowv[best].is_nan() {
                    f32::NEG_INFINITY
                } else {
                    rowv[best]
                };
                if v > b {
                    best = i;
                }
            }
            assert_eq!(got[row], best as i32, "{dtype:?} row {row}");
        }
        assert_eq!(got[1], 7);
        assert_eq!(got[2], 77);
    }
}
