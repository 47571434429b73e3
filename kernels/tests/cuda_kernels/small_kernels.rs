//! The small kernels of a layer: embedding, RMS norms, rotary embedding, SiLU-and-mul,
//! qkv_prepare, the KV-cache write and the copies.

use super::*;

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

/// The deferred norm's kernels (norm.cu): `silu_and_mul_rms` against the CPU's
/// `silu_and_mul` of the gate/up rows scaled by their source row's 1 / RMS and rounded,
/// and `scale_cols` against the weight's columns times the norm, rounded.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn deferred_norm_kernels_match_cpu() {
    let Some(g) = gpu() else { return };
    let eps = 1e-6;
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(41);
        // Vectorised rows (3072, 1024), one element a step (333, 1037), and a row wider
        // than a block of 512 threads takes chunks (12,288).
        for (rows, d, hidden) in [(5, 3072, 1024), (3, 333, 1037), (2, 12288, 4096)] {
            let x = c.round(&r.vec(rows * 2 * d, 4.0));
            let src = c.round(&r.vec(rows * hidden, 30.0));
            let mut scaled = x.clone();
            for (row, s) in scaled.chunks_mut(2 * d).zip(src.chunks(hidden)) {
                let inv = cpu::inv_rms(s, eps);
                row.iter_mut().for_each(|v| *v = dtype.round(*v * inv));
            }
            let mut want = vec![0.0; rows * d];
            cpu::silu_and_mul(&scaled, d, &mut want);
            let mut out = c.poisoned(rows * d);
            c.ops
                .silu_and_mul_rms(
                    &c.upload(&x),
                    &c.upload(&src),
                    &mut out,
                    rows,
                    (d, hidden),
                    eps,
                )
                .unwrap();
            let what = format!("silu_and_mul_rms d={d} hidden={hidden}");
            assert_close(
                &what,
                dtype,
                &c.download(&out, want.len()),
                &want,
                tol(dtype, 3.0),
            );
        }
        let (rows, cols) = (67, 1031);
        let w = c.round(&r.vec(rows * cols, 1.0));
        let norm = c.round(&r.vec(cols, 2.0));
        let want: Vec<f32> = w
            .iter()
            .enumerate()
            .map(|(i, v)| dtype.round(v * norm[i % cols]))
            .collect();
        let mut wd = c.upload(&w);
        c.ops
            .scale_cols(&mut wd, &c.upload(&norm), rows, cols)
            .unwrap();
        assert_close(
            "scale_cols",
            dtype,
            &c.download(&wd, w.len()),
            &want,
            tol(dtype, 0.0),
        );
    }
}

/// `qkv_prepare` (split, q/k per-head RMSNorm, neox rotary, k and v into the cache, one
/// launch) against the CPU's split, `rms_norm_per_head`, `rotary_embedding_neox` and
/// `reshape_and_cache`: head sizes of whole 16-byte chunks (128, 64: `qkv_prepare_wide`,
/// several heads a warp in 16-bit dtypes), one whose lanes take 4 elements (96: 12 chunks)
/// and one whose lanes take one (36), partial rotary, with and without the norms, each
/// plain, with a deferred input norm, with a bias and with both, and a
/// padding slot whose k and v go nowhere (the caches start random, so a stray or missing
/// write shows). Steps of 9 and of 200 tokens take a few heads a block, of 70 a token's
/// heads in one block (`QKV_TOKEN_BLOCK_STEPS`), or in two where they outnumber a block
/// (80 heads of 128).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn qkv_prepare_matches_cpu() {
    for (t, hq, hkv) in [(9, 4, 2), (70, 4, 2), (70, 64, 8), (200, 4, 2)] {
        qkv_prepare_step_matches_cpu(t, hq, hkv);
    }
}

fn qkv_prepare_step_matches_cpu(t: usize, hq: usize, hkv: usize) {
    use vllm_kernels::cuda::QkvPrepare;
    let Some(g) = gpu() else { return };
    let (max_pos, num_slots, eps) = (64, 2 * t + 6, 1e-6);
    for dtype in DTYPES {
        let c = Ctx::new(&g, dtype);
        let mut r = Lcg(29);
        let heads = [
            (128, 128, true),
            (64, 32, false),
            (96, 96, true),
            (36, 36, true),
        ];
        let variants = [(false, false), (true, false), (false, true), (true, true)];
        for ((d, rotary_dim, norm), (deferred, biased)) in
            heads.into_iter().flat_map(|h| variants.map(|v| (h, v)))
        {
            let (q_row, kv_row) = (hq * d, hkv * d);
            let width = q_row + 2 * kv_row;
            let raw = c.round(&r.vec(t * width, 2.0));
            // A deferred input norm scales each row by its input row's 1 / RMS; the bias
            // is added after it, the sum rounded once.
            let hidden = 3 * d + 5;
            let input = c.round(&r.vec(t * hidden, 20.0));
            let bias = c.round(&r.vec(width, 1.0));
            let mut qkv = raw.clone();
            for (row, x) in qkv.chunks_mut(width).zip(input.chunks(hidden)) {
                let inv = if deferred { cpu::inv_rms(x, eps) } else { 1.0 };
                for (j, v) in row.iter_mut().enumerate() {
                    let b = if biased { bias[j] } else { 0.0 };
                    *v = dtype.round(*v * inv + b);
                }
            }
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
            let (qkvd, csd, inputd) = (c.upload(&raw), c.upload(&cos_sin), c.upload(&input));
            let biasd = c.upload(&bias);
            let (posd, slotd) = (c.ints(&positions), c.ints(&slots));
            let (kc, vc) = (c.upload(&kc0), c.upload(&vc0));
            let mut q_out = c.poisoned(t * q_row);
            let args = QkvPrepare {
                qkv: &qkvd,
                bias: biased.then_some(&biasd),
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
                deferred_norm: deferred.then_some((&inputd, hidden, eps)),
            };
            c.ops.qkv_prepare(&args, &mut q_out).unwrap();
            let what = |part: &str| {
                format!(
                    "qkv_prepare t={t} heads={hq}+2x{hkv} d={d} rotary={rotary_dim} norm={norm} \
                     deferred={deferred} biased={biased} {part}"
                )
            };
            // Products rounded to the dtype before their sum (rotary.cu) against f32 sums.
            let t4 = tol(dtype, 4.0);
            assert_close(&what("q"), dtype, &c.download(&q_out, t * q_row), &q, t4);
            assert_close(&what("k cache"), dtype, &c.download(&kc, wk.len()), &wk, t4);
            assert_close(
                &what("v cache"),
                dtype,
                &c.download(&vc, wv.len()),
                &wv,
                // Copied as is, or scaled (by a sum in another order than ours) and biased.
                tol(dtype, if deferred || biased { 1.0 } else { 0.0 }),
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
    }
}
