//! Per-request and per-engine speculative metrics (seed §31): what the benchmark contract reports
//! — committed tokens per target call, per-position acceptance, the accepted-prefix histogram,
//! bonus rate, wasted verification, draft / verify / accept / rollback time, TTFT, TPOT, ITL.

use serde::Serialize;

/// Inter-token gaps an engine's totals keep (the most recent; between this and twice it).
pub const TOTALS_ITL_CAP: usize = 1 << 16;

#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestMetrics {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (not computed for this request).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Of totals: the requests merged in whose first token came (their prefill's); 0 on one
    /// request's own metrics (read as 1 when it has a token).
    pub first_tokens: usize,
    /// Target forwards this request took part in after its prefill (decode / verify cycles).
    pub target_calls: usize,
    /// Cycles that verified at least one drafted token.
    pub spec_calls: usize,
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    pub bonus_tokens: usize,
    /// Drafted tokens that were verified and rejected (or cut by a stop condition).
    pub wasted_tokens: usize,
    /// `proposed[k]`, `accepted[k]`: drafts at block position k (0-based) and how many survived.
    /// `proposed[k]` counts every block drafted past k, also those rejected before k.
    pub proposed_at: Vec<usize>,
    pub accepted_at: Vec<usize>,
    /// `reached[k]`: blocks drafted past k whose drafts before k were all accepted (the target
    /// judged position k itself).
    pub reached_at: Vec<usize>,
    /// `prefix_hist[a]`: verifications that accepted exactly `a` drafts.
    pub prefix_hist: Vec<usize>,
    pub draft_s: f64,
    pub verify_s: f64,
    pub accept_s: f64,
    pub rollback_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
    /// Gaps between successive streamed chunks (a cycle's committed tokens arrive together).
    pub itl_s: Vec<f64>,
    /// Engine totals: the gaps trimmed off `itl_s` (count, sum), so the mean stays exact.
    #[serde(skip)]
    pub itl_trimmed: (usize, f64),
    /// Per verified block with drafter confidences — calibration data.
    #[serde(skip)]
    pub conf_blocks: Vec<ConfBlock>,
}

/// A verified block's confidences, what they were computed from, and how many drafts survived.
#[derive(Clone, Debug, Default)]
pub struct ConfBlock {
    /// The confidences served (after the engine's online recalibration).
    pub conf: Vec<f32>,
    /// The proposer's own confidences, before it.
    pub base: Vec<f32>,
    /// Empty when the drafter did not report them.
    pub inputs: Vec<crate::proposer::ConfInputs>,
    /// Per position, the probability it had of being accepted if reached, 1 − TV(q, p)
    /// (sampled requests; empty for greedy ones, whose acceptance is not random).
    pub accept_prob: Vec<f32>,
    pub accepted: usize,
    /// The engine step that verified it (orders blocks of requests decoded together).
    pub step: usize,
}

