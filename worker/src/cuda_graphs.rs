//! `CudaGraphs`: decode steps replayed from CUDA graphs (vLLM's CUDA graph runner).
//!
//! After the KV cache is allocated, one graph is captured per batch size of the ladder
//! (`decode_bucket`: 1, 2, 4, 8, then steps of 8 up to `--max-num-seqs`), each the whole
//! forward pass of a step of that many one-token sequences, its logits left where its LM
//! head wrote them in the arena (below). A later step of decodes only is padded to the
//! smallest size that fits, staged in the step buffers (whose addresses the graph baked
//! in) and replayed with one launch instead of hundreds. Steps with prefill tokens, longer
//! sequences than a graph's attention grid reaches, or more sequences than the largest
//! graph run eagerly.
//!
//! The activations of every capture come from one arena sized by an eager pass of the
//! largest shape (`CaptureArena`), so that a graph holds kernels and copies only: no
//! allocation node sits between two kernels, and programmatic dependent launch joins
//! them. The graphs share the arena, as they run one at a time on one stream. A replay's
//! logits are read in place: whatever reads them (the sampler) is queued on the stream
//! before the next replay, which may write over them. (Copying them to one buffer that
//! every graph shared read and wrote 156 MB a step at 256 sequences of a 152k vocabulary.)
//!
//! A padded sequence has one key (slot 0 of block 0, never written: its slot is -1), so
//! its rows stay finite; its logits are never read.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use vllm_kernels::cuda::attention_plan::{decode_bucket, DecodeGrid};
use vllm_kernels::cuda::CaptureArena;

use crate::backend::cuda::pending_step::InputCopies;
use crate::backend::cuda::tensor::Borrowed;
use crate::backend::cuda::CudaTensor;
use crate::backend::{Backend, CudaBackend, StepInputs};
use crate::kv_cache::KvCache;
use crate::models::LlamaForCausalLM;

/// What a graph of one batch size was captured for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphShape {
    /// Sequences (one token each).
    pub batch: usize,
    /// The longest sequence the attention grid reaches.
    pub max_seq_len: usize,
}

/// The model facts the graph shapes follow from.
#[derive(Debug, Clone, Copy)]
pub struct GraphGeometry {
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub num_sms: usize,
}

impl GraphGeometry {
    /// The shape of every graph to capture, largest first; empty when the decode kernel
    /// does not take this model's GQA group.
    pub fn shapes(&self) -> Vec<GraphShape> {
        let mut batches: Vec<usize> = Vec::new();
        let mut n = 1;
        while n <= self.max_num_seqs {
            batches.push(n);
            n = decode_bucket(n + 1);
        }
        batches
            .into_iter()
            .rev()
            .filter_map(|batch| {
                let grid = DecodeGrid::for_bucket(
                    batch,
                    self.num_q_heads,
                    self.num_kv_heads,
                    self.num_sms,
                )?;
                Some(GraphShape {
                    batch,
                    max_seq_len: grid.max_keys().min(self.max_model_len),
                })
            })
            .collect()
    }
}

/// The graph shape that replays `inputs`, if one does: decodes only, every sequence
/// sampled, no more sequences than the largest graph and none longer than its grid.
pub fn shape_for(shapes: &[GraphShape], inputs: &StepInputs) -> Option<GraphShape> {
    let n = inputs.num_seqs();
    let decodes_only = n > 0
        && inputs.num_tokens() == n
        && inputs
            .query_start_loc
            .iter()
            .enumerate()
            .all(|(i, &q)| q == i as i32)
        && inputs.samples_every_token();
    if !decodes_only {
        return None;
    }
    let longest = inputs.seq_lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    // Shapes are largest first: the last that fits is the smallest.
    shapes
        .iter()
        .rev()
        .find(|s| s.batch >= n && s.max_seq_len >= longest)
        .copied()
}

