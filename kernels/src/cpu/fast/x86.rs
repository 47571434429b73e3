//! The AVX-512 and AVX2 bodies of the fast kernels: the GEMM micro-kernels, `exp`, the
//! dot products and weighted sums of attention. Each performs, lane by lane, the operations
//! of its scalar definition (`math.rs`, `matmul::tile_scalar`), so results do not depend
//! on the ISA. Callers check `Isa::is_available` before calling in.

// Register tiles read best as indexed loops over their rows and panels.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::isa::Isa;
use super::math::{weighted_sum_body, EXP_HI, EXP_LO, EXP_P, LN2_HI, LN2_LO, LOG2E};
use super::packed::{Elem, PANEL};

/// Loading 16 (AVX-512) or 8 (AVX2) consecutive elements widened to f32.
pub(crate) trait X86Elem: Elem {
    /// # Safety
    /// AVX-512F available; 16 elements readable at `p`.
    unsafe fn load16(p: *const Self) -> __m512;
    /// # Safety
    /// AVX2 and F16C available; 8 elements readable at `p`.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl X86Elem for f32 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl X86Elem for bf16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const bf16) -> __m512 {
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const bf16) -> __m256 {
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
}

impl X86Elem for f16 {
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// `acc[i][16j + l] = Σ_c x[c·MR + i] · panel_j[c·16 + l]`, fused multiply-adds in
/// increasing `c`, for a tile of `MR` rows of `x` (packed column by column) and `NP`
/// panels.
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C available; `x` holds `k · MR` values; each panel holds
/// `k · 16` elements.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx512<T: X86Elem, const MR: usize, const NP: usize>(
    x: *const f32,
    k: usize,
    panels: [*const T; NP],
    acc_out: &mut [[f32; 2 * PANEL]; MR],
) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NP]; MR];
        for c in 0..k {
            let mut w = [_mm512_setzero_ps(); NP];
            for j in 0..NP {
                w[j] = T::load16(panels[j].add(c * PANEL));
            }
            for i in 0..MR {
                let b = _mm512_set1_ps(*x.add(c * MR + i));
                for j in 0..NP {
                    acc[i][j] = _mm512_fmadd_ps(b, w[j], acc[i][j]);
                }
            }
        }
        for i in 0..MR {
            for j in 0..NP {
                _mm512_storeu_ps(acc_out[i].as_mut_ptr().add(j * PANEL), acc[i][j]);
            }
        }
    }
}

/// `acc[i][16j + l] += (odd, then even) bf16 products` of row `i`'s pairs `x[c·MR + i]`
/// and lane `l`'s pairs of panel `j` (`Bf16Layout::Pairs`), for `c` in `0..k2`: what
/// `tile_avx512` computes on the same values in `Bf16Layout::Swapped` order, since a
/// bf16 product is exact in f32 and `vdpbf16ps` adds the odd product, then the even one.
///
/// # Safety
/// AVX-512F and AVX-512 BF16 available; `x` holds `k2 · MR` pairs; each panel holds
/// `k2 · 32` elements.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn tile_avx512_bf16<const MR: usize, const NP: usize>(
    x: *const u32,
    k2: usize,
    panels: [*const bf16; NP],
    acc_out: &mut [[f32; 2 * PANEL]; MR],
) {
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NP]; MR];
        for c in 0..k2 {
            let mut w = [_mm512_setzero_si512(); NP];
            for j in 0..NP {
                w[j] = _mm512_loadu_si512(panels[j].add(c * 2 * PANEL) as *const __m512i);
            }
            for i in 0..MR {
                let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(c * MR + i) as i32));
                for j in 0..NP {
                    let wj: __m512bh = std::mem::transmute(w[j]);
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], b, wj);
                }
            }
        }
        for i in 0..MR {
            for j in 0..NP {
                _mm512_storeu_ps(acc_out[i].as_mut_ptr().add(j * PANEL), acc[i][j]);
            }
        }
    }
}

/// `tile_avx512` in 8-lane halves.
///
/// # Safety
/// As `tile_avx512`, with AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile_avx2<T: X86Elem, const MR: usize, const NP: usize>(
    x: *const f32,
    k: usize,
    panels: [*const T; NP],
    acc_out: &mut [[f32; 2 * PANEL]; MR],
) {
    unsafe {
        let mut acc = [[[_mm256_setzero_ps(); 2]; NP]; MR];
        for c in 0..k {
            let mut b = [_mm256_setzero_ps(); MR];
            for i in 0..MR {
                b[i] = _mm256_set1_ps(*x.add(c * MR + i));
            }
            for j in 0..NP {
                for h in 0..2 {
                    let w = T::load8(panels[j].add(c * PANEL + 8 * h));
                    for i in 0..MR {
                        acc[i][j][h] = _mm256_fmadd_ps(b[i], w, acc[i][j][h]);
                    }
                }
            }
        }
        for i in 0..MR {
            for j in 0..NP {
                for h in 0..2 {
                    let dst = acc_out[i].as_mut_ptr().add(j * PANEL + 8 * h);
                    _mm256_storeu_ps(dst, acc[i][j][h]);
                }
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_LO)),
        _mm512_set1_ps(EXP_HI),
    );
    let t = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _mm512_set1_ps(0.5));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut y = _mm512_set1_ps(EXP_P[0]);
    for &p in &EXP_P[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    let e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e)))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
        _mm256_set1_ps(EXP_HI),
    );
    let t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _mm256_set1_ps(0.5));
    let n = _mm256_floor_ps(t);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut y = _mm256_set1_ps(EXP_P[0]);
    for &p in &EXP_P[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e)))
}

