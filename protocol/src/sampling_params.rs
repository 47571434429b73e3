//! `SamplingParams`: how the next tokens of one request are chosen, with vLLM's defaults
//! and vLLM's validation messages. Stop *strings* are not here: the frontend matches them
//! on detokenized text (DESIGN §3).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Number of samples the frontend fans out for one prompt; the engine sees n = 1.
    pub n: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// 0 or -1 disables top-k.
    pub top_k: i32,
    pub min_p: f32,
    /// Makes the request's sampling reproducible whatever else shares its batch.
    pub seed: Option<u64>,
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of top log-probabilities to return per sampled token (plus the sampled one).
    pub logprobs: Option<u32>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// (token id, bias added to its logit).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

/// Below this temperature sampling is greedy, as in vLLM.
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Most top log-probabilities a request may ask for.
pub const MAX_LOGPROBS: u32 = 20;

/// An invalid parameter: the field's name and vLLM's message for it.
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidParam {
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for InvalidParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for InvalidParam {}

fn invalid(param: &'static str, message: String) -> Result<(), InvalidParam> {
    Err(InvalidParam { param, message })
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    pub fn top_k_enabled(&self) -> Option<usize> {
        (self.top_k > 0).then_some(self.top_k as usize)
    }

    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Checks every field against vLLM's rules, with vLLM's messages.
    pub fn validate(&self, vocab_size: u32) -> Result<(), InvalidParam> {
        if self.n < 1 {
            return invalid("n", format!("n must be at least 1, got {}.", self.n));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return invalid(
                "presence_penalty",
                format!(
                    "presence_penalty must be in [-2, 2], got {}.",
                    self.presence_penalty
                ),
            );
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return invalid(
                "frequency_penalty",
                format!(
                    "frequency_penalty must be in [-2, 2], got {}.",
                    self.frequency_penalty
                ),
            );
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return invalid(
                "repetition_penalty",
                format!(
                    "repetition_penalty must be greater than zero, got {}.",
                    self.repetition_penalty
                ),
            );
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return invalid(
                "temperature",
                format!(
                    "temperature must be non-negative, got {}.",
                    self.temperature
                ),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {}.", self.top_p),
            );
        }
        if self.top_k < -1 {
            return invalid(
                "top_k",
                format!(
                    "top_k must be 0 (disable), or at least 1, got {}.",
                    self.top_k
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return invalid(
                "min_p",
                format!("min_p must be in [0, 1], got {}.", self.min_p),
            );
        }
        if self.max_tokens < 1 {
            return invalid(
                "max_tokens",
                format!("max_tokens must be at least 1, got {}.", self.max_tokens),
            );
        }
        if self.min_tokens > self.max_tokens {
            return invalid(
                "min_tokens",
                format!(
                    "min_tokens must be less than or equal to max_tokens={}, got {}.",
                    self.max_tokens, self.min_tokens
                ),
            );
        }
        if let Some(k) = self.logprobs {
            if k > MAX_LOGPROBS {
                return invalid(
                    "logprobs",
                    format!("Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}"),
                );
            }
        }
        if let Some(&bad) = self.stop_token_ids.iter().find(|&&t| t >= vocab_size) {
            return invalid(
                "stop_token_ids",
                format!("stop_token_ids contains token id {bad}, outside the vocabulary of size {vocab_size}."),
            );
        }
        for &(token, bias) in &self.logit_bias {
            if token >= vocab_size {
                return invalid(
                    "logit_bias",
                    format!("token_id {token} in logit_bias contains out-of-vocab token id. Vocabulary size: {vocab_size}"),
                );
            }
            if !bias.is_finite() {
                return invalid(
                    "logit_bias",
                    format!("logit_bias for token {token} must be finite, got {bias}."),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_vllm() {
        let p = SamplingParams::default();
        assert_eq!(p.validate(100), Ok(()));
        assert_eq!(
            (p.n, p.temperature, p.top_p, p.max_tokens),
            (1, 1.0, 1.0, 16)
        );
        assert!(!p.is_greedy());
    }

    #[test]
    fn invalid_values_get_vllm_messages() {
        let p = SamplingParams {
            top_p: 1.5,
            ..Default::default()
        };
        let err = p.validate(100).unwrap_err();
        assert_eq!(err.param, "top_p");
        assert_eq!(err.message, "top_p must be in (0, 1], got 1.5.");

        let p = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert_eq!(p.validate(100).unwrap_err().param, "temperature");
        let p = SamplingParams {
            min_tokens: 20,
            max_tokens: 10,
            ..Default::default()
        };
        assert_eq!(p.validate(100).unwrap_err().param, "min_tokens");
        let p = SamplingParams {
            logit_bias: vec![(100, 1.0)],
            ..Default::default()
        };
        assert_eq!(p.validate(100).unwrap_err().param, "logit_bias");
        let p = SamplingParams {
            top_k: -2,
            ..Default::default()
        };
        assert_eq!(p.validate(100).unwrap_err().param, "top_k");
    }
}
