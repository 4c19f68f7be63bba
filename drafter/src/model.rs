//! DSpark drafter model on candle tensors (used for training with autograd and for drafting).
//!
//! Block of γ positions `[anchor, mask, …, mask]`; each drafter layer's queries are the block,
//! its keys/values are the projected target context features followed by the block itself (the
//! block attends to the context and to each other, bidirectionally: one forward drafts the whole
//! block). `base_k = head(norm(h_k))` with the target's frozen head; the Markov head adds
//! `W1[x_{k−1}]·W2` (rank r, x_0 = anchor); confidence `c_k = σ(w·[h_k; W1[x_{k−1}]] + b)` never
//! sees x_k. Sequential Temperature Scaling divides position k's confidence logit by T_k.

use crate::{DrafterError, Result};
use candle_core::{D, DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder, VarMap, linear_no_bias};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DrafterConfig {
    /// Identity of the target this drafter belongs to.
    pub target_arch: String,
    pub target_vocab_hash: String,
    pub target_layers: usize,
    /// Target layers whose hidden states are the context features (low, middle, high).
    pub feature_layers: Vec<usize>,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    /// Block length the drafter was trained for.
    pub gamma: usize,
    /// Markov head rank (0 = parallel-only ablation).
    pub rank: usize,
    /// Context features attended to (most recent committed positions).
    pub context: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    /// Per-position confidence temperatures (Sequential Temperature Scaling), 1.0 = uncalibrated.
    pub sts: Vec<f32>,
    /// Per-position logit shifts fitted with the temperatures (empty = 0): c = σ(z/T − s).
    #[serde(default)]
    pub sts_shift: Vec<f32>,
    /// Whether the base logits and the parallel-only confidence head were trained (auxiliary
    /// loss), so the parallel-only ablation of this checkpoint means something.
    #[serde(default)]
    pub parallel_trained: bool,
    /// Per-position mix of the confidence inputs before STS (head logit, log-odds of max p_d,
    /// entropy of p_d, log-odds of the request's running acceptance, bias); empty = the head's
    /// logit alone. Fitted by `dspark calibrate-drafter`.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "crate::calibrate::de_mixes"
    )]
    pub conf_mix: Vec<crate::calibrate::Mix>,
    /// The copy prior for sampled requests: per suffix-match length (1, 2, …, the last entry
    /// for that length and longer), the logit bonus of the token that followed the longest
    /// earlier occurrence of the drafted sequence's suffix ([`specdec::proposer::suffix_match`]).
    /// Fitted by `dspark calibrate-drafter`; empty = no copy prior.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_bias: Vec<f32>,
    /// The calibration for greedy requests, whose acceptance (argmax agreement) is not the coin
    /// flip of sampled acceptance and follows the drafter's certainty much more closely. The
    /// fields above serve sampled requests, and greedy ones when this is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub greedy_calibration: Option<CalibrationCfg>,
    /// Size of the draft vocabulary (0 = the target's whole vocabulary): the drafter proposes
    /// only the most frequent tokens (`draft_vocab.json`, most frequent first), so its head
    /// reads a fraction of the target's. Lossless either way: verification corrects any q.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub draft_vocab: usize,
    /// Bits per weight of the serving forward's matrices (context fuse, layers, draft head):
    /// 8 (GGUF Q8_0 blocks) or 4 (Q4_1 blocks, 0.625 bytes a weight against 1.06). A drafting
    /// call streams these weights from memory after every target forward has evicted them, so
    /// its cost follows their bytes. Training and the candle forward stay in f32.
    #[serde(default = "eight", skip_serializing_if = "is_eight")]
    pub serve_bits: u8,
    /// Hashes ([`prompt_hash`]) of the prompts `dspark calibrate-drafter` fitted on, either
    /// kind of request: `dspark eval-drafter` refuses to report held-out figures on them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calibration_prompts: Vec<u64>,
}

/// A prompt's identity for [`DrafterConfig::calibration_prompts`]: FNV-1a over its UTF-8
/// bytes (stable across builds and platforms, unlike the standard library's hasher).
pub fn prompt_hash(prompt: &str) -> u64 {
    prompt.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn eight() -> u8 {
    8
}

fn is_eight(n: &u8) -> bool {
    *n == 8
}

/// A stored calibration: STS temperatures and shifts, and the input mix before them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CalibrationCfg {
    pub sts: Vec<f32>,
    #[serde(default)]
    pub sts_shift: Vec<f32>,
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "crate::calibrate::de_mixes"
    )]
    pub conf_mix: Vec<crate::calibrate::Mix>,
    /// The copy prior (see [`DrafterConfig::copy_bias`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_bias: Vec<f32>,
    /// Copy runs (greedy only): per match length L = 1.., how often the token that followed
    /// the suffix's earlier occurrence was the one committed, on the calibration prompts.
    /// Where it is at least [`crate::proposer::COPY_RUN_MIN`], the proposer drafts the copy
    /// without running the network (whose output the copy prior decides there anyway), with
    /// this rate as the confidence unless `copy_head` is set. Empty: no copy runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copy_runs: Vec<f32>,
    /// A confidence head of greedy requests' own (see [`GreedyHead`]); None: the trained one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<GreedyHead>,
    /// Confidences of copy runs: a logistic regression over
    /// [`crate::proposer::copy_inputs`] with one bias per block position (same shape as
    /// [`GreedyHead`]); None: the match length's rate in `copy_runs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_head: Option<GreedyHead>,
    /// The input set `copy_head` was fitted over ([`crate::proposer::COPY_HEAD_SPEC`]; absent:
    /// "copy-v1", the only set before the tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_head_inputs: Option<String>,
}

/// A confidence head fitted for greedy requests by `dspark calibrate-drafter`: a logistic
/// regression of "the target's argmax is the drafted token" on the trained head's own inputs,
/// z_k = w·[h_k; W1[x_{k−1}]] + bias_k, never a function of x_k. The trained head learns
/// 1 − TV of the sampled distributions; greedy acceptance is argmax agreement, another event,
/// and a head fitted on it ranks greedy positions better (held-out greedy math, network
/// positions: ROC-AUC 0.762 → 0.774 in the experiment that chose it). Its logit replaces the
/// trained head's as the first confidence input of greedy requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GreedyHead {
    /// Weights over [h_k; W1[x_{k−1}]] (d_model + rank; the parallel-only drafter drops the
    /// head). The same shape serves as the copy-run head ([`CalibrationCfg::copy_head`]), over
    /// [`crate::proposer::copy_inputs`].
    pub w: Vec<f32>,
    /// One bias per block position.
    pub bias: Vec<f32>,
}

impl GreedyHead {
    /// The logit at block position `k` (0-based) from h_k and, with the Markov head, the W1
    /// row of x_{k−1}; None when the widths are not the head's.
    pub fn logit(&self, h: &[f32], e: Option<&[f32]>, k: usize) -> Option<f32> {
        let e = e.unwrap_or(&[]);
        if h.len() + e.len() != self.w.len() {
            return None;
        }
        let dot: f32 = self
            .w
            .iter()
            .zip(h.iter().chain(e))
            .map(|(a, b)| a * b)
            .sum();
        Some(dot + self.bias.get(k).copied()?)
    }

    /// Weights then biases, as a draft worker publishes a copy-run head (see
    /// [`GreedyHead::from_flat`]).
    pub fn flat(&self) -> Vec<f32> {
        self.w.iter().chain(&self.bias).copied().collect()
    }

    /// A head of `inputs` weights from [`GreedyHead::flat`]'s layout; None when there is no
    /// bias after them or a number is not finite.
    pub fn from_flat(flat: &[f32], inputs: usize) -> Option<Self> {
        if flat.len() <= inputs || flat.iter().any(|x| !x.is_finite()) {
            return None;
        }
        Some(Self {
            w: flat[..inputs].to_vec(),
            bias: flat[inputs..].to_vec(),
        })
    }
}

impl CalibrationCfg {
    pub fn sts(&self) -> crate::calibrate::Sts {
        crate::calibrate::Sts::new(&self.sts, &self.sts_shift).with_mix(&self.conf_mix)
    }

    pub fn from_sts(s: &crate::calibrate::Sts) -> Self {
        Self {
            sts: s.temps.clone(),
            sts_shift: s.shifts.clone(),
            conf_mix: s.mix.clone(),
            ..Default::default()
        }
    }

