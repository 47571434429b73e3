//! `DType`: the floating-point type the CUDA backend stores weights, activations and the KV
//! cache in, and the host-side conversions to and from f32.

use anyhow::{bail, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    /// `--dtype` on the CUDA backend: auto (and the checkpoint's own) is bfloat16.
    pub fn from_flag(flag: Option<&str>) -> Result<Self> {
        Ok(match flag.unwrap_or("auto") {
            "auto" | "bfloat16" | "bf16" => DType::BF16,
            "float16" | "half" | "fp16" => DType::F16,
            "float32" | "float" | "fp32" => DType::F32,
            other => bail!("--dtype {other}: expected auto, bfloat16, float16 or float32"),
        })
    }

    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// Elements in one 16-byte access (`VEC16` of csrc/common.cuh).
    pub fn vec16(self) -> usize {
        16 / self.size()
    }

    /// vLLM's name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
        }
    }

    /// The NVRTC define that selects `scalar_t` in `csrc/common.cuh`.
    pub fn define(self) -> &'static str {
        match self {
            DType::BF16 => "-DVLLM_DTYPE_BF16",
            DType::F16 => "-DVLLM_DTYPE_F16",
            DType::F32 => "-DVLLM_DTYPE_F32",
        }
    }

    /// f32 values as this dtype's little-endian bytes (round to nearest even), converted in
    /// parallel chunks when there are many.
    pub fn encode(self, data: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; data.len() * self.size()];
        let size = self.size();
        par_blocks(&mut out, CONVERT_BLOCK * size, |block, dst| {
            let start = block * CONVERT_BLOCK;
            self.encode_into(&data[start..start + dst.len() / size], dst);
        });
        out
    }

    /// This dtype's little-endian bytes as f32 values (in parallel chunks when many).
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / self.size();
        let mut out = vec![0f32; n];
        let size = self.size();
        par_blocks(&mut out, CONVERT_BLOCK, |block, dst| {
            let start = block * CONVERT_BLOCK * size;
            self.decode_into(&bytes[start..start + dst.len() * size], dst);
        });
        out
    }

    /// `src`, little-endian bytes of this dtype, as the bytes of `to` (through f32, round to
    /// nearest even), in parallel chunks when there are many.
    pub fn convert(self, src: &[u8], to: DType) -> Vec<u8> {
        if self == to {
            return src.to_vec();
        }
        let (from_size, to_size) = (self.size(), to.size());
        let mut out = vec![0u8; src.len() / from_size * to_size];
        par_blocks(&mut out, CONVERT_BLOCK * to_size, |block, dst| {
            let n = dst.len() / to_size;
            let start = block * CONVERT_BLOCK * from_size;
            let mut tmp = vec![0f32; n];
            self.decode_into(&src[start..start + n * from_size], &mut tmp);
            to.encode_into(&tmp, dst);
        });
        out
    }

    /// Sequential `encode` of `src` into `dst` (`src.len() * size()` bytes).
    pub fn encode_into(self, src: &[f32], dst: &mut [u8]) {
        debug_assert_eq!(dst.len(), src.len() * self.size());
        match self {
            DType::BF16 => {
                for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            DType::F16 => {
                for (d, &v) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            DType::F32 => {
                for (d, &v) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// Sequential `decode` of `src` into `dst` (`dst.len() * size()` bytes of `src`).
    pub fn decode_into(self, src: &[u8], dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len() * self.size());
        match self {
            DType::BF16 => {
                for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            DType::F16 => {
                for (d, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            DType::F32 => {
                for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }

    /// The value `v` takes after a round trip through this dtype.
    pub fn round(self, v: f32) -> f32 {
        match self {
            DType::BF16 => half::bf16::from_f32(v).to_f32(),
            DType::F16 => half::f16::from_f32(v).to_f32(),
            DType::F32 => v,
        }
    }
}

/// Elements per block of the parallel conversions.
const CONVERT_BLOCK: usize = 1 << 16;

/// Runs `f(block_index, block)` over the consecutive `block`-sized pieces of `out` (the
/// last may be shorter), spread over the machine's cores: each thread takes a contiguous
/// run of blocks. Blocks are fixed by `block` alone, so what `f` computes never depends on
/// the number of threads. Small inputs run on the calling thread.
pub fn par_blocks<T: Send>(out: &mut [T], block: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let block = block.max(1);
    let blocks = out.len().div_ceil(block);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(blocks);
    if threads <= 1 {
        for (i, b) in out.chunks_mut(block).enumerate() {
            f(i, b);
        }
        return;
    }
    let per_thread = blocks.div_ceil(threads);
    std::thread::scope(|s| {
        for (t, run) in out.chunks_mut(per_thread * block).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (i, b) in run.chunks_mut(block).enumerate() {
                    f(t * per_thread + i, b);
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trips_through_the_dtype() {
        let v = [1.0f32, -2.5, 3.3, 1e-3];
        for dt in [DType::BF16, DType::F16, DType::F32] {
            let back = dt.decode(&dt.encode(&v));
            assert_eq!(back.len(), v.len());
            for (a, b) in back.iter().zip(v) {
                assert_eq!(*a, dt.round(b));
            }
        }
    }

    #[test]
    fn flags_parse_and_auto_is_bf16() {
        assert_eq!(DType::from_flag(None).unwrap(), DType::BF16);
        assert_eq!(DType::from_flag(Some("float16")).unwrap(), DType::F16);
        assert!(DType::from_flag(Some("int8")).is_err());
    }
    #[test]
    fn parallel_conversions_match_the_element_wise_ones() {
        // Over several blocks, with a short last one.
        let n = 3 * CONVERT_BLOCK + 123;
        let v: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        for dt in [DType::BF16, DType::F16, DType::F32] {
            let bytes = dt.encode(&v);
            assert_eq!(bytes.len(), n * dt.size());
            let back = dt.decode(&bytes);
            for (i, (&a, &b)) in back.iter().zip(&v).enumerate() {
                assert_eq!(a, dt.round(b), "{dt:?} element {i}");
            }
            for to in [DType::BF16, DType::F16, DType::F32] {
                let conv = dt.convert(&bytes, to);
                assert_eq!(conv, to.encode(&back), "{dt:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn par_blocks_visits_every_block_once_in_place() {
        let mut out = vec![0usize; 1000];
        par_blocks(&mut out, 7, |b, dst| {
            for (j, x) in dst.iter_mut().enumerate() {
                *x += b * 7 + j;
            }
        });
        assert!(out.iter().enumerate().all(|(i, &x)| x == i));
    }
}
