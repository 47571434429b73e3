//! Stop strings, matched on the streamed text of one request.
//!
//! The engine never sees stop strings (DESIGN §4): the frontend feeds each detokenized
//! delta to a [`StopChecker`], which releases text that can no longer be part of a stop
//! string, holds back the shortest tail that could still begin one, and reports the first
//! stop string that completes (the earliest in the text; on a tie, the first listed). A stop
//! string may span any number of deltas.

/// Where a stop string matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// Index of the stop string in the list the checker was built with.
    pub index: usize,
    /// Byte offset in the whole output text (all deltas fed so far) where it begins.
    pub offset: usize,
}

/// What one delta released.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that may be sent to the client now.
    pub text: String,
    /// Set when a stop string matched: `text` then ends right before it, or right after it
    /// with `include_stop_str_in_output`, and the request is finished.
    pub stopped: Option<StopMatch>,
}

#[derive(Debug, Clone)]
pub struct StopChecker {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    /// Text fed but not released yet: a tail that could begin a stop string.
    pending: String,
    /// Byte offset, in the whole output, of `pending`'s start.
    pending_offset: usize,
    stopped: bool,
}

impl StopChecker {
    /// Empty stop strings are ignored (they would stop before any text).
    pub fn new(stops: Vec<String>, include_stop_str_in_output: bool) -> Self {
        StopChecker {
            stops,
            include_stop_str_in_output,
            pending: String::new(),
            pending_offset: 0,
            stopped: false,
        }
    }

    /// True when there are no stop strings: every delta passes through unchanged.
    pub fn is_empty(&self) -> bool {
        self.stops.iter().all(String::is_empty)
    }

    /// Whether a stop string has matched; later deltas are ignored.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next delta of output text.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        self.pending.push_str(delta);
        // Every stop string that began in released text was ruled out when it was
        // released, so a match can only begin inside `pending`.
        if let Some((index, start)) = self.earliest_match() {
            let end = if self.include_stop_str_in_output {
                start + self.stops[index].len()
            } else {
                start
            };
            let text = self.pending[..end].to_string();
            let offset = self.pending_offset + start;
            self.pending.clear();
            self.stopped = true;
            return StopOutput {
                text,
                stopped: Some(StopMatch { index, offset }),
            };
        }
        let keep = self.longest_partial_tail();
        let release = self.pending.len() - keep;
        StopOutput {
            text: self.release(release),
            stopped: None,
        }
    }

    /// Releases the held tail: call when the request ends for another reason (eos, length).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        self.release(self.pending.len())
    }

    /// The first `len` bytes of `pending`, removed from it.
    fn release(&mut self, len: usize) -> String {
        let rest = self.pending.split_off(len);
        self.pending_offset += len;
        std::mem::replace(&mut self.pending, rest)
    }

    /// (stop index, byte start in `pending`) of the earliest occurrence of any stop string.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|start| (i, start)))
            .min_by_key(|&(i, start)| (start, i))
    }

    /// Length in bytes of the longest suffix of `pending` that is a proper prefix of a stop
    /// string: the text that must wait for the next delta.
    fn longest_partial_tail(&self) -> usize {
        self.stops
            .iter()
            .map(|stop| partial_overlap(&self.pending, stop))
            .max()
            .unwrap_or(0)
    }
}