    fn validate(&self, gamma: usize) -> Result<()> {
        if self.sts.len() != gamma {
            return Err(DrafterError::Invalid(
                "one STS temperature per block position".into(),
            ));
        }
        if !self.sts_shift.is_empty() && self.sts_shift.len() != gamma {
            return Err(DrafterError::Invalid(
                "one STS shift per block position (or none)".into(),
            ));
        }
        if !self.conf_mix.is_empty() && self.conf_mix.len() != gamma {
            return Err(DrafterError::Invalid(
                "one confidence mix per block position (or none)".into(),
            ));
        }
        if self
            .sts
            .iter()
            .chain(&self.sts_shift)
            .chain(self.conf_mix.iter().flatten())
            .any(|x| !x.is_finite())
            || self.sts.iter().any(|&t| t <= 0.0)
        {
            return Err(DrafterError::Invalid(
                "STS temperatures must be positive, shifts and mixes finite".into(),
            ));
        }
        if self.copy_bias.len() > crate::proposer::COPY_MAX_MATCH
            || self.copy_bias.iter().any(|b| !b.is_finite() || *b < 0.0)
        {
            return Err(DrafterError::Invalid(format!(
                "the copy prior takes at most {} finite, non-negative biases",
                crate::proposer::COPY_MAX_MATCH
            )));
        }
        if self.copy_runs.len() > crate::proposer::COPY_MAX_MATCH
            || self.copy_runs.iter().any(|p| !(0.0..=1.0).contains(p))
        {
            return Err(DrafterError::Invalid(format!(
                "copy runs take at most {} rates in [0, 1]",
                crate::proposer::COPY_MAX_MATCH
            )));
        }
        if let Some(h) = &self.head
            && (h.bias.len() != gamma || h.w.iter().chain(&h.bias).any(|x| !x.is_finite()))
        {
            return Err(DrafterError::Invalid(
                "a greedy confidence head needs finite weights and one bias per block position"
                    .into(),
            ));
        }
        if let Some(h) = &self.copy_head
            && (h.w.len() != crate::proposer::COPY_HEAD_INPUTS
                || h.bias.len() != gamma
                || h.w.iter().chain(&h.bias).any(|x| !x.is_finite()))
        {
            return Err(DrafterError::Invalid(format!(
                "a copy-run head needs {} finite weights and one bias per block position",
                crate::proposer::COPY_HEAD_INPUTS
            )));
        }
        let tag = self.copy_head_inputs.as_deref();
        if self.copy_head.is_some() && !crate::proposer::copy_head_is_ours(tag) {
            return Err(DrafterError::Invalid(format!(
                "the copy-run head was fitted over inputs {:?}, this release computes {:?}",
                crate::proposer::copy_head_spec(tag),
                crate::proposer::COPY_HEAD_SPEC
            )));
        }
        Ok(())
    }
}

impl DrafterConfig {
    /// The fitted confidence calibration for sampled requests (input mix, temperatures and
    /// shifts).
    pub fn calibration(&self) -> crate::calibrate::Sts {
        self.sampled_calibration().sts()
    }

    /// The calibration for greedy (`true`) or sampled requests.
    pub fn calibration_for(&self, greedy: bool) -> crate::calibrate::Sts {
        match (&self.greedy_calibration, greedy) {
            (Some(g), true) => g.sts(),
            _ => self.calibration(),
        }
    }

    /// The sampled-request calibration as a stored block.
    pub fn sampled_calibration(&self) -> CalibrationCfg {
        CalibrationCfg {
            sts: self.sts.clone(),
            sts_shift: self.sts_shift.clone(),
            conf_mix: self.conf_mix.clone(),
            copy_bias: self.copy_bias.clone(),
            ..Default::default()
        }
    }

    /// The copy prior of greedy (`true`) or sampled requests (empty: none).
    pub fn copy_bias_for(&self, greedy: bool) -> &[f32] {
        match (&self.greedy_calibration, greedy) {
            (Some(g), true) => &g.copy_bias,
            _ => &self.copy_bias,
        }
    }

    /// Per match length, the acceptance rate of a copied token for greedy requests (empty:
    /// no copy runs; see [`CalibrationCfg::copy_runs`]).
    pub fn copy_runs(&self) -> &[f32] {
        self.greedy_calibration
            .as_ref()
            .map_or(&[], |g| g.copy_runs.as_slice())
    }

    /// Removes a copy-run head fitted over other inputs than [`crate::proposer::copy_inputs`]
    /// computes (another release's), so that the rates serve; returns its tag.
    pub fn drop_foreign_copy_head(&mut self) -> Option<String> {
        let g = self.greedy_calibration.as_mut()?;
        let tag = g.copy_head_inputs.as_deref();
        if g.copy_head.is_none() || crate::proposer::copy_head_is_ours(tag) {
            return None;
        }
        let spec = crate::proposer::copy_head_spec(tag).to_string();
        g.copy_head = None;
        g.copy_head_inputs = None;
        Some(spec)
    }

    /// The copy runs' confidence head (None: their rates; see [`CalibrationCfg::copy_head`]).
    pub fn copy_head(&self) -> Option<&GreedyHead> {
        self.greedy_calibration
            .as_ref()
            .and_then(|g| g.copy_head.as_ref())
    }

    /// Without the copy prior (the ablation, and the drafts its fit is measured on).
    pub fn without_copy(mut self) -> Self {
        self.copy_bias.clear();
        if let Some(g) = self.greedy_calibration.as_mut() {
            g.copy_bias.clear();
            g.copy_runs.clear();
            g.copy_head = None;
            g.copy_head_inputs = None;
        }
        self
    }

    /// Sets the copy prior of greedy (`true`) or sampled requests, leaving the other's alone
    /// (greedy requests without a calibration of their own are given one, a copy of the
    /// sampled one).
    pub fn set_copy_bias(&mut self, greedy: bool, bias: Vec<f32>) {
        if greedy {
            let sampled = self.sampled_calibration();
            self.greedy_calibration.get_or_insert(sampled).copy_bias = bias;
        } else {
            self.copy_bias = bias;
        }
    }

    /// Stores a fitted calibration for greedy or sampled requests.
    pub fn set_calibration(&mut self, greedy: bool, c: CalibrationCfg) {
        if greedy {
            self.greedy_calibration = Some(c);
        } else {
            self.sts = c.sts;
            self.sts_shift = c.sts_shift;
            self.conf_mix = c.conf_mix;
            self.copy_bias = c.copy_bias;
        }
    }

    /// Drops every confidence calibration: confidences become σ(head logit). The copy prior,
    /// which shapes the drafts rather than their confidences, is kept for each kind of request.
    pub fn uncalibrated(mut self) -> Self {
        let greedy_copy = self.copy_bias_for(true).to_vec();
        self.sts = vec![1.0; self.gamma];
        self.sts_shift = Vec::new();
        self.conf_mix = Vec::new();
        self.greedy_calibration = (greedy_copy != self.copy_bias).then(|| CalibrationCfg {
            sts: vec![1.0; self.gamma],
            copy_bias: greedy_copy,
            ..Default::default()
        });
        self
    }

    /// Drops the confidence calibration of greedy (`true`) or sampled requests, keeping the
    /// other kind's and each kind's copy prior (what [`Self::uncalibrated`] does for both): for
    /// when the forward it was fitted on changes (`dspark calibrate-drafter --serve-bits`).
    /// Greedy requests without a calibration of their own read the sampled one (so dropping the
    /// sampled one drops theirs too). Returns whether a fitted calibration was dropped.
    pub fn drop_calibration(&mut self, greedy: bool) -> bool {
        if greedy {
            let Some(g) = self.greedy_calibration.take() else {
                return false;
            };
            let fitted = g.sts.iter().any(|&t| t != 1.0)
                || !g.sts_shift.is_empty()
                || !g.conf_mix.is_empty()
                || g.head.is_some()
                || !g.copy_runs.is_empty()
                || g.copy_head.is_some();
            // Greedy requests read the sampled calibration again, with their own copy prior.
            if g.copy_bias != self.copy_bias {
                self.set_copy_bias(true, g.copy_bias);
            }
            fitted
        } else {
            let fitted = self.sts.iter().any(|&t| t != 1.0)
                || !self.sts_shift.is_empty()
                || !self.conf_mix.is_empty();
            self.sts = vec![1.0; self.gamma];
            self.sts_shift = Vec::new();
            self.conf_mix = Vec::new();
            fitted
        }
    }

