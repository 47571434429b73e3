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

/// splitmix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
const BLOCK_KEY: u64 = 0xD1B5_4A32_D192_ED03;

/// FNV-1a of the tensor's name, so every tensor has its own streams.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Irwin–Hall: the sum of four 16-bit uniforms has this mean and standard deviation.
const SUM_MEAN: f32 = 4.0 * 32767.5;
fn sum_std() -> f32 {
    (4.0 * (65536.0f64 * 65536.0 - 1.0) / 12.0).sqrt() as f32
}

/// Element `e` (row-major index in the whole tensor) of the tensor keyed `key`: the
/// Irwin–Hall sum of the four 16-bit fields of one splitmix64 draw, a close approximation
/// of the normal distribution (bounded at ±3.46 std) at the cost of one integer hash per
/// element. Element `i` of block `b` is draw `i + 1` of the splitmix64 stream seeded by
/// the block, so any element can be drawn alone: the GPU kernel `dummy_fill`
/// (kernels/src/cuda/csrc/copy.cu) draws the same values, in the same f32 operations.
fn value(block_state: u64, index_in_block: u64, mean: f32, scale: f32) -> f32 {
    let r = mix64(block_state.wrapping_add((index_in_block + 1).wrapping_mul(GOLDEN)));
    let sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
    mean + (sum as f32 - SUM_MEAN) * scale
}

fn block_state(key: u64, block: u64) -> u64 {
    mix64((key ^ block.wrapping_mul(BLOCK_KEY)).wrapping_add(GOLDEN))
}

/// Rows `row0..row0 + rows` and columns `col0..col0 + cols` of one dummy tensor whose
/// rows are `full_cols` long: a dummy weight's values before they are drawn. A narrowed
/// or fused weight is a list of these stacked by rows, so each rank draws only its shard,
/// and where the tensor lands: the CUDA backend draws on the GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DummyRegion {
    pub key: u64,
    pub mean: f32,
    /// The std over the Irwin–Hall sum's std.
    pub scale: f32,
    pub full_cols: usize,
    pub row0: usize,
    pub col0: usize,
    pub rows: usize,
    pub cols: usize,
}

impl DummyRegion {
    /// Draws the region's values into `out` (`rows * cols` elements of `dtype`).
    pub fn draw_into(&self, dtype: DType, out: &mut [u8]) {
        let size = dtype.size();
        debug_assert_eq!(out.len(), self.rows * self.cols * size);
        let cols = self.cols.max(1);
        par_blocks(out, BLOCK * size, |chunk, dst| {
            let first = chunk * BLOCK;
            let values: Vec<f32> = (first..first + dst.len() / size)
                .map(|i| {
                    let (r, c) = (i / cols, i % cols);
                    let e = ((self.row0 + r) * self.full_cols + self.col0 + c) as u64;
                    let state = block_state(self.key, e / BLOCK as u64);
                    value(state, e % BLOCK as u64, self.mean, self.scale)
                })
                .collect();
            dtype.encode_into(&values, dst);
        });
    }
}

/// The values of `regions` (stacked by rows) in `dtype`.
pub(crate) fn draw(regions: &[DummyRegion], dtype: DType) -> Vec<u8> {
    let size = dtype.size();
    let total: usize = regions.iter().map(|r| r.rows * r.cols).sum();
    let mut out = vec![0u8; total * size];
    let mut rest = out.as_mut_slice();
    for r in regions {
        let (dst, tail) = rest.split_at_mut(r.rows * r.cols * size);
        r.draw_into(dtype, dst);
        rest = tail;
    }
    out
}

/// `regions` of a tensor of `shape`, narrowed to `start..start + len` along `dim` (0: rows,
/// across the stacked regions; 1: columns, within each).
pub(crate) fn narrow(
    regions: &[DummyRegion],
    shape: &[usize],
    dim: usize,
    start: usize,
    len: usize,
) -> Vec<DummyRegion> {
    assert!(
        start + len <= shape[dim] && (dim == 0 || (dim == 1 && shape.len() == 2)),
        "narrow: {start}..{} along dim {dim} of shape {shape:?}",
        start + len
    );
    if dim == 1 {
        return regions
            .iter()
            .map(|r| DummyRegion {
                col0: r.col0 + start,
                cols: len,
                ..*r
            })
            .collect();
    }
    let (end, mut at, mut out) = (start + len, 0, Vec::new());
    for r in regions {
        let (lo, hi) = (start.max(at), end.min(at + r.rows));
        if lo < hi {
            out.push(DummyRegion {
                row0: r.row0 + lo - at,
                rows: hi - lo,
                ..*r
            });
        }
        at += r.rows;
    }
    out
}

