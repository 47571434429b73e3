//! RMSNorm in its three uses: plain (final norm of the first layer's input), fused with the
//! residual add (every other norm of the decoder), and per attention head (Qwen3's q/k norm).
//!
//! `y = x / sqrt(mean(x²) + eps) * weight`, accumulated in f32 left to right.

/// 1 / RMS of a row, eps inside the root: the scale every norm here applies (and the
/// deferred norm's, norm.cu's `row_inv_rms`).
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let sum_sq: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (sum_sq / x.len() as f32 + eps).sqrt()
}

fn normalize_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv_rms = inv_rms(x, eps);
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv_rms * w;
    }
}

/// Shapes: `x` [T, hidden], `weight` [hidden], `out` [T, hidden].
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = weight.len();
    assert_eq!(x.len() % hidden, 0, "rms_norm: x shape");
    assert_eq!(out.len(), x.len(), "rms_norm: out shape");
    for (row, dst) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        normalize_row(row, weight, eps, dst);
    }
}

/// vLLM's `fused_add_rms_norm`: `residual += x`, then `x = rms_norm(residual)`, both in
/// place. Shapes: `x`, `residual` [T, hidden], `weight` [hidden].
pub fn fused_add_rms_norm(x: &mut [f32], residual: &mut [f32], weight: &[f32], eps: f32) {
    let hidden = weight.len();
    assert_eq!(
        x.len(),
        residual.len(),
        "fused_add_rms_norm: x vs residual shape"
    );
    assert_eq!(x.len() % hidden, 0, "fused_add_rms_norm: x shape");
    for (xr, rr) in x
        .chunks_exact_mut(hidden)
        .zip(residual.chunks_exact_mut(hidden))
    {
        for (r, &v) in rr.iter_mut().zip(xr.iter()) {
            *r += v;
        }
        normalize_row(rr, weight, eps, xr);
    }
}

/// RMSNorm over each head of `x` [T, num_heads, head_dim] in place, one shared `weight`
/// [head_dim] (Qwen3's q_norm / k_norm).
pub fn rms_norm_per_head(x: &mut [f32], weight: &[f32], eps: f32) {
    let head_dim = weight.len();
    assert_eq!(x.len() % head_dim, 0, "rms_norm_per_head: x shape");
    let mut tmp = vec![0.0f32; head_dim];
    for head in x.chunks_exact_mut(head_dim) {
        normalize_row(head, weight, eps, &mut tmp);
        head.copy_from_slice(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_hand_checked() {
        // mean(x²) of [3, 4] = 12.5
        let mut out = [f32::NAN; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let r = 12.5f32.sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
    }

    #[test]
    fn fused_add_equals_add_then_norm() {
        let mut x = [1.0, -2.0, 0.5, 4.0];
        let mut res = [0.5, 0.5, 1.0, -1.0];
        let w = [1.5, 0.5];
        let sum = [1.5, -1.5, 1.5, 3.0];
        let mut expect = [f32::NAN; 4];
        rms_norm(&sum, &w, 1e-6, &mut expect);
        fused_add_rms_norm(&mut x, &mut res, &w, 1e-6);
        assert_eq!(res, sum);
        assert_eq!(x, expect);
    }

    #[test]
    fn per_head_normalizes_each_head_separately() {
        let mut x = [3.0, 4.0, 30.0, 40.0];
        rms_norm_per_head(&mut x, &[1.0, 1.0], 0.0);
        assert!((x[0] - x[2]).abs() < 1e-6 && (x[1] - x[3]).abs() < 1e-6);
    }
}