    /// Defaults for a target: features from layers n/6, n/2 and n−2, one layer at the target's
    /// width, rank min(256, vocab/64).
    pub fn for_target(
        cfg: &dspark_runtime::ModelConfig,
        vocab_hash: &str,
        gamma: usize,
        layers: usize,
        rank: usize,
    ) -> Self {
        let n = cfg.n_layers;
        Self {
            target_arch: cfg.arch.name().to_string(),
            target_vocab_hash: vocab_hash.to_string(),
            target_layers: n,
            feature_layers: vec![n / 6, n / 2, n.saturating_sub(2)],
            d_model: cfg.d_model,
            n_layers: layers,
            n_heads: cfg.n_heads,
            ffn_dim: cfg.ffn_dim,
            vocab: cfg.vocab_size,
            gamma,
            rank,
            context: 32,
            rms_eps: cfg.rms_eps as f64,
            rope_theta: 10000.0,
            sts: vec![1.0; gamma],
            sts_shift: Vec::new(),
            parallel_trained: false,
            conf_mix: Vec::new(),
            copy_bias: Vec::new(),
            greedy_calibration: None,
            draft_vocab: 0,
            serve_bits: 8,
            calibration_prompts: Vec::new(),
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.gamma == 0 || self.gamma > 32 {
            return Err(DrafterError::Invalid(format!(
                "gamma {} out of range 1..=32",
                self.gamma
            )));
        }
        // Bounds far past any drafter here: the sizes come from a JSON file and size the
        // model's variables before the weights are read.
        for (what, v, lo, hi) in [
            ("d_model", self.d_model, 1, 1 << 16),
            ("n_layers", self.n_layers, 1, 64),
            ("n_heads", self.n_heads, 1, 1024),
            ("ffn_dim", self.ffn_dim, 1, 1 << 18),
            ("vocab", self.vocab, 1, 1 << 22),
            ("rank", self.rank, 0, 4096),
            ("context", self.context, 1, 1 << 20),
        ] {
            if !(lo..=hi).contains(&v) {
                return Err(DrafterError::Invalid(format!(
                    "{what} {v} out of range {lo}..={hi}"
                )));
            }
        }
        if self.d_model % self.n_heads != 0 || (self.d_model / self.n_heads) % 2 != 0 {
            return Err(DrafterError::Invalid(
                "d_model must split into even-width heads".into(),
            ));
        }
        // The rotary tables (cos and sin, (context + γ) × head width / 2 each) are built from
        // these sizes alone, before any weight is read.
        let rope = (self.context + self.gamma).saturating_mul(self.d_model / self.n_heads / 2);
        if rope > MAX_ROPE_ENTRIES {
            return Err(DrafterError::Invalid(format!(
                "context {} at a head width of {} needs rotary tables of {rope} entries (at \
                 most {MAX_ROPE_ENTRIES})",
                self.context,
                self.d_model / self.n_heads
            )));
        }
        if self.feature_layers.is_empty()
            || self.feature_layers.iter().any(|&l| l >= self.target_layers)
        {
            return Err(DrafterError::Invalid(
                "feature layers must be target layers".into(),
            ));
        }
        if !matches!(self.serve_bits, 4 | 8) {
            return Err(DrafterError::Invalid(format!(
                "serve_bits {} is not 4 or 8",
                self.serve_bits
            )));
        }
        self.sampled_calibration().validate(self.gamma)?;
        if let Some(g) = &self.greedy_calibration {
            g.validate(self.gamma)?;
            let width = self.d_model + self.rank;
            if let Some(h) = &g.head
                && h.w.len() != width
            {
                return Err(DrafterError::Invalid(format!(
                    "the greedy confidence head has {} weights, this drafter's head inputs are {width} wide",
                    h.w.len()
                )));
            }
        }
        Ok(())
    }
}

/// Entries of each rotary table (cos, sin) a drafter may have: 256 MiB each, far past any
/// context a drafter attends to.
const MAX_ROPE_ENTRIES: usize = 1 << 26;

/// Largest safetensors header read (as the `safetensors` crate allows).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// The name and shape of every variable [`DsparkDrafter::build`] makes for `cfg` (a linear
/// layer's weight is out × in).
fn variable_shapes(cfg: &DrafterConfig) -> Vec<(String, Vec<usize>)> {
    let (d, f) = (cfg.d_model, cfg.ffn_dim);
    let mut v = vec![
        (
            "fuse.weight".to_string(),
            vec![d, cfg.feature_layers.len().saturating_mul(d)],
        ),
        ("mask".to_string(), vec![d]),
    ];
    for i in 0..cfg.n_layers {
        let p = format!("layer{i}");
        v.push((format!("{p}.n1"), vec![d]));
        for w in ["wq", "wk", "wv", "wo"] {
            v.push((format!("{p}.{w}.weight"), vec![d, d]));
        }
        v.push((format!("{p}.n2"), vec![d]));
        v.push((format!("{p}.gate.weight"), vec![f, d]));
        v.push((format!("{p}.up.weight"), vec![f, d]));
        v.push((format!("{p}.down.weight"), vec![d, f]));
    }
    v.push(("out_norm".to_string(), vec![d]));
    if cfg.rank > 0 {
        v.push(("markov.w1".to_string(), vec![cfg.vocab, cfg.rank]));
        v.push(("markov.w2".to_string(), vec![cfg.rank, cfg.vocab]));
    }
    v.push(("conf.weight".to_string(), vec![1, d + cfg.rank]));
    v.push(("conf.bias".to_string(), vec![1]));
    if cfg.rank > 0 {
        v.push(("conf_par.weight".to_string(), vec![1, d]));
        v.push(("conf_par.bias".to_string(), vec![1]));
    }
    v
}

/// Compares the variables `cfg` implies with the tensors the safetensors file at `path`
/// declares, reading its header alone (an 8-byte little-endian length, then JSON): every
/// variable present at its shape, and their bytes within the file's data. Run before the model
/// is built, so a corrupt drafter.json (a huge `ffn_dim` or depth) is refused instead of sizing
/// allocations (every variable, randomly initialised) the file could never fill.
fn check_checkpoint_shapes(cfg: &DrafterConfig, path: &Path) -> std::result::Result<(), String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|e| format!("no safetensors header ({e})"))?;
    let n = u64::from_le_bytes(n);
    let data = len.saturating_sub(8);
    if n > MAX_HEADER_BYTES || n > data {
        return Err(format!(
            "a safetensors header of {n} bytes in a file of {len} bytes"
        ));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|e| format!("safetensors header: {e}"))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| format!("safetensors header: {e}"))?;
    let data = data - n;
    let mut need: u64 = 0;
    for (name, shape) in variable_shapes(cfg) {
        let t = header
            .get(&name)
            .ok_or_else(|| format!("lacks `{name}` (drafter.json implies it)"))?;
        let dims: Option<Vec<u64>> = t
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect());
        let want: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
        if dims.as_ref() != Some(&want) {
            return Err(format!(
                "`{name}` has shape {}, drafter.json says {want:?}",
                t.get("shape")
                    .map_or_else(|| "none".to_string(), |s| s.to_string())
            ));
        }
        let width: u64 = match t.get("dtype").and_then(|d| d.as_str()).unwrap_or("") {
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
            "U16" | "I16" | "F16" | "BF16" => 2,
            "U32" | "I32" | "F32" => 4,
            "U64" | "I64" | "F64" => 8,
            other => return Err(format!("`{name}` has an unknown dtype {other:?}")),
        };
        let bytes = want.iter().fold(width, |acc, &x| acc.saturating_mul(x));
        need = need.saturating_add(bytes);
    }
    if need > data {
        return Err(format!(
            "drafter.json implies {need} bytes of weights, the file holds {data}"
        ));
    }
    Ok(())
}

pub(crate) struct Layer {
    pub(crate) n1: Tensor,
    pub(crate) wq: Linear,
    pub(crate) wk: Linear,
    pub(crate) wv: Linear,
    pub(crate) wo: Linear,
    pub(crate) n2: Tensor,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

pub struct DsparkDrafter {
    pub cfg: DrafterConfig,
    pub varmap: VarMap,
    pub(crate) fuse: Linear,
    pub(crate) mask: Tensor,
    pub(crate) layers: Vec<Layer>,
    pub(crate) out_norm: Tensor,
    pub(crate) w1: Option<Tensor>,
    pub(crate) w2: Option<Tensor>,
    pub(crate) conf: Linear,
    /// Confidence head of the parallel-only variant (over h_k alone), trained beside `conf` so
    /// the ablation sharing this backbone has calibrated confidences too.
    pub(crate) conf_par: Option<Linear>,
    /// Draft without the Markov head (the parallel-only ablation of a Markov checkpoint).
    pub(crate) parallel_only: bool,
    /// Frozen target embedding and LM head, vocab × d.
    pub(crate) embed: Tensor,
    pub(crate) head: Tensor,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    /// Token ids the drafter may propose (most frequent first); None = all.
    pub draft_vocab: Option<Vec<u32>>,
}

/// Output of a block forward.
pub struct BlockOut {
    /// Drafter hidden after its final norm, B × γ × d.
    pub h: Tensor,
    /// Base logits (no Markov bias), B × γ × V.
    pub base: Tensor,
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

impl DsparkDrafter {
    /// A freshly initialized drafter (seeded) for a target whose embedding and head are given.
    pub fn new(cfg: DrafterConfig, embed: Tensor, head: Tensor, seed: u64) -> Result<Self> {
        cfg.validate()?;
        let varmap = VarMap::new();
        let m = Self::build(cfg, &varmap, embed, head)?;
        reseed(&varmap, seed)?;
        Ok(Self { varmap, ..m })
    }