/// Tensor `name` of `shape` in `dtype`, for `seed`: not drawn yet (see `DummyRegion`).
pub(crate) fn generate(
    seed: u64,
    name: &str,
    shape: &[usize],
    dtype: DType,
) -> WeightTensor<'static> {
    let (mean, std) = init_for(name, shape);
    let rows = shape.first().copied().unwrap_or(1);
    let cols = shape.iter().skip(1).product::<usize>();
    let region = DummyRegion {
        key: mix64((seed ^ name_hash(name)).wrapping_add(GOLDEN)),
        mean,
        scale: std / sum_std(),
        full_cols: cols,
        row0: 0,
        col0: 0,
        rows,
        cols,
    };
    WeightTensor::dummy(shape.to_vec(), dtype, vec![region])
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

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
        let bytes = a.bytes();
        assert_eq!(bytes.len(), 300 * 256 * 2);
        assert_eq!(bytes, generate(7, name, &shape, DType::BF16).bytes());
        assert_ne!(bytes, generate(8, name, &shape, DType::BF16).bytes());
        let gate = "model.layers.0.mlp.gate_proj.weight";
        assert_ne!(bytes, generate(7, gate, &shape, DType::BF16).bytes());
        // Each dtype holds the same draws, rounded.
        let f = generate(7, name, &shape, DType::F32);
        assert_eq!(DType::F32.convert(&f.bytes(), DType::BF16), bytes.as_ref());
    }

    /// The stream as first written (one sequential splitmix64 walk per block): the values
    /// drawn element by element must not have changed, so earlier benchmark runs and the
    /// GPU kernel draw the same weights.
    #[test]
    fn elements_drawn_alone_equal_the_sequential_stream() {
        fn splitmix64(state: &mut u64) -> u64 {
            *state = state.wrapping_add(GOLDEN);
            mix64(*state)
        }
        let (seed, name, len) = (DUMMY_SEED, "model.norm.weight", BLOCK * 2 + 77);
        let (mean, std) = init_for(name, &[len]);
        let key = splitmix64(&mut (seed ^ name_hash(name)));
        let scale = std / sum_std();
        let mut expected = Vec::new();
        for block in 0..3u64 {
            let mut state = splitmix64(&mut (key ^ block.wrapping_mul(BLOCK_KEY)));
            for _ in 0..BLOCK.min(len - expected.len()) {
                let r = splitmix64(&mut state);
                let sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
                expected.push(mean + (sum as f32 - SUM_MEAN) * scale);
            }
        }
        assert_eq!(generate(seed, name, &[len], DType::F32).to_f32(), expected);
    }

    /// Narrowing and fusing a dummy weight before drawing it gives the bytes of drawing it
    /// first, so a rank's shard (drawn alone, on the GPU) is the shard of the whole tensor.
    #[test]
    fn narrowed_and_fused_dummy_weights_equal_the_drawn_ones() {
        let q = generate(3, "q", &[40, 24], DType::BF16);
        let k = generate(3, "k", &[16, 24], DType::BF16);
        fn drawn(t: &WeightTensor) -> WeightTensor<'static> {
            WeightTensor::new(t.shape.clone(), t.dtype, Cow::Owned(t.bytes().into_owned()))
        }
        for (dim, start, len) in [(0, 5, 30), (1, 7, 12), (0, 0, 40), (1, 0, 24)] {
            let lazy = q.clone().narrow(dim, start, len);
            assert!(lazy.dummy_regions().is_some());
            assert_eq!(
                lazy.bytes(),
                drawn(&q).narrow(dim, start, len).bytes(),
                "{dim} {start}"
            );
        }
        let fused = WeightTensor::cat_rows(vec![q.clone(), k.clone()]);
        assert_eq!(fused.dummy_regions().map(<[_]>::len), Some(2));
        let both = WeightTensor::cat_rows(vec![drawn(&q), drawn(&k)]);
        assert_eq!(fused.bytes(), both.bytes());
        // Rows across the seam of two regions, then columns of the result.
        let cut = fused.clone().narrow(0, 35, 10).narrow(1, 4, 8);
        assert_eq!(cut.bytes(), both.narrow(0, 35, 10).narrow(1, 4, 8).bytes());
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
