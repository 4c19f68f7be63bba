//! `dspark generate`.

use crate::config::Global;
use clap::Args;
use dspark_runtime::chat::{ChatTemplate, Message};
use dspark_runtime::json::Format;
use kernels::sampling::SamplingParams;
use specdec::{Event, ProposerKind, Request};
use std::io::Write;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model name (fetched on first use) or a GGUF file / Hugging Face directory.
    #[arg(long, default_value = dspark_runtime::fetch::DEFAULT_MODEL)]
    pub model: String,
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as one user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Answer with one JSON object (JSON mode).
    #[arg(long, conflicts_with_all = ["json_schema", "regex", "choice"])]
    pub json_object: bool,
    /// Answer with a document of the JSON schema in this file (structured output).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "choice"])]
    pub json_schema: Option<std::path::PathBuf>,
    /// Answer with text the whole of which matches this regex (guided decoding).
    #[arg(long, conflicts_with = "choice")]
    pub regex: Option<String>,
    /// Answer with one of these strings (repeat the flag for each).
    #[arg(long)]
    pub choice: Vec<String>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// none | ngram | draft-model[:NAME]
    #[arg(long, default_value = "none")]
    pub drafter: String,
    /// Draft length (1..=32).
    #[arg(long, default_value_t = 4)]
    pub gamma: usize,
    /// Keep the draft length fixed instead of letting the per-request gate adapt it.
    #[arg(long)]
    pub no_gate: bool,
}

pub fn run(g: &Global, a: GenerateArgs) -> anyhow::Result<()> {
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        ..Default::default()
    };
    sampling.validate()?;
    if a.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    if a.prompt.is_empty() {
        anyhow::bail!("--prompt is empty");
    }
    if a.gamma == 0 || a.gamma > specdec::MAX_GAMMA {
        anyhow::bail!(
            "--gamma must be in 1..={}, got {}",
            specdec::MAX_GAMMA,
            a.gamma
        );
    }
    let format = match &a.json_schema {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", path.display()))?;
            let schema = dspark_runtime::json_schema::Schema::compile(&v)
                .map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", path.display()))?;
            Some(Format::Schema(std::sync::Arc::new(schema)))
        }
        None if a.regex.is_some() || !a.choice.is_empty() => {
            use dspark_runtime::json_schema::Pattern;
            let p = match &a.regex {
                Some(r) => Pattern::full_match(r),
                None => Pattern::one_of(&a.choice),
            }
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            Some(Format::Regex(std::sync::Arc::new(p)))
        }
        None => a.json_object.then_some(Format::Object),
    };
    let kind = ProposerKind::parse(&a.drafter, crate::spec::default_draft_for(&a.model))?;
    let target = crate::spec::load_target(g, &a.model)?;
    let tok = target.tok.clone();
    let text = if a.chat {
        ChatTemplate::from_tokenizer(&tok)?.render(&[Message::new("user", &a.prompt)], true)?
    } else {
        a.prompt.clone()
    };
    // A plain prompt starts with BOS where the model's tokenizer adds one; a chat template
    // writes its own.
    let ids = if a.chat {
        tok.encode(&text)?
    } else {
        tok.encode_prompt(&text)?
    };
    let mut drafts = crate::spec::DraftCache::default();
    let proposer = crate::spec::build_proposer(g, &kind, &target, &mut drafts)?;
    let mut engine = crate::spec::engine(&target, proposer, a.gamma, !a.no_gate, 1)?;
    let mut req = Request::new(1, ids, a.max_tokens);
    req.params = sampling;
    req.seed = a.seed;
    req.json = format;
    engine.add(req)?;
    let mut stdout = std::io::stdout();
    let mut token_ids = Vec::new();
    let mut full = String::new();
    let mut finish = None;
    while !engine.is_idle() {
        for ev in engine.step()? {
            match ev {
                Event::Tokens { tokens, text, .. } => {
                    token_ids.extend(tokens);
                    full.push_str(&text);
                    if !a.json {
                        // A closed pipe ends the command (quietly: see `run`).
                        stdout.write_all(text.as_bytes())?;
                        stdout.flush()?;
                    }
                }
                Event::Finished {
                    reason, metrics, ..
                } => finish = Some((reason, metrics)),
                Event::Failed { error, .. } => anyhow::bail!("the request failed: {error}"),
            }
        }
    }
    let (reason, m) = finish.ok_or_else(|| anyhow::anyhow!("the request did not finish"))?;
    let n = token_ids.len();
    let decode_s = (m.e2e_s - m.ttft_s).max(1e-9);
    let tps = if n > 1 {
        (n - 1) as f64 / decode_s
    } else {
        0.0
    };
    if a.json {
        let mut metrics = m.summary();
        metrics["tok_s"] = serde_json::json!(tps);
        metrics["drafter"] = serde_json::json!(kind.label());
        out!(
            "{}",
            serde_json::json!({"text": full, "token_ids": token_ids, "finish_reason": reason.as_str(), "metrics": metrics})
        )?;
    } else {
        out!()?;
        eprintln!(
            "[{} prompt + {n} tokens, {tps:.1} tok/s, TTFT {:.0} ms, {:.2} tokens/target call, drafter {}, finish: {}]",
            m.prompt_tokens,
            m.ttft_s * 1000.0,
            m.committed_per_call(),
            kind.label(),
            reason.as_str()
        );
    }
    Ok(())
}