    fn build(cfg: DrafterConfig, varmap: &VarMap, embed: Tensor, head: Tensor) -> Result<Self> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        let d = cfg.d_model;
        let ones = |vb: VarBuilder<'_>, n: usize, name: &str| {
            vb.get_with_hints(n, name, candle_nn::Init::Const(1.0))
        };
        let nf = cfg.feature_layers.len();
        let fuse = linear_no_bias(nf * d, d, vb.pp("fuse"))?;
        let mask = vb.get_with_hints(
            d,
            "mask",
            candle_nn::Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        let mut layers = Vec::new();
        for i in 0..cfg.n_layers {
            let v = vb.pp(format!("layer{i}"));
            layers.push(Layer {
                n1: ones(v.clone(), d, "n1")?,
                wq: linear_no_bias(d, d, v.pp("wq"))?,
                wk: linear_no_bias(d, d, v.pp("wk"))?,
                wv: linear_no_bias(d, d, v.pp("wv"))?,
                wo: linear_no_bias(d, d, v.pp("wo"))?,
                n2: ones(v.clone(), d, "n2")?,
                gate: linear_no_bias(d, cfg.ffn_dim, v.pp("gate"))?,
                up: linear_no_bias(d, cfg.ffn_dim, v.pp("up"))?,
                down: linear_no_bias(cfg.ffn_dim, d, v.pp("down"))?,
            });
        }
        let out_norm = ones(vb.clone(), d, "out_norm")?;
        let (w1, w2) = if cfg.rank > 0 {
            (
                Some(vb.get_with_hints(
                    (cfg.vocab, cfg.rank),
                    "markov.w1",
                    candle_nn::Init::Randn {
                        mean: 0.0,
                        stdev: 0.02,
                    },
                )?),
                Some(vb.get_with_hints(
                    (cfg.rank, cfg.vocab),
                    "markov.w2",
                    candle_nn::Init::Const(0.0),
                )?),
            )
        } else {
            (None, None)
        };
        let conf = candle_nn::linear(d + cfg.rank, 1, vb.pp("conf"))?;
        let conf_par = if cfg.rank > 0 {
            Some(candle_nn::linear(d, 1, vb.pp("conf_par"))?)
        } else {
            None
        };
        let hd = d / cfg.n_heads;
        let max_pos = cfg.context + cfg.gamma;
        let inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_pos * hd / 2);
        let mut sin = Vec::with_capacity(max_pos * hd / 2);
        for p in 0..max_pos {
            for f in &inv {
                cos.push((p as f32 * f).cos());
                sin.push((p as f32 * f).sin());
            }
        }
        let cos = Tensor::from_vec(cos, (max_pos, hd / 2), &Device::Cpu)?;
        let sin = Tensor::from_vec(sin, (max_pos, hd / 2), &Device::Cpu)?;
        Ok(Self {
            cfg,
            varmap: varmap.clone(),
            fuse,
            mask,
            layers,
            out_norm,
            w1,
            w2,
            conf,
            conf_par,
            parallel_only: false,
            embed,
            head,
            cos,
            sin,
            draft_vocab: None,
        })
    }

    /// Trainable parameter count.
    pub fn num_params(&self) -> usize {
        self.varmap.all_vars().iter().map(|v| v.elem_count()).sum()
    }

    /// The parallel-only ablation of this checkpoint: same backbone, no Markov head, its own
    /// confidence head. A rank-0 checkpoint is parallel-only already.
    pub fn into_parallel(mut self) -> Result<Self> {
        if self.w1.is_some() && !self.cfg.parallel_trained {
            return Err(DrafterError::Invalid(
                "this checkpoint's parallel-only head was not trained (--parallel-weight 0)".into(),
            ));
        }
        self.parallel_only = true;
        // The greedy head reads W1 rows, which the parallel-only drafter has none of.
        if let Some(g) = self.cfg.greedy_calibration.as_mut() {
            g.head = None;
        }
        Ok(self)
    }

    /// The frozen embedding's row of token `t`.
    pub fn embed_row(&self, t: u32) -> Result<Vec<f32>> {
        Ok(self.embed.get(t as usize)?.to_vec1()?)
    }

    /// Whether drafting uses the Markov head.
    pub fn is_markov(&self) -> bool {
        !self.parallel_only && self.w1.is_some()
    }

    /// The frozen LM head (vocab × d).
    pub fn head(&self) -> &Tensor {
        &self.head
    }

    /// One parallel forward: `feats` B × C × (F·d) context features, `anchors` B token ids.
    pub fn block(&self, feats: &Tensor, anchors: &Tensor) -> Result<BlockOut> {
        let h = self.hidden(feats, anchors)?;
        let base = h.broadcast_matmul(&self.head.t()?)?;
        Ok(BlockOut { h, base })
    }

    /// The backbone: drafter hidden states after the final norm, B × γ × d.
    pub fn hidden(&self, feats: &Tensor, anchors: &Tensor) -> Result<Tensor> {
        self.hidden_fused(&self.fuse_context(feats)?, anchors)
    }

    /// Context rows B × C × (F·d) of target features → B × C × d. Row by row, so a serving
    /// drafter fuses each committed position once and keeps the result.
    pub fn fuse_context(&self, feats: &Tensor) -> Result<Tensor> {
        let (b, c, _) = feats.dims3()?;
        let d = self.cfg.d_model;
        // Each target layer's hidden state is RMS-normalized before fusing: residual streams carry
        // "massive activation" channels (~10⁴ in SmolLM2) that would otherwise swamp the fuse.
        let nf = self.cfg.feature_layers.len();
        let fr = feats.reshape((b, c, nf, d))?;
        let fr =
            fr.broadcast_div(&(fr.sqr()?.mean_keepdim(D::Minus1)? + self.cfg.rms_eps)?.sqrt()?)?;
        Ok(self.fuse.forward(&fr.reshape((b, c, nf * d))?)?)
    }

