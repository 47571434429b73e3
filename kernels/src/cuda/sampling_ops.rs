//! Launch wrapper of `sample_tokens_ex` (sampling.cu): logits processors (penalties,
//! logit_bias, min_tokens), sampling and raw logprobs of a batch of rows in one launch.
//!
//! The host describes the processors as a sparse, per-row list of the tokens they touch
//! ([`LogitEntry`], sorted by token), so only what a request's history implies is uploaded,
//! and only the sampled tokens and the asked-for logprobs come back.
//!
//! Rows without entries or logprobs take the fast path (sampling_fast.cu: each row split
//! over many blocks, one or two launches; top-k / top-p rows merge per-chunk candidates
//! exactly, or hand the row back when they cannot); the rest, and the rows handed back,
//! take `sample_tokens_ex` (one block per row), launched after. Both give the CPU
//! sampler's tokens.

use std::sync::Mutex;

use anyhow::{ensure, Result};
use cudarc::driver::{
    CudaEvent, CudaSlice, DeviceRepr, LaunchConfig, PinnedHostSlice, ValidAsZeroBits,
};

use super::device::driver_error;
use super::ops::{launch, rows_cfg, CudaOps};

/// Most top logprobs per row (vLLM's `max_logprobs` default, `MAX_LOGPROBS` in sampling.cu).
pub const MAX_LOGPROBS: usize = 20;
/// [`LogitEntry::flags`]: the token was seen in the prompt or the output (repetition
/// penalty).
pub const ENTRY_REPEAT: i32 = 1;
/// [`LogitEntry::flags`]: min_tokens is not reached and the token would end the request.
pub const ENTRY_MASK: i32 = 2;

/// [`SampleRowEx::path`]: the row is sampled by sampling_fast.cu (`PATH_FAST` there).
pub const PATH_FAST: i32 = 1;
/// Tokens of one block of the fast path (`FAST_CHUNK` in sampling_fast.cu), of one block
/// of `sample_fast_draw` (`DRAW_CHUNK`) and of one of `sample_fast_max` and
/// `sample_fast_max_race` (`MAX_CHUNK`).
const FAST_CHUNK: usize = 16384;
const DRAW_CHUNK: usize = 8192;
const MAX_CHUNK: usize = 8192;
/// Threads of one block of the fast path (`FAST_THREADS` in sampling_fast.cu).
const FAST_THREADS: u32 = 256;
/// Candidate slots of one chunk of a top-k / top-p row: `FAST_WARPS` × `TOP_WCAP` in
/// sampling_fast.cu.
const TOP_WARP_SLOTS: usize = FAST_THREADS as usize / 32;
const TOP_WCAP: usize = 32;
/// Vocabularies whose top-k / top-p rows the fast path takes: its merge keys a token by
/// 21 bits of id (`TOP_RANK_BITS` in sampling_fast.cu); larger ones use the general kernel.
const TOP_MAX_VOCAB: usize = 1 << 21;

/// One (row, token) the logits processors change (`LogitEntry` in sampling.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LogitEntry {
    pub token: i32,
    /// Occurrences in the output (frequency and presence penalties); 0: none.
    pub count: i32,
    /// `ENTRY_REPEAT` | `ENTRY_MASK`.
    pub flags: i32,
    /// The token's logit_bias values are `biases[bias_begin..bias_end]`, added in order.
    pub bias_begin: i32,
    pub bias_end: i32,
}
// SAFETY: repr(C) plain data, the layout of the CUDA struct.
unsafe impl DeviceRepr for LogitEntry {}

/// One row's sampling parameters (`SampleRow` in sampling.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SampleRow {
    pub temperature: f32,
    /// <= 0: off.
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    /// The row's uniform draw in [0, 1): the inverse CDF's target, or a plain temperature
    /// row's race key (its 53 bits, worker/src/exponential_race.rs).
    pub uniform: f64,
}
// SAFETY: repr(C) plain data, the layout of the CUDA struct.
unsafe impl DeviceRepr for SampleRow {}

/// One row of `sample_tokens_ex` (`SampleRowEx` in sampling.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SampleRowEx {
    pub base: SampleRow,
    /// The row's entries, `entries[entry_begin..entry_end]`, sorted by token, unique.
    pub entry_begin: i32,
    pub entry_end: i32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// < 0: no logprobs; else the number of top logprobs (at most `MAX_LOGPROBS`).
    pub logprobs: i32,
    /// Where the row's [`TokenLogprobsOut`] goes (rows with logprobs only).
    pub logprobs_slot: i32,
    /// Which kernel samples the row ([`PATH_FAST`] or 0); set by `sample_tokens_ex`, so
    /// callers leave it 0.
    pub path: i32,
}
// SAFETY: repr(C) plain data, the layout of the CUDA struct.
unsafe impl DeviceRepr for SampleRowEx {}
// SAFETY: plain numbers; all zero bits is a valid row (the `Default` one but for the
// repetition penalty and logprobs, which nothing reads from a padding row).
unsafe impl ValidAsZeroBits for SampleRowEx {}

