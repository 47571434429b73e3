//! `POST /v1/chat/completions`: messages rendered through the model's chat template (or
//! `--chat-template FILE`), tokenized without added special tokens, then generated like a
//! completion; whole or streamed as `chat.completion.chunk`s, with logprobs in the chat
//! shape.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::Response;
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::{json, Map, Value};
use vllm_protocol::TokenLogprobs;

use super::body::JsonObject;
use super::choices::{self, created, engine_error, random_id, usage, Choice, FinishedChoice};
use super::fields::Fields;
use super::request_fields::{read_max_tokens, SamplingFields, MAX_TOP_LOGPROBS, SAMPLING_FIELDS};
use super::{ApiError, AppState};
use crate::chat_template::{normalize_messages, RenderOptions};
use crate::tokenizer::Tokenizer;

const FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "user",
];

/// What a response needs besides the choices.
struct Reply {
    id: String,
    model: String,
    n: usize,
    /// `top_logprobs` when logprobs were asked for.
    top_logprobs: Option<u32>,
    include_usage: bool,
    tokenizer: Tokenizer,
}

pub async fn create_chat_completion(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Response {
    choices::respond(start(&state, &body), stream_response, Reply::body).await
}

fn start(
    state: &AppState,
    body: &Map<String, Value>,
) -> Result<(Reply, Vec<Choice>, bool), ApiError> {
    let f = Fields::new(body, &[FIELDS, SAMPLING_FIELDS])?;
    let model = state.model_name(f.string("model")?)?;
    state.check_alive()?;
    let vocab_size = state.llm.client.ready.model.vocab_size;
    let sampling = SamplingFields::read(&f, vocab_size, state.llm.max_num_seqs)?;
    let max_model_len = state.llm.max_model_len();
    let max_tokens = match read_max_tokens(&f, "max_completion_tokens", max_model_len)? {
        Some(m) => Some(m),
        None => read_max_tokens(&f, "max_tokens", max_model_len)?,
    };
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = f.u32("top_logprobs", 0, MAX_TOP_LOGPROBS, "")?;
    if top_logprobs.is_some() && !logprobs {
        return Err(ApiError::invalid_param(
            "top_logprobs",
            "when using `top_logprobs`, `logprobs` must be set to true.",
        ));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = f.include_usage(stream)?;
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    let continue_final_message = f.bool("continue_final_message")?.unwrap_or(false);
    let kwargs = f.object("chat_template_kwargs")?;
    f.string("user")?;
    let Some(template) = &state.chat_template else {
        return Err(ApiError::bad_request(
            "The model has no chat template: start the server with --chat-template FILE.",
        ));
    };
    let Some(messages) = f.get("messages") else {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is required: a list of message objects.",
        ));
    };
    let messages =
        normalize_messages(messages).map_err(|e| ApiError::invalid_param(e.param, e.message))?;
    let options = RenderOptions {
        add_generation_prompt,
        continue_final_message,
        kwargs,
    };
    let text = template
        .render(&messages, &options)
        .map_err(|e| ApiError::invalid_param(e.param, e.message))?;
    // The template wrote the special tokens (bos included) itself.
    let prompt = state
        .llm
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid_param("messages", format!("{e:#}")))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "The chat template rendered an empty prompt.",
        ));
    }
    let top_logprobs = logprobs.then(|| top_logprobs.unwrap_or(0));
    let id = format!("chatcmpl-{}", random_id());
    let choices = choices::start_choices(
        state,
        &id,
        vec![prompt],
        max_tokens,
        top_logprobs,
        &sampling,
    )?;
    let reply = Reply {
        id,
        model,
        n: sampling.n.unwrap_or(1) as usize,
        top_logprobs,
        include_usage,
        tokenizer: state.llm.tokenizer.clone(),
    };
    Ok((reply, choices, stream))
}

