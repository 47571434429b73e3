//! `qkv_prepare` at Qwen3-0.6B's heads (16 q / 8 kv of 128, q and k normed), from one
//! decode token to a prefill step of nanovllm-256's size, plain and with the input norm
//! deferred (each row scaled by its 1,024-wide input row's 1 / RMS).
//!
//!   cuda_bench qkv_prepare_tokens --ignored --nocapture

use super::*;
use vllm_kernels::cuda::QkvPrepare;

#[test]
#[ignore = "needs a CUDA GPU"]
fn qkv_prepare_tokens() {
    let Some(dev) = common::device() else { return };
    let ops = CudaOps::new(&dev, DType::BF16).expect("build kernels");
    let (max_pos, heads) = (8192, HQ + 2 * HKV);
    let (q_norm, k_norm) = (random(&dev, D, 11), random(&dev, D, 17));
    let cos_sin = random(&dev, max_pos * D, 12);
    for t in [1, 64, 256, 1024, 2048, 4096, 8060] {
        let qkv = random(&dev, t * heads * D, 13);
        let positions: Vec<i32> = (0..t).map(|i| ((i * 37) % max_pos) as i32).collect();
        // Slots spread over a cache of four times the tokens, as a step's blocks are.
        let slots: Vec<i32> = (0..t).map(|i| ((i * 7919) % (4 * t)) as i32).collect();
        let (positions, slots) = (
            dev.stream.clone_htod(&positions).expect("upload"),
            dev.stream.clone_htod(&slots).expect("upload"),
        );
        let cache = |seed| random(&dev, 4 * t * HKV * D, seed);
        let (key_cache, value_cache) = (cache(14), cache(15));
        let mut q_out = random(&dev, t * HQ * D, 16);
        let input = random(&dev, t * HIDDEN, 18);
        for deferred in [false, true] {
            let args = QkvPrepare {
                qkv: &qkv,
                bias: None,
                q_norm: Some(&q_norm),
                k_norm: Some(&k_norm),
                eps: 1e-6,
                positions: &positions,
                cos_sin: &cos_sin,
                rotary_dim: D,
                slot_mapping: &slots,
                key_cache: &key_cache,
                value_cache: &value_cache,
                num_tokens: t,
                num_q_heads: HQ,
                num_kv_heads: HKV,
                head_dim: D,
                deferred_norm: deferred.then_some((&input, HIDDEN, 1e-6)),
            };
            let s = time_graph(&dev, 20, || {
                ops.qkv_prepare(&args, &mut q_out).expect("qkv_prepare")
            });
            // The row read (and the input row); q, k and v written.
            let input_bytes = if deferred { t * HIDDEN * 2 } else { 0 };
            let bytes = (t * heads * D * 2 * 2 + input_bytes) as f64;
            let what = if deferred { ", deferred norm" } else { "" };
            report(&format!("qkv_prepare {t} tokens{what}"), s, bytes);
        }
    }
}
