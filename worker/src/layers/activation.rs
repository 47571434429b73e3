//! The MLP's gated activation, `silu(gate) * up` over the fused gate/up output.

use anyhow::Result;

use crate::backend::Backend;

pub fn silu_and_mul<B: Backend>(b: &B, gate_up: &B::Tensor) -> Result<B::Tensor> {
    b.silu_and_mul(gate_up)
}
