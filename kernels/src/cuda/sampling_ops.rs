//! Launch wrapper of `sample_tokens_ex` (sampling.cu): logits processors (penalties,
//! logit_bias, min_tokens), sampling and raw logprobs of a batch of rows in one launch.
//!
//! The host describes the processors as a sparse, per-row list of the tokens they touch
//! ([`LogitEntry`], sorted by token), so only what a request's history implies is uploaded,
//! and only the sampled tokens and the asked-for logprobs come back.

use anyhow::{ensure, Result};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use super::device::driver_error;
use super::ops::CudaOps;

/// Most top logprobs per row (vLLM's `max_logprobs` default, `MAX_LOGPROBS` in sampling.cu).
pub const MAX_LOGPROBS: usize = 20;
/// [`LogitEntry::flags`]: the token was seen in the prompt or the output (repetition
/// penalty).
pub const ENTRY_REPEAT: i32 = 1;
/// [`LogitEntry::flags`]: min_tokens is not reached and the token would end the request.
pub const ENTRY_MASK: i32 = 2;

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
    pub pad: i32,
}
// SAFETY: repr(C) plain data, the layout of the CUDA struct.
unsafe impl DeviceRepr for SampleRowEx {}

impl SampleRowEx {
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

    /// Processes, samples and (where asked) computes raw logprobs of logits rows
    /// [batch.rows.len(), vocab], in one launch of one block per row; the logits are not
    /// modified. `poison` fills the outputs with NaN / -1 first (tests).
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
        let params = self.upload_padded(batch.rows, SampleRowEx::default())?;
        let entries = self.upload_padded(batch.entries, LogitEntry::default())?;
        let biases = self.upload_padded(batch.biases, 0.0f32)?;
        let mut values = self.output(batch.entries.len(), poison.then_some(f32::NAN))?;
        let mut tokens = self.output(rows, poison.then_some(i32::MIN))?;
        let mut logprobs =
            self.output(batch.num_logprobs, poison.then(TokenLogprobsOut::poison))?;
        let func = &self.f.sample_tokens_ex;
        let mut b = self.stream.launch_builder(func);
        b.arg(logits)
            .arg(&v)
            .arg(&params)
            .arg(&entries)
            .arg(&biases)
            .arg(&mut values)
            .arg(&mut tokens)
            .arg(&mut logprobs);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the logits size is checked above, and `validate` checked every index the
        // kernel follows (entry and bias ranges, tokens < vocab, logprobs slots).
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launching sample_tokens_ex", e))?;
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
