//! One timed request of `bench serve`: a streamed `/v1/completions` call, its server-sent
//! events read as they arrive, with the time to the first token, the gap before each later
//! chunk, and the output length the server's `usage` reports.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

/// What to send.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Token ids or text, as the completions API takes it.
    pub prompt: Value,
    pub max_tokens: u32,
    pub ignore_eos: bool,
    pub temperature: f32,
}

/// How one request went (vLLM's `RequestFuncOutput`).
#[derive(Debug, Clone, Default)]
pub struct RequestOutcome {
    pub success: bool,
    pub error: String,
    /// Prompt tokens, as the server's `usage` counts them.
    pub prompt_len: usize,
    pub output_tokens: usize,
    /// From sending the request to the first chunk with a choice.
    pub ttft: Duration,
    /// Gaps between consecutive chunks with a choice after the first.
    pub itl: Vec<Duration>,
    /// From sending to the last event.
    pub latency: Duration,
}

/// Sends `spec` to `url` (the completions endpoint) as `model`, streaming.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    spec: &RequestSpec,
) -> RequestOutcome {
    let mut outcome = RequestOutcome::default();
    let start = Instant::now();
    match stream(client, url, model, spec, start, &mut outcome).await {
        Ok(()) => outcome.success = true,
        Err(e) => outcome.error = e,
    }
    outcome.latency = start.elapsed();
    outcome
}

async fn stream(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    spec: &RequestSpec,
    start: Instant,
    outcome: &mut RequestOutcome,
) -> Result<(), String> {
    let body = json!({
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": spec.ignore_eos,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let response = client
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("{e}"))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(format!("HTTP {status}: {}", text.trim()));
    }
    let mut events = SseEvents::default();
    let mut bytes = response.bytes_stream();
    let mut last_chunk: Option<Instant> = None;
    let mut done = false;
    while let Some(piece) = bytes.next().await {
        let piece = piece.map_err(|e| format!("reading the stream: {e}"))?;
        for data in events.push(&piece) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let event: Value =
                serde_json::from_str(&data).map_err(|e| format!("bad event {data:?}: {e}"))?;
            if let Some(error) = event.get("error") {
                return Err(format!("the server reported: {error}"));
            }
            if let Some(usage) = event.get("usage").filter(|u| u.is_object()) {
                outcome.prompt_len = usage["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                outcome.output_tokens = usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
            }
            // A chunk with a choice carries tokens even when its text is empty (special
            // tokens, bytes of an unfinished character), as vLLM's bench counts them; only
            // the usage event has none.
            let has_tokens = event["choices"].as_array().is_some_and(|c| !c.is_empty());
            if has_tokens {
                let now = Instant::now();
                match last_chunk {
                    None => outcome.ttft = now - start,
                    Some(prev) => outcome.itl.push(now - prev),
                }
                last_chunk = Some(now);
            }
        }
    }
    if !done {
        return Err("the stream ended without [DONE]".into());
    }
    if last_chunk.is_none() {
        return Err("no token came back".into());
    }
    Ok(())
}

/// Splits a byte stream into server-sent events' `data` fields.
#[derive(Default)]
struct SseEvents {
    buffer: Vec<u8>,
}

impl SseEvents {
    /// Appends `bytes`; returns the data of every event now complete.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = find(&self.buffer, b"\n\n") {
            let event: Vec<u8> = self.buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads() {
        let mut sse = SseEvents::default();
        assert!(sse.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            sse.push(b": 1}\n\ndata: [DONE]\n\n"),
            vec!["{\"a\": 1}", "[DONE]"]
        );
        assert_eq!(sse.push(b": comment\n\n"), Vec::<String>::new());
        assert_eq!(sse.push(b"data:x\ndata: y\n\n"), vec!["x\ny"]);
    }

    /// Serves streamed completions whose token chunks all have empty text (a model that
    /// emits special tokens only).
    async fn serve_empty_text_stream() -> String {
        let chunk = |finish: &str| {
            format!("data: {{\"choices\": [{{\"index\": 0, \"text\": \"\", \"finish_reason\": {finish}}}]}}\n\n")
        };
        let mut body = chunk("null").repeat(3);
        body.push_str(&chunk("\"length\""));
        body.push_str("data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 2, \"completion_tokens\": 4}}\n\n");
        body.push_str("data: [DONE]\n\n");
        let stream = move || async move {
            (
                [(axum::http::header::CONTENT_TYPE, "text/event-stream")],
                body,
            )
        };
        let app = axum::Router::new().route("/v1/completions", axum::routing::post(stream));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    #[tokio::test]
    async fn chunks_with_empty_text_still_carry_tokens() {
        let url = serve_empty_text_stream().await;
        let spec = RequestSpec {
            prompt: json!([1, 2]),
            max_tokens: 4,
            ignore_eos: true,
            temperature: 0.0,
        };
        let outcome = send(&reqwest::Client::new(), &url, "m", &spec).await;
        assert!(outcome.success, "{}", outcome.error);
        assert_eq!((outcome.prompt_len, outcome.output_tokens), (2, 4));
        // Four chunks with a choice: a first token and three gaps; the usage event is none.
        assert_eq!(outcome.itl.len(), 3);
        assert!(outcome.ttft > Duration::ZERO);
    }
}
