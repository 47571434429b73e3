//! Vocabulary-parallel embedding and LM head (DESIGN §7): each rank holds a contiguous
//! slice of the vocabulary; the embedding sums the ranks' rows (ids outside a shard give
//! zeros), the LM head gathers each rank's logits columns.

use std::borrow::Cow;

use anyhow::Result;

use super::var_builder::VarBuilder;
use super::TensorParallel;
use crate::backend::Backend;
use crate::weights::WeightTensor;

/// `(start, len)` of this rank's vocabulary slice: ceil(vocab / tp) rows, the last rank
/// keeping what is left.
fn vocab_shard(vocab: usize, tp: TensorParallel) -> (usize, usize) {
    let per_rank = vocab.div_ceil(tp.size);
    let start = (tp.rank * per_rank).min(vocab);
    (start, per_rank.min(vocab - start))
}

pub struct VocabParallelEmbedding<B: Backend> {
    weight: B::Tensor,
    vocab_start: usize,
}

impl<B: Backend> VocabParallelEmbedding<B> {
    /// Loads `weight` [vocab, hidden] of the module `vb` and keeps this rank's rows.
    pub fn load(vb: &VarBuilder<B>, vocab: usize, hidden: usize) -> Result<Self> {
        let (start, len) = vocab_shard(vocab, vb.tp);
        let w = vb.get("weight", &[vocab, hidden])?.narrow(0, start, len);
        Ok(Self {
            weight: vb.upload(&w)?,
            vocab_start: start,
        })
    }

    pub fn forward(&self, b: &B, ids: &B::Ints) -> Result<B::Tensor> {
        let mut x = b.embedding(&self.weight, ids, self.vocab_start)?;
        b.all_reduce(&mut x)?;
        Ok(x)
    }
}

/// The LM head: `lm_head.weight`, or the embedding's weight when tied. Every rank's shard
/// is `ceil(vocab / tp)` rows, the last one padded with zero rows, so that the gather
/// moves equal parts; the padding columns are cut off after it.
pub struct ParallelLMHead<B: Backend> {
    weight: B::Tensor,
    vocab: usize,
    padded_vocab: usize,
}

impl<B: Backend> ParallelLMHead<B> {
    /// Loads `weight` [vocab, hidden] of the module `vb` (`lm_head`, or the embedding when
    /// tied) and keeps this rank's padded rows.
    pub fn load(vb: &VarBuilder<B>, vocab: usize, hidden: usize) -> Result<Self> {
        let tp = vb.tp;
        let (start, len) = vocab_shard(vocab, tp);
        let per_rank = vocab.div_ceil(tp.size);
        let mut w = vb.get("weight", &[vocab, hidden])?.narrow(0, start, len);
        if len < per_rank {
            let zeros = vec![0u8; (per_rank - len) * hidden * w.dtype.size()];
            let pad = WeightTensor::new(vec![per_rank - len, hidden], w.dtype, Cow::Owned(zeros));
            w = WeightTensor::cat_rows(vec![w, pad]);
        }
        Ok(Self {
            weight: vb.upload(&w)?,
            vocab,
            padded_vocab: per_rank * tp.size,
        })
    }

    /// Logits [rows, vocab] of hidden states [rows, hidden].
    pub fn forward(&self, b: &B, hidden: &B::Tensor) -> Result<B::Tensor> {
        let logits = b.all_gather_cols(b.linear(hidden, &self.weight)?)?;
        if self.padded_vocab == self.vocab {
            return Ok(logits);
        }
        let pad = self.padded_vocab - self.vocab;
        b.split_cols(&logits, &[self.vocab, pad])?
            .into_iter()
            .next()
            .ok_or_else(|| anyhow::anyhow!("split_cols returned no part"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_shards_cover_the_vocabulary() {
        let tp = |rank| TensorParallel { rank, size: 3 };
        assert_eq!(vocab_shard(10, tp(0)), (0, 4));
        assert_eq!(vocab_shard(10, tp(1)), (4, 4));
        assert_eq!(vocab_shard(10, tp(2)), (8, 2));
    }
}
