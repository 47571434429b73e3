//! The fast linear layer: `y = x · Wᵀ (+ b)` over a `PackedMatrix`, multi-threaded, and
//! its fused MLP form `silu(x · Wgᵀ) · (x · Wuᵀ)`.
//!
//! Every output element is `Σ_c x[i][c] · W[j][c]` as one chain of fused multiply-adds in
//! increasing `c`, started from zero, then `+ b[j]`. With bf16 weights `x` is rounded to
//! bf16 too and each pair of columns is taken odd one first: exactly what `vdpbf16ps`
//! computes (a product of two bf16 is exact in f32), at twice the FMA rate, where the CPU
//! has AVX-512 BF16; other ISAs run the same chain through FMAs. That order is the same
//! whatever the ISA, the tile an element falls in, the number of rows `m` or threads, so
//! a row gives the same bits in a batch of 512 (prefill) as alone (decode).
//!
//! Work: the columns are cut into units of two panels (32 outputs; for the fused form, a
//! gate panel and its up panel), the units into contiguous ranges claimed by the pool's
//! threads; each range runs over `x` in blocks of rows that stay in cache while every
//! unit's weights stream past them, in tiles of up to 12 rows (AVX-512) whose
//! accumulators live in registers.

use half::bf16;

use super::isa::Isa;
use super::math::exp_in_place;
use super::packed::{Bf16Layout, Elem, PackedData, PackedMatrix, PANEL};
use super::pool::ThreadPool;

/// Most rows per register tile on each ISA.
fn max_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 12,
        Isa::Avx2 => 3,
        Isa::Scalar => 4,
    }
}

/// Multiply-adds below which a product runs on the calling thread alone.
const SERIAL_WORK: usize = 1 << 15;

/// `acc[i][16j + l] = Σ_c x[c·MR + i] · panel_j[c·16 + l]` (a tile of `MR` rows of `x`,
/// packed column by column): the definition every ISA's tile reproduces bit for bit.
fn tile_scalar<T: Elem, const MR: usize, const NP: usize>(
    x: &[f32],
    k: usize,
    panels: [&[T]; NP],
    acc_out: &mut [[f32; 2 * PANEL]; MR],
) {
    let mut acc = [[[0f32; PANEL]; NP]; MR];
    for c in 0..k {
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let b = x[c * MR + i];
            for (a, p) in acc_i.iter_mut().zip(&panels) {
                let w = &p[c * PANEL..(c + 1) * PANEL];
                for l in 0..PANEL {
                    a[l] = b.mul_add(w[l].to_f32(), a[l]);
                }
            }
        }
    }
    for (out, a) in acc_out.iter_mut().zip(&acc) {
        for (j, aj) in a.iter().enumerate() {
            out[j * PANEL..(j + 1) * PANEL].copy_from_slice(aj);
        }
    }
}

