//! Paged attention: one kernel for prefill chunks, prefix-cache hits and decode.
//!
//! Every query token belongs to the sequence given by `query_start_loc` (vLLM's
//! `cu_seqlens_q`). A sequence with `seq_len` tokens of which the last `query_len` are
//! queried this step has `context_len = seq_len - query_len` tokens already in the cache;
//! its j-th query token sits at position `context_len + j` and attends causally to keys
//! `0..=position`, read through the sequence's block table. The new tokens' K and V must
//! already be in the cache (`reshape_and_cache` runs first), so prefill, chunked prefill
//! and decode are the same computation.

/// Static shape of the attention problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedAttentionShape {
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Row width of `block_tables`.
    pub max_blocks_per_seq: usize,
}

impl PagedAttentionShape {
    /// Panics unless the buffers' lengths fit this shape for `seq_lens.len()` sequences (see
    /// `paged_attention`).
    pub fn check(
        &self,
        q_len: usize,
        out_len: usize,
        block_tables_len: usize,
        seq_lens: &[i32],
        query_start_loc: &[i32],
    ) {
        let num_seqs = seq_lens.len();
        assert_eq!(
            query_start_loc.len(),
            num_seqs + 1,
            "paged_attention: query_start_loc shape"
        );
        let t = query_start_loc[num_seqs] as usize;
        assert_eq!(
            q_len,
            t * self.num_q_heads * self.head_dim,
            "paged_attention: q shape"
        );
        assert_eq!(out_len, q_len, "paged_attention: out shape");
        assert_eq!(
            block_tables_len,
            num_seqs * self.max_blocks_per_seq,
            "paged_attention: block_tables shape"
        );
        assert_eq!(
            self.num_q_heads % self.num_kv_heads,
            0,
            "paged_attention: GQA group"
        );
    }
}

/// Shapes: `q`, `out` [T, num_q_heads, head_dim]; caches [num_blocks, block_size,
/// num_kv_heads, head_dim]; `block_tables` [num_seqs, max_blocks_per_seq]; `seq_lens`
/// [num_seqs]; `query_start_loc` [num_seqs + 1] with `query_start_loc[num_seqs] == T`.
/// Softmax over `scale · q·k` with scores and weighted sums accumulated in key order.
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
) {
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
    let group = num_q_heads / num_kv_heads;
    let kv_row = num_kv_heads * head_dim;
    let mut scores = Vec::new();
    let mut acc = vec![0.0f32; head_dim];
    for s in 0..num_seqs {
        let (q_start, q_end) = (query_start_loc[s] as usize, query_start_loc[s + 1] as usize);
        let seq_len = seq_lens[s] as usize;
        let query_len = q_end - q_start;
        assert!(
            query_len <= seq_len,
            "paged_attention: query_len {query_len} > seq_len {seq_len}"
        );
        let context_len = seq_len - query_len;
        let table = &block_tables[s * max_blocks_per_seq..(s + 1) * max_blocks_per_seq];
        assert!(
            seq_len <= max_blocks_per_seq * block_size,
            "paged_attention: block table too short"
        );
        let slot_of = |p: usize| table[p / block_size] as usize * block_size + p % block_size;
        for j in 0..query_len {
            let token = q_start + j;
            let num_keys = context_len + j + 1;
            for h in 0..num_q_heads {
                let kvh = h / group;
                let qv = &q[(token * num_q_heads + h) * head_dim..][..head_dim];
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for p in 0..num_keys {
                    let k = &key_cache[slot_of(p) * kv_row + kvh * head_dim..][..head_dim];
                    let dot: f32 = qv.iter().zip(k).map(|(a, b)| a * b).sum();
                    let sc = dot * scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                acc.fill(0.0);
                let mut denom = 0.0f32;
                for (p, sc) in scores.iter().enumerate() {
                    let w = (sc - max).exp();
                    denom += w;
                    let v = &value_cache[slot_of(p) * kv_row + kvh * head_dim..][..head_dim];
                    for (a, &vv) in acc.iter_mut().zip(v) {
                        *a += w * vv;
                    }
                }
                let dst = &mut out[(token * num_q_heads + h) * head_dim..][..head_dim];
                for (o, a) in dst.iter_mut().zip(&acc) {
                    *o = a / denom;
                }
            }
        }
    }
}
