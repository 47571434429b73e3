//! GEMMs of decode batches by our own warpgroup tensor-core kernel (`csrc/thin_gemm.cu`,
//! sm_90a): `out [m, n] = x [m, k] · w [n, k]ᵀ` for 1 to `THIN_GEMM_MAX_M` rows, and the
//! gate/up product fused with SiLU-and-mul (the model's products of 2 rows and more; gemv
//! takes one). At these rows a GEMM is a stream of the
//! weights, and what decides is whether every SM streams: the kernel splits k until the
//! grid fills the GPU, a tile's splits one thread-block cluster that sums its partials in
//! shared memory in a fixed order (so a graph replay gives the bits of the eager run).

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig};

use super::device::driver_error;
use super::launch::{ByValue, KernelLaunch};
use super::ops::{i32_of, CudaOps};

/// The most rows of x the kernel takes: from 64 rows up cuBLAS is faster (docs/BENCHMARKS.md,
/// "Decode GEMMs on warpgroup tensor cores").
pub const THIN_GEMM_MAX_M: usize = 32;
/// Rows of x a block takes (the batch, padded), one kernel each (`thin_gemm_m{BM}`),
/// smallest first.
pub const THIN_GEMM_BLOCK_ROWS: [usize; 2] = [16, 32];
/// Columns of out a block takes (`TG_BN`), and the k of one pipeline stage (`TG_BK`).
const TG_BN: usize = 64;
const TG_BK: usize = 64;
/// Pipeline depth (`TG_STAGES`) and threads of a block (`TG_THREADS`: one warpgroup).
const TG_STAGES: usize = 6;
const TG_THREADS: u32 = 128;
/// The most splits of k: a tile's splits are one cluster (`TG_MAX_SPLITS`).
const TG_MAX_SPLITS: usize = 8;
/// Each split takes at least this many k-tiles: fewer leave the pipeline empty.
const MIN_K_TILES_PER_SPLIT: usize = 2;
/// The most n-tiles: they are the grid's y, which CUDA caps at 65,535 blocks.
const MAX_N_TILES: usize = 65_535;

/// Whether the grid can hold n's tiles (n up to about 4.2 million).
fn n_fits(n: usize) -> bool {
    n.div_ceil(TG_BN) <= MAX_N_TILES
}

/// `ThinGemmArgs` of thin_gemm.cu, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ThinGemmArgs {
    x: u64,
    w: u64,
    out: u64,
    m: i32,
    k: i32,
    n: i32,
    k_tiles_per_split: i32,
}
// SAFETY: repr(C) plain data matching the CUDA struct (8-byte pointers first).
unsafe impl ByValue for ThinGemmArgs {}

/// Shared memory of a block of `bm` rows: the pipeline's stages (the finished tile reuses
/// it), and 1 KB to align them for the swizzle.
fn smem_bytes(bm: usize) -> usize {
    let stages = TG_STAGES * (TG_BN + bm) * TG_BK * 2;
    let tile = bm * (TG_BN + 4) * 4;
    stages.max(tile) + 1024
}

/// The kernels of one dtype's module (bf16 and fp16 only).
pub struct ThinGemmKernels {
    /// `thin_gemm_m{BM}`, then `thin_gemm_silu_m{BM}`, by `THIN_GEMM_BLOCK_ROWS`.
    plain: [CudaFunction; 2],
    silu: [CudaFunction; 2],
}

impl ThinGemmKernels {
    /// Raises each kernel's shared-memory limit to what it asks for.
    pub fn new(plain: [CudaFunction; 2], silu: [CudaFunction; 2]) -> Result<Self> {
        for (i, bm) in THIN_GEMM_BLOCK_ROWS.into_iter().enumerate() {
            for f in [&plain[i], &silu[i]] {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_bytes(bm) as i32,
                )
                .map_err(|e| driver_error("raising thin_gemm's shared memory", e))?;
            }
        }
        Ok(Self { plain, silu })
    }
}

