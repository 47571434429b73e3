//! `POST /v1/completions`: prompts (a string, strings, token ids, or lists of token ids)
//! in, completions out, whole or streamed by SSE; `logprobs` in the legacy completions
//! shape, `echo`, and vLLM's `return_token_ids`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::Response;
use futures::stream::{self, BoxStream, StreamExt};
use serde_json::{json, Value};
use vllm_protocol::TokenLogprobs;

use super::body::JsonObject;
use super::choices::{self, created, engine_error, random_id, usage, Choice, FinishedChoice};
use super::fields::{shown, token_ids, Fields};
use super::request_fields::{
    check_sequences, read_max_tokens, SamplingFields, MAX_TOP_LOGPROBS, SAMPLING_FIELDS,
};
use super::{ApiError, AppState};
use crate::tokenizer::Tokenizer;

pub(super) const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "user",
    "suffix",
    "best_of",
];

pub(super) enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// Reads `prompt`: a string, strings, token ids or lists of token ids, every id within
    /// the vocabulary.
    pub(super) fn read(value: Option<&Value>, vocab_size: u32) -> Result<Self, ApiError> {
        const WHAT: &str =
            "a string, a list of strings, a list of token ids or a list of lists of token ids";
        let bad = |m: String| ApiError::invalid_param("prompt", m);
        let Some(value) = value else {
            return Err(bad(format!("prompt is required: {WHAT}.")));
        };
        let items = match value {
            Value::String(s) => return Ok(Prompt::Text(s.clone())),
            Value::Array(items) if items.is_empty() => {
                return Err(bad("The prompt must not be empty, got [].".into()))
            }
            Value::Array(items) => items,
            other => return Err(bad(format!("prompt must be {WHAT}, got {}.", shown(other)))),
        };
        match &items[0] {
            Value::String(_) => items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(bad(format!(
                        "prompt[{i}] must be a string, as prompt[0] is, got {}.",
                        shown(other)
                    ))),
                })
                .collect::<Result<_, _>>()
                .map(Prompt::Texts),
            Value::Number(_) => token_ids("prompt", value, vocab_size)
                .map(Prompt::Tokens)
                .map_err(bad),
            Value::Array(_) => items
                .iter()
                .enumerate()
                .map(|(i, v)| token_ids(&format!("prompt[{i}]"), v, vocab_size))
                .collect::<Result<_, _>>()
                .map(Prompt::TokenLists)
                .map_err(bad),
            other => Err(bad(format!(
                "prompt must be {WHAT}; prompt[0] is {}.",
                shown(other)
            ))),
        }
    }

    /// How many prompts (each of which runs `n` times).
    pub(super) fn len(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Tokens(_) => 1,
            Prompt::Texts(v) => v.len(),
            Prompt::TokenLists(v) => v.len(),
        }
    }
}

/// What a response needs besides the choices.
struct Reply {
    id: String,
    model: String,
    n: usize,
    echo: bool,
    return_token_ids: bool,
    tokens_as_ids: bool,
    include_usage: bool,
    tokenizer: Tokenizer,
}

pub async fn create_completion(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Response {
    choices::respond(start(&state, &body), stream_response, Reply::body).await
}

fn start(
    state: &AppState,
    body: &serde_json::Map<String, Value>,
) -> Result<(Reply, Vec<Choice>, bool), ApiError> {
    let f = Fields::new(body, &[FIELDS, SAMPLING_FIELDS])?;
    let model = state.model_name(f.string("model")?)?;
    state.check_alive()?;
    let max_num_seqs = state.llm.max_num_seqs;
    let vocab_size = state.llm.client.ready.model.vocab_size;
    let sampling = SamplingFields::read(&f, vocab_size, max_num_seqs)?;
    let n = sampling.n.unwrap_or(1);
    if f.string("suffix")?.is_some() {
        return Err(ApiError::invalid_param(
            "suffix",
            "suffix is not supported.",
        ));
    }
    if let Some(b) = f.u32("best_of", 1, max_num_seqs, "--max-num-seqs")? {
        if b != n {
            return Err(ApiError::invalid_param(
                "best_of",
                format!(
                    "best_of is not supported (only best_of == n), got best_of={b} with n={n}."
                ),
            ));
        }
    }
    let max_tokens = read_max_tokens(&f, "max_tokens", state.llm.max_model_len())?;
    let logprobs = f.u32("logprobs", 0, MAX_TOP_LOGPROBS, "")?;
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid_param(
            "echo",
            "echo with logprobs needs prompt logprobs, which are not supported yet.",
        ));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = f.include_usage(stream)?;
    let return_token_ids = f.bool("return_token_ids")?.unwrap_or(false);
    let tokens_as_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);
    f.string("user")?;
    let prompt = Prompt::read(f.get("prompt"), vocab_size)?;
    check_sequences(n, prompt.len(), max_num_seqs)?;
    let prompts = tokenize_prompts(state, prompt)?;
    let id = format!("cmpl-{}", random_id());
    let choices = choices::start_choices(state, &id, prompts, max_tokens, logprobs, &sampling)?;
    let reply = Reply {
        id,
        model,
        n: n as usize,
        echo,
        return_token_ids,
        tokens_as_ids,
        include_usage,
        tokenizer: state.llm.tokenizer.clone(),
    };
    Ok((reply, choices, stream))
}

