//! The target worker's Prometheus page (`--metrics-listen`): what vLLM's and SGLang's engines
//! export, for one engine of the pool. The engine thread publishes a snapshot after every step
//! (a lock and a few copies); a scrape renders the last one. Names: `dspark_scheduler::prom`.

use dspark_scheduler::prom::names::*;
use dspark_scheduler::prom::{Histogram, STEP_BUCKETS, labelled, sample};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Engine state as of its last step.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks: usize,
    pub kv_free_blocks: usize,
    pub prefix_queried: u64,
    pub prefix_hit: u64,
    /// Of every request, running ones' work so far included ([`specdec::Engine::live_totals`]).
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    pub forwards: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub drafted_at: Vec<usize>,
    pub accepted_at: Vec<usize>,
    pub reached_at: Vec<usize>,
    pub steps: usize,
}

impl Snapshot {
    pub fn of(e: &specdec::Engine) -> Self {
        // Running requests' work counts as it is done (a five-minute answer is not one spike
        // at its end).
        let t = e.live_totals();
        let (prefix_queried, prefix_hit) = e.prefix_cache_stats();
        Self {
            running: e.num_running(),
            waiting: e.num_waiting(),
            kv_blocks: e.kv_total_blocks(),
            kv_free_blocks: e.kv_free_blocks(),
            prefix_queried,
            prefix_hit,
            prompt_tokens: t.prompt_tokens,
            generation_tokens: t.completion_tokens,
            forwards: t.target_calls,
            drafted: t.drafted_tokens,
            accepted: t.accepted_tokens,
            drafted_at: t.proposed_at.clone(),
            accepted_at: t.accepted_at.clone(),
            reached_at: t.reached_at.clone(),
            steps: e.steps,
        }
    }
}

pub struct WorkerMetrics {
    pub snap: Mutex<Snapshot>,
    pub step_seconds: Histogram,
    /// Requests ended, by finish reason (`cancelled` for callers that went away).
    pub finished: Mutex<BTreeMap<&'static str, u64>>,
    pub remote_cycles: AtomicU64,
    pub fallback_cycles: AtomicU64,
    pub draining: Arc<AtomicBool>,
    /// Steps whose verification budget came from the central scheduler / was computed locally
    /// (scheduler policy only).
    pub budget: Option<(Arc<AtomicU64>, Arc<AtomicU64>)>,
    /// Tensor parallelism: the degree and rank 0's link state.
    pub tp: Option<(usize, Arc<dspark_runtime::tp::LinkState>)>,
}

impl WorkerMetrics {
    pub fn new(
        draining: Arc<AtomicBool>,
        budget: Option<(Arc<AtomicU64>, Arc<AtomicU64>)>,
    ) -> Self {
        Self {
            snap: Mutex::new(Snapshot::default()),
            step_seconds: Histogram::new(&STEP_BUCKETS),
            finished: Mutex::new(BTreeMap::new()),
            remote_cycles: AtomicU64::new(0),
            fallback_cycles: AtomicU64::new(0),
            draining,
            budget,
            tp: None,
        }
    }

    pub fn publish(&self, s: Snapshot) {
        if let Ok(mut g) = self.snap.lock() {
            *g = s;
        }
    }

    pub fn finished(&self, reason: &'static str) {
        if let Ok(mut f) = self.finished.lock() {
            *f.entry(reason).or_insert(0) += 1;
        }
    }