impl SampleRowEx {
    /// Whether the fast path samples this row: no logits-processor entries and no
    /// logprobs. Its top-k / top-p rows ([`Self::is_top`]) may still be handed to the
    /// general kernel on the GPU, when their candidates cannot give the exact answer.
    pub fn takes_fast_path(&self) -> bool {
        self.entry_begin == self.entry_end && self.logprobs < 0
    }

    /// A draw with top-k or top-p on, as the kernels decide it (`top_k > 0`, `top_p < 1`:
    /// a NaN top_p is off).
    pub fn is_top(&self) -> bool {
        !self.is_greedy() && (self.base.top_k > 0 || self.base.top_p < 1.0)
    }

    /// A top row whose top-p may need the row's whole mass (no top-k to bound it), so the
    /// fast path's second launch.
    fn may_need_total(&self) -> bool {
        self.is_top() && self.base.top_k <= 0
    }

    /// A draw by the exponential race (`race_row` in sampling_fast.cu): temperature without
    /// min-p, top-k or top-p.
    fn races(&self) -> bool {
        let min_p_off = self.base.min_p <= 0.0 || self.base.min_p.is_nan();
        !self.is_greedy() && !self.is_top() && min_p_off
    }

    /// Greedy as the kernels decide it (`temperature < 1e-5`).
    pub fn is_greedy(&self) -> bool {
        self.base.temperature < 1e-5
    }

    /// `base`'s sampling with no logits processors and no logprobs.
    pub fn plain(base: SampleRow) -> Self {
        Self {
            base,
            repetition_penalty: 1.0,
            logprobs: -1,
            ..Default::default()
        }
    }
}

/// Raw logprobs of one row (`TokenLogprobsOut` in sampling.cu).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprobsOut {
    /// Of the sampled token.
    pub logprob: f32,
    /// 1-based: how many tokens have a logprob >= the sampled one's.
    pub rank: i32,
    /// Valid entries of `top_ids` / `top_logprobs`, best first.
    pub num_top: i32,
    pub top_ids: [i32; MAX_LOGPROBS],
    pub top_logprobs: [f32; MAX_LOGPROBS],
}
// SAFETY: repr(C) plain data, the layout of the CUDA struct.
unsafe impl DeviceRepr for TokenLogprobsOut {}

impl TokenLogprobsOut {
    /// What a kernel that wrote nothing leaves behind (tests poison outputs with it).
    pub fn poison() -> Self {
        Self {
            logprob: f32::NAN,
            rank: -1,
            num_top: -1,
            top_ids: [-1; MAX_LOGPROBS],
            top_logprobs: [f32::NAN; MAX_LOGPROBS],
        }
    }
}

/// The host side of one `sample_tokens_ex` launch: row `i` of the logits is sampled with
/// `rows[i]`.
pub struct SamplingBatch<'a> {
    pub rows: &'a [SampleRowEx],
    pub entries: &'a [LogitEntry],
    pub biases: &'a [f32],
    /// Rows with logprobs; their `logprobs_slot`s are 0..num_logprobs, each once.
    pub num_logprobs: usize,
}

impl<'a> SamplingBatch<'a> {
    /// Rows without logits-processor entries or logprobs.
    pub fn plain(rows: &'a [SampleRowEx]) -> Self {
        Self {
            rows,
            entries: &[],
            biases: &[],
            num_logprobs: 0,
        }
    }
}

/// What comes back: a token per row, and the logprobs of each slot.
#[derive(Debug, Clone)]
pub struct SampledBatch {
    pub tokens: Vec<i32>,
    pub logprobs: Vec<TokenLogprobsOut>,
    /// Top-k / top-p rows the fast path handed to the general kernel (counted in `poison`
    /// calls only, for tests: it costs a read-back).
    pub handed_back: usize,
}

