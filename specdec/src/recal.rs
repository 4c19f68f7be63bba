//! Online recalibration of served confidences.
//!
//! A drafter's calibration (STS and its input mix) is fitted once, offline, on calibration
//! prompts. A worker's traffic is not those prompts: each kind of prompt is accepted at its own
//! rate, and a static calibration reads a few points of survival off on prompts it was not
//! fitted on. The engine sees every verdict, so per block position it keeps refitting a
//! two-parameter map c' = σ(α·logit(c) + β) of the proposer's confidences on the verdicts of
//! blocks already verified, and serves c'.
//!
//! - Prequential: a block's confidences are mapped with what earlier verdicts taught, never its
//!   own, and c is a function of x_1..x_{k−1} (the proposer's contract), so c'_k never depends
//!   on the drafted token x_k either.
//! - A ridge pulls (α, β) toward (1, 0), the proposer's calibration as it is, so a cold start or
//!   a position seldom reached serves what the proposer said.
//! - Observations fade with a half-life (in verified positions), so the map follows the traffic.
//! - Verdicts are grouped in bins of logit(c), so a refit costs the same however long the
//!   worker has run. Where the verdicts of a bin depart from the two-parameter map (a
//!   miscalibration that is not a slope and a shift: too low at both ends and too high in the
//!   middle, say), the bin's own correction is added to the logit, shrunk toward none by
//!   [`RecalConfig::bin_ridge`] (histogram binning on top of Platt scaling).
//! - Separate maps per kind of block: greedy or sampled requests, and confidences from a
//!   confidence head or fitted rates (greedy copy runs,
//!   [`crate::proposer::DraftBlock::fitted_rates`]); they are off in different ways. Copy runs
//!   are split again by their first position's rate (see [`STRONG_RUN`]).

use crate::MAX_GAMMA;

/// Bins of logit(c), over [`LOGIT_MIN`, `LOGIT_MAX`].
const BINS: usize = 32;
const LOGIT_MIN: f64 = -8.0;
const LOGIT_MAX: f64 = 8.0;
/// Observations at a position between refits.
const REFIT_EVERY: u32 = 8;
/// Kinds of block: greedy or sampled × (copy run starting weak, confidence head, copy run
/// starting strong).
const CLASSES: usize = 6;
/// A copy run whose first position's rate (the committed context's own match; with a copy-run
/// head, that head's confidence there) is at least this is mapped apart from one that starts
/// lower. Along a run the match length counts the tokens
/// the run itself copied, so a run that starts on a two-token match reaches the rate of a
/// six-token match a few positions in, on no more evidence than it started with. One map per
/// position saw both kinds of run at the same confidences and served their average: at
/// position 7 of held-out greedy chat, 0.16–0.29 served where runs that started weak survived
/// at 0.10–0.11, and 0.65–0.68 where strong ones survived at 0.73–0.74 (cumulative ECE 2.2 %
/// there against 1.3 % at the first positions). The shipped drafter's rates are 0.53–0.72 up
/// to five matched tokens and 0.95 from six.
pub const STRONG_RUN: f32 = 0.85;

/// [`RecalConfig::half_life`]'s default (also the target worker's `--calibration-half-life`).
pub const DEFAULT_HALF_LIFE: f64 = 1000.0;

/// Settings of [`OnlineCalibration`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecalConfig {
    /// Verified positions (per block position and kind) after which an observation weighs half.
    /// 1000 by default: a worker's traffic drifts within a run (held-out math prompts were
    /// accepted at 0.30 to 0.43 at position 1 between quarters of a run), and a map that
    /// remembers 4000 verdicts followed that only on average. Replayed on the first 48 held-out
    /// prompts of each set, 1000 served a lower worst-position ECE than 4000 on all six sets
    /// (chat, code, math × greedy, T = 1; math at T = 1: 1.8 against 2.2 %). On 96 newer
    /// prompts, without such drift, the two were level (within 0.3 points either way).
    pub half_life: f64,
    /// Strength of the pull toward the proposer's own calibration, in units of the log-loss
    /// curvature one observation adds at c = ½ (¼): 100 is as firm as 400 such verdicts.
    pub ridge: f64,
    /// Shrinkage of a bin's own correction, in the same units: at 100 a bin needs about 100
    /// verdicts at c = ½ (200 at c = 0.15) before half of what they say is applied.
    pub bin_ridge: f64,
}

impl Default for RecalConfig {
    fn default() -> Self {
        Self {
            half_life: DEFAULT_HALF_LIFE,
            ridge: 25.0,
            bin_ridge: 100.0,
        }
    }
}

