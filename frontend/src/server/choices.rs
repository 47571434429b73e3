//! The choices of one API request: each prompt fans out into `n` engine requests (vLLM's
//! parallel sampling), choice `i * n + j` being sample `j` of prompt `i`. Shared by
//! completions and chat: starting the choices, running them to the end, or merging their
//! streams for SSE.

use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::{json, Value};
use vllm_protocol::{FinishReason, TokenLogprobs};

use super::admission::Ticket;
use super::request_fields::{resolve_max_tokens, SamplingFields};
use super::{ApiError, AppState};
use crate::output_processor::{OutputStream, RequestOutput, StopReason};

/// One engine request of an API request.
pub struct Choice {
    pub index: usize,
    pub prompt_token_ids: Vec<u32>,
    pub stream: OutputStream,
    /// Its place among the requests in flight, freed when the choice ends or is dropped.
    pub ticket: Ticket,
}

/// A choice run to its end.
pub struct FinishedChoice {
    pub index: usize,
    pub prompt_token_ids: Vec<u32>,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    pub num_cached_tokens: u32,
}

impl FinishedChoice {
    pub fn stop_reason_json(&self) -> serde_json::Value {
        crate::output_processor::stop_reason_json(&self.stop_reason)
    }
}

/// Validates the sampling fields against each prompt, admits the request (or refuses it
/// with a 503 when `--max-num-queued-reqs` would be exceeded) and starts `n` engine
/// requests per prompt. Nothing is started unless every prompt is valid and all fit.
pub fn start_choices(
    state: &AppState,
    request_id: &str,
    prompts: Vec<Vec<u32>>,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    sampling: &SamplingFields,
) -> Result<Vec<Choice>, ApiError> {
    let n = sampling.n.unwrap_or(1) as usize;
    let vocab = state.llm.client.ready.model.vocab_size;
    let mut planned = Vec::new();
    for prompt in &prompts {
        let max_tokens = resolve_max_tokens(prompt.len(), max_tokens, state.llm.max_model_len())?;
        planned.push(sampling.sampling_params(max_tokens, logprobs, vocab)?);
    }
    let mut tickets = state.admission.admit(prompts.len() * n)?.into_iter();
    if state.log_requests {
        log_request(state, request_id, &prompts, &planned);
    }
    let mut choices = Vec::new();
    for (i, (prompt, params)) in prompts.into_iter().zip(planned).enumerate() {
        for j in 0..n {
            let mut child = params.clone();
            // vLLM gives each parallel sample its own seed, so the n samples differ yet
            // the whole request stays reproducible.
            child.seed = params.seed.map(|s| s.wrapping_add(j as u64));
            child.n = 1;
            let stream = state
                .llm
                .generate(
                    format!("{request_id}-{i}-{j}"),
                    prompt.clone(),
                    child,
                    sampling.text_options(),
                    sampling.priority.unwrap_or(0),
                    Some(request_id.to_string()),
                )
                .map_err(|e| ApiError::unavailable(format!("{e:#}")))?;
            let Some(ticket) = tickets.next() else {
                return Err(ApiError::internal(
                    "admission gave fewer tickets than requests",
                ));
            };
            choices.push(Choice {
                index: i * n + j,
                prompt_token_ids: prompt.clone(),
                stream,
                ticket,
            });
        }
    }
    Ok(choices)
}

/// `--enable-log-requests`: the request's id and parameters at info, its prompts (text)
/// at debug. Nothing else in the server logs a prompt.
fn log_request(
    state: &AppState,
    request_id: &str,
    prompts: &[Vec<u32>],
    params: &[vllm_protocol::SamplingParams],
) {
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    tracing::info!(
        request_id,
        prompt_tokens = ?lens,
        params = ?params.first(),
        "received request"
    );
    if tracing::enabled!(tracing::Level::DEBUG) {
        for (i, prompt) in prompts.iter().enumerate() {
            let text = state
                .llm
                .tokenizer
                .decode(prompt, false)
                .unwrap_or_default();
            tracing::debug!(request_id, index = i, prompt = %text, "received prompt");
        }
    }
}

/// Runs a choice to its end.
pub async fn finish(mut choice: Choice) -> Result<FinishedChoice, ApiError> {
    let mut done = FinishedChoice {
        index: choice.index,
        prompt_token_ids: std::mem::take(&mut choice.prompt_token_ids),
        text: String::new(),
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        finish_reason: None,
        stop_reason: None,
        num_cached_tokens: 0,
    };
    while let Some(o) = choice.stream.next().await {
        if let Some(err) = &o.error {
            return Err(engine_error(err, done.token_ids.is_empty()));
        }
        done.text.push_str(&o.text);
        done.token_ids.extend_from_slice(&o.new_token_ids);
        done.logprobs.extend(o.logprobs.into_iter().flatten());
        done.num_cached_tokens = o.num_cached_tokens;
        if o.finish_reason.is_some() {
            done.finish_reason = o.finish_reason;
            done.stop_reason = o.stop_reason;
        }
    }
    Ok(done)
}

/// Runs every choice to its end, concurrently.
pub async fn finish_all(choices: Vec<Choice>) -> Result<Vec<FinishedChoice>, ApiError> {
    futures::future::try_join_all(choices.into_iter().map(finish)).await
}

/// Prompt tokens of the request: each prompt counted once, however many samples it has.
pub fn prompt_tokens(choices: impl IntoIterator<Item = (usize, usize)>, n: usize) -> usize {
    choices
        .into_iter()
        .filter(|(index, _)| index % n.max(1) == 0)
        .map(|(_, prompt_len)| prompt_len)
        .sum()
}

/// The `usage` object of a response or of the last stream chunk.
pub fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens})
}

/// The end both handlers share: the started choices streamed as SSE, or run to their end
/// and answered as one JSON body.
pub async fn respond<R, S: IntoResponse>(
    started: Result<(R, Vec<Choice>, bool), ApiError>,
    stream_response: impl FnOnce(R, Vec<Choice>) -> S,
    body: impl FnOnce(&R, &[FinishedChoice]) -> Value,
) -> Response {
    let (reply, choices, stream) = match started {
        Ok(started) => started,
        Err(e) => return e.into_response(),
    };
    if stream {
        return stream_response(reply, choices).into_response();
    }
    match finish_all(choices).await {
        Ok(done) => Json(body(&reply, &done)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Every choice's outputs as one stream of (choice index, output), in arrival order.
pub fn merged(choices: Vec<Choice>) -> BoxStream<'static, (usize, RequestOutput)> {
    let streams = choices.into_iter().map(|c| {
        let index = c.index;
        // The ticket lives as long as the stream does.
        stream::unfold((c.stream, c.ticket), |(mut s, ticket)| async move {
            s.next().await.map(|o| (o, (s, ticket)))
        })
        .map(move |o| (index, o))
        .boxed()
    });
    stream::select_all(streams).boxed()
}

/// An engine-side failure: a rejection before any token is the client's fault (400), a
/// dead engine is a 503, anything else the server's fault.
pub fn engine_error(err: &str, before_first_token: bool) -> ApiError {
    if err.starts_with("the engine died") || err.starts_with(super::shutdown::SHUTTING_DOWN) {
        ApiError::unavailable(err)
    } else if before_first_token {
        ApiError::bad_request(err)
    } else {
        ApiError::internal(err)
    }
}

pub fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Seconds since the epoch, for the `created` field.
pub fn created() -> u64 {
    vllm_engine_core::engine_core::now() as u64
}
