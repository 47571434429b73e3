//! The small endpoints: `GET /v1/models`, `GET /version`, `POST /tokenize`,
//! `POST /detokenize`.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::body::JsonObject;
use super::choices::created;
use super::fields::Fields;
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

pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<Value>, ApiError> {
    let f = Fields::new(&body, &[&["model", "prompt", "add_special_tokens"]])?;
    state.model_name(f.string("model")?)?;
    let Some(prompt) = f.string("prompt")? else {
        return Err(ApiError::invalid_param(
            "prompt",
            "prompt is required: the text to tokenize.",
        ));
    };
    let add_special_tokens = f.bool("add_special_tokens")?.unwrap_or(true);
    let tokens = state
        .llm
        .tokenizer
        .encode(prompt, add_special_tokens)
        .map_err(|e| ApiError::invalid_param("prompt", format!("{e:#}")))?;
    Ok(Json(
        json!({"count": tokens.len(), "max_model_len": state.llm.max_model_len(), "tokens": tokens}),
    ))
}

pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<Value>, ApiError> {
    let f = Fields::new(&body, &[&["model", "tokens"]])?;
    state.model_name(f.string("model")?)?;
    let vocab_size = state.llm.client.ready.model.vocab_size;
    let Some(tokens) = f.token_ids("tokens", vocab_size)? else {
        return Err(ApiError::invalid_param(
            "tokens",
            "tokens is required: a list of token ids.",
        ));
    };
    let prompt = state
        .llm
        .tokenizer
        .decode(&tokens, false)
        .map_err(|e| ApiError::invalid_param("tokens", format!("{e:#}")))?;
    Ok(Json(json!({"prompt": prompt})))
}