    /// [`Self::hidden`] from fused context rows (B × C × d, from [`Self::fuse_context`]).
    pub fn hidden_fused(&self, ctx: &Tensor, anchors: &Tensor) -> Result<Tensor> {
        let (b, c, _) = ctx.dims3()?;
        let g = self.cfg.gamma;
        let d = self.cfg.d_model;
        let nh = self.cfg.n_heads;
        let hd = d / nh;
        let a = self.embed.index_select(anchors, 0)?.unsqueeze(1)?; // B × 1 × d
        let mut x = if g > 1 {
            Tensor::cat(
                &[
                    a,
                    self.mask.reshape((1, 1, d))?.broadcast_as((b, g - 1, d))?,
                ],
                1,
            )?
        } else {
            a
        };
        let cos_q = self.cos.narrow(0, c, g)?;
        let sin_q = self.sin.narrow(0, c, g)?;
        let cos_k = self.cos.narrow(0, 0, c + g)?;
        let sin_k = self.sin.narrow(0, 0, c + g)?;
        for l in &self.layers {
            let xn = rms_norm(&x, &l.n1, self.cfg.rms_eps)?;
            let cn = rms_norm(ctx, &l.n1, self.cfg.rms_eps)?;
            let kv_in = Tensor::cat(&[cn, xn.clone()], 1)?; // B × (C+γ) × d
            let heads =
                |t: Tensor, n: usize| t.reshape((b, n, nh, hd))?.transpose(1, 2)?.contiguous();
            let q = heads(l.wq.forward(&xn)?, g)?;
            let k = heads(l.wk.forward(&kv_in)?, c + g)?;
            let v = heads(l.wv.forward(&kv_in)?, c + g)?;
            let q = candle_nn::rotary_emb::rope_slow(&q, &cos_q, &sin_q)?;
            let k = candle_nn::rotary_emb::rope_slow(&k, &cos_k, &sin_k)?;
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
            // `softmax_last_dim` is a fused op without a backward pass; this one trains wq and wk.
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, g, d))?;
            x = (x + l.wo.forward(&o)?)?;
            let xn = rms_norm(&x, &l.n2, self.cfg.rms_eps)?;
            let ff = (candle_nn::ops::silu(&l.gate.forward(&xn)?)? * l.up.forward(&xn)?)?;
            x = (x + l.down.forward(&ff)?)?;
        }
        Ok(rms_norm(&x, &self.out_norm, self.cfg.rms_eps)?)
    }

    /// Markov bias W1[prev]·W2 (B × γ × V) and W1[prev] (B × γ × r); `prev` B × γ token ids.
    pub fn markov(&self, prev: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        if self.parallel_only {
            return Ok(None);
        }
        self.markov_terms(prev)
    }

    /// W1 rows of the previous tokens (B × γ × r) when drafting with the Markov head.
    pub fn markov_rows(&self, prev: &Tensor) -> Result<Option<Tensor>> {
        match (&self.w1, self.parallel_only) {
            (Some(w1), false) => {
                let (b, g) = prev.dims2()?;
                Ok(Some(
                    w1.index_select(&prev.flatten_all()?, 0)?
                        .reshape((b, g, self.cfg.rank))?,
                ))
            }
            _ => Ok(None),
        }
    }

    /// W2 (r × V, row-major) when drafting with the Markov head.
    pub fn markov_w2(&self) -> Result<Option<Vec<f32>>> {
        match (&self.w2, self.parallel_only) {
            (Some(w2), false) => Ok(Some(w2.flatten_all()?.to_vec1()?)),
            _ => Ok(None),
        }
    }

    /// The Markov terms whatever the drafting variant (training supervises both variants).
    pub fn markov_terms(&self, prev: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
        self.markov_terms_cols(prev, None)
    }

    /// The Markov terms with the bias over the W2 columns `cols` only (a draft vocabulary).
    pub fn markov_terms_cols(
        &self,
        prev: &Tensor,
        cols: Option<&Tensor>,
    ) -> Result<Option<(Tensor, Tensor)>> {
        match (&self.w1, &self.w2) {
            (Some(w1), Some(w2)) => {
                let (b, g) = prev.dims2()?;
                let e = w1
                    .index_select(&prev.flatten_all()?, 0)?
                    .reshape((b, g, self.cfg.rank))?;
                let bias = match cols {
                    Some(c) => e.broadcast_matmul(&w2.index_select(c, 1)?)?,
                    None => e.broadcast_matmul(w2)?,
                };
                Ok(Some((bias, e)))
            }
            _ => Ok(None),
        }
    }

    /// Confidence logits (B × γ), before STS.
    pub fn conf_logits(&self, h: &Tensor, markov_e: Option<&Tensor>) -> Result<Tensor> {
        if self.parallel_only {
            if let Some(cp) = &self.conf_par {
                return self.conf_par_logits_with(cp, h);
            }
        }
        let inp = match markov_e {
            Some(e) => Tensor::cat(&[h, e], D::Minus1)?,
            None => h.clone(),
        };
        Ok(self.conf.forward(&inp)?.squeeze(D::Minus1)?)
    }

    /// Confidence logits of the parallel-only variant (B × γ), if this checkpoint has that head.
    pub fn conf_par_logits(&self, h: &Tensor) -> Result<Option<Tensor>> {
        match &self.conf_par {
            Some(cp) => Ok(Some(self.conf_par_logits_with(cp, h)?)),
            None => Ok(None),
        }
    }

    fn conf_par_logits_with(&self, cp: &Linear, h: &Tensor) -> Result<Tensor> {
        Ok(cp.forward(h)?.squeeze(D::Minus1)?)
    }

    /// Training forward with teacher forcing: logits B × γ × V and confidence logits B × γ.
    pub fn forward_train(
        &self,
        feats: &Tensor,
        anchors: &Tensor,
        prev: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let o = self.block(feats, anchors)?;
        let mk = self.markov(prev)?;
        let logits = match &mk {
            Some((bias, _)) => (&o.base + bias)?,
            None => o.base.clone(),
        };
        let conf = self.conf_logits(&o.h, mk.as_ref().map(|m| &m.1))?;
        Ok((logits, conf))
    }

    /// Saves weights (safetensors, f16: half the bytes, and the drafter's outputs are sampled
    /// from, not compared bit for bit) and config (JSON) into `dir`. Writes to a temporary file
    /// first so an interrupted save never leaves a corrupt checkpoint.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        let tensors: std::collections::HashMap<String, Tensor> = {
            let data = self
                .varmap
                .data()
                .lock()
                .map_err(|_| DrafterError::Invalid("variable map poisoned".into()))?;
            data.iter()
                .map(|(k, v)| Ok((k.clone(), v.as_tensor().to_dtype(DType::F16)?)))
                .collect::<Result<_>>()?
        };
        let tmp = dir.join("drafter.safetensors.tmp");
        candle_core::safetensors::save(&tensors, &tmp)?;
        std::fs::rename(&tmp, dir.join("drafter.safetensors"))?;
        if let Some(ids) = &self.draft_vocab {
            write_draft_vocab(dir, ids)?;
        }
        let json = serde_json::to_string_pretty(&self.cfg)
            .map_err(|e| DrafterError::Invalid(e.to_string()))?;
        let tmp = dir.join("drafter.json.tmp");
        std::fs::write(&tmp, json)?;
        std::fs::rename(&tmp, dir.join("drafter.json"))?;
        Ok(())
    }

    /// Loads a checkpoint for a target (its configuration, its tokenizer's vocabulary hash and
    /// its embedding and head, [`target_tensors`]); refuses a checkpoint trained for another
    /// target: another architecture or vocabulary, or the same ones at another depth or width
    /// (a drafter of SmolLM2-135M against the 360M), whose features it would misread.
    pub fn load(
        dir: &Path,
        target: &dspark_runtime::ModelConfig,
        vocab_hash: &str,
        embed: Tensor,
        head: Tensor,
    ) -> Result<Self> {
        let target_arch = target.arch.name();
        let bad = |reason: String| DrafterError::Checkpoint {
            path: dir.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(dir.join("drafter.json"))
            .map_err(|e| bad(format!("drafter.json: {e}")))?;
        let mut cfg: DrafterConfig =
            serde_json::from_str(&text).map_err(|e| bad(format!("drafter.json: {e}")))?;
        if let Some(spec) = cfg.drop_foreign_copy_head() {
            tracing::warn!(
                drafter = %dir.display(),
                inputs = spec,
                ours = crate::proposer::COPY_HEAD_SPEC,
                "the stored copy-run head reads other inputs than this release computes: copy \
                 runs take their rates as confidences until `dspark calibrate-drafter \
                 --temperature 0` refits it"
            );
        }
        cfg.validate()?;
        if cfg.target_arch != target_arch || cfg.target_vocab_hash != vocab_hash {
            return Err(DrafterError::WrongTarget(format!(
                "checkpoint is for a {} target with vocabulary {}…, this target is {} with {}…",
                cfg.target_arch,
                cfg.target_vocab_hash.chars().take(12).collect::<String>(),
                target_arch,
                vocab_hash.chars().take(12).collect::<String>()
            )));
        }
        check_target_shape(&cfg, target, &embed, &head).map_err(|why| {
            DrafterError::WrongTarget(format!("the drafter in {} {why}", dir.display()))
        })?;
        // The sizes drafter.json gives are checked against the weights file before any
        // variable is allocated.
        let weights = dir.join("drafter.safetensors");
        check_checkpoint_shapes(&cfg, &weights)
            .map_err(|why| bad(format!("drafter.safetensors: {why}")))?;
        let varmap = VarMap::new();
        let m = Self::build(cfg, &varmap, embed, head)?;
        // Loading sets the values of the variables the model already holds (f16 or f32 on disk).
        let file = candle_core::safetensors::load(&weights, &Device::Cpu)
            .map_err(|e| bad(format!("drafter.safetensors: {e}")))?;
        {
            let data = varmap
                .data()
                .lock()
                .map_err(|_| DrafterError::Invalid("variable map poisoned".into()))?;
            for (name, var) in data.iter() {
                let t = file
                    .get(name)
                    .ok_or_else(|| bad(format!("drafter.safetensors lacks `{name}`")))?;
                if t.dims() != var.dims() {
                    return Err(bad(format!(
                        "`{name}` has shape {:?}, config says {:?}",
                        t.dims(),
                        var.dims()
                    )));
                }
                let t = t.to_dtype(DType::F32)?;
                // A checkpoint with NaN or inf weights (a diverged run, a corrupt write)
                // drafts garbage confidences and q rows: refused here, named.
                if let Some(bad_at) = t
                    .flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .position(|x| !x.is_finite())
                {
                    return Err(bad(format!(
                        "`{name}` holds a non-finite value (at flat index {bad_at})"
                    )));
                }
                var.set(&t)?;
            }
        }
        let draft_vocab = if m.cfg.draft_vocab > 0 {
            let text = std::fs::read_to_string(dir.join(DRAFT_VOCAB_FILE))
                .map_err(|e| bad(format!("{DRAFT_VOCAB_FILE}: {e}")))?;
            let ids: Vec<u32> =
                serde_json::from_str(&text).map_err(|e| bad(format!("{DRAFT_VOCAB_FILE}: {e}")))?;
            check_draft_vocab(&ids, m.cfg.vocab)
                .map_err(|e| bad(format!("{DRAFT_VOCAB_FILE}: {e}")))?;
            if ids.len() != m.cfg.draft_vocab {
                return Err(bad(format!(
                    "{DRAFT_VOCAB_FILE} has {} ids, drafter.json says {}",
                    ids.len(),
                    m.cfg.draft_vocab
                )));
            }
            Some(ids)
        } else {
            None
        };
        Ok(Self {
            varmap,
            draft_vocab,
            ..m
        })
    }

    /// Restricts drafting to `ids` (most frequent first), or lifts the restriction (None).
    pub fn set_draft_vocab(&mut self, ids: Option<Vec<u32>>) -> Result<()> {
        if let Some(ids) = &ids {
            check_draft_vocab(ids, self.cfg.vocab).map_err(DrafterError::Invalid)?;
        }
        self.cfg.draft_vocab = ids.as_ref().map_or(0, |v| v.len());
        self.draft_vocab = ids;
        Ok(())
    }
}