/// One register tile of `mr` rows (1..=max_rows) and `NP` panels on `isa`; `x` is the
/// tile's rows packed column by column (`pack_rows`).
#[allow(clippy::too_many_arguments)]
fn tile<T: TileElem, const NP: usize>(
    isa: Isa,
    mr: usize,
    x: &[f32],
    k: usize,
    panels: [&[T]; NP],
    acc: &mut [[f32; 2 * PANEL]; 12],
) {
    assert!(x.len() >= mr * k);
    assert!(panels.iter().all(|p| p.len() >= k * PANEL));
    macro_rules! rows {
        ($f:ident, $($n:literal)*) => {
            match mr {
                $($n => {
                    let a: &mut [[f32; 2 * PANEL]; $n] = (&mut acc[..$n]).try_into().unwrap();
                    $f::<T, $n, NP>(x, k, panels, a)
                })*
                _ => unreachable!("tile of {mr} rows"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            fn run<T: TileElem, const MR: usize, const NP: usize>(
                x: &[f32],
                k: usize,
                panels: [&[T]; NP],
                a: &mut [[f32; 2 * PANEL]; MR],
            ) {
                // SAFETY: the driver only picks an available ISA; the slices bound every
                // access (asserted above).
                unsafe {
                    super::x86::tile_avx512::<T, MR, NP>(
                        x.as_ptr(),
                        k,
                        panels.map(|p| p.as_ptr()),
                        a,
                    )
                }
            }
            rows!(run, 1 2 3 4 5 6 7 8 9 10 11 12)
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            fn run<T: TileElem, const MR: usize, const NP: usize>(
                x: &[f32],
                k: usize,
                panels: [&[T]; NP],
                a: &mut [[f32; 2 * PANEL]; MR],
            ) {
                // SAFETY: as for AVX-512.
                unsafe {
                    super::x86::tile_avx2::<T, MR, NP>(x.as_ptr(), k, panels.map(|p| p.as_ptr()), a)
                }
            }
            rows!(run, 1 2 3)
        }
        _ => rows!(tile_scalar, 1 2 3 4),
    }
}

/// The element types the tiles take: `Elem`, plus the x86 loads where they exist.
#[cfg(target_arch = "x86_64")]
pub(crate) trait TileElem: super::x86::X86Elem {}
#[cfg(target_arch = "x86_64")]
impl<T: super::x86::X86Elem> TileElem for T {}
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait TileElem: Elem {}
#[cfg(not(target_arch = "x86_64"))]
impl<T: Elem> TileElem for T {}

/// What becomes of a tile's sums.
#[derive(Clone, Copy)]
enum Epilogue<'a> {
    /// `out[i][col] = acc + bias[col]`, for the unit's columns below `n`.
    Store { bias: Option<&'a [f32]>, n: usize },
    /// `out[i][col] = silu(gate) · up` of the unit's gate and up panels.
    SiluMul { n: usize },
}

/// The output matrix, written by several threads at disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr {
    ptr: *mut f32,
    ld: usize,
}
// SAFETY: threads write disjoint elements (their own units' columns) and the caller waits
// for all of them before reading.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl Epilogue<'_> {
    /// Writes the tile of `acc` rows `0..mr`, rows `row0..` of `out`, unit `unit`.
    fn finish(
        self,
        isa: Isa,
        acc: &mut [[f32; 2 * PANEL]; 12],
        mr: usize,
        row0: usize,
        unit: usize,
        out: OutPtr,
    ) {
        match self {
            Epilogue::Store { bias, n } => {
                let col0 = unit * 2 * PANEL;
                let cols = (2 * PANEL).min(n - col0);
                for (i, a) in acc.iter().enumerate().take(mr) {
                    // SAFETY: row `row0 + i` < m and columns `col0..col0 + cols` ≤ n
                    // belong to this unit alone.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            out.ptr.add((row0 + i) * out.ld + col0),
                            cols,
                        )
                    };
                    match bias {
                        Some(b) => {
                            for ((d, &s), &bv) in dst.iter_mut().zip(a).zip(&b[col0..]) {
                                *d = s + bv;
                            }
                        }
                        None => dst.copy_from_slice(&a[..cols]),
                    }
                }
            }
            Epilogue::SiluMul { n } => {
                let col0 = unit * PANEL;
                let cols = PANEL.min(n - col0);
                for (i, a) in acc.iter_mut().enumerate().take(mr) {
                    let (gate, up) = a.split_at_mut(PANEL);
                    let mut e = [0f32; PANEL];
                    for (e, &g) in e.iter_mut().zip(gate.iter()) {
                        *e = -g;
                    }
                    exp_in_place(&mut e, isa);
                    // SAFETY: as for `Store`.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            out.ptr.add((row0 + i) * out.ld + col0),
                            cols,
                        )
                    };
                    for (((d, &g), &u), &e) in
                        dst.iter_mut().zip(gate.iter()).zip(up.iter()).zip(&e)
                    {
                        *d = g / (1.0 + e) * u;
                    }
                }
            }
        }
    }
}

/// Rows of `x` per cache block: about 256 KiB of them, whole tiles.
fn block_rows(k: usize, mr: usize) -> usize {
    let rows = (256 * 1024 / (4 * k.max(1))).max(mr);
    rows / mr * mr
}

