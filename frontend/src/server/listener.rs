//! The server's TCP listener: every accepted connection sends each write at once
//! (TCP_NODELAY), as uvicorn's do for vLLM.
//!
//! With Nagle's algorithm on, a streamed chunk written while the response head was still
//! unacknowledged waited for the client's delayed ACK: at 16 req/s `bench serve` saw a
//! third of its first tokens 20–45 ms late (TTFT median 4.1 ms, p99 44 ms;
//! docs/BENCHMARKS.md).

use axum::serve::{ListenerExt, TapIo};
use tokio::net::{TcpListener, TcpStream};

pub type Listener = TapIo<TcpListener, fn(&mut TcpStream)>;

/// Binds `addr`; the accepted connections get TCP_NODELAY.
pub async fn bind(addr: &str) -> std::io::Result<Listener> {
    let listener = TcpListener::bind(addr).await?;
    Ok(listener.tap_io(no_delay as fn(&mut TcpStream)))
}

fn no_delay(stream: &mut TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        // The connection still works, only with Nagle's delays.
        tracing::warn!("setting TCP_NODELAY on a connection failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener as _;

    #[tokio::test]
    async fn accepted_connections_send_at_once() {
        let mut listener = bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(TcpStream::connect(addr));
        let (stream, _) = listener.accept().await;
        assert!(
            stream.nodelay().unwrap(),
            "TCP_NODELAY is off on an accepted connection"
        );
        client.await.unwrap().unwrap();
    }
}
