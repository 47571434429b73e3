//! The Llama-family decoder (Llama, Qwen2, Qwen3), written once against the `Backend`.
//!
//! embed → N × [input_layernorm → attention → post_attention_layernorm → MLP] → norm,
//! with vLLM's residual handling: the residual stream is carried separately and added
//! inside the fused add + RMSNorm. `forward` returns the final hidden states of every
//! token; `compute_logits` runs the LM head on the rows the sampler needs.
//!
//! Where the backend folds norms (`Backend::folds_norms`), the two norms of a layer live
//! in the columns of the projection after them, and a step the backend defers
//! (`forward_deferred`) runs without their kernels: the projections read the residual
//! itself, the ops after them scale each row by the residual row's 1 / RMS, and o_proj
//! and down_proj add into the residual.

use anyhow::Result;

use crate::backend::{Backend, StepMetadata};
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::layers::attention::Attention;
use crate::layers::embedding::{ParallelLMHead, VocabParallelEmbedding};
use crate::layers::linear::{MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear};
use crate::layers::norm::RmsNorm;
use crate::layers::rotary::RotaryEmbedding;
use crate::layers::var_builder::VarBuilder;
use crate::layers::TensorParallel;
use crate::weights::Weights;

/// What an architecture changes in the shared decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderVariant {
    /// q, k, v projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k before rotary (Qwen3).
    pub qk_norm: bool,
}

/// Plain Llama: bias only if `attention_bias`, no q/k norm.
pub fn variant(cfg: &ModelConfig) -> DecoderVariant {
    DecoderVariant {
        qkv_bias: cfg.attention_bias,
        qk_norm: false,
    }
}

struct LlamaAttention<B: Backend> {
    qkv_proj: QKVParallelLinear<B>,
    o_proj: RowParallelLinear<B>,
    qk_norm: Option<(RmsNorm<B>, RmsNorm<B>)>,
    attn: Attention,
}

impl<B: Backend> LlamaAttention<B> {
    /// Loads the `self_attn` module `vb`.
    fn load(vb: &VarBuilder<B>, cfg: &ModelConfig, variant: DecoderVariant) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let heads = (cfg.num_attention_heads, cfg.num_key_value_heads, d);
        let qkv_proj = QKVParallelLinear::load(vb, h, heads, variant.qkv_bias)?;
        let o_proj = RowParallelLinear::load(&vb.pp("o_proj"), cfg.num_attention_heads * d, h)?;
        let qk_norm = if variant.qk_norm {
            let eps = cfg.rms_norm_eps;
            Some((
                RmsNorm::load(&vb.pp("q_norm"), d, eps)?,
                RmsNorm::load(&vb.pp("k_norm"), d, eps)?,
            ))
        } else {
            None
        };
        let attn = Attention::new(qkv_proj.num_heads, qkv_proj.num_kv_heads, d);
        Ok(Self {
            qkv_proj,
            o_proj,
            qk_norm,
            attn,
        })
    }

    /// The attention output, before o_proj (which the layer runs with the norm after it).
    /// With `deferred_norm` (the input norm's eps), x is the unnormed residual and the
    /// norm is folded into qkv_proj.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        b: &B,
        x: &B::Tensor,
        deferred_norm: Option<f32>,
        rotary: &RotaryEmbedding<B>,
        cache: &mut KvCache<B>,
        layer: usize,
        meta: &StepMetadata<B>,
    ) -> Result<B::Tensor> {
        let qkv = self.qkv_proj.forward(b, x)?;
        let qk_norm = self.qk_norm.as_ref().map(|(q_norm, k_norm)| {
            let ((qw, eps), (kw, _)) = (q_norm.weight_and_eps(), k_norm.weight_and_eps());
            (qw, kw, eps)
        });
        let shape = self.attn.shape(cache.block_size, meta);
        let layer_cache = &mut cache.layers[layer];
        let q = b.prepare_qkv(
            &qkv,
            self.qkv_proj.bias(),
            &shape,
            qk_norm,
            deferred_norm.map(|eps| (x, eps)),
            &meta.positions,
            rotary.cos_sin_cache(),
            &mut layer_cache.key,
            &mut layer_cache.value,
            &meta.slot_mapping,
        )?;
        self.attn.forward(b, &q, layer_cache, &shape, meta)
    }
}