/// How one product is cut: rows of x a block (all of them), the grid, and the k-tiles of
/// each split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinGemmPlan {
    pub block_rows: usize,
    pub n_tiles: usize,
    pub splits: usize,
    pub k_tiles_per_split: usize,
}

impl ThinGemmPlan {
    /// The plan for (m ≤ `THIN_GEMM_MAX_M`, k, n) on `num_sms` SMs: the smallest block
    /// that holds m rows, and splits of k until the grid has two blocks an SM,
    /// as far as `TG_MAX_SPLITS` and `MIN_K_TILES_PER_SPLIT` allow. `splits` overrides the
    /// choice (the benchmark), within the same limits.
    pub fn new((m, k, n): (usize, usize, usize), num_sms: usize, splits: Option<usize>) -> Self {
        let block_rows = THIN_GEMM_BLOCK_ROWS
            .into_iter()
            .find(|&bm| bm >= m)
            .unwrap_or(THIN_GEMM_MAX_M);
        let n_tiles = n.div_ceil(TG_BN);
        let k_tiles = k.div_ceil(TG_BK);
        // Two blocks an SM (three fit): more splits cost more of the cluster's sums.
        let wanted = splits.unwrap_or_else(|| (2 * num_sms).div_ceil(n_tiles));
        let max_splits = (k_tiles / MIN_K_TILES_PER_SPLIT).min(TG_MAX_SPLITS);
        let k_tiles_per_split = k_tiles.div_ceil(wanted.clamp(1, max_splits.max(1)));
        Self {
            block_rows,
            n_tiles,
            splits: k_tiles.div_ceil(k_tiles_per_split),
            k_tiles_per_split,
        }
    }
}

impl CudaOps {
    /// Whether this module has the kernels (Hopper, 16-bit dtypes).
    pub fn has_thin_gemm(&self) -> bool {
        self.thin_gemm.is_some()
    }

    /// Whether `thin_gemm` takes this product: a 16-bit dtype, 1 to `THIN_GEMM_MAX_M` rows,
    /// k in whole 16-byte chunks, an even n whose tiles the grid holds, and 16-byte
    /// aligned buffers.
    pub fn thin_gemm_fits(&self, bufs: [&CudaSlice<u8>; 3], m: usize, k: usize, n: usize) -> bool {
        self.has_thin_gemm()
            && (1..=THIN_GEMM_MAX_M).contains(&m)
            && k.is_multiple_of(8)
            && n.is_multiple_of(2)
            && n_fits(n)
            && self.aligned16(&bufs)
    }

    /// `out [m, n] = x [m, k] · w [n, k]ᵀ` for a product `thin_gemm_fits` takes.
    pub fn thin_gemm(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (m, k, n): (usize, usize, usize),
        splits: Option<usize>,
    ) -> Result<()> {
        self.check(out, m * n, "thin_gemm out")?;
        self.thin_gemm_launch(x, w, out, (m, k, n), false, splits)
    }

    /// `out [m, d] = silu(x · w[..d]ᵀ) * (x · w[d..]ᵀ)` for the fused gate/up weight
    /// `w [2d, k]`: bit for bit `thin_gemm` then `silu_and_mul`, in one launch. d must be
    /// even (a thread writes a pair of columns).
    pub fn thin_gemm_silu_mul(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (m, k, d): (usize, usize, usize),
        splits: Option<usize>,
    ) -> Result<()> {
        ensure!(d.is_multiple_of(2), "thin_gemm_silu_mul: odd d = {d}");
        self.check(out, m * d, "thin_gemm_silu_mul out")?;
        self.thin_gemm_launch(x, w, out, (m, k, 2 * d), true, splits)
    }

