//! ZeroMQ plumbing shared by every process that links engine-core: binding and connecting
//! the `ipc://` sockets of one run, and sending and receiving framed messages.
//!
//! A malformed frame is logged and dropped here, so no caller ever dies of one.

use std::path::Path;

use bytes::Bytes;
use vllm_protocol::WireMessage;
use zeromq::{SocketRecv, SocketSend, ZmqMessage};

/// The `ipc://` endpoint of a socket file named `name` inside the run's private directory.
pub fn ipc_endpoint(run_dir: &Path, name: &str) -> String {
    format!("ipc://{}", run_dir.join(name).display())
}

/// Encodes `msg` as one frame and sends it.
pub async fn send<S: SocketSend + ?Sized, M: WireMessage>(
    socket: &mut S,
    msg: &M,
) -> anyhow::Result<()> {
    let frame = msg.encode()?;
    socket.send(ZmqMessage::from(frame)).await?;
    Ok(())
}

/// Sends `msg` through a ROUTER to the peer with routing identity `peer`.
pub async fn send_to<S: SocketSend + ?Sized, M: WireMessage>(
    socket: &mut S,
    peer: &Bytes,
    msg: &M,
) -> anyhow::Result<()> {
    let mut message = ZmqMessage::from(msg.encode()?);
    message.push_front(peer.clone());
    socket.send(message).await?;
    Ok(())
}

/// Receives the next well-formed message. Malformed frames are logged and skipped; an error
/// means the socket itself failed.
pub async fn recv<S: SocketRecv + ?Sized, M: WireMessage>(
    socket: &mut S,
    what: &str,
) -> anyhow::Result<M> {
    loop {
        let message = socket.recv().await?;
        let Some(frame) = message.iter().last() else {
            continue;
        };
        match M::decode(frame) {
            Ok(msg) => return Ok(msg),
            Err(e) => tracing::warn!("dropping malformed frame on {what}: {e}"),
        }
    }
}

/// Receives the next well-formed message from a ROUTER, with the sender's identity.
pub async fn recv_from<S: SocketRecv + ?Sized, M: WireMessage>(
    socket: &mut S,
    what: &str,
) -> anyhow::Result<(Bytes, M)> {
    loop {
        let message = socket.recv().await?;
        let (Some(peer), Some(frame)) = (message.get(0), message.iter().last()) else {
            continue;
        };
        if message.len() < 2 {
            tracing::warn!("dropping frame without identity on {what}");
            continue;
        }
        match M::decode(frame) {
            Ok(msg) => return Ok((peer.clone(), msg)),
            Err(e) => tracing::warn!("dropping malformed frame on {what}: {e}"),
        }
    }
}
