//! Sampling transforms and seeded sampling.
//!
//! The transform pipeline (logit bias → held-back end tokens → penalties → temperature → min-p →
//! top-k → top-p → renormalize) is one pure function, [`probs`], so the speculative verifier can
//! apply exactly the same transform to the target's p and the drafter's q before acceptance. Temperature 0 means greedy: [`argmax`], with
//! ties broken toward the lowest token id so greedy output is deterministic.

use crate::KernelError;
use crate::rng::Rng;

/// User-facing sampling parameters, validated once ([`SamplingParams::validate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off; must lie in (0, 1].
    pub top_p: f32,
    /// 1 = off; > 0. Divides positive logits (multiplies negative ones) of seen tokens.
    pub repetition_penalty: f32,
    /// 0 = off. Subtracted once from the logit of every token the output holds.
    pub presence_penalty: f32,
    /// 0 = off. Subtracted per occurrence in the output.
    pub frequency_penalty: f32,
    /// 0 = off; in [0, 1]. After temperature, tokens less likely than `min_p` times the most
    /// likely one are dropped (vLLM's `min_p`).
    pub min_p: f32,
    /// Added to the logits of these tokens before anything else (OpenAI's `logit_bias`, each in
    /// [-100, 100]). Sorted by token id, one entry per token ([`SamplingParams::set_logit_bias`]).
    pub logit_bias: Vec<(u32, f32)>,
    /// While the context (`seen`) is shorter than this, `held_ids` cannot be produced: vLLM's
    /// `min_tokens`, made absolute (prompt length + min_tokens) by whoever starts the request
    /// ([`SamplingParams::hold_end_tokens`]). 0 = off.
    pub hold_until: usize,
    /// The end-of-sequence and stop token ids `hold_until` holds back.
    pub held_ids: Vec<u32>,
    /// Where the output begins in `seen` (the prompt's length): presence and frequency
    /// penalties count tokens from here, as OpenAI and vLLM do; the repetition penalty counts
    /// the prompt too ([`SamplingParams::count_output_from`]).
    pub output_from: usize,
}

/// Temperatures below this decode greedily (vLLM's threshold).
pub const GREEDY_BELOW: f32 = 1e-5;

/// Largest |bias| OpenAI's `logit_bias` accepts.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            hold_until: 0,
            held_ids: Vec::new(),
            output_from: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Temperatures below [`GREEDY_BELOW`] are greedy: 1/T overflows f32 from about 3e-39,
    /// and a NaN row would sample token 0 every time.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Whether the logits are changed before temperature (penalties, logit bias, held-back end
    /// tokens): then greedy is the argmax of the changed logits, not of the raw ones, and the
    /// transform needs ordinary token ids and the context.
    pub fn shapes_logits(&self) -> bool {
        self.has_penalties() || !self.logit_bias.is_empty() || self.hold_until > 0
    }

    /// Sets `logit_bias` from (token, bias) pairs: sorted, and a token listed twice keeps its
    /// last bias (as a JSON object would).
    pub fn set_logit_bias(&mut self, pairs: impl IntoIterator<Item = (u32, f32)>) {
        let mut m = std::collections::BTreeMap::new();
        for (t, b) in pairs {
            m.insert(t, b);
        }
        self.logit_bias = m.into_iter().collect();
    }

    /// vLLM's `min_tokens`: `end_ids` (end-of-sequence and stop tokens) cannot be produced
    /// before `min_tokens` tokens follow a prompt of `prompt_len`.
    pub fn hold_end_tokens(&mut self, prompt_len: usize, min_tokens: usize, end_ids: &[u32]) {
        if min_tokens == 0 || end_ids.is_empty() {
            self.hold_until = 0;
            self.held_ids.clear();
            return;
        }
        // Saturating: a library caller may ask for up to usize::MAX tokens.
        self.hold_until = prompt_len.saturating_add(min_tokens);
        self.held_ids = end_ids.to_vec();
        self.held_ids.sort_unstable();
        self.held_ids.dedup();
    }

    /// Presence and frequency penalties count `seen` from `start` on: the prompt's length
    /// (without output resumed from another worker, which is output still).
    pub fn count_output_from(&mut self, start: usize) {
        self.output_from = start;
    }

    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |m: String| Err(KernelError::InvalidParam(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !self.min_p.is_finite() || !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for &(t, b) in &self.logit_bias {
            if !b.is_finite() || !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b) {
                return bad(format!(
                    "logit_bias for token {t} must be in [-100, 100], got {b}"
                ));
            }
        }
        if self.logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return bad("logit_bias must be sorted by token, one entry each".into());
        }
        Ok(())
    }

    /// Checks token ids against the vocabulary (they are ignored past it otherwise).
    pub fn validate_vocab(&self, vocab: usize) -> Result<(), KernelError> {
        if let Some(&(t, _)) = self.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return Err(KernelError::InvalidParam(format!(
                "logit_bias names token {t}, outside the vocabulary of {vocab}"
            )));
        }
        Ok(())
    }
}