/// `x` [m, k] cut into tiles of `mr` rows (the last one shorter), each stored column by
/// column (`tile[c·rows + i]`) at `t·mr·k`, so that a tile's `k`-th terms are adjacent.
fn pack_rows<E: Copy + Default + Send + Sync>(
    x: &[f32],
    m: usize,
    k: usize,
    mr: usize,
    pool: &ThreadPool,
    elem: impl Fn(&[f32], usize) -> E + Sync,
) -> Vec<E> {
    let mut out = vec![E::default(); m * k];
    let tiles = m.div_ceil(mr);
    let dst = SendPtr(out.as_mut_ptr());
    let dst = &dst;
    let src_k = x.len() / m.max(1);
    let work = |t0: usize, t1: usize| {
        for t in t0..t1 {
            let rows = mr.min(m - t * mr);
            // SAFETY: tile `t` owns `out[t·mr·k..][..rows·k]`, disjoint from other tiles.
            let tile = unsafe { std::slice::from_raw_parts_mut(dst.0.add(t * mr * k), rows * k) };
            for i in 0..rows {
                let row = &x[(t * mr + i) * src_k..(t * mr + i + 1) * src_k];
                for c in 0..k {
                    tile[c * rows + i] = elem(row, c);
                }
            }
        }
    };
    if m * k < SERIAL_WORK {
        work(0, tiles);
    } else {
        pool.for_ranges(tiles, pool.threads(), work);
    }
    out
}

struct SendPtr<E>(*mut E);
// SAFETY: see `pack_rows`: threads write disjoint tiles.
unsafe impl<E> Send for SendPtr<E> {}
unsafe impl<E> Sync for SendPtr<E> {}

/// `v` rounded to bf16, as f32.
#[inline(always)]
fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// Element `c` of a row as the bf16 kernels see it: rounded to bf16, the columns of each
/// pair swapped (`Bf16Layout::Swapped`), zero past the end.
fn bf16_swapped(row: &[f32], c: usize) -> f32 {
    row.get(c ^ 1).map_or(0.0, |&v| round_bf16(v))
}

/// Columns `2c, 2c + 1` of a row as a bf16 pair (even one in the low half).
fn bf16_pair(row: &[f32], c: usize) -> u32 {
    let b = |i: usize| row.get(i).map_or(0, |&v| bf16::from_f32(v).to_bits()) as u32;
    b(2 * c) | b(2 * c + 1) << 16
}

/// Whether bf16 weights go through `vdpbf16ps` on `isa` (else `Bf16Layout::Swapped`).
pub fn bf16_layout_for(isa: Isa) -> Bf16Layout {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512bf16") {
        return Bf16Layout::Pairs;
    }
    let _ = isa;
    Bf16Layout::Swapped
}

/// Runs `tile_at(row0, rows, unit, acc)` over every register tile of the `m` rows and
/// `units` column units, spread over the pool, and finishes each with `epilogue`.
#[allow(clippy::too_many_arguments)]
fn run_units(
    m: usize,
    k: usize,
    units: usize,
    mr_max: usize,
    epilogue: Epilogue<'_>,
    out: OutPtr,
    pool: &ThreadPool,
    isa: Isa,
    tile_at: impl Fn(usize, usize, usize, &mut [[f32; 2 * PANEL]; 12]) + Sync,
) {
    let mc = block_rows(k, mr_max);
    let work = m * units * 2 * PANEL * k;
    let tasks = if work < SERIAL_WORK {
        1
    } else {
        (pool.threads() * 4).min(units)
    };
    pool.for_ranges(units, tasks, |u0, u1| {
        let mut acc = [[0f32; 2 * PANEL]; 12];
        for r0 in (0..m).step_by(mc) {
            let r1 = (r0 + mc).min(m);
            for u in u0..u1 {
                let mut i = r0;
                while i < r1 {
                    let mr = mr_max.min(r1 - i);
                    tile_at(i, mr, u, &mut acc);
                    epilogue.finish(isa, &mut acc, mr, i, u, out);
                    i += mr;
                }
            }
        }
    });
}

