//! Prometheus text exposition shared by the services, and every metric name the cluster
//! exports, in one place: the router's (`dspark_router_*`), the target workers'
//! (`dspark_target_*`), the draft workers' (`dspark_draft_*`) and the scheduler's
//! (`dspark_scheduler_*`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

pub mod names {
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
    pub const TTFT_SECONDS: &str = "dspark_router_time_to_first_token_seconds";
    pub const E2E_SECONDS: &str = "dspark_router_e2e_request_latency_seconds";
    pub const TPOT_SECONDS: &str = "dspark_router_time_per_output_token_seconds";

    pub const T_RUNNING: &str = "dspark_target_requests_running";
    pub const T_WAITING: &str = "dspark_target_requests_waiting";
    pub const T_FINISHED_TOTAL: &str = "dspark_target_requests_finished_total";
    pub const T_KV_BLOCKS: &str = "dspark_target_kv_cache_blocks";
    pub const T_KV_USED_BLOCKS: &str = "dspark_target_kv_cache_used_blocks";
    pub const T_KV_USAGE: &str = "dspark_target_kv_cache_usage_ratio";
    pub const T_PREFIX_QUERIED_TOTAL: &str = "dspark_target_prefix_cache_queried_tokens_total";
    pub const T_PREFIX_HIT_TOTAL: &str = "dspark_target_prefix_cache_hit_tokens_total";
    pub const T_PROMPT_TOKENS_TOTAL: &str = "dspark_target_prompt_tokens_total";
    pub const T_GENERATION_TOKENS_TOTAL: &str = "dspark_target_generation_tokens_total";
    pub const T_FORWARDS_TOTAL: &str = "dspark_target_request_forwards_total";
    pub const T_DRAFTED_TOTAL: &str = "dspark_target_spec_drafted_tokens_total";
    pub const T_ACCEPTED_TOTAL: &str = "dspark_target_spec_accepted_tokens_total";
    pub const T_DRAFTED_PER_POS_TOTAL: &str = "dspark_target_spec_drafted_tokens_per_pos_total";
    pub const T_ACCEPTED_PER_POS_TOTAL: &str = "dspark_target_spec_accepted_tokens_per_pos_total";
    pub const T_REACHED_PER_POS_TOTAL: &str = "dspark_target_spec_reached_tokens_per_pos_total";
    pub const T_DRAFT_CYCLES_TOTAL: &str = "dspark_target_draft_cycles_total";
    pub const T_STEPS_TOTAL: &str = "dspark_target_engine_steps_total";
    pub const T_STEP_SECONDS: &str = "dspark_target_engine_step_seconds";
    pub const T_BUDGET_STEPS_TOTAL: &str = "dspark_target_budget_steps_total";
    pub const T_DRAINING: &str = "dspark_target_draining";
    pub const T_TP_RANKS: &str = "dspark_target_tp_ranks";
    pub const T_TP_LINKS_UP: &str = "dspark_target_tp_links_up";
    pub const T_TP_CONNECTS_TOTAL: &str = "dspark_target_tp_connects_total";

    pub const D_REQUESTS: &str = "dspark_draft_requests_held";
    pub const D_STREAMS: &str = "dspark_draft_streams_open";
    pub const D_CALLS_TOTAL: &str = "dspark_draft_calls_total";
    pub const D_ROUNDS_TOTAL: &str = "dspark_draft_rounds_total";
    pub const D_ROUND_ERRORS_TOTAL: &str = "dspark_draft_round_errors_total";
    pub const D_ITEMS_TOTAL: &str = "dspark_draft_round_items_total";
    pub const D_TOKENS_TOTAL: &str = "dspark_draft_tokens_total";
    pub const D_CALL_SECONDS: &str = "dspark_draft_call_seconds";

    pub const S_WORKERS: &str = "dspark_scheduler_workers";
    pub const S_TARGET_CAPACITY: &str = "dspark_scheduler_target_capacity";
    pub const S_TARGET_LOAD: &str = "dspark_scheduler_target_load";
    pub const S_PLACEMENTS_TOTAL: &str = "dspark_scheduler_placements_total";
    pub const S_BUDGETS_TOTAL: &str = "dspark_scheduler_budgets_total";
}

