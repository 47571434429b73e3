//! The vllm-rs side of scripts/hf_parity.py: prefill logits and greedy continuations of
//! given prompts, for the transformers comparison.

use super::*;

/// Driven by scripts/hf_parity.py: VLLM_PARITY_MODEL (dir), VLLM_PARITY_PROMPTS (JSON list
/// of token-id lists), VLLM_PARITY_OUT (dir), VLLM_PARITY_NEW_TOKENS, VLLM_PARITY_DTYPE.
/// Writes prefill_logits.f32 (every prompt position, prompts in order) and tokens.json.
#[test]
#[ignore]
fn hf_parity_dump() {
    if !gpu_present() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let model = std::path::PathBuf::from(var("VLLM_PARITY_MODEL"));
    let prompts: Vec<Vec<u32>> =
        serde_json::from_str(&std::fs::read_to_string(var("VLLM_PARITY_PROMPTS")).unwrap())
            .unwrap();
    let out = std::path::PathBuf::from(var("VLLM_PARITY_OUT"));
    let new_tokens: usize = std::env::var("VLLM_PARITY_NEW_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let dtype = DType::from_flag(std::env::var("VLLM_PARITY_DTYPE").ok().as_deref()).unwrap();
    let kernels = match std::env::var("VLLM_PARITY_ATTENTION").as_deref() {
        Ok("flash") => AttentionKernels::flash(dtype != DType::F32),
        _ => AttentionKernels::CUDA_CORE,
    };
    let b = CudaBackend::new(0, dtype)
        .unwrap()
        .with_attention_kernels(kernels);
    let started = std::time::Instant::now();
    let run = run_batch(&b, &model, &prompts, new_tokens, false).unwrap();
    let bytes: Vec<u8> = run
        .prefill_logits
        .iter()
        .flat_map(|r| r.iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("prefill_logits.f32"), bytes).unwrap();
    std::fs::write(
        out.join("tokens.json"),
        serde_json::to_string(&run.continuations).unwrap(),
    )
    .unwrap();
    println!(
        "hf_parity_dump: {} prompts, {new_tokens} tokens each, {:.1}s",
        prompts.len(),
        started.elapsed().as_secs_f32()
    );
}
