//! The CUDA side of the kernels: CUDA C sources (`csrc/`), their NVRTC build for the
//! device's architecture with an on-disk cache, typed launch wrappers and the cuBLAS GEMM.
//!
//! Everything here is compiled in every build and links nothing from CUDA: the driver,
//! NVRTC and cuBLAS are loaded at run time (`libs`), so a machine without CUDA builds and
//! runs the CPU path, and gets a one-line error if it asks for the GPU.

pub mod attention_plan;
pub mod cache;
pub mod capture_arena;
pub mod custom_all_reduce;
pub mod device;
pub mod dtype;
pub mod gemm;
pub mod gemm_choices;
pub mod gemv;
pub mod graph_timer;
pub mod launch;
pub mod libs;
pub mod lt_matmul;
pub mod module;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod sampling_ops;
pub mod sources;
pub mod thin_gemm;

pub use attention_plan::{AttentionKernels, AttentionPlan};
pub use capture_arena::{CaptureArena, DeviceBuf};
pub use custom_all_reduce::{
    AbortWord, CustomAllReduce, CustomAllReduceSetup, GemvNorm, LocalBuffer,
};
pub use device::CudaDevice;
pub use dtype::DType;
pub use gemm::Gemm;
pub use gemv::{GEMV_MAX_M, GEMV_PAYS_MAX_M};
pub use lt_matmul::TuningCounts;
pub use ops::{AttentionDims, AttentionMeta, CudaOps, QkvPrepare};
pub use sampling_ops::{
    LogitEntry, SampleRow, SampleRowEx, SampledBatch, SamplingBatch, TokenLogprobsOut, ENTRY_MASK,
    ENTRY_REPEAT, MAX_LOGPROBS,
};
pub use thin_gemm::THIN_GEMM_MAX_M;