impl RequestMetrics {
    pub fn record_block(&mut self, drafted: usize, accepted: usize, bonus: bool) {
        if self.proposed_at.len() < drafted {
            self.proposed_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        if self.reached_at.len() < drafted {
            self.reached_at.resize(drafted, 0);
        }
        for k in 0..drafted {
            self.proposed_at[k] += 1;
            if k <= accepted {
                self.reached_at[k] += 1;
            }
            if k < accepted {
                self.accepted_at[k] += 1;
            }
        }
        if drafted > 0 {
            if self.prefix_hist.len() <= drafted {
                self.prefix_hist.resize(drafted + 1, 0);
            }
            self.prefix_hist[accepted] += 1;
            self.spec_calls += 1;
        }
        self.drafted_tokens += drafted;
        self.accepted_tokens += accepted;
        self.wasted_tokens += drafted - accepted;
        self.bonus_tokens += bonus as usize;
    }

    /// Conditional acceptance at each block position: P(accept k | drafts before k accepted),
    /// over the blocks that reached k (0 where none did).
    pub fn accept_per_pos(&self) -> Vec<f64> {
        self.accepted_at
            .iter()
            .enumerate()
            .map(|(k, &a)| match self.reached_at.get(k) {
                Some(&r) if r > 0 => a as f64 / r as f64,
                _ => 0.0,
            })
            .collect()
    }

    /// Prefix survival at each block position: P(accepted > k | drafted > k), over every block
    /// drafted past k (0 where none was). The product of [`Self::accept_per_pos`] up to k
    /// where every block drafts as far.
    pub fn survival_per_pos(&self) -> Vec<f64> {
        self.proposed_at
            .iter()
            .zip(&self.accepted_at)
            .map(|(&p, &a)| if p == 0 { 0.0 } else { a as f64 / p as f64 })
            .collect()
    }

    /// First tokens (each request's, which its prefill produced): merged totals count them,
    /// one request has one when it has any token.
    fn firsts(&self) -> usize {
        if self.first_tokens > 0 {
            self.first_tokens
        } else {
            usize::from(self.completion_tokens > 0)
        }
    }

    /// Output tokens per target forward, after each request's first token (its prefill's):
    /// τ of one request or of merged totals alike.
    pub fn committed_per_call(&self) -> f64 {
        if self.target_calls == 0 {
            1.0
        } else {
            (self.completion_tokens.saturating_sub(self.firsts())) as f64 / self.target_calls as f64
        }
    }

    pub fn tpot_s(&self) -> f64 {
        if self.completion_tokens <= 1 {
            0.0
        } else {
            (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1) as f64
        }
    }

    /// Adds a finished request to an engine's running totals: every counter, but not its
    /// calibration blocks (they leave with the request's own metrics) and only the latest
    /// [`TOTALS_ITL_CAP`] inter-token gaps. A server runs for weeks: totals must not grow with
    /// the tokens it served.
    pub fn merge(&mut self, o: &RequestMetrics) {
        self.merge_counts(o);
        self.itl_s.extend_from_slice(&o.itl_s);
        if self.itl_s.len() > 2 * TOTALS_ITL_CAP {
            let cut = self.itl_s.len() - TOTALS_ITL_CAP;
            let gone: f64 = self.itl_s.drain(..cut).sum();
            self.itl_trimmed.0 += cut;
            self.itl_trimmed.1 += gone;
        }
    }

    /// [`Self::merge`] without the inter-token latencies (counts and sums only).
    pub(crate) fn merge_counts(&mut self, o: &RequestMetrics) {
        self.prompt_tokens += o.prompt_tokens;
        self.cached_tokens += o.cached_tokens;
        self.first_tokens = self.firsts() + o.firsts();
        self.completion_tokens += o.completion_tokens;
        self.target_calls += o.target_calls;
        self.spec_calls += o.spec_calls;
        self.drafted_tokens += o.drafted_tokens;
        self.accepted_tokens += o.accepted_tokens;
        self.bonus_tokens += o.bonus_tokens;
        self.wasted_tokens += o.wasted_tokens;
        for (dst, src) in [
            (&mut self.proposed_at, &o.proposed_at),
            (&mut self.accepted_at, &o.accepted_at),
            (&mut self.reached_at, &o.reached_at),
            (&mut self.prefix_hist, &o.prefix_hist),
        ] {
            if dst.len() < src.len() {
                dst.resize(src.len(), 0);
            }
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
        self.draft_s += o.draft_s;
        self.verify_s += o.verify_s;
        self.accept_s += o.accept_s;
        self.rollback_s += o.rollback_s;
        self.ttft_s += o.ttft_s;
        self.e2e_s += o.e2e_s;
    }

    /// A JSON summary (with derived rates) for CLIs and benchmarks.
    pub fn summary(&self) -> serde_json::Value {
        let itl_n = self.itl_s.len() + self.itl_trimmed.0;
        let itl_mean = if itl_n == 0 {
            0.0
        } else {
            (self.itl_s.iter().sum::<f64>() + self.itl_trimmed.1) / itl_n as f64
        };
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "target_calls": self.target_calls,
            "committed_per_call": self.committed_per_call(),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "bonus_rate": if self.spec_calls == 0 { 0.0 } else { self.bonus_tokens as f64 / self.spec_calls as f64 },
            "wasted_tokens": self.wasted_tokens,
            "accept_per_pos": self.accept_per_pos(),
            "survival_per_pos": self.survival_per_pos(),
            "accepted_prefix_hist": self.prefix_hist,
            "draft_s": self.draft_s, "verify_s": self.verify_s, "accept_s": self.accept_s, "rollback_s": self.rollback_s,
            "ttft_s": self.ttft_s, "tpot_s": self.tpot_s(), "itl_mean_s": itl_mean, "e2e_s": self.e2e_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn block_records_add_up() {
        let mut m = RequestMetrics::default();
        m.record_block(4, 2, false);
        m.record_block(4, 4, true);
        m.record_block(0, 0, true);
        assert_eq!(m.proposed_at, vec![2, 2, 2, 2]);
        assert_eq!(m.accepted_at, vec![2, 2, 1, 1]);
        // The first block's target judged positions 0..=2 (it rejected 2); position 3 it never
        // reached.
        assert_eq!(m.reached_at, vec![2, 2, 2, 1]);
        assert_eq!(m.prefix_hist, vec![0, 0, 1, 0, 1]);
        assert_eq!(m.wasted_tokens, 2);
        // Conditional: position 3 was accepted every time it was reached.
        assert_eq!(m.accept_per_pos(), vec![1.0, 1.0, 0.5, 1.0]);
        assert_eq!(m.survival_per_pos(), vec![1.0, 1.0, 0.5, 0.5]);
        let s = m.summary();
        assert_eq!(s["accept_per_pos"][3].as_f64(), Some(1.0));
        assert_eq!(s["survival_per_pos"][3].as_f64(), Some(0.5));
    }

    #[test]
    fn conditional_acceptance_counts_only_blocks_that_reached_the_position() {
        // Three blocks of 3: rejected at 0, rejected at 1, all accepted.
        let mut m = RequestMetrics::default();
        m.record_block(3, 0, false);
        m.record_block(3, 1, false);
        m.record_block(3, 3, true);
        assert_eq!(m.reached_at, vec![3, 2, 1]);
        assert_eq!(m.accept_per_pos(), vec![2.0 / 3.0, 0.5, 1.0]);
        assert_eq!(m.survival_per_pos(), vec![2.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]);
        // Survival is the running product of conditional acceptance when all draft as far.
        let prod: Vec<f64> = m
            .accept_per_pos()
            .iter()
            .scan(1.0, |p, &a| {
                *p *= a;
                Some(*p)
            })
            .collect();
        for (p, s) in prod.iter().zip(m.survival_per_pos()) {
            assert!((p - s).abs() < 1e-12, "{prod:?}");
        }
        // Merged totals keep the counts, and a position nobody reached reads 0.
        let mut tot = RequestMetrics::default();
        tot.merge(&m);
        tot.merge(&m);
        assert_eq!(tot.reached_at, vec![6, 4, 2]);
        assert_eq!(tot.accept_per_pos(), m.accept_per_pos());
        let mut never = RequestMetrics::default();
        never.record_block(2, 0, false);
        assert_eq!(never.accept_per_pos(), vec![0.0, 0.0]);
    }

    #[test]
    fn tokens_per_call_leave_out_every_request_s_first_token() {
        // Plain decoding: 64 tokens, the first from the prefill, 63 from 63 calls.
        let one = RequestMetrics {
            completion_tokens: 64,
            target_calls: 63,
            ..Default::default()
        };
        assert_eq!(one.committed_per_call(), 1.0);
        let mut tot = RequestMetrics::default();
        for _ in 0..10 {
            tot.merge(&one);
        }
        assert_eq!(tot.first_tokens, 10);
        assert_eq!(tot.committed_per_call(), 1.0);
        // Totals of totals, and a request with no token (prompt log-probabilities only).
        let mut all = RequestMetrics::default();
        all.merge(&tot);
        all.merge(&tot);
        all.merge(&RequestMetrics::default());
        assert_eq!(all.first_tokens, 20);
        assert_eq!(all.committed_per_call(), 1.0);
    }

    #[test]
    fn totals_keep_every_count_and_stay_bounded() {
        let mut one = RequestMetrics::default();
        one.completion_tokens = 1000;
        one.record_block(3, 1, false);
        one.itl_s = vec![0.01; 1000];
        one.conf_blocks = vec![ConfBlock::default(); 10];
        let mut tot = RequestMetrics::default();
        for _ in 0..500 {
            tot.merge(&one);
        }
        assert_eq!(tot.completion_tokens, 500_000);
        assert_eq!(tot.proposed_at, vec![500; 3]);
        assert_eq!(tot.accepted_at, vec![500, 0, 0]);
        assert_eq!(tot.reached_at, vec![500, 500, 0]);
        assert!(tot.conf_blocks.is_empty());
        assert!(
            (TOTALS_ITL_CAP..=2 * TOTALS_ITL_CAP).contains(&tot.itl_s.len()),
            "{}",
            tot.itl_s.len()
        );
        // The mean still covers every gap.
        assert_eq!(tot.itl_s.len() + tot.itl_trimmed.0, 500_000);
        let mean = tot.summary()["itl_mean_s"].as_f64().unwrap_or(0.0);
        assert!((mean - 0.01).abs() < 1e-9, "{mean}");
    }
}
