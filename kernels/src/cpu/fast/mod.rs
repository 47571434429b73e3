//! The fast CPU kernels that `--device cpu` serves with, beside the reference kernels of
//! `cpu::*` (which stay the plain definitions the CUDA kernels are checked against).
//!
//! - `pool`: one persistent thread per core, spinning briefly between loops.
//! - `packed`: weights packed once at load time into 16-row panels, in f32, bf16 or f16.
//! - `matmul`: the multi-threaded GEMV/GEMM over packed weights (and the MLP's fused
//!   gate/up + SiLU·mul), one register-tiled micro-kernel for every batch size.
//! - `attention`: paged attention in parallel over heads and tokens.
//! - `math`, `isa`, `x86`: the SIMD primitives, the run-time ISA choice (AVX-512, AVX2 +
//!   FMA, or portable Rust), and the x86 bodies.
//!
//! Numerics: each fast kernel fixes its order of operations independently of the ISA, the
//! batch size and the thread count (each module says how), so every ISA gives the same
//! bits and a token's result is the same in a prefill as in a decode. Against the
//! reference kernels only the order of sums and the `exp` (within 2 ulp) differ; the tests
//! bound both.

pub mod attention;
pub mod isa;
pub mod math;
pub mod matmul;
pub mod packed;
pub mod pool;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use isa::Isa;
pub use packed::{PackedData, PackedMatrix, PANEL};
pub use pool::{default_threads, ThreadPool};
