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
    /// The fastest pass, which `steps_per_s` is (0 in artifacts from before it was recorded).
    #[serde(default)]
    pub ms_min: f64,
    pub steps_per_s: f64,
}

/// Sequences a step of B tokens is split over (verification windows of ~B/n tokens each).
fn seqs_for(b: usize) -> usize {
    b.clamp(1, 16)
}

/// Measures every (ctx, B, kind) in `reps` passes over the grid (at each context); a point is
/// its fastest pass. A neighbour's busy spell lasts seconds: the median of consecutive forwards
/// put whole stretches of a table measured during a test run 1.3–1.5× too slow (B = 96 at 263
/// ms where an idle machine measures 172), while a pass of the grid takes seconds, so a spell
/// lands on one pass of a point, not on all of them.
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
        let shapes: Vec<(&str, usize)> = ["decode", "mixed"]
            .into_iter()
            .flat_map(|k| batch.iter().map(move |&b| (k, b)))
            .collect();
        let mut times = vec![Vec::new(); shapes.len()];
        for _ in 0..reps.max(1) {
            for (&(kind, b), times) in shapes.iter().zip(times.iter_mut()) {
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
                let mut inputs: Vec<SeqInput<'_>> = toks
                    .iter()
                    .enumerate()
                    .map(|(i, t)| SeqInput {
                        seq: seqs[i],
                        tokens: t,
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
        }
        for (&(kind, b), t) in shapes.iter().zip(times.iter_mut()) {
            let (min, med) = min_median(t);
            out.push(SpsPoint {
                batch_tokens: b,
                ctx,
                kind: kind.to_string(),
                ms_median: med * 1e3,
                ms_min: min * 1e3,
                steps_per_s: 1.0 / min.max(1e-9),
            });
        }
    }
    Ok(out)
}

/// The fastest and the median of `t` (0 for none).
fn min_median(t: &mut [f64]) -> (f64, f64) {
    t.sort_by(|a, b| a.total_cmp(b));
    match t.first() {
        Some(&m) => (m, t[t.len() / 2]),
        None => (0.0, 0.0),
    }
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

/// The decoding steps at the shortest profiled context as a staircase (per B the slowest
/// pass kept, made non-increasing): the steepest relative steps, which price what verified
/// drafts add to a decoding step ([`SpsPoint`]s of other kinds and contexts are left out).
pub fn marginal_staircase(points: &[SpsPoint]) -> Vec<(u32, f64)> {
    let Some(ctx) = points
        .iter()
        .filter(|p| p.kind == "decode")
        .map(|p| p.ctx)
        .min()
    else {
        return Vec::new();
    };
    let short: Vec<SpsPoint> = points
        .iter()
        .filter(|p| p.kind == "decode" && p.ctx == ctx)
        .cloned()
        .collect();
    staircase(&short)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspark_runtime::LoadOptions;
    use dspark_runtime::tiny::{TinySpec, tiny_model_path};

    #[test]
    fn every_shape_is_measured_and_kept_at_its_fastest_pass() {
        let path = tiny_model_path(&TinySpec::llama(5), "profile").unwrap();
        let opts = LoadOptions {
            threads: 1,
            ..Default::default()
        };
        let model = Model::load(&path, &opts).unwrap();
        let pts = measure(&model, &[1, 3, 8], &[4, 16], 3).unwrap();
        // 2 contexts × 2 kinds × 3 sizes.
        assert_eq!(pts.len(), 12);
        for p in &pts {
            assert!(p.ms_min > 0.0 && p.ms_min <= p.ms_median, "{p:?}");
            assert!((p.steps_per_s - 1e3 / p.ms_min).abs() < 1e-6 * p.steps_per_s);
        }
        let t = staircase(&pts);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3, 8]);
        assert!(t.windows(2).all(|w| w[1].1 <= w[0].1), "{t:?}");
    }

    #[test]
    fn the_marginal_staircase_is_the_decoding_steps_at_the_shortest_context() {
        let pt = |kind: &str, ctx, b, ms: f64| SpsPoint {
            batch_tokens: b,
            ctx,
            kind: kind.into(),
            ms_median: ms,
            ms_min: ms,
            steps_per_s: 1e3 / ms,
        };
        let pts = vec![
            pt("decode", 1024, 32, 72.0),
            pt("decode", 1024, 33, 73.0),
            pt("mixed", 256, 32, 40.0),
            pt("mixed", 256, 33, 41.0),
            pt("decode", 256, 32, 43.0),
            pt("decode", 256, 33, 46.0),
            // A noisy pass reading faster at a larger size is levelled.
            pt("decode", 256, 34, 45.0),
        ];
        let m = marginal_staircase(&pts);
        assert_eq!(m.iter().map(|x| x.0).collect::<Vec<_>>(), [32, 33, 34]);
        assert!((1e3 / m[0].1 - 43.0).abs() < 1e-9 && (1e3 / m[1].1 - 46.0).abs() < 1e-9);
        assert_eq!(m[2].1, m[1].1);
        // The staircase the scheduler plans on is the slowest shape: its step is 1.4 %.
        let t = staircase(&pts);
        assert!((t[1].1 / t[0].1 - 72.0 / 73.0).abs() < 1e-9);
        assert!(marginal_staircase(&pts[2..4]).is_empty());
    }

    #[test]
    fn min_median_of_passes() {
        assert_eq!(min_median(&mut [3.0, 1.0, 2.0]), (1.0, 2.0));
        assert_eq!(min_median(&mut [5.0]), (5.0, 5.0));
        assert_eq!(min_median(&mut []), (0.0, 0.0));
    }
}
