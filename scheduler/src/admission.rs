//! Confidence-scheduled verification: which drafted tokens to verify this step.
//!
//! Pure functions, no I/O. For request r with calibrated per-position confidences c_{r,1..γ},
//! the survival of position j is a_{r,j} = Π_{i≤j} c_{r,i} (the probability that the first j
//! drafts are all accepted). Verifying K_r tokens of every request makes a batch of
//! B = Σ_r (1 + K_r) tokens and commits τ = Σ_r (1 + Σ_{j≤K_r} a_{r,j}) tokens in expectation;
//! the hardware turns B into SPS(B) steps per second, so the rate is Θ = τ · SPS(B).
//!
//! Because a_{r,j} never grows with j, the best set of a given size is the top entries by
//! survival, and it is prefix-closed (ties go to the earlier position). The choice is therefore
//! one sort and a scan over sizes: the global argmax of Θ over the sorted prefix, or the paper's
//! greedy that stops at the first entry that lowers Θ (on a staircase SPS these differ exactly
//! when Θ dips at a stair and recovers further on).

use std::fmt;

/// Steps per second at a total batch of B tokens: a staircase from profiling.
#[derive(Clone, Debug, PartialEq)]
pub struct SpsTable {
    /// (B, steps/s), B strictly increasing, steps/s non-increasing; SPS(B) for B between two
    /// points is the value of the next point up (the stair B falls on).
    pub points: Vec<(u32, f64)>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AdmissionError {
    EmptyTable,
    NotMonotone(String),
}

impl fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EmptyTable => write!(f, "the SPS table is empty"),
            Self::NotMonotone(m) => write!(f, "the SPS table is not a staircase: {m}"),
        }
    }
}

impl std::error::Error for AdmissionError {}

impl SpsTable {
    /// Validates: non-empty, B strictly increasing from ≥ 1, steps/s finite, positive and
    /// non-increasing.
    pub fn new(points: Vec<(u32, f64)>) -> Result<Self, AdmissionError> {
        if points.is_empty() {
            return Err(AdmissionError::EmptyTable);
        }
        for (i, &(b, s)) in points.iter().enumerate() {
            if b == 0 || !s.is_finite() || s <= 0.0 {
                return Err(AdmissionError::NotMonotone(format!(
                    "point {i}: B = {b}, steps/s = {s}"
                )));
            }
            if i > 0 {
                let (pb, ps) = points[i - 1];
                if b <= pb || s > ps {
                    return Err(AdmissionError::NotMonotone(format!(
                        "point {i} (B = {b}, {s:.3}/s) after (B = {pb}, {ps:.3}/s)"
                    )));
                }
            }
        }
        Ok(Self { points })
    }

    /// Largest batch the table covers.
    pub fn max_batch(&self) -> u32 {
        self.points.last().map(|p| p.0).unwrap_or(0)
    }

    /// SPS(B); 0 beyond the table (such batches are never chosen).
    pub fn sps(&self, b: u32) -> f64 {
        match self.points.binary_search_by(|p| p.0.cmp(&b)) {
            Ok(i) => self.points[i].1,
            Err(i) if i < self.points.len() => self.points[i].1,
            Err(_) => 0.0,
        }
    }
}

/// Per-request limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReqLimits {
    /// Verify at least this many (SLO tier), if drafted.
    pub min_k: u8,
    /// Verify at most this many.
    pub max_k: u8,
}

impl Default for ReqLimits {
    fn default() -> Self {
        Self {
            min_k: 0,
            max_k: u8::MAX,
        }
    }
}

/// Global limits of one step.
#[derive(Clone, Copy, Debug)]
pub struct StepLimits {
    /// Largest batch in tokens (B), including each request's pending token.
    pub max_batch_tokens: u32,
    /// KV slots free for drafted tokens this step.
    pub kv_headroom: u32,
    /// Tokens in the batch besides pending tokens and drafts (prefill chunks).
    pub other_tokens: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Global argmax of Θ over the sorted prefix.
    Argmax,
    /// The paper's greedy: stop at the first entry that lowers Θ.
    GreedyEarlyStop,
}

