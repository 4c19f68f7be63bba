//! The draft worker's Prometheus page (`--metrics-listen`): how busy the drafting thread is,
//! which is what sizing the draft pool against the target pool needs (`dspark plan`).
//! Names: `dspark_scheduler::prom`.

use dspark_scheduler::prom::names::*;
use dspark_scheduler::prom::{Histogram, STEP_BUCKETS, sample};
use std::sync::atomic::{AtomicU64, Ordering};

pub struct DraftMetrics {
    /// Requests with drafting state here.
    pub requests: AtomicU64,
    /// Streams from target workers open now.
    pub streams: AtomicU64,
    /// Drafting calls (each drafts every round that was waiting, in one batch).
    pub calls: AtomicU64,
    pub rounds: AtomicU64,
    pub round_errors: AtomicU64,
    pub items: AtomicU64,
    pub tokens: AtomicU64,
    pub call_seconds: Histogram,
}

impl Default for DraftMetrics {
    fn default() -> Self {
        Self {
            requests: AtomicU64::new(0),
            streams: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            round_errors: AtomicU64::new(0),
            items: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            call_seconds: Histogram::new(&STEP_BUCKETS),
        }
    }
}

impl DraftMetrics {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut s = String::new();
        let rows: [(&str, &str, &str, u64); 7] = [
            (
                D_REQUESTS,
                "gauge",
                "Requests with drafting state here.",
                g(&self.requests),
            ),
            (
                D_STREAMS,
                "gauge",
                "Streams from target workers open now.",
                g(&self.streams),
            ),
            (
                D_CALLS_TOTAL,
                "counter",
                "Drafting calls (each drafts all rounds waiting, batched).",
                g(&self.calls),
            ),
            (
                D_ROUNDS_TOTAL,
                "counter",
                "Drafting rounds answered.",
                g(&self.rounds),
            ),
            (
                D_ROUND_ERRORS_TOTAL,
                "counter",
                "Rounds answered with an error (refused input, failed drafting).",
                g(&self.round_errors),
            ),
            (
                D_ITEMS_TOTAL,
                "counter",
                "Requests drafted for, over all rounds.",
                g(&self.items),
            ),
            (
                D_TOKENS_TOTAL,
                "counter",
                "Draft tokens sent back.",
                g(&self.tokens),
            ),
        ];
        for (name, kind, help, v) in rows {
            sample(&mut s, name, kind, help, v);
        }
        self.call_seconds.render(
            &mut s,
            D_CALL_SECONDS,
            "Wall time of one drafting call (syncs, drafting, replies).",
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_counts_and_is_well_formed() {
        let m = DraftMetrics::default();
        DraftMetrics::add(&m.rounds, 3);
        DraftMetrics::add(&m.tokens, 12);
        m.streams.store(2, Ordering::Relaxed);
        m.call_seconds.observe(0.004);
        let out = m.render();
        dspark_scheduler::prom::well_formed(&out).unwrap();
        for want in [
            format!("{D_ROUNDS_TOTAL} 3\n"),
            format!("{D_TOKENS_TOTAL} 12\n"),
            format!("{D_STREAMS} 2\n"),
            format!("{D_CALL_SECONDS}_count 1\n"),
        ] {
            assert!(out.contains(&want), "missing {want:?} in\n{out}");
        }
    }
}