impl RecalConfig {
    /// The defaults with this half-life; 0 turns the recalibration off (None).
    pub fn with_half_life(half_life: f64) -> crate::Result<Option<Self>> {
        if !half_life.is_finite() || half_life < 0.0 {
            return Err(crate::SpecError::Invalid(format!(
                "calibration half-life must be a number ≥ 0 (0: off), not {half_life}"
            )));
        }
        Ok((half_life > 0.0).then(|| Self {
            half_life,
            ..Self::default()
        }))
    }
}

#[derive(Clone, Debug)]
struct PosFit {
    /// Faded count, accepted count and sum of logit(c) per bin.
    n: [f64; BINS],
    s: [f64; BINS],
    l: [f64; BINS],
    alpha: f64,
    beta: f64,
    since: u32,
}

impl Default for PosFit {
    fn default() -> Self {
        Self {
            n: [0.0; BINS],
            s: [0.0; BINS],
            l: [0.0; BINS],
            alpha: 1.0,
            beta: 0.0,
            since: 0,
        }
    }
}

fn bin_of(l: f64) -> usize {
    (((l - LOGIT_MIN) / (LOGIT_MAX - LOGIT_MIN) * BINS as f64) as usize).min(BINS - 1)
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// logit(c), clamped to the binned range; None for a confidence that is not a number.
fn logit(c: f32) -> Option<f64> {
    if !c.is_finite() {
        return None;
    }
    let c = (c as f64).clamp(1e-6, 1.0 - 1e-6);
    Some((c / (1.0 - c)).ln().clamp(LOGIT_MIN, LOGIT_MAX))
}

impl PosFit {
    fn observe(&mut self, l: f64, accepted: bool, decay: f64, ridge: f64) {
        for b in 0..BINS {
            self.n[b] *= decay;
            self.s[b] *= decay;
            self.l[b] *= decay;
        }
        let b = bin_of(l);
        self.n[b] += 1.0;
        self.s[b] += accepted as u8 as f64;
        self.l[b] += l;
        self.since += 1;
        if self.since >= REFIT_EVERY {
            self.since = 0;
            self.refit(ridge);
        }
    }

    /// The served logit of a proposer's logit `l`: the map, plus its bin's shrunk correction
    /// (one Newton step from none on the bin's verdicts, at the bin's mean logit).
    fn logit_of(&self, l: f64, bin_ridge: f64) -> f64 {
        let z = self.alpha * l + self.beta;
        let b = bin_of(l);
        let n = self.n[b];
        if n < 1e-9 {
            return z;
        }
        let p = sigmoid(self.alpha * self.l[b] / n + self.beta);
        z + (self.s[b] - n * p) / (n * p * (1.0 - p) + bin_ridge * 0.25)
    }

    /// Newton steps on the ridge-penalized log loss of the binned verdicts, from the last fit.
    fn refit(&mut self, ridge: f64) {
        let lam = ridge * 0.25;
        let (mut a, mut c) = (self.alpha, self.beta);
        for _ in 0..4 {
            let (mut ga, mut gb) = (lam * (a - 1.0), lam * c);
            let (mut haa, mut hab, mut hbb) = (lam, 0.0, lam);
            for b in 0..BINS {
                let n = self.n[b];
                if n < 1e-9 {
                    continue;
                }
                let x = self.l[b] / n;
                let p = sigmoid(a * x + c);
                let r = n * p - self.s[b];
                ga += r * x;
                gb += r;
                let w = n * p * (1.0 - p);
                haa += w * x * x;
                hab += w * x;
                hbb += w;
            }
            let det = haa * hbb - hab * hab;
            if det.is_nan() || det <= 1e-12 {
                return;
            }
            let da = (hbb * ga - hab * gb) / det;
            let mut db = (haa * gb - hab * ga) / det;
            let a_new = (a - da).clamp(0.05, 5.0);
            if a_new != a - da {
                // The slope is at its bound: the best shift for the slope kept (a joint step
                // that assumed the slope moved further would stall the shift).
                db = gb / hbb;
            }
            a = a_new;
            c = (c - db).clamp(-6.0, 6.0);
            if da.abs() + db.abs() < 1e-6 {
                break;
            }
        }
        if a.is_finite() && c.is_finite() {
            self.alpha = a;
            self.beta = c;
        }
    }
}

/// Per kind of block and block position, the map from the proposer's confidences to served
/// ones, refitted on verdicts as they come (see the module doc).
#[derive(Clone, Debug)]
pub struct OnlineCalibration {
    fits: Vec<Vec<PosFit>>,
    decay: f64,
    ridge: f64,
    bin_ridge: f64,
}

impl OnlineCalibration {
    pub fn new(cfg: RecalConfig) -> Self {
        let hl = if cfg.half_life.is_finite() && cfg.half_life > 0.0 {
            cfg.half_life
        } else {
            f64::INFINITY
        };
        Self {
            fits: vec![vec![PosFit::default(); MAX_GAMMA]; CLASSES],
            decay: 0.5f64.powf(1.0 / hl),
            ridge: cfg.ridge.max(0.0),
            bin_ridge: cfg.bin_ridge.max(1e-3),
        }
    }

    /// The map of a block: `first` is its first position's confidence as the proposer gave it.
    fn class(greedy: bool, head: bool, first: Option<f32>) -> usize {
        let kind = if head {
            1
        } else if first.is_some_and(|c| c >= STRONG_RUN) {
            2
        } else {
            0
        };
        greedy as usize * 3 + kind
    }

    /// Maps a block's conditional confidences (position 0 first) in place. Confidences that are
    /// not numbers are left for the policy to refuse.
    pub fn apply(&self, greedy: bool, head: bool, conf: &mut [f32]) {
        let fits = &self.fits[Self::class(greedy, head, conf.first().copied())];
        for (c, f) in conf.iter_mut().zip(fits) {
            if let Some(l) = logit(*c) {
                *c = sigmoid(f.logit_of(l, self.bin_ridge)) as f32;
            }
        }
    }

    /// Learns from a verified block: `base` are the proposer's confidences of the verified
    /// positions (before [`OnlineCalibration::apply`]), `accepted` how many drafts survived.
    /// Position k was reached when accepted ≥ k, and accepted there when accepted > k.
    pub fn observe(&mut self, greedy: bool, head: bool, base: &[f32], accepted: usize) {
        let (decay, ridge) = (self.decay, self.ridge);
        let fits = &mut self.fits[Self::class(greedy, head, base.first().copied())];
        for (k, (&c, f)) in base.iter().zip(fits.iter_mut()).enumerate() {
            if k > accepted {
                break;
            }
            if let Some(l) = logit(c) {
                f.observe(l, accepted > k, decay, ridge);
            }
        }
    }

    /// The current map (α, β) of a kind of block at position `k` (`first`: the block's first
    /// confidence, which sorts copy runs).
    pub fn params(&self, greedy: bool, head: bool, first: f32, k: usize) -> (f64, f64) {
        self.fits[Self::class(greedy, head, Some(first))]
            .get(k)
            .map_or((1.0, 0.0), |f| (f.alpha, f.beta))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::rng::Rng;

    fn mean_conf(cal: &OnlineCalibration, c: f32) -> f32 {
        let mut v = [c];
        cal.apply(false, true, &mut v);
        v[0]
    }

    #[test]
    fn a_cold_start_serves_the_proposers_confidences() {
        let cal = OnlineCalibration::new(RecalConfig::default());
        let mut c = [0.1f32, 0.5, 0.93, f32::NAN];
        cal.apply(true, true, &mut c);
        assert!((c[0] - 0.1).abs() < 1e-5 && (c[1] - 0.5).abs() < 1e-5);
        assert!((c[2] - 0.93).abs() < 1e-5);
        assert!(c[3].is_nan(), "a NaN is left for the policy to refuse");
    }

    #[test]
    fn a_biased_stream_is_corrected_and_an_honest_one_left_alone() {
        // The proposer says c; the truth is c shifted by −1 in logit (over-confident).
        let mut rng = Rng::new(11);
        let mut off = OnlineCalibration::new(RecalConfig::default());
        let mut honest = OnlineCalibration::new(RecalConfig::default());
        for _ in 0..20_000 {
            let c = 0.05 + 0.9 * rng.uniform() as f32;
            let l = (c / (1.0 - c)).ln() as f64;
            let truth = sigmoid(l - 1.0);
            off.observe(false, true, &[c], (rng.uniform() < truth) as usize);
            honest.observe(
                false,
                true,
                &[c],
                (rng.uniform() < l.exp() / (1.0 + l.exp())) as usize,
            );
        }
        let (a, b) = off.params(false, true, 0.5, 0);
        assert!(
            (a - 1.0).abs() < 0.1 && (b + 1.0).abs() < 0.1,
            "α {a}, β {b}"
        );
        let (a, b) = honest.params(false, true, 0.5, 0);
        assert!((a - 1.0).abs() < 0.1 && b.abs() < 0.1, "α {a}, β {b}");
        let served = mean_conf(&off, 0.5);
        assert!((served as f64 - sigmoid(-1.0)).abs() < 0.03, "{served}");
        // Other kinds of block and positions are untouched.
        assert_eq!(off.params(true, true, 0.5, 0), (1.0, 0.0));
        assert_eq!(off.params(false, false, 0.5, 0), (1.0, 0.0));
        assert_eq!(off.params(false, true, 0.5, 1), (1.0, 0.0));
    }

    #[test]
    fn only_reached_positions_are_observed() {
        let mut cal = OnlineCalibration::new(RecalConfig {
            half_life: 0.0,
            ridge: 1.0,
            ..Default::default()
        });
        let served = |cal: &OnlineCalibration, k: usize| {
            let mut v = [0.9f32; 3];
            cal.apply(false, true, &mut v);
            v[k]
        };
        // Position 0 always rejected: positions 1.. are never reached and stay as they were.
        for _ in 0..500 {
            cal.observe(false, true, &[0.9, 0.9, 0.9], 0);
        }
        assert!(served(&cal, 0) < 0.05, "{}", served(&cal, 0));
        assert_eq!(cal.params(false, true, 0.5, 1), (1.0, 0.0));
        // Accepted through position 1, rejected at 2.
        for _ in 0..500 {
            cal.observe(false, true, &[0.9, 0.9, 0.9], 2);
        }
        assert!(served(&cal, 1) > 0.95, "{}", served(&cal, 1));
        assert!(served(&cal, 2) < 0.05, "{}", served(&cal, 2));
    }

    #[test]
    fn copy_runs_that_start_weak_and_strong_are_mapped_apart() {
        // Both kinds of run read 0.95 at their third position; one that started on a weak
        // match survives there at 0.7, one that started strong at 0.97.
        let mut rng = Rng::new(9);
        let mut cal = OnlineCalibration::new(RecalConfig::default());
        let weak = [0.55f32, 0.7, 0.95];
        let strong = [0.95f32, 0.95, 0.95];
        for _ in 0..6000 {
            for (block, truth) in [(weak, [0.55, 0.7, 0.7]), (strong, [0.95, 0.95, 0.97])] {
                let accepted = truth.iter().take_while(|&&t| rng.uniform() < t).count();
                cal.observe(true, false, &block, accepted);
            }
        }
        let served = |block: [f32; 3]| {
            let mut v = block;
            cal.apply(true, false, &mut v);
            v[2] as f64
        };
        assert!((served(weak) - 0.7).abs() < 0.04, "{}", served(weak));
        assert!((served(strong) - 0.97).abs() < 0.02, "{}", served(strong));
        // Confidence-head blocks keep their own map.
        assert_eq!(cal.params(true, true, 0.95, 2), (1.0, 0.0));
    }

    #[test]
    fn a_miscalibration_that_is_not_a_slope_and_shift_is_corrected_per_bin() {
        // Too low at both ends, too high in the middle: no σ(α·l + β) fits it.
        let truth = |c: f64| {
            if (0.25..0.45).contains(&c) {
                c - 0.08
            } else {
                (c + 0.06).min(1.0)
            }
        };
        // Bins shrink toward none by the verdicts they hold, so this checks the mechanism at
        // a memory of 4000 verdicts (the default's 1000 leaves each bin a quarter of them).
        let mut rng = Rng::new(3);
        let long = RecalConfig {
            half_life: 4000.0,
            ..Default::default()
        };
        let mut cal = OnlineCalibration::new(long);
        let mut flat = OnlineCalibration::new(RecalConfig {
            bin_ridge: 1e12,
            ..long
        });
        for _ in 0..40_000 {
            let c = 0.05 + 0.7 * rng.uniform();
            let y = (rng.uniform() < truth(c)) as usize;
            cal.observe(false, true, &[c as f32], y);
            flat.observe(false, true, &[c as f32], y);
        }
        let err = |cal: &OnlineCalibration| {
            [0.1f64, 0.35, 0.65]
                .iter()
                .map(|&c| (mean_conf(cal, c as f32) as f64 - truth(c)).abs())
                .fold(0.0, f64::max)
        };
        // The map alone is off by about 0.11 at one of these; the bins take most of it back
        // (what is left is the shrinkage, at the half-life's worth of verdicts per bin).
        let (binned, alone) = (err(&cal), err(&flat));
        assert!(alone > 0.08, "the map alone {alone}");
        assert!(
            binned < 0.045 && binned < alone / 2.5,
            "binned {binned}, alone {alone}"
        );
    }

    #[test]
    fn the_map_follows_a_change_of_traffic() {
        let mut rng = Rng::new(5);
        let mut cal = OnlineCalibration::new(RecalConfig {
            half_life: 1000.0,
            ..Default::default()
        });
        for phase in [0.6f64, 0.2] {
            for _ in 0..8000 {
                cal.observe(false, true, &[0.4], (rng.uniform() < phase) as usize);
            }
            let served = mean_conf(&cal, 0.4) as f64;
            assert!(
                (served - phase).abs() < 0.04,
                "served {served}, truth {phase}"
            );
        }
    }
}