impl SamplingBatch<'_> {
    /// Every index the kernel will follow is inside its buffer, entries are sorted and
    /// unique per row, and every logprobs slot is used once.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        ensure!(vocab > 0, "sampling: empty vocabulary");
        let mut slot_used = vec![false; self.num_logprobs];
        for (i, r) in self.rows.iter().enumerate() {
            let (b, e) = (r.entry_begin, r.entry_end);
            ensure!(
                0 <= b && b <= e && e as usize <= self.entries.len(),
                "sampling row {i}: entries {b}..{e} outside 0..{}",
                self.entries.len()
            );
            let mut prev = -1i64;
            for en in &self.entries[b as usize..e as usize] {
                ensure!(
                    i64::from(en.token) > prev && (en.token as usize) < vocab,
                    "sampling row {i}: entry token {} unsorted, repeated or outside the \
                     vocabulary of {vocab}",
                    en.token
                );
                prev = i64::from(en.token);
                ensure!(
                    0 <= en.bias_begin
                        && en.bias_begin <= en.bias_end
                        && en.bias_end as usize <= self.biases.len(),
                    "sampling row {i}: biases {}..{} outside 0..{}",
                    en.bias_begin,
                    en.bias_end,
                    self.biases.len()
                );
            }
            if r.logprobs >= 0 {
                ensure!(
                    r.logprobs as usize <= MAX_LOGPROBS,
                    "sampling row {i}: {} logprobs asked, at most {MAX_LOGPROBS}",
                    r.logprobs
                );
                let slot = r.logprobs_slot;
                ensure!(
                    0 <= slot && (slot as usize) < self.num_logprobs && !slot_used[slot as usize],
                    "sampling row {i}: logprobs slot {slot} outside 0..{} or used twice",
                    self.num_logprobs
                );
                slot_used[slot as usize] = true;
            }
        }
        Ok(())
    }
}

/// The fast sampler's buffers, kept across calls and grown only when a batch needs more
/// rows or chunks than any before, so that a step allocates nothing on the device: the
/// rows go up in one copy from pinned memory and the tokens come back into pinned memory.
/// Held by [`CudaOps`]; the lock makes concurrent calls wait for each other.
#[derive(Default)]
pub struct SamplingScratch(Mutex<Option<ScratchBuffers>>);

/// [`SamplingScratch`]'s buffers for up to `rows` rows of up to `chunks` fast-path chunks.
struct ScratchBuffers {
    rows: usize,
    chunks: usize,
    params_host: PinnedHostSlice<SampleRowEx>,
    /// Recorded behind the copy out of `params_host`: a call that does not wait for its
    /// tokens (`sample_tokens_on_device`) may still have that copy queued when the next
    /// call writes the pinned rows.
    params_copied: CudaEvent,
    params: CudaSlice<SampleRowEx>,
    tokens_host: PinnedHostSlice<i32>,
    tokens: CudaSlice<i32>,
    /// rows × chunks partials of the fast path's two launches.
    part_val: CudaSlice<f32>,
    part_id: CudaSlice<i32>,
    part_mass: CudaSlice<f64>,
    part_last: CudaSlice<i32>,
    /// Candidates of top rows: TOP_WCAP entries, a count and a bound per warp slot (rows ×
    /// chunks × TOP_WARP_SLOTS of them).
    cand: CudaSlice<u64>,
    cand_n: CudaSlice<i32>,
    cand_bound: CudaSlice<u32>,
    /// Per-row arrival counters: zero when allocated, and each launch's last block of a
    /// row puts its back to zero.
    counters: CudaSlice<u32>,
    /// Per-row argmax keys of `sample_fast_max`: zero when allocated, and put back to zero
    /// by the row's last block after it reads its key.
    row_key: CudaSlice<u64>,
    row_max: CudaSlice<f32>,
    row_fallback: CudaSlice<i32>,
    /// What `sample_tokens_ex` is given for a batch without entries or logprobs (one
    /// element each, never read or written there).
    no_entries: CudaSlice<LogitEntry>,
    no_biases: CudaSlice<f32>,
    no_values: CudaSlice<f32>,
    no_logprobs: CudaSlice<TokenLogprobsOut>,
}

