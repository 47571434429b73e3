//! The API key (`--api-key`, or the `VLLM_API_KEY` environment variable): as in vLLM,
//! every path under `/v1`, unknown ones included, needs `Authorization: Bearer KEY`, while
//! `/health`, `/metrics`, `/version`, `/tokenize` and `/detokenize` stay open. The key is
//! compared in constant time, so how long a refusal takes never tells how much of a guess
//! was right.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::{ApiError, AppState};

pub async fn require_api_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.api_key {
        let guarded = req.uri().path().starts_with("/v1") && req.method() != Method::OPTIONS;
        if guarded && !bearer_matches(req.headers().get(header::AUTHORIZATION), key) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Whether `Authorization` is `Bearer <key>`.
fn bearer_matches(header: Option<&HeaderValue>, key: &str) -> bool {
    let given = header
        .map(HeaderValue::as_bytes)
        .and_then(|v| v.strip_prefix(b"Bearer "))
        .unwrap_or(b"");
    constant_time_eq(given, key.as_bytes())
}

/// Byte equality whose time depends on the lengths only, never on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_key_matches() {
        let h = |s: &'static str| HeaderValue::from_static(s);
        assert!(bearer_matches(Some(&h("Bearer sesame")), "sesame"));
        assert!(!bearer_matches(Some(&h("Bearer sesamE")), "sesame"));
        assert!(!bearer_matches(Some(&h("Bearer sesame2")), "sesame"));
        assert!(!bearer_matches(Some(&h("sesame")), "sesame"));
        assert!(!bearer_matches(Some(&h("Basic sesame")), "sesame"));
        assert!(!bearer_matches(None, "sesame"));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"a", b""));
    }
}
