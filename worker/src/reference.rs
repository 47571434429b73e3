//! `greedy_reference`: the model run directly, with none of the worker's bookkeeping.
//!
//! Each step recomputes the whole sequence from scratch into a fresh, contiguous KV cache
//! (block i holds tokens `i*16..`), in one prefill, and takes the argmax of the last row.
//! It shares the layers and kernels with the served path (so results are bit-identical:
//! every kernel computes a row the same way whatever the batch), but not the request
//! states, block tables, chunking or sampler that integration tests check.

use std::path::Path;

use anyhow::{ensure, Result};

use crate::backend::{Backend, CpuBackend, StepInputs};
use crate::config::ModelConfig;
use crate::kv_cache::KvCache;
use crate::layers::TensorParallel;
use crate::models::{variant_for, LlamaForCausalLM};
use crate::sampler::argmax;
use crate::weights::Weights;

const BLOCK_SIZE: usize = 16;

/// One prefill of `tokens` on a contiguous block table; logits of the last token.
fn last_logits(
    b: &CpuBackend,
    model: &LlamaForCausalLM<CpuBackend>,
    cfg: &ModelConfig,
    tokens: &[u32],
) -> Result<Vec<f32>> {
    let n = tokens.len();
    let num_blocks = n.div_ceil(BLOCK_SIZE);
    let mut cache = KvCache::allocate(
        b,
        cfg.num_hidden_layers,
        num_blocks,
        BLOCK_SIZE,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )?;
    let inputs = StepInputs {
        input_ids: tokens.iter().map(|&t| t as i32).collect(),
        positions: (0..n as i32).collect(),
        slot_mapping: (0..n as i32).collect(),
        block_tables: (0..num_blocks as i32).collect(),
        max_blocks_per_seq: num_blocks,
        seq_lens: vec![n as i32],
        query_start_loc: vec![0, n as i32],
        logits_indices: vec![n as i32 - 1],
    };
    let meta = b.upload_step(&inputs)?;
    let hidden = model.forward(b, &meta, &mut cache)?;
    Ok(b.to_host(&model.compute_logits(b, &hidden, &meta)?)?.data)
}

/// Greedy continuation of `prompt` by the model in `model_dir`, `max_tokens` tokens.
pub fn greedy_reference(model_dir: &Path, prompt: &[u32], max_tokens: usize) -> Result<Vec<u32>> {
    ensure!(!prompt.is_empty(), "greedy_reference: empty prompt");
    let cfg = ModelConfig::from_model_dir(model_dir)?;
    let total = prompt.len() + max_tokens;
    ensure!(
        total <= cfg.max_position_embeddings,
        "prompt + max_tokens ({total}) exceeds max_position_embeddings"
    );
    let b = CpuBackend::new();
    let weights = Weights::open(model_dir)?;
    let model = LlamaForCausalLM::load(
        &b,
        &weights,
        &cfg,
        variant_for(&cfg),
        TensorParallel::SINGLE,
        total,
        |_| {},
    )?;
    let mut tokens = prompt.to_vec();
    for _ in 0..max_tokens {
        let logits = last_logits(&b, &model, &cfg, &tokens)?;
        tokens.push(argmax(&logits));
    }
    Ok(tokens[prompt.len()..].to_vec())
}

/// Logits of the last token of `tokens` after one from-scratch prefill (tests).
pub fn reference_logits(model_dir: &Path, tokens: &[u32]) -> Result<Vec<f32>> {
    let cfg = ModelConfig::from_model_dir(model_dir)?;
    let b = CpuBackend::new();
    let weights = Weights::open(model_dir)?;
    let model = LlamaForCausalLM::load(
        &b,
        &weights,
        &cfg,
        variant_for(&cfg),
        TensorParallel::SINGLE,
        tokens.len(),
        |_| {},
    )?;
    last_logits(&b, &model, &cfg, tokens)
}
