//! Plain autoregressive decoding over the runtime (the baseline every speculative arm is compared
//! with, and `dspark generate --drafter none`).

use crate::json::{Format, JsonVocab};
use crate::model::{ForwardOptions, LogitsMode, Model, SeqInput};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::{Result, RuntimeError};
use kernels::rng::Rng;
use kernels::sampling::{SamplingParams, sample_logits};
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    /// Prefill chunk size (tokens per forward).
    pub prefill_chunk: usize,
    /// End-of-sequence and stop tokens are held back until this many tokens (vLLM's
    /// `min_tokens`).
    pub min_tokens: usize,
    /// More tokens that end generation; they are part of the output.
    pub stop_token_ids: Vec<u32>,
    /// Structured output: a JSON object, or a document of a schema ([`crate::json`]).
    pub json: Option<Format>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::greedy(),
            seed: 0,
            prefill_chunk: 256,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            json: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    /// "stop" (a stop token) or "length" (max_tokens or the context end).
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// Validates a request before any work: non-empty prompt, max_tokens ≥ 1, sampling values, and
/// a prompt that leaves room for at least one generated token.
pub fn validate(model: &Model, prompt: &[u32], p: &GenerateParams) -> Result<()> {
    if prompt.is_empty() {
        return Err(RuntimeError::Invalid("the prompt is empty".into()));
    }
    if p.max_tokens == 0 {
        return Err(RuntimeError::Invalid(
            "max_tokens must be at least 1".into(),
        ));
    }
    p.sampling.validate()?;
    p.sampling.validate_vocab(model.cfg.vocab_size)?;
    if p.min_tokens > p.max_tokens {
        return Err(RuntimeError::Invalid(format!(
            "min_tokens {} exceeds max_tokens {}",
            p.min_tokens, p.max_tokens
        )));
    }
    if p.json.is_some() && p.min_tokens > 0 {
        return Err(RuntimeError::Invalid(
            "min_tokens cannot be combined with JSON mode".into(),
        ));
    }
    if prompt.len() + 1 > model.cfg.max_ctx {
        return Err(RuntimeError::ContextOverflow {
            tokens: prompt.len() + 1,
            ctx: model.cfg.max_ctx,
        });
    }
    Ok(())
}

pub fn generate(
    model: &Model,
    tok: &Tokenizer,
    prompt: &[u32],
    p: &GenerateParams,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    validate(model, prompt, p)?;
    if p.json.is_some() && !tok.is_byte_level() {
        return Err(RuntimeError::Invalid(
            "structured output needs a byte-level BPE tokenizer; this model's is not".into(),
        ));
    }
    // Saturating: a max_tokens past the context (a client's usize::MAX) means "to the end".
    let total = prompt
        .len()
        .saturating_add(p.max_tokens)
        .min(model.cfg.max_ctx);
    let mut cache = model.new_cache(total, 16)?;
    let seq = cache.new_seq();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = prompt.chunks(p.prefill_chunk.max(1)).collect();
    for (i, c) in chunks.iter().enumerate() {
        let mode = if i + 1 == chunks.len() {
            LogitsMode::Last
        } else {
            LogitsMode::None
        };
        let out = model.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: c,
                logits: mode,
            }],
            &ForwardOptions::default(),
        )?;
        if mode == LogitsMode::Last {
            logits = out.row(0, 0).to_vec();
        }
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut rng = Rng::new(p.seed);
    let mut sampling = p.sampling.clone();
    let ends: Vec<u32> = tok
        .stop_ids
        .iter()
        .chain(&p.stop_token_ids)
        .copied()
        .collect();
    sampling.hold_end_tokens(prompt.len(), p.min_tokens, &ends);
    sampling.count_output_from(prompt.len());
    let json = p.json.as_ref().map(|f| (JsonVocab::new(tok), f));
    let mut doc = p.json.as_ref().map(Format::start);
    let mut seen: Vec<u32> = prompt.to_vec();
    let mut out_ids = Vec::new();
    let mut dec = StreamDecoder::new();
    let mut finish = "length";
    loop {
        if let (Some((jv, f)), Some(d)) = (&json, &doc) {
            jv.mask_doc(f, d, &mut logits);
        }
        let next = sample_logits(&logits, &seen, &sampling, &mut rng);
        if let (Some((jv, f)), Some(d)) = (&json, doc.as_mut()) {
            *d = jv.advance_doc(f, d, next).ok_or_else(|| {
                RuntimeError::Invalid(format!("token {next} breaks the JSON document"))
            })?;
        }
        if tok.is_stop(next) {
            finish = "stop";
            break;
        }
        out_ids.push(next);
        seen.push(next);
        if let Some(s) = dec.push(tok, next)? {
            on_text(&s);
        }
        if p.stop_token_ids.contains(&next) {
            finish = "stop";
            break;
        }
        if out_ids.len() >= p.max_tokens || prompt.len() + out_ids.len() >= model.cfg.max_ctx {
            break;
        }
        let o = model.forward(
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &[next],
                logits: LogitsMode::Last,
            }],
            &ForwardOptions::default(),
        )?;
        logits = o.row(0, 0).to_vec();
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let text = tok.decode(&out_ids, true)?;
    Ok(GenerateOutput {
        token_ids: out_ids,
        text,
        finish_reason: finish,
        prompt_tokens: prompt.len(),
        prefill_s,
        decode_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LoadOptions;
    use crate::gguf::GgufFile;
    use crate::tiny::{TinySpec, tiny_model_path};

    #[test]
    fn max_tokens_past_any_context_generates_to_the_context_end() {
        let p = tiny_model_path(&TinySpec::llama(4), "generate-unit").unwrap();
        let opts = LoadOptions {
            threads: 1,
            max_ctx: Some(24),
            ..Default::default()
        };
        let model = Model::load(&p, &opts).unwrap();
        let tok = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        let prompt = [1u32, 2, 3, 4];
        let params = GenerateParams {
            max_tokens: usize::MAX,
            ..Default::default()
        };
        let out = generate(&model, &tok, &prompt, &params, &mut |_| {}).unwrap();
        assert!(out.token_ids.len() <= 24 - prompt.len(), "{out:?}");
        if out.finish_reason == "length" {
            assert_eq!(out.token_ids.len(), 24 - prompt.len());
        }
    }
}