impl ScratchBuffers {
    fn new(ops: &CudaOps, rows: usize, chunks: usize) -> Result<Self> {
        let n = rows * chunks;
        let slots = n * TOP_WARP_SLOTS;
        let ctx = ops.stream.context();
        let err = |e| driver_error("allocating the sampler's buffers", e);
        // SAFETY (the `alloc`s and `alloc_pinned_with_flags`): each element is written
        // before it is read: the rows and tokens by the host or the kernels of a call, the
        // partials and candidates by a chunk's block before its row's last block reads them.
        let alloc = |len: usize| unsafe { ops.stream.alloc::<f32>(len) }.map_err(err);
        // Page-locked, not write-combined (the host reads the tokens back); zeroed here, so
        // the host never sees uninitialised memory.
        let mut params_host = unsafe { ctx.alloc_pinned_with_flags(rows, 0) }.map_err(err)?;
        params_host
            .as_mut_slice()
            .map_err(err)?
            .fill(SampleRowEx::default());
        let mut tokens_host = unsafe { ctx.alloc_pinned_with_flags(rows, 0) }.map_err(err)?;
        tokens_host.as_mut_slice().map_err(err)?.fill(0);
        Ok(Self {
            rows,
            chunks,
            params_host,
            params_copied: ctx.new_event(None).map_err(err)?,
            params: unsafe { ops.stream.alloc(rows) }.map_err(err)?,
            tokens_host,
            tokens: unsafe { ops.stream.alloc(rows) }.map_err(err)?,
            part_val: alloc(n)?,
            part_id: unsafe { ops.stream.alloc(n) }.map_err(err)?,
            part_mass: unsafe { ops.stream.alloc(n) }.map_err(err)?,
            part_last: unsafe { ops.stream.alloc(n) }.map_err(err)?,
            cand: unsafe { ops.stream.alloc(slots * TOP_WCAP) }.map_err(err)?,
            cand_n: unsafe { ops.stream.alloc(slots) }.map_err(err)?,
            cand_bound: unsafe { ops.stream.alloc(slots) }.map_err(err)?,
            counters: ops.stream.alloc_zeros(rows).map_err(err)?,
            row_key: ops.stream.alloc_zeros(rows).map_err(err)?,
            row_max: alloc(rows)?,
            row_fallback: unsafe { ops.stream.alloc(rows) }.map_err(err)?,
            no_entries: unsafe { ops.stream.alloc(1) }.map_err(err)?,
            no_biases: alloc(1)?,
            no_values: alloc(1)?,
            no_logprobs: unsafe { ops.stream.alloc(1) }.map_err(err)?,
        })
    }

    /// Copies `rows` (at most `self.rows`) to `params` through the pinned buffer.
    fn upload_rows(&mut self, ops: &CudaOps, rows: &[SampleRowEx]) -> Result<()> {
        self.params_copied
            .synchronize()
            .map_err(|e| driver_error("waiting for the last sampling rows' copy", e))?;
        let host = self
            .params_host
            .as_mut_slice()
            .map_err(|e| driver_error("waiting for the sampler's row buffer", e))?;
        host[..rows.len()].copy_from_slice(rows);
        ops.stream
            .memcpy_htod(&self.params_host, &mut self.params)
            .map_err(|e| driver_error("copying sampling rows to the GPU", e))?;
        self.params_copied
            .record(&ops.stream)
            .map_err(|e| driver_error("recording an event", e))
    }

    /// The first `rows` tokens, through the pinned buffer (waits for the stream).
    fn download_tokens(&mut self, ops: &CudaOps, rows: usize) -> Result<Vec<i32>> {
        ops.stream
            .memcpy_dtoh(&self.tokens, &mut self.tokens_host)
            .map_err(|e| driver_error("copying sampled tokens from the GPU", e))?;
        // The context does not track events (device.rs), so the pinned slice's own wait
        // below waits for nothing: the copy is awaited here.
        ops.stream
            .synchronize()
            .map_err(|e| driver_error("waiting for the sampled tokens", e))?;
        let host = self
            .tokens_host
            .as_slice()
            .map_err(|e| driver_error("waiting for the sampled tokens", e))?;
        Ok(host[..rows].to_vec())
    }
}

impl SamplingScratch {
    /// The buffers, grown to hold `rows` rows of `chunks` chunks.
    fn buffers<'a>(
        slot: &'a mut Option<ScratchBuffers>,
        ops: &CudaOps,
        rows: usize,
        chunks: usize,
    ) -> Result<&'a mut ScratchBuffers> {
        let fits = slot
            .as_ref()
            .is_some_and(|b| b.rows >= rows && b.chunks >= chunks);
        if !fits {
            let (r, c) = slot
                .as_ref()
                .map_or((rows, chunks), |b| (b.rows.max(rows), b.chunks.max(chunks)));
            *slot = None; // free the old buffers first
            *slot = Some(ScratchBuffers::new(ops, r, c)?);
        }
        slot.as_mut()
            .ok_or_else(|| anyhow::anyhow!("sampling: buffers missing after allocation"))
    }
}

/// Which kernels of the fast path a batch takes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct FastPlan {
    /// Some rows are top rows: `sample_fast_top` (their candidates and merge) instead of
    /// `sample_fast_max`, and `sample_fast_draw_top` when a second launch is needed.
    top: bool,
    /// Some row races (`sample_fast_max_race`, or inside `sample_fast_top`).
    race: bool,
    /// A second launch is needed: min-p rows and top-p rows that may need the row's total
    /// mass.
    draw: bool,
}

impl FastPlan {
    /// The plan of the rows that take the fast path.
    fn of<'a>(rows: impl Iterator<Item = &'a SampleRowEx>) -> Self {
        let (mut top, mut race, mut min_p, mut need_total) = (false, false, false, false);
        for r in rows {
            top |= r.is_top();
            race |= r.races();
            min_p |= !r.is_greedy() && !r.is_top() && !r.races();
            need_total |= r.may_need_total();
        }
        Self {
            top,
            race: race && !top,
            draw: min_p || need_total,
        }
    }
}

