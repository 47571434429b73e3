//! `StepBuffers`: the device memory of one step's metadata (input ids, positions, slot
//! mapping, block tables, sequence lengths, query starts, logits rows and the attention
//! plan), allocated once at the largest step the engine schedules and filled every step
//! from pinned host memory by one asynchronous copy.
//!
//! Their addresses never change. That is what lets a CUDA graph captured on one step
//! replay a later one: the graph reads whatever the last copy put there. It also keeps
//! the hot path free of allocations and of the seven small copies a step used to make.

use std::sync::Arc;

use anyhow::{ensure, Result};
use cudarc::driver::{result as dr, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use vllm_kernels::cuda::device::driver_error;
use vllm_kernels::cuda::AttentionPlan;

use super::tensor::{Borrowed, DeviceInts};
use crate::backend::{StepCapacity, StepInputs};
use crate::overlap::CopyRun;

/// Where each array starts, in i32s from the start of the buffers. The block tables come
/// last, so that a step copies only the prefix it uses.
#[derive(Debug, Clone, Copy)]
struct Layout {
    input_ids: usize,
    positions: usize,
    slot_mapping: usize,
    seq_lens: usize,
    query_start_loc: usize,
    logits_indices: usize,
    decode_seqs: usize,
    tile_seq: usize,
    tile_token: usize,
    step_dims: usize,
    block_tables: usize,
    total: usize,
}

impl Layout {
    fn new(c: &StepCapacity) -> Self {
        let (t, s) = (c.max_num_tokens.max(1), c.max_num_seqs.max(1));
        let mut at = 0;
        let mut next = |n: usize| {
            let start = at;
            at += n;
            start
        };
        let (input_ids, positions, slot_mapping) = (next(t), next(t), next(t));
        // Logits rows: one per sequence, or every token's (prompt logprobs, tests).
        let (seq_lens, query_start_loc, logits_indices) = (next(s), next(s + 1), next(t.max(s)));
        // Every tile holds at least one query token.
        let (decode_seqs, tile_seq, tile_token) = (next(s), next(t), next(t));
        let step_dims = next(2);
        let block_tables = next(s * c.max_blocks_per_seq.max(1));
        Self {
            input_ids,
            positions,
            slot_mapping,
            seq_lens,
            query_start_loc,
            logits_indices,
            decode_seqs,
            tile_seq,
            tile_token,
            step_dims,
            block_tables,
            total: at,
        }
    }
}

/// One step's arrays on the device, as views into the buffers.
pub struct StagedStep {
    pub input_ids: DeviceInts,
    pub positions: DeviceInts,
    pub slot_mapping: DeviceInts,
    pub block_tables: DeviceInts,
    pub seq_lens: DeviceInts,
    pub query_start_loc: DeviceInts,
    pub logits_indices: DeviceInts,
    pub decode_seqs: DeviceInts,
    pub tile_seq: DeviceInts,
    pub tile_token: DeviceInts,
    pub step_dims: DeviceInts,
}

pub struct StepBuffers {
    capacity: StepCapacity,
    layout: Layout,
    stream: Arc<CudaStream>,
    dev: CudaSlice<i32>,
    /// Page-locked, so the copy is asynchronous and a graph replay never waits on it.
    staging: PinnedHostSlice<i32>,
    /// Recorded after each copy out of `staging`: the next step waits on it before it
    /// overwrites what the copy may still be reading.
    copied: CudaEvent,
}

impl StepBuffers {
    pub fn new(stream: &Arc<CudaStream>, capacity: StepCapacity) -> Result<Self> {
        let layout = Layout::new(&capacity);
        let ctx = stream.context();
        // SAFETY: every element a kernel reads is written by a step's copy first.
        let dev = unsafe { stream.alloc::<i32>(layout.total) }
            .map_err(|e| driver_error("allocating the step buffers", e))?;
        // SAFETY: as above: a step writes what it copies before the copy.
        let staging = unsafe { ctx.alloc_pinned_with_flags::<i32>(layout.total, 0) }
            .map_err(|e| driver_error("allocating pinned step buffers", e))?;
        let copied = ctx
            .new_event(None)
            .map_err(|e| driver_error("creating an event", e))?;
        Ok(Self {
            capacity,
            layout,
            stream: stream.clone(),
            dev,
            staging,
            copied,
        })
    }

    /// Whether a step of this shape fits.
    fn fits(&self, inputs: &StepInputs, plan: &AttentionPlan) -> bool {
        let c = &self.capacity;
        inputs.num_tokens() <= c.max_num_tokens
            && inputs.num_seqs() <= c.max_num_seqs
            && inputs.logits_indices.len() <= c.max_num_tokens.max(c.max_num_seqs)
            && inputs.max_blocks_per_seq <= c.max_blocks_per_seq
            && plan.num_tiles() <= c.max_num_tokens
    }

    /// Writes the step's arrays into the pinned buffer and enqueues their copy to the
    /// device; the block tables keep the step's row width (`inputs.max_blocks_per_seq`).
    pub fn stage(&mut self, inputs: &StepInputs, plan: &AttentionPlan) -> Result<StagedStep> {
        ensure!(
            self.fits(inputs, plan),
            "step of {} tokens, {} sequences and {} blocks per sequence exceeds the step \
             buffers ({:?})",
            inputs.num_tokens(),
            inputs.num_seqs(),
            inputs.max_blocks_per_seq,
            self.capacity
        );
        ensure!(
            inputs.block_tables.len() == inputs.num_seqs() * inputs.max_blocks_per_seq,
            "block_tables: {} entries for {} sequences of {}",
            inputs.block_tables.len(),
            inputs.num_seqs(),
            inputs.max_blocks_per_seq
        );
        let l = self.layout;
        let step_dims = plan.step_dims(inputs.max_blocks_per_seq);
        let parts: [(usize, &[i32]); 11] = [
            (l.input_ids, &inputs.input_ids),
            (l.positions, &inputs.positions),
            (l.slot_mapping, &inputs.slot_mapping),
            (l.seq_lens, &inputs.seq_lens),
            (l.query_start_loc, &inputs.query_start_loc),
            (l.logits_indices, &inputs.logits_indices),
            (l.decode_seqs, &plan.decode_seqs),
            (l.tile_seq, &plan.tile_seq),
            (l.tile_token, &plan.tile_token),
            (l.step_dims, &step_dims),
            (l.block_tables, &inputs.block_tables),
        ];
        self.copied
            .synchronize()
            .map_err(|e| driver_error("waiting for the last step's copy", e))?;
        let staging = self
            .staging
            .as_mut_slice()
            .map_err(|e| driver_error("reading the pinned step buffers", e))?;
        for (at, data) in parts {
            staging[at..at + data.len()].copy_from_slice(data);
        }
        let used = l.block_tables + inputs.block_tables.len();
        let (base, _guard) = self.dev.device_ptr(&self.stream);
        // SAFETY: `staging` is page-locked and holds `used` i32s, which `dev` holds too;
        // `copied` keeps them from being overwritten before the copy has read them.
        unsafe { dr::memcpy_htod_async(base, &staging[..used], self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying a step's metadata to the GPU", e))?;
        self.copied
            .record(&self.stream)
            .map_err(|e| driver_error("recording an event", e))?;
        let view = |at: usize, len: usize| {
            // SAFETY: a range inside `dev`, which outlives the step (the backend owns both).
            unsafe {
                Borrowed::new(
                    self.stream
                        .upgrade_device_ptr::<i32>(base + (at * 4) as u64, len),
                )
            }
        };
        Ok(StagedStep {
            input_ids: view(l.input_ids, inputs.input_ids.len()),
            positions: view(l.positions, inputs.positions.len()),
            slot_mapping: view(l.slot_mapping, inputs.slot_mapping.len()),
            block_tables: view(l.block_tables, inputs.block_tables.len()),
            seq_lens: view(l.seq_lens, inputs.seq_lens.len()),
            query_start_loc: view(l.query_start_loc, inputs.query_start_loc.len()),
            logits_indices: view(l.logits_indices, inputs.logits_indices.len()),
            decode_seqs: view(l.decode_seqs, plan.decode_seqs.len()),
            tile_seq: view(l.tile_seq, plan.tile_seq.len()),
            tile_token: view(l.tile_token, plan.tile_token.len()),
            step_dims: view(l.step_dims, 2),
        })
    }

    /// Overwrites input ids of the step staged last with tokens of `src`, a device
    /// buffer: run by run, `len` ids at `dst` from `src[src..]`. Stream-ordered after
    /// the step's upload, so the forward (or graph) that follows reads them.
    pub fn copy_into_input_ids(&self, runs: &[CopyRun], src: &CudaSlice<i32>) -> Result<()> {
        let (dst_base, _g0) = self.dev.device_ptr(&self.stream);
        let (src_base, _g1) = src.device_ptr(&self.stream);
        for r in runs {
            ensure!(
                r.dst + r.len <= self.capacity.max_num_tokens && r.src + r.len <= src.len(),
                "input copy {r:?} outside the step buffers or the {} sampled tokens",
                src.len()
            );
            let at = |base: u64, i: usize| base + (i * 4) as u64;
            // SAFETY: both ranges lie inside their buffers (checked above), on this stream.
            unsafe {
                dr::memcpy_dtod_async(
                    at(dst_base, self.layout.input_ids + r.dst),
                    at(src_base, r.src),
                    r.len * 4,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_error("copying sampled tokens into a step's inputs", e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_do_not_overlap_and_block_tables_come_last() {
        let c = StepCapacity {
            max_num_tokens: 100,
            max_num_seqs: 7,
            max_blocks_per_seq: 5,
        };
        let l = Layout::new(&c);
        let mut ranges = [
            (l.input_ids, 100),
            (l.positions, 100),
            (l.slot_mapping, 100),
            (l.seq_lens, 7),
            (l.query_start_loc, 8),
            (l.logits_indices, 100),
            (l.decode_seqs, 7),
            (l.tile_seq, 100),
            (l.tile_token, 100),
            (l.step_dims, 2),
            (l.block_tables, 35),
        ];
        ranges.sort();
        for w in ranges.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0, "{ranges:?}");
        }
        assert_eq!(ranges.last(), Some(&(l.block_tables, 35)));
        assert_eq!(l.total, l.block_tables + 35);
    }
}
