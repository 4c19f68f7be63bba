//! `dspark bench draft`: what one drafting call costs, against what one target decode costs, in
//! the serving loop's conditions (the target decodes between calls, so the drafter's weights
//! are streamed again from memory each time, as when serving).

use crate::config::Global;
use clap::Args;
use dspark_runtime::model::{ForwardOptions, LogitsMode, SeqInput};
use serde_json::json;
use specdec::proposer::ProposeReq;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct DraftArgs {
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    /// dspark[:DIR] (the shipped drafter by default) or a checkpoint DIR, ngram,
    /// draft-model[:NAME].
    #[arg(long, default_value = "dspark")]
    pub drafter: String,
    /// chat | code | math
    #[arg(long, default_value = "code")]
    pub prompts: String,
    /// Requests drafted for in one call.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Block lengths.
    #[arg(long, value_delimiter = ',', default_value = "1,3,7")]
    pub gammas: Vec<usize>,
    /// Timed drafting calls per point (each after one target decode step).
    #[arg(long, default_value_t = 48)]
    pub steps: usize,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Refuses a block length outside `1..=max` (the drafter's longest block, or the engine's
/// [`specdec::MAX_GAMMA`] for a drafter without one).
fn check_gammas(gammas: &[usize], max: usize) -> anyhow::Result<()> {
    if let Some(&bad) = gammas.iter().find(|&&k| k == 0 || k > max) {
        anyhow::bail!("--gammas: gamma {bad} out of range 1..={max}");
    }
    Ok(())
}

pub fn run(g: &Global, a: DraftArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.steps >= 2, "--steps must be at least 2");
    crate::config::check_outputs(&[a.json.as_deref()])?;
    anyhow::ensure!(
        a.batch.iter().all(|&b| (1..=256).contains(&b)),
        "--batch values must lie in 1..=256"
    );
    let params = kernels::sampling::SamplingParams {
        temperature: a.temperature,
        ..Default::default()
    };
    params.validate()?;
    let kind = crate::spec::parse_drafter(&a.drafter, crate::spec::default_draft_for(&a.model))?;
    // Checked before the target loads against the engine's bound, then against the drafter's.
    check_gammas(&a.gammas, specdec::MAX_GAMMA)?;
    let target = crate::spec::load_target(g, &a.model)?;
    let mut drafts = crate::spec::DraftCache::default();
    let mut proposer = crate::spec::build_proposer(g, &kind, &target, &mut drafts)?;
    check_gammas(
        &a.gammas,
        proposer.max_gamma().unwrap_or(specdec::MAX_GAMMA),
    )?;
    let model = &target.model;
    let tmpl = dspark_runtime::chat::ChatTemplate::from_tokenizer(&target.tok)?;
    let prompts = crate::bench::prompt_set(&a.prompts)?;
    let layers = proposer.feature_layers();
    let fopts = ForwardOptions {
        layers: layers.clone(),
        ..Default::default()
    };
    let d = model.cfg.d_model;
    let rows_of = |out: &dspark_runtime::ForwardOutput, off: usize, n: usize| -> Vec<f32> {
        let mut rows = Vec::with_capacity(n * layers.len() * d);
        for t in off..off + n {
            for lh in &out.layer_hidden {
                rows.extend_from_slice(&lh[t * d..(t + 1) * d]);
            }
        }
        rows
    };
    let mut points = Vec::new();
    out!(
        "{:>5} {:>5} {:>10} {:>10} {:>9}  stages (ms per call)",
        "batch",
        "gamma",
        "draft_ms",
        "decode_ms",
        "ratio"
    )?;
    let mut next_id = 1u64;
    for &b in &a.batch {
        for &k in &a.gammas {
            // Fresh requests per point: prompt prefill (features observed), then decode steps.
            let total = a.steps + 512;
            let mut cache = model.new_cache(b * total + 64, 16)?;
            let mut seqs = Vec::with_capacity(b);
            for i in 0..b {
                let p = &prompts[i % prompts.len()];
                let ids = target.tok.encode(
                    &tmpl.render(&[dspark_runtime::chat::Message::new("user", p)], true)?,
                )?;
                anyhow::ensure!(ids.len() < 512, "prompt {i} longer than 512 tokens");
                let s = cache.new_seq();
                let out = model.forward(
                    &mut cache,
                    &[SeqInput {
                        seq: s,
                        tokens: &ids,
                        logits: LogitsMode::Last,
                    }],
                    &fopts,
                )?;
                let id = next_id;
                next_id += 1;
                proposer.observe(id, 0, &rows_of(&out, 0, ids.len()))?;
                let mut ctx = ids;
                ctx.push(kernels::sampling::argmax(out.row(0, 0)));
                seqs.push((id, s, ctx, kernels::rng::Rng::new(id)));
            }
            let before = proposer.stage_seconds();
            let (mut draft_s, mut decode_s, mut timed) = (0f64, 0f64, 0usize);
            let mut stage_acc: Vec<f64> = vec![0.0; before.len()];
            for step in 0..=a.steps {
                // One target decode over every request (its features arrive as when serving).
                let last: Vec<[u32; 1]> =
                    seqs.iter().map(|s| [*s.2.last().unwrap_or(&0)]).collect();
                let inputs: Vec<SeqInput<'_>> = seqs
                    .iter()
                    .zip(&last)
                    .map(|(s, t)| SeqInput {
                        seq: s.1,
                        tokens: t,
                        logits: LogitsMode::All,
                    })
                    .collect();
                let t0 = Instant::now();
                let out = model.forward(&mut cache, &inputs, &fopts)?;
                let dec = t0.elapsed().as_secs_f64();
                for (j, s) in seqs.iter_mut().enumerate() {
                    let pos = s.2.len() - 1;
                    proposer.observe(s.0, pos, &rows_of(&out, out.token_offsets[j], 1))?;
                    s.2.push(kernels::sampling::argmax(out.row(j, 0)));
                }
                let s0 = proposer.stage_seconds();
                let mut reqs: Vec<ProposeReq<'_>> = seqs
                    .iter_mut()
                    .map(|s| ProposeReq {
                        id: s.0,
                        context: &s.2,
                        k,
                        params: &params,
                        rng: &mut s.3,
                    })
                    .collect();
                let t0 = Instant::now();
                let blocks = proposer.propose(&mut reqs)?;
                let dr = t0.elapsed().as_secs_f64();
                drop(reqs);
                anyhow::ensure!(
                    blocks.len() == b,
                    "the proposer answered {} blocks",
                    blocks.len()
                );
                // The first call also catches the drafter up on the prompt: not timed.
                if step > 0 {
                    draft_s += dr;
                    decode_s += dec;
                    timed += 1;
                    for ((acc, (_, now)), (_, was)) in
                        stage_acc.iter_mut().zip(proposer.stage_seconds()).zip(&s0)
                    {
                        *acc += now - was;
                    }
                }
            }
            for s in &seqs {
                proposer.finish(s.0);
                cache.remove(s.1)?;
            }
            let n = timed.max(1) as f64;
            let (dms, tms) = (draft_s / n * 1e3, decode_s / n * 1e3);
            let stages: serde_json::Map<String, serde_json::Value> = before
                .iter()
                .zip(&stage_acc)
                .map(|((name, _), s)| (name.to_string(), json!(s / n * 1e3)))
                .collect();
            let stage_txt: Vec<String> = before
                .iter()
                .zip(&stage_acc)
                .map(|((name, _), s)| format!("{name} {:.3}", s / n * 1e3))
                .collect();
            out!(
                "{b:>5} {k:>5} {dms:>10.3} {tms:>10.3} {:>9.3}  {}",
                dms / tms.max(1e-9),
                stage_txt.join(", ")
            )?;
            points.push(json!({
                "batch": b, "gamma": k, "draft_ms": dms, "decode_ms": tms,
                "draft_over_decode": dms / tms.max(1e-9), "stages_ms": stages,
            }));
        }
    }
    crate::bench::write_json(
        &a.json,
        &json!({
            "command": crate::bench::command_line(),
            "model": a.model,
            "drafter": kind.label(),
            "threads": model.threads(),
            "temperature": a.temperature,
            "steps": a.steps,
            "points": points,
        }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drafter without a longest block of its own (n-gram) is bounded by the engine's.
    #[test]
    fn block_lengths_are_bounded_for_every_drafter() {
        assert!(check_gammas(&[1, 3, 7], 7).is_ok());
        let e = check_gammas(&[1, 8], 7).unwrap_err().to_string();
        assert!(e.contains("gamma 8 out of range 1..=7"), "{e}");
        assert!(check_gammas(&[0], specdec::MAX_GAMMA).is_err());
        let over = specdec::MAX_GAMMA + 1;
        let e = check_gammas(&[2, over], specdec::MAX_GAMMA)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("gamma {over}")), "{e}");
        assert!(check_gammas(&[specdec::MAX_GAMMA], specdec::MAX_GAMMA).is_ok());
    }
}