#[target_feature(enable = "avx512f")]
fn exp_avx512(xs: &mut [f32]) {
    let mut chunks = xs.chunks_exact_mut(16);
    for c in &mut chunks {
        // SAFETY: `c` holds 16 floats.
        unsafe { _mm512_storeu_ps(c.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr()))) };
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut buf = [0f32; 16];
        buf[..rest.len()].copy_from_slice(rest);
        // SAFETY: `buf` holds 16 floats.
        unsafe { _mm512_storeu_ps(buf.as_mut_ptr(), exp16(_mm512_loadu_ps(buf.as_ptr()))) };
        rest.copy_from_slice(&buf[..rest.len()]);
    }
}

#[target_feature(enable = "avx2,fma")]
fn exp_avx2(xs: &mut [f32]) {
    let mut chunks = xs.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 floats.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr()))) };
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut buf = [0f32; 8];
        buf[..rest.len()].copy_from_slice(rest);
        // SAFETY: `buf` holds 8 floats.
        unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), exp8(_mm256_loadu_ps(buf.as_ptr()))) };
        rest.copy_from_slice(&buf[..rest.len()]);
    }
}

pub(crate) fn exp_in_place(xs: &mut [f32], isa: Isa) {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    // SAFETY: the ISA's features are available (checked above).
    match isa {
        Isa::Avx512 => unsafe { exp_avx512(xs) },
        Isa::Avx2 => unsafe { exp_avx2(xs) },
        Isa::Scalar => unreachable!("the scalar exp is math::exp_scalar"),
    }
}

/// Lanes 0..8 plus 8..16 (the first step of `math::reduce16`), then the rest.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce512(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    reduce256(_mm256_add_ps(lo, hi))
}

#[inline]
#[target_feature(enable = "avx2")]
fn reduce256(s8: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// `math::dot_scalar` of `n` floats at `a` and `b`.
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn dot_avx512(a: *const f32, b: *const f32, n: usize) -> f32 {
    unsafe {
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), acc);
            i += 16;
        }
        if i < n {
            let m: __mmask16 = ((1u32 << (n - i)) - 1) as u16;
            let (x, y) = (
                _mm512_maskz_loadu_ps(m, a.add(i)),
                _mm512_maskz_loadu_ps(m, b.add(i)),
            );
            acc = _mm512_fmadd_ps(x, y, acc);
        }
        reduce512(acc)
    }
}

/// `math::dot_scalar` in two 8-lane halves.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: *const f32, b: *const f32, n: usize) -> f32 {
    unsafe {
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), lo);
            hi = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.add(i + 8)),
                _mm256_loadu_ps(b.add(i + 8)),
                hi,
            );
            i += 16;
        }
        if i < n {
            let (mut x, mut y) = ([0f32; 16], [0f32; 16]);
            std::ptr::copy_nonoverlapping(a.add(i), x.as_mut_ptr(), n - i);
            std::ptr::copy_nonoverlapping(b.add(i), y.as_mut_ptr(), n - i);
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()), lo);
            hi = _mm256_fmadd_ps(
                _mm256_loadu_ps(x.as_ptr().add(8)),
                _mm256_loadu_ps(y.as_ptr().add(8)),
                hi,
            );
        }
        reduce256(_mm256_add_ps(lo, hi))
    }
}

