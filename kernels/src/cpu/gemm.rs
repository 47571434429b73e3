//! GEMM for linear layers: `y = x · Wᵀ + b`, weights in PyTorch's [out, in] layout.
//!
//! Goes through `matrixmultiply::sgemm`, whose summation order over `k` for one output
//! element does not depend on how many rows `x` has: a row gives bit-identical results
//! whether computed alone (decode) or in a batch (prefill), which the greedy-equality tests
//! rely on.

/// Shapes: `x` [m, k], `w` [n, k], `bias` [n], `out` [m, n].
pub fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    assert_eq!(x.len(), m * k, "linear: x shape");
    assert_eq!(w.len(), n * k, "linear: w shape");
    assert_eq!(out.len(), m * n, "linear: out shape");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "linear: bias shape");
    }
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the asserts above bound every access: A is m×k row-major, B = Wᵀ is k×n read
    // through W's strides (row stride 1, column stride k), C is m×n row-major; beta = 0
    // means C's previous contents (NaN poison included) are never read.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            x.as_ptr(),
            k as isize,
            1,
            w.as_ptr(),
            1,
            k as isize,
            0.0,
            out.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            for (o, &bv) in row.iter_mut().zip(b) {
                *o += bv;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_hand_computed_product() {
        // x [2,3], w [2,3]
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = [1.0, 0.0, -1.0, 0.5, 0.5, 0.5];
        let mut out = [f32::NAN; 4];
        linear(&x, &w, Some(&[10.0, 20.0]), 2, 3, 2, &mut out);
        assert_eq!(
            out,
            [1.0 - 3.0 + 10.0, 3.0 + 20.0, 4.0 - 6.0 + 10.0, 7.5 + 20.0]
        );
    }

    #[test]
    fn rows_are_independent_of_batch_size() {
        let (k, n) = (300, 70);
        let x: Vec<f32> = (0..5 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 31.0)
            .collect();
        let mut all = vec![f32::NAN; 5 * n];
        linear(&x, &w, None, 5, k, n, &mut all);
        for r in 0..5 {
            let mut one = vec![f32::NAN; n];
            linear(&x[r * k..(r + 1) * k], &w, None, 1, k, n, &mut one);
            assert_eq!(one, all[r * n..(r + 1) * n]);
        }
    }
}
