//! CPU reference kernels (f32), and beside them (`fast`) the multi-threaded SIMD kernels
//! the CPU backend serves with.
//!
//! One concept per file. Every function works on plain slices with explicit shapes, so the
//! CUDA kernels can be checked against them element for element. Shapes are row-major;
//! "[T, H, D]" means `T * H * D` contiguous floats with D fastest.

pub mod activation;
pub mod attention;
pub mod cache;
pub mod embedding;
pub mod fast;
pub mod gemm;
pub mod norm;
pub mod rotary;

pub use activation::silu_and_mul;
pub use attention::paged_attention;
pub use cache::reshape_and_cache;
pub use embedding::embedding;
pub use gemm::linear;
pub use norm::{fused_add_rms_norm, inv_rms, rms_norm, rms_norm_per_head};
pub use rotary::{
    compute_cos_sin_cache, compute_inv_freq, rotary_embedding_neox, Llama3RopeScaling,
};
