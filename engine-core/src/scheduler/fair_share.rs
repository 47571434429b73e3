//! Fair shares of the sequence slots among API requests.
//!
//! The prompts and `n` samples of one API request reach the engine as separate requests
//! that share one group (`parent_request_id`). A group may fill every free slot, but while
//! another group waits, no group keeps more than `max_num_seqs / groups` of them: waiting
//! requests of groups under their share are admitted first, and when every slot is taken
//! the largest group above its share gives up its latest admitted requests (preemption by
//! recompute). Without this, one request with `n = max_num_seqs` and a long `max_tokens`
//! would hold every slot for minutes while other clients time out. With one request per
//! group (no `n`, one prompt) every group's share is at least its one request, and the
//! order is the policy's alone.

use std::collections::{HashMap, HashSet};

/// Running requests per group, and the share of the slots each group may hold.
#[derive(Debug)]
pub(crate) struct Shares {
    running: HashMap<String, u32>,
    /// Slots per group when every group with work wants them: at least 1.
    share: u32,
}

impl Shares {
    /// `running` and `waiting` give the group of each running and waiting request.
    pub fn new<'a>(
        running: impl Iterator<Item = &'a str>,
        waiting: impl Iterator<Item = &'a str>,
        max_num_seqs: u32,
    ) -> Self {
        let mut counts: HashMap<String, u32> = HashMap::new();
        for group in running {
            *counts.entry(group.to_string()).or_default() += 1;
        }
        let waiting_only: HashSet<&str> = waiting.filter(|g| !counts.contains_key(*g)).collect();
        let num_groups = u32::try_from(counts.len() + waiting_only.len())
            .unwrap_or(u32::MAX)
            .max(1);
        Self {
            running: counts,
            share: (max_num_seqs / num_groups).max(1),
        }
    }

    pub fn running(&self, group: &str) -> u32 {
        self.running.get(group).copied().unwrap_or(0)
    }

    /// Whether one more running request of `group` stays within its share.
    pub fn under_share(&self, group: &str) -> bool {
        self.running(group) < self.share
    }

    /// Slots `group` may still take within its share.
    pub fn room(&self, group: &str) -> u32 {
        self.share.saturating_sub(self.running(group))
    }

    /// The group holding the most slots, when that is more than its share.
    pub fn largest_over_share(&self) -> Option<String> {
        self.running
            .iter()
            .filter(|&(_, &n)| n > self.share)
            .max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(group, _)| group.clone())
    }

    pub fn admitted(&mut self, group: &str) {
        *self.running.entry(group.to_string()).or_default() += 1;
    }

    pub fn released(&mut self, group: &str) {
        if let Some(n) = self.running.get_mut(group) {
            *n = n.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_divides_the_slots_among_groups_with_work() {
        let s = Shares::new(["a", "a", "a", "b"].into_iter(), ["c"].into_iter(), 8);
        assert_eq!(s.share, 2);
        assert_eq!(s.room("a"), 0);
        assert!(!s.under_share("a"));
        assert!(s.under_share("c"));
        assert_eq!(s.largest_over_share().as_deref(), Some("a"));
        let alone = Shares::new(["a"; 8].into_iter(), std::iter::empty(), 8);
        assert_eq!(
            alone.largest_over_share(),
            None,
            "a lone group may fill every slot"
        );
        let many = Shares::new(std::iter::empty(), ["a", "b", "c"].into_iter(), 2);
        assert_eq!(many.share, 1, "every group may run at least one request");
    }
}
