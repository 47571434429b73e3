//! The fast paged attention: the reference kernel's algorithm (`cpu::attention`: scores in
//! key order, max, `exp(s - max)`, weighted sum of values in key order, divide), run in
//! parallel over (sequence, head, chunk of query tokens), with SIMD dot products
//! (`math::dot_scalar`'s order) and exponentials (`math::exp_scalar`).
//!
//! What one (token, head) gets does not depend on the batch, the chunking, the thread
//! count or the ISA.

use super::isa::Isa;
use super::math::{dot_scalar, exp_in_place};
use super::pool::ThreadPool;
use crate::cpu::attention::PagedAttentionShape;

/// Query tokens per task.
const TOKENS_PER_TASK: usize = 16;

fn scores(q: &[f32], cache: &[f32], offsets: &[usize], scale: f32, out: &mut [f32], isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => super::x86::scores(q, cache, offsets, scale, out, isa),
        _ => {
            for (o, &off) in out.iter_mut().zip(offsets) {
                *o = dot_scalar(q, &cache[off..off + q.len()]) * scale;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn weighted_sum(
    rows: usize,
    w: &[f32],
    w_stride: usize,
    cache: &[f32],
    offsets: &[usize],
    acc: &mut [f32],
    hd: usize,
    isa: Isa,
) {
    #[cfg(target_arch = "x86_64")]
    super::x86::weighted_sum(rows, w, w_stride, cache, offsets, acc, hd, isa);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        super::math::weighted_sum_body(rows, w, w_stride, cache, offsets, acc, hd);
    }
}

/// Query heads (of one KV head's group) whose value sums run together.
const ROWS: usize = 4;

/// Keys whose K (then V) vectors every row of a task uses before the next ones.
const KEYS_PER_BLOCK: usize = 16;

struct OutPtr(*mut f32);
// SAFETY: each task writes the rows of its own (token, head) pairs only, and the caller
// waits for every task.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// The same contract as `cpu::paged_attention`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    key_cache: &[f32],
    value_cache: &[f32],
    block_tables: &[i32],
    seq_lens: &[i32],
    query_start_loc: &[i32],
    shape: &PagedAttentionShape,
    scale: f32,
    out: &mut [f32],
    pool: &ThreadPool,
    isa: Isa,
) {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    let PagedAttentionShape {
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_blocks_per_seq,
    } = *shape;
    let num_seqs = seq_lens.len();
    shape.check(
        q.len(),
        out.len(),
        block_tables.len(),
        seq_lens,
        query_start_loc,
    );
    assert_eq!(
        key_cache.len(),
        value_cache.len(),
        "paged_attention: cache shapes"
    );
    let group = num_q_heads / num_kv_heads;
    let kv_row = num_kv_heads * head_dim;
    let num_slots = key_cache.len() / kv_row.max(1);

    // Tasks: (sequence, KV head, its query heads `g0..g1`, first token of the chunk). The
    // heads of a group share their keys and values; a decode splits the group instead, so
    // that every thread gets work.
    let total_queries = (query_start_loc[num_seqs] as usize) * num_kv_heads;
    let heads_per_task = if total_queries < 4 * pool.threads() {
        1
    } else {
        group
    };
    let mut tasks = Vec::new();
    for s in 0..num_seqs {
        let query_len = (query_start_loc[s + 1] - query_start_loc[s]) as usize;
        let seq_len = seq_lens[s] as usize;
        assert!(
            query_len <= seq_len,
            "paged_attention: query_len {query_len} > seq_len {seq_len}"
        );
        assert!(
            seq_len <= max_blocks_per_seq * block_size,
            "paged_attention: block table too short"
        );
        for kvh in 0..num_kv_heads {
            for g0 in (0..group).step_by(heads_per_task) {
                for j0 in (0..query_len).step_by(TOKENS_PER_TASK) {
                    tasks.push((s, kvh, g0, (g0 + heads_per_task).min(group), j0));
                }
            }
        }
    }
    // Later chunks of a prompt see more keys: start with them.
    tasks.sort_by_key(|t| std::cmp::Reverse(t.4));
    let out_ptr = OutPtr(out.as_mut_ptr());
    let out_ptr = &out_ptr;
    pool.run(tasks.len(), |task| {
        let (s, kvh, g0, g1, j0) = tasks[task];
        let q_start = query_start_loc[s] as usize;
        let query_len = query_start_loc[s + 1] as usize - q_start;
        let context_len = seq_lens[s] as usize - query_len;
        let j1 = (j0 + TOKENS_PER_TASK).min(query_len);
        let table = &block_tables[s * max_blocks_per_seq..(s + 1) * max_blocks_per_seq];
        // Where each key of this KV head starts in the caches (K and V share the layout).
        let max_keys = context_len + j1;
        let offsets: Vec<usize> = (0..max_keys)
            .map(|p| {
                let slot = table[p / block_size] as usize * block_size + p % block_size;
                assert!(
                    slot < num_slots,
                    "paged_attention: slot {slot} outside the cache"
                );
                slot * kv_row + kvh * head_dim
            })
            .collect();
        // Rows: (token j, head h) → row (j - j0) · heads + (h - h0), each with its scores
        // (then weights) over keys 0..context_len + j + 1.
        let (h0, heads) = (kvh * group + g0, g1 - g0);
        let rows = (j1 - j0) * heads;
        let keys_of = |r: usize| context_len + j0 + r / heads + 1;
        let q_row = |r: usize| {
            let at = ((q_start + j0 + r / heads) * num_q_heads + h0 + r % heads) * head_dim;
            (at, &q[at..at + head_dim])
        };
        let mut w = vec![0f32; rows * max_keys];
        // Keys a block at a time, so that the block's K (then V) stays in L1 while every
        // row that sees it uses it.
        for k0 in (0..max_keys).step_by(KEYS_PER_BLOCK) {
            for r in 0..rows {
                let k1 = (k0 + KEYS_PER_BLOCK).min(keys_of(r));
                if k1 > k0 {
                    let out = &mut w[r * max_keys + k0..r * max_keys + k1];
                    scores(q_row(r).1, key_cache, &offsets[k0..k1], scale, out, isa);
                }
            }
        }
        let mut denom = vec![0f32; rows];
        for (r, d) in denom.iter_mut().enumerate() {
            let wr = &mut w[r * max_keys..r * max_keys + keys_of(r)];
            let max = wr.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            wr.iter_mut().for_each(|s| *s -= max);
            exp_in_place(wr, isa);
            *d = wr.iter().fold(0f32, |d, &x| d + x);
        }
        let mut acc = vec![0f32; rows * head_dim];
        for k0 in (0..max_keys).step_by(KEYS_PER_BLOCK) {
            // A token's heads share their keys: up to `ROWS` of them per weighted sum.
            for r0 in (0..rows).step_by(heads) {
                let k1 = (k0 + KEYS_PER_BLOCK).min(keys_of(r0));
                if k1 <= k0 {
                    continue;
                }
                for r in (r0..r0 + heads).step_by(ROWS) {
                    let n = ROWS.min(r0 + heads - r);
                    weighted_sum(
                        n,
                        &w[r * max_keys + k0..],
                        max_keys,
                        value_cache,
                        &offsets[k0..k1],
                        &mut acc[r * head_dim..(r + n) * head_dim],
                        head_dim,
                        isa,
                    );
                }
            }
        }
        for (r, &d) in denom.iter().enumerate() {
            let at = q_row(r).0;
            // SAFETY: row (token, head) of `out` is written by this task alone, and lies
            // inside `out` (its length was checked against the shape).
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.0.add(at), head_dim) };
            for (o, a) in dst.iter_mut().zip(&acc[r * head_dim..(r + 1) * head_dim]) {
                *o = a / d;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    struct Case {
        q: Vec<f32>,
        kc: Vec<f32>,
        vc: Vec<f32>,
        tables: Vec<i32>,
        seq_lens: Vec<i32>,
        qsl: Vec<i32>,
        shape: PagedAttentionShape,
    }

    /// Two sequences in shuffled blocks: one decoding with a long context, one chunk of a
    /// prefill after a cached prefix. Groups of 5 query heads per KV head (a run of 4 and
    /// one of 1); head_dim 40 has a tail past the 16-lane chunks.
    fn case(rng: &mut StdRng, head_dim: usize) -> Case {
        let shape = PagedAttentionShape {
            num_q_heads: 10,
            num_kv_heads: 2,
            head_dim,
            block_size: 4,
            max_blocks_per_seq: 10,
        };
        let num_blocks = 24;
        let kv = num_blocks * shape.block_size * shape.num_kv_heads * head_dim;
        let mut r = |n: usize| {
            (0..n)
                .map(|_| rng.random_range(-2.0f32..2.0))
                .collect::<Vec<_>>()
        };
        let (kc, vc) = (r(kv), r(kv));
        let mut tables: Vec<i32> = (0..20).map(|i| i * 7 % 23).collect();
        tables[5] = 23;
        let seq_lens = vec![37, 21];
        let qsl = vec![0, 1, 1 + 19];
        let q = r(20 * shape.num_q_heads * head_dim);
        Case {
            q,
            kc,
            vc,
            tables,
            seq_lens,
            qsl,
            shape,
        }
    }

    #[test]
    fn matches_the_reference_and_every_isa_gives_the_same_bits() {
        let mut rng = StdRng::seed_from_u64(9);
        for head_dim in [64, 40, 8] {
            let c = case(&mut rng, head_dim);
            let scale = 1.0 / (head_dim as f32).sqrt();
            let mut want = vec![f32::NAN; c.q.len()];
            crate::cpu::paged_attention(
                &c.q,
                &c.kc,
                &c.vc,
                &c.tables,
                &c.seq_lens,
                &c.qsl,
                &c.shape,
                scale,
                &mut want,
            );
            let mut first: Option<Vec<f32>> = None;
            for threads in [1, 3] {
                let pool = ThreadPool::new(threads);
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; c.q.len()];
                    paged_attention(
                        &c.q,
                        &c.kc,
                        &c.vc,
                        &c.tables,
                        &c.seq_lens,
                        &c.qsl,
                        &c.shape,
                        scale,
                        &mut got,
                        &pool,
                        isa,
                    );
                    for (a, b) in got.iter().zip(&want) {
                        assert!(
                            (a - b).abs() <= 2e-6 * (1.0 + b.abs()),
                            "{isa:?}: {a} vs {b}"
                        );
                    }
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert_eq!(&got, f, "{isa:?}, {threads} threads"),
                    }
                }
            }
        }
    }

    #[test]
    fn a_token_gets_the_same_bits_in_a_prefill_and_in_a_decode() {
        let mut rng = StdRng::seed_from_u64(4);
        let c = case(&mut rng, 64);
        let pool = ThreadPool::new(2);
        let isa = Isa::detect();
        let row = c.shape.num_q_heads * c.shape.head_dim;
        // Sequence 1 computes its last 19 tokens in one go ...
        let mut all = vec![f32::NAN; c.q.len()];
        paged_attention(
            &c.q,
            &c.kc,
            &c.vc,
            &c.tables,
            &c.seq_lens,
            &c.qsl,
            &c.shape,
            0.3,
            &mut all,
            &pool,
            isa,
        );
        // ... or its token at position 15 alone, as a decode step of a 16-token sequence.
        let j = 13;
        let tables = &c.tables[10..20];
        let mut one = vec![f32::NAN; row];
        paged_attention(
            &c.q[(1 + j) * row..(2 + j) * row],
            &c.kc,
            &c.vc,
            tables,
            &[2 + j as i32 + 1],
            &[0, 1],
            &c.shape,
            0.3,
            &mut one,
            &pool,
            isa,
        );
        assert_eq!(one, all[(1 + j) * row..(2 + j) * row]);
    }
}