    fn thin_gemm_launch(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &CudaSlice<u8>,
        (m, k, n): (usize, usize, usize),
        silu: bool,
        splits: Option<usize>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let kernels = (self.thin_gemm.as_ref())
            .ok_or_else(|| anyhow!("thin_gemm: no kernel in the {} module", self.dtype.name()))?;
        ensure!(
            self.thin_gemm_fits([x, w, out], m, k, n),
            "thin_gemm: [{m}x{k}]·[{n}x{k}]ᵀ is not a product it takes"
        );
        self.check(x, m * k, "thin_gemm x")?;
        self.check(w, n * k, "thin_gemm w")?;
        let plan = ThinGemmPlan::new((m, k, n), self.num_sms, splits);
        let b = THIN_GEMM_BLOCK_ROWS
            .iter()
            .position(|&bm| bm == plan.block_rows)
            .unwrap_or(0);
        let args = ThinGemmArgs {
            x: x.device_ptr(&self.stream).0,
            w: w.device_ptr(&self.stream).0,
            out: out.device_ptr(&self.stream).0,
            m: i32_of(m, "m")?,
            k: i32_of(k, "k")?,
            n: i32_of(n, "n")?,
            k_tiles_per_split: i32_of(plan.k_tiles_per_split, "k tiles")?,
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.splits as u32, plan.n_tiles as u32, 1),
            block_dim: (TG_THREADS, 1, 1),
            shared_mem_bytes: smem_bytes(plan.block_rows) as u32,
        };
        let func = if silu {
            &kernels.silu[b]
        } else {
            &kernels.plain[b]
        };
        let mut kernel = KernelLaunch::new(&self.stream, func);
        kernel.arg(&args);
        // SAFETY: sizes and alignment checked above (`thin_gemm_fits`, `check`); the plan
        // keeps the splits within `TG_MAX_SPLITS`, a cluster the kernel allows; the kernel
        // reads x [m, k] and w [n, k] and writes out [m, n] (or [m, n / 2] with SiLU).
        unsafe { kernel.launch_in_clusters(cfg, self.pdl, plan.splits as u32) }
            .map_err(|e| driver_error("launching thin_gemm", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_fill_the_gpu_within_a_cluster() {
        // Qwen3-0.6B's o_proj at 16 rows: 16 n-tiles, 32 k-tiles.
        let p = ThinGemmPlan::new((16, 2048, 1024), 132, None);
        assert_eq!((p.block_rows, p.n_tiles), (16, 16));
        assert!(p.splits > 1 && p.splits * p.k_tiles_per_split >= 32);
        assert!(p.k_tiles_per_split >= MIN_K_TILES_PER_SPLIT);
        // Every split has k-tiles of its own.
        assert!((p.splits - 1) * p.k_tiles_per_split < 32);
        // 17 rows: the block of 32.
        let p = ThinGemmPlan::new((17, 1024, 6144), 132, None);
        assert_eq!((p.block_rows, p.n_tiles), (32, 96));
        // A tile's splits are one cluster: at most 8.
        let p = ThinGemmPlan::new((2, 3072, 1024), 132, Some(64));
        assert_eq!(p.splits, TG_MAX_SPLITS);
        // Forced splits are kept within k.
        let p = ThinGemmPlan::new((8, 128, 64), 132, Some(64));
        assert_eq!((p.splits, p.k_tiles_per_split), (1, 2));
        let p = ThinGemmPlan::new((3, 1024, 64), 132, Some(3));
        assert_eq!((p.splits, p.k_tiles_per_split), (3, 6));
    }

    #[test]
    fn the_grid_holds_every_n_tile() {
        assert!(n_fits(151_936 * 8));
        assert!(n_fits(MAX_N_TILES * TG_BN));
        assert!(!n_fits(MAX_N_TILES * TG_BN + 2));
    }

    #[test]
    fn every_block_fits_the_shared_memory() {
        for bm in THIN_GEMM_BLOCK_ROWS {
            assert!(
                smem_bytes(bm) <= 227 << 10,
                "{bm} rows: {} bytes",
                smem_bytes(bm)
            );
        }
    }
}
