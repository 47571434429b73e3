//! The fields every generating endpoint shares: the sampling knobs, read from the body's
//! JSON object into `SamplingParams`, and the bounds on what one request may ask for
//! (sequences, `max_tokens`) checked before any work is done.

use serde_json::Value;
use vllm_protocol::{SamplingParams, MAX_LOGPROBS};

use super::fields::{shown, Fields};
use super::ApiError;
use crate::output_processor::TextOptions;

/// Field names of [`SamplingFields`], accepted by every generating endpoint.
pub const SAMPLING_FIELDS: &[&str] = &[
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "priority",
];

/// The most `logprobs` (completions) or `top_logprobs` (chat) a request may ask for.
pub const MAX_TOP_LOGPROBS: u32 = MAX_LOGPROBS;

/// The sampling knobs shared by completions and chat, with vLLM's defaults.
#[derive(Debug, Clone, Default)]
pub struct SamplingFields {
    pub n: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// (token id, bias), each bias clamped to [-100, 100] as vLLM does.
    pub logit_bias: Vec<(u32, f32)>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub priority: Option<i32>,
}

impl SamplingFields {
    /// Reads the sampling fields, checking each one's type and range; `n` may be at most
    /// `--max-num-seqs`.
    pub fn read(f: &Fields, vocab_size: u32, max_num_seqs: u32) -> Result<Self, ApiError> {
        Ok(Self {
            n: f.u32("n", 1, max_num_seqs, "--max-num-seqs")?,
            temperature: f.number("temperature", "≥ 0")?,
            top_p: f.number("top_p", "in (0, 1]")?,
            top_k: f
                .int("top_k", -1, i32::MAX.into(), "0 or -1 disables it")?
                .map(|k| k as i32),
            min_p: f.number("min_p", "in [0, 1]")?,
            seed: read_seed(f)?,
            stop: read_stop(f)?,
            stop_token_ids: f.token_ids("stop_token_ids", vocab_size)?,
            ignore_eos: f.bool("ignore_eos")?,
            min_tokens: f.u32("min_tokens", 0, u32::MAX, "")?,
            presence_penalty: f.number("presence_penalty", "in [-2, 2]")?,
            frequency_penalty: f.number("frequency_penalty", "in [-2, 2]")?,
            repetition_penalty: f.number("repetition_penalty", "> 0")?,
            logit_bias: read_logit_bias(f)?,
            include_stop_str_in_output: f.bool("include_stop_str_in_output")?,
            skip_special_tokens: f.bool("skip_special_tokens")?,
            priority: f
                .int("priority", i32::MIN.into(), i32::MAX.into(), "")?
                .map(|p| p as i32),
        })
    }
}

/// A seed: any 64-bit integer, signed (as vLLM takes it) or not.
fn read_seed(f: &Fields) -> Result<Option<u64>, ApiError> {
    let Some(value) = f.get("seed") else {
        return Ok(None);
    };
    match (value.as_u64(), value.as_i64()) {
        (Some(v), _) => Ok(Some(v)),
        (None, Some(v)) => Ok(Some(v as u64)),
        _ => Err(ApiError::invalid_param(
            "seed",
            format!(
                "seed must be an integer in [{}, {}], got {}.",
                i64::MIN,
                u64::MAX,
                shown(value)
            ),
        )),
    }
}

/// `stop`: one string or a list of them, none empty.
fn read_stop(f: &Fields) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("stop", m);
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                other => Err(bad(format!(
                    "stop[{i}] must be a string, got {}.",
                    shown(other)
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(bad(format!(
                "stop must be a string or a list of strings, got {}.",
                shown(other)
            )))
        }
    };
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(bad(format!(
            "stop cannot contain an empty string, got one at stop[{i}]."
        )));
    }
    Ok(stop)
}

/// `logit_bias`: {"token id": bias}, biases clamped to [-100, 100] as vLLM does.
fn read_logit_bias(f: &Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = f.object("logit_bias")? else {
        return Ok(Vec::new());
    };
    let bad = |m: String| ApiError::invalid_param("logit_bias", m);
    map.iter()
        .map(|(token, bias)| {
            let id = token
                .parse::<u32>()
                .map_err(|_| bad(format!("logit_bias keys must be token ids, got {token:?}.")))?;
            let bias = bias.as_f64().ok_or_else(|| {
                bad(format!(
                    "logit_bias[{token:?}] must be a number in [-100, 100], got {}.",
                    shown(bias)
                ))
            })?;
            Ok((id, bias.clamp(-100.0, 100.0) as f32))
        })
        .collect()
}

/// `max_tokens` (or `max_completion_tokens`): at least 1, and room left for a prompt of one
/// token in the context.
pub fn read_max_tokens(
    f: &Fields,
    name: &str,
    max_model_len: u32,
) -> Result<Option<u32>, ApiError> {
    f.u32(
        name,
        1,
        max_model_len.saturating_sub(1).max(1),
        "the context length less a one-token prompt",
    )
}

/// One request is at most one full step of the engine: prompts × n ≤ `--max-num-seqs`, so
/// its outputs fit the frontend's memory and, with the scheduler's fair shares, it cannot
/// starve other clients. Checked before any prompt is tokenized.
pub fn check_sequences(n: u32, num_prompts: usize, max_num_seqs: u32) -> Result<(), ApiError> {
    let sequences = num_prompts as u64 * u64::from(n);
    if sequences > u64::from(max_num_seqs) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "The request asks for {sequences} sequences ({num_prompts} prompts × n={n}), but one request may ask for at most {max_num_seqs} (--max-num-seqs)."
            ),
        ));
    }
    Ok(())
}

impl SamplingFields {
    /// Builds validated `SamplingParams`; `max_tokens` is already resolved against the
    /// context length by the caller.
    pub fn sampling_params(
        &self,
        max_tokens: u32,
        logprobs: Option<u32>,
        vocab_size: u32,
    ) -> Result<SamplingParams, ApiError> {
        let d = SamplingParams::default();
        let params = SamplingParams {
            n: self.n.unwrap_or(1),
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            seed: self.seed,
            max_tokens,
            min_tokens: self.min_tokens.unwrap_or(0),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            logit_bias: self.logit_bias.clone(),
        };
        params
            .validate(vocab_size)
            .map_err(|e| ApiError::invalid_param(e.param, e.message))?;
        Ok(params)
    }

    pub fn text_options(&self) -> TextOptions {
        TextOptions {
            stop: self.stop.clone(),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
        }
    }
}

/// Resolves `max_tokens` against the context, with vLLM's messages for prompts that do not
/// fit: an absent `max_tokens` means "up to the context length".
pub fn resolve_max_tokens(
    prompt_len: usize,
    max_tokens: Option<u32>,
    max_model_len: u32,
) -> Result<u32, ApiError> {
    let max_model_len = max_model_len as usize;
    if prompt_len >= max_model_len {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_len} input tokens. Please reduce the length of the input messages."
            ),
        ));
    }
    match max_tokens {
        None => Ok((max_model_len - prompt_len) as u32),
        Some(m) if prompt_len + m as usize > max_model_len => Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_len} in the messages, {m} in the completion). Please reduce the length of the messages or completion.",
                prompt_len + m as usize
            ),
        )),
        Some(m) => Ok(m),
    }
}