/// Whether a drafter configured by `cfg` reads `target`'s features and tokens: the target has
/// the depth the drafter was trained on (every feature layer among its layers), its width and
/// its vocabulary, and `embed`/`head` are its `(vocab, d_model)` matrices. Same architecture
/// and tokenizer is not the same model. The error ("was trained on …", to follow the drafter's
/// name) names both shapes.
pub fn check_target_shape(
    cfg: &DrafterConfig,
    target: &dspark_runtime::ModelConfig,
    embed: &Tensor,
    head: &Tensor,
) -> std::result::Result<(), String> {
    let (e, h) = (embed.dims(), head.dims());
    let want = [cfg.vocab, cfg.d_model];
    if cfg.target_layers == target.n_layers
        && cfg.feature_layers.iter().all(|&l| l < target.n_layers)
        && cfg.d_model == target.d_model
        && cfg.vocab == target.vocab_size
        && e == want.as_slice()
        && h == want.as_slice()
    {
        return Ok(());
    }
    Err(format!(
        "was trained on a target of {} layers × {} with a vocabulary of {} (features of \
         layers {:?}); this {} target has {} layers × {} with a vocabulary of {} (embedding \
         {:?}, head {:?})",
        cfg.target_layers,
        cfg.d_model,
        cfg.vocab,
        cfg.feature_layers,
        target.arch.name(),
        target.n_layers,
        target.d_model,
        target.vocab_size,
        e,
        h
    ))
}

/// The draft vocabulary's file in a checkpoint directory (a JSON list of token ids).
pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.json";

fn check_draft_vocab(ids: &[u32], vocab: usize) -> std::result::Result<(), String> {
    if ids.is_empty() {
        return Err("an empty draft vocabulary".into());
    }
    let mut seen = vec![false; vocab];
    for &t in ids {
        match seen.get_mut(t as usize) {
            None => return Err(format!("token {t} outside the vocabulary of {vocab}")),
            Some(true) => return Err(format!("token {t} listed twice")),
            Some(s) => *s = true,
        }
    }
    Ok(())
}

/// Writes a draft vocabulary (atomically).
pub fn write_draft_vocab(dir: &Path, ids: &[u32]) -> Result<()> {
    let json = serde_json::to_string(ids).map_err(|e| DrafterError::Invalid(e.to_string()))?;
    let tmp = dir.join(format!("{DRAFT_VOCAB_FILE}.tmp"));
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, dir.join(DRAFT_VOCAB_FILE))?;
    Ok(())
}

/// Re-initializes every variable from our seeded RNG (candle's CPU RNG cannot be seeded), so the
/// same seed gives the same drafter: norms 1, Markov W2 and biases 0, mask and W1 N(0, 0.02²),
/// matrices N(0, 1/fan_in).
fn reseed(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| DrafterError::Invalid("variable map poisoned".into()))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = kernels::rng::Rng::new(seed);
    for name in names {
        let var = &data[name];
        let shape = var.shape().clone();
        let n = shape.elem_count();
        let vals: Vec<f32> = if name.ends_with("n1") || name.ends_with("n2") || name == "out_norm" {
            vec![1.0; n]
        } else if name.ends_with("bias") || name == "markov.w2" {
            vec![0.0; n]
        } else if name == "mask" || name == "markov.w1" {
            (0..n).map(|_| rng.normal() as f32 * 0.02).collect()
        } else {
            let fan_in = *shape.dims().last().unwrap_or(&1) as f64;
            (0..n)
                .map(|_| (rng.normal() / fan_in.sqrt()) as f32)
                .collect()
        };
        var.set(&Tensor::from_vec(vals, shape, &Device::Cpu)?)?;
    }
    Ok(())
}

