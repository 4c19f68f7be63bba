//! SPS(B) profiling: real forwards over a grid of total batch tokens B, shaped like the steps the
//! engine runs (several requests' verification windows, optionally with a prefill chunk), at a
//! few context lengths. Steps per second at each B is what the scheduler trades τ against.

use crate::Result;
use dspark_runtime::Model;
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use std::time::Instant;

/// One measured point.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SpsPoint {
    pub batch_tokens: usize,
    pub ctx: usize,
    /// "decode" (verification windows only) or "mixed" (half the tokens a prefill chunk).
    pub kind: String,
    pub ms_median: f64,
    pub steps_per_s: f64,
}

/// Sequences a step of B tokens is split over (verification windows of ~B/n tokens each).
fn seqs_for(b: usize) -> usize {
    b.clamp(1, 16)
}

/// Measures every (ctx, B, kind); `reps` forwards each, median.
pub fn measure(
    model: &Model,
    batch: &[usize],
    ctxs: &[usize],
    reps: usize,
) -> Result<Vec<SpsPoint>> {
    let mut out = Vec::new();
    let vocab = model.cfg.vocab_size as u32;
    let tok = |i: usize| 1 + ((i as u32).wrapping_mul(7919) % (vocab - 1));
    for &ctx in ctxs {
        let ctx = ctx.min(
            model
                .cfg
                .max_ctx
                .saturating_sub(batch.iter().max().copied().unwrap_or(1) + 1),
        );
        let max_b = batch.iter().copied().max().unwrap_or(1);
        let n_max = seqs_for(max_b) + 1;
        let mut cache = model.new_cache(n_max * (ctx + max_b + 32) + max_b + 64, 16)?;
        let seqs: Vec<_> = (0..n_max).map(|_| cache.new_seq()).collect();
        let prompt: Vec<u32> = (0..ctx).map(tok).collect();
        for &s in &seqs {
            model.forward(
                &mut cache,
                &[SeqInput {
                    seq: s,
                    tokens: &prompt,
                    logits: LogitsMode::None,
                }],
                &ForwardOptions::default(),
            )?;
        }
        for kind in ["decode", "mixed"] {
            for &b in batch {
                let (prefill, windows) = if kind == "mixed" && b >= 2 {
                    (b / 2, b - b / 2)
                } else {
                    (0, b)
                };
                let n = seqs_for(windows);
                let per: Vec<usize> = (0..n)
                    .map(|i| windows / n + usize::from(i < windows % n))
                    .collect();
                let toks: Vec<Vec<u32>> = per
                    .iter()
                    .map(|&k| (0..k).map(|i| tok(i + 3)).collect())
                    .collect();
                let chunk: Vec<u32> = (0..prefill).map(|i| tok(i + 11)).collect();
                let mut times = Vec::new();
                for _ in 0..reps.max(1) {
                    let mut inputs: Vec<SeqInput<'_>> = per
                        .iter()
                        .enumerate()
                        .map(|(i, _)| SeqInput {
                            seq: seqs[i],
                            tokens: &toks[i],
                            logits: LogitsMode::All,
                        })
                        .collect();
                    if prefill > 0 {
                        inputs.push(SeqInput {
                            seq: seqs[n_max - 1],
                            tokens: &chunk,
                            logits: LogitsMode::Last,
                        });
                    }
                    let t0 = Instant::now();
                    model.forward(&mut cache, &inputs, &ForwardOptions::default())?;
                    times.push(t0.elapsed().as_secs_f64());
                    for &s in &seqs {
                        cache.truncate(s, ctx)?;
                    }
                }
                times.sort_by(|a, b| a.total_cmp(b));
                let med = times[times.len() / 2];
                out.push(SpsPoint {
                    batch_tokens: b,
                    ctx,
                    kind: kind.to_string(),
                    ms_median: med * 1e3,
                    steps_per_s: 1.0 / med.max(1e-9),
                });
            }
        }
    }
    Ok(out)
}

/// The staircase the scheduler uses: per B the slowest of the measured shapes and contexts,
/// then made non-increasing in B (a bigger batch is never assumed faster).
pub fn staircase(points: &[SpsPoint]) -> Vec<(u32, f64)> {
    let mut bs: Vec<usize> = points.iter().map(|p| p.batch_tokens).collect();
    bs.sort_unstable();
    bs.dedup();
    let mut out: Vec<(u32, f64)> = Vec::new();
    for b in bs {
        let s = points
            .iter()
            .filter(|p| p.batch_tokens == b)
            .map(|p| p.steps_per_s)
            .fold(f64::INFINITY, f64::min);
        let s = out.last().map(|l| l.1.min(s)).unwrap_or(s);
        out.push((b as u32, s));
    }
    out
}
