//! Admission control (`--max-num-queued-reqs`, vLLM's name): at most N engine requests in
//! flight, waiting or running, each prompt × sample of an API request counting one. A
//! request that would go over is refused at once with a 503 and `Retry-After`, before any
//! engine request is made, so an overloaded server sheds load instead of growing a queue
//! without bound. Each admitted engine request holds a [`Ticket`] until its stream ends or
//! is dropped (a client that went away).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::ApiError;

/// Seconds a refused client is asked to wait before it retries.
const RETRY_AFTER_S: u32 = 1;

#[derive(Debug, Default)]
pub struct Admission {
    /// None: no limit.
    limit: Option<usize>,
    in_flight: Arc<AtomicUsize>,
}

/// One admitted engine request; dropping it frees its place.
#[derive(Debug)]
pub struct Ticket {
    in_flight: Arc<AtomicUsize>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(limit: Option<usize>) -> Self {
        Self {
            limit,
            in_flight: Arc::default(),
        }
    }

    /// Engine requests admitted and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Admits `count` engine requests together, or none of them.
    pub fn admit(&self, count: usize) -> Result<Vec<Ticket>, ApiError> {
        let admitted = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                let after = now.checked_add(count)?;
                self.limit
                    .is_none_or(|limit| after <= limit)
                    .then_some(after)
            });
        match admitted {
            Ok(_) => Ok((0..count)
                .map(|_| Ticket {
                    in_flight: self.in_flight.clone(),
                })
                .collect()),
            Err(now) => Err(ApiError::overloaded(
                format!(
                    "The server is at capacity: {now} requests are in flight and this one needs {count} more, but at most {} may be (--max-num-queued-reqs). Retry later.",
                    self.limit.unwrap_or(0)
                ),
                RETRY_AFTER_S,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_frees_on_drop() {
        let a = Admission::new(Some(3));
        let two = a.admit(2).unwrap();
        let err = a.admit(2).unwrap_err();
        assert_eq!(err.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(err.retry_after_s, Some(1));
        assert!(
            err.message.contains("2 requests are in flight"),
            "{}",
            err.message
        );
        let one = a.admit(1).unwrap();
        assert_eq!(a.in_flight(), 3);
        drop(two);
        drop(one);
        assert_eq!(a.in_flight(), 0);
        assert_eq!(Admission::new(None).admit(1000).unwrap().len(), 1000);
    }
}
