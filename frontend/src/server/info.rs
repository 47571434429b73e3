//! The small endpoints: `GET /v1/models`, `GET /version`, `POST /tokenize`,
//! `POST /detokenize`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::choices::created;
use super::request_fields::parse_body;
use super::{ApiError, AppState};

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let max_model_len = state.llm.max_model_len();
    let data: Vec<Value> = state
        .served_model_names
        .iter()
        .map(|name| {
            json!({
                "id": name, "object": "model", "created": created(), "owned_by": "vllm-rs",
                "root": state.model_path, "parent": null, "max_model_len": max_model_len,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

#[derive(Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: String,
    #[serde(default = "yes")]
    add_special_tokens: bool,
}

fn yes() -> bool {
    true
}

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse_body(&body, &["model", "prompt", "add_special_tokens"])?;
    state.model_name(req.model.as_deref())?;
    let tokens = state
        .llm
        .tokenizer
        .encode(&req.prompt, req.add_special_tokens)
        .map_err(|e| ApiError::invalid_param("prompt", format!("{e:#}")))?;
    Ok(Json(
        json!({"count": tokens.len(), "max_model_len": state.llm.max_model_len(), "tokens": tokens}),
    ))
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse_body(&body, &["model", "tokens"])?;
    state.model_name(req.model.as_deref())?;
    let vocab = state.llm.client.ready.model.vocab_size;
    if let Some(bad) = req.tokens.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("Token id {bad} is out of vocabulary (size {vocab})."),
        ));
    }
    let prompt = state
        .llm
        .tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    Ok(Json(json!({"prompt": prompt})))
}