/// The tiles of `w` for `x`, each unit's panels given by `panels_of`.
#[allow(clippy::too_many_arguments)]
fn run(
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    units: usize,
    panels_of: impl Fn(usize) -> (usize, Option<usize>) + Sync,
    epilogue: Epilogue<'_>,
    out: OutPtr,
    pool: &ThreadPool,
    isa: Isa,
) {
    let k = w.width();
    let mr_max = max_rows(isa);
    fn seq_tiles<'a, T: TileElem>(
        isa: Isa,
        xp: &'a [f32],
        k: usize,
        data: &'a [T],
        panels_of: &'a (impl Fn(usize) -> (usize, Option<usize>) + Sync),
    ) -> impl Fn(usize, usize, usize, &mut [[f32; 2 * PANEL]; 12]) + Sync + 'a {
        move |i, mr, u, acc| {
            let panel = |p: usize| &data[p * k * PANEL..(p + 1) * k * PANEL];
            let xs = &xp[i * k..(i + mr) * k];
            match panels_of(u) {
                (p0, Some(p1)) => tile(isa, mr, xs, k, [panel(p0), panel(p1)], acc),
                (p0, None) => tile(isa, mr, xs, k, [panel(p0)], acc),
            }
        }
    }
    match w.data() {
        PackedData::F32(d) => {
            let xp = pack_rows(x, m, k, mr_max, pool, |row, c| row[c]);
            let tiles = seq_tiles(isa, &xp, k, d, &panels_of);
            run_units(m, k, units, mr_max, epilogue, out, pool, isa, tiles)
        }
        PackedData::F16(d) => {
            let xp = pack_rows(x, m, k, mr_max, pool, |row, c| row[c]);
            let tiles = seq_tiles(isa, &xp, k, d, &panels_of);
            run_units(m, k, units, mr_max, epilogue, out, pool, isa, tiles)
        }
        PackedData::BF16(d) => match w.bf16_layout() {
            Bf16Layout::Swapped => {
                let xp = pack_rows(x, m, k, mr_max, pool, bf16_swapped);
                let tiles = seq_tiles(isa, &xp, k, d, &panels_of);
                run_units(m, k, units, mr_max, epilogue, out, pool, isa, tiles)
            }
            Bf16Layout::Pairs => {
                let k2 = k / 2;
                let xp = pack_rows(x, m, k2, mr_max, pool, bf16_pair);
                let tiles = |i: usize, mr: usize, u: usize, acc: &mut [[f32; 2 * PANEL]; 12]| {
                    let panel = |p: usize| &d[p * k * PANEL..(p + 1) * k * PANEL];
                    let xs = &xp[i * k2..(i + mr) * k2];
                    match panels_of(u) {
                        (p0, Some(p1)) => tile_pairs(isa, mr, xs, k2, [panel(p0), panel(p1)], acc),
                        (p0, None) => tile_pairs(isa, mr, xs, k2, [panel(p0)], acc),
                    }
                };
                run_units(m, k, units, mr_max, epilogue, out, pool, isa, tiles)
            }
        },
    }
}