/// `inputs` (decodes only) padded to `shape`: extra sequences of one key (block 0) whose
/// K/V are not written. The block tables keep the step's row width, which the decode
/// kernel reads from the step's buffers, not from the graph.
pub fn pad_decode_step(inputs: &StepInputs, shape: GraphShape) -> StepInputs {
    let (b, w) = (shape.batch, inputs.max_blocks_per_seq.max(1));
    let pad = |v: &[i32], fill: i32| {
        let mut out = v.to_vec();
        out.resize(b, fill);
        out
    };
    let mut block_tables = vec![0; b * w];
    block_tables[..inputs.block_tables.len()].copy_from_slice(&inputs.block_tables);
    StepInputs {
        input_ids: pad(&inputs.input_ids, 0),
        positions: pad(&inputs.positions, 0),
        slot_mapping: pad(&inputs.slot_mapping, -1),
        block_tables,
        max_blocks_per_seq: w,
        seq_lens: pad(&inputs.seq_lens, 1),
        query_start_loc: (0..=b as i32).collect(),
        logits_indices: (0..b as i32).collect(),
    }
}

/// A step of `batch` one-token sequences of one key each, the input a graph is captured
/// on.
fn capture_step(shape: GraphShape) -> StepInputs {
    let empty = StepInputs {
        max_blocks_per_seq: 1,
        block_tables: Vec::new(),
        ..Default::default()
    };
    pad_decode_step(&empty, shape)
}

/// The first rows of a replayed graph's logits, as a tensor.
pub type LogitsView = Borrowed<CudaTensor>;

pub struct CudaGraphs {
    /// Largest first, as `GraphGeometry::shapes` gives them.
    shapes: Vec<GraphShape>,
    graphs: BTreeMap<usize, CapturedGraph>,
    vocab: usize,
    /// Where the graphs whose logits fell outside the arena copy them (allocated only
    /// then): [largest batch, vocab]. Held for those graphs, which write it by address.
    _spill: Option<CudaTensor>,
    /// The memory of every graph's activations (capture_arena.rs in the kernels crate).
    arena: CaptureArena,
}

struct CapturedGraph {
    graph: CudaGraph,
    /// The device address of its logits, [batch, vocab]: in the arena, or `spill`.
    logits: u64,
}

impl CudaGraphs {
    /// Captures a graph of every shape of `geometry` over `cache` (largest first, so
    /// that the smaller graphs fit in the memory the larger ones used).
    pub fn capture(
        b: &CudaBackend,
        model: &LlamaForCausalLM<CudaBackend>,
        cache: &mut KvCache<CudaBackend>,
        geometry: &GraphGeometry,
        vocab: usize,
    ) -> Result<Self> {
        let shapes = geometry.shapes();
        let arena = warm_up_and_size_arena(b, model, cache, &shapes)?;
        let mut graphs = BTreeMap::new();
        let mut spill: Option<CudaTensor> = None;
        let spill_shape = [shapes.first().map_or(1, |s| s.batch), vocab];
        for &shape in &shapes {
            let what = || {
                let n = shape.batch;
                format!("capturing the CUDA graph of {n} sequences (--enforce-eager runs without)")
            };
            let captured =
                capture_or_spill(b, model, cache, shape, &arena, &mut spill, spill_shape)
                    .with_context(what)?;
            graphs.insert(shape.batch, captured);
        }
        let (arena_mib, allocation_nodes) = (arena.high_water() >> 20, arena.fallbacks());
        let gemms = b.gemm_tuning_counts();
        tracing::info!(
            arena_mib,
            allocation_nodes,
            logits_outside_the_arena = spill.is_some(),
            gemm_shapes = gemms.shapes,
            cublaslt_won = gemms.cublaslt,
            timed_now = gemms.timed,
            "activations and GEMMs of the CUDA graphs"
        );
        if allocation_nodes > 0 {
            // Correct still, but those nodes keep PDL from joining the kernels around them.
            tracing::warn!(
                allocation_nodes,
                "some graph buffers did not fit the capture arena and were allocated inside \
                 the capture"
            );
        }
        Ok(Self {
            shapes,
            graphs,
            vocab,
            _spill: spill,
            arena,
        })
    }

