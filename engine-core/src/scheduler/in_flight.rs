//! The steps sent to the workers whose output has not come back yet, as the scheduler
//! planned them.
//!
//! Without async scheduling there is at most one, and it is resolved before the next
//! `schedule()`. With it (`--async-scheduling`) the engine-core schedules step N+1 while
//! step N runs, so two can be in flight, and by the time a step's output arrives its
//! requests may have finished, been aborted, or been preempted (and even readmitted, or
//! their id reused). Each entry therefore remembers which *admission* of each request it
//! was scheduled for, and whether that request samples in the step (holding an output
//! placeholder until the output arrives): an output for another admission is stale and
//! dropped, its token never reaching the client.

use std::collections::{HashMap, VecDeque};

/// One scheduled request of an in-flight step, in `num_scheduled_tokens` order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledRequest {
    /// `Request::admission_seq` when the step was scheduled.
    pub admission_seq: u64,
    /// The step computes up to the end of the sequence, so it samples a token (and the
    /// request holds a placeholder for it); false for a prefill chunk that stops short.
    pub samples: bool,
}

#[derive(Debug, Clone)]
pub struct InFlightStep {
    pub step_id: u64,
    pub requests: Vec<ScheduledRequest>,
}

/// Steps sent and not yet updated from their output, oldest first.
#[derive(Debug, Default)]
pub struct InFlightSteps {
    steps: VecDeque<InFlightStep>,
}

impl InFlightSteps {
    pub fn push(&mut self, step: InFlightStep) {
        self.steps.push_back(step);
    }

    /// Takes the record of `step_id`. Steps are updated in the order they were sent, so it
    /// is the oldest; older ones left behind (never updated) are dropped with it.
    pub fn take(&mut self, step_id: u64) -> Option<InFlightStep> {
        while let Some(step) = self.steps.pop_front() {
            if step.step_id == step_id {
                return Some(step);
            }
            tracing::warn!(
                step = step.step_id,
                "dropping the record of a step that was never updated"
            );
        }
        None
    }

    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn clear(&mut self) {
        self.steps.clear();
    }

    /// How many placeholders each admission holds in the steps in flight: the count every
    /// running request's `num_output_placeholders` must equal.
    pub fn placeholders_by_admission(&self) -> HashMap<u64, u32> {
        let mut counts = HashMap::new();
        for r in self.steps.iter().flat_map(|s| &s.requests) {
            if r.samples {
                *counts.entry(r.admission_seq).or_insert(0) += 1;
            }
        }
        counts
    }
}
