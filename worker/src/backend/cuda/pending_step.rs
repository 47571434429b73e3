//! `PendingStep`: a deferred CUDA step (see `crate::overlap`) whose sampled tokens are on
//! their way to the host, and the device-to-device copies that feed them to the next
//! step's input ids before the host has seen them.
//!
//! The sampler leaves the tokens in the readback's device buffer; one asynchronous copy
//! takes them to page-locked host memory and an event is recorded behind it. The device context does
//! not track events (kernels/src/cuda/device.rs), so reading the pinned memory waits on
//! that event explicitly: `PinnedHostSlice::as_slice` would not.

use anyhow::{ensure, Result};
use cudarc::driver::{result as dr, CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};
use vllm_kernels::cuda::device::driver_error;

use super::sampling::checked_token;
use super::CudaBackend;
use crate::overlap::{CopyRun, DeferredRows};

/// Device and page-locked memory for one step's tokens and the event that says they
/// arrived; reused from step to step (two are in use at most: the step being finished and
/// the next).
pub struct Readback {
    /// Where the sampler puts the tokens; the next step's input copies read them here.
    pub device: CudaSlice<i32>,
    host: PinnedHostSlice<i32>,
    arrived: CudaEvent,
}

impl Readback {
    /// Room for `capacity` tokens (a step samples at most `max_num_seqs`).
    pub fn new(b: &CudaBackend, capacity: usize) -> Result<Self> {
        let ctx = b.dev.stream.context();
        // SAFETY: only the tokens a copy wrote, after its event, are read.
        let host = unsafe { ctx.alloc_pinned_with_flags::<i32>(capacity.max(1), 0) }
            .map_err(|e| driver_error("allocating pinned memory for sampled tokens", e))?;
        // SAFETY: the sampler writes the tokens before anything reads them.
        let device = unsafe { b.dev.stream.alloc::<i32>(capacity.max(1)) }
            .map_err(|e| driver_error("allocating the sampled-token buffer", e))?;
        let arrived = ctx
            .new_event(None)
            .map_err(|e| driver_error("creating an event", e))?;
        Ok(Self {
            device,
            host,
            arrived,
        })
    }
}

/// A step whose tokens were sampled on the device and are not read yet.
pub struct PendingStep {
    pub rows: DeferredRows,
    /// Row `i`'s token at index `i` of `readback.device`.
    readback: Readback,
    vocab: usize,
}

impl PendingStep {
    /// Enqueues the copy of the step's tokens (one per row of `rows`, sampled into
    /// `readback.device`) to the host and records the event behind it.
    pub fn start(
        b: &CudaBackend,
        rows: DeferredRows,
        mut readback: Readback,
        vocab: usize,
    ) -> Result<Self> {
        let n = rows.req_ids.len();
        ensure!(
            n <= readback.device.len() && n <= readback.host.len(),
            "step {}: {n} sampled tokens exceed their buffers",
            rows.step_id
        );
        let stream = &b.dev.stream;
        {
            let host = readback
                .host
                .as_mut_slice()
                .map_err(|e| driver_error("the pinned token buffer", e))?;
            let (src, _guard) = readback.device.device_ptr(stream);
            // SAFETY: `host` is page-locked and holds n i32s, `tokens` at least n; nothing
            // reads `host` before `arrived` has completed, and `readback` is not handed
            // to another step before then (`finish` waits).
            unsafe { dr::memcpy_dtoh_async(&mut host[..n], src, stream.cu_stream()) }
                .map_err(|e| driver_error("copying sampled tokens to the host", e))?;
        }
        readback
            .arrived
            .record(stream)
            .map_err(|e| driver_error("recording an event", e))?;
        Ok(Self {
            rows,
            readback,
            vocab,
        })
    }

    /// Whether the tokens have arrived (`finish` will not wait).
    pub fn is_ready(&self) -> Result<bool> {
        self.readback
            .arrived
            .try_is_complete()
            .map_err(|e| driver_error("querying a step's event", e))
    }

    /// Enqueues the next step's input copies from this step's tokens: after that step's
    /// upload (`upload_step`), before its forward or graph replay.
    pub fn copy_into_inputs(&self, b: &CudaBackend, runs: &[CopyRun]) -> Result<()> {
        b.copy_into_input_ids(runs, &self.readback.device)
    }

    /// Waits for the tokens; they and the readback buffer, for the next deferred step.
    pub fn finish(self) -> Result<(DeferredRows, Vec<u32>, Readback)> {
        self.readback
            .arrived
            .synchronize()
            .map_err(|e| driver_error("waiting for a step's sampled tokens", e))?;
        let n = self.rows.req_ids.len();
        let host = self
            .readback
            .host
            .as_slice()
            .map_err(|e| driver_error("the pinned token buffer", e))?;
        let tokens = host[..n]
            .iter()
            .map(|&t| checked_token(t, self.vocab))
            .collect::<Result<Vec<_>>>()?;
        Ok((self.rows, tokens, self.readback))
    }
}

/// The next step's copies from a pending step's tokens, applied between its upload and
/// its forward.
pub struct InputCopies<'a> {
    pub pending: &'a PendingStep,
    pub runs: Vec<CopyRun>,
}

impl InputCopies<'_> {
    pub fn apply(&self, b: &CudaBackend) -> Result<()> {
        self.pending.copy_into_inputs(b, &self.runs)
    }
}
