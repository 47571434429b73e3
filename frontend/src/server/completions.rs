//! `POST /v1/completions`: prompts (a string, strings, token ids, or lists of token ids)
//! in, completions out, whole or streamed by SSE; `logprobs` in the legacy completions
//! shape, `echo`, and vLLM's `return_token_ids`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::Response;
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use vllm_protocol::TokenLogprobs;

use super::choices::{self, created, engine_error, random_id, usage, Choice, FinishedChoice};
use super::request_fields::{check_request_size, parse_body, SamplingFields};
use super::{ApiError, AppState};
use crate::tokenizer::Tokenizer;

const FIELDS: &[&str] = &[
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

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// How many prompts (each of which runs `n` times).
    fn len(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Tokens(_) => 1,
            Prompt::Texts(v) => v.len(),
            Prompt::TokenLists(v) => v.len(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    logprobs: Option<u32>,
    #[serde(default)]
    echo: bool,
    #[serde(default)]
    return_token_ids: bool,
    /// vLLM's option to name logprob tokens "token_id:N", which never collide.
    #[serde(default)]
    return_tokens_as_token_ids: bool,
    suffix: Option<String>,
    best_of: Option<u32>,
    #[serde(flatten)]
    sampling: SamplingFields,
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

pub async fn create_completion(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    choices::respond(start(&state, &body), stream_response, Reply::body).await
}

fn start(state: &AppState, body: &[u8]) -> Result<(Reply, Vec<Choice>, bool), ApiError> {
    let req: CompletionRequest = parse_body(body, FIELDS)?;
    let model = state.model_name(req.model.as_deref())?;
    state.check_alive()?;
    if req.suffix.is_some() {
        return Err(ApiError::invalid_param(
            "suffix",
            "suffix is not supported.",
        ));
    }
    let max_num_seqs = state.llm.max_num_seqs;
    if let Some(b) = req.best_of.filter(|&b| b > max_num_seqs) {
        return Err(ApiError::invalid_param(
            "best_of",
            format!("best_of must be at most {max_num_seqs} (--max-num-seqs), got {b}."),
        ));
    }
    check_request_size(
        req.sampling.n,
        req.prompt.len(),
        req.max_tokens,
        max_num_seqs,
        state.llm.max_model_len(),
    )?;
    if req
        .best_of
        .is_some_and(|b| b != req.sampling.n.unwrap_or(1))
    {
        return Err(ApiError::invalid_param(
            "best_of",
            "best_of is not supported (only best_of == n).",
        ));
    }
    if req.echo && req.logprobs.is_some() {
        return Err(ApiError::invalid_param(
            "echo",
            "echo with logprobs needs prompt logprobs, which are not supported yet.",
        ));
    }
    let prompts = tokenize_prompts(state, &req.prompt)?;
    let id = format!("cmpl-{}", random_id());
    let choices = choices::start_choices(
        state,
        &id,
        prompts,
        req.max_tokens,
        req.logprobs,
        &req.sampling,
    )?;
    let reply = Reply {
        id,
        model,
        n: req.sampling.n.unwrap_or(1) as usize,
        echo: req.echo,
        return_token_ids: req.return_token_ids,
        tokens_as_ids: req.return_tokens_as_token_ids,
        include_usage: req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        tokenizer: state.llm.tokenizer.clone(),
    };
    Ok((reply, choices, req.stream))
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
