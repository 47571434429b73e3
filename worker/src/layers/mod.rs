//! Layers of a Llama-family decoder, written against the `Backend`: the tensor-parallel
//! linear layers and embeddings of DESIGN §7, RMSNorm, rotary embedding, paged attention
//! and the gated activation.

pub mod activation;
pub mod attention;
pub mod embedding;
pub mod linear;
pub mod norm;
pub mod rotary;

/// This rank's place in the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    pub rank: usize,
    pub size: usize,
}

impl TensorParallel {
    pub const SINGLE: TensorParallel = TensorParallel { rank: 0, size: 1 };

    /// The `(start, len)` of this rank's equal share of `total` (which must divide).
    pub fn even_shard(&self, total: usize, what: &str) -> anyhow::Result<(usize, usize)> {
        anyhow::ensure!(
            total.is_multiple_of(self.size),
            "{what} ({total}) is not divisible by the tensor-parallel size {}",
            self.size
        );
        let len = total / self.size;
        Ok((self.rank * len, len))
    }
}
