//! GEMMs through cuBLAS: `y = x · Wᵀ` with weights in PyTorch's [out, in] layout, inputs
//! and output in the activation dtype, accumulation in f32 (`CUBLAS_COMPUTE_32F`; for f32
//! data no TF32, so the f32 build matches the CPU reference closely). In bf16 and f16 the
//! shapes met while `tuning` (the CUDA graphs' warm-up runs) get the fastest cuBLASLt
//! algorithm for them (lt_matmul.rs); every other shape runs cuBLAS's default. Products
//! run at `padded_rows` (a few row counts), whose prefill kernels `warming` loads at
//! start-up.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, ensure, Result};
use cudarc::cublas::{result as cr, sys as cs, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::attention_plan::decode_bucket;
use super::cache;
use super::dtype::DType;
use super::gemm_choices::Mkn;
use super::lt_matmul::{Beta, LtMatmul, Operands, TuningCounts};

pub struct Gemm {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    dtype: DType,
    /// Tuned cuBLASLt algorithms; None in f32 (kept on cuBLAS's exact-f32 default).
    lt: Option<LtMatmul>,
    /// While set, a shape without a tuned algorithm is tuned on first use.
    tuning: AtomicBool,
    /// While set, a product of prefill rows first runs at every smaller prefill row count,
    /// once a (k, n, β) (`warming`).
    warming: AtomicBool,
    warmed: Mutex<HashSet<(usize, usize, Beta)>>,
    /// cuBLAS's workspace, ours for the handle's lifetime: a GEMM captured into a CUDA
    /// graph must not allocate (cuBLAS asks for 32 MiB on Hopper).
    _workspace: CudaSlice<u8>,
}

const WORKSPACE_BYTES: usize = 32 << 20;

/// The rows cuBLAS runs for a product of `m` rows where its buffers hold them (the rows
/// past m are never read): from 33 rows to `DECODE_ROWS`, the decode graphs' batch size
/// (`decode_bucket`: multiples of 8); past them, m rounded up to a multiple of a sixteenth
/// of its power of two, so at most 6 % more rows and 16 row counts an octave. cuBLAS loads
/// a kernel the first time it takes it, and which one it takes depends finely on m: the
/// first prefill of an unseen row count (nanovllm-256's last, 5,813 rows) held the host
/// for 25-30 ms, a whole step (docs/BENCHMARKS.md, "A prefill step that stalls the
/// host"). Rounded, an eager step runs only row counts the start-up ran: the graphs' up
/// to 256, and `Gemm::warming` the rest.
pub fn padded_rows(m: usize) -> usize {
    match m {
        0..=32 => m, // our own GEMMs' rows on Hopper (gemv, thin_gemm)
        33..=DECODE_ROWS => decode_bucket(m),
        _ => m.next_multiple_of(1 << (m.ilog2() - 4)),
    }
}

/// The rows up to which products are rounded to the decode graphs' batch sizes (the
/// default `--max-num-seqs`); products of more are a prefill's, which `warming` covers.
const DECODE_ROWS: usize = 256;

/// `padded_rows`' values between a decode batch and `up_to`, rising.
fn prefill_row_counts(up_to: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(padded_rows(DECODE_ROWS + 1)), |&m| {
        Some(padded_rows(m + 1))
    })
    .take_while(move |&m| m <= up_to)
}

/// Runs `f` with `flag` set (`Gemm::tuning`, `Gemm::warming`).
fn while_set<R>(flag: &AtomicBool, f: impl FnOnce() -> R) -> R {
    flag.store(true, Ordering::Relaxed);
    let r = f();
    flag.store(false, Ordering::Relaxed);
    r
}

fn data_type(dtype: DType) -> cs::cudaDataType {
    match dtype {
        DType::BF16 => cs::cudaDataType::CUDA_R_16BF,
        DType::F16 => cs::cudaDataType::CUDA_R_16F,
        DType::F32 => cs::cudaDataType::CUDA_R_32F,
    }
}

impl Gemm {
    /// A GEMM whose tuned choices are recorded beside the kernel cache (`cache::cache_dir`).
    pub fn new(stream: Arc<CudaStream>, dtype: DType) -> Result<Self> {
        Self::with_choices_in(stream, dtype, &cache::cache_dir())
    }