/// Longest suffix of `text` (starting on a char boundary) that is a proper prefix of `stop`.
fn partial_overlap(text: &str, stop: &str) -> usize {
    let longest = stop.len().saturating_sub(1).min(text.len());
    (1..=longest)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(stops: &[&str], include: bool) -> StopChecker {
        StopChecker::new(stops.iter().map(|s| s.to_string()).collect(), include)
    }

    /// Feeds the deltas; returns all released text and the match.
    fn run(c: &mut StopChecker, deltas: &[&str]) -> (String, Option<StopMatch>) {
        let mut text = String::new();
        for d in deltas {
            let out = c.push(d);
            text.push_str(&out.text);
            if out.stopped.is_some() {
                return (text, out.stopped);
            }
        }
        text.push_str(&c.finish());
        (text, None)
    }

    #[test]
    fn no_stop_strings_pass_everything_through() {
        let mut c = checker(&[], false);
        assert!(c.is_empty());
        assert_eq!(c.push("abc").text, "abc");
        assert_eq!(c.finish(), "");
    }

    #[test]
    fn stop_within_one_delta() {
        let mut c = checker(&["STOP"], false);
        let out = c.push("hello STOP world");
        assert_eq!(out.text, "hello ");
        assert_eq!(
            out.stopped,
            Some(StopMatch {
                index: 0,
                offset: 6
            })
        );
        assert!(c.is_stopped());
        assert_eq!(c.push("more").text, "");
        assert_eq!(c.finish(), "");
    }

    #[test]
    fn include_stop_str_in_output() {
        let mut c = checker(&["STOP"], true);
        let (text, stop) = run(&mut c, &["hello ST", "OP world"]);
        assert_eq!(text, "hello STOP");
        assert_eq!(
            stop,
            Some(StopMatch {
                index: 0,
                offset: 6
            })
        );
    }

    #[test]
    fn stop_spanning_many_deltas_is_held_back_then_cut() {
        let mut c = checker(&["<end>"], false);
        assert_eq!(c.push("abc<").text, "abc");
        assert_eq!(c.push("e").text, "");
        assert_eq!(c.push("n").text, "");
        let out = c.push("d>tail");
        assert_eq!(out.text, "");
        assert_eq!(
            out.stopped,
            Some(StopMatch {
                index: 0,
                offset: 3
            })
        );
    }

    #[test]
    fn a_false_start_is_released() {
        let mut c = checker(&["<end>"], false);
        assert_eq!(c.push("a<en").text, "a");
        assert_eq!(c.push("x").text, "<enx");
        let (text, stop) = run(&mut c, &["y <e"]);
        assert_eq!(
            (text.as_str(), stop),
            ("y <e", None),
            "finish flushes the tail"
        );
    }

    #[test]
    fn overlapping_prefixes_hold_the_longest_candidate() {
        // "aab" could begin at the second 'a' after "aa" turns out not to be followed by 'b'.
        let mut c = checker(&["aab"], false);
        let (text, stop) = run(&mut c, &["xa", "a", "a", "b!"]);
        assert_eq!(text, "xa");
        assert_eq!(
            stop,
            Some(StopMatch {
                index: 0,
                offset: 2
            })
        );
    }

    #[test]
    fn earliest_match_wins_then_list_order() {
        let mut c = checker(&["world", "lo"], false);
        let out = c.push("hello world");
        assert_eq!(out.text, "hel");
        assert_eq!(
            out.stopped,
            Some(StopMatch {
                index: 1,
                offset: 3
            })
        );

        let mut c = checker(&["ab", "abc"], true);
        let out = c.push("xabc");
        assert_eq!(out.text, "xab");
        assert_eq!(out.stopped.map(|m| m.index), Some(0));
    }

    #[test]
    fn offsets_count_released_text() {
        let mut c = checker(&["!"], false);
        assert_eq!(c.push("héllo ").text, "héllo ");
        let out = c.push("wörld!");
        assert_eq!(out.text, "wörld");
        assert_eq!(
            out.stopped,
            Some(StopMatch {
                index: 0,
                offset: "héllo wörld".len()
            })
        );
    }

    #[test]
    fn multibyte_stop_strings_and_text() {
        let mut c = checker(&["。終"], false);
        assert_eq!(c.push("日本語。").text, "日本語");
        let out = c.push("終わり");
        assert_eq!(out.text, "");
        assert!(out.stopped.is_some());

        let mut c = checker(&["🦀🚀"], false);
        assert_eq!(c.push("a🦀").text, "a");
        assert_eq!(c.push("🦀").text, "🦀");
        let (text, stop) = run(&mut c, &["x"]);
        assert_eq!((text.as_str(), stop), ("🦀x", None));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let mut c = checker(&["", "z"], false);
        assert!(!c.is_empty());
        assert_eq!(c.push("abc").text, "abc");
        assert_eq!(c.push("yz").stopped.map(|m| m.index), Some(1));
    }

    /// Whatever the split into deltas, the released text is the same as on the whole text.
    #[test]
    fn result_does_not_depend_on_delta_boundaries() {
        let text = "the cat sat on the mat; the end. THE END";
        let stops = ["the end", "mat;x", "THE"];
        let mut whole = checker(&stops, false);
        let expected = run(&mut whole, &[text]);
        assert_eq!(expected.0, "the cat sat on the mat; ");
        for step in 1..8 {
            let pieces: Vec<&str> = text
                .as_bytes()
                .chunks(step)
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect();
            let mut c = checker(&stops, false);
            assert_eq!(run(&mut c, &pieces), expected, "step {step}");
        }
    }
}