/// The decision: verification length per request, and its predicted value.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub k: Vec<u32>,
    pub batch_tokens: u32,
    pub expected_tokens: f64,
    pub theta: f64,
}

/// Confidence clamp: calibrated confidences live in (0, 1); NaN counts as "no confidence".
pub const CONF_EPS: f32 = 1e-6;

/// Clamps a confidence into (0, 1); returns whether it had to.
pub fn clamp_conf(c: f32) -> (f32, bool) {
    if c.is_nan() {
        (CONF_EPS, true)
    } else if c < CONF_EPS {
        (CONF_EPS, true)
    } else if c > 1.0 - CONF_EPS {
        (1.0 - CONF_EPS, c > 1.0)
    } else {
        (c, false)
    }
}

/// Reusable scratch so a decision allocates nothing in steady state.
#[derive(Default)]
pub struct Admission {
    keys: Vec<u64>,
    tmp: Vec<u64>,
    count: Vec<u32>,
    /// Entries that had to be clamped in the last call (NaN or out of (0, 1)).
    pub clamped: usize,
}

const POS_BITS: u32 = 5;
const REQ_BITS: u32 = 11;
/// Largest request count and γ one decision takes.
pub const MAX_REQUESTS: usize = 1 << REQ_BITS;
pub const MAX_GAMMA: usize = 1 << POS_BITS;

/// An entry: high 32 bits = !bits(a) (positive floats order like their bits, so ascending keys
/// are descending survivals), low bits = request and position.
fn pack(a: f32, r: usize, j: usize) -> u64 {
    ((!a.to_bits()) as u64) << 32 | (r as u64) << POS_BITS | j as u64
}

fn unpack(key: u64) -> (f32, usize) {
    let a = f32::from_bits(!((key >> 32) as u32));
    let r = ((key >> POS_BITS) & ((1 << REQ_BITS) - 1)) as usize;
    (a, r)
}

impl Admission {
    /// Chooses K_r for every request. `conf[r]` are request r's drafted positions' confidences
    /// (cumulative survival is computed here). Requests beyond [`MAX_REQUESTS`] or positions
    /// beyond [`MAX_GAMMA`] are not drafted (they still decode).
    pub fn decide(
        &mut self,
        conf: &[&[f32]],
        limits: &[ReqLimits],
        step: StepLimits,
        sps: &SpsTable,
        rule: Rule,
    ) -> Decision {
        let n = conf.len();
        let mut k = vec![0u32; n];
        self.keys.clear();
        self.clamped = 0;
        let base_b = n as u32 + step.other_tokens;
        let mut forced = 0u32;
        let mut tau = n as f64;
        for (r, c) in conf.iter().enumerate().take(MAX_REQUESTS) {
            let lim = limits.get(r).copied().unwrap_or_default();
            let cap = c.len().min(MAX_GAMMA).min(lim.max_k as usize);
            let mut a = 1f32;
            for (j, &cj) in c.iter().take(cap).enumerate() {
                let (cj, cl) = clamp_conf(cj);
                self.clamped += cl as usize;
                a *= cj;
                if j < lim.min_k as usize {
                    // Forced by the request's tier: always verified, outside the ranking.
                    k[r] += 1;
                    forced += 1;
                    tau += a as f64;
                } else {
                    self.keys.push(pack(a, r, j));
                }
            }
        }
        let room = step
            .max_batch_tokens
            .min(sps.max_batch())
            .saturating_sub(base_b + forced)
            .min(step.kv_headroom.saturating_sub(forced));
        // Stable sort on the survival half only: ties keep (request, position) order, so
        // earlier positions come first and every prefix of the order is prefix-closed.
        radix_sort_high32(&mut self.keys, &mut self.tmp, &mut self.count);
        let b0 = base_b + forced;
        let mut best = (tau * sps.sps(b0), 0usize);
        let mut t = tau;
        let upto = (room as usize).min(self.keys.len());
        for (i, &key) in self.keys[..upto].iter().enumerate() {
            t += unpack(key).0 as f64;
            let th = t * sps.sps(b0 + i as u32 + 1);
            if th > best.0 {
                best = (th, i + 1);
            } else if rule == Rule::GreedyEarlyStop && th < best.0 {
                break;
            }
        }
        let mut expected = tau;
        for &key in &self.keys[..best.1] {
            let (a, r) = unpack(key);
            k[r] += 1;
            expected += a as f64;
        }
        let batch_tokens = b0 + best.1 as u32;
        Decision {
            theta: expected * sps.sps(batch_tokens),
            k,
            batch_tokens,
            expected_tokens: expected,
        }
    }
}

