//! Framing: one message-type byte, then the msgpack encoding of that message's payload.
//!
//! The type byte lets a receiver reject a frame meant for another socket (or from another
//! build) before it tries to decode it, and keeps the payload a plain struct, readable by
//! any msgpack tool.

use serde::{de::DeserializeOwned, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("empty frame")]
    Empty,
    #[error("unknown message type byte {0:#04x}")]
    UnknownType(u8),
    #[error("malformed payload for message type {kind:#04x}: {source}")]
    Payload {
        kind: u8,
        source: rmp_serde::decode::Error,
    },
    #[error("message type {kind:#04x}: {extra} bytes after the payload")]
    TrailingBytes { kind: u8, extra: usize },
    #[error("cannot encode message: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
}

/// A message enum that travels on one socket. Each variant has a fixed type byte.
pub trait WireMessage: Sized {
    /// The type byte of this message and its payload, encoded.
    fn encode(&self) -> Result<Vec<u8>, FrameError>;
    /// Parses a frame produced by [`WireMessage::encode`].
    fn decode(frame: &[u8]) -> Result<Self, FrameError>;
}

/// Writes `kind` then the msgpack of `payload` (structs as maps, so fields may be added
/// with `#[serde(default)]` without breaking older readers).
pub fn encode_payload<T: Serialize>(kind: u8, payload: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![kind];
    rmp_serde::encode::write_named(&mut out, payload)?;
    Ok(out)
}

/// Splits a frame into its type byte and payload bytes.
pub fn split(frame: &[u8]) -> Result<(u8, &[u8]), FrameError> {
    frame
        .split_first()
        .map(|(k, p)| (*k, p))
        .ok_or(FrameError::Empty)
}

/// Decodes the whole payload: bytes left after the message make the frame malformed (a
/// frame that was cut and glued, or of another build), not silently ignored.
pub fn decode_payload<T: DeserializeOwned>(kind: u8, payload: &[u8]) -> Result<T, FrameError> {
    let mut de = rmp_serde::Deserializer::new(std::io::Cursor::new(payload));
    let value = T::deserialize(&mut de).map_err(|source| FrameError::Payload { kind, source })?;
    let extra = payload.len() - (de.position() as usize).min(payload.len());
    if extra > 0 {
        return Err(FrameError::TrailingBytes { kind, extra });
    }
    Ok(value)
}

/// Implements [`WireMessage`] for an enum whose variants each wrap one payload type.
#[macro_export]
macro_rules! wire_message {
    ($name:ident { $($variant:ident($payload:ty) = $kind:literal),+ $(,)? }) => {
        impl $crate::frame::WireMessage for $name {
            fn encode(&self) -> Result<Vec<u8>, $crate::frame::FrameError> {
                match self {
                    $($name::$variant(p) => $crate::frame::encode_payload($kind, p),)+
                }
            }
            fn decode(frame: &[u8]) -> Result<Self, $crate::frame::FrameError> {
                let (kind, payload) = $crate::frame::split(frame)?;
                match kind {
                    $($kind => Ok($name::$variant($crate::frame::decode_payload(kind, payload)?)),)+
                    other => Err($crate::frame::FrameError::UnknownType(other)),
                }
            }
        }
    };
}