/// What `enqueue_sampling` launched.
struct Enqueued {
    /// The rows as uploaded (with their paths).
    rows_ex: Vec<SampleRowEx>,
    /// Whether any row took the top fast path.
    top: bool,
    /// The logprobs buffer, when the batch asks for logprobs.
    logprobs: Option<CudaSlice<TokenLogprobsOut>>,
}

impl CudaOps {
    /// Copies `data` to the device (at least one element: empty buffers are not
    /// allocatable; the kernel reads none of a padding element).
    pub fn upload_padded<T: DeviceRepr + Copy>(&self, data: &[T], pad: T) -> Result<CudaSlice<T>> {
        let padded;
        let src = if data.is_empty() {
            padded = [pad];
            &padded[..]
        } else {
            data
        };
        self.stream
            .clone_htod(src)
            .map_err(|e| driver_error(&format!("copying {} elements to the GPU", data.len()), e))
    }

    /// An output buffer of `n` (at least one) elements: uninitialised, or filled with
    /// `poison` so that a value the kernel should have written and did not shows.
    fn output<T: DeviceRepr + Copy>(&self, n: usize, poison: Option<T>) -> Result<CudaSlice<T>> {
        match poison {
            Some(p) => self.upload_padded(&vec![p; n], p),
            // SAFETY: the kernel writes every element the host reads back.
            None => unsafe { self.stream.alloc::<T>(n.max(1)) }
                .map_err(|e| driver_error("allocating sampling outputs", e)),
        }
    }

