//! Output processing of one request: engine outputs in, [`RequestOutput`]s out. Token ids
//! are detokenized incrementally, stop strings are matched on the text (the engine never
//! sees them), and a matched stop string aborts the request in the engine.

use vllm_protocol::{EngineCoreOutput, FinishReason, TokenLogprobs};

use std::sync::Arc;

use crate::detokenizer::IncrementalDetokenizer;
use crate::engine_client::RequestStream;
use crate::metrics::{Metrics, RequestTracker};
use crate::stop_strings::StopChecker;
use crate::tokenizer::Tokenizer;

/// Text-side options of a request: what the frontend does with the tokens.
#[derive(Debug, Clone, Default)]
pub struct TextOptions {
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
}

/// Why a request stopped, beyond the finish reason.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// What one engine step produced for a request, ready for a client.
#[derive(Debug, Clone, Default)]
pub struct RequestOutput {
    pub new_token_ids: Vec<u32>,
    /// Text released by this output (may be empty while a stop string is possible).
    pub text: String,
    pub logprobs: Option<Vec<TokenLogprobs>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub num_cached_tokens: u32,
    pub error: Option<String>,
}

impl RequestOutput {
    /// `stop_reason` as vLLM reports it: the stop token id or string, else null.
    pub fn stop_reason_json(&self) -> serde_json::Value {
        stop_reason_json(&self.stop_reason)
    }
}

/// `stop_reason` as vLLM reports it: the stop token id or string, else null.
pub fn stop_reason_json(reason: &Option<StopReason>) -> serde_json::Value {
    match reason {
        Some(StopReason::Token(t)) => serde_json::json!(t),
        Some(StopReason::Text(s)) => serde_json::json!(s),
        None => serde_json::Value::Null,
    }
}

/// The outputs of one request, processed.
pub struct OutputStream {
    engine: RequestStream,
    detokenizer: IncrementalDetokenizer,
    stop: StopChecker,
    stops: Vec<String>,
    done: bool,
    metrics: Arc<Metrics>,
    tracker: RequestTracker,
}

impl OutputStream {
    pub fn new(
        engine: RequestStream,
        tokenizer: Tokenizer,
        prompt: &[u32],
        text: TextOptions,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            metrics,
            tracker: RequestTracker::new(prompt.len()),
            engine,
            detokenizer: IncrementalDetokenizer::new(&tokenizer, prompt, text.skip_special_tokens),
            stop: StopChecker::new(text.stop.clone(), text.include_stop_str_in_output),
            stops: text.stop,
            done: false,
        })
    }

    pub fn request_id(&self) -> &str {
        &self.engine.request_id
    }

    /// The next processed output; `None` after the last one.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.done {
            return None;
        }
        let Some(out) = self.engine.next().await else {
            self.done = true;
            return None;
        };
        Some(self.process(out))
    }

    fn process(&mut self, out: EngineCoreOutput) -> RequestOutput {
        let mut text = String::new();
        for &token in &out.new_token_ids {
            text.push_str(&self.detokenizer.push(token));
        }
        if out.finish_reason.is_some() {
            text.push_str(&self.detokenizer.finish());
        }
        let mut result = RequestOutput {
            new_token_ids: out.new_token_ids,
            text: String::new(),
            logprobs: out.new_logprobs,
            finish_reason: out.finish_reason,
            stop_reason: out.stop_reason.map(StopReason::Token),
            num_cached_tokens: out.num_cached_tokens,
            error: out.error,
        };
        let released = self.stop.push(&text);
        result.text = released.text;
        if let Some(m) = released.stopped {
            // The engine would go on generating: stop it here.
            self.engine.abort();
            result.finish_reason = Some(FinishReason::Stop);
            result.stop_reason = Some(StopReason::Text(self.stops[m.index].clone()));
        } else if result.finish_reason.is_some() {
            result.text.push_str(&self.stop.finish());
        }
        self.done = result.finish_reason.is_some();
        self.tracker
            .on_tokens(&self.metrics, result.new_token_ids.len());
        if let Some(reason) = result.finish_reason {
            self.tracker.on_finish(&self.metrics, reason.as_str());
        }
        result
    }
}

impl Drop for OutputStream {
    /// A stream dropped before its end is a client that went away: the engine request is
    /// aborted (by the `RequestStream`) and counted as such.
    fn drop(&mut self) {
        if !self.tracker.is_finished() {
            self.tracker.on_finish(&self.metrics, "abort");
        }
    }
}
