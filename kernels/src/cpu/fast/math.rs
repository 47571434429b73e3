//! The two vector primitives whose order of operations the fast kernels fix for every ISA:
//! `exp` (Cephes' single-precision polynomial, within 2 ulp of the true value over the
//! softmax and SiLU range) and `dot` (16 lanes of fused multiply-adds, then a fixed tree).
//!
//! The scalar bodies here define the results; the x86 bodies (`x86.rs`) perform the same
//! operations lane by lane, so every ISA gives the same bits.

use super::isa::Isa;

pub(crate) const EXP_HI: f32 = 88.0;
pub(crate) const EXP_LO: f32 = -87.0;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `e^x`, the scalar definition of every ISA's `exp`. Inputs are clamped to
/// [-87, 88] (so the result is a normal, finite float; NaN gives e^-87).
#[inline(always)]
pub fn exp_scalar(x: f32) -> f32 {
    // Not `clamp`: max/min send NaN to a bound, as the SIMD max/min do.
    #[allow(clippy::manual_clamp)]
    let x = x.max(EXP_LO).min(EXP_HI);
    let n = (x * LOG2E + 0.5).floor();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut y = EXP_P[0];
    for &p in &EXP_P[1..] {
        y = y.mul_add(r, p);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `xs[i] = e^xs[i]`, vectorized on `isa`.
pub fn exp_in_place(xs: &mut [f32], isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => super::x86::exp_in_place(xs, isa),
        _ => xs.iter_mut().for_each(|x| *x = exp_scalar(*x)),
    }
}

/// The 16-lane dot product: lane `l` accumulates `a[d] * b[d]` for `d ≡ l (mod 16)` in
/// increasing `d` with fused multiply-adds, then lanes are summed by halves
/// (l + l+8, then + l+4, + l+2, + l+1).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // lane arithmetic reads best indexed
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..16 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let (ra, rb) = (ca.remainder(), cb.remainder());
    if !ra.is_empty() {
        // The SIMD bodies load the tail zero-padded: zeros go through the same FMAs.
        for l in 0..16 {
            let (x, y) = (
                ra.get(l).copied().unwrap_or(0.0),
                rb.get(l).copied().unwrap_or(0.0),
            );
            acc[l] = x.mul_add(y, acc[l]);
        }
    }
    reduce16(acc)
}

#[inline(always)]
pub(crate) fn reduce16(acc: [f32; 16]) -> f32 {
    let mut s8 = [0f32; 8];
    for l in 0..8 {
        s8[l] = acc[l] + acc[l + 8];
    }
    let s4 = [s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

// The weighted sum of attention is elementwise (`acc[d] += w · v[d]`, a multiply then an
// add, in key order), so any vector width gives the same bits, and so does stopping after
// any key and going on later from `acc`: one body, which the x86 wrappers compile for
// their width. Up to 4 rows (query heads sharing a KV head) go together so that each value
// vector is loaded once and the rows' additions overlap; 32 columns at a time stay in
// registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weighted_sum_cols<const L: usize, const R: usize>(
    w: &[f32],
    w_stride: usize,
    cache: &[f32],
    offsets: &[usize],
    d0: usize,
    acc: &mut [f32],
    hd: usize,
) {
    let mut a = [[0f32; L]; R];
    for (r, ar) in a.iter_mut().enumerate() {
        ar.copy_from_slice(&acc[r * hd + d0..r * hd + d0 + L]);
    }
    for (p, &off) in offsets.iter().enumerate() {
        let v: &[f32; L] = cache[off + d0..off + d0 + L].try_into().unwrap();
        for (r, ar) in a.iter_mut().enumerate() {
            let wp = w[r * w_stride + p];
            for i in 0..L {
                ar[i] += wp * v[i];
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        acc[r * hd + d0..r * hd + d0 + L].copy_from_slice(ar);
    }
}

#[inline(always)]
fn weighted_sum_rows<const R: usize>(
    w: &[f32],
    w_stride: usize,
    cache: &[f32],
    offsets: &[usize],
    acc: &mut [f32],
    hd: usize,
) {
    let mut d0 = 0;
    while d0 < hd {
        let left = hd - d0;
        d0 += if left >= 32 {
            weighted_sum_cols::<32, R>(w, w_stride, cache, offsets, d0, acc, hd);
            32
        } else if left >= 16 {
            weighted_sum_cols::<16, R>(w, w_stride, cache, offsets, d0, acc, hd);
            16
        } else {
            for r in 0..R {
                let a = &mut acc[r * hd + d0..(r + 1) * hd];
                for (p, &off) in offsets.iter().enumerate() {
                    let wp = w[r * w_stride + p];
                    for (x, &v) in a.iter_mut().zip(&cache[off + d0..off + hd]) {
                        *x += wp * v;
                    }
                }
            }
            left
        };
    }
}

/// For each of `rows` (1..=4) rows `r`: `acc[r·hd + d] += w[r·w_stride + p] ·
/// cache[offsets[p] + d]` for each `p` in order.
#[inline(always)]
pub(crate) fn weighted_sum_body(
    rows: usize,
    w: &[f32],
    w_stride: usize,
    cache: &[f32],
    offsets: &[usize],
    acc: &mut [f32],
    hd: usize,
) {
    match rows {
        1 => weighted_sum_rows::<1>(w, w_stride, cache, offsets, acc, hd),
        2 => weighted_sum_rows::<2>(w, w_stride, cache, offsets, acc, hd),
        3 => weighted_sum_rows::<3>(w, w_stride, cache, offsets, acc, hd),
        4 => weighted_sum_rows::<4>(w, w_stride, cache, offsets, acc, hd),
        _ => panic!("weighted_sum of {rows} rows"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_f64() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp_scalar(x);
            let want = (x as f64).exp() as f32;
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            x += 0.0137;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp_scalar(0.0), 1.0);
        assert!(exp_scalar(-1000.0) > 0.0 && exp_scalar(1000.0).is_finite());
    }

    #[test]
    fn every_isa_gives_the_scalar_bits() {
        let xs: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.19).collect();
        let want: Vec<f32> = xs.iter().map(|&x| exp_scalar(x)).collect();
        for isa in Isa::available() {
            let mut got = xs.clone();
            exp_in_place(&mut got, isa);
            assert_eq!(got, want, "{isa:?}");
        }
    }

    #[test]
    fn dot_matches_f64_closely() {
        for n in [1, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 7.0).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot_scalar(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
        }
    }
}
