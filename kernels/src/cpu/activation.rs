//! SiLU-and-mul: the gated activation of the Llama MLP, `silu(gate) * up`.

/// Input `x` [T, 2*d] holds `gate` in the first half of each row and `up` in the second
/// (the layout of the fused gate/up projection); `out` [T, d].
pub fn silu_and_mul(x: &[f32], d: usize, out: &mut [f32]) {
    let t = x.len() / (2 * d);
    assert_eq!(x.len(), t * 2 * d, "silu_and_mul: x shape");
    assert_eq!(out.len(), t * d, "silu_and_mul: out shape");
    for (row, dst) in x.chunks_exact(2 * d).zip(out.chunks_exact_mut(d)) {
        let (gate, up) = row.split_at(d);
        for ((o, &g), &u) in dst.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_formula() {
        let x = [0.0, 1.0, -2.0, 2.0, 3.0, 0.5];
        let mut out = [f32::NAN; 3];
        silu_and_mul(&x, 3, &mut out);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        assert_eq!(out[0], 0.0);
        assert!((out[1] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((out[2] - silu(-2.0) * 0.5).abs() < 1e-6);
    }
}
