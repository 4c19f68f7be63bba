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

#[derive(Default)]
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
        s
    }
}
