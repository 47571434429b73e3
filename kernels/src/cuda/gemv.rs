//! Thin GEMMs by our own kernel (`csrc/gemv.cu`): `out [m, n] = x [m, k] · w [n, k]ᵀ` for
//! the few rows of a decode step, where a GEMM is a stream of the weights and cuBLAS's
//! split-K tiles leave two thirds of the bandwidth unused (docs/BENCHMARKS.md).

use anyhow::{ensure, Result};
use cudarc::driver::CudaSlice;

use super::ops::{i32_of, launch, rows_cfg, CudaOps};

/// The most rows of x the kernel takes; above it, the GEMM has reuse for tensor cores.
pub const GEMV_MAX_M: usize = 8;
/// The most rows of x for which `gemv` beats cuBLAS on an H100 (`thin_gemms`,
/// docs/BENCHMARKS.md "Thin GEMMs"): at one row it is 7–45% faster on every decode
/// shape; at 2 and 4 rows the two tie, and at 8 cuBLAS wins by up to 50%.
pub const GEMV_PAYS_MAX_M: usize = 1;
/// Warps per block (`GEMV_WARPS` of gemv.cu), and their threads.
pub(crate) const GEMV_WARPS: usize = 8;
pub(crate) const GEMV_THREADS: u32 = (GEMV_WARPS * 32) as u32;
/// 16-byte loads a lane has in flight (`GEMV_UNROLL`).
const GEMV_UNROLL: usize = 4;
/// Warps an SM below which a one-row product splits each row over more warps. On four
/// H200s (`cuda_bench tp_rank_gemvs`, docs/BENCHMARKS.md 2026-11-26) the Qwen3-8B's TP=4
/// qkv (1,536 rows, 12 warps an SM) went from 5.6 to 5.4 µs over two warps a row, and its
/// TPOT from 2.05 to 2.02 ms; at 24 its TP=2 qkv (3,072 rows) split too and lost (8.0
/// against 8.7 µs), and at 48 the TPOT lost (2.07).
const GEMV_MIN_WARPS_PER_SM: usize = 16;
/// The span L2 fetches for a prefetch hint (`prefetch_l2`).
const L2_LINE: usize = 128;

/// The lines of each of `rows` rows of `row_bytes` a gemv asks L2 for before its PDL wait,
/// so that about `early_l2` bytes of w in all are asked for (the first lines of every
/// row, the order the kernel reads them in).
fn early_lines(early_l2: usize, rows: usize, row_bytes: usize) -> Result<i32> {
    let lines = (early_l2 / rows.max(1) / L2_LINE).min(row_bytes.div_ceil(L2_LINE));
    i32_of(lines, "early lines")
}

/// Warps each row of a one-row product (`k` elements, `vec` to 16 bytes) is split over: 1,
/// 2 or 4, doubled while the `n` rows leave fewer than `GEMV_MIN_WARPS_PER_SM` warps an SM
/// and each warp keeps at least one whole unrolled step of loads. A rule of the shape and
/// the GPU alone, so that eager steps and CUDA graphs run the same kernel and give the
/// same bits (the gate/up kernels are timed per shape only because all three give the
/// same bits).
fn gemv_k_parts(k: usize, n: usize, vec: usize, num_sms: usize) -> usize {
    let steps = k / (vec * 32 * GEMV_UNROLL);
    let mut parts = 1;
    while parts < 4 && n * parts < GEMV_MIN_WARPS_PER_SM * num_sms && steps >= 2 * parts {
        parts *= 2;
    }
    parts
}

impl CudaOps {
    /// Whether `gemv` takes this product: at most `GEMV_MAX_M` rows, rows of whole 16-byte
    /// chunks, and 16-byte aligned buffers.
    pub fn gemv_fits(&self, bufs: [&CudaSlice<u8>; 3], m: usize, k: usize) -> bool {
        let vec = self.dtype.vec16();
        (1..=GEMV_MAX_M).contains(&m) && k.is_multiple_of(vec) && self.aligned16(&bufs)
    }