impl Reply {
    fn body(&self, done: &[FinishedChoice]) -> Value {
        let prompt_tokens = choices::prompt_tokens(
            done.iter().map(|c| (c.index, c.prompt_token_ids.len())),
            self.n,
        );
        let completion_tokens: usize = done.iter().map(|c| c.token_ids.len()).sum();
        let choices: Vec<Value> = done
            .iter()
            .map(|c| {
                json!({
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self.logprobs(&c.logprobs),
                    "finish_reason": c.finish_reason.map(|f| f.as_str()),
                    "stop_reason": c.stop_reason_json(),
                })
            })
            .collect();
        json!({
            "id": self.id, "object": "chat.completion", "created": created(), "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        })
    }

    /// The chat logprobs of some tokens, or null when none were asked for.
    fn logprobs(&self, logprobs: &[TokenLogprobs]) -> Value {
        match self.top_logprobs {
            Some(k) => chat_logprobs(&self.tokenizer, logprobs, k),
            None => Value::Null,
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": created(), "model": self.model, "choices": choices})
    }
}

/// The chat API's logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`. As in
/// vLLM, each entry's `top_logprobs` starts with the sampled token itself, followed by the
/// most likely others, `top` entries in all.
pub fn chat_logprobs(tokenizer: &Tokenizer, logprobs: &[TokenLogprobs], top: u32) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = tokenizer.decode(&[id], false).unwrap_or_default();
        json!({"token": token, "logprob": logprob.max(-9999.0), "bytes": token.as_bytes()})
    };
    let content: Vec<Value> = logprobs
        .iter()
        .map(|lp| {
            let alternatives = lp.top.iter().copied().filter(|&(id, _)| id != lp.token_id);
            let top: Vec<Value> = std::iter::once((lp.token_id, lp.logprob))
                .chain(alternatives)
                .take(top as usize)
                .map(|(id, l)| entry(id, l))
                .collect();
            let mut e = entry(lp.token_id, lp.logprob);
            e["top_logprobs"] = json!(top);
            e
        })
        .collect();
    json!({ "content": content })
}

fn stream_response(
    reply: Reply,
    choices: Vec<Choice>,
) -> Sse<BoxStream<'static, Result<Event, std::convert::Infallible>>> {
    let prompt_tokens = choices::prompt_tokens(
        choices.iter().map(|c| (c.index, c.prompt_token_ids.len())),
        reply.n,
    );
    let completion_tokens = Arc::new(Mutex::new(0usize));
    let counted = completion_tokens.clone();
    let reply = Arc::new(reply);
    let tail_reply = reply.clone();
    // Every choice first says who speaks, as vLLM and OpenAI do.
    let roles: Vec<Result<Event, std::convert::Infallible>> = choices
        .iter()
        .map(|c| {
            let choice = json!({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            Ok(Event::default().data(reply.chunk(json!([choice])).to_string()))
        })
        .collect();
    let events = choices::merged(choices).filter_map(move |(index, o)| {
        let event = match &o.error {
            Some(err) => Some(engine_error(err, false).body()),
            None => {
                *counted.lock().unwrap_or_else(|p| p.into_inner()) += o.new_token_ids.len();
                let logprobs = o.logprobs.as_deref().unwrap_or_default();
                // Text held back (a possible stop string) and nothing else: no chunk yet.
                if o.text.is_empty() && logprobs.is_empty() && o.finish_reason.is_none() {
                    None
                } else {
                    let choice = json!({
                        "index": index,
                        "delta": {"content": o.text},
                        "logprobs": reply.logprobs(logprobs),
                        "finish_reason": o.finish_reason.map(|f| f.as_str()),
                        "stop_reason": o.stop_reason_json(),
                    });
                    Some(reply.chunk(json!([choice])))
                }
            }
        };
        futures::future::ready(event.map(|body| Ok(Event::default().data(body.to_string()))))
    });
    let tail = stream::once(async move {
        let mut out = Vec::new();
        if tail_reply.include_usage {
            let completion = *completion_tokens.lock().unwrap_or_else(|p| p.into_inner());
            let mut body = tail_reply.chunk(json!([]));
            body["usage"] = usage(prompt_tokens, completion);
            out.push(Ok(Event::default().data(body.to_string())));
        }
        out.push(Ok(Event::default().data("[DONE]")));
        stream::iter(out)
    })
    .flatten();
    Sse::new(stream::iter(roles).chain(events).chain(tail).boxed())
}
