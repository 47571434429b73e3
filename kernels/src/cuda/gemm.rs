//! GEMMs through cuBLAS: `y = x · Wᵀ` with weights in PyTorch's [out, in] layout, inputs
//! and output in the activation dtype, accumulation in f32 (`CUBLAS_COMPUTE_32F`; for f32
//! data no TF32, so the f32 build matches the CPU reference closely). In bf16 and f16 the
//! shapes met while `tuning` (the CUDA graphs' warm-up runs) get the fastest cuBLASLt
//! algorithm for them (lt_matmul.rs); every other shape runs cuBLAS's default.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{anyhow, ensure, Result};
use cudarc::cublas::{result as cr, sys as cs, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

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
    /// cuBLAS's workspace, ours for the handle's lifetime: a GEMM captured into a CUDA
    /// graph must not allocate (cuBLAS asks for 32 MiB on Hopper).
    _workspace: CudaSlice<u8>,
}

const WORKSPACE_BYTES: usize = 32 << 20;

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
            _workspace: workspace,
        })
    }

    /// Runs `f` with tuning on: each new shape `linear` meets takes its choice from the
    /// record on disk, or else is timed against the heuristic's cuBLASLt algorithms (which
    /// synchronises the stream: not while capturing a graph). New choices are saved after.
    pub fn tuning<R>(&self, f: impl FnOnce() -> R) -> R {
        self.tuning.store(true, Ordering::Relaxed);
        let r = f();
        self.tuning.store(false, Ordering::Relaxed);
        if let Some(lt) = &self.lt {
            lt.save();
        }
        r
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
        let untuned = self.lt.as_ref().is_some_and(|lt| !lt.is_tuned((m, k, n)));
        if self.is_tuning() && untuned && m * n > 0 {
            let mut scratch = self
                .stream
                .alloc_zeros::<u8>(m * n * self.dtype.size())
                .map_err(|e| anyhow!("a scratch output to tune [{m}, {k}, {n}]: {e:?}"))?;
            self.linear(x, w, &mut scratch, m, k, n)?;
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
        let dims = |v: usize| {
            i32::try_from(v).map_err(|_| anyhow!("linear: dimension {v} exceeds cuBLAS's i32"))
        };
        let (mi, ki, ni) = (dims(m)?, dims(k)?, dims(n)?);
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr(&self.stream);
        let Some(lt) = &self.lt else {
            return self.gemm_ex((xp, wp, op), (mi, ki, ni), beta);
        };
        let (mkn, ops) = (
            (m, k, n),
            Operands {
                x: xp,
                w: wp,
                y: op,
            },
        );
        if self.is_tuning() && !lt.is_tuned(mkn) {
            // `linear_add` tunes through `linear` first, so β is 0 here.
            let mut baseline = || self.gemm_ex((xp, wp, op), (mi, ki, ni), Beta::Zero);
            lt.tune(mkn, ops, &mut baseline)?;
        }
        if lt.run(mkn, ops, beta)? {
            return Ok(());
        }
        self.gemm_ex((xp, wp, op), (mi, ki, ni), beta)
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
