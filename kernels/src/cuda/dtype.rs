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

    /// f32 values as this dtype's little-endian bytes (round to nearest even).
    pub fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            DType::BF16 => data
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            DType::F16 => data
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            DType::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// This dtype's little-endian bytes as f32 values.
    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
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
}