fn tokenize_prompts(state: &AppState, prompt: Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        state
            .llm
            .tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::invalid_param("prompt", format!("{e:#}")))
    };
    let prompts = match prompt {
        Prompt::Text(t) => vec![encode(&t)?],
        Prompt::Texts(ts) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![ids],
        Prompt::TokenLists(lists) => lists,
    };
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("The prompt must not be empty, got an empty prompt at index {i}."),
        ));
    }
    Ok(prompts)
}

impl Reply {
    fn body(&self, done: &[FinishedChoice]) -> Value {
        let prompt_tokens = choices::prompt_tokens(
            done.iter().map(|c| (c.index, c.prompt_token_ids.len())),
            self.n,
        );
        let completion_tokens: usize = done.iter().map(|c| c.token_ids.len()).sum();
        let choices: Vec<Value> = done.iter().map(|c| self.choice(c)).collect();
        json!({
            "id": self.id, "object": "text_completion", "created": created(), "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        })
    }

    fn choice(&self, c: &FinishedChoice) -> Value {
        let text = match self.echo {
            true => format!(
                "{}{}",
                self.tokenizer
                    .decode(&c.prompt_token_ids, true)
                    .unwrap_or_default(),
                c.text
            ),
            false => c.text.clone(),
        };
        let mut v = json!({
            "index": c.index,
            "text": text,
            "logprobs": (!c.logprobs.is_empty()).then(|| legacy_logprobs(&self.tokenizer, &c.logprobs, 0, self.tokens_as_ids)),
            "finish_reason": c.finish_reason.map(|f| f.as_str()),
            "stop_reason": c.stop_reason_json(),
        });
        if self.return_token_ids {
            v["token_ids"] = json!(c.token_ids);
            v["prompt_token_ids"] = json!(c.prompt_token_ids);
        }
        v
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": created(), "model": self.model, "choices": [choice]})
    }
}

/// The completions API's logprobs: parallel lists of token texts, their logprobs, the top
/// alternatives as {text: logprob} and each token's offset in the text.
pub fn legacy_logprobs(
    tokenizer: &Tokenizer,
    logprobs: &[TokenLogprobs],
    start_offset: usize,
    tokens_as_ids: bool,
) -> Value {
    let text_of = |id: u32| match tokens_as_ids {
        true => format!("token_id:{id}"),
        false => tokenizer.decode(&[id], false).unwrap_or_default(),
    };
    let mut offset = start_offset;
    let (mut tokens, mut token_logprobs, mut top, mut offsets) = (vec![], vec![], vec![], vec![]);
    for lp in logprobs {
        let text = text_of(lp.token_id);
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
        token_logprobs.push(lp.logprob);
        let alternatives: serde_json::Map<String, Value> = lp
            .top
            .iter()
            .map(|&(id, l)| (text_of(id), json!(l)))
            .collect();
        top.push(Value::Object(alternatives));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// Per-choice bookkeeping while streaming.
#[derive(Default, Clone)]
struct StreamedChoice {
    prompt_len: usize,
    completion_tokens: usize,
    text_len: usize,
    echoed: bool,
}

fn stream_response(
    reply: Reply,
    choices: Vec<Choice>,
) -> Sse<BoxStream<'static, Result<Event, std::convert::Infallible>>> {
    let mut seen: Vec<StreamedChoice> = vec![StreamedChoice::default(); choices.len()];
    for c in &choices {
        seen[c.index].prompt_len = c.prompt_token_ids.len();
    }
    let prompts: Vec<Vec<u32>> = choices.iter().map(|c| c.prompt_token_ids.clone()).collect();
    let reply = Arc::new(reply);
    let usage_reply = reply.clone();
    let seen = Arc::new(std::sync::Mutex::new(seen));
    let usage_seen = seen.clone();
    let events = choices::merged(choices).map(move |(index, o)| {
        let body = match &o.error {
            Some(err) => engine_error(err, false).body(),
            None => {
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                let s = &mut seen[index];
                let mut text = o.text.clone();
                if reply.echo && !s.echoed {
                    s.echoed = true;
                    text = format!("{}{text}", reply.tokenizer.decode(&prompts[index], true).unwrap_or_default());
                }
                let logprobs = o.logprobs.as_ref().map(|lp| legacy_logprobs(&reply.tokenizer, lp, s.text_len, reply.tokens_as_ids));
                s.completion_tokens += o.new_token_ids.len();
                s.text_len += o.text.len();
                let mut choice = json!({
                    "index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": o.finish_reason.map(|f| f.as_str()), "stop_reason": o.stop_reason_json(),
                });
                if reply.return_token_ids {
                    choice["token_ids"] = json!(o.new_token_ids);
                }
                reply.chunk(choice)
            }
        };
        Ok(Event::default().data(body.to_string()))
    });
    let tail = stream::once(async move {
        let mut out = Vec::new();
        if usage_reply.include_usage {
            let seen = usage_seen.lock().unwrap_or_else(|p| p.into_inner());
            let prompt = choices::prompt_tokens(seen.iter().map(|s| s.prompt_len).enumerate(), usage_reply.n);
            let completion: usize = seen.iter().map(|s| s.completion_tokens).sum();
            let body = json!({
                "id": usage_reply.id, "object": "text_completion", "created": created(), "model": usage_reply.model,
                "choices": [], "usage": usage(prompt, completion),
            });
            out.push(Ok(Event::default().data(body.to_string())));
        }
        out.push(Ok(Event::default().data("[DONE]")));
        stream::iter(out)
    })
    .flatten();
    Sse::new(events.chain(tail).boxed())
}