/// Index of the largest logit; ties go to the lowest index. NaN never wins; with nothing
/// above −∞, index 0.
///
/// Two passes the compiler vectorizes: the maximum over 16 lanes, then the first block of 16
/// holding it. The one-pass scan (a compare and branch per logit, [`argmax_scan`]) took 2.8 %
/// of the cycles of a c = 8 serving run on SmolLM2, one 49 152-logit row per verified
/// position.
pub fn argmax(x: &[f32]) -> u32 {
    const L: usize = 16;
    let chunks = x.chunks_exact(L);
    let tail = chunks.remainder();
    let mut m = [f32::NEG_INFINITY; L];
    for c in chunks {
        for (mj, &cj) in m.iter_mut().zip(c) {
            // `maxps` as written: NaN never replaces the lane's value.
            *mj = if cj > *mj { cj } else { *mj };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in m.iter().chain(tail) {
        if v > best {
            best = v;
        }
    }
    if best == f32::NEG_INFINITY {
        return 0;
    }
    // The first block holding the maximum, then its first position there.
    let block = x
        .chunks(L)
        .position(|c| c.iter().fold(false, |a, &v| a | (v == best)))
        .unwrap_or(0);
    let at = x[block * L..].iter().position(|&v| v == best).unwrap_or(0);
    (block * L + at) as u32
}

/// The one-pass reference for [`argmax`]: the first index whose logit exceeds every earlier one.
pub fn argmax_scan(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// Applies the repetition penalty for the tokens seen so far (prompt and output), presence and
/// frequency penalties for those of the output (`seen[p.output_from..]`).
pub fn apply_penalties(logits: &mut [f32], seen: &[u32], p: &SamplingParams) {
    if !p.has_penalties() {
        return;
    }
    // Occurrences in the output; a prompt-only token is present with count 0.
    let mut counts = std::collections::HashMap::<u32, u32>::new();
    for (i, &t) in seen.iter().enumerate() {
        *counts.entry(t).or_default() += u32::from(i >= p.output_from);
    }
    for (&t, &c) in &counts {
        let Some(l) = logits.get_mut(t as usize) else {
            continue;
        };
        if p.repetition_penalty != 1.0 {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
        if c > 0 {
            *l -= p.presence_penalty + p.frequency_penalty * c as f32;
        }
    }
}

/// Everything done to the logits before temperature: logit bias, end tokens held back while
/// the context is shorter than `hold_until`, penalties. `seen` is the context (prompt and
/// output so far, ordinary token ids).
pub fn shape_logits(logits: &mut [f32], seen: &[u32], p: &SamplingParams) {
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if seen.len() < p.hold_until {
        for &t in &p.held_ids {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    apply_penalties(logits, seen, p);
}

/// The sampling distribution for one position: [`shape_logits`], temperature, min-p, top-k,
/// top-p, renormalized. For greedy parameters it is the one-hot of [`argmax`] of the shaped
/// logits. `seen` is the context: prompt and output so far (the penalties count its tokens,
/// `hold_until` measures its length).
pub fn probs(logits: &[f32], seen: &[u32], p: &SamplingParams) -> Vec<f32> {
    let mut l = logits.to_vec();
    shape_logits(&mut l, seen, p);
    let n = l.len();
    if p.is_greedy() {
        let mut out = vec![0f32; n];
        if n > 0 {
            out[argmax(&l) as usize] = 1.0;
        }
        return out;
    }
    let inv_t = 1.0 / p.temperature;
    let max = lane_max(&l);
    if max == f32::INFINITY {
        // A +∞ logit outweighs everything: its token (shared among +∞ ties), as greedy
        // decoding would pick it. (∞ − ∞ would make every probability NaN, and then token 0.)
        let tops = l.iter().filter(|&&v| v == f32::INFINITY).count() as f32;
        for v in l.iter_mut() {
            *v = if *v == f32::INFINITY { 1.0 / tops } else { 0.0 };
        }
        return l;
    }
    let sum = if max.is_finite() {
        exp_shifted(&mut l, max, inv_t)
    } else {
        // Every logit −∞ (or NaN): an empty row, which samples token 0 as greedy picks it.
        let mut sum = 0f64;
        for v in l.iter_mut() {
            let e = if v.is_nan() {
                0.0
            } else {
                ((*v - max) * inv_t).exp()
            };
            *v = e;
            sum += e as f64;
        }
        sum
    };
    let inv = (1.0 / sum) as f32;
    for v in l.iter_mut() {
        *v *= inv;
    }
    if p.min_p > 0.0 {
        // The most likely token has probability exp(0)/sum: the threshold in the same units.
        let cut = p.min_p * inv;
        let mut kept = 0f64;
        for v in l.iter_mut() {
            if *v < cut {
                *v = 0.0;
            }
            kept += *v as f64;
        }
        let inv = (1.0 / kept) as f32;
        for v in l.iter_mut() {
            *v *= inv;
        }
    }
    if (p.top_k > 0 && p.top_k < n) || p.top_p < 1.0 {
        // Sort descending by probability, ties by lower id, then keep a prefix.
        let mut idx: Vec<u32> = (0..n as u32).collect();
        let k = if p.top_k > 0 { p.top_k.min(n) } else { n };
        let cmp = |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b));
        if k < n {
            idx.select_nth_unstable_by(k - 1, cmp);
            idx.truncate(k);
        }
        idx.sort_unstable_by(cmp);
        let mut keep = idx.len();
        if p.top_p < 1.0 {
            let kept_mass: f64 = idx.iter().map(|&i| l[i as usize] as f64).sum();
            let mut cum = 0f64;
            for (j, &i) in idx.iter().enumerate() {
                cum += l[i as usize] as f64 / kept_mass;
                if cum >= p.top_p as f64 {
                    keep = j + 1;
                    break;
                }
            }
        }
        let mut out = vec![0f32; n];
        let mut s = 0f64;
        for &i in &idx[..keep] {
            out[i as usize] = l[i as usize];
            s += l[i as usize] as f64;
        }
        let inv = (1.0 / s) as f32;
        for &i in &idx[..keep] {
            out[i as usize] *= inv;
        }
        return out;
    }
    l
}

/// The largest non-NaN value (−∞ when there is none), over 16 lanes.
fn lane_max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { lane_max_avx2(x) };
    }
    crate::ops::max_body(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn lane_max_avx2(x: &[f32]) -> f32 {
    crate::ops::max_body(x)
}

/// `l[i] = e^((l[i] − max)·inv_t)` (0 for NaN) for a finite `max`, returning the sum.
///
/// Why: this runs at every sampled position, over the whole vocabulary (49,152 on SmolLM2,
/// and again at every verified position of a speculative window); a libm `exp` per element
/// with a running f64 sum took 0.17 ms there per position, a twentieth of a decode. Here the
/// exponential is [`ops::fast_exp`](crate::ops::fast_exp) (≤ 2 ulp) over 16 lanes with f32
/// partial sums, whose 16 lane totals are added into f64 lanes every 256 elements. Scaled gaps
/// below the top logit past 87 give exactly 0 (`fast_exp`'s range) where libm gave at most
/// 10⁻³⁸; p and q both come through here, so they agree.
fn exp_shifted(l: &mut [f32], max: f32, inv_t: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { exp_shifted_avx2(l, max, inv_t) };
    }
    exp_shifted_body(l, max, inv_t)
}

/// AVX2 rounds (`floor`) in one instruction, so [`ops::fast_exp`](crate::ops::fast_exp)'s
/// loop vectorizes; the x86-64 baseline calls libm's `floorf` per element instead.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(l: &mut [f32], max: f32, inv_t: f32) -> f64 {
    exp_shifted_body(l, max, inv_t)
}

#[inline(always)]
fn exp_shifted_body(l: &mut [f32], max: f32, inv_t: f32) -> f64 {
    let e = |v: f32| {
        if v.is_nan() {
            0.0
        } else {
            crate::ops::fast_exp((v - max) * inv_t)
        }
    };
    // f32 lanes over 256 elements at a time, then f64 lanes: no long chain of dependent adds.
    let mut wide = [0f64; 16];
    let mut blocks = l.chunks_exact_mut(256);
    for b in &mut blocks {
        let mut acc = [0f32; 16];
        for c in b.chunks_exact_mut(16) {
            for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
                *v = e(*v);
                *a += *v;
            }
        }
        for (w, &a) in wide.iter_mut().zip(&acc) {
            *w += a as f64;
        }
    }
    let mut sum: f64 = wide.iter().sum();
    for v in blocks.into_remainder() {
        *v = e(*v);
        sum += *v as f64;
    }
    sum
}

/// The sum of the positive values of `x` (NaN counts as 0), in 16 independent f64 lanes (a
/// running sum is a chain of dependent adds, 4 cycles an element). In f64 so that a block's
/// mass agrees with [`sample`]'s element-wise walk through it to f64 rounding: with f32 lanes
/// the two differed by ~10⁻⁷ of the block's mass, and that difference went to one token.
pub(crate) fn positive_mass(x: &[f32]) -> f64 {
    let mut acc = [0f64; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v.max(0.0) as f64;
        }
    }
    let rem: f64 = chunks.remainder().iter().map(|&v| v.max(0.0) as f64).sum();
    acc.iter().sum::<f64>() + rem
}

