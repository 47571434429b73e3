//! Dequantization of GGUF tensor data to f32, for the block layouts of llama.cpp's
//! `ggml-quants.c` (`dequantize_row_*`): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and
//! Q6_K. Large tensors are decoded in parallel chunks of whole blocks.

use half::f16;
use vllm_kernels::cuda::dtype::par_blocks;
use vllm_kernels::cuda::DType;

use super::ggml_type::{GgmlType, QK_K};

/// Elements per parallel chunk (a multiple of every block size).
const CHUNK: usize = 1 << 16;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The values of `numel` elements of `ty` stored in `bytes`. Errors name the type when it
/// cannot be decoded, or when the byte count does not match.
pub fn dequantize(ty: GgmlType, bytes: &[u8], numel: usize) -> Result<Vec<f32>, String> {
    if !ty.is_supported() {
        return Err(format!(
            "unsupported GGUF tensor type {} (supported: {})",
            ty.name(),
            GgmlType::DEQUANTIZED
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let Some((elems, block_bytes)) = ty.block() else {
        return Err(format!(
            "GGUF tensor type {} has no known layout",
            ty.name()
        ));
    };
    match ty.bytes_for(numel) {
        Some(n) if n == bytes.len() => {}
        _ => {
            return Err(format!(
                "{numel} {} elements do not fill {} bytes",
                ty.name(),
                bytes.len()
            ))
        }
    }
    let mut out = vec![0f32; numel];
    let chunk_bytes = CHUNK / elems * block_bytes;
    par_blocks(&mut out, CHUNK, |i, dst| {
        let start = i * chunk_bytes;
        let src = &bytes[start..start + dst.len() / elems * block_bytes];
        decode(ty, src, dst);
    });
    Ok(out)
}

/// Decodes whole blocks: `src` holds exactly the blocks of `dst`.
fn decode(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match ty {
        GgmlType::F32 => DType::F32.decode_into(src, dst),
        GgmlType::F16 => DType::F16.decode_into(src, dst),
        GgmlType::BF16 => DType::BF16.decode_into(src, dst),
        GgmlType::Q8_0 => {
            for (y, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (v, &q) in y.iter_mut().zip(&b[2..34]) {
                    *v = d * f32::from(q as i8);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (y, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let (lo, hi) = y.split_at_mut(16);
                for (j, &q) in b[2..18].iter().enumerate() {
                    lo[j] = d * (f32::from(q & 0xF) - 8.0);
                    hi[j] = d * (f32::from(q >> 4) - 8.0);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (y, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let (lo, hi) = y.split_at_mut(16);
                for (j, &q) in b[4..20].iter().enumerate() {
                    lo[j] = d * f32::from(q & 0xF) + m;
                    hi[j] = d * f32::from(q >> 4) + m;
                }
            }
        }
        GgmlType::Q4K => {
            for (y, b) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(144)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qs = &b[16..144];
                for (j, (y, q)) in y.chunks_exact_mut(64).zip(qs.chunks_exact(32)).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let (d1, m1) = (d * sc1, dmin * m1);
                    let (d2, m2) = (d * sc2, dmin * m2);
                    let (lo, hi) = y.split_at_mut(32);
                    for l in 0..32 {
                        lo[l] = d1 * f32::from(q[l] & 0xF) - m1;
                        hi[l] = d2 * f32::from(q[l] >> 4) - m2;
                    }
                }
            }
        }
        GgmlType::Q5K => {
            for (y, b) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(176)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let scales = &b[4..16];
                let qh = &b[16..48];
                let qs = &b[48..176];
                for (j, (y, q)) in y.chunks_exact_mut(64).zip(qs.chunks_exact(32)).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let (d1, m1) = (d * sc1, dmin * m1);
                    let (d2, m2) = (d * sc2, dmin * m2);
                    let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
                    let (lo, hi) = y.split_at_mut(32);
                    for l in 0..32 {
                        let h1 = if qh[l] & u1 != 0 { 16.0 } else { 0.0 };
                        let h2 = if qh[l] & u2 != 0 { 16.0 } else { 0.0 };
                        lo[l] = d1 * (f32::from(q[l] & 0xF) + h1) - m1;
                        hi[l] = d2 * (f32::from(q[l] >> 4) + h2) - m2;
                    }
                }
            }
        }
        GgmlType::Q6K => {
            for (y, b) in dst.chunks_exact_mut(QK_K).zip(src.chunks_exact(210)) {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for n in 0..2 {
                    let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                    let sc = &sc[8 * n..];
                    let y = &mut y[128 * n..128 * (n + 1)];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let s = |k: usize| d * f32::from(sc[is + k] as i8);
                        y[l] = s(0) * q1 as f32;
                        y[l + 32] = s(2) * q2 as f32;
                        y[l + 64] = s(4) * q3 as f32;
                        y[l + 96] = s(6) * q4 as f32;
                    }
                }
            }
        }
        other => unreachable!("decode of unsupported type {}", other.name()),
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K super-block
/// (`get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (d, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(d), f32::from(m))
}
