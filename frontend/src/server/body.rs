//! Reading a request body into a JSON object, every failure an [`ApiError`] in OpenAI's
//! shape: a content type other than JSON (415), a body over [`MAX_BODY_BYTES`] (413), and
//! bytes that are not UTF-8, not JSON, nested too deep or not an object (400). What the
//! fields hold is [`super::fields`]' concern.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde_json::{Map, Value};

use super::ApiError;

/// The largest request body accepted: room for a full context of token ids many times over,
/// small enough that a flood of bodies cannot exhaust the frontend's memory.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// The body of a POST, checked to be one JSON object.
pub struct JsonObject(pub Map<String, Value>);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        check_content_type(req.headers().get(header::CONTENT_TYPE))?;
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(MAX_BODY_BYTES)
            } else {
                ApiError::bad_request(format!("Cannot read the request body: {}", e.body_text()))
            }
        })?;
        parse_object(&bytes).map(JsonObject)
    }
}

/// JSON bodies only; a request without a content type is read as JSON, as FastAPI does.
fn check_content_type(value: Option<&axum::http::HeaderValue>) -> Result<(), ApiError> {
    let Some(value) = value else {
        return Ok(());
    };
    let text = value.to_str().unwrap_or("");
    let mime = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json")) {
        return Ok(());
    }
    Err(ApiError::unsupported_media_type(format!(
        "Content-Type must be application/json, got `{}`.",
        text.chars().take(100).collect::<String>()
    )))
}

/// Parses `bytes` as one JSON object, with messages that say what is wrong and where.
pub fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ApiError::bad_request(format!(
            "The request body is not valid UTF-8: byte {} (0x{:02x}) is not part of a UTF-8 character.",
            e.valid_up_to(),
            bytes.get(e.valid_up_to()).copied().unwrap_or(0)
        )));
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "The request body is empty: it must be a JSON object.",
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        let at = format!("line {}, column {}", e.line(), e.column());
        let message = if e.is_eof() {
            format!("Invalid JSON in request body: it ends early, at {at} (truncated?).")
        } else if e.to_string().starts_with("recursion limit exceeded") {
            format!("Invalid JSON in request body: it nests deeper than 128 levels, at {at}.")
        } else {
            let what = e.to_string();
            let what = what.split(" at line ").next().unwrap_or(&what).to_string();
            format!("Invalid JSON in request body at {at}: {what}.")
        };
        ApiError::bad_request(message)
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::bad_request(format!(
            "The request body must be a JSON object, got {}.",
            kind_of(&other)
        ))),
    }
}

/// "a string", "an array", …: a JSON value's kind, for messages.
pub fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(bytes: &[u8]) -> String {
        parse_object(bytes).unwrap_err().message
    }

    #[test]
    fn bad_bodies_are_described() {
        assert!(message(b"{\"prompt\": ").contains("ends early"));
        assert!(message(b"[1, 2]").contains("must be a JSON object, got an array"));
        assert!(message(b"{\"a\": \xff}").contains("byte 6 (0xff)"));
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(message(deep.as_bytes()).contains("deeper than 128"));
        assert!(message(b"{\"a\" 1}").contains("line 1, column 6"));
        assert!(message(b"  ").contains("empty"));
        assert!(parse_object(b"{\"a\": 1}").is_ok());
    }

    #[test]
    fn only_json_content_types_pass() {
        let v = |s: &'static str| axum::http::HeaderValue::from_static(s);
        assert!(check_content_type(None).is_ok());
        assert!(check_content_type(Some(&v("application/json; charset=utf-8"))).is_ok());
        assert!(check_content_type(Some(&v("application/merge-patch+json"))).is_ok());
        let err = check_content_type(Some(&v("text/plain"))).unwrap_err();
        assert_eq!(err.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert!(err.message.contains("`text/plain`"));
    }
}