/// The frozen embedding and head of a runtime model as candle tensors.
pub fn target_tensors(target: &dspark_runtime::Model) -> Result<(Tensor, Tensor)> {
    let (v, d) = (target.cfg.vocab_size, target.cfg.d_model);
    let e = Tensor::from_vec(target.embedding_f32()?, (v, d), &Device::Cpu)?;
    let h = Tensor::from_vec(target.head_f32()?, (v, d), &Device::Cpu)?;
    Ok((e, h))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::train::{TrainConfig, loss, make_batch, teacher};
    use dspark_runtime::tiny::{TinySpec, tiny_model_path};
    use dspark_runtime::{LoadOptions, Model, Tokenizer};

    fn tiny() -> (Model, Tokenizer) {
        tiny_target(21, "drafter-target")
    }

    /// A tiny seeded target model and its tokenizer (shared by the drafter's unit tests).
    pub(crate) fn tiny_target(seed: u64, name: &str) -> (Model, Tokenizer) {
        let p = tiny_model_path(&TinySpec::llama(seed), name).unwrap();
        (
            Model::load(
                &p,
                &LoadOptions {
                    threads: 1,
                    ..Default::default()
                },
            )
            .unwrap(),
            Tokenizer::load(&p).unwrap(),
        )
    }

    /// A γ = 4, one-layer, rank-16 drafter over layers 0 and 1 of the tiny target.
    pub(crate) fn tiny_drafter(
        m: &Model,
        tok: &Tokenizer,
        context: usize,
        seed: u64,
    ) -> DsparkDrafter {
        let (e, h) = target_tensors(m).unwrap();
        let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, 1, 16);
        cfg.feature_layers = vec![0, 1];
        cfg.context = context;
        DsparkDrafter::new(cfg, e, h, seed).unwrap()
    }

    #[test]
    fn fusing_rows_one_at_a_time_gives_the_same_hidden_states() {
        let (m, tok) = tiny();
        let d = m.cfg.d_model;
        let dr = tiny_drafter(&m, &tok, 6, 5);
        let mut rng = kernels::rng::Rng::new(4);
        let raw: Vec<f32> = (0..2 * 6 * 2 * d)
            .map(|_| rng.normal() as f32 * 3.0)
            .collect();
        let feats = Tensor::from_vec(raw.clone(), (2, 6, 2 * d), &Device::Cpu).unwrap();
        let anchors = Tensor::from_vec(vec![5u32, 9], 2, &Device::Cpu).unwrap();
        let want: Vec<f32> = dr
            .hidden(&feats, &anchors)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut fused = Vec::new();
        for row in raw.chunks_exact(2 * d) {
            let t = Tensor::from_slice(row, (1, 1, 2 * d), &Device::Cpu).unwrap();
            fused.extend(
                dr.fuse_context(&t)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
        }
        let ctx = Tensor::from_vec(fused, (2, 6, d), &Device::Cpu).unwrap();
        let got: Vec<f32> = dr
            .hidden_fused(&ctx, &anchors)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "worst abs difference {worst}");
    }

    #[test]
    fn a_copy_prior_set_for_one_kind_of_request_is_the_one_it_drafts_with() {
        let (m, tok) = tiny();
        let mut cfg = tiny_drafter(&m, &tok, 6, 5).cfg;
        // No greedy calibration: greedy requests share the sampled prior until given their own.
        cfg.set_copy_bias(false, vec![1.0]);
        assert_eq!(cfg.copy_bias_for(true), [1.0]);
        cfg.set_copy_bias(true, vec![9.0, 9.5]);
        assert_eq!(cfg.copy_bias_for(true), [9.0, 9.5]);
        assert_eq!(cfg.copy_bias_for(false), [1.0]);
        // What `calibrate-drafter` starts from when both kinds are calibrated already: the
        // greedy calibration is kept (emptied), and a prior set on the sampled side would not
        // reach greedy requests. Set for greedy, it does.
        let mut c = cfg.clone().uncalibrated().without_copy();
        assert!(c.greedy_calibration.is_some());
        c.copy_bias = vec![3.0];
        assert!(c.copy_bias_for(true).is_empty());
        c.set_copy_bias(true, vec![3.0]);
        assert_eq!(c.copy_bias_for(true), [3.0]);
        c.validate().unwrap();
    }

    #[test]
    fn serving_bits_round_trip_and_others_are_refused() {
        let (m, tok) = tiny();
        let cfg = tiny_drafter(&m, &tok, 6, 5).cfg;
        // The default (8) is not written, so older checkpoints read back unchanged.
        let json = serde_json::to_string(&cfg).unwrap();
        assert!(!json.contains("serve_bits"), "{json}");
        let back: DrafterConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back.serve_bits, 8);
        let mut four = cfg.clone();
        four.serve_bits = 4;
        let back: DrafterConfig =
            serde_json::from_str(&serde_json::to_string(&four).unwrap()).unwrap();
        assert_eq!(back.serve_bits, 4);
        back.validate().unwrap();
        for bad in [0u8, 5, 16] {
            let mut c = cfg.clone();
            c.serve_bits = bad;
            let e = c.validate().err().expect("refused");
            assert!(e.to_string().contains("serve_bits"), "{e}");
        }
    }

    #[test]
    fn a_greedy_head_round_trips_and_a_bad_one_is_refused() {
        let (m, tok) = tiny();
        let dr = tiny_drafter(&m, &tok, 6, 5);
        let mut cfg = dr.cfg.clone();
        let width = cfg.d_model + cfg.rank;
        let mut c = cfg.sampled_calibration();
        c.head = Some(GreedyHead {
            w: vec![0.5; width],
            bias: vec![1.0; cfg.gamma],
        });
        cfg.greedy_calibration = Some(c);
        cfg.validate().unwrap();
        let back: DrafterConfig =
            serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
        // Older checkpoints have none.
        assert!(!serde_json::to_string(&dr.cfg).unwrap().contains("\"head\""));
        let bad = |f: &dyn Fn(&mut GreedyHead)| {
            let mut c = cfg.clone();
            f(c.greedy_calibration
                .as_mut()
                .unwrap()
                .head
                .as_mut()
                .unwrap());
            c.validate().err().expect("refused").to_string()
        };
        assert!(bad(&|h| h.w.pop().map(|_| ()).unwrap_or(())).contains("wide"));
        assert!(bad(&|h| h.bias.push(0.0)).contains("one bias per block position"));
        assert!(bad(&|h| h.w[0] = f32::NAN).contains("finite"));
        // The parallel-only drafter has no W1 rows to read: it drops the head.
        let mut dr = dr;
        dr.cfg = cfg;
        dr.cfg.parallel_trained = true;
        let p = dr.into_parallel().unwrap();
        assert!(p.cfg.greedy_calibration.unwrap().head.is_none());
    }

    /// `calibrate-drafter --serve-bits` drops the other kind of request's calibration: a
    /// greedy one goes back to reading the sampled one (its copy prior kept), a sampled one
    /// to the identity; each says whether something fitted was dropped.
    #[test]
    fn one_kind_of_requests_calibration_is_dropped_and_the_other_kept() {
        let (m, tok) = tiny();
        let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, 1, 8);
        assert!(!cfg.drop_calibration(true));
        assert!(!cfg.drop_calibration(false));
        cfg.sts = vec![0.8; 4];
        cfg.copy_bias = vec![1.0];
        cfg.set_calibration(
            true,
            CalibrationCfg {
                sts: vec![0.5; 4],
                copy_bias: vec![2.0],
                copy_runs: vec![0.9],
                ..Default::default()
            },
        );
        let sampled = cfg.sampled_calibration();
        assert!(cfg.drop_calibration(true));
        let g = cfg.greedy_calibration.clone().expect("its own copy prior");
        assert_eq!(g.copy_bias, vec![2.0]);
        assert_eq!((g.sts, g.copy_runs), (vec![0.8; 4], Vec::new()));
        assert_eq!(cfg.sampled_calibration(), sampled);
        assert!(cfg.drop_calibration(false));
        assert_eq!(
            (cfg.sts.clone(), cfg.copy_bias.clone()),
            (vec![1.0; 4], vec![1.0])
        );
    }

    #[test]
    fn a_draft_vocabulary_round_trips_and_bad_ones_are_refused() {
        let (m, tok) = tiny();
        let mut dr = tiny_drafter(&m, &tok, 6, 5);
        let dir = std::env::temp_dir().join(format!("dspark-draft-vocab-{}", std::process::id()));
        let ids: Vec<u32> = vec![7, 3, 11, 2];
        dr.set_draft_vocab(Some(ids.clone())).unwrap();
        dr.save(&dir).unwrap();
        let load = || {
            let (e, h) = target_tensors(&m).unwrap();
            DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e, h)
        };
        let back = load().unwrap();
        assert_eq!(back.draft_vocab.as_deref(), Some(&ids[..]));
        assert_eq!(back.cfg.draft_vocab, 4);
        // Corrupt files: a wrong count, an id past the vocabulary, garbage.
        for bad in ["[7, 3, 11]", "[7, 3, 11, 99999]", "not json"] {
            std::fs::write(dir.join(DRAFT_VOCAB_FILE), bad).unwrap();
            let e = load().err().expect("refused");
            assert!(e.to_string().contains(DRAFT_VOCAB_FILE), "{e}");
        }
        std::fs::remove_file(dir.join(DRAFT_VOCAB_FILE)).unwrap();
        assert!(load().is_err(), "a missing draft vocabulary is refused");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn confidence_at_k_never_depends_on_the_token_at_k() {
        let (m, tok) = tiny();
        let dr = tiny_drafter(&m, &tok, 8, 5);
        let feats = Tensor::zeros((1, 8, 2 * m.cfg.d_model), DType::F32, &Device::Cpu).unwrap();
        let anchors = Tensor::from_vec(vec![5u32], 1, &Device::Cpu).unwrap();
        // prev = [x0, x1, x2, x3]; changing x2 (the token drafted at position 2) must leave the
        // confidences of positions 0..=2 unchanged and may change position 3's.
        let a = Tensor::from_vec(vec![5u32, 7, 9, 11], (1, 4), &Device::Cpu).unwrap();
        let b = Tensor::from_vec(vec![5u32, 7, 200, 11], (1, 4), &Device::Cpu).unwrap();
        let (_, ca) = dr.forward_train(&feats, &anchors, &a).unwrap();
        let (_, cb) = dr.forward_train(&feats, &anchors, &b).unwrap();
        let (ca, cb): (Vec<f32>, Vec<f32>) = (
            ca.flatten_all().unwrap().to_vec1().unwrap(),
            cb.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert_eq!(ca[..2], cb[..2]);
        assert_ne!(
            ca[2], cb[2],
            "position 2 conditions on prev[2] = x_2's predecessor slot"
        );
        assert_eq!(ca[3], cb[3]);
    }

    /// Largest absolute value of a tensor.
    pub(crate) fn a_max(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The shapes the checkpoint check expects are the variables `build` makes, with and
    /// without the Markov head.
    #[test]
    fn the_checked_shapes_are_the_built_variables() {
        let (m, tok) = tiny();
        for rank in [16, 0] {
            let (e, h) = target_tensors(&m).unwrap();
            let mut cfg = DrafterConfig::for_target(&m.cfg, &tok.vocab_hash(), 4, 2, rank);
            cfg.feature_layers = vec![0, 1];
            let dr = DsparkDrafter::new(cfg.clone(), e, h, 1).unwrap();
            let mut built: Vec<(String, Vec<usize>)> = dr
                .varmap
                .data()
                .lock()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.dims().to_vec()))
                .collect();
            built.sort();
            let mut want = variable_shapes(&cfg);
            want.sort();
            assert_eq!(built, want, "rank {rank}");
        }
    }

    /// A drafter.json edited to sizes its weights file does not hold (an FFN of 2^18 and the
    /// most layers allowed: ~13 GB of variables at this tiny target's width) is refused from the file's
    /// header, before anything is allocated; a weights file whose header claims more bytes
    /// than it holds is refused too.
    #[test]
    fn a_config_larger_than_its_weights_is_refused_before_allocating() {
        let (m, tok) = tiny();
        let (e, h) = target_tensors(&m).unwrap();
        let dr = tiny_drafter(&m, &tok, 8, 3);
        let dir = std::env::temp_dir().join(format!("dspark-drafter-huge-{}", std::process::id()));
        dr.save(&dir).unwrap();
        let base = serde_json::to_value(&dr.cfg).unwrap();
        let load = || DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e.clone(), h.clone());
        assert!(load().is_ok());
        let t0 = std::time::Instant::now();
        let huge = [("ffn_dim", 1u64 << 18), ("n_layers", 64)];
        for (edits, says) in [
            (&huge[..], "layer0.gate.weight"),
            (&huge[1..], "lacks `layer1.n1`"),
            (&[("rank", 4096)][..], "markov.w1"),
        ] {
            let mut c = base.clone();
            for &(key, v) in edits {
                c[key] = serde_json::json!(v);
            }
            let key = edits[0].0;
            std::fs::write(dir.join("drafter.json"), c.to_string()).unwrap();
            let err = load().err().expect("refused");
            assert!(
                matches!(err, DrafterError::Checkpoint { .. }),
                "{key}: {err}"
            );
            assert!(err.to_string().contains(says), "{key}: {err}");
        }
        assert!(t0.elapsed().as_secs() < 5, "{:?}", t0.elapsed());
        // The header's shapes agree with drafter.json but the data is cut short.
        std::fs::write(dir.join("drafter.json"), base.to_string()).unwrap();
        let st = dir.join("drafter.safetensors");
        let bytes = std::fs::read(&st).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        std::fs::write(&st, &bytes[..8 + n + 16]).unwrap();
        let err = load().err().expect("refused");
        assert!(err.to_string().contains("bytes of weights"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
        // Rotary tables are sized from the config alone: a context each bound allows, at a
        // wide head, is refused (8 Gi entries a table).
        let mut wide = dr.cfg.clone();
        (wide.d_model, wide.n_heads, wide.context) = (1 << 14, 1, 1 << 20);
        let err = wide.validate().err().expect("refused");
        assert!(err.to_string().contains("rotary tables"), "{err}");
    }

    #[test]
    fn training_reduces_the_loss_and_checkpoints_round_trip() {
        let (m, tok) = tiny();
        let (e, h) = target_tensors(&m).unwrap();
        let dr = tiny_drafter(&m, &tok, 8, 3);
        assert!(dr.num_params() > 0);
        let text = "the theater in there then rather inner bit tin ".repeat(20);
        let data = tok.encode(&text).unwrap();
        let tc = TrainConfig {
            steps: 60,
            batch: 8,
            chunk: 48,
            lr: 3e-3,
            warmup: 5,
            ..Default::default()
        };
        let ch = teacher(&m, &data[..48], &dr.cfg.feature_layers).unwrap();
        let anchors: Vec<usize> = (8..40).step_by(4).collect();
        let bt = make_batch(&ch, &dr, &anchors).unwrap();
        let before = loss(&dr, &bt, &tc).unwrap().total;
        crate::train::train(&m, &dr, &data, &tc, None, &mut |_, _| Ok(())).unwrap();
        let after = loss(&dr, &bt, &tc).unwrap().total;
        assert!(after < 0.8 * before, "loss {before} -> {after}");
        // Save, load, same outputs; wrong target refused; corrupt checkpoint refused.
        let dir = std::env::temp_dir().join(format!("dspark-drafter-{}", std::process::id()));
        dr.save(&dir).unwrap();
        let back =
            DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e.clone(), h.clone()).unwrap();
        let (a, _) = dr.forward_train(&bt.feats, &bt.anchors, &bt.prev).unwrap();
        let (b, _) = back
            .forward_train(&bt.feats, &bt.anchors, &bt.prev)
            .unwrap();
        let diff = (a.clone() - b.clone())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        // Stored in f16: logits agree to f16 precision, and a second round trip is exact.
        let scale = a_max(&a);
        assert!(diff <= 1e-2 * scale + 1e-3, "{diff} vs scale {scale}");
        back.save(&dir).unwrap();
        let again =
            DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e.clone(), h.clone()).unwrap();
        let (c, _) = again
            .forward_train(&bt.feats, &bt.anchors, &bt.prev)
            .unwrap();
        assert_eq!(a_max(&(b - c).unwrap()), 0.0);
        assert!(matches!(
            DsparkDrafter::load(&dir, &m.cfg, "another-vocab", e.clone(), h.clone()),
            Err(DrafterError::WrongTarget(_))
        ));
        // A copy-run head over another release's inputs is dropped at load (its rates serve,
        // and calibrate-drafter can refit it); one over this release's is kept.
        for (tag, kept) in [("copy-v0", false), (crate::proposer::COPY_HEAD_SPEC, true)] {
            let mut cfg = back.cfg.clone();
            let mut g = cfg.sampled_calibration();
            g.copy_runs = vec![0.3, 0.6];
            g.copy_head = Some(GreedyHead {
                w: vec![0.0; crate::proposer::COPY_HEAD_INPUTS],
                bias: vec![0.0; cfg.gamma],
            });
            g.copy_head_inputs = Some(tag.into());
            cfg.greedy_calibration = Some(g);
            let json = serde_json::to_string(&cfg).unwrap();
            std::fs::write(dir.join("drafter.json"), json).unwrap();
            let got =
                DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e.clone(), h.clone()).unwrap();
            assert_eq!(got.cfg.copy_head().is_some(), kept, "{tag}");
            assert_eq!(got.cfg.copy_runs(), &[0.3, 0.6]);
        }
        // Sizes that would divide by zero or size allocations without bound, and a hash that
        // an error message cut mid-character: errors, never panics.
        let base = serde_json::to_value(&back.cfg).unwrap();
        for (key, v, says) in [
            ("n_heads", serde_json::json!(0), "n_heads"),
            ("vocab", serde_json::json!(4_000_000_000u64), "vocab"),
            ("context", serde_json::json!(1u64 << 40), "context"),
            (
                "target_vocab_hash",
                serde_json::json!(format!("a{}", "é".repeat(6))),
                "checkpoint is for",
            ),
        ] {
            let mut c = base.clone();
            c[key] = v;
            std::fs::write(dir.join("drafter.json"), c.to_string()).unwrap();
            let err = DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e.clone(), h.clone())
                .err()
                .expect("refused");
            assert!(err.to_string().contains(says), "{key}: {err}");
        }
        std::fs::write(dir.join("drafter.json"), base.to_string()).unwrap();
        // A weight that went NaN (a diverged run) is refused by name, not served.
        let st = dir.join("drafter.safetensors");
        let mut ts = candle_core::safetensors::load(&st, &Device::Cpu).unwrap();
        let (name, t) = ts
            .iter()
            .next()
            .map(|(k, v)| (k.clone(), v.clone()))
            .unwrap();
        let n = t.elem_count();
        let mut vals = vec![0f32; n];
        vals[n / 2] = f32::NAN;
        let poisoned = Tensor::from_vec(vals, t.dims(), &Device::Cpu).unwrap();
        ts.insert(name.clone(), poisoned.to_dtype(t.dtype()).unwrap());
        candle_core::safetensors::save(&ts, &st).unwrap();
        let err = DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e.clone(), h.clone())
            .err()
            .expect("NaN weight refused");
        assert!(
            err.to_string().contains("non-finite") && err.to_string().contains(&name),
            "{err}"
        );
        std::fs::write(dir.join("drafter.safetensors"), b"garbage").unwrap();
        assert!(matches!(
            DsparkDrafter::load(&dir, &m.cfg, &tok.vocab_hash(), e, h),
            Err(DrafterError::Checkpoint { .. })
        ));
        let _ = std::fs::remove_dir_all(dir);
    }
}