    pub fn num_graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Buffers that did not fit the arena and were allocated inside a capture.
    pub fn allocation_nodes(&self) -> usize {
        self.arena.fallbacks()
    }

    pub fn largest_batch(&self) -> usize {
        self.shapes.first().map_or(0, |s| s.batch)
    }

    /// The graph shape that replays this step, if any.
    pub fn shape_for(&self, inputs: &StepInputs) -> Option<GraphShape> {
        shape_for(&self.shapes, inputs)
    }

    /// Replays the graph of `shape` on `inputs` padded to it, with `copies` (a deferred
    /// step's tokens) applied to its input ids first; the logits of the step's sequences,
    /// in order.
    pub fn replay(
        &self,
        b: &CudaBackend,
        inputs: &StepInputs,
        shape: GraphShape,
        copies: Option<&InputCopies>,
    ) -> Result<LogitsView> {
        let captured = self
            .graphs
            .get(&shape.batch)
            .context("no CUDA graph of this size")?;
        // Staged where the graph reads: the metadata handles are not needed past this.
        drop(b.upload_step(&pad_decode_step(inputs, shape))?);
        // A deferred step's tokens, into the same input ids (padding rows follow the
        // step's own, so their positions are the step's).
        if let Some(c) = copies {
            c.apply(b)?;
        }
        captured
            .graph
            .launch()
            .map_err(|e| anyhow::anyhow!("CUDA driver: launching a graph failed: {e:?}"))?;
        let (rows, vocab) = (inputs.num_seqs(), self.vocab);
        // SAFETY: the first `rows` of the graph's `shape.batch` logits rows, in the arena
        // (or `spill`), which outlives every view; the runner queues their readers before
        // the next replay and drops the view before the next step.
        Ok(unsafe {
            Borrowed::new(CudaTensor {
                shape: vec![rows, vocab],
                buf: b
                    .dev
                    .stream
                    .upgrade_device_ptr::<u8>(captured.logits, rows * vocab * b.dtype().size())
                    .into(),
            })
        })
    }
}

/// Runs every shape's capture step once, eagerly: whatever a first call sets up (cuBLAS's
/// heuristics, the stream-ordered pool) happens outside the captures, and the GEMMs of
/// each batch size choose their algorithms, which the graphs then keep. The passes also
/// measure the arena: as large as the most any of them spans, with an eighth more, as a
/// capture's buffers may fall into the ranges less tightly. (The largest shape alone is
/// not enough: a split decode grid of a smaller bucket can take more attention partials
/// than a largest grid of whole sequences.)
fn warm_up_and_size_arena(
    b: &CudaBackend,
    model: &LlamaForCausalLM<CudaBackend>,
    cache: &mut KvCache<CudaBackend>,
    shapes: &[GraphShape],
) -> Result<CaptureArena> {
    let measuring = CaptureArena::measuring();
    for &shape in shapes {
        let meta = b.upload_step(&capture_step(shape))?;
        b.ops.with_capture_arena(&measuring, || {
            b.tuning_gemms(|| -> Result<()> {
                drop(model.compute_logits(b, &model.forward(b, &meta, cache)?, &meta)?);
                Ok(())
            })
        })?;
    }
    if shapes.is_empty() {
        return Ok(measuring);
    }
    let bytes = measuring.high_water();
    CaptureArena::backed(&b.dev.stream, bytes + bytes / 8)
}

