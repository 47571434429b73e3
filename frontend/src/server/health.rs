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
    let model = &state.served_model_names[0];
    let gauges = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running_reqs as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.num_waiting_reqs as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage as f64,
        ),
    ];
    let mut out = String::new();
    for (name, help, value) in gauges {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} {value}\n"
        ));
    }
    ([("content-type", "text/plain; version=0.0.4")], out)
}
