//! `--load-format dummy`: random weights without a checkpoint, so benchmarks need only
//! `config.json` and the tokenizer files.
//!
//! Each tensor is drawn from the distributions `tiny_model` writes its random models with
//! (normal; here a close, bounded approximation that is fast to draw), chosen by name and
//! shape, so activations stay O(1) through every layer and the
//! logits spread (greedy decoding is well defined):
//! - RMSNorm weights (`*norm.weight`): normal, mean 1, std 0.1;
//! - biases (`*.bias`): normal, mean 0, std 0.1;
//! - the embedding and the LM head: normal, std 3/sqrt(hidden) (logits of std ≈ 3);
//! - every other matrix: normal, std 1/sqrt(fan_in) (its number of columns).
//!
//! Values are generated straight into the requested dtype's bytes, in fixed blocks of
//! elements spread over the cores; each block has its own splitmix64 stream keyed by the
//! seed, the tensor's name and the block's index, so a tensor is the same whatever the
//! thread count or the order in which the model asks for its weights (a tied LM head reads
//! the embedding's values again).

use std::borrow::Cow;

use vllm_kernels::cuda::dtype::par_blocks;

use super::{DType, WeightTensor};

/// The seed of `--load-format dummy` (vLLM's `initialize_dummy_weights` default).
pub const DUMMY_SEED: u64 = 1234;

/// Elements per independently seeded block.
const BLOCK: usize = 1 << 14;

/// `(mean, std)` of tensor `name` of `shape` (see the module notes).
pub(crate) fn init_for(name: &str, shape: &[usize]) -> (f32, f32) {
    let cols = if shape.len() >= 2 {
        shape[1..].iter().product::<usize>()
    } else {
        shape.first().copied().unwrap_or(1)
    }
    .max(1) as f32;
    if name.ends_with("norm.weight") {
        (1.0, 0.1)
    } else if name.ends_with(".bias") {
        (0.0, 0.1)
    } else if name.contains("embed_tokens") || name.contains("lm_head") {
        (0.0, 3.0 / cols.sqrt())
    } else {
        (0.0, 1.0 / cols.sqrt())
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of the tensor's name, so every tensor has its own streams.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Fills `out` with values of `mean` and `std` from the stream `state`, each the
/// Irwin–Hall sum of the four 16-bit uniforms of one splitmix64 draw: a close
/// approximation of the normal distribution (bounded at ±3.46 std) at the cost of one
/// integer hash per element, a tenth of Box–Muller's with its `ln` and `sin_cos`.
fn fill_normal(out: &mut [f32], mut state: u64, mean: f32, std: f32) {
    // Each 16-bit field: mean 32767.5, variance (65536² - 1) / 12.
    const SUM_MEAN: f32 = 4.0 * 32767.5;
    let sum_std = (4.0 * (65536.0f64 * 65536.0 - 1.0) / 12.0).sqrt() as f32;
    let scale = std / sum_std;
    for v in out.iter_mut() {
        let r = splitmix64(&mut state);
        let sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        *v = mean + (sum as f32 - SUM_MEAN) * scale;
    }
}

/// Tensor `name` of `shape` in `dtype`, drawn for `seed`.
pub(crate) fn generate(
    seed: u64,
    name: &str,
    shape: &[usize],
    dtype: DType,
) -> WeightTensor<'static> {
    let (mean, std) = init_for(name, shape);
    let numel: usize = shape.iter().product();
    let key = splitmix64(&mut (seed ^ name_hash(name)));
    let size = dtype.size();
    let mut bytes = vec![0u8; numel * size];
    par_blocks(&mut bytes, BLOCK * size, |block, dst| {
        let mut values = vec![0f32; dst.len() / size];
        let state = splitmix64(&mut (key ^ (block as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)));
        fill_normal(&mut values, state, mean, std);
        dtype.encode_into(&values, dst);
    });
    WeightTensor::new(shape.to_vec(), dtype, Cow::Owned(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_std(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn dummy_weights_are_deterministic_per_seed_and_name() {
        let shape = [300, 256];
        let name = "model.layers.0.mlp.up_proj.weight";
        let a = generate(7, name, &shape, DType::BF16);
        assert_eq!(a.shape, shape);
        assert_eq!(a.dtype, DType::BF16);
        assert_eq!(a.bytes.len(), 300 * 256 * 2);
        assert_eq!(a, generate(7, name, &shape, DType::BF16));
        assert_ne!(a, generate(8, name, &shape, DType::BF16));
        assert_ne!(
            a,
            generate(
                7,
                "model.layers.0.mlp.gate_proj.weight",
                &shape,
                DType::BF16
            )
        );
        // Each dtype holds the same draws, rounded.
        let f = generate(7, name, &shape, DType::F32);
        assert_eq!(DType::F32.convert(&f.bytes, DType::BF16), a.bytes.as_ref());
    }

    #[test]
    fn dummy_weights_follow_the_tiny_model_distributions() {
        // Several blocks, an odd element count (a lone last element).
        let (vocab, hidden) = (1001, 64);
        let cases = [
            (
                "model.embed_tokens.weight",
                vec![vocab, hidden],
                0.0,
                3.0 / 8.0,
            ),
            (
                "model.layers.3.self_attn.o_proj.weight",
                vec![64, 1024],
                0.0,
                1.0 / 32.0,
            ),
            (
                "model.layers.3.input_layernorm.weight",
                vec![70_000],
                1.0,
                0.1,
            ),
            (
                "model.layers.3.self_attn.q_proj.bias",
                vec![40_000],
                0.0,
                0.1,
            ),
        ];
        for (name, shape, mean, std) in cases {
            let (mean, std): (f64, f64) = (mean, std);
            let t = generate(DUMMY_SEED, name, &shape, DType::F32);
            assert_eq!(t.shape, shape);
            let v = t.to_f32();
            assert_eq!(v.len(), shape.iter().product::<usize>());
            assert!(v.iter().all(|x| x.is_finite()), "{name}");
            let (m, s) = mean_std(&v);
            assert!((m - mean).abs() < 0.02 * std.max(0.1), "{name}: mean {m}");
            assert!(
                (s / std - 1.0).abs() < 0.02,
                "{name}: std {s}, expected {std}"
            );
        }
    }

    /// Generation speed: `cargo test --release -p vllm-worker --lib dummy_speed -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore]
    fn dummy_speed() {
        let shape = [151_936, 1024];
        for dtype in [DType::BF16, DType::F32] {
            let t = std::time::Instant::now();
            let w = generate(DUMMY_SEED, "model.embed_tokens.weight", &shape, dtype);
            let s = t.elapsed().as_secs_f64();
            println!(
                "{dtype:?}: {} elements in {s:.3} s ({:.0} M/s)",
                w.numel(),
                w.numel() as f64 / s / 1e6
            );
        }
    }
}
