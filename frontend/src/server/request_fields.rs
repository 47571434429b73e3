//! Reading a request body: malformed JSON and unknown fields become 400s (never silently
//! ignored), and the sampling fields every endpoint shares become `SamplingParams`.

use std::collections::HashMap;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use vllm_protocol::SamplingParams;

use super::ApiError;
use crate::output_processor::TextOptions;

/// Parses `body` as `T`, refusing fields outside `known`.
pub fn parse_body<T: DeserializeOwned>(body: &[u8], known: &[&str]) -> Result<T, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid JSON in request body: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    };
    if let Some(unknown) = object
        .keys()
        .find(|k| !known.contains(&k.as_str()) && !SAMPLING_FIELDS.contains(&k.as_str()))
    {
        return Err(ApiError::invalid_param(
            unknown.clone(),
            format!("Unsupported field `{unknown}`: vllm-rs does not implement it."),
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("Invalid request: {e}")))
}

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

/// `stop` may be one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// The sampling knobs shared by completions and chat, with vLLM's defaults.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub n: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub priority: Option<i32>,
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
        let logit_bias = self
            .logit_bias
            .iter()
            .flatten()
            .map(|(token, bias)| {
                token.parse::<u32>().map(|t| (t, *bias)).map_err(|_| {
                    ApiError::invalid_param(
                        "logit_bias",
                        format!("logit_bias keys must be token ids, got {token:?}."),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
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
            logit_bias,
        };
        params
            .validate(vocab_size)
            .map_err(|e| ApiError::invalid_param(e.param, e.message))?;
        Ok(params)
    }

    pub fn text_options(&self) -> TextOptions {
        TextOptions {
            stop: match &self.stop {
                None => Vec::new(),
                Some(StopField::One(s)) => vec![s.clone()],
                Some(StopField::Many(v)) => v.clone(),
            },
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
        }
    }
}

/// Bounds what one request may ask for, checked before any prompt is tokenized or any
/// engine request made: at most `--max-num-seqs` sequences (prompts × n, so one request
/// is at most one full step of the engine, and its outputs fit the frontend's memory),
/// and a `max_tokens` that leaves room for a prompt in the context.
pub fn check_request_size(
    n: Option<u32>,
    num_prompts: usize,
    max_tokens: Option<u32>,
    max_num_seqs: u32,
    max_model_len: u32,
) -> Result<(), ApiError> {
    let n = n.unwrap_or(1);
    if n < 1 {
        return Err(ApiError::invalid_param(
            "n",
            format!("n must be at least 1, got {n}."),
        ));
    }
    if n > max_num_seqs {
        return Err(ApiError::invalid_param(
            "n",
            format!("n must be at most {max_num_seqs} (--max-num-seqs), got {n}."),
        ));
    }
    let sequences = num_prompts as u64 * u64::from(n);
    if sequences > u64::from(max_num_seqs) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "The request asks for {sequences} sequences ({num_prompts} prompts × n={n}), but one request may ask for at most {max_num_seqs} (--max-num-seqs)."
            ),
        ));
    }
    if let Some(m) = max_tokens.filter(|&m| m >= max_model_len) {
        return Err(ApiError::invalid_param(
            "max_tokens",
            format!(
                "max_tokens must be at most {} (the context length {max_model_len} less a one-token prompt), got {m}.",
                max_model_len.saturating_sub(1)
            ),
        ));
    }
    Ok(())
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