impl Admission {
    /// The top `k_total` entries by cumulative survival (prefix-closed), within per-request
    /// limits (forced minimums first): the selection half of the two-step lag.
    pub fn select_top(&mut self, conf: &[&[f32]], limits: &[ReqLimits], k_total: u32) -> Vec<u32> {
        let mut k = vec![0u32; conf.len()];
        self.keys.clear();
        self.clamped = 0;
        let mut left = k_total;
        for (r, c) in conf.iter().enumerate().take(MAX_REQUESTS) {
            let lim = limits.get(r).copied().unwrap_or_default();
            let cap = c.len().min(MAX_GAMMA).min(lim.max_k as usize);
            let mut a = 1f32;
            for (j, &cj) in c.iter().take(cap).enumerate() {
                let (cj, cl) = clamp_conf(cj);
                self.clamped += cl as usize;
                a *= cj;
                if j < lim.min_k as usize {
                    k[r] += 1;
                    left = left.saturating_sub(1);
                } else {
                    self.keys.push(pack(a, r, j));
                }
            }
        }
        radix_sort_high32(&mut self.keys, &mut self.tmp, &mut self.count);
        for &key in self.keys.iter().take(left as usize) {
            k[unpack(key).1] += 1;
        }
        k
    }
}

/// The scheduler in the engine's loop ([`specdec::VerifyPolicy`]): the budget K_total for
/// step t is the argmax decision on the confidences of step t − `lag` (so with lag 2 the next
/// batch shape is known before the current step ends); step t verifies the top-K_total entries
/// by the latest cumulative confidences. With lag 0 the decision is made on the spot.
pub struct ConfidencePolicy {
    pub sps: SpsTable,
    pub rule: Rule,
    pub lag: usize,
    pub max_batch_tokens: u32,
    /// Per-request verification cap (γ of the drafter).
    pub max_k: u8,
    adm: Admission,
    budgets: std::collections::VecDeque<u32>,
    /// Budgets computed elsewhere (the central scheduler), used while fresh.
    pub external: Option<std::sync::Arc<std::sync::Mutex<ExternalBudget>>>,
    steps: u64,
    pub last_decision_us: f64,
    pub clamped_total: usize,
}

/// A budget pushed by the central scheduler for a given engine step.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExternalBudget {
    pub for_step: u64,
    pub k_total: u32,
}