/// A register tile of bf16 pairs through `vdpbf16ps` (`Bf16Layout::Pairs`).
fn tile_pairs<const NP: usize>(
    isa: Isa,
    mr: usize,
    x: &[u32],
    k2: usize,
    panels: [&[bf16]; NP],
    acc: &mut [[f32; 2 * PANEL]; 12],
) {
    assert!(x.len() >= mr * k2);
    assert!(panels.iter().all(|p| p.len() >= k2 * 2 * PANEL));
    assert_eq!(
        bf16_layout_for(isa),
        Bf16Layout::Pairs,
        "vdpbf16ps on {isa:?}"
    );
    #[cfg(target_arch = "x86_64")]
    {
        fn run<const MR: usize, const NP: usize>(
            x: &[u32],
            k2: usize,
            panels: [&[bf16]; NP],
            a: &mut [[f32; 2 * PANEL]; MR],
        ) {
            // SAFETY: AVX-512 BF16 is available (asserted above); the slices bound every
            // access (asserted above).
            unsafe {
                super::x86::tile_avx512_bf16::<MR, NP>(
                    x.as_ptr(),
                    k2,
                    panels.map(|p| p.as_ptr()),
                    a,
                )
            }
        }
        macro_rules! rows {
            ($($n:literal)*) => {
                match mr {
                    $($n => {
                        let a: &mut [[f32; 2 * PANEL]; $n] = (&mut acc[..$n]).try_into().unwrap();
                        run::<$n, NP>(x, k2, panels, a)
                    })*
                    _ => unreachable!("tile of {mr} rows"),
                }
            };
        }
        rows!(1 2 3 4 5 6 7 8 9 10 11 12)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = acc; // `bf16_layout_for` never picks pairs off x86 (asserted above)
}

fn check_isa(isa: Isa) {
    assert!(isa.is_available(), "{isa:?} is not available on this CPU");
}

/// `out = x · Wᵀ + bias`. Shapes: `x` [m, k], `w` [n, k], `bias` [n], `out` [m, n].
pub fn linear(
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    bias: Option<&[f32]>,
    out: &mut [f32],
    pool: &ThreadPool,
    isa: Isa,
) {
    check_isa(isa);
    let (n, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), m * k, "linear: x shape");
    assert_eq!(out.len(), m * n, "linear: out shape");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "linear: bias shape");
    }
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for row in out.chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return;
    }
    let panels = w.panels();
    let units = panels.div_ceil(2);
    let panels_of = |u: usize| (2 * u, (2 * u + 1 < panels).then_some(2 * u + 1));
    let epilogue = Epilogue::Store { bias, n };
    let out = OutPtr {
        ptr: out.as_mut_ptr(),
        ld: n,
    };
    run(x, m, w, units, panels_of, epilogue, out, pool, isa);
}

/// Whether `w` (the fused gate/up weight, [2d, k]) can go through
/// `linear_silu_and_mul`: `d` must be a whole number of panels.
pub fn fuses_silu_and_mul(w: &PackedMatrix) -> bool {
    w.rows().is_multiple_of(2 * PANEL) && w.cols() > 0
}

