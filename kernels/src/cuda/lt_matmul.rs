//! cuBLASLt matmuls whose algorithm was timed for their shape: `y[m, n] = x[m, k] · w[n, k]ᵀ`
//! as `Gemm::linear` computes it, but with the fastest of the algorithms cuBLASLt's
//! heuristic offers for (m, n, k), chosen once on the real operands (`LtMatmul::tune`).
//!
//! Why: at decode batches (m of 16 to 256) the default cuBLAS choice for the small models'
//! shapes leaves most SMs idle (Qwen3-0.6B at batch 256: 8–10 µs a GEMM, 0.85 TB/s on the
//! weights, with output tiles for a third of the H100's SMs); the heuristic's other
//! candidates include split-K and stream-K kernels that fill them. Measured, they win a
//! third of Qwen3-0.6B's shapes by 5–20%, and none comes near the byte floor
//! (docs/BENCHMARKS.md).
//!
//! Candidates are timed in a CUDA graph of back-to-back runs, as a step's graph runs them
//! (graph_timer.rs). Choices are kept on disk (gemm_choices.rs), so only the first start
//! on a GPU times anything.
//!
//! Only the tuned shapes run here; the chosen algorithm never changes afterwards, so an
//! eager step and a CUDA graph of the same batch compute the same bits.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{anyhow, Result};
use cudarc::cublaslt::{result as lr, sys as ls};
use cudarc::driver::CudaStream;

use super::device::driver_error;
use super::dtype::DType;
use super::gemm_choices::{self, Choice, Mkn};
use super::graph_timer::mean_us_in_graph;

/// Candidates asked of the heuristic for one shape.
const CANDIDATES: usize = 16;
/// Shapes whose default GEMM takes longer than this are left to it untimed: they fill the
/// GPU already (the LM head, 140 µs at 256 rows of Qwen3-0.6B, never lost).
const TUNE_BELOW_US: f32 = 50.0;
/// A candidate must beat cuBLAS's default by this factor: closer is timing noise.
const WIN_FACTOR: f32 = 0.97;

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
    fn new(dtype: DType, (m, k, n): Mkn) -> Result<Self> {
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

/// One of the heuristic's algorithms for a shape, with its configuration in words.
pub struct Candidate {
    shape: Shape,
    pub label: String,
}

/// An algorithm's configuration (id, tile, stages, split-K, cluster, ...) as cuBLASLt
/// reports it, for reading bench output.
fn algo_label(algo: &ls::cublasLtMatmulAlgo_t) -> String {
    use ls::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr: A, size: usize| {
        let mut value = 0u32;
        let mut written = 0usize;
        // SAFETY: an initialised algorithm and a buffer of the attribute's size (4 bytes,
        // or 2 for the shape ids, which land in the low bytes: little-endian).
        let status = unsafe {
            ls::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut value as *mut u32 as *mut c_void,
                size,
                &mut written,
            )
        };
        if status == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            value.to_string()
        } else {
            "?".into()
        }
    };
    format!(
        "id={} tile={} stages={} splitk={} reduction={} swizzle={} cluster={} inner={} custom={}",
        get(A::CUBLASLT_ALGO_CONFIG_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4),
        get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 4),
        get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4),
        get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2),
        get(A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, 2),
        get(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 4),
    )
}

/// The operands of one call, as raw device pointers on the handle's stream.
#[derive(Clone, Copy)]
pub struct Operands {
    pub x: u64,
    pub w: u64,
    pub y: u64,
}

/// What a product does with y's old contents: cuBLAS's β.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Beta {
    /// y = x · wᵀ.
    Zero,
    /// y += x · wᵀ (in place).
    One,
}

impl Beta {
    pub fn value(self) -> f32 {
        match self {
            Beta::Zero => 0.0,
            Beta::One => 1.0,
        }
    }
}

/// What tuning has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TuningCounts {
    /// Shapes with a choice.
    pub shapes: usize,
    /// Of those, the ones a cuBLASLt algorithm won.
    pub cublaslt: usize,
    /// Of those, the ones timed here rather than loaded from the record on disk.
    pub timed: usize,
}

/// The shapes chosen so far, and the record on disk they are kept in.
struct Tuned {
    /// None where cuBLAS's own GEMM won.
    shapes: HashMap<Mkn, Option<Shape>>,
    /// The record as loaded, plus every choice made since.
    record: BTreeMap<Mkn, Choice>,
    timed: usize,
    unsaved: bool,
}

