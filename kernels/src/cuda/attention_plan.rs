//! Host-side plan of one paged-attention launch: how query tokens are grouped into tiles
//! and whether the keys are split (flash-decoding) because too few tiles fill the GPU.
//!
//! Must agree with `csrc/attention.cu`: a tile is up to `ATT_ROWS` (token, q head) rows,
//! i.e. `ATT_ROWS / group` consecutive query tokens of one sequence.

use anyhow::{ensure, Result};

/// Query rows per tile (`ATT_ROWS` in attention.cu).
pub const ATT_ROWS: usize = 16;
/// Threads per attention block (`ATT_THREADS`).
pub const ATT_THREADS: u32 = 128;
/// A split covers a multiple of this many keys (`ATT_KEYS`).
pub const ATT_KEYS: usize = 32;
/// Head sizes with a compiled kernel.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Sequence of each tile.
    pub tile_seq: Vec<i32>,
    /// First query token (batch index) of each tile.
    pub tile_token: Vec<i32>,
    pub tokens_per_tile: usize,
    pub num_splits: usize,
    /// Keys per split (a multiple of ATT_KEYS; i32::MAX when not split).
    pub split_keys: usize,
}

impl AttentionPlan {
    pub fn num_tiles(&self) -> usize {
        self.tile_seq.len()
    }

    /// Tiles and splits for one step. Splits are used when the tiles times the kv heads
    /// leave the SMs idle and the sequences are long (decode of a few long requests).
    pub fn new(
        query_start_loc: &[i32],
        seq_lens: &[i32],
        num_q_heads: usize,
        num_kv_heads: usize,
        num_sms: usize,
    ) -> Result<Self> {
        ensure!(
            num_kv_heads > 0 && num_q_heads.is_multiple_of(num_kv_heads),
            "attention: {num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads"
        );
        let group = num_q_heads / num_kv_heads;
        ensure!(
            group <= ATT_ROWS,
            "attention: GQA group of {group} q heads per kv head exceeds the kernel's {ATT_ROWS}"
        );
        ensure!(
            query_start_loc.len() == seq_lens.len() + 1,
            "attention: query_start_loc has {} entries for {} sequences",
            query_start_loc.len(),
            seq_lens.len()
        );
        let tokens_per_tile = (ATT_ROWS / group).max(1);
        let mut tile_seq = Vec::new();
        let mut tile_token = Vec::new();
        for (s, w) in query_start_loc.windows(2).enumerate() {
            let (start, end) = (w[0], w[1]);
            ensure!(
                start <= end && end - start <= seq_lens[s],
                "attention: sequence {s} queries {} tokens of {}",
                end - start,
                seq_lens[s]
            );
            let mut t = start;
            while t < end {
                tile_seq.push(s as i32);
                tile_token.push(t);
                t += tokens_per_tile as i32;
            }
        }
        let max_keys = seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize;
        let blocks = tile_seq.len() * num_kv_heads;
        let target_blocks = 2 * num_sms.max(1);
        let (num_splits, split_keys) = if blocks >= target_blocks || max_keys <= 512 {
            (1, i32::MAX as usize)
        } else {
            let want = target_blocks
                .div_ceil(blocks.max(1))
                .min(max_keys.div_ceil(256))
                .clamp(1, 64);
            let split_keys = max_keys.div_ceil(want).div_ceil(ATT_KEYS) * ATT_KEYS;
            (max_keys.div_ceil(split_keys), split_keys)
        };
        Ok(Self {
            tile_seq,
            tile_token,
            tokens_per_tile,
            num_splits,
            split_keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_every_query_token_once() {
        // group 2 → 8 tokens per tile; sequences of 20, 1 and 8 query tokens.
        let p = AttentionPlan::new(&[0, 20, 21, 29], &[20, 5, 40], 16, 8, 132).unwrap();
        assert_eq!(p.tokens_per_tile, 8);
        assert_eq!(p.tile_seq, vec![0, 0, 0, 1, 2]);
        assert_eq!(p.tile_token, vec![0, 8, 16, 20, 21]);
        assert_eq!(p.num_splits, 1);
    }

    #[test]
    fn long_decode_of_few_sequences_is_split() {
        let p = AttentionPlan::new(&[0, 1], &[8000], 16, 8, 132).unwrap();
        assert!(p.num_splits > 1);
        assert_eq!(p.split_keys % ATT_KEYS, 0);
        assert!(p.num_splits * p.split_keys >= 8000);
        assert!((p.num_splits - 1) * p.split_keys < 8000);
    }

    #[test]
    fn rejects_groups_wider_than_a_tile() {
        assert!(AttentionPlan::new(&[0, 1], &[1], 32, 1, 1).is_err());
    }
}