    pub fn render(&self) -> String {
        let snap = self.snap.lock().map(|g| g.clone()).unwrap_or_default();
        let mut s = String::new();
        let out = &mut s;
        if let Some((degree, links)) = &self.tp {
            sample(
                out,
                T_TP_RANKS,
                "gauge",
                "Tensor-parallel ranks of this worker (itself included).",
                *degree,
            );
            sample(
                out,
                T_TP_LINKS_UP,
                "gauge",
                "1 while every other rank is linked; 0 while one is down (forwards fail).",
                links.up() as u8,
            );
            sample(
                out,
                T_TP_CONNECTS_TOTAL,
                "counter",
                "Connections of the rank group, the first included (more: ranks came back).",
                links.connects(),
            );
        }
        sample(
            out,
            T_RUNNING,
            "gauge",
            "Requests in the running batch.",
            snap.running,
        );
        sample(
            out,
            T_WAITING,
            "gauge",
            "Requests queued for admission.",
            snap.waiting,
        );
        let used = snap.kv_blocks.saturating_sub(snap.kv_free_blocks);
        sample(
            out,
            T_KV_BLOCKS,
            "gauge",
            "Blocks of the paged KV cache.",
            snap.kv_blocks,
        );
        sample(
            out,
            T_KV_USED_BLOCKS,
            "gauge",
            "KV blocks held by requests (cached blocks nobody holds count as free).",
            used,
        );
        sample(
            out,
            T_KV_USAGE,
            "gauge",
            "Share of the KV cache held by requests.",
            used as f64 / snap.kv_blocks.max(1) as f64,
        );
        sample(
            out,
            T_PREFIX_QUERIED_TOTAL,
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            snap.prefix_queried,
        );
        sample(
            out,
            T_PREFIX_HIT_TOTAL,
            "counter",
            "Prompt tokens found in the prefix cache (not computed again).",
            snap.prefix_hit,
        );
        let rows: [(&str, &str, usize); 5] = [
            (
                T_PROMPT_TOKENS_TOTAL,
                "Prompt tokens of admitted requests.",
                snap.prompt_tokens,
            ),
            (
                T_GENERATION_TOKENS_TOTAL,
                "Tokens generated, counted as they are committed.",
                snap.generation_tokens,
            ),
            (
                T_FORWARDS_TOTAL,
                "Target forwards (decode or verify) requests took part in, summed.",
                snap.forwards,
            ),
            (T_DRAFTED_TOTAL, "Draft tokens verified.", snap.drafted),
            (T_ACCEPTED_TOTAL, "Draft tokens accepted.", snap.accepted),
        ];
        for (name, help, v) in rows {
            sample(out, name, "counter", help, v);
        }
        labelled(
            out,
            T_DRAFTED_PER_POS_TOTAL,
            "counter",
            "Draft tokens drafted at each block position (0 = first), rejected before it or not.",
            "position",
            snap.drafted_at.iter().enumerate(),
        );
        labelled(
            out,
            T_ACCEPTED_PER_POS_TOTAL,
            "counter",
            "Draft tokens accepted at each block position (0 = first).",
            "position",
            snap.accepted_at.iter().enumerate(),
        );
        labelled(
            out,
            T_REACHED_PER_POS_TOTAL,
            "counter",
            "Draft tokens the target judged at each block position (every draft before accepted): \
             accepted over reached is the conditional acceptance there.",
            "position",
            snap.reached_at.iter().enumerate(),
        );
        labelled(
            out,
            T_DRAFT_CYCLES_TOTAL,
            "counter",
            "Drafting cycles of ended requests (finished, cancelled or failed), by where the draft came from.",
            "source",
            [
                ("remote", self.remote_cycles.load(Ordering::Relaxed)),
                ("fallback", self.fallback_cycles.load(Ordering::Relaxed)),
            ],
        );
        let finished = self.finished.lock().map(|f| f.clone()).unwrap_or_default();
        labelled(
            out,
            T_FINISHED_TOTAL,
            "counter",
            "Requests ended, by finish reason.",
            "reason",
            finished,
        );
        sample(out, T_STEPS_TOTAL, "counter", "Engine steps.", snap.steps);
        self.step_seconds.render(
            out,
            T_STEP_SECONDS,
            "Wall time of one engine step (draft, verify, accept).",
        );
        if let Some((c, l)) = &self.budget {
            labelled(
                out,
                T_BUDGET_STEPS_TOTAL,
                "counter",
                "Steps whose verification budget came from the central scheduler or was computed locally.",
                "source",
                [
                    ("central", c.load(Ordering::Relaxed)),
                    ("local", l.load(Ordering::Relaxed)),
                ],
            );
        }
        sample(
            out,
            T_DRAINING,
            "gauge",
            "1 while the worker drains before stopping.",
            u8::from(self.draining.load(Ordering::Relaxed)),
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_reports_the_snapshot_and_is_well_formed() {
        let m = WorkerMetrics::new(Arc::new(AtomicBool::new(true)), None);
        m.publish(Snapshot {
            running: 3,
            waiting: 1,
            kv_blocks: 100,
            kv_free_blocks: 75,
            drafted_at: vec![10, 6],
            accepted_at: vec![7, 2],
            reached_at: vec![10, 5],
            ..Default::default()
        });
        m.finished("stop");
        m.finished("stop");
        m.finished("length");
        m.step_seconds.observe(0.012);
        let out = m.render();
        dspark_scheduler::prom::well_formed(&out).unwrap();
        for want in [
            format!("{T_RUNNING} 3\n"),
            format!("{T_WAITING} 1\n"),
            format!("{T_KV_USED_BLOCKS} 25\n"),
            format!("{T_KV_USAGE} 0.25\n"),
            format!("{T_ACCEPTED_PER_POS_TOTAL}{{position=\"1\"}} 2\n"),
            format!("{T_REACHED_PER_POS_TOTAL}{{position=\"1\"}} 5\n"),
            format!("{T_FINISHED_TOTAL}{{reason=\"stop\"}} 2\n"),
            format!("{T_FINISHED_TOTAL}{{reason=\"length\"}} 1\n"),
            format!("{T_STEP_SECONDS}_count 1\n"),
            format!("{T_DRAINING} 1\n"),
        ] {
            assert!(out.contains(&want), "missing {want:?} in\n{out}");
        }
        assert!(
            !out.contains(T_BUDGET_STEPS_TOTAL),
            "no budget counters without the policy"
        );
    }
}
