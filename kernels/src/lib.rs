//! Compute kernels. `cpu` holds the plain f32 reference of every kernel: the CPU backend
//! runs on it, and the CUDA kernels (`cuda`, compiled at run time by NVRTC) are checked
//! against it.

pub mod cpu;
pub mod cuda;
