//! Request metrics in the Prometheus text format, with vLLM's names under the `vllm:`
//! prefix. The output processor records each request's latencies and token counts here;
//! the engine's own counters (preemptions, prefix-cache queries and hits) and gauges come
//! from its `SchedulerStats` when `/metrics` is rendered.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use vllm_protocol::SchedulerStats;

/// Bucket bounds in seconds, as vLLM uses for these histograms.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

struct Histogram {
    bounds: &'static [f64],
    /// Cumulative-free counts per bucket, plus one for +Inf.
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    fn observe(&self, seconds: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((seconds * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = self
                .bounds
                .get(i)
                .map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {sum}\n{name}_count{{{labels}}} {cumulative}"
        );
    }
}

pub struct Metrics {
    model_name: String,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    finished: Mutex<BTreeMap<&'static str, u64>>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

impl Metrics {
    pub fn new(model_name: String) -> Self {
        Self {
            model_name,
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Mutex::new(BTreeMap::new()),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }

    /// The whole exposition, with the engine's current statistics.
    pub fn render(&self, stats: &SchedulerStats) -> String {
        let labels = format!("model_name=\"{}\"", self.model_name.replace('"', "\\\""));
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}"
            );
        };
        gauge(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            stats.num_running_reqs as f64,
        );
        gauge(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            stats.num_waiting_reqs as f64,
        );
        gauge(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            stats.kv_cache_usage as f64,
        );
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {v}"
            );
        };
        counter(
            &mut out,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            self.generation_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            stats.num_preemptions,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        );
        counter(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.prefix_cache_hits,
        );
        let name = "vllm:request_success_total";
        let _ = writeln!(
            out,
            "# HELP {name} Count of successfully processed requests.\n# TYPE {name} counter"
        );
        let finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        for reason in ["stop", "length", "abort"] {
            let v = finished.get(reason).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}{{{labels},finished_reason=\"{reason}\"}} {v}");
        }
        self.ttft.render(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &labels,
        );
        self.itl.render(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &labels,
        );
        self.e2e.render(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &labels,
        );
        out
    }
}

/// One request's timings, recorded into [`Metrics`] as its outputs arrive.
pub struct RequestTracker {
    arrival: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    finished: bool,
}

impl RequestTracker {
    pub fn new(prompt_tokens: usize) -> Self {
        Self {
            arrival: Instant::now(),
            last_token: None,
            prompt_tokens,
            finished: false,
        }
    }

    /// Records an output carrying `new_tokens` tokens.
    pub fn on_tokens(&mut self, metrics: &Metrics, new_tokens: usize) {
        if new_tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => {
                metrics.ttft.observe((now - self.arrival).as_secs_f64());
                metrics
                    .prompt_tokens
                    .fetch_add(self.prompt_tokens as u64, Ordering::Relaxed);
            }
            Some(last) => metrics.itl.observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        metrics
            .generation_tokens
            .fetch_add(new_tokens as u64, Ordering::Relaxed);
    }

    /// Records the end of the request ("stop", "length" or "abort"; errors are not successes).
    pub fn on_finish(&mut self, metrics: &Metrics, reason: &'static str) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        metrics.e2e.observe(self.arrival.elapsed().as_secs_f64());
        if reason != "error" {
            *metrics
                .finished
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(reason)
                .or_insert(0) += 1;
        }
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }
}
