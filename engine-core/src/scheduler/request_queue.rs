//! The waiting queue, in the policy's order.
//!
//! FCFS is a deque (preempted requests go back to the front). Priority is an ordered set
//! keyed by (priority, arrival time, admission order), so a preempted request simply
//! takes its place again by priority.

use std::cmp::Ordering;
use std::collections::{BTreeSet, VecDeque};

use super::config::SchedulingPolicy;
use crate::request::Request;

#[derive(Debug, Clone)]
pub(crate) struct PriorityKey {
    priority: i32,
    arrival_time: f64,
    arrival_seq: u64,
    request_id: String,
}

impl PriorityKey {
    fn of(req: &Request) -> Self {
        Self {
            priority: req.priority,
            arrival_time: req.arrival_time,
            arrival_seq: req.arrival_seq,
            request_id: req.request_id.clone(),
        }
    }
}

impl Ord for PriorityKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then(self.arrival_time.total_cmp(&other.arrival_time))
            .then(self.arrival_seq.cmp(&other.arrival_seq))
    }
}

impl PartialOrd for PriorityKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for PriorityKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for PriorityKey {}

#[derive(Debug, Clone)]
pub(crate) enum RequestQueue {
    Fcfs(VecDeque<String>),
    Priority(BTreeSet<PriorityKey>),
}

impl RequestQueue {
    pub fn new(policy: SchedulingPolicy) -> Self {
        match policy {
            SchedulingPolicy::Fcfs => Self::Fcfs(VecDeque::new()),
            SchedulingPolicy::Priority => Self::Priority(BTreeSet::new()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Fcfs(q) => q.len(),
            Self::Priority(q) => q.len(),
        }
    }

    /// Queues a newly arrived request.
    pub fn push_back(&mut self, req: &Request) {
        match self {
            Self::Fcfs(q) => q.push_back(req.request_id.clone()),
            Self::Priority(q) => {
                q.insert(PriorityKey::of(req));
            }
        }
    }

    /// Queues a preempted request ahead of the others (under Priority: at its rank).
    pub fn push_front(&mut self, req: &Request) {
        match self {
            Self::Fcfs(q) => q.push_front(req.request_id.clone()),
            Self::Priority(q) => {
                q.insert(PriorityKey::of(req));
            }
        }
    }

    /// Removes a request wherever it is (admitted or aborted).
    pub fn remove(&mut self, req: &Request) {
        match self {
            Self::Fcfs(q) => {
                if let Some(pos) = q.iter().position(|id| *id == req.request_id) {
                    q.remove(pos);
                }
            }
            Self::Priority(q) => {
                q.remove(&PriorityKey::of(req));
            }
        }
    }

    /// Ids in admission order, without copying them.
    pub fn iter(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match self {
            Self::Fcfs(q) => Box::new(q.iter().map(String::as_str)),
            Self::Priority(q) => Box::new(q.iter().map(|k| k.request_id.as_str())),
        }
    }

    /// Ids in admission order.
    pub fn ids(&self) -> Vec<String> {
        match self {
            Self::Fcfs(q) => q.iter().cloned().collect(),
            Self::Priority(q) => q.iter().map(|k| k.request_id.clone()).collect(),
        }
    }

    pub fn clear(&mut self) {
        match self {
            Self::Fcfs(q) => q.clear(),
            Self::Priority(q) => q.clear(),
        }
    }
}