    /// The fast path's launches over the rows marked [`PATH_FAST`] in `s.params`, as
    /// `plan` says; the other rows' blocks return at once.
    fn sample_fast(
        &self,
        logits: &CudaSlice<u8>,
        vocab: i32,
        rows: usize,
        s: &mut ScratchBuffers,
        plan: FastPlan,
    ) -> Result<()> {
        let FastPlan { top, race, draw } = plan;
        ensure!(
            rows <= 65_535,
            "sampling: {rows} rows exceed the fast path's grid"
        );
        // (chunk, row), so that a row's blocks run together (sampling_fast.cu's `fast_block`).
        let grid = |chunk: usize| LaunchConfig {
            grid_dim: ((vocab as usize).div_ceil(chunk) as u32, rows as u32, 1),
            block_dim: (FAST_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let cfg = grid(FAST_CHUNK);
        // SAFETY (all launches): the caller checked the logits size; the scratch holds at
        // least rows × (vocab / DRAW_CHUNK, the most chunks of any launch) partials and
        // candidate slots per chunk, and one counter, max and fallback per row, as the
        // kernels index them.
        if top {
            launch!(unsafe self, sample_fast_top, cfg; logits, &vocab, &mut s.params,
                &mut s.part_val, &mut s.part_id, &mut s.cand, &mut s.cand_n,
                &mut s.cand_bound, &mut s.counters, &mut s.row_max, &mut s.row_fallback,
                &mut s.tokens)?;
        } else if race {
            launch!(unsafe self, sample_fast_max_race, grid(MAX_CHUNK); logits, &vocab,
                &s.params, &mut s.row_key, &mut s.counters, &mut s.row_max,
                &mut s.row_fallback, &mut s.tokens)?;
        } else {
            launch!(unsafe self, sample_fast_max, grid(MAX_CHUNK); logits, &vocab, &s.params,
                &mut s.row_key, &mut s.counters, &mut s.row_max, &mut s.row_fallback,
                &mut s.tokens)?;
        }
        if !draw {
            return Ok(());
        }
        if top {
            launch!(unsafe self, sample_fast_draw_top, cfg; logits, &vocab, &mut s.params,
                &mut s.row_max, &s.row_fallback, &mut s.part_mass, &mut s.part_last,
                &mut s.counters, &mut s.tokens, &s.cand, &s.cand_n, &s.cand_bound)
        } else {
            launch!(unsafe self, sample_fast_draw, grid(DRAW_CHUNK); logits, &vocab,
                &mut s.params, &s.row_max, &s.row_fallback, &mut s.part_mass,
                &mut s.part_last, &mut s.counters, &mut s.tokens)
        }
    }

    /// Processes, samples and (where asked) computes raw logprobs of logits rows
    /// [batch.rows.len(), vocab]: one or two split-row launches for the fast rows, then one
    /// launch of one block per row for the general ones (and the top rows the fast path
    /// handed back); the logits are not modified. `poison` fills the outputs with NaN / -1
    /// first (tests). Rows, partials and tokens live in the [`SamplingScratch`]: a batch
    /// without entries or logprobs allocates nothing on the device.
    pub fn sample_tokens_ex(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
        poison: bool,
    ) -> Result<SampledBatch> {
        let rows = batch.rows.len();
        if rows == 0 {
            return Ok(SampledBatch {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                handed_back: 0,
            });
        }
        self.check_logits(logits, vocab, batch)?;
        self.with_scratch(rows, vocab, |s| {
            self.sample_into(logits, vocab, batch, poison, s)
        })
    }

    /// `sample_tokens_ex` without the read-back, for the worker's overlapped steps: the
    /// tokens are copied on the device into `out` (row `i`'s at index `i`) and the call
    /// returns without waiting for them. Batches with logprobs are refused: only the
    /// tokens would come back.
    pub fn sample_tokens_on_device(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
        out: &mut CudaSlice<i32>,
    ) -> Result<()> {
        let rows = batch.rows.len();
        ensure!(
            batch.num_logprobs == 0,
            "sampling on the device only: {} rows ask for logprobs",
            batch.num_logprobs
        );
        ensure!(
            rows > 0 && rows <= out.len(),
            "sampling on the device: {rows} rows for a buffer of {}",
            out.len()
        );
        self.check_logits(logits, vocab, batch)?;
        self.with_scratch(rows, vocab, |s| {
            self.enqueue_sampling(logits, vocab, batch, false, s)?;
            self.stream
                .memcpy_dtod(&s.tokens.slice(..rows), &mut out.slice_mut(..rows))
                .map_err(|e| driver_error("copying sampled tokens on the GPU", e))
        })
    }

    /// Runs `f` on the sampler's buffers, grown for `rows` rows of `vocab` logits. A
    /// failed call drops them: a failed launch may leave counters half counted.
    fn with_scratch<R>(
        &self,
        rows: usize,
        vocab: usize,
        f: impl FnOnce(&mut ScratchBuffers) -> Result<R>,
    ) -> Result<R> {
        let mut slot = self
            .sampling
            .0
            .lock()
            .map_err(|_| anyhow::anyhow!("sampling: a previous call panicked"))?;
        let chunks = vocab.div_ceil(FAST_CHUNK.min(DRAW_CHUNK));
        let s = SamplingScratch::buffers(&mut slot, self, rows, chunks)?;
        let out = f(s);
        if out.is_err() {
            *slot = None;
        }
        out
    }

    /// The sizes `sample_tokens_ex` checks before it launches anything.
    fn check_logits(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
    ) -> Result<()> {
        batch.validate(vocab)?;
        let rows = batch.rows.len();
        let need = rows * vocab * self.dtype.size();
        ensure!(
            logits.len() >= need,
            "sample logits: buffer of {} bytes, {rows}×{vocab} {} elements need {need}",
            logits.len(),
            self.dtype.name()
        );
        Ok(())
    }

    /// `sample_tokens_ex` with its buffers.
    fn sample_into(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
        poison: bool,
        s: &mut ScratchBuffers,
    ) -> Result<SampledBatch> {
        let rows = batch.rows.len();
        let Enqueued {
            rows_ex,
            top,
            logprobs,
        } = self.enqueue_sampling(logits, vocab, batch, poison, s)?;
        let tokens = s.download_tokens(self, rows)?;
        let logprobs = match logprobs {
            Some(l) => self
                .stream
                .clone_dtoh(&l)
                .map_err(|e| driver_error("copying logprobs from the GPU", e))?,
            None => Vec::new(),
        };
        let handed_back = if poison && top {
            let after = self
                .stream
                .clone_dtoh(&s.params)
                .map_err(|e| driver_error("copying sampling rows from the GPU", e))?;
            (rows_ex.iter().zip(&after))
                .filter(|(before, after)| before.path == PATH_FAST && after.path != PATH_FAST)
                .count()
        } else {
            0
        };
        Ok(SampledBatch {
            tokens,
            logprobs,
            handed_back,
        })
    }

    /// Uploads the rows and enqueues the fast and general launches, which leave the tokens
    /// in `s.tokens`.
    fn enqueue_sampling(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
        poison: bool,
        s: &mut ScratchBuffers,
    ) -> Result<Enqueued> {
        let rows = batch.rows.len();
        let v = i32::try_from(vocab)
            .map_err(|_| anyhow::anyhow!("vocab = {vocab} does not fit the kernels' i32"))?;
        let mut rows_ex = batch.rows.to_vec();
        let mut fast = 0usize;
        for r in &mut rows_ex {
            let fits = !r.is_top() || vocab <= TOP_MAX_VOCAB;
            r.path = if r.takes_fast_path() && fits {
                PATH_FAST
            } else {
                0
            };
            fast += usize::from(r.path == PATH_FAST);
        }
        let plan = FastPlan::of(rows_ex.iter().filter(|r| r.path == PATH_FAST));
        s.upload_rows(self, &rows_ex)?;
        if poison {
            self.stream
                .memcpy_htod(&vec![i32::MIN; s.rows], &mut s.tokens)
                .map_err(|e| driver_error("poisoning sampled tokens", e))?;
        }
        if fast > 0 {
            self.sample_fast(logits, v, rows, s, plan)?;
        }
        // After the fast path: its top rows that could not be exact come back with path 0.
        let mut logprobs = None;
        if fast < rows || plan.top {
            logprobs = self.sample_general(logits, v, batch, poison, s)?;
        }
        Ok(Enqueued {
            rows_ex,
            top: plan.top,
            logprobs,
        })
    }

    /// The one-block-per-row launch over the rows whose path is 0 in `s.params`; returns
    /// the logprobs buffer when the batch asks for logprobs.
    fn sample_general(
        &self,
        logits: &CudaSlice<u8>,
        v: i32,
        batch: &SamplingBatch,
        poison: bool,
        s: &mut ScratchBuffers,
    ) -> Result<Option<CudaSlice<TokenLogprobsOut>>> {
        let uploaded;
        let (entries, biases, mut values) = if batch.entries.is_empty() {
            (&s.no_entries, &s.no_biases, None)
        } else {
            uploaded = (
                self.upload_padded(batch.entries, LogitEntry::default())?,
                self.upload_padded(batch.biases, 0.0f32)?,
            );
            let values = self.output(batch.entries.len(), poison.then_some(f32::NAN))?;
            (&uploaded.0, &uploaded.1, Some(values))
        };
        let mut logprobs = match batch.num_logprobs {
            0 => None,
            n => Some(self.output(n, poison.then(TokenLogprobsOut::poison))?),
        };
        let cfg = rows_cfg(batch.rows.len(), 1024);
        // SAFETY: the logits size is checked by the caller, and `validate` checked every
        // index the kernel follows (entry and bias ranges, tokens < vocab, logprobs
        // slots); rows without entries or logprobs read and write none of the one-element
        // stand-ins.
        launch!(unsafe self, sample_tokens_ex, cfg; logits, &v, &s.params, entries, biases,
            values.as_mut().unwrap_or(&mut s.no_values), &mut s.tokens,
            logprobs.as_mut().unwrap_or(&mut s.no_logprobs))?;
        Ok(logprobs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(token: i32) -> LogitEntry {
        LogitEntry {
            token,
            ..Default::default()
        }
    }

    /// `exp_neg` of sampling_fast.cu, step for step in f64 (fma is the same IEEE
    /// operation on both sides). The constants are the CUDA source's, verbatim.
    #[allow(clippy::excessive_precision)]
    fn exp_neg(x: f64) -> f64 {
        if x < -700.0 {
            return x.exp();
        }
        let shifted = x.mul_add(92.332482616893656, 6755399441055744.0);
        let k = shifted.to_bits() as u32 as i32;
        let kd = shifted - 6755399441055744.0;
        let r0 = kd.mul_add(-6.93147180369123816490e-01 / 64.0, x);
        let r = kd.mul_add(-1.90821492927058770002e-10 / 64.0, r0);
        let mut p: f64 = 1.0 / 120.0;
        for c in [1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = p.mul_add(r, c);
        }
        let t = (f64::from(k & 63) / 64.0).exp2();
        let scaled = f64::from_bits(t.to_bits().wrapping_add_signed(i64::from(k >> 6) << 52));
        p * scaled
    }

    /// The fast path's weights stay within 4 ulp of libm's exp over the whole range a
    /// weight takes (the general kernel's exp() is within 1 ulp: the same class of error,
    /// far below what moves a draw).
    #[test]
    fn fast_exp_is_within_a_few_ulp() {
        let mut worst = 0u64;
        let mut s = 12345u64;
        for i in 0..200_000 {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            // Mostly the range logits span, some down to the underflow edge.
            let d = f64::from(if i % 10 == 0 { -750.0 * u } else { -40.0 * u });
            let (got, want) = (exp_neg(d), d.exp());
            let ulp = got.to_bits().abs_diff(want.to_bits());
            worst = worst.max(ulp);
        }
        assert_eq!(exp_neg(0.0), 1.0);
        assert!(worst <= 4, "fast exp off by {worst} ulp");
    }

    #[test]
    fn fast_path_takes_rows_without_processors_or_logprobs() {
        let base = |temperature, top_k, top_p, min_p| SampleRow {
            temperature,
            top_k,
            top_p,
            min_p,
            uniform: 0.5,
        };
        assert!(SampleRowEx::plain(base(0.0, 5, 0.5, 0.0)).takes_fast_path());
        assert!(!SampleRowEx::plain(base(0.0, 5, 0.5, 0.0)).is_top());
        assert!(SampleRowEx::plain(base(0.7, 0, 1.0, 0.1)).takes_fast_path());
        assert!(!SampleRowEx::plain(base(0.7, 0, 1.0, 0.1)).is_top());
        let top_k = SampleRowEx::plain(base(0.7, 5, 1.0, 0.0));
        assert!(top_k.takes_fast_path() && top_k.is_top() && !top_k.may_need_total());
        let top_p = SampleRowEx::plain(base(0.7, 0, 0.9, 0.0));
        assert!(top_p.takes_fast_path() && top_p.is_top() && top_p.may_need_total());
        assert!(!SampleRowEx::plain(base(0.7, 0, f32::NAN, 0.0)).is_top());
        let mut lp = SampleRowEx::plain(base(0.0, 0, 1.0, 0.0));
        lp.logprobs = 0;
        assert!(!lp.takes_fast_path());
        let mut ent = SampleRowEx::plain(base(0.0, 0, 1.0, 0.0));
        ent.entry_end = 1;
        assert!(!ent.takes_fast_path());
    }

    #[test]
    fn fast_plans_launch_what_their_rows_need() {
        let row = |temperature, top_k, top_p, min_p| {
            SampleRowEx::plain(SampleRow {
                temperature,
                top_k,
                top_p,
                min_p,
                uniform: 0.5,
            })
        };
        let greedy = row(0.0, 0, 1.0, 0.0);
        let plain = row(0.7, 0, 1.0, 0.0);
        let min_p = row(0.7, 0, 1.0, 0.1);
        let top_k = row(0.7, 20, 1.0, 0.0);
        let top_p = row(0.7, 0, 0.9, 0.0);
        let plan = |rows: &[SampleRowEx]| FastPlan::of(rows.iter());
        let want = |top, race, draw| FastPlan { top, race, draw };
        assert_eq!(plan(&[greedy]), want(false, false, false));
        assert_eq!(plan(&[greedy, plain]), want(false, true, false));
        assert_eq!(plan(&[plain, min_p]), want(false, true, true));
        assert_eq!(plan(&[greedy, min_p]), want(false, false, true));
        assert_eq!(plan(&[greedy, top_k]), want(true, false, false));
        assert_eq!(plan(&[top_p]), want(true, false, true));
        // sample_fast_top races a plain row itself.
        assert_eq!(plan(&[top_k, plain]), want(true, false, false));
    }

    #[test]
    fn layouts_match_the_cuda_structs() {
        assert_eq!(std::mem::size_of::<SampleRow>(), 24);
        assert_eq!(std::mem::size_of::<SampleRowEx>(), 56);
        assert_eq!(std::mem::align_of::<SampleRowEx>(), 8);
        assert_eq!(std::mem::size_of::<LogitEntry>(), 20);
        assert_eq!(
            std::mem::size_of::<TokenLogprobsOut>(),
            12 + 8 * MAX_LOGPROBS
        );
    }

    #[test]
    fn validate_catches_every_bad_index() {
        let row = |b, e, lp, slot| SampleRowEx {
            entry_begin: b,
            entry_end: e,
            logprobs: lp,
            logprobs_slot: slot,
            ..Default::default()
        };
        let entries = [entry(1), entry(5), entry(2)];
        let ok = SamplingBatch {
            rows: &[row(0, 2, -1, 0), row(2, 3, 3, 0)],
            entries: &entries,
            biases: &[],
            num_logprobs: 1,
        };
        ok.validate(10).unwrap();
        assert!(ok.validate(5).is_err(), "token 5 outside a vocabulary of 5");
        let unsorted = SamplingBatch {
            rows: &[row(1, 3, -1, 0)],
            ..ok
        };
        assert!(unsorted.validate(10).is_err());
        let out_of_range = SamplingBatch {
            rows: &[row(0, 4, -1, 0)],
            ..ok
        };
        assert!(out_of_range.validate(10).is_err());
        let twice = SamplingBatch {
            rows: &[row(0, 0, 1, 0), row(0, 0, 1, 0)],
            num_logprobs: 2,
            ..ok
        };
        assert!(twice.validate(10).is_err());
        let too_many = SamplingBatch {
            rows: &[row(0, 0, 21, 0)],
            ..ok
        };
        assert!(too_many.validate(10).is_err());
        let bad_bias = [LogitEntry {
            token: 0,
            bias_begin: 0,
            bias_end: 2,
            ..Default::default()
        }];
        let bias = SamplingBatch {
            rows: &[row(0, 1, -1, 0)],
            entries: &bad_bias,
            biases: &[1.0],
            num_logprobs: 0,
        };
        assert!(bias.validate(10).is_err());
    }
}
