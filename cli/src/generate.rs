//! `dspark generate`.

use crate::config::Global;
use clap::Args;
use dspark_runtime::chat::{ChatTemplate, Message};
use dspark_runtime::generate::{GenerateParams, generate};
use dspark_runtime::{Model, Tokenizer};
use kernels::sampling::SamplingParams;
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
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(g: &Global, a: GenerateArgs) -> anyhow::Result<()> {
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        ..Default::default()
    };
    sampling.validate()?;
    if a.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    if a.prompt.is_empty() {
        anyhow::bail!("--prompt is empty");
    }
    let path = g.resolve_model(&a.model)?;
    let model = Model::load(&path, &g.load_opts())?;
    let tok = Tokenizer::load(&path)?;
    let text = if a.chat {
        ChatTemplate::from_tokenizer(&tok)?.render(&[Message::new("user", &a.prompt)], true)?
    } else {
        a.prompt.clone()
    };
    let ids = tok.encode(&text)?;
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling,
        seed: a.seed,
        ..Default::default()
    };
    let json = a.json;
    let mut stdout = std::io::stdout();
    let out = generate(&model, &tok, &ids, &params, &mut |s| {
        if !json {
            let _ = stdout.write_all(s.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    let n = out.token_ids.len();
    let tps = if out.decode_s > 0.0 {
        n as f64 / out.decode_s
    } else {
        0.0
    };
    if json {
        println!(
            "{}",
            serde_json::json!({
                "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                "metrics": {"prompt_tokens": out.prompt_tokens, "completion_tokens": n,
                            "prefill_s": out.prefill_s, "decode_s": out.decode_s, "tok_s": tps}
            })
        );
    } else {
        println!();
        eprintln!(
            "[{} prompt + {n} tokens, {:.1} tok/s decode, prefill {:.0} ms, finish: {}]",
            out.prompt_tokens,
            tps,
            out.prefill_s * 1000.0,
            out.finish_reason
        );
    }
    Ok(())
}
