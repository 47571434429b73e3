//! Which SIMD instruction set the fast kernels run on, detected at run time.
//!
//! Every kernel has an AVX-512, an AVX2 + FMA and a portable (scalar) body. They compute
//! the same operations in the same order, so the choice changes speed, not results (the
//! tests run each body and compare them bit for bit). `VLLM_CPU_ISA=scalar|avx2|avx512`
//! caps the choice, to time or test a fallback on a machine that has more.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, any target.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512F (plus AVX2, FMA and F16C).
    Avx512,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// Whether this CPU can run the kernels of `self`.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx2.is_available() && is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every instruction set this CPU can run, slowest first (tests run each).
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The best instruction set of this CPU, capped by `VLLM_CPU_ISA` when set; decided
    /// once per process.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Isa::available().pop().unwrap_or(Isa::Scalar);
            match std::env::var("VLLM_CPU_ISA") {
                Ok(v) => match Isa::from_name(v.trim()) {
                    Some(cap) => cap.min(best),
                    None => {
                        tracing::warn!("VLLM_CPU_ISA={v}: expected scalar, avx2 or avx512");
                        best
                    }
                },
                Err(_) => best,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_is_always_available_and_detect_is_available() {
        assert!(Isa::Scalar.is_available());
        assert!(Isa::detect().is_available());
        assert_eq!(Isa::from_name("avx2"), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("sse"), None);
    }
}