impl ConfidencePolicy {
    pub fn new(sps: SpsTable, rule: Rule, lag: usize, max_batch_tokens: u32, max_k: u8) -> Self {
        Self {
            sps,
            rule,
            lag,
            max_batch_tokens,
            max_k,
            adm: Admission::default(),
            budgets: std::collections::VecDeque::new(),
            external: None,
            steps: 0,
            last_decision_us: 0.0,
            clamped_total: 0,
        }
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl specdec::VerifyPolicy for ConfidencePolicy {
    fn name(&self) -> &str {
        "dspark-scheduler"
    }

    fn select(&mut self, conf: &[&[f32]], other_tokens: usize, kv_headroom: usize) -> Vec<usize> {
        let t0 = std::time::Instant::now();
        self.steps += 1;
        let limits: Vec<ReqLimits> = conf
            .iter()
            .map(|_| ReqLimits {
                min_k: 0,
                max_k: self.max_k,
            })
            .collect();
        let step = StepLimits {
            max_batch_tokens: self.max_batch_tokens,
            kv_headroom: kv_headroom.min(u32::MAX as usize) as u32,
            other_tokens: other_tokens.min(u32::MAX as usize) as u32,
        };
        let d = self.adm.decide(conf, &limits, step, &self.sps, self.rule);
        self.clamped_total += self.adm.clamped;
        if self.adm.clamped > 0 {
            tracing::debug!(
                clamped = self.adm.clamped,
                "confidences outside (0, 1) or NaN clamped"
            );
        }
        let now: u32 = d.k.iter().sum();
        let k = if self.lag == 0 {
            d.k
        } else {
            self.budgets.push_back(now);
            let lagged = if self.budgets.len() > self.lag {
                self.budgets.pop_front().unwrap_or(now)
            } else {
                now
            };
            let central = self
                .external
                .as_ref()
                .and_then(|e| e.lock().ok().map(|b| *b))
                .filter(|b| b.for_step + 1 >= self.steps && b.for_step <= self.steps + 1);
            let budget = central.map(|b| b.k_total).unwrap_or(lagged);
            self.adm.select_top(conf, &limits, budget)
        };
        self.last_decision_us = t0.elapsed().as_secs_f64() * 1e6;
        k.into_iter().map(|x| x as usize).collect()
    }
}

/// LSD radix sort by bits 32..64, two 16-bit passes (stable).
fn radix_sort_high32(v: &mut Vec<u64>, tmp: &mut Vec<u64>, count: &mut Vec<u32>) {
    tmp.clear();
    tmp.resize(v.len(), 0);
    count.resize(1 << 16, 0);
    for shift in [32u32, 48] {
        count.iter_mut().for_each(|c| *c = 0);
        for &x in v.iter() {
            count[((x >> shift) & 0xffff) as usize] += 1;
        }
        let mut sum = 0;
        for c in count.iter_mut() {
            let n = *c;
            *c = sum;
            sum += n;
        }
        for &x in v.iter() {
            let d = ((x >> shift) & 0xffff) as usize;
            tmp[count[d] as usize] = x;
            count[d] += 1;
        }
        std::mem::swap(v, tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    fn staircase(rng: &mut Rng, max_b: u32) -> SpsTable {
        let mut pts = Vec::new();
        let mut s = 100.0 + rng.uniform() * 50.0;
        let mut b = 0;
        while b < max_b {
            b += 1 + rng.below(4) as u32;
            pts.push((b.min(max_b), s));
            if rng.uniform() < 0.5 {
                s *= 0.5 + rng.uniform() * 0.5;
            }
            if b >= max_b {
                break;
            }
        }
        pts.dedup_by_key(|p| p.0);
        SpsTable::new(pts).expect("valid staircase")
    }

    fn theta(conf: &[Vec<f32>], k: &[u32], sps: &SpsTable) -> f64 {
        let mut tau = conf.len() as f64;
        let mut b = conf.len() as u32;
        for (c, &kr) in conf.iter().zip(k) {
            let mut a = 1f32;
            for &x in &c[..kr as usize] {
                a *= clamp_conf(x).0;
                tau += a as f64;
            }
            b += kr;
        }
        tau * sps.sps(b)
    }

    /// Every K vector within limits, the best Θ.
    fn brute(conf: &[Vec<f32>], lim: &[ReqLimits], step: StepLimits, sps: &SpsTable) -> f64 {
        let n = conf.len();
        let lo: Vec<u32> = (0..n)
            .map(|r| (lim[r].min_k as usize).min(conf[r].len()) as u32)
            .collect();
        let hi: Vec<u32> = (0..n)
            .map(|r| (lim[r].max_k as usize).min(conf[r].len()) as u32)
            .collect();
        let forced: u32 = lo.iter().sum();
        let room = step
            .max_batch_tokens
            .min(sps.max_batch())
            .saturating_sub(n as u32 + step.other_tokens + forced)
            .min(step.kv_headroom.saturating_sub(forced));
        let mut k = lo.clone();
        let mut best = f64::MIN;
        loop {
            let extra: u32 = k.iter().sum::<u32>() - forced;
            if extra <= room {
                best = best.max(theta(conf, &k, sps));
            }
            let mut i = 0;
            loop {
                if i == n {
                    return best;
                }
                if k[i] < hi[i].max(lo[i]) {
                    k[i] += 1;
                    break;
                }
                k[i] = lo[i];
                i += 1;
            }
        }
    }

    fn instance(rng: &mut Rng) -> (Vec<Vec<f32>>, Vec<ReqLimits>, StepLimits, SpsTable) {
        let n = 1 + rng.below(4);
        let conf: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..rng.below(5)).map(|_| rng.uniform() as f32).collect())
            .collect();
        let lim: Vec<ReqLimits> = (0..n)
            .map(|_| ReqLimits {
                min_k: if rng.uniform() < 0.2 { 1 } else { 0 },
                max_k: if rng.uniform() < 0.2 { 2 } else { u8::MAX },
            })
            .collect();
        let step = StepLimits {
            max_batch_tokens: 4 + rng.below(20) as u32,
            kv_headroom: rng.below(20) as u32,
            other_tokens: 0,
        };
        let sps = staircase(rng, 24);
        (conf, lim, step, sps)
    }

    #[test]
    fn argmax_is_the_best_prefix_closed_set_and_greedy_never_beats_it() {
        let mut rng = Rng::new(11);
        let mut adm = Admission::default();
        let mut differ = 0;
        for _ in 0..3000 {
            let (conf, lim, step, sps) = instance(&mut rng);
            let refs: Vec<&[f32]> = conf.iter().map(|c| c.as_slice()).collect();
            let d = adm.decide(&refs, &lim, step, &sps, Rule::Argmax);
            // Prefix-closed and within limits by construction of the output: K_r ≤ drafted.
            for (r, &kr) in d.k.iter().enumerate() {
                assert!(kr as usize <= conf[r].len());
            }
            let got = theta(&conf, &d.k, &sps);
            assert!(
                (got - d.theta).abs() <= 1e-9 * got.max(1.0),
                "{got} vs {}",
                d.theta
            );
            let want = brute(&conf, &lim, step, &sps);
            assert!(
                (got - want).abs() <= 1e-9 * want.max(1.0),
                "argmax Θ {got} < brute force {want}: {conf:?} {lim:?} {step:?} {sps:?} → {:?}",
                d.k
            );
            let g = adm.decide(&refs, &lim, step, &sps, Rule::GreedyEarlyStop);
            assert!(g.theta <= d.theta + 1e-9 * d.theta);
            if g.theta < d.theta - 1e-9 * d.theta {
                differ += 1;
            }
        }
        assert!(
            differ > 0,
            "random staircases must make greedy stop early sometimes"
        );
    }

    #[test]
    fn greedy_and_argmax_differ_exactly_at_a_dip_in_theta() {
        // Θ(K) over the sorted prefix with survivals 0.9, 0.8, 0.7, 0.6 for one request:
        // SPS 100 up to B = 2, 60 at B = 3, 60 at B = 5 ⇒ Θ = 190, 171, 240, 300 → greedy stops
        // at K = 1, argmax takes all four.
        let sps = SpsTable::new(vec![(2, 100.0), (5, 60.0)]).unwrap();
        let c = [0.9f32, 0.8 / 0.9, 0.7 / 0.8, 0.6 / 0.7];
        let step = StepLimits {
            max_batch_tokens: 64,
            kv_headroom: 64,
            other_tokens: 0,
        };
        let mut adm = Admission::default();
        let g = adm.decide(
            &[&c],
            &[ReqLimits::default()],
            step,
            &sps,
            Rule::GreedyEarlyStop,
        );
        let a = adm.decide(&[&c], &[ReqLimits::default()], step, &sps, Rule::Argmax);
        assert_eq!(g.k, vec![1]);
        assert_eq!(a.k, vec![4]);
        // A flat table: both keep going while Θ grows.
        let flat = SpsTable::new(vec![(64, 100.0)]).unwrap();
        let g = adm.decide(
            &[&c],
            &[ReqLimits::default()],
            step,
            &flat,
            Rule::GreedyEarlyStop,
        );
        assert_eq!(g.k, vec![4]);
    }

    #[test]
    fn load_trims_low_confidence_and_can_fall_to_plain_decoding() {
        // SPS halves once the batch passes 8: with 8 requests only the most confident tokens
        // are worth verifying; with one request everything is.
        let sps = SpsTable::new(vec![(8, 100.0), (16, 50.0), (64, 25.0)]).unwrap();
        let hi = [0.95f32; 7];
        let lo = [0.2f32; 7];
        let step = StepLimits {
            max_batch_tokens: 64,
            kv_headroom: 1000,
            other_tokens: 0,
        };
        let mut adm = Admission::default();
        let one = adm.decide(&[&hi], &[], step, &sps, Rule::Argmax);
        assert_eq!(one.k, vec![7]);
        let reqs: Vec<&[f32]> = vec![&lo; 8];
        let many = adm.decide(&reqs, &[], step, &sps, Rule::Argmax);
        assert_eq!(
            many.k,
            vec![0; 8],
            "low confidence under load: plain decoding"
        );
        // Limits: per-request max and KV headroom.
        let capped = adm.decide(
            &[&hi],
            &[ReqLimits { min_k: 0, max_k: 3 }],
            step,
            &sps,
            Rule::Argmax,
        );
        assert_eq!(capped.k, vec![3]);
        let kv = adm.decide(
            &[&hi],
            &[],
            StepLimits {
                max_batch_tokens: 64,
                kv_headroom: 2,
                other_tokens: 0,
            },
            &sps,
            Rule::Argmax,
        );
        assert_eq!(kv.k, vec![2]);
        let tier = adm.decide(
            &[&lo],
            &[ReqLimits { min_k: 2, max_k: 9 }],
            step,
            &sps,
            Rule::Argmax,
        );
        assert!(tier.k[0] >= 2);
    }

    #[test]
    fn bad_tables_and_confidences_are_refused_or_clamped() {
        assert_eq!(SpsTable::new(vec![]), Err(AdmissionError::EmptyTable));
        assert!(SpsTable::new(vec![(4, 10.0), (2, 5.0)]).is_err());
        assert!(SpsTable::new(vec![(2, 10.0), (4, 20.0)]).is_err());
        assert!(SpsTable::new(vec![(0, 10.0)]).is_err());
        assert!(SpsTable::new(vec![(2, f64::NAN)]).is_err());
        let sps = SpsTable::new(vec![(64, 100.0)]).unwrap();
        let mut adm = Admission::default();
        let c = [f32::NAN, 2.0, -1.0, 0.5];
        let d = adm.decide(
            &[&c],
            &[],
            StepLimits {
                max_batch_tokens: 64,
                kv_headroom: 64,
                other_tokens: 0,
            },
            &sps,
            Rule::Argmax,
        );
        assert_eq!(adm.clamped, 3);
        assert!(d.theta.is_finite() && d.k[0] <= 4);
    }
}