struct LlamaMlp<B: Backend> {
    gate_up_proj: MergedColumnParallelLinear<B>,
    down_proj: RowParallelLinear<B>,
}

impl<B: Backend> LlamaMlp<B> {
    /// Loads the `mlp` module `vb`.
    fn load(vb: &VarBuilder<B>, cfg: &ModelConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_up_proj: MergedColumnParallelLinear::load(vb, &["gate_proj", "up_proj"], h, i)?,
            down_proj: RowParallelLinear::load(&vb.pp("down_proj"), i, h)?,
        })
    }

    /// `silu(gate) · up`, the input of down_proj (which runs with the norm after it).
    fn activation(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        self.gate_up_proj.forward_silu_and_mul(b, x)
    }
}

struct LlamaDecoderLayer<B: Backend> {
    input_layernorm: RmsNorm<B>,
    self_attn: LlamaAttention<B>,
    post_attention_layernorm: RmsNorm<B>,
    mlp: LlamaMlp<B>,
}

impl<B: Backend> LlamaDecoderLayer<B> {
    /// Each norm's weight into the projection after it (`RmsNorm::fold_into`).
    fn fold_norms(&mut self, b: &B) -> Result<()> {
        let qkv = &mut self.self_attn.qkv_proj;
        qkv.fold_norm(b, &mut self.input_layernorm)?;
        let gate_up = &mut self.mlp.gate_up_proj;
        gate_up.fold_norm(b, &mut self.post_attention_layernorm)
    }
}

pub struct LlamaForCausalLM<B: Backend> {
    embed_tokens: VocabParallelEmbedding<B>,
    layers: Vec<LlamaDecoderLayer<B>>,
    norm: RmsNorm<B>,
    lm_head: ParallelLMHead<B>,
    rotary: RotaryEmbedding<B>,
    /// The layers' norms are folded into their projections (`Backend::folds_norms`).
    norms_folded: bool,
}

