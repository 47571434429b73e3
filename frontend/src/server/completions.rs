//! `POST /v1/completions`: prompts (a string, strings, token ids, or lists of token ids)
//! in, completions out, whole or streamed by SSE. Each prompt fans out into `n` engine
//! requests; choice `i * n + j` is sample `j` of prompt `i`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::request_fields::{parse_body, resolve_max_tokens, SamplingFields};
use super::{ApiError, AppState};
use crate::output_processor::{OutputStream, RequestOutput};

const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "return_token_ids",
    "user",
    "suffix",
    "best_of",
];

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    logprobs: Option<u32>,
    #[serde(default)]
    return_token_ids: bool,
    suffix: Option<String>,
    best_of: Option<u32>,
    #[serde(flatten)]
    sampling: SamplingFields,
}

/// One engine request of this HTTP request, and where its output goes.
struct Choice {
    index: usize,
    prompt_token_ids: Vec<u32>,
    stream: OutputStream,
}

pub async fn create_completion(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match start(&state, &body) {
        Ok((req, model, choices)) if req.stream => stream_response(model, choices).into_response(),
        Ok((req, model, choices)) => match collect(
            model,
            choices,
            req.sampling.n.unwrap_or(1) as usize,
            req.return_token_ids,
        )
        .await
        {
            Ok(body) => Json(body).into_response(),
            Err(e) => e.into_response(),
        },
        Err(e) => e.into_response(),
    }
}

fn start(
    state: &AppState,
    body: &[u8],
) -> Result<(CompletionRequest, String, Vec<Choice>), ApiError> {
    let req: CompletionRequest = parse_body(body, FIELDS)?;
    let model = state.model_name(req.model.as_deref())?;
    state.check_alive()?;
    if req.suffix.is_some() {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    if req
        .best_of
        .is_some_and(|b| b != req.sampling.n.unwrap_or(1))
    {
        return Err(ApiError::invalid_param(
            "best_of",
            "best_of is not supported (only best_of == n)",
        ));
    }
    let prompts = tokenize_prompts(state, &req.prompt)?;
    let request_id = format!("cmpl-{}", random_id());
    let n = req.sampling.n.unwrap_or(1) as usize;
    let mut choices = Vec::new();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let max_tokens =
            resolve_max_tokens(prompt.len(), req.max_tokens, state.llm.max_model_len())?;
        let params = req.sampling.sampling_params(
            max_tokens,
            req.logprobs,
            state.llm.client.ready.model.vocab_size,
        )?;
        for j in 0..n {
            let mut child = params.clone();
            // vLLM gives each parallel sample its own seed, so the n samples differ yet
            // the whole request stays reproducible.
            child.seed = params.seed.map(|s| s.wrapping_add(j as u64));
            child.n = 1;
            let id = format!("{request_id}-{i}-{j}");
            let stream = state
                .llm
                .generate(
                    id,
                    prompt.clone(),
                    child,
                    req.sampling.text_options(),
                    req.sampling.priority.unwrap_or(0),
                )
                .map_err(|e| ApiError::unavailable(format!("{e:#}")))?;
            choices.push(Choice {
                index: i * n + j,
                prompt_token_ids: prompt.clone(),
                stream,
            });
        }
    }
    Ok((req, model, choices))
}

fn tokenize_prompts(state: &AppState, prompt: &Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        state
            .llm
            .tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::invalid_param("prompt", format!("{e:#}")))
    };
    let prompts = match prompt {
        Prompt::Text(t) => vec![encode(t)?],
        Prompt::Texts(ts) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![ids.clone()],
        Prompt::TokenLists(lists) => lists.clone(),
    };
    let vocab = state.llm.client.ready.model.vocab_size;
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::invalid_param(
            "prompt",
            "The prompt must not be empty.",
        ));
    }
    if let Some(bad) = prompts.iter().flatten().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("Token id {bad} is out of vocabulary (size {vocab})."),
        ));
    }
    Ok(prompts)
}

pub fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn created() -> u64 {
    vllm_engine_core::engine_core::now() as u64
}

/// Runs every choice to the end and builds the response body.
async fn collect(
    model: String,
    choices: Vec<Choice>,
    n: usize,
    return_token_ids: bool,
) -> Result<Value, ApiError> {
    let mut out = Vec::new();
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for mut choice in choices {
        let (mut text, mut token_ids, mut last) = (String::new(), Vec::new(), None);
        while let Some(o) = choice.stream.next().await {
            if let Some(err) = &o.error {
                return Err(engine_error(err, token_ids.is_empty()));
            }
            text.push_str(&o.text);
            token_ids.extend_from_slice(&o.new_token_ids);
            last = Some(o);
        }
        // n samples of one prompt count its tokens once, as OpenAI does.
        if choice.index % n == 0 {
            prompt_tokens += choice.prompt_token_ids.len();
        }
        completion_tokens += token_ids.len();
        let mut c = json!({
            "index": choice.index,
            "text": text,
            "logprobs": null,
            "finish_reason": last.as_ref().and_then(|o| o.finish_reason).map(|f| f.as_str()),
            "stop_reason": last.as_ref().map(|o| o.stop_reason_json()),
        });
        if return_token_ids {
            c["token_ids"] = json!(token_ids);
            c["prompt_token_ids"] = json!(choice.prompt_token_ids);
        }
        out.push(c);
    }
    Ok(json!({
        "id": format!("cmpl-{}", random_id()),
        "object": "text_completion",
        "created": created(),
        "model": model,
        "choices": out,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
    }))
}

/// An engine-side failure: a rejection before any token is the client's fault (400),
/// anything later is the server's.
fn engine_error(err: &str, before_first_token: bool) -> ApiError {
    if err.starts_with("the engine died") {
        ApiError::unavailable(err)
    } else if before_first_token {
        ApiError::bad_request(err)
    } else {
        ApiError::internal(err)
    }
}

fn stream_response(
    model: String,
    choices: Vec<Choice>,
) -> Sse<BoxStream<'static, Result<Event, std::convert::Infallible>>> {
    let id = format!("cmpl-{}", random_id());
    let created = created();
    let streams = choices.into_iter().map(|c| {
        let index = c.index;
        stream::unfold(
            c.stream,
            |mut s| async move { s.next().await.map(|o| (o, s)) },
        )
        .map(move |o| (index, o))
        .boxed()
    });
    let events = stream::select_all(streams)
        .map(move |(index, o): (usize, RequestOutput)| {
            let body = match &o.error {
                Some(err) => engine_error(err, false).body(),
                None => json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{
                        "index": index, "text": o.text, "logprobs": null,
                        "finish_reason": o.finish_reason.map(|f| f.as_str()),
                        "stop_reason": o.stop_reason_json(),
                    }],
                }),
            };
            Ok(Event::default().data(body.to_string()))
        })
        .chain(stream::once(async { Ok(Event::default().data("[DONE]")) }));
    Sse::new(events.boxed())
}
