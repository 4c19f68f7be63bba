//! Prometheus metrics of the router (names: `dspark_scheduler::prom::names`, every service's in one place).

pub use dspark_scheduler::prom::names::*;
use dspark_scheduler::prom::{Histogram, LATENCY_BUCKETS, TOKEN_BUCKETS};
use std::sync::atomic::{AtomicU64, Ordering};

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
                "Sequences being served (each prompt and choice of a request counts).",
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
            dspark_scheduler::prom::sample(&mut s, name, kind, help, v);
        }
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
    fn the_page_is_well_formed_and_counts_what_it_saw() {
        let m = Metrics::default();
        Metrics::add(&m.failovers, 2);
        m.ttft.observe(0.03);
        m.ttft.observe(3.0);
        let out = m.render();
        dspark_scheduler::prom::well_formed(&out).unwrap();
        assert!(out.contains(&format!("\n{FAILOVERS_TOTAL} 2\n")), "{out}");
        assert!(out.contains(&format!("{TTFT_SECONDS}_count 2\n")), "{out}");
        assert!(out.contains(&format!("{TPOT_SECONDS}_count 0\n")), "{out}");
        assert!(out.contains(&format!("# TYPE {E2E_SECONDS} histogram")));
    }
}