/// Elements per block of [`sample`]'s scan.
const SCAN_BLOCK: usize = 256;

/// Draws one index from a probability vector (inverse CDF with one uniform).
///
/// The cumulative sum runs block by block (each block's mass summed in 16 lanes), and
/// element by element only inside the block where it crosses the draw: an element-wise f64
/// scan of the whole vocabulary cost as much as the softmax before it.
pub fn sample(probs: &[f32], rng: &mut Rng) -> u32 {
    let masses: Vec<f64> = probs.chunks(SCAN_BLOCK).map(positive_mass).collect();
    let total: f64 = masses.iter().sum();
    let u = rng.uniform() * total;
    let mut cum = 0f64;
    let mut last = None;
    for (bi, (block, &m)) in probs.chunks(SCAN_BLOCK).zip(&masses).enumerate() {
        if m <= 0.0 {
            continue;
        }
        if u >= cum + m {
            cum += m;
            last = Some(bi);
            continue;
        }
        // The draw falls here (up to rounding: past the block's last positive element, it
        // takes that element).
        let mut pick = None;
        for (i, &v) in block.iter().enumerate() {
            if v > 0.0 {
                cum += v as f64;
                pick = Some(i);
                if u < cum {
                    break;
                }
            }
        }
        if let Some(i) = pick {
            return (bi * SCAN_BLOCK + i) as u32;
        }
    }
    // Rounding left the draw past every block: the last positive element.
    last.and_then(|bi| {
        let block = probs.chunks(SCAN_BLOCK).nth(bi)?;
        let i = block.iter().rposition(|&v| v > 0.0)?;
        Some((bi * SCAN_BLOCK + i) as u32)
    })
    .unwrap_or(0)
}

