//! Launch wrapper of `sample_tokens_ex` (sampling.cu): logits processors (penalties,
//! logit_bias, min_tokens), sampling and raw logprobs of a batch of rows in one launch.
//!
//! The host describes the processors as a sparse, per-row list of the tokens they touch
//! ([`LogitEntry`], sorted by token), so only what a request's history implies is uploaded,
//! and only the sampled tokens and the asked-for logprobs come back.
//!
//! Rows without entries or logprobs that are greedy or temperature (+ min-p) sampled take
//! the fast path (sampling_fast.cu: each row split over many blocks, two launches); the
//! rest take `sample_tokens_ex` (one block per row). Both give the CPU sampler's tokens.

use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

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
/// Tokens of one block of the fast path (`FAST_CHUNK` in sampling_fast.cu).
const FAST_CHUNK: usize = 8192;
/// Threads of one block of the fast path (`FAST_THREADS` in sampling_fast.cu).
const FAST_THREADS: u32 = 256;

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
    /// The row's uniform draw in [0, 1).
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

impl SampleRowEx {
    /// Whether the fast path samples this row: no logits-processor entries, no logprobs,
    /// and greedy or a draw with at most min-p (top-k and top-p need the general kernel's
    /// selection). The conditions are the kernels' own (`temperature < 1e-5`: greedy;
    /// `top_k > 0` and `top_p < 1` switch those filters on).
    pub fn takes_fast_path(&self) -> bool {
        let b = &self.base;
        // As the kernels test them: NaN compares false (a NaN top_p is off).
        let top_p_on = b.top_p < 1.0;
        self.entry_begin == self.entry_end
            && self.logprobs < 0
            && (self.is_greedy() || (b.top_k <= 0 && !top_p_on))
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

    /// The fast path's two launches over the rows marked [`PATH_FAST`] in `params`
    /// (`draw`: some of them are not greedy); the other rows' blocks return at once.
    fn sample_fast(
        &self,
        logits: &CudaSlice<u8>,
        vocab: i32,
        rows: usize,
        params: &CudaSlice<SampleRowEx>,
        draw: bool,
        tokens: &mut CudaSlice<i32>,
    ) -> Result<()> {
        let chunks = (vocab as usize).div_ceil(FAST_CHUNK);
        ensure!(
            chunks <= 65_535 && rows <= i32::MAX as usize,
            "sampling: {rows} rows of {vocab} tokens exceed the fast path's grid"
        );
        let n = rows * chunks;
        // Scratch left uninitialised: every element is written by a chunk's block before the
        // row's last block reads it, and row_max / row_fallback by sample_fast_max before
        // sample_fast_draw (same stream) reads them.
        let mut part_val = self.output::<f32>(n, None)?;
        let mut part_id = self.output::<i32>(n, None)?;
        let mut row_max = self.output::<f32>(rows, None)?;
        let mut row_fallback = self.output::<i32>(rows, None)?;
        // The per-row arrival counters start at 0; each launch's last block puts its back.
        let mut counters = self
            .stream
            .alloc_zeros::<u32>(rows)
            .map_err(|e| driver_error("allocating sampling counters", e))?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, chunks as u32, 1),
            block_dim: (FAST_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the caller checked the logits size; the scratch holds rows × chunks
        // partials and one counter, max and fallback per row, as the kernel indexes them.
        launch!(unsafe self, sample_fast_max, cfg; logits, &vocab, params, &mut part_val,
            &mut part_id, &mut counters, &mut row_max, &mut row_fallback, &mut *tokens)?;
        if !draw {
            return Ok(());
        }
        let mut part_mass = self.output::<f64>(n, None)?;
        let mut part_last = self.output::<i32>(n, None)?;
        // SAFETY: as above.
        launch!(unsafe self, sample_fast_draw, cfg; logits, &vocab, params, &row_max,
            &row_fallback, &mut part_mass, &mut part_last, &mut counters, &mut *tokens)
    }

    /// Processes, samples and (where asked) computes raw logprobs of logits rows
    /// [batch.rows.len(), vocab], in one launch of one block per row for the general rows
    /// and two split-row launches for the fast ones; the logits are not modified. `poison`
    /// fills the outputs with NaN / -1 first (tests).
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
            });
        }
        let (tokens, logprobs) = self.launch_sampling(logits, vocab, batch, poison)?;
        let tokens = self
            .stream
            .clone_dtoh(&tokens)
            .map_err(|e| driver_error("copying sampled tokens from the GPU", e))?;
        let logprobs = if batch.num_logprobs > 0 {
            self.stream
                .clone_dtoh(&logprobs)
                .map_err(|e| driver_error("copying logprobs from the GPU", e))?
        } else {
            Vec::new()
        };
        Ok(SampledBatch {
            tokens: tokens[..rows].to_vec(),
            logprobs: logprobs[..batch.num_logprobs].to_vec(),
        })
    }

    /// `sample_tokens_ex` without the read-back: the sampled tokens stay on the device
    /// (one per row, at least one element), for a caller that copies them back itself,
    /// later (the worker's overlapped steps). Batches with logprobs are refused: only the
    /// tokens would come back.
    pub fn sample_tokens_on_device(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
    ) -> Result<CudaSlice<i32>> {
        ensure!(
            batch.num_logprobs == 0,
            "sampling on the device only: {} rows ask for logprobs",
            batch.num_logprobs
        );
        ensure!(!batch.rows.is_empty(), "sampling on the device: no rows");
        Ok(self.launch_sampling(logits, vocab, batch, false)?.0)
    }

    /// Enqueues the sampling launches of a non-empty batch; the token and logprobs
    /// buffers they write.
    fn launch_sampling(
        &self,
        logits: &CudaSlice<u8>,
        vocab: usize,
        batch: &SamplingBatch,
        poison: bool,
    ) -> Result<(CudaSlice<i32>, CudaSlice<TokenLogprobsOut>)> {
        let rows = batch.rows.len();
        batch.validate(vocab)?;
        let need = rows * vocab * self.dtype.size();
        ensure!(
            logits.len() >= need,
            "sample logits: buffer of {} bytes, {rows}×{vocab} {} elements need {need}",
            logits.len(),
            self.dtype.name()
        );
        let v = i32::try_from(vocab)
            .map_err(|_| anyhow::anyhow!("vocab = {vocab} does not fit the kernels' i32"))?;
        let mut rows_ex = batch.rows.to_vec();
        let mut fast = 0usize;
        let mut fast_draw = false;
        for r in &mut rows_ex {
            r.path = if r.takes_fast_path() { PATH_FAST } else { 0 };
            if r.path == PATH_FAST {
                fast += 1;
                fast_draw |= !r.is_greedy();
            }
        }
        let params = self.upload_padded(&rows_ex, SampleRowEx::default())?;
        let mut tokens = self.output(rows, poison.then_some(i32::MIN))?;
        let mut logprobs =
            self.output(batch.num_logprobs, poison.then(TokenLogprobsOut::poison))?;
        if fast < rows {
            let entries = self.upload_padded(batch.entries, LogitEntry::default())?;
            let biases = self.upload_padded(batch.biases, 0.0f32)?;
            let mut values = self.output(batch.entries.len(), poison.then_some(f32::NAN))?;
            let cfg = rows_cfg(rows, 1024);
            // SAFETY: the logits size is checked above, and `validate` checked every index
            // the kernel follows (entry and bias ranges, tokens < vocab, logprobs slots).
            launch!(unsafe self, sample_tokens_ex, cfg; logits, &v, &params, &entries, &biases,
                &mut values, &mut tokens, &mut logprobs)?;
        }
        if fast > 0 {
            self.sample_fast(logits, v, rows, &params, fast_draw, &mut tokens)?;
        }
        Ok((tokens, logprobs))
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
    fn exp_neg(d: f32) -> f64 {
        if d < -700.0 {
            return f64::from(d).exp();
        }
        let x = f64::from(d);
        let shifted = x.mul_add(92.332482616893656, 6755399441055744.0);
        let k = shifted.to_bits() as u32 as i32;
        let kd = shifted - 6755399441055744.0;
        let r0 = kd.mul_add(-6.93147180369123816490e-01 / 64.0, x);
        let r = kd.mul_add(-1.90821492927058770002e-10 / 64.0, r0);
        let mut p: f64 = 1.0 / 720.0;
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
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
            let d = if i % 10 == 0 { -750.0 * u } else { -40.0 * u };
            let (got, want) = (exp_neg(d), f64::from(d).exp());
            let ulp = got.to_bits().abs_diff(want.to_bits());
            worst = worst.max(ulp);
        }
        assert_eq!(exp_neg(0.0), 1.0);
        assert!(worst <= 4, "fast exp off by {worst} ulp");
    }

    #[test]
    fn fast_path_takes_plain_greedy_and_temperature_rows_only() {
        let base = |temperature, top_k, top_p, min_p| SampleRow {
            temperature,
            top_k,
            top_p,
            min_p,
            uniform: 0.5,
        };
        assert!(SampleRowEx::plain(base(0.0, 5, 0.5, 0.0)).takes_fast_path());
        assert!(SampleRowEx::plain(base(0.7, 0, 1.0, 0.1)).takes_fast_path());
        assert!(!SampleRowEx::plain(base(0.7, 5, 1.0, 0.0)).takes_fast_path());
        assert!(!SampleRowEx::plain(base(0.7, 0, 0.9, 0.0)).takes_fast_path());
        let mut lp = SampleRowEx::plain(base(0.0, 0, 1.0, 0.0));
        lp.logprobs = 0;
        assert!(!lp.takes_fast_path());
        let mut ent = SampleRowEx::plain(base(0.0, 0, 1.0, 0.0));
        ent.entry_end = 1;
        assert!(!ent.takes_fast_path());
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
