//! The graceful shutdown of `serve`, as deliberate as the request path. On SIGTERM (or
//! Ctrl-C) the server drains: `/health` answers 503 and new generation requests are
//! refused with a 503, while the requests in flight run on for up to `--shutdown-timeout`
//! seconds. Whatever is still running then (or at once, on a second signal) ends with an
//! error its client sees, and only after that do the listener, the engine-core and the
//! workers stop. The exit code stays 0: the shutdown was asked for.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::AppState;

/// The start of the error that requests cut short by the shutdown end with.
pub const SHUTTING_DOWN: &str = "the server is shutting down";

/// Resolves on Ctrl-C or SIGTERM.
pub async fn signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

/// Drains the server: refuses new requests, waits up to `timeout` for those in flight,
/// then ends the rest with an error and waits (briefly) for their responses to go out.
pub async fn drain(state: &AppState, timeout: Duration) {
    state.draining.store(true, Ordering::SeqCst);
    let secs = timeout.as_secs_f64();
    tracing::info!(
        "shutting down: refusing new requests; waiting up to {secs} s (--shutdown-timeout) for {} in flight",
        state.admission.in_flight()
    );
    tokio::select! {
        () = until_idle(state) => {
            tracing::info!("every request in flight has finished");
            return;
        }
        () = tokio::time::sleep(timeout) => tracing::warn!(
            "{} requests still in flight after {secs} s (--shutdown-timeout): ending them",
            state.admission.in_flight()
        ),
        () = signal() => tracing::warn!(
            "a second signal: ending the {} requests in flight now",
            state.admission.in_flight()
        ),
        _ = state.llm.client.wait_dead() => {}
    }
    state.llm.client.fail_in_flight(&format!(
        "{SHUTTING_DOWN}: the request did not finish within --shutdown-timeout ({secs} s)"
    ));
    // Let the failed responses reach their clients before the listener closes.
    let _ = tokio::time::timeout(Duration::from_secs(2), until_idle(state)).await;
}

async fn until_idle(state: &AppState) {
    while state.admission.in_flight() > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