/// One sampled token from logits under `p` (argmax when greedy).
pub fn sample_logits(logits: &[f32], seen: &[u32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.is_greedy() && !p.shapes_logits() {
        return argmax(logits);
    }
    let pr = probs(logits, seen, p);
    if p.is_greedy() {
        return argmax(&pr);
    }
    sample(&pr, rng)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..Default::default()
        }
    }

    #[test]
    fn validation_rejects_bad_values() {
        assert!(params(-1.0, 0, 1.0).validate().is_err());
        assert!(params(f32::NAN, 0, 1.0).validate().is_err());
        assert!(params(1.0, 0, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.5).validate().is_err());
        assert!(params(0.7, 40, 0.9).validate().is_ok());
    }

    /// A tiny positive temperature decodes greedily instead of overflowing 1/T into a NaN
    /// row (which sampled token 0 every time).
    #[test]
    fn a_tiny_temperature_is_greedy() {
        let logits = [0.5f32, 3.0, 1.0, -2.0];
        for t in [0.0f32, 1e-40, 1e-30, 1e-6] {
            let p = params(t, 0, 1.0);
            assert!(p.validate().is_ok() && p.is_greedy(), "{t}");
        }
        let p = params(1e-4, 0, 1.0);
        assert!(!p.is_greedy());
        let pr = probs(&logits, &[], &p);
        assert!(pr.iter().all(|x| x.is_finite()), "{pr:?}");
        assert_eq!(argmax(&pr), 1);
    }

    #[test]
    fn greedy_ties_go_to_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn argmax_matches_the_one_pass_scan() {
        let mut rng = crate::rng::Rng::new(7);
        // Few distinct values (ties everywhere), NaN, ±∞ and ±0, lengths around the block.
        let pool = [
            -1.0f32,
            0.5,
            2.0,
            0.0,
            -0.0,
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
        ];
        let lens = (0..70).chain([255, 256, 257, 49_152, 151_936]);
        for n in lens {
            for trial in 0..20 {
                // Some trials draw from a smaller pool: all NaN / −∞, or no +∞.
                let k = [8, 7, 2, 5, 3][trial % 5];
                let x: Vec<f32> = (0..n)
                    .map(|_| match k {
                        2 => pool[5 + rng.below(2)],
                        _ => pool[rng.below(k)],
                    })
                    .collect();
                assert_eq!(argmax(&x), argmax_scan(&x), "{x:?}");
                // A unique maximum anywhere.
                let mut y: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
                if n > 0 {
                    y[rng.below(n)] = 100.0;
                }
                assert_eq!(argmax(&y), argmax_scan(&y));
            }
        }
    }

    #[test]
    fn top_k_and_top_p_keep_the_right_sets() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let pr = probs(&logits, &[], &params(1.0, 2, 1.0));
        assert_eq!(pr[0], 0.0);
        assert_eq!(pr[1], 0.0);
        assert!((pr[2] + pr[3] - 1.0).abs() < 1e-6 && pr[3] > pr[2]);
        // Softmax of 0..3 ≈ [0.032, 0.087, 0.237, 0.644]: top_p 0.7 keeps {3, 2}.
        let pr = probs(&logits, &[], &params(1.0, 0, 0.7));
        assert!(pr[0] == 0.0 && pr[1] == 0.0 && pr[2] > 0.0);
        let pr = probs(&logits, &[], &params(1.0, 0, 0.5));
        assert_eq!(pr[3], 1.0);
    }

    #[test]
    fn sampling_frequencies_follow_probs() {
        let pr = [0.1f32, 0.2, 0.3, 0.4];
        let mut rng = Rng::new(11);
        let mut c = [0usize; 4];
        let n = 200_000;
        for _ in 0..n {
            c[sample(&pr, &mut rng) as usize] += 1;
        }
        for i in 0..4 {
            assert!((c[i] as f64 / n as f64 - pr[i] as f64).abs() < 0.005);
        }
    }

    #[test]
    fn softmax_over_a_large_vocabulary_matches_the_f64_reference() {
        // Sizes that cover the 256-element blocks, the 16-lane chunks and a remainder.
        let mut rng = Rng::new(21);
        for &(n, t) in &[(49_152usize, 1.0f32), (8_195, 0.7), (300, 1.3), (17, 1.0)] {
            let mut logits: Vec<f32> = (0..n).map(|_| 4.0 * rng.normal() as f32).collect();
            logits[n / 2] = f32::NAN;
            logits[n / 3] = f32::NEG_INFINITY;
            let pr = probs(&logits, &[], &params(t, 0, 1.0));
            let max = logits
                .iter()
                .filter(|v| !v.is_nan())
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            // The exponential's argument rounded to f32 as `probs` rounds it (the old libm path
            // did too): what is compared is the exponential and the sums.
            let (maxf, inv_t) = (max as f32, 1.0 / t);
            let e: Vec<f64> = logits
                .iter()
                .map(|&v| {
                    if v.is_nan() {
                        0.0
                    } else {
                        (((v - maxf) * inv_t) as f64).exp()
                    }
                })
                .collect();
            let z: f64 = e.iter().sum();
            for (i, (&got, &want)) in pr.iter().zip(&e).enumerate() {
                let want = want / z;
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * want + 1e-12,
                    "n {n} t {t} i {i}: {got} vs {want}"
                );
            }
            assert_eq!(pr[n / 2], 0.0);
            assert_eq!(pr[n / 3], 0.0);
        }
        // Every logit −∞: no distribution (NaN), as before the vectorized path.
        let pr = probs(&[f32::NEG_INFINITY; 40], &[], &params(1.0, 0, 1.0));
        assert!(pr.iter().all(|v| v.is_nan()));
    }

    #[test]
    fn sampling_over_many_blocks_follows_probs() {
        // Mass in a few tokens spread over blocks of the scan (one of them in the remainder
        // block), whole blocks empty between them, and a tail of tiny probabilities.
        let n = 3 * SCAN_BLOCK + 37;
        let mut pr = vec![0f32; n];
        let heavy = [(5usize, 0.2f32), (SCAN_BLOCK + 1, 0.3), (n - 2, 0.4)];
        for &(i, v) in &heavy {
            pr[i] = v;
        }
        let tail = 0.1 / 100.0;
        for i in 0..100 {
            pr[2 * SCAN_BLOCK + 3 + i] = tail;
        }
        let mut rng = Rng::new(12);
        let draws = 200_000;
        let mut c = vec![0usize; n];
        for _ in 0..draws {
            c[sample(&pr, &mut rng) as usize] += 1;
        }
        for &(i, v) in &heavy {
            assert!(
                (c[i] as f64 / draws as f64 - v as f64).abs() < 0.005,
                "token {i}"
            );
        }
        let tail_hits: usize = c[2 * SCAN_BLOCK + 3..2 * SCAN_BLOCK + 103].iter().sum();
        assert!((tail_hits as f64 / draws as f64 - 0.1).abs() < 0.005);
        let elsewhere: usize =
            c.iter().sum::<usize>() - tail_hits - heavy.iter().map(|h| c[h.0]).sum::<usize>();
        assert_eq!(elsewhere, 0, "a token of probability 0 was drawn");
        // A block's mass must be what the walk through it adds up (else the difference goes to
        // the block's last token, or away from the next block's first): here f32 partial sums
        // were 4·10⁻⁷ off, 400,000 times token 255's probability.
        let mut edge = vec![0f32; 2 * SCAN_BLOCK];
        edge[0] = 0.5;
        for k in 1..16 {
            edge[16 * k] = 3e-8;
        }
        edge[SCAN_BLOCK - 1] = 1e-12;
        edge[SCAN_BLOCK] = 0.5;
        for b in edge.chunks(SCAN_BLOCK) {
            let walk: f64 = b.iter().map(|&v| v as f64).sum();
            assert!((positive_mass(b) - walk).abs() <= 1e-15 * walk);
        }
        // Only the last token has mass; none has any.
        let mut last = vec![0f32; n];
        last[n - 1] = 1e-30;
        assert_eq!(sample(&last, &mut rng), (n - 1) as u32);
        assert_eq!(sample(&vec![0f32; n], &mut rng), 0);
    }

    #[test]
    fn an_infinite_logit_takes_all_the_mass() {
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let inf = f32::INFINITY;
        assert_eq!(probs(&[0.0, inf, 3.0, -inf], &[], &p), [0.0, 1.0, 0.0, 0.0]);
        assert_eq!(probs(&[inf, 1.0, inf], &[], &p), [0.5, 0.0, 0.5]);
        let mut rng = Rng::new(3);
        assert_eq!(sample(&probs(&[0.0, 2.0, inf], &[], &p), &mut rng), 2);
    }

    #[test]
    fn penalties_lower_seen_tokens() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            ..Default::default()
        };
        let mut l = [2.0f32, -2.0, 1.0];
        apply_penalties(&mut l, &[0, 1, 1], &p);
        assert_eq!(l, [0.5, -4.5, 1.0]);
        // Presence and frequency count the output only (from `output_from`); the repetition
        // penalty counts the prompt too. Prompt [0, 0, 2], output [1, 2, 2].
        let mut p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        p.count_output_from(3);
        let mut l = [2.0f32, 2.0, 2.0, 2.0];
        apply_penalties(&mut l, &[0, 0, 2, 1, 2, 2], &p);
        assert_eq!(l, [1.0, 1.0 - 0.75, 1.0 - 1.0, 2.0]);
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        // Softmax of 0..3 ≈ [0.032, 0.087, 0.237, 0.644]; 0.2 × 0.644 = 0.129 keeps {2, 3}.
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.2,
            ..Default::default()
        };
        let pr = probs(&[0.0, 1.0, 2.0, 3.0], &[], &p);
        assert_eq!((pr[0], pr[1]), (0.0, 0.0));
        assert!((pr[2] + pr[3] - 1.0).abs() < 1e-6);
        assert!((pr[3] / pr[2] - 1f32.exp()).abs() < 1e-4);
        // min_p 1 keeps only the best; 0 keeps everything.
        let only = probs(
            &[0.0, 1.0, 2.0, 3.0],
            &[],
            &SamplingParams {
                min_p: 1.0,
                ..p.clone()
            },
        );
        assert_eq!(only, vec![0.0, 0.0, 0.0, 1.0]);
        let all = probs(
            &[0.0, 1.0, 2.0, 3.0],
            &[],
            &SamplingParams { min_p: 0.0, ..p },
        );
        assert!(all.iter().all(|&v| v > 0.0));
    }

    #[test]
    fn logit_bias_moves_greedy_and_sampled_choices() {
        let mut p = SamplingParams::greedy();
        p.set_logit_bias([(0, 5.0), (3, -100.0), (0, 4.0)]);
        assert_eq!(p.logit_bias, vec![(0, 4.0), (3, -100.0)]);
        assert!(p.validate().is_ok() && p.shapes_logits());
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        // 0 + 4 beats 2; 3 − 100 is out.
        let mut rng = Rng::new(1);
        assert_eq!(sample_logits(&logits, &[], &p, &mut rng), 0);
        p.temperature = 1.0;
        let pr = probs(&logits, &[], &p);
        assert!(pr[3] < 1e-40 && pr[0] > pr[2]);
        assert!(p.validate_vocab(4).is_ok());
        assert!(p.validate_vocab(3).is_err());
        p.set_logit_bias([(1, 100.5)]);
        assert!(p.validate().is_err());
        p.set_logit_bias([(1, f32::NAN)]);
        assert!(p.validate().is_err());
        p.logit_bias = vec![(2, 1.0), (1, 1.0)];
        assert!(p.validate().is_err(), "unsorted");
    }

    #[test]
    fn end_tokens_are_held_back_until_min_tokens() {
        let mut p = SamplingParams::greedy();
        p.hold_end_tokens(2, 3, &[3, 3]);
        assert_eq!((p.hold_until, p.held_ids.clone()), (5, vec![3]));
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let mut rng = Rng::new(1);
        // Prompt of 2 and 0..2 outputs: 3 is held; with 3 outputs it is free again.
        for n in 2..5 {
            let seen = vec![7u32; n];
            assert_eq!(
                sample_logits(&logits, &seen, &p, &mut rng),
                2,
                "context {n}"
            );
        }
        assert_eq!(sample_logits(&logits, &[7; 5], &p, &mut rng), 3);
        p.temperature = 1.0;
        assert_eq!(probs(&logits, &[7; 4], &p)[3], 0.0);
        assert!(probs(&logits, &[7; 5], &p)[3] > 0.5);
        p.hold_end_tokens(2, 0, &[3]);
        assert!(p.hold_until == 0 && p.held_ids.is_empty() && !p.shapes_logits());
        // As many as a caller may ask for: held for good, not wrapped to a few tokens.
        p.hold_end_tokens(2, usize::MAX, &[3]);
        assert_eq!(p.hold_until, usize::MAX);
    }

    #[test]
    fn validation_rejects_bad_min_p() {
        for m in [-0.1f32, 1.5, f32::NAN] {
            let p = SamplingParams {
                min_p: m,
                ..Default::default()
            };
            assert!(p.validate().is_err(), "{m}");
        }
    }
}
