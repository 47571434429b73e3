//! How a decode step's one-row gate/up product with SiLU-and-mul runs: `gemv_silu_mul`
//! with each output's gate and up rows in one warp or split over two warps, or `gemv` then
//! `silu_and_mul`. The three give the same bits, and which is fastest depends on the
//! shape: on an H200 (`cuda_bench tp_rank_gemvs`) the fused kernel wins at the Qwen3-8B's
//! TP=2 shard, the split one at its TP=4 shard, and the unfused pair at the
//! Llama-3.1-70B's TP=4 shard, where the fused kernel is 15 % slower (docs/BENCHMARKS.md,
//! 2026-11-26).
//!
//! So a shape is timed once, in the warm-up runs that also tune the cuBLAS GEMMs, and
//! keeps its choice; until then, and in eager mode, the fused kernel runs. Each timed run
//! follows a write of twice the L2's bytes: the timing graph runs one layer's weight over
//! and over, which would otherwise come from L2, where a step's kernels, each on its own
//! layer's weights, read HBM.

use std::cell::RefCell;
use std::collections::HashMap;

use anyhow::Result;
use vllm_kernels::cuda::graph_timer::mean_us_in_graph;

use super::{CudaBackend, CudaTensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateUpKernel {
    /// `gemv_silu_mul`, a warp an output.
    Fused,
    /// `gemv_silu_mul`, an output's gate and up rows in two warps.
    Split,
    /// `gemv` (a warp a row, as the fused kernels sum), then `silu_and_mul`.
    Unfused,
}

/// Each timed (k, d) shape's kernel.
#[derive(Default)]
pub struct GateUpChoices(RefCell<HashMap<(usize, usize), GateUpKernel>>);

impl CudaBackend {
    /// The kernel of the one-row product of x [1, k] and the gate/up weight w [2d, k]:
    /// timed on these operands, into outputs of its own, if tuning and not yet chosen.
    pub(super) fn gate_up_kernel(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        (k, d): (usize, usize),
    ) -> Result<GateUpKernel> {
        if let Some(&kernel) = self.gate_up.0.borrow().get(&(k, d)) {
            return Ok(kernel);
        }
        if !self.gemm.is_tuning() {
            return Ok(GateUpKernel::Fused);
        }
        let kernel = self.time_gate_up(x, w, (k, d))?;
        self.gate_up.0.borrow_mut().insert((k, d), kernel);
        Ok(kernel)
    }

    /// The fastest of the three for this shape; the fused kernel where the gemv kernels do
    /// not take the operands (the caller then runs the unfused pair on cuBLAS) or there is
    /// no room for the eviction buffer.
    fn time_gate_up(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        (k, d): (usize, usize),
    ) -> Result<GateUpKernel> {
        let (mut out, mut gate_up) = (self.tensor(vec![1, d])?, self.tensor(vec![1, 2 * d])?);
        if !self.ops.gemv_fits([&x.buf, &w.buf, &out.buf], 1, k) {
            return Ok(GateUpKernel::Fused);
        }
        // Outside the capture arena: a buffer of warm-up only.
        let evict_elems = 2 * self.dev.l2_bytes / self.dtype.size();
        let Ok(mut evict) = self.ops.alloc_zeros(evict_elems) else {
            tracing::debug!(k, d, "no room to time a gate/up shape: fused");
            return Ok(GateUpKernel::Fused);
        };
        let stream = &self.dev.stream;
        let mut time = |run: &mut dyn FnMut() -> Result<()>| {
            mean_us_in_graph(stream, &mut || {
                self.ops.fill(&mut evict, evict_elems, 0.0)?;
                run()
            })
        };
        let mut fused = |split| {
            time(&mut || {
                self.ops
                    .gemv_silu_mul(&x.buf, &w.buf, &mut out.buf, (k, d), split, 0)
            })
        };
        let (fused_us, split_us) = (fused(false)?, fused(true)?);
        let unfused_us = time(&mut || {
            self.ops
                .gemv_with_rows(&x.buf, &w.buf, &mut gate_up.buf, (1, k, 2 * d), 1, 0)?;
            self.ops.silu_and_mul(&gate_up.buf, &mut out.buf, 1, d)
        })?;
        let kernel = [
            (fused_us, GateUpKernel::Fused),
            (split_us, GateUpKernel::Split),
            (unfused_us, GateUpKernel::Unfused),
        ]
        .into_iter()
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map_or(GateUpKernel::Fused, |(_, kernel)| kernel);
        // Each time includes the eviction's write, the same in all three.
        tracing::debug!(
            k,
            d,
            fused_us,
            split_us,
            unfused_us,
            ?kernel,
            "timed a gate/up shape"
        );
        Ok(kernel)
    }
}