    /// What every gemv kernel's launch checks, for x [m, k], w [w_rows, k] and an output
    /// of `out_elems`: a product `gemv_fits` takes, each buffer large enough. Returns k and
    /// the early L2 lines (`early_lines`) as the kernels take them.
    pub(crate) fn gemv_checked(
        &self,
        what: &str,
        [x, w, out]: [&CudaSlice<u8>; 3],
        (m, k, w_rows): (usize, usize, usize),
        out_elems: usize,
        early_l2: usize,
    ) -> Result<(i32, i32)> {
        ensure!(
            self.gemv_fits([x, w, out], m, k),
            "{what}: [{m}x{k}]·[{w_rows}x{k}]ᵀ is not a thin aligned product"
        );
        for (buf, elems, name) in [
            (x, m * k, "x"),
            (w, w_rows * k, "w"),
            (out, out_elems, "out"),
        ] {
            self.check(buf, elems, what)
                .map_err(|e| anyhow::anyhow!("{e} ({name})"))?;
        }
        let early = early_lines(early_l2, w_rows, k * self.dtype.size())?;
        Ok((i32_of(k, "k")?, early))
    }

    /// Warps `gemv` splits each row of w over (`gemv_k_parts`; one row of x only).
    fn gemv_parts(&self, m: usize, k: usize, n: usize) -> usize {
        if m == 1 {
            gemv_k_parts(k, n, self.dtype.vec16(), self.num_sms)
        } else {
            1
        }
    }

    /// Whether `gemv` runs a one-row product of `k` → `n` at one warp a row (`gemv_m1_r1`),
    /// the kernel whose sums `gemv_m1_all_reduce_send` repeats.
    pub(crate) fn gemv_one_warp_a_row(&self, k: usize, n: usize) -> bool {
        k.is_multiple_of(self.dtype.vec16()) && self.gemv_parts(1, k, n) == 1
    }

    /// `out [m, n] = x [m, k] · w [n, k]ᵀ` for a product `gemv_fits` takes. About
    /// `early_l2` bytes of w are asked of L2 before the kernel waits for the one before it
    /// (gemv.cu, `early_lines`; 0 for none).
    pub fn gemv(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (m, k, n): (usize, usize, usize),
        early_l2: usize,
    ) -> Result<()> {
        let parts = self.gemv_parts(m, k, n);
        if parts > 1 {
            return self.gemv_split_k(x, w, out, (k, n), parts, early_l2);
        }
        let rows_per_warp = self.gemv_rows_per_warp(m, n);
        self.gemv_with_rows(x, w, out, (m, k, n), rows_per_warp, early_l2)
    }

    /// `gemv` of one row with each row of w split over `parts` (2 or 4) warps, which sum
    /// their parts in a fixed order (so the bits depend on `parts`; `gemv` picks it by
    /// shape).
    pub fn gemv_split_k(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (k, n): (usize, usize),
        parts: usize,
        early_l2: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let func = match parts {
            2 => &self.f.gemv_split_k[0],
            4 => &self.f.gemv_split_k[1],
            _ => anyhow::bail!("gemv: k split over {parts} warps"),
        };
        let (ki, early) = self.gemv_checked("gemv", [x, w, out], (1, k, n), n, early_l2)?;
        let ni = i32_of(n, "n")?;
        let cfg = rows_cfg(n.div_ceil(GEMV_WARPS / parts), GEMV_THREADS);
        // SAFETY: sizes and alignment checked above; the kernel reads x [1, k] and
        // w [n, k] (its prefetch hints stay within its part of a row) and writes out [1, n].
        launch!(unsafe self, func => "gemv", cfg; x, w, out, &ki, &ni, &early)
    }

    /// Rows of w per warp: two halve the reads of x, which matter from four rows of x on,
    /// as long as the grid still fills the GPU.
    fn gemv_rows_per_warp(&self, m: usize, n: usize) -> usize {
        let blocks_of_two = n.div_ceil(2 * GEMV_WARPS);
        if m >= 4 && blocks_of_two >= 2 * self.num_sms {
            2
        } else {
            1
        }
    }