/// Upper bounds of latency histograms' buckets, in seconds (requests).
pub const LATENCY_BUCKETS: [f64; 18] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
    1280.0, 2560.0,
];
/// Upper bounds of per-token histograms' buckets, in seconds.
pub const TOKEN_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
];
/// Upper bounds of engine-step and drafting-call histograms' buckets, in seconds: the per-token
/// resolution at the low end, then on to a minute, since a long prefill chunk or a
/// tensor-parallel step may run far past a second (the watchdog allows 600 s) and would
/// otherwise all land in +Inf.
pub const STEP_BUCKETS: [f64; 17] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// A Prometheus histogram with fixed buckets (lock-free).
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), then the +Inf bucket.
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Records one sample; NaN and negative ones are dropped.
    pub fn observe(&self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < secs);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((secs * 1e6).round() as u64, Ordering::Relaxed);
    }

    pub fn render(&self, s: &mut String, name: &str, help: &str) {
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

/// One unlabelled sample with its HELP and TYPE lines.
pub fn sample(s: &mut String, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
    let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
}

/// A family of samples that differ by one label (`name{label="k"} v`), in the given order.
pub fn labelled<K: std::fmt::Display, V: std::fmt::Display>(
    s: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    label: &str,
    rows: impl IntoIterator<Item = (K, V)>,
) {
    let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (k, v) in rows {
        let _ = writeln!(s, "{name}{{{label}=\"{k}\"}} {v}");
    }
}

/// Serves `GET /metrics` (what `render` returns) on `listener` until the process stops; the
/// workers' metrics port.
pub async fn serve(
    listener: tokio::net::TcpListener,
    render: std::sync::Arc<dyn Fn() -> String + Send + Sync>,
) {
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let render = std::sync::Arc::clone(&render);
                async move { render() }
            }),
        )
        .fallback(|| async {
            (
                axum::http::StatusCode::NOT_FOUND,
                "no such route: try /metrics\n",
            )
        });
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!("metrics server: {e}");
    }
}

/// The lines of an exposition that carry samples parse as `name{labels} number`; a check
/// for tests of every service's page.
pub fn well_formed(text: &str) -> Result<(), String> {
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (head, v) = l.rsplit_once(' ').ok_or_else(|| format!("no value: {l}"))?;
        v.parse::<f64>().map_err(|_| format!("not a number: {l}"))?;
        let name = head.split('{').next().unwrap_or("");
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
        {
            return Err(format!("bad metric name: {l}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_cumulative_buckets_sum_and_count() {
        let h = Histogram::new(&LATENCY_BUCKETS);
        for s in [0.004, 0.03, 0.03, 3.0, 500.0] {
            h.observe(s);
        }
        h.observe(f64::NAN);
        h.observe(-1.0);
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "A test.");
        let line = |k: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_else(|| panic!("{k} missing in\n{out}"))
        };
        let b = |le: &str| line(&format!("x_seconds_bucket{{le=\"{le}\"}} "));
        assert_eq!(b("0.01"), "1");
        assert_eq!(b("0.025"), "1");
        assert_eq!(b("0.05"), "3");
        assert_eq!(b("2.5"), "3");
        assert_eq!(b("5"), "4");
        assert_eq!(b("160"), "4");
        // A long answer on CPU (minutes) lands in a bucket of its own, not +Inf, so a p99
        // reads it rather than the last bound.
        assert_eq!(b("640"), "5");
        assert_eq!(b("+Inf"), "5");
        assert_eq!(line("x_seconds_count "), "5");
        let sum: f64 = line("x_seconds_sum ").parse().unwrap();
        assert!((sum - 503.064).abs() < 1e-6, "{sum}");
        assert!(out.contains("# TYPE x_seconds histogram"));
        well_formed(&out).unwrap();
    }

    #[test]
    fn step_buckets_keep_the_token_resolution_and_reach_a_minute() {
        assert_eq!(STEP_BUCKETS[..TOKEN_BUCKETS.len()], TOKEN_BUCKETS);
        assert!(STEP_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        // A 45 s prefill step is counted below +Inf.
        let h = Histogram::new(&STEP_BUCKETS);
        h.observe(45.0);
        let mut out = String::new();
        h.render(&mut out, "s_seconds", "A test.");
        assert!(out.contains("s_seconds_bucket{le=\"30\"} 0\n"), "{out}");
        assert!(out.contains("s_seconds_bucket{le=\"60\"} 1\n"), "{out}");
    }

    #[test]
    fn labelled_families_and_the_format_check() {
        let mut s = String::new();
        labelled(
            &mut s,
            "y_total",
            "counter",
            "Y.",
            "reason",
            [("stop", 2), ("length", 1)],
        );
        sample(&mut s, "z", "gauge", "Z.", 0.5);
        assert!(s.contains("y_total{reason=\"stop\"} 2\n"));
        assert!(s.contains("y_total{reason=\"length\"} 1\n"));
        assert!(s.contains("\nz 0.5\n"));
        well_formed(&s).unwrap();
        assert!(well_formed("a b c").is_err());
        assert!(well_formed("a-b 1").is_err());
        assert!(well_formed("a NaNx").is_err());
    }
}
