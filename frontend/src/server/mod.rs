//! The OpenAI-compatible HTTP server (axum). `serve` starts the engine, binds the listener
//! and serves until Ctrl-C / SIGTERM (a graceful drain, then exit 0: see `shutdown`) or
//! until the engine dies (exit 1 after a short grace, so in-flight responses can carry
//! their error to the clients).

mod admission;
mod auth;
mod body;
mod chat;
mod choices;
mod completions;
mod error;
mod fields;
mod health;
mod info;
mod listener;
mod request_fields;
#[cfg(test)]
mod request_fuzz;
mod shutdown;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::DefaultBodyLimit;
use axum::http::{Method, Uri};
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;

pub use error::ApiError;

use crate::async_llm::AsyncLLM;
use crate::cli::ServeArgs;

pub struct AppState {
    pub llm: AsyncLLM,
    pub served_model_names: Vec<String>,
    /// `--api-key` (or VLLM_API_KEY), required on every path under /v1.
    pub api_key: Option<String>,
    /// `--enable-log-requests`: log each request's parameters (and, at debug, its prompt).
    pub log_requests: bool,
    /// `--max-num-queued-reqs`: engine requests in flight, and their limit.
    pub admission: admission::Admission,
    /// Set on SIGTERM: /health answers 503 and new requests are refused.
    pub draining: AtomicBool,
    /// `--model` as given (a path or a Hub id), reported as each model's `root`.
    pub model_path: String,
    /// `--chat-template FILE`, else the tokenizer's; None: chat requests get a 400.
    pub chat_template: Option<crate::chat_template::ChatTemplate>,
}

impl AppState {
    /// The model name a response reports: the one asked for, or the first served name.
    pub fn model_name(&self, requested: Option<&str>) -> Result<String, ApiError> {
        match requested {
            None => Ok(self.served_model_names[0].clone()),
            Some(name) if self.served_model_names.iter().any(|n| n == name) => Ok(name.to_string()),
            Some(name) => Err(
                ApiError::not_found(format!("The model `{name}` does not exist."))
                    .with_param("model"),
            ),
        }
    }

    /// 503 once the engine is dead, so no request is accepted that could never finish, and
    /// while the server shuts down.
    pub fn check_alive(&self) -> Result<(), ApiError> {
        if let Some(why) = self.llm.client.dead_reason() {
            return Err(ApiError::unavailable(format!("The engine is dead: {why}")));
        }
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable(
                "The server is shutting down: it takes no new requests.",
            ));
        }
        Ok(())
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions::create_completion))
        .route("/v1/chat/completions", post(chat::create_chat_completion))
        .route("/v1/models", get(info::models))
        .route("/health", get(health::health))
        .route("/metrics", get(health::metrics))
        .route("/version", get(info::version))
        .route("/tokenize", post(info::tokenize))
        .route("/detokenize", post(info::detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body::MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        .with_state(state)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(format!(
        "Not Found: there is no endpoint at `{}`.",
        uri.path()
    ))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(format!(
        "Method Not Allowed: `{}` does not answer {method}.",
        uri.path()
    ))
}

/// `vllm-rs serve`: returns the process's exit code.
pub async fn serve(args: ServeArgs) -> anyhow::Result<i32> {
    let shutdown_timeout = Duration::try_from_secs_f64(args.shutdown_timeout).map_err(|_| {
        anyhow::anyhow!(
            "--shutdown-timeout must be a number of seconds ≥ 0, got {}",
            args.shutdown_timeout
        )
    })?;
    let llm = AsyncLLM::start(&args.engine).await?;
    let chat_template = match crate::chat_template::ChatTemplate::load(
        args.chat_template.as_deref(),
        &llm.tokenizer,
    ) {
        Ok(t) => t,
        Err(e) => {
            llm.shutdown().await;
            return Err(e);
        }
    };
    let state = Arc::new(AppState {
        llm,
        chat_template,
        served_model_names: args.engine.served_model_names(),
        // An empty key guards nothing, as in vLLM.
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        log_requests: args.enable_log_requests,
        admission: admission::Admission::new(args.max_num_queued_reqs),
        draining: AtomicBool::new(false),
        model_path: args.engine.model_name(),
    });
    let addr = format!("{}:{}", args.host, args.port);
    let listener = match listener::bind(&addr).await {
        Ok(listener) => listener,
        Err(e) => {
            state.llm.shutdown().await;
            return Err(e).with_context(|| format!("cannot listen on {addr}"));
        }
    };
    tracing::info!(
        "serving {} on http://{addr}",
        state.served_model_names.join(", ")
    );

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(state.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .await
    });
    let code = tokio::select! {
        why = state.llm.client.wait_dead() => {
            tracing::error!("shutting down: {why}");
            // Let in-flight responses carry their errors out, with /health at 503.
            tokio::time::sleep(Duration::from_secs(1)).await;
            1
        }
        () = shutdown::signal() => {
            shutdown::drain(&state, shutdown_timeout).await;
            0
        }
    };
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    state.llm.shutdown().await;
    Ok(code)
}
