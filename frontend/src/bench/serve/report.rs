//! The figures of a `bench serve` run, computed as vLLM's `vllm bench serve` computes them:
//! throughput over the whole run, and TTFT, TPOT (excluding the first token) and ITL over
//! the successful requests, each as mean, median and p99 in milliseconds.

use std::time::Duration;

use serde_json::{json, Value};

use super::request::RequestOutcome;
use crate::bench::{mean, percentile};

/// Mean, median and p99 of one latency, in ms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub median: f64,
    pub p99: f64,
}

impl Stat {
    fn of(values_ms: &[f64]) -> Stat {
        Stat {
            mean: mean(values_ms).unwrap_or(0.0),
            median: percentile(values_ms, 50.0).unwrap_or(0.0),
            p99: percentile(values_ms, 99.0).unwrap_or(0.0),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct ServeReport {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Stat,
    pub tpot: Stat,
    pub itl: Stat,
    /// The first few distinct errors, for the report.
    pub errors: Vec<String>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl ServeReport {
    pub fn new(outcomes: &[RequestOutcome], duration: Duration) -> ServeReport {
        let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.success).collect();
        let duration_s = duration.as_secs_f64().max(1e-9);
        let total_input_tokens: usize = ok.iter().map(|o| o.prompt_len).sum();
        let total_output_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
        let ttfts: Vec<f64> = ok.iter().map(|o| ms(o.ttft)).collect();
        let tpots: Vec<f64> = ok
            .iter()
            .filter(|o| o.output_tokens > 1)
            .map(|o| (ms(o.latency) - ms(o.ttft)) / (o.output_tokens - 1) as f64)
            .collect();
        let itls: Vec<f64> = ok
            .iter()
            .flat_map(|o| o.itl.iter().map(|&d| ms(d)))
            .collect();
        let mut errors: Vec<String> = Vec::new();
        for o in outcomes.iter().filter(|o| !o.success) {
            if errors.len() < 5 && !errors.contains(&o.error) {
                errors.push(o.error.clone());
            }
        }
        ServeReport {
            completed: ok.len(),
            failed: outcomes.len() - ok.len(),
            duration_s,
            total_input_tokens,
            total_output_tokens,
            request_throughput: ok.len() as f64 / duration_s,
            output_throughput: total_output_tokens as f64 / duration_s,
            total_token_throughput: (total_input_tokens + total_output_tokens) as f64 / duration_s,
            ttft: Stat::of(&ttfts),
            tpot: Stat::of(&tpots),
            itl: Stat::of(&itls),
            errors,
        }
    }

    /// The report, laid out as vLLM prints it.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| s.push_str(&format!("{k:<40}{v:<10}\n"));
        let rule = |s: &mut String, title: &str| s.push_str(&format!("{title:-^50}\n"));
        s.push_str(&format!("{:=^50}\n", " Serving Benchmark Result "));
        line(&mut s, "Successful requests:", self.completed.to_string());
        line(&mut s, "Failed requests:", self.failed.to_string());
        line(
            &mut s,
            "Benchmark duration (s):",
            format!("{:.2}", self.duration_s),
        );
        line(
            &mut s,
            "Total input tokens:",
            self.total_input_tokens.to_string(),
        );
        line(
            &mut s,
            "Total generated tokens:",
            self.total_output_tokens.to_string(),
        );
        line(
            &mut s,
            "Request throughput (req/s):",
            format!("{:.2}", self.request_throughput),
        );
        line(
            &mut s,
            "Output token throughput (tok/s):",
            format!("{:.2}", self.output_throughput),
        );
        line(
            &mut s,
            "Total Token throughput (tok/s):",
            format!("{:.2}", self.total_token_throughput),
        );
        for (title, name, stat) in [
            ("Time to First Token", "TTFT", self.ttft),
            ("Time per Output Token (excl. 1st token)", "TPOT", self.tpot),
            ("Inter-token Latency", "ITL", self.itl),
        ] {
            rule(&mut s, title);
            line(
                &mut s,
                &format!("Mean {name} (ms):"),
                format!("{:.2}", stat.mean),
            );
            line(
                &mut s,
                &format!("Median {name} (ms):"),
                format!("{:.2}", stat.median),
            );
            line(
                &mut s,
                &format!("P99 {name} (ms):"),
                format!("{:.2}", stat.p99),
            );
        }
        s.push_str(&"=".repeat(50));
        s.push('\n');
        for e in &self.errors {
            s.push_str(&format!("error: {e}\n"));
        }
        s
    }

    /// The figures under vLLM's `--save-result` keys.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "errors": self.errors,
        });
        for (name, stat) in [("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl)] {
            v[format!("mean_{name}_ms")] = json!(stat.mean);
            v[format!("median_{name}_ms")] = json!(stat.median);
            v[format!("p99_{name}_ms")] = json!(stat.p99);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ttft_ms: u64, itl_ms: &[u64], tokens: usize) -> RequestOutcome {
        let itl: Vec<Duration> = itl_ms.iter().map(|&m| Duration::from_millis(m)).collect();
        RequestOutcome {
            success: true,
            prompt_len: 10,
            output_tokens: tokens,
            ttft: Duration::from_millis(ttft_ms),
            latency: Duration::from_millis(ttft_ms) + itl.iter().sum::<Duration>(),
            itl,
            ..Default::default()
        }
    }

    #[test]
    fn figures_follow_vllm_definitions() {
        let failed = RequestOutcome {
            error: "HTTP 400".into(),
            ..Default::default()
        };
        let outcomes = [outcome(10, &[2, 4], 3), outcome(30, &[6], 2), failed];
        let r = ServeReport::new(&outcomes, Duration::from_secs(2));
        assert_eq!((r.completed, r.failed), (2, 1));
        assert_eq!(r.total_input_tokens, 20);
        assert_eq!(r.total_output_tokens, 5);
        assert!((r.request_throughput - 1.0).abs() < 1e-9);
        assert!((r.output_throughput - 2.5).abs() < 1e-9);
        assert!((r.ttft.mean - 20.0).abs() < 1e-9);
        assert!((r.ttft.median - 20.0).abs() < 1e-9);
        // TPOT: (16 - 10) / 2 = 3 and (36 - 30) / 1 = 6.
        assert!((r.tpot.mean - 4.5).abs() < 1e-9);
        // ITL over every gap: 2, 4, 6.
        assert!((r.itl.mean - 4.0).abs() < 1e-9);
        assert!((r.itl.median - 4.0).abs() < 1e-9);
        assert_eq!(r.errors, vec!["HTTP 400".to_string()]);
        let text = r.render();
        assert!(
            text.contains("Successful requests:                    2"),
            "{text}"
        );
        assert!(
            text.contains("Mean TPOT (ms):                         4.50"),
            "{text}"
        );
        assert_eq!(r.to_json()["median_itl_ms"], 4.0);
    }
}