    /// `out [1, d] = silu(x · w[..d]ᵀ) * (x · w[d..]ᵀ)` for one row of x and the fused
    /// gate/up weight `w [2d, k]`: bit for bit `gemv_with_rows` at a row a warp, then
    /// `silu_and_mul`, in one launch.
    /// An output's gate and up rows are streamed by one warp, or by two (`split`); which
    /// is faster depends on the shape (the caller times them). `early_l2` as for `gemv`.
    pub fn gemv_silu_mul(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (k, d): (usize, usize),
        split: bool,
        early_l2: usize,
    ) -> Result<()> {
        if d == 0 {
            return Ok(());
        }
        let (ki, early) =
            self.gemv_checked("gemv_silu_mul", [x, w, out], (1, k, 2 * d), d, early_l2)?;
        let di = i32_of(d, "d")?;
        let (func, outputs_per_block) = if split {
            (&self.f.gemv_silu_mul_split_m1, GEMV_WARPS / 2)
        } else {
            (&self.f.gemv_silu_mul_m1, GEMV_WARPS)
        };
        let cfg = rows_cfg(d.div_ceil(outputs_per_block), GEMV_THREADS);
        // SAFETY: sizes and alignment checked above; the kernel reads x [1, k] and
        // w [2d, k] (its prefetch hints stay within a row) and writes out [1, d].
        launch!(unsafe self, func => "gemv_silu_mul", cfg;
            x, w, out, &ki, &di, &early)
    }

    /// `gemv` with the rows of w per warp chosen by the caller (1 or 2; the benchmark).
    pub fn gemv_with_rows(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (m, k, n): (usize, usize, usize),
        rows_per_warp: usize,
        early_l2: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        ensure!(
            (1..=2).contains(&rows_per_warp),
            "gemv: {rows_per_warp} rows per warp"
        );
        let (ki, early) = self.gemv_checked("gemv", [x, w, out], (m, k, n), m * n, early_l2)?;
        let ni = i32_of(n, "n")?;
        let rows_per_block = GEMV_WARPS * rows_per_warp;
        let cfg = rows_cfg(n.div_ceil(rows_per_block), GEMV_THREADS);
        // SAFETY: sizes and alignment checked above; the kernel reads x [m, k] and
        // w [n, k] (its prefetch hints stay within a row) and writes out [m, n].
        launch!(unsafe self, &self.f.gemv[m - 1][rows_per_warp - 1] => "gemv", cfg;
            x, w, out, &ki, &ni, &early)
    }
}

#[cfg(test)]
mod tests {
    use super::gemv_k_parts;

    #[test]
    fn only_products_of_few_long_rows_split_their_rows() {
        // bf16 on 132 SMs: Qwen3-8B's TP=4 qkv (1,536 rows) over two warps a row; its TP=2
        // qkv (3,072 rows) and the 70B's TP=4 qkv (2,560) keep one.
        assert_eq!(gemv_k_parts(4096, 1536, 8, 132), 2);
        assert_eq!(gemv_k_parts(4096, 3072, 8, 132), 1);
        assert_eq!(gemv_k_parts(8192, 2560, 8, 132), 1);
        // Qwen3-0.6B's o and down (1,024 rows): rows of two unrolled steps split in two.
        assert_eq!(gemv_k_parts(2048, 1024, 8, 132), 2);
        assert_eq!(gemv_k_parts(3072, 1024, 8, 132), 2);
        // Few rows but short ones (one step a warp) and very few long ones.
        assert_eq!(gemv_k_parts(1024, 1024, 8, 132), 1);
        assert_eq!(gemv_k_parts(8192, 256, 8, 132), 4);
        // f32 rows of as many elements take twice the steps: four warps a row.
        assert_eq!(gemv_k_parts(2048, 1024, 4, 132), 4);
    }
}