    /// A GEMM whose tuned choices are recorded in `dir`.
    pub fn with_choices_in(stream: Arc<CudaStream>, dtype: DType, dir: &Path) -> Result<Self> {
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| anyhow!("cuBLAS: creating a handle failed: {e:?}"))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| anyhow!("allocating the cuBLAS workspace failed: {e:?}"))?;
        {
            let (p, _g) = workspace.device_ptr(&stream);
            // SAFETY: a live buffer of WORKSPACE_BYTES on the handle's stream, kept as
            // long as the handle (both are fields of `Gemm`).
            unsafe { cs::cublasSetWorkspace_v2(*blas.handle(), p as *mut _, WORKSPACE_BYTES) }
                .result()
                .map_err(|e| anyhow!("cuBLAS: setting the workspace failed: {e:?}"))?;
        }
        let lt = match dtype {
            DType::F32 => None,
            DType::BF16 | DType::F16 => {
                let (p, _g) = workspace.device_ptr(&stream);
                let workspace = (p, WORKSPACE_BYTES);
                Some(LtMatmul::new(stream.clone(), dtype, workspace, dir)?)
            }
        };
        Ok(Self {
            blas,
            stream,
            dtype,
            lt,
            tuning: AtomicBool::new(false),
            warming: AtomicBool::new(false),
            warmed: Mutex::new(HashSet::new()),
            _workspace: workspace,
        })
    }

    /// Runs `f` with tuning on: each new shape `linear` meets takes its choice from the
    /// record on disk, or else is timed against the heuristic's cuBLASLt algorithms (which
    /// synchronises the stream: not while capturing a graph). New choices are saved after.
    pub fn tuning<R>(&self, f: impl FnOnce() -> R) -> R {
        let r = while_set(&self.tuning, f);
        if let Some(lt) = &self.lt {
            lt.save();
        }
        r
    }

    /// Runs `f` (the start-up's worst-case step, whose products have the most rows a step
    /// can have) with warming on: the first product of each (k, n, β) with more rows than a
    /// decode step first runs at each smaller row count of `padded_rows`, on its own
    /// operands, so that cuBLAS loads every kernel a prefill can take now rather than in
    /// the middle of serving. The product itself runs last, so `f`'s results stand.
    pub fn warming<R>(&self, f: impl FnOnce() -> R) -> R {
        while_set(&self.warming, f)
    }

    /// Whether `tuning` is running (the caller's own timed choices may be made too).
    pub fn is_tuning(&self) -> bool {
        self.tuning.load(Ordering::Relaxed)
    }

    /// The tuned cuBLASLt GEMMs (None in f32), for benches that survey their algorithms.
    pub fn lt(&self) -> Option<&LtMatmul> {
        self.lt.as_ref()
    }

    pub fn tuning_counts(&self) -> TuningCounts {
        self.lt
            .as_ref()
            .map_or_else(TuningCounts::default, LtMatmul::counts)
    }

    /// out [m, n] = x [m, k] · w [n, k]ᵀ.
    pub fn linear(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        self.product(x, w, out, (m, k, n), Beta::Zero)
    }

    /// out [m, n] += x [m, k] · w [n, k]ᵀ, in the GEMM's epilogue (cuBLAS's β = 1, in
    /// place): a residual add without a kernel of its own. A shape not yet tuned is tuned
    /// as the plain product into a scratch output, since each timed run would add into
    /// `out` again.
    pub fn linear_add(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<()> {
        let rows = self.run_rows(x, out, (m, k, n));
        let untuned = self
            .lt
            .as_ref()
            .is_some_and(|lt| !lt.is_tuned((rows, k, n)));
        if self.is_tuning() && untuned && m * n > 0 {
            let mut scratch = self
                .stream
                .alloc_zeros::<u8>(rows * n * self.dtype.size())
                .map_err(|e| anyhow!("a scratch output to tune [{rows}, {k}, {n}]: {e:?}"))?;
            self.linear(x, w, &mut scratch, rows, k, n)?;
        }
        self.product(x, w, out, (m, k, n), Beta::One)
    }

    fn product(
        &self,
        x: &CudaSlice<u8>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<u8>,
        (m, k, n): Mkn,
        beta: Beta,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let m = self.run_rows(x, out, (m, k, n));
        let es = self.dtype.size();
        ensure!(
            x.len() >= m * k * es,
            "linear: x holds {} bytes for [{m}, {k}]",
            x.len()
        );
        ensure!(
            w.len() >= n * k * es,
            "linear: w holds {} bytes for [{n}, {k}]",
            w.len()
        );
        ensure!(
            out.len() >= m * n * es,
            "linear: out holds {} bytes for [{m}, {n}]",
            out.len()
        );
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr(&self.stream);
        let ops = Operands {
            x: xp,
            w: wp,
            y: op,
        };
        if self.warms((m, k, n), beta)? {
            for rows in prefill_row_counts(m).filter(|&r| r < m) {
                self.dispatch(ops, (rows, k, n), beta)?;
            }
        }
        self.dispatch(ops, (m, k, n), beta)
    }

    /// The rows a product of (m, k, n) runs: `padded_rows(m)` where x and out hold them.
    fn run_rows(&self, x: &CudaSlice<u8>, out: &CudaSlice<u8>, (m, k, n): Mkn) -> usize {
        let (padded, es) = (padded_rows(m), self.dtype.size());
        if x.len() >= padded * k * es && out.len() >= padded * n * es {
            padded
        } else {
            m
        }
    }

    /// Whether this product is the first of its (k, n, β) at prefill rows while warming.
    fn warms(&self, (m, k, n): Mkn, beta: Beta) -> Result<bool> {
        if m <= DECODE_ROWS || !self.warming.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let mut warmed =
            (self.warmed.lock()).map_err(|_| anyhow!("a panic held the GEMM's warmed shapes"))?;
        Ok(warmed.insert((k, n, beta)))
    }

    /// The product on operands whose sizes `product` checked: the tuned cuBLASLt algorithm
    /// where the shape has one, else cuBLAS's default.
    fn dispatch(&self, ops: Operands, (m, k, n): Mkn, beta: Beta) -> Result<()> {
        let dims = |v: usize| {
            i32::try_from(v).map_err(|_| anyhow!("linear: dimension {v} exceeds cuBLAS's i32"))
        };
        let (mi, ki, ni) = (dims(m)?, dims(k)?, dims(n)?);
        let ptrs = (ops.x, ops.w, ops.y);
        let Some(lt) = &self.lt else {
            return self.gemm_ex(ptrs, (mi, ki, ni), beta);
        };
        let mkn = (m, k, n);
        if self.is_tuning() && !lt.is_tuned(mkn) {
            // `linear_add` tunes through `linear` first, so β is 0 here.
            let mut baseline = || self.gemm_ex(ptrs, (mi, ki, ni), Beta::Zero);
            lt.tune(mkn, ops, &mut baseline)?;
        }
        if lt.run(mkn, ops, beta)? {
            return Ok(());
        }
        self.gemm_ex(ptrs, (mi, ki, ni), beta)
    }

    /// cuBLAS's default GEMM on device pointers (x, w, out) of sizes checked by `product`.
    fn gemm_ex(
        &self,
        (xp, wp, op): (u64, u64, u64),
        (mi, ki, ni): (i32, i32, i32),
        beta: Beta,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, beta.value());
        let t = data_type(self.dtype);
        // Row-major y[m,n] is column-major yᵀ[n,m] = W[n,k] · xᵀ[k,m]: W is stored as
        // column-major [k, n] (transpose it), x as column-major [k, m].
        // SAFETY: buffer sizes checked above; all pointers are on our stream's device.
        unsafe {
            cr::gemm_ex(
                *self.blas.handle(),
                cs::cublasOperation_t::CUBLAS_OP_T,
                cs::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                &alpha as *const f32 as *const _,
                wp as *const _,
                t,
                ki,
                xp as *const _,
                t,
                ki,
                &beta as *const f32 as *const _,
                op as *mut _,
                t,
                ni,
                cs::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cuBLAS: gemm [{mi}x{ki}]·[{ni}x{ki}]ᵀ failed: {e:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eager_rows_round_to_the_decode_graphs_batches_and_to_few_prefill_counts() {
        // Our own GEMMs' rows stay as they are; 33-256 become a graph's batch size.
        assert_eq!(
            (1..=32).map(padded_rows).collect::<Vec<_>>(),
            (1..=32).collect::<Vec<_>>()
        );
        assert_eq!(
            [33, 40, 41, 255, 256].map(padded_rows),
            [40, 40, 48, 256, 256]
        );
        // Past a decode batch, 16 counts an octave, each at most 1/16 over the rows asked.
        let counts: Vec<usize> = prefill_row_counts(8192).collect();
        assert_eq!(counts.len(), 80);
        assert_eq!(counts[..3], [272, 288, 304]);
        assert_eq!(counts[14..18], [496, 512, 544, 576]);
        assert_eq!(counts.last(), Some(&8192));
        for m in 1..=20_000 {
            let p = padded_rows(m);
            assert!(p >= m && p - m < (m / 16).max(8), "{m} -> {p}");
            assert_eq!(padded_rows(p), p, "{m} -> {p} is not a fixed point");
            if (DECODE_ROWS + 1..=8192).contains(&m) {
                assert!(
                    counts.contains(&p),
                    "{m} -> {p}, which warming does not run"
                );
            }
        }
        assert_eq!(prefill_row_counts(9000).last(), Some(8704));
        assert_eq!(prefill_row_counts(256).count(), 0);
    }
}
