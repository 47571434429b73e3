//! `/health` (200 while the engine lives, 503 once it is dead) and `/metrics`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;

use super::AppState;

pub async fn health(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    match state.check_alive() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Prometheus text format, vLLM's metric names, labelled with the model name.
pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let stats = state.llm.client.stats().await;
    (
        [("content-type", "text/plain; version=0.0.4")],
        state.llm.metrics.render(&stats),
    )
}
