//! Prometheus metrics of the router: every name in one place.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

pub const REQUESTS_TOTAL: &str = "dspark_router_requests_total";
pub const REQUEST_ERRORS_TOTAL: &str = "dspark_router_request_errors_total";
pub const REJECTED_TOTAL: &str = "dspark_router_rejected_total";
pub const INFLIGHT: &str = "dspark_router_inflight_requests";
pub const PROMPT_TOKENS_TOTAL: &str = "dspark_router_prompt_tokens_total";
pub const CACHED_PROMPT_TOKENS_TOTAL: &str = "dspark_router_cached_prompt_tokens_total";
pub const COMPLETION_TOKENS_TOTAL: &str = "dspark_router_completion_tokens_total";
pub const DRAFTED_TOKENS_TOTAL: &str = "dspark_router_drafted_tokens_total";
pub const ACCEPTED_TOKENS_TOTAL: &str = "dspark_router_accepted_tokens_total";
pub const VERIFY_FORWARDS_TOTAL: &str = "dspark_router_verify_forwards_total";
pub const FAILOVERS_TOTAL: &str = "dspark_router_failovers_total";
pub const TTFT_SECONDS_SUM: &str = "dspark_router_ttft_seconds_sum";
pub const TTFT_SECONDS: &str = "dspark_router_time_to_first_token_seconds";
pub const E2E_SECONDS: &str = "dspark_router_e2e_request_latency_seconds";
pub const TPOT_SECONDS: &str = "dspark_router_time_per_output_token_seconds";

/// Upper bounds of the latency histograms' buckets, in seconds.
const LATENCY_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];
/// Upper bounds of the per-token histogram's buckets, in seconds.
const TOKEN_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
];

/// A Prometheus histogram with fixed buckets (lock-free).
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), then the +Inf bucket.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < secs);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((secs * 1e6).round() as u64, Ordering::Relaxed);
    }

    fn render(&self, s: &mut String, name: &str, help: &str) {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cum += c.load(Ordering::Relaxed);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = writeln!(s, "{name}_bucket{{le=\"{b}\"}} {cum}");
                }
                None => {
                    let _ = writeln!(s, "{name}_bucket{{le=\"+Inf\"}} {cum}");
                }
            }
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(s, "{name}_sum {sum}\n{name}_count {cum}");
    }
}

pub struct Metrics {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub rejected: AtomicU64,
    pub inflight: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
    pub forwards: AtomicU64,
    pub failovers: AtomicU64,
    pub ttft_us: AtomicU64,
    /// Per request (each choice): arrival to first token, arrival to last, and the time per
    /// output token after the first.
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub tpot: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            inflight: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            drafted: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            forwards: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            ttft_us: AtomicU64::new(0),
            ttft: Histogram::new(&LATENCY_BUCKETS),
            e2e: Histogram::new(&LATENCY_BUCKETS),
            tpot: Histogram::new(&TOKEN_BUCKETS),
        }
    }
}

impl Metrics {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let rows: [(&str, &str, &str, u64); 11] = [
            (
                REQUESTS_TOTAL,
                "counter",
                "Completion requests received.",
                g(&self.requests),
            ),
            (
                REQUEST_ERRORS_TOTAL,
                "counter",
                "Requests that ended in an error.",
                g(&self.errors),
            ),
            (
                REJECTED_TOTAL,
                "counter",
                "Requests refused with 429 (cluster full).",
                g(&self.rejected),
            ),
            (
                INFLIGHT,
                "gauge",
                "Requests being served.",
                g(&self.inflight),
            ),
            (
                PROMPT_TOKENS_TOTAL,
                "counter",
                "Prompt tokens served.",
                g(&self.prompt_tokens),
            ),
            (
                CACHED_PROMPT_TOKENS_TOTAL,
                "counter",
                "Prompt tokens whose KV a target worker found in its prefix cache.",
                g(&self.cached_prompt_tokens),
            ),
            (
                COMPLETION_TOKENS_TOTAL,
                "counter",
                "Completion tokens generated.",
                g(&self.completion_tokens),
            ),
            (
                DRAFTED_TOKENS_TOTAL,
                "counter",
                "Draft tokens verified.",
                g(&self.drafted),
            ),
            (
                ACCEPTED_TOKENS_TOTAL,
                "counter",
                "Draft tokens accepted.",
                g(&self.accepted),
            ),
            (
                VERIFY_FORWARDS_TOTAL,
                "counter",
                "Target forwards (decode or verify) per request, summed.",
                g(&self.forwards),
            ),
            (
                FAILOVERS_TOTAL,
                "counter",
                "Requests continued on another target worker after one failed.",
                g(&self.failovers),
            ),
        ];
        for (name, kind, help, v) in rows {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        let _ = writeln!(
            s,
            "# HELP {TTFT_SECONDS_SUM} Time to first token, summed over requests.\n# TYPE {TTFT_SECONDS_SUM} counter\n{TTFT_SECONDS_SUM} {}",
            g(&self.ttft_us) as f64 / 1e6
        );
        self.ttft.render(
            &mut s,
            TTFT_SECONDS,
            "Arrival to first token, per request (each choice).",
        );
        self.e2e.render(
            &mut s,
            E2E_SECONDS,
            "Arrival to last token, per request (each choice).",
        );
        self.tpot.render(
            &mut s,
            TPOT_SECONDS,
            "Time per output token after the first, per request (each choice).",
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_cumulative_buckets_sum_and_count() {
        let m = Metrics::default();
        for s in [0.004, 0.03, 0.03, 3.0, 500.0] {
            m.ttft.observe(s);
        }
        m.ttft.observe(f64::NAN);
        m.ttft.observe(-1.0);
        let out = m.render();
        let line = |k: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|| panic!("{k} missing in\n{out}"))
        };
        let b = |le: &str| line(&format!("{TTFT_SECONDS}_bucket{{le=\"{le}\"}} "));
        assert_eq!(b("0.01"), "1");
        assert_eq!(b("0.025"), "1");
        assert_eq!(b("0.05"), "3");
        assert_eq!(b("2.5"), "3");
        assert_eq!(b("5"), "4");
        assert_eq!(b("160"), "4");
        assert_eq!(b("+Inf"), "5");
        assert_eq!(line(&format!("{TTFT_SECONDS}_count ")), "5");
        let sum: f64 = line(&format!("{TTFT_SECONDS}_sum ")).parse().unwrap();
        assert!((sum - 503.064).abs() < 1e-6, "{sum}");
        assert!(out.contains(&format!("# TYPE {E2E_SECONDS} histogram")));
        assert_eq!(line(&format!("{TPOT_SECONDS}_count ")), "0");
        // Every sample line is `name{labels} value` with a number.
        for l in out.lines().filter(|l| !l.starts_with('#')) {
            let v = l.rsplit(' ').next().unwrap_or("");
            assert!(v.parse::<f64>().is_ok(), "{l}");
        }
    }
}
