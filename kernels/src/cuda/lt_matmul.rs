//! cuBLASLt matmuls whose algorithm was timed for their shape: `y[m, n] = x[m, k] · w[n, k]ᵀ`
//! as `Gemm::linear` computes it, but with the fastest of the algorithms cuBLASLt's
//! heuristic offers for (m, n, k), chosen once on the real operands (`LtMatmul::tune`).
//!
//! Why: at decode batches (m of 16 to 256) the default cuBLAS choice for the small models'
//! shapes leaves most SMs idle (Qwen3-0.6B at batch 256: 8–10 µs a GEMM, 0.85 TB/s on the
//! weights, with output tiles for a third of the H100's SMs); the heuristic's other
//! candidates include split-K and stream-K kernels that fill them.
//!
//! Only the tuned shapes run here; the chosen algorithm never changes afterwards, so an
//! eager step and a CUDA graph of the same batch compute the same bits.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Result};
use cudarc::cublaslt::{result as lr, sys as ls};
use cudarc::driver::{sys::CUevent_flags, CudaStream};

use super::dtype::DType;

/// Candidates asked of the heuristic for one shape.
const CANDIDATES: usize = 16;
/// Timed runs of each candidate (after one untimed run).
const TIMED_RUNS: usize = 5;

fn data_type(dtype: DType) -> ls::cudaDataType {
    match dtype {
        DType::BF16 => ls::cudaDataType::CUDA_R_16BF,
        DType::F16 => ls::cudaDataType::CUDA_R_16F,
        DType::F32 => ls::cudaDataType::CUDA_R_32F,
    }
}

fn lt_err(what: &str) -> impl FnOnce(cudarc::cublaslt::result::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt: {what} failed: {e:?}")
}

/// The descriptors of one shape and the algorithm chosen for it.
struct Shape {
    desc: ls::cublasLtMatmulDesc_t,
    /// w as column-major [k, n] (transposed by the descriptor), x as [k, m], y as [n, m].
    w_layout: ls::cublasLtMatrixLayout_t,
    x_layout: ls::cublasLtMatrixLayout_t,
    y_layout: ls::cublasLtMatrixLayout_t,
    algo: ls::cublasLtMatmulAlgo_t,
}

impl Drop for Shape {
    fn drop(&mut self) {
        // SAFETY: created in `Shape::new`, destroyed once here.
        unsafe {
            let _ = lr::destroy_matrix_layout(self.y_layout);
            let _ = lr::destroy_matrix_layout(self.x_layout);
            let _ = lr::destroy_matrix_layout(self.w_layout);
            let _ = lr::destroy_matmul_desc(self.desc);
        }
    }
}

// SAFETY: the descriptors are plain host objects, used only under `LtMatmul`'s lock.
unsafe impl Send for Shape {}

impl Shape {
    fn new(dtype: DType, (m, k, n): (usize, usize, usize)) -> Result<Self> {
        let t = data_type(dtype);
        let desc = lr::create_matmul_desc(
            ls::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ls::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("creating a matmul descriptor"))?;
        let mut shape = Self {
            desc,
            w_layout: std::ptr::null_mut(),
            x_layout: std::ptr::null_mut(),
            y_layout: std::ptr::null_mut(),
            algo: ls::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // cuBLASLt takes cuBLAS's operation enum as an i32.
        let transa = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32;
        // SAFETY: a live descriptor and an attribute of the size it expects.
        unsafe {
            lr::set_matmul_desc_attribute(
                shape.desc,
                ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transa as *const _ as *const c_void,
                std::mem::size_of_val(&transa),
            )
        }
        .map_err(lt_err("setting TRANSA"))?;
        let layout = |rows: usize, cols: usize| {
            lr::create_matrix_layout(t, rows as u64, cols as u64, rows as i64)
                .map_err(lt_err("creating a matrix layout"))
        };
        shape.w_layout = layout(k, n)?;
        shape.x_layout = layout(k, m)?;
        shape.y_layout = layout(n, m)?;
        Ok(shape)
    }
}

/// The operands of one call, as raw device pointers on the handle's stream.
#[derive(Clone, Copy)]
pub struct Operands {
    pub x: u64,
    pub w: u64,
    pub y: u64,
}

pub struct LtMatmul {
    handle: ls::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    dtype: DType,
    workspace: (u64, usize),
    /// Every shape tuned so far; None where cuBLAS's own GEMM was as fast.
    shapes: Mutex<HashMap<(usize, usize, usize), Option<Shape>>>,
}

// SAFETY: the handle is used from one stream, and the shapes only under their lock.
unsafe impl Send for LtMatmul {}
unsafe impl Sync for LtMatmul {}

impl Drop for LtMatmul {
    fn drop(&mut self) {
        self.shapes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        // SAFETY: created in `new`, destroyed once here, after every shape.
        let _ = unsafe { lr::destroy_handle(self.handle) };
    }
}

impl LtMatmul {
    /// `workspace`: a device buffer (pointer, bytes) that outlives this and is only used
    /// on `stream`.
    pub fn new(stream: Arc<CudaStream>, dtype: DType, workspace: (u64, usize)) -> Result<Self> {
        let handle = lr::create_handle().map_err(lt_err("creating a handle"))?;
        Ok(Self {
            handle,
            stream,
            dtype,
            workspace,
            shapes: Mutex::new(HashMap::new()),
        })
    }

