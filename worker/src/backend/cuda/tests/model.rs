//! The whole model on CUDA against the CPU backend (bf16 and f32, both attention
//! backends), and `--load-format dummy` weights drawn on the GPU against the host draw.

use super::*;

/// CUDA vs CPU on one model, with both attention backends (the CUDA-core kernel and the
/// flash kernels) against one CPU run: prints a table row each, checks the bounds.
fn compare_model(preset: &str, dtype: DType, new_tokens: usize, max_abs_bound: f32) {
    let dir = model_dir(preset);
    let spec = TinyModelSpec::preset(preset).unwrap();
    let ps = prompts(6, spec.vocab, 1);
    let cpu = run_batch(&CpuBackend::new(), &dir, &ps, new_tokens, true).unwrap();
    let sixteen_bit = dtype != DType::F32;
    for kernels in [
        AttentionKernels::CUDA_CORE,
        AttentionKernels::flash(sixteen_bit),
    ] {
        let gpu = CudaBackend::new(0, dtype)
            .unwrap()
            .with_attention_kernels(kernels);
        let cuda = run_batch(&gpu, &dir, &ps, new_tokens, true).unwrap();
        check_against_cpu(
            preset,
            dtype,
            kernels,
            &cpu,
            &cuda,
            new_tokens,
            max_abs_bound,
        );
    }
}

fn check_against_cpu(
    preset: &str,
    dtype: DType,
    kernels: AttentionKernels,
    cpu: &BatchRun,
    cuda: &BatchRun,
    new_tokens: usize,
    max_abs_bound: f32,
) {
    let ps = &cpu.continuations;
    let mut worst = Diff {
        max_abs: 0.0,
        mean_abs: 0.0,
    };
    let mut agree = 0;
    let mut total = 0;
    for s in 0..ps.len() {
        let d = diff(&cpu.prefill_logits[s], &cuda.prefill_logits[s]);
        worst.max_abs = worst.max_abs.max(d.max_abs);
        worst.mean_abs = worst.mean_abs.max(d.mean_abs);
        // Decode rows: compare while the two continuations agree (same inputs).
        let same = cpu.continuations[s]
            .iter()
            .zip(&cuda.continuations[s])
            .take_while(|(a, b)| a == b)
            .count();
        for k in 0..same.min(cpu.decode_logits[s].len()) {
            let d = diff(&cpu.decode_logits[s][k], &cuda.decode_logits[s][k]);
            worst.max_abs = worst.max_abs.max(d.max_abs);
            worst.mean_abs = worst.mean_abs.max(d.mean_abs);
        }
        agree += same;
        total += new_tokens;
    }
    println!(
        "MODEL-CHECK {preset:<14} {:<8} {} logits max|d| {:.5} mean|d| {:.6} greedy agree \
         {agree}/{total}",
        dtype.name(),
        if kernels == AttentionKernels::CUDA_CORE {
            "cuda-core"
        } else {
            "flash"
        },
        worst.max_abs,
        worst.mean_abs
    );
    assert!(
        worst.max_abs <= max_abs_bound,
        "{preset} {dtype:?} {kernels:?}: max |logit diff| {} over {max_abs_bound}",
        worst.max_abs
    );
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_model_matches_cpu_backend_in_f32() {
    if !gpu_present() {
        return;
    }
    for preset in ["tiny-qwen3", "tiny-qwen2", "tiny-llama"] {
        compare_model(preset, DType::F32, 12, 2e-3);
    }
    compare_model("qwen3-0.6b", DType::F32, 4, 5e-2);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_model_matches_cpu_backend_in_bf16() {
    if !gpu_present() {
        return;
    }
    for preset in ["tiny-qwen3", "tiny-qwen2", "tiny-llama"] {
        compare_model(preset, DType::BF16, 12, 0.25);
    }
    for preset in ["qwen3-0.6b", "qwen2.5-0.5b", "llama-3.2-1b"] {
        compare_model(preset, DType::BF16, 4, 1.0);
    }
}

/// Prefills of more rows than a decode batch, whose GEMMs and LM head run at padded row
/// counts (`padded_rows`: 601 + 7 + 5 tokens in steps of 305 and 308 rows, each run as
/// 320), against the CPU backend in f32.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn cuda_prefill_of_padded_rows_matches_cpu() {
    if !gpu_present() {
        return;
    }
    let preset = "tiny-qwen3";
    let dir = model_dir(preset);
    let vocab = TinyModelSpec::preset(preset).unwrap().vocab;
    let ps: Vec<Vec<u32>> = [601, 7, 5]
        .iter()
        .map(|&len| {
            (0..len)
                .map(|j| ((j * 104_729 + len) % vocab) as u32)
                .collect()
        })
        .collect();
    let cpu = run_batch(&CpuBackend::new(), &dir, &ps, 4, true).unwrap();
    let gpu = CudaBackend::new(0, DType::F32).unwrap();
    let cuda = run_batch(&gpu, &dir, &ps, 4, true).unwrap();
    let kernels = AttentionKernels::flash(false);
    check_against_cpu(preset, DType::F32, kernels, &cpu, &cuda, 4, 2e-3);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu_round.sh runs it with --ignored"]
fn dummy_weights_drawn_on_the_gpu_equal_the_host_draw() {
    if !gpu_present() {
        return;
    }
    for dtype in [DType::BF16, DType::F32] {
        let gpu = CudaBackend::new(0, dtype).expect("cuda backend");
        let weights = Weights::dummy(crate::weights::DUMMY_SEED, dtype);
        let name = "model.layers.0.mlp.gate_proj.weight";
        // Several 16,384-element blocks, a row shard, a column shard and a fused pair.
        let full = weights.get(name, &[300, 1000]).expect("dummy");
        let cases = [
            full.clone(),
            full.clone().narrow(0, 37, 200),
            full.clone().narrow(1, 500, 500),
            crate::weights::WeightTensor::cat_rows(vec![
                full.clone().narrow(0, 0, 100),
                weights
                    .get("model.layers.0.mlp.up_proj.weight", &[300, 1000])
                    .expect("dummy")
                    .narrow(0, 150, 100),
            ]),
            weights.get("model.norm.weight", &[4096]).expect("dummy"),
        ];
        for (i, w) in cases.iter().enumerate() {
            assert!(w.dummy_regions().is_some(), "case {i} stays lazy");
            let on_gpu = gpu
                .to_host(&gpu.upload_weight(w).expect("upload"))
                .expect("to host");
            assert_eq!(
                on_gpu.data,
                w.to_f32(),
                "case {i} ({dtype:?}): GPU draw != host draw"
            );
        }
    }
}