/// `capture_one`, its logits left in the arena; or, where they fell outside it (rare: the
/// arena is sized by the same passes), captured again copying them into `spill`, a buffer
/// of `spill_shape` ([largest batch, vocab]) allocated the first time.
fn capture_or_spill(
    b: &CudaBackend,
    model: &LlamaForCausalLM<CudaBackend>,
    cache: &mut KvCache<CudaBackend>,
    shape: GraphShape,
    arena: &CaptureArena,
    spill: &mut Option<CudaTensor>,
    spill_shape: [usize; 2],
) -> Result<CapturedGraph> {
    if let Some(captured) = capture_one(b, model, cache, shape, None, arena)? {
        return Ok(captured);
    }
    if spill.is_none() {
        *spill = Some(CudaTensor {
            buf: b.ops.alloc_zeros(spill_shape[0] * spill_shape[1])?.into(),
            shape: spill_shape.to_vec(),
        });
    }
    capture_one(b, model, cache, shape, spill.as_mut(), arena)?
        .context("a graph's logits copied into the spill buffer")
}

/// Captures one forward pass of `shape`'s capture step (run eagerly before, by
/// `warm_up_and_size_arena`), its activations taken from `arena`, its logits left there,
/// or copied into `spill` when given. None when they fell outside the arena and no
/// `spill` was given: the pool's memory would be freed at the graph's end.
fn capture_one(
    b: &CudaBackend,
    model: &LlamaForCausalLM<CudaBackend>,
    cache: &mut KvCache<CudaBackend>,
    shape: GraphShape,
    spill: Option<&mut CudaTensor>,
    arena: &CaptureArena,
) -> Result<Option<CapturedGraph>> {
    let meta = b.upload_step(&capture_step(shape))?;
    let stream = &b.dev.stream;
    let (graph, forward) = b.ops.with_capture_arena(arena, || {
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow::anyhow!("CUDA driver: beginning a capture failed: {e:?}"))?;
        let forward = (|| -> Result<Option<u64>> {
            let hidden = model.forward(b, &meta, cache)?;
            let logits = model.compute_logits(b, &hidden, &meta)?;
            // Every tensor of the pass gives its range back to the arena when this returns,
            // so that the next capture starts from an empty one; the graph keeps writing
            // its logits to theirs.
            let address = |t: &CudaTensor| cudarc::driver::DevicePtr::device_ptr(&*t.buf, stream).0;
            let Some(out) = spill else {
                return Ok(logits.buf.from_arena().then(|| address(&logits)));
            };
            let row = logits.cols() * b.dtype().size();
            b.ops
                .copy_2d(&logits.buf, 0, row, &mut out.buf, 0, row, row, shape.batch)?;
            Ok(Some(address(out)))
        })();
        // The capture must end whatever happened, or the stream stays in capture mode.
        Ok((stream.end_capture(CUgraphInstantiate_flags(0)), forward))
    })?;
    let Some(logits) = forward? else {
        return Ok(None);
    };
    let graph = graph
        .map_err(|e| anyhow::anyhow!("CUDA driver: ending a capture failed: {e:?}"))?
        .context("the capture recorded nothing")?;
    // Uploaded now, so that the first replay does not pay for it.
    graph
        .upload()
        .map_err(|e| anyhow::anyhow!("CUDA driver: uploading a graph failed: {e:?}"))?;
    Ok(Some(CapturedGraph { graph, logits }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(max_num_seqs: usize) -> GraphGeometry {
        GraphGeometry {
            max_num_seqs,
            max_model_len: 40_960,
            num_q_heads: 16,
            num_kv_heads: 8,
            num_sms: 132,
        }
    }

    #[test]
    fn graphs_cover_the_ladder_up_to_max_num_seqs_largest_first() {
        let batches: Vec<usize> = geometry(40).shapes().iter().map(|s| s.batch).collect();
        assert_eq!(batches, vec![40, 32, 24, 16, 8, 4, 2, 1]);
        let batches: Vec<usize> = geometry(30).shapes().iter().map(|s| s.batch).collect();
        assert_eq!(batches, vec![24, 16, 8, 4, 2, 1]);
        // Batch 1 spreads over many partitions: it reaches the whole context.
        let one = *geometry(1).shapes().last().unwrap();
        assert_eq!(one.max_seq_len, 40_960);
        // A GQA group too wide for the decode kernel gets no graphs.
        let wide = GraphGeometry {
            num_kv_heads: 1,
            ..geometry(8)
        };
        assert!(wide.shapes().is_empty());
    }

    fn decode_step(lens: &[i32]) -> StepInputs {
        let n = lens.len();
        StepInputs {
            input_ids: (0..n as i32).map(|i| 100 + i).collect(),
            positions: lens.iter().map(|l| l - 1).collect(),
            slot_mapping: (0..n as i32).map(|i| 16 * i + 3).collect(),
            block_tables: (0..2 * n as i32).collect(),
            max_blocks_per_seq: 2,
            seq_lens: lens.to_vec(),
            query_start_loc: (0..=n as i32).collect(),
            logits_indices: (0..n as i32).collect(),
        }
    }

    #[test]
    fn a_decode_step_goes_to_the_smallest_graph_that_holds_it() {
        let shapes = geometry(256).shapes();
        assert_eq!(
            shape_for(&shapes, &decode_step(&[20, 30, 17]))
                .unwrap()
                .batch,
            4
        );
        assert_eq!(shape_for(&shapes, &decode_step(&[5; 9])).unwrap().batch, 16);
        // Too long for the grid of 256 sequences, not for a smaller batch's.
        let big = shapes[0];
        let mut lens = vec![5; 200];
        lens[7] = big.max_seq_len as i32 + 1;
        assert_eq!(shape_for(&shapes, &decode_step(&lens)), None);
        // A prefill token, or a sequence that samples nothing, runs eagerly.
        let mut prefill = decode_step(&[20, 30]);
        prefill.query_start_loc = vec![0, 1, 3];
        prefill.input_ids.push(7);
        assert_eq!(shape_for(&shapes, &prefill), None);
        let mut silent = decode_step(&[20, 30]);
        silent.logits_indices.pop();
        assert_eq!(shape_for(&shapes, &silent), None);
        assert_eq!(shape_for(&shapes, &decode_step(&[4; 257])), None);
    }

    #[test]
    fn only_every_token_sampled_in_order_skips_the_logits_gather() {
        let step = decode_step(&[20, 30, 17]);
        assert!(step.samples_every_token());
        let mut reordered = decode_step(&[20, 30, 17]);
        reordered.logits_indices = vec![1, 0, 2];
        assert!(!reordered.samples_every_token());
        let mut silent = decode_step(&[20, 30, 17]);
        silent.logits_indices.pop();
        assert!(!silent.samples_every_token());
        // Two prompts of 2 and 1 tokens: the last token of each.
        let mut prefill = decode_step(&[2, 1]);
        prefill.query_start_loc = vec![0, 2, 3];
        prefill.input_ids.push(7);
        prefill.logits_indices = vec![1, 2];
        assert!(!prefill.samples_every_token());
    }

    #[test]
    fn padding_adds_one_key_sequences_that_write_nothing() {
        let step = decode_step(&[20, 30, 17]);
        let shape = GraphShape {
            batch: 4,
            max_seq_len: 80,
        };
        let p = pad_decode_step(&step, shape);
        assert_eq!(p.input_ids, vec![100, 101, 102, 0]);
        assert_eq!(p.positions, vec![19, 29, 16, 0]);
        assert_eq!(p.slot_mapping, vec![3, 19, 35, -1]);
        assert_eq!(p.seq_lens, vec![20, 30, 17, 1]);
        assert_eq!(p.query_start_loc, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.logits_indices, vec![0, 1, 2, 3]);
        // The step's own width: the kernel reads it from the step's buffers.
        assert_eq!(p.max_blocks_per_seq, 2);
        assert_eq!(p.block_tables, vec![0, 1, 2, 3, 4, 5, 0, 0]);
    }
}
