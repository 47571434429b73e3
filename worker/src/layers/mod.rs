//! Layers of a Llama-family decoder, written against the `Backend`: the tensor-parallel
//! linear layers and embeddings of DESIGN §7 (the merged gate/up one also applies the
//! gated activation), RMSNorm, rotary embedding and paged attention.

pub mod attention;
pub mod embedding;
pub mod linear;
pub mod norm;
pub mod rotary;
pub mod var_builder;

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

    /// Checks, before any weight is read, that `cfg` splits over this many ranks: the
    /// attention heads and the MLP divide evenly, and the kv heads either divide evenly or
    /// (more ranks than kv heads) are replicated an equal number of times.
    pub fn check_model(&self, cfg: &crate::config::ModelConfig) -> anyhow::Result<()> {
        let n = self.size;
        let heads = cfg.num_attention_heads;
        anyhow::ensure!(
            heads.is_multiple_of(n),
            "the model's {heads} attention heads cannot be split over --tensor-parallel-size \
             {n}: the size must divide the number of heads"
        );
        let kv = cfg.num_key_value_heads;
        anyhow::ensure!(
            kv.is_multiple_of(n) || n.is_multiple_of(kv),
            "the model's {kv} key-value heads cannot be split over --tensor-parallel-size {n}: \
             the size must divide them, or be a multiple of them (to replicate them)"
        );
        self.even_shard(cfg.intermediate_size, "intermediate_size")?;
        Ok(())
    }

    /// This rank's kv heads: its equal share, or one replicated head when the ranks
    /// outnumber the kv heads.
    pub fn local_kv_heads(&self, total_kv_heads: usize) -> usize {
        (total_kv_heads / self.size).max(1)
    }
}