/// The sums of 16 accumulators at once, lane `i` of the result holding `a[i]` summed by
/// `math::reduce16`'s tree: the same additions, done four vectors at a time.
#[inline]
#[target_feature(enable = "avx512f")]
fn reduce16x16(a: [__m512; 16]) -> __m512 {
    // l + l+8: [a_i lanes 0..8 | a_i+1 lanes 0..8] + [their lanes 8..16].
    let t: [__m512; 8] = std::array::from_fn(|i| {
        let (x, y) = (a[2 * i], a[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xEE>(x, y),
        )
    });
    // l + l+4: quarter q of u_i holds the 4 sums of accumulator 4i + q.
    let u: [__m512; 4] = std::array::from_fn(|i| {
        let (x, y) = (t[2 * i], t[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    });
    // l + l+2: quarter q of v_0 holds 2 sums of accumulators q and 4 + q, of v_1 8 + q
    // and 12 + q.
    let v: [__m512; 2] = std::array::from_fn(|i| {
        let (x, y) = (u[2 * i], u[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(x, y),
            _mm512_shuffle_ps::<0xEE>(x, y),
        )
    });
    // l + l+1: lane 4q + r holds the sum of accumulator 4r + q.
    let w = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(v[0], v[1]),
        _mm512_shuffle_ps::<0xDD>(v[0], v[1]),
    );
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, w)
}

#[target_feature(enable = "avx512f,avx2,fma")]
fn scores_avx512(q: &[f32], cache: &[f32], offsets: &[usize], scale: f32, out: &mut [f32]) {
    let n = q.len();
    assert!(offsets.iter().all(|&o| o + n <= cache.len()));
    assert!(out.len() >= offsets.len());
    let chunks = n / 16;
    let tail: __mmask16 = ((1u32 << (n % 16)) - 1) as u16;
    let (qp, cp) = (q.as_ptr(), cache.as_ptr());
    let mut blocks = offsets.chunks_exact(16);
    let mut p = 0;
    for keys in &mut blocks {
        // SAFETY: every key's `n` floats lie inside `cache` (asserted above), `q` holds `n`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in 0..chunks {
                let qc = _mm512_loadu_ps(qp.add(16 * c));
                for (a, &off) in acc.iter_mut().zip(keys) {
                    *a = _mm512_fmadd_ps(qc, _mm512_loadu_ps(cp.add(off + 16 * c)), *a);
                }
            }
            if tail != 0 {
                let qc = _mm512_maskz_loadu_ps(tail, qp.add(16 * chunks));
                for (a, &off) in acc.iter_mut().zip(keys) {
                    let k = _mm512_maskz_loadu_ps(tail, cp.add(off + 16 * chunks));
                    *a = _mm512_fmadd_ps(qc, k, *a);
                }
            }
            let s = _mm512_mul_ps(reduce16x16(acc), _mm512_set1_ps(scale));
            _mm512_storeu_ps(out.as_mut_ptr().add(p), s);
        }
        p += 16;
    }
    for (o, &off) in out[p..].iter_mut().zip(blocks.remainder()) {
        // SAFETY: as above.
        *o = unsafe { dot_avx512(qp, cp.add(off), n) } * scale;
    }
}

#[target_feature(enable = "avx2,fma")]
fn scores_avx2(q: &[f32], cache: &[f32], offsets: &[usize], scale: f32, out: &mut [f32]) {
    let n = q.len();
    for (o, &off) in out.iter_mut().zip(offsets) {
        let k = &cache[off..off + n];
        // SAFETY: `q` and `k` hold `n` floats each.
        *o = unsafe { dot_avx2(q.as_ptr(), k.as_ptr(), n) } * scale;
    }
}

/// `out[p] = dot(q, cache[offsets[p]..][..q.len()]) · scale`.
pub(crate) fn scores(
    q: &[f32],
    cache: &[f32],
    offsets: &[usize],
    scale: f32,
    out: &mut [f32],
    isa: Isa,
) {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    // SAFETY: the ISA's features are available (checked above).
    match isa {
        Isa::Avx512 => unsafe { scores_avx512(q, cache, offsets, scale, out) },
        Isa::Avx2 => unsafe { scores_avx2(q, cache, offsets, scale, out) },
        Isa::Scalar => unreachable!("the scalar body is in attention.rs"),
    }
}

macro_rules! weighted_sum_for {
    ($name:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        fn $name(
            rows: usize,
            w: &[f32],
            w_stride: usize,
            cache: &[f32],
            offsets: &[usize],
            acc: &mut [f32],
            hd: usize,
        ) {
            weighted_sum_body(rows, w, w_stride, cache, offsets, acc, hd)
        }
    };
}
weighted_sum_for!(weighted_sum_avx512, "avx512f");
weighted_sum_for!(weighted_sum_avx2, "avx2");

/// `math::weighted_sum_body` (adds to `acc`), compiled for `isa`'s vector width.
#[allow(clippy::too_many_arguments)]
pub(crate) fn weighted_sum(
    rows: usize,
    w: &[f32],
    w_stride: usize,
    cache: &[f32],
    offsets: &[usize],
    acc: &mut [f32],
    hd: usize,
    isa: Isa,
) {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
    // SAFETY: the ISA's features are available (checked above).
    match isa {
        Isa::Avx512 => unsafe { weighted_sum_avx512(rows, w, w_stride, cache, offsets, acc, hd) },
        Isa::Avx2 => unsafe { weighted_sum_avx2(rows, w, w_stride, cache, offsets, acc, hd) },
        Isa::Scalar => weighted_sum_body(rows, w, w_stride, cache, offsets, acc, hd),
    }
}