/// `out = silu(x · Wgᵀ) · (x · Wuᵀ)` where `w` [2d, k] stacks the gate rows over the up
/// rows (the fused gate/up projection); `out` [m, d]. The products are `linear`'s, so
/// this equals `linear` followed by SiLU-and-mul with `math::exp_scalar`.
pub fn linear_silu_and_mul(
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    out: &mut [f32],
    pool: &ThreadPool,
    isa: Isa,
) {
    check_isa(isa);
    assert!(
        fuses_silu_and_mul(w),
        "linear_silu_and_mul: {} rows is not two whole sets of panels",
        w.rows()
    );
    let (d, k) = (w.rows() / 2, w.cols());
    assert_eq!(x.len(), m * k, "linear_silu_and_mul: x shape");
    assert_eq!(out.len(), m * d, "linear_silu_and_mul: out shape");
    if m == 0 {
        return;
    }
    let half = d / PANEL;
    let panels_of = |u: usize| (u, Some(u + half));
    let epilogue = Epilogue::SiluMul { n: d };
    let out = OutPtr {
        ptr: out.as_mut_ptr(),
        ld: d,
    };
    run(x, m, w, half, panels_of, epilogue, out, pool, isa);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The definition: one fused multiply-add chain per element, in increasing `c`; for
    /// bf16 weights, `x` rounded to bf16 and each pair of columns taken odd one first.
    fn naive(
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        (m, k, n): (usize, usize, usize),
        bf16_inputs: bool,
    ) -> Vec<f32> {
        let order: Vec<usize> = if bf16_inputs {
            (0..k + k % 2).map(|c| c ^ 1).collect()
        } else {
            (0..k).collect()
        };
        let xv = |i: usize, c: usize| match (c < k, bf16_inputs) {
            (false, _) => 0.0,
            (true, true) => round_bf16(x[i * k + c]),
            (true, false) => x[i * k + c],
        };
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for &c in &order {
                    let wv = if c < k { w[j * k + c] } else { 0.0 };
                    acc = xv(i, c).mul_add(wv, acc);
                }
                out[i * n + j] = acc + bias.map_or(0.0, |b| b[j]);
            }
        }
        out
    }

    fn pack(w: &[f32], n: usize, k: usize, dtype: DType, isa: Isa) -> PackedMatrix {
        let layout = bf16_layout_for(isa);
        PackedMatrix::from_le_bytes(&DType::F32.encode(w), DType::F32, dtype, n, k, layout)
    }

    #[test]
    fn every_isa_and_shape_equals_the_naive_chain_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(7);
        let pools = [ThreadPool::new(1), ThreadPool::new(3)];
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 7, 5),
            (2, 33, 17),
            (3, 64, 48),
            (17, 100, 70),
            (1, 576, 960),
            (13, 19, 33),
            (40, 45, 130),
        ] {
            let x = random(&mut rng, m * k);
            let w = random(&mut rng, n * k);
            let b = random(&mut rng, n);
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                for bias in [None, Some(b.as_slice())] {
                    for isa in Isa::available() {
                        let packed = pack(&w, n, k, dtype, isa);
                        let wr = packed.to_f32();
                        let want = naive(&x, &wr, bias, (m, k, n), dtype == DType::BF16);
                        for pool in &pools {
                            let mut out = vec![f32::NAN; m * n];
                            linear(&x, m, &packed, bias, &mut out, pool, isa);
                            assert!(
                                out.iter()
                                    .zip(&want)
                                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                                "m={m} k={k} n={n} {dtype:?} {isa:?} {:?} bias={} threads={}",
                                packed.bf16_layout(),
                                bias.is_some(),
                                pool.threads()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn close_to_the_reference_gemm() {
        let mut rng = StdRng::seed_from_u64(11);
        let (m, k, n) = (9, 300, 70);
        let x = random(&mut rng, m * k);
        let w = random(&mut rng, n * k);
        let mut want = vec![0f32; m * n];
        crate::cpu::linear(&x, &w, None, m, k, n, &mut want);
        let mut got = vec![0f32; m * n];
        let pool = ThreadPool::new(2);
        linear(
            &x,
            m,
            &PackedMatrix::from_f32(&w, n, k),
            None,
            &mut got,
            &pool,
            Isa::detect(),
        );
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn fused_silu_and_mul_equals_linear_then_silu() {
        let mut rng = StdRng::seed_from_u64(3);
        let pool = ThreadPool::new(2);
        for &(m, k, d) in &[(1, 20, 16), (3, 64, 48), (17, 33, 32), (1, 576, 1536)] {
            let x = random(&mut rng, m * k);
            let w: Vec<f32> = random(&mut rng, 2 * d * k)
                .iter()
                .map(|v| v * 4.0)
                .collect();
            let packed = PackedMatrix::from_f32(&w, 2 * d, k);
            let mut gate_up = vec![0f32; m * 2 * d];
            linear(&x, m, &packed, None, &mut gate_up, &pool, Isa::Scalar);
            let want: Vec<f32> = gate_up
                .chunks_exact(2 * d)
                .flat_map(|r| {
                    let (g, u) = r.split_at(d);
                    g.iter()
                        .zip(u)
                        .map(|(&g, &u)| g / (1.0 + super::super::math::exp_scalar(-g)) * u)
                        .collect::<Vec<_>>()
                })
                .collect();
            // And close to the reference kernel's libm exp.
            let mut reference = vec![0f32; m * d];
            crate::cpu::silu_and_mul(&gate_up, d, &mut reference);
            for (a, b) in want.iter().zip(&reference) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
            }
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; m * d];
                linear_silu_and_mul(&x, m, &packed, &mut out, &pool, isa);
                assert_eq!(out, want, "m={m} k={k} d={d} {isa:?}");
            }
        }
    }

    #[test]
    fn a_row_is_the_same_alone_and_in_a_batch() {
        let mut rng = StdRng::seed_from_u64(5);
        let (m, k, n) = (29, 96, 200);
        let x = random(&mut rng, m * k);
        let w = PackedMatrix::from_f32(&random(&mut rng, n * k), n, k);
        let pool = ThreadPool::new(2);
        let isa = Isa::detect();
        let mut all = vec![0f32; m * n];
        linear(&x, m, &w, None, &mut all, &pool, isa);
        for r in 0..m {
            let mut one = vec![0f32; n];
            linear(&x[r * k..(r + 1) * k], 1, &w, None, &mut one, &pool, isa);
            assert_eq!(one, all[r * n..(r + 1) * n]);
        }
    }
}