pub struct LtMatmul {
    handle: ls::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    dtype: DType,
    workspace: (u64, usize),
    record_path: PathBuf,
    tuned: Mutex<Tuned>,
}

// SAFETY: the handle is used from one stream, and the shapes only under their lock.
unsafe impl Send for LtMatmul {}
unsafe impl Sync for LtMatmul {}

impl Drop for LtMatmul {
    fn drop(&mut self) {
        self.lock().shapes.clear();
        // SAFETY: created in `new`, destroyed once here, after every shape.
        let _ = unsafe { lr::destroy_handle(self.handle) };
    }
}

impl LtMatmul {
    /// `workspace`: a device buffer (pointer, bytes) that outlives this and is only used
    /// on `stream`. Loads the choices made on this GPU before, from the record in `dir`.
    pub fn new(
        stream: Arc<CudaStream>,
        dtype: DType,
        workspace: (u64, usize),
        dir: &Path,
    ) -> Result<Self> {
        let gpu = stream
            .context()
            .name()
            .map_err(|e| driver_error("reading the GPU's name", e))?;
        // SAFETY: a plain query of the loaded library.
        let version = unsafe { ls::cublasLtGetVersion() };
        let record_path = gemm_choices::record_path(dir, &gpu, version, dtype.name());
        let record = gemm_choices::load(&record_path);
        let handle = lr::create_handle().map_err(lt_err("creating a handle"))?;
        Ok(Self {
            handle,
            stream,
            dtype,
            workspace,
            record_path,
            tuned: Mutex::new(Tuned {
                shapes: HashMap::new(),
                record,
                timed: 0,
                unsaved: false,
            }),
        })
    }

    pub fn counts(&self) -> TuningCounts {
        let tuned = self.lock();
        TuningCounts {
            shapes: tuned.shapes.len(),
            cublaslt: tuned.shapes.values().filter(|s| s.is_some()).count(),
            timed: tuned.timed,
        }
    }

    /// Whether (m, k, n) has a choice (whichever GEMM won).
    pub fn is_tuned(&self, mkn: Mkn) -> bool {
        self.lock().shapes.contains_key(&mkn)
    }

    fn lock(&self) -> MutexGuard<'_, Tuned> {
        // A panic elsewhere leaves the state whole: entries are inserted complete.
        self.tuned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the choices made since the record was loaded, if any.
    pub fn save(&self) {
        let mut tuned = self.lock();
        if std::mem::take(&mut tuned.unsaved) {
            gemm_choices::store(&self.record_path, &tuned.record);
        }
    }

    /// Runs (m, k, n) through its tuned algorithm; false when it has none (not tuned, or
    /// cuBLAS's own GEMM won), and the caller runs that.
    pub fn run(&self, mkn: Mkn, ops: Operands, beta: Beta) -> Result<bool> {
        let tuned = self.lock();
        let Some(Some(shape)) = tuned.shapes.get(&mkn) else {
            return Ok(false);
        };
        self.matmul(shape, &shape.algo, ops, beta)?;
        Ok(true)
    }

    fn matmul(
        &self,
        shape: &Shape,
        algo: &ls::cublasLtMatmulAlgo_t,
        ops: Operands,
        beta: Beta,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, beta.value());
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

    /// Chooses (m, k, n)'s GEMM: the record's choice if it has one that still fits the
    /// shape, else the fastest of the heuristic's candidates and `baseline` (cuBLAS's own
    /// GEMM, enqueued on the same stream), timed on these operands (which it overwrites).
    /// Synchronises the stream; never call it while a graph is being captured.
    pub fn tune(
        &self,
        mkn: Mkn,
        ops: Operands,
        baseline: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let recorded = self.lock().record.get(&mkn).copied();
        if let Some(choice) = recorded {
            if let Some(shape) = self.shape_of(mkn, choice)? {
                self.lock().shapes.insert(mkn, shape);
                return Ok(());
            }
        }
        let (chosen, best_us, default_us) = self.time_candidates(mkn, ops, baseline)?;
        let (m, k, n) = mkn;
        tracing::debug!(
            m,
            k,
            n,
            best_us,
            default_us,
            "timed a GEMM shape's algorithms"
        );
        let mut tuned = self.lock();
        tuned
            .record
            .insert(mkn, chosen.as_ref().map(|s| s.algo.data));
        tuned.shapes.insert(mkn, chosen);
        tuned.timed += 1;
        tuned.unsaved = true;
        Ok(())
    }

