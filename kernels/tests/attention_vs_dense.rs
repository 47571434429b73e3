//! Paged attention against a naive dense causal attention, with shuffled blocks, GQA,
//! several sequences, prefix context and NaN-poisoned unused cache slots.

use vllm_kernels::cpu::attention::{paged_attention, PagedAttentionShape};
use vllm_kernels::cpu::reshape_and_cache;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// Dense causal attention over one whole sequence: q [L, Hq, D], k/v [L, Hkv, D].
fn dense(q: &[f32], k: &[f32], v: &[f32], len: usize, hq: usize, hkv: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0; len * hq * d];
    let scale = 1.0 / (d as f64).sqrt();
    for i in 0..len {
        for h in 0..hq {
            let kvh = h / (hq / hkv);
            let qi = &q[(i * hq + h) * d..][..d];
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    qi.iter()
                        .zip(&k[(j * hkv + kvh) * d..][..d])
                        .map(|(a, b)| (*a * *b) as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for dd in 0..d {
                let o: f64 = (0..=i)
                    .map(|j| w[j] * v[(j * hkv + kvh) * d + dd] as f64)
                    .sum::<f64>()
                    / z;
                out[(i * hq + h) * d + dd] = o as f32;
            }
        }
    }
    out
}

#[test]
fn paged_matches_dense_for_prefill_chunks_and_decode() {
    let (hq, hkv, d, bs) = (4, 2, 8, 4);
    let num_blocks = 16;
    let mut rng = Lcg(7);
    // Two sequences: lengths 11 (6 cached + 5 queried) and 7 (6 cached + 1 decode).
    let lens = [11usize, 7];
    let query_lens = [5usize, 1];
    let tables: [Vec<i32>; 2] = [vec![9, 2, 14], vec![5, 0]];
    let max_blocks = 3;
    let qs: Vec<Vec<f32>> = lens.iter().map(|&l| rng.vec(l * hq * d)).collect();
    let ks: Vec<Vec<f32>> = lens.iter().map(|&l| rng.vec(l * hkv * d)).collect();
    let vs: Vec<Vec<f32>> = lens.iter().map(|&l| rng.vec(l * hkv * d)).collect();

    let kv_row = hkv * d;
    let mut kc = vec![f32::NAN; num_blocks * bs * kv_row];
    let mut vc = vec![f32::NAN; num_blocks * bs * kv_row];
    for s in 0..2 {
        let slots: Vec<i32> = (0..lens[s])
            .map(|p| tables[s][p / bs] * bs as i32 + (p % bs) as i32)
            .collect();
        reshape_and_cache(&ks[s], &vs[s], &mut kc, &mut vc, &slots, kv_row);
    }
    let mut block_tables = vec![0i32; 2 * max_blocks];
    for s in 0..2 {
        block_tables[s * max_blocks..s * max_blocks + tables[s].len()].copy_from_slice(&tables[s]);
    }
    let mut q = Vec::new();
    for s in 0..2 {
        let ctx = lens[s] - query_lens[s];
        q.extend_from_slice(&qs[s][ctx * hq * d..]);
    }
    let t = query_lens.iter().sum::<usize>();
    let mut out = vec![f32::NAN; t * hq * d];
    let shape = PagedAttentionShape {
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        max_blocks_per_seq: max_blocks,
    };
    paged_attention(
        &q,
        &kc,
        &vc,
        &block_tables,
        &[11, 7],
        &[0, 5, 6],
        &shape,
        1.0 / (d as f32).sqrt(),
        &mut out,
    );

    let mut row = 0;
    for s in 0..2 {
        let want = dense(&qs[s], &ks[s], &vs[s], lens[s], hq, hkv, d);
        let ctx = lens[s] - query_lens[s];
        for i in ctx..lens[s] {
            for x in 0..hq * d {
                let (g, w) = (out[row * hq * d + x], want[i * hq * d + x]);
                assert!((g - w).abs() < 1e-5, "seq {s} pos {i}: {g} vs {w}");
            }
            row += 1;
        }
    }
}