impl<B: Backend> LlamaForCausalLM<B> {
    /// Loads every weight of `cfg`'s model; `on_layer` is called after each decoder layer
    /// (progress reporting). The rotary table covers positions `0..max_model_len`.
    pub fn load(
        b: &B,
        weights: &Weights,
        cfg: &ModelConfig,
        variant: DecoderVariant,
        tp: TensorParallel,
        max_model_len: usize,
        mut on_layer: impl FnMut(usize),
    ) -> Result<Self> {
        let (h, v, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps);
        let vb = VarBuilder::new(b, weights, tp);
        let model = vb.pp("model");
        let embed_tokens = VocabParallelEmbedding::load(&model.pp("embed_tokens"), v, h)?;
        // At tensor-parallel sizes above 1 the residual adds follow the all-reduces.
        let norms_folded = b.folds_norms() && tp.size == 1;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for n in 0..cfg.num_hidden_layers {
            let layer = model.pp("layers").pp(n);
            let mut decoder = LlamaDecoderLayer {
                input_layernorm: RmsNorm::load(&layer.pp("input_layernorm"), h, eps)?,
                self_attn: LlamaAttention::load(&layer.pp("self_attn"), cfg, variant)?,
                post_attention_layernorm: RmsNorm::load(
                    &layer.pp("post_attention_layernorm"),
                    h,
                    eps,
                )?,
                mlp: LlamaMlp::load(&layer.pp("mlp"), cfg)?,
            };
            if norms_folded {
                decoder.fold_norms(b)?;
            }
            layers.push(decoder);
            on_layer(n);
        }
        let norm = RmsNorm::load(&model.pp("norm"), h, eps)?;
        // Tied checkpoints usually omit lm_head.weight; some still ship it, and then it is
        // the same tensor, so reading the embedding is correct either way.
        let head = if cfg.tie_word_embeddings {
            model.pp("embed_tokens")
        } else {
            vb.pp("lm_head")
        };
        let lm_head = ParallelLMHead::load(&head, v, h)?;
        let rotary = RotaryEmbedding::new(b, cfg, max_model_len)?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            rotary,
            norms_folded,
        })
    }

    /// Final hidden states [num_tokens, hidden] of the step described by `meta`, writing
    /// this step's K and V into `cache`.
    pub fn forward(
        &self,
        b: &B,
        meta: &StepMetadata<B>,
        cache: &mut KvCache<B>,
    ) -> Result<B::Tensor> {
        let mut residual = self.embed_tokens.forward(b, &meta.input_ids)?;
        if self.norms_folded && b.defers_norms(meta.num_tokens) {
            return self.forward_deferred(b, meta, cache, residual);
        }
        // The last layer's MLP activation and the down_proj it still goes through, with
        // the norm after it (the next layer's input_layernorm, or the final norm).
        let mut pending: Option<(B::Tensor, &RowParallelLinear<B>)> = None;
        for (n, layer) in self.layers.iter().enumerate() {
            let normed = match pending.take() {
                None => layer.input_layernorm.forward(b, &residual)?,
                Some((act, down)) => {
                    down.forward_add_rms_norm(b, &act, &layer.input_layernorm, &mut residual)?
                }
            };
            let attn = &layer.self_attn;
            let out = attn.forward(b, &normed, None, &self.rotary, cache, n, meta)?;
            let h = attn.o_proj.forward_add_rms_norm(
                b,
                &out,
                &layer.post_attention_layernorm,
                &mut residual,
            )?;
            pending = Some((layer.mlp.activation(b, &h)?, &layer.mlp.down_proj));
        }
        match pending {
            Some((act, down)) => down.forward_add_rms_norm(b, &act, &self.norm, &mut residual),
            None => self.norm.forward(b, &residual),
        }
    }

    /// `forward` with the norms deferred (the module's doc): per layer qkv_proj of the
    /// residual, `prepare_qkv` scaling by its 1 / RMS, attention, o_proj added into the
    /// residual, gate/up of the residual with SiLU scaled likewise, down_proj added; the
    /// final norm as before.
    fn forward_deferred(
        &self,
        b: &B,
        meta: &StepMetadata<B>,
        cache: &mut KvCache<B>,
        mut residual: B::Tensor,
    ) -> Result<B::Tensor> {
        for (n, layer) in self.layers.iter().enumerate() {
            let (attn, mlp) = (&layer.self_attn, &layer.mlp);
            let eps = layer.input_layernorm.eps();
            let out = attn.forward(b, &residual, Some(eps), &self.rotary, cache, n, meta)?;
            attn.o_proj.forward_add(b, &out, &mut residual)?;
            let eps = layer.post_attention_layernorm.eps();
            let act = mlp
                .gate_up_proj
                .forward_rms_silu_and_mul(b, &residual, eps)?;
            mlp.down_proj.forward_add(b, &act, &mut residual)?;
        }
        self.norm.forward(b, &residual)
    }

    /// Logits [rows, vocab] of the hidden rows selected by `meta.logits_indices`. A step
    /// of decodes samples every row in order, and the LM head reads them where they are
    /// (one kernel less in a decode step and its CUDA graph).
    pub fn compute_logits(
        &self,
        b: &B,
        hidden: &B::Tensor,
        meta: &StepMetadata<B>,
    ) -> Result<B::Tensor> {
        if meta.samples_every_token {
            return self.lm_head.forward(b, hidden);
        }
        let rows = b.gather_rows(hidden, &meta.logits_indices)?;
        self.lm_head.forward(b, &rows)
    }
}