    /// The shape a recorded choice gives: Some(None) for cuBLAS's own GEMM, None when the
    /// recorded algorithm no longer fits (another library build wrote the same name).
    fn shape_of(&self, mkn: Mkn, choice: Choice) -> Result<Option<Option<Shape>>> {
        let Some(data) = choice else {
            return Ok(Some(None));
        };
        let mut shape = Shape::new(self.dtype, mkn)?;
        shape.algo = ls::cublasLtMatmulAlgo_t { data };
        let mut result = std::mem::MaybeUninit::<ls::cublasLtMatmulHeuristicResult_t>::zeroed();
        // SAFETY: live descriptors and a result the call fills.
        let status = unsafe {
            ls::cublasLtMatmulAlgoCheck(
                self.handle,
                shape.desc,
                shape.w_layout,
                shape.x_layout,
                shape.y_layout,
                shape.y_layout,
                &shape.algo,
                result.as_mut_ptr(),
            )
        };
        // SAFETY: zero-initialised, and written by the call where it succeeded.
        let fits = status == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && unsafe { result.assume_init() }.workspaceSize <= self.workspace.1;
        Ok(fits.then_some(Some(shape)))
    }

    /// The fastest of the heuristic's candidates if it beats `baseline` by WIN_FACTOR,
    /// with its time and the baseline's, in µs.
    fn time_candidates(
        &self,
        mkn: Mkn,
        ops: Operands,
        baseline: &mut dyn FnMut() -> Result<()>,
    ) -> Result<(Option<Shape>, f32, f32)> {
        let base_us = mean_us_in_graph(&self.stream, baseline)?;
        if base_us > TUNE_BELOW_US {
            return Ok((None, base_us, base_us));
        }
        let mut shape = Shape::new(self.dtype, mkn)?;
        let mut best: Option<(f32, ls::cublasLtMatmulAlgo_t)> = None;
        for candidate in self.heuristic(&shape, CANDIDATES)? {
            let mut run = || self.matmul(&shape, &candidate.algo, ops, Beta::Zero);
            // A candidate may still refuse the operands (alignment): skip it.
            let Ok(us) = mean_us_in_graph(&self.stream, &mut run) else {
                continue;
            };
            if best.is_none_or(|(b, _)| us < b) {
                best = Some((us, candidate.algo));
            }
        }
        Ok(match best {
            Some((us, algo)) if us < WIN_FACTOR * base_us => {
                shape.algo = algo;
                (Some(shape), us, base_us)
            }
            _ => (None, base_us, base_us),
        })
    }

    /// Up to `count` of the heuristic's algorithms for (m, k, n), each runnable on its own
    /// (`run_candidate`), for a bench to time them as it likes.
    pub fn candidates_for(&self, mkn: Mkn, count: usize) -> Result<Vec<Candidate>> {
        let probe = Shape::new(self.dtype, mkn)?;
        self.heuristic(&probe, count)?
            .into_iter()
            .map(|r| {
                let mut shape = Shape::new(self.dtype, mkn)?;
                shape.algo = r.algo;
                let label = format!("{} waves={:.2}", algo_label(&r.algo), r.wavesCount);
                Ok(Candidate { shape, label })
            })
            .collect()
    }

    pub fn run_candidate(&self, candidate: &Candidate, ops: Operands) -> Result<()> {
        self.matmul(&candidate.shape, &candidate.shape.algo, ops, Beta::Zero)
    }

    /// Up to `count` algorithms the heuristic offers for `shape` within the workspace, in
    /// its order.
    fn heuristic(
        &self,
        shape: &Shape,
        count: usize,
    ) -> Result<Vec<ls::cublasLtMatmulHeuristicResult_t>> {
        let pref = lr::create_matmul_pref().map_err(lt_err("creating a preference"))?;
        let bytes = self.workspace.1 as u64;
        let mut results = Vec::with_capacity(count);
        let mut returned = 0i32;
        // SAFETY: live descriptors; `results` has room for `count` entries, of which the
        // call initialises `returned`.
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
                    count as i32,
                    results.as_mut_ptr(),
                    &mut returned,
                )
                .result()
            })
            .map(|_| results.set_len(returned.clamp(0, count as i32) as usize))
        };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lr::destroy_matmul_pref(pref) };
        status.map_err(lt_err("asking the heuristic"))?;
        Ok(results
            .into_iter()
            .filter(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .collect())
    }
}
