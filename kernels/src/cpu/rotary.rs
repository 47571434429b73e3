//! Rotary position embedding, neox style (rotate halves), as in vLLM's `get_rope`.
//!
//! `compute_inv_freq` gives the per-pair frequencies (with Llama 3's frequency scaling when
//! asked), `compute_cos_sin_cache` tabulates them per position as vLLM's `cos_sin_cache`
//! ([max_position, rotary_dim] with the cos half then the sin half), and
//! `rotary_embedding_neox` rotates q and k in place.

use std::f64::consts::PI;

/// Llama 3's `rope_scaling` (rope_type "llama3").
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// `inv_freq[i] = 1 / theta^(2i / rotary_dim)`, `i < rotary_dim / 2`, then Llama 3
/// scaling: long wavelengths are divided by `factor`, short ones kept, the band between
/// interpolated smoothly (transformers' `_compute_llama3_parameters`).
pub fn compute_inv_freq(
    rotary_dim: usize,
    theta: f64,
    llama3: Option<Llama3RopeScaling>,
) -> Vec<f64> {
    let base: Vec<f64> = (0..rotary_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64))
        .collect();
    let Some(s) = llama3 else { return base };
    let low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    base.into_iter()
        .map(|freq| {
            let wavelen = 2.0 * PI / freq;
            if wavelen < high_freq_wavelen {
                freq
            } else if wavelen > low_freq_wavelen {
                freq / s.factor
            } else {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * freq / s.factor + smooth * freq
            }
        })
        .collect()
}

/// `[max_position, rotary_dim]`: row p holds `cos(p·inv_freq)` then `sin(p·inv_freq)`.
/// Computed in f64 and rounded once, so every backend can share the same table.
pub fn compute_cos_sin_cache(inv_freq: &[f64], max_position: usize) -> Vec<f32> {
    let half = inv_freq.len();
    let mut cache = vec![0.0f32; max_position * 2 * half];
    for (p, row) in cache.chunks_exact_mut(2 * half).enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = p as f64 * f;
            row[i] = angle.cos() as f32;
            row[half + i] = angle.sin() as f32;
        }
    }
    cache
}

fn rotate_heads(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos[i] - b * sin[i];
            head[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

/// Rotates `q` [T, num_q_heads, head_dim] and `k` [T, num_kv_heads, head_dim] in place at
/// `positions` [T]; the rotary dim is the cache's row width (= head_dim for our models).
pub fn rotary_embedding_neox(
    positions: &[i32],
    q: &mut [f32],
    k: &mut [f32],
    head_dim: usize,
    cos_sin_cache: &[f32],
    rotary_dim: usize,
) {
    let t = positions.len();
    assert!(
        rotary_dim <= head_dim && rotary_dim.is_multiple_of(2),
        "rotary: rotary_dim"
    );
    assert_eq!(q.len() % (t.max(1) * head_dim), 0, "rotary: q shape");
    assert_eq!(k.len() % (t.max(1) * head_dim), 0, "rotary: k shape");
    if t == 0 {
        return;
    }
    let (q_row, k_row) = (q.len() / t, k.len() / t);
    for (i, &pos) in positions.iter().enumerate() {
        let row = &cos_sin_cache[pos as usize * rotary_dim..(pos as usize + 1) * rotary_dim];
        let (cos, sin) = row.split_at(rotary_dim / 2);
        rotate_heads(&mut q[i * q_row..(i + 1) * q_row], head_dim, cos, sin);
        rotate_heads(&mut k[i * k_row..(i + 1) * k_row], head_dim, cos, sin);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_pairs_by_position_times_frequency() {
        let head_dim = 4;
        let inv = compute_inv_freq(head_dim, 10000.0, None);
        assert_eq!(inv, vec![1.0, 0.01]);
        let cache = compute_cos_sin_cache(&inv, 8);
        let mut q = vec![1.0, 2.0, 3.0, 4.0];
        let mut k = vec![0.5, 0.0, -1.0, 1.0];
        rotary_embedding_neox(&[3], &mut q, &mut k, head_dim, &cache, head_dim);
        let rot = |a: f64, b: f64, ang: f64| {
            (a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin())
        };
        let (q0, q2) = rot(1.0, 3.0, 3.0);
        let (q1, q3) = rot(2.0, 4.0, 0.03);
        for (got, want) in q.iter().zip([q0, q1, q2, q3]) {
            assert!((*got as f64 - want).abs() < 1e-6, "{got} vs {want}");
        }
        let (k0, k2) = rot(0.5, -1.0, 3.0);
        assert!((k[0] as f64 - k0).abs() < 1e-6 && (k[2] as f64 - k2).abs() < 1e-6);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let plain = compute_inv_freq(64, 500000.0, None);
        let scaled = compute_inv_freq(64, 500000.0, Some(s));
        assert_eq!(scaled[0], plain[0]); // wavelength 2π < 2048
        assert!((scaled[31] - plain[31] / 32.0).abs() < 1e-15); // very long wavelength
        for (a, b) in scaled.iter().zip(&plain) {
            assert!(*a <= *b && *a >= b / 32.0 - 1e-18);
        }
    }
}