    /// Shapes tuned, and of those the ones a cuBLASLt algorithm won.
    pub fn counts(&self) -> (usize, usize) {
        let shapes = self.lock();
        (
            shapes.len(),
            shapes.values().filter(|s| s.is_some()).count(),
        )
    }

    /// Whether (m, k, n) has been tuned (whichever GEMM won).
    pub fn is_tuned(&self, mkn: (usize, usize, usize)) -> bool {
        self.lock().contains_key(&mkn)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(usize, usize, usize), Option<Shape>>> {
        // A panic elsewhere leaves the map whole: entries are inserted complete.
        self.shapes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs (m, k, n) through its tuned algorithm; false when it has none (not tuned, or
    /// cuBLAS's own GEMM won), and the caller runs that.
    pub fn run(&self, mkn: (usize, usize, usize), ops: Operands) -> Result<bool> {
        let shapes = self.lock();
        let Some(Some(shape)) = shapes.get(&mkn) else {
            return Ok(false);
        };
        self.matmul(shape, &shape.algo, ops)?;
        Ok(true)
    }

    fn matmul(&self, shape: &Shape, algo: &ls::cublasLtMatmulAlgo_t, ops: Operands) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller's operands hold [m, k], [n, k] and [m, n] (checked by
        // `Gemm::linear`); the workspace is ours for the stream's use.
        unsafe {
            lr::matmul(
                self.handle,
                shape.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                ops.w as *const c_void,
                shape.w_layout,
                ops.x as *const c_void,
                shape.x_layout,
                ops.y as *const c_void,
                shape.y_layout,
                ops.y as *mut c_void,
                shape.y_layout,
                algo,
                self.workspace.0 as *mut c_void,
                self.workspace.1,
                self.stream.cu_stream() as ls::cudaStream_t,
            )
        }
        .map_err(lt_err("matmul"))
    }

    /// Chooses (m, k, n)'s GEMM on these operands (which it overwrites): each of the
    /// heuristic's candidates and `baseline` (cuBLAS's own GEMM, enqueued on the same
    /// stream) are timed, and the fastest is kept. Synchronises the stream; never call it
    /// while a graph is being captured. Returns the time of the winner and of the baseline,
    /// in µs.
    pub fn tune(
        &self,
        mkn: (usize, usize, usize),
        ops: Operands,
        baseline: &mut dyn FnMut() -> Result<()>,
    ) -> Result<(f32, f32)> {
        let mut shape = Shape::new(self.dtype, mkn)?;
        let base_us = self.time(baseline)?;
        let mut best: Option<(f32, ls::cublasLtMatmulAlgo_t)> = None;
        for candidate in self.candidates(&shape)? {
            let mut run = || self.matmul(&shape, &candidate.algo, ops);
            // A candidate may still refuse the operands (alignment): skip it.
            let Ok(us) = self.time(&mut run) else {
                continue;
            };
            if best.is_none_or(|(b, _)| us < b) {
                best = Some((us, candidate.algo));
            }
        }
        let chosen = match best {
            // Within noise of the baseline, keep cuBLAS's own GEMM.
            Some((us, algo)) if us < 0.97 * base_us => {
                shape.algo = algo;
                Some((us, shape))
            }
            _ => None,
        };
        let best_us = chosen.as_ref().map_or(base_us, |(us, _)| *us);
        self.lock().insert(mkn, chosen.map(|(_, s)| s));
        Ok((best_us, base_us))
    }

    /// Up to CANDIDATES algorithms the heuristic offers for `shape` within the workspace.
    fn candidates(&self, shape: &Shape) -> Result<Vec<ls::cublasLtMatmulHeuristicResult_t>> {
        let pref = lr::create_matmul_pref().map_err(lt_err("creating a preference"))?;
        let bytes = self.workspace.1 as u64;
        let mut results = Vec::with_capacity(CANDIDATES);
        let mut count = 0i32;
        // SAFETY: live descriptors; `results` has room for CANDIDATES entries, of which
        // the call initialises `count`.
        let status = unsafe {
            lr::set_matmul_pref_attribute(
                pref,
                ls::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .and_then(|_| {
                ls::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    shape.desc,
                    shape.w_layout,
                    shape.x_layout,
                    shape.y_layout,
                    shape.y_layout,
                    pref,
                    CANDIDATES as i32,
                    results.as_mut_ptr(),
                    &mut count,
                )
                .result()
            })
            .map(|_| results.set_len(count.clamp(0, CANDIDATES as i32) as usize))
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lr::destroy_matmul_pref(pref) };
        status.map_err(lt_err("asking the heuristic"))?;
        Ok(results
            .into_iter()
            .filter(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .collect())
    }

    /// Mean µs of `f` over TIMED_RUNS runs, after one untimed run.
    fn time(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<f32> {
        let event = || {
            self.stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("CUDA driver: recording an event failed: {e:?}"))
        };
        f()?;
        let start = event()?;
        for _ in 0..TIMED_RUNS {
            f()?;
        }
        let end = event()?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| anyhow!("CUDA driver: timing events failed: {e:?}"))?;
        Ok(ms * 1000.0 / TIMED_RUNS as f32)
    }
}
