//! Tokenizer from a `tokenizer.json` or from the GGUF's own metadata (BPE vocabulary, merges,
//! pre-tokenizer), plus the chat template and the stop tokens that go with it.
//!
//! candle's GGUF builder maps SmolLM2's `smollm` pre-tokenizer to GPT-2's default, which adds a
//! prefix space and gives wrong ids; `smollm` is digits-split + byte-level without prefix space
//! (ids then equal llama.cpp's), so we set that pipeline ourselves.

use crate::gguf::GgufFile;
use crate::{Result, RuntimeError};
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::processors::PostProcessorWrapper;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The same, reading special-token strings as ordinary text: for what a user wrote.
    plain: tokenizers::Tokenizer,
    /// The strings of control tokens (`<|im_end|>`, …), longest first: what `plain` reads as
    /// characters. (Added tokens not marked special, such as DeepSeek's `<｜User｜>` in its
    /// `tokenizer.json`, are matched in any text, as Hugging Face matches them.)
    specials: Vec<String>,
    /// One pass over a text for all of them (Llama 3 has 256 reserved tokens).
    find_special: Option<aho_corasick::AhoCorasick>,
    /// Control tokens, which text leaves out: not GGUF's user-defined tokens, which candle
    /// marks special too but are text (Qwen2.5's `<tool_call>`, which tool parsers look for).
    hidden: std::collections::HashSet<u32>,
    /// Added tokens the inner tokenizer marks special but that are text (GGUF's
    /// user-defined tokens), longest first, with their ids: `plain` would split them into
    /// characters, where Hugging Face's tokenizer (`special: false`) keeps them whole.
    visible: Vec<(String, u32)>,
    find_visible: Option<aho_corasick::AhoCorasick>,
    /// Token ids that end generation (the model's EOS and end-of-turn markers).
    pub stop_ids: Vec<u32>,
    pub bos: Option<(u32, String)>,
    pub eos: Option<(u32, String)>,
    pub chat_template: Option<String>,
    /// Whether a prompt given as text starts with the BOS token, as the model's own
    /// tokenizer encodes it (GGUF `tokenizer.ggml.add_bos_token`; a Hugging Face
    /// `tokenizer_config.json`'s `add_bos_token`, or a post-processor that adds it): Llama 3
    /// and Gemma do, SmolLM2 and Qwen2.5 do not.
    pub add_bos: bool,
}

fn tok_err(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// From a GGUF file path or a Hugging Face directory.
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            Self::from_hf_dir(path)
        } else {
            Self::from_gguf(&GgufFile::open(path)?)
        }
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let pre = g.meta_str("tokenizer.ggml.pre").unwrap_or_default();
        // candle's reader knows the Qwen2 and Llama-3-style pre-tokenizers by name and reads
        // any other as GPT-2's with a space added before every segment: wrong ids, silently.
        // The names whose splitting is known here are read; the others are refused.
        const KNOWN: [&str; 8] = [
            "qwen2",
            "llama3",
            "llama-bpe",
            "smaug-bpe",
            "lfm2",
            "smollm",
            "gpt2",
            "",
        ];
        if !KNOWN.contains(&pre.as_str()) {
            return Err(RuntimeError::Tokenizer(format!(
                "this GGUF's pre-tokenizer `{pre}` is not one this build splits text like (it \
                 reads {}); load the model's Hugging Face directory (tokenizer.json) instead",
                KNOWN[..7].join(", ")
            )));
        }
        if pre.is_empty() {
            // llama.cpp reads such a file as its `default` pre-tokenizer and warns too.
            tracing::warn!(
                "{}: no tokenizer.ggml.pre; text is split as GPT-2's, which may not be how \
                 this model's tokenizer splits it",
                g.path.display()
            );
        }
        // Llama 3's pre-tokenizer (llama.cpp's `llama-bpe`, candle's `llama3`): llama.cpp (and
        // Llama 3's tokenizer.json, `ignore_merges: true`) takes a word the vocabulary holds
        // whole as one token, even where the merges cannot build it, and adds BOS; candle does
        // either only where the file has the key, so both default to true here.
        let llama3 = pre == "llama-bpe" || pre == "llama3";
        let mut inner = if llama3 {
            use candle_core::quantized::gguf_file::Value;
            let mut metadata = g.content.metadata.clone();
            metadata.insert(
                "tokenizer.ggml.pre".to_string(),
                Value::String("llama3".to_string()),
            );
            metadata
                .entry("tokenizer.ggml.ignore_merges".to_string())
                .or_insert(Value::Bool(true));
            metadata
                .entry("tokenizer.ggml.add_bos_token".to_string())
                .or_insert(Value::Bool(true));
            let c = candle_core::quantized::gguf_file::Content {
                magic: g.content.magic,
                metadata,
                tensor_infos: Default::default(),
                tensor_data_offset: 0,
            };
            tokenizers::Tokenizer::from_gguf(&c)
        } else {
            tokenizers::Tokenizer::from_gguf(&g.content)
        }
        .map_err(|e| tok_err(crate::error::candle_message(&e)))?;
        if pre == "gpt2" || pre.is_empty() {
            // GPT-2's own tokenizer adds no space in front (candle's default does).
            inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        }
        if pre == "smollm" {
            inner.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])));
            inner.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
            inner.with_post_processor(None::<PostProcessorWrapper>);
        }
        let id_tok = |key: &str| -> Option<(u32, String)> {
            let id = u32::try_from(g.meta_u64(key)?).ok()?;
            let s = inner.id_to_token(id)?;
            Some((id, s))
        };
        let bos = id_tok("tokenizer.ggml.bos_token_id");
        let eos = id_tok("tokenizer.ggml.eos_token_id");
        // The file's word where it has one; else Llama 3's pre-tokenizer means BOS (as in
        // llama.cpp), any other none.
        let add_bos = match g.meta("tokenizer.ggml.add_bos_token") {
            Some(candle_core::quantized::gguf_file::Value::Bool(b)) => *b,
            Some(_) => false,
            None => llama3,
        };
        let chat_template = g.meta_str("tokenizer.chat_template");
        // llama.cpp's token types: 2 unknown, 3 control, 5 unused are not text; 4
        // (user-defined) is, as Hugging Face's `special: false` added tokens are.
        let hidden = match g.meta("tokenizer.ggml.token_type") {
            Some(candle_core::quantized::gguf_file::Value::Array(types)) => Some(
                types
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| matches!(token_type(t), Some(2 | 3 | 5)))
                    .map(|(i, _)| i as u32)
                    .collect(),
            ),
            _ => None,
        };
        let mut t = Self::finish(inner, bos, eos, chat_template, hidden);
        t.add_bos = add_bos;
        Ok(t)
    }

    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tj = dir.join("tokenizer.json");
        if !tj.exists() {
            return Err(RuntimeError::NotFound(tj.display().to_string()));
        }
        let inner = tokenizers::Tokenizer::from_file(&tj).map_err(tok_err)?;
        let mut bos = None;
        let mut eos = None;
        let mut chat_template = None;
        let mut add_bos = None;
        if let Ok(text) = std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            let v: serde_json::Value = serde_json::from_str(&text).map_err(tok_err)?;
            let tok_of = |k: &str| -> Option<(u32, String)> {
                let s = match &v[k] {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
                    _ => return None,
                };
                Some((inner.token_to_id(&s)?, s))
            };
            bos = tok_of("bos_token");
            eos = tok_of("eos_token");
            add_bos = v["add_bos_token"].as_bool();
            chat_template = hf_chat_template(&v["chat_template"]);
        }
        // Newer repositories keep the template in a file of its own.
        if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
            chat_template = Some(t);
        }
        let mut t = Self::finish(inner, bos, eos, chat_template, None);
        // Unsaid in the config: whatever the post-processor does (Llama 3's adds it).
        t.add_bos = add_bos.unwrap_or_else(|| {
            let bos = t.bos.as_ref().map(|b| b.0);
            t.inner
                .encode("a", true)
                .is_ok_and(|e| bos.is_some() && e.get_ids().first().copied() == bos)
        });
        // generation_config.json's end tokens stop generation too (Gemma's `<end_of_turn>`,
        // Llama 3's `<|eot_id|>` beside `<|end_of_text|>`).
        if let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) {
            // Only its end tokens are read here: a file that does not parse costs those.
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::warn!("{}: {e}; its end tokens are not read", dir.display());
                serde_json::Value::Null
            });
            let ids: Vec<u64> = match &v["eos_token_id"] {
                serde_json::Value::Number(n) => n.as_u64().into_iter().collect(),
                serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64()).collect(),
                _ => Vec::new(),
            };
            let vocab = t.vocab_size() as u64;
            for id in ids.into_iter().filter(|&i| i < vocab) {
                if !t.stop_ids.contains(&(id as u32)) {
                    t.stop_ids.push(id as u32);
                }
            }
        }
        Ok(t)
    }
}

/// tokenizer_config.json's `chat_template`: a string, or a list of named templates (then the
/// one named `default`, else the first).
fn hf_chat_template(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => {
            let named = |want: Option<&str>| {
                list.iter().find_map(|t| {
                    let name = t.get("name").and_then(|n| n.as_str());
                    if want.is_none() || name == want {
                        t.get("template")
                            .and_then(|x| x.as_str())
                            .map(str::to_string)
                    } else {
                        None
                    }
                })
            };
            named(Some("default")).or_else(|| named(None))
        }
        _ => None,
    }
}

impl Tokenizer {
    fn finish(
        inner: tokenizers::Tokenizer,
        bos: Option<(u32, String)>,
        eos: Option<(u32, String)>,
        chat_template: Option<String>,
        hidden: Option<std::collections::HashSet<u32>>,
    ) -> Self {
        let mut stop_ids: Vec<u32> = eos.iter().map(|(id, _)| *id).collect();
        for s in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<|end_of_text|>",
        ] {
            if let Some(id) = inner.token_to_id(s)
                && !stop_ids.contains(&id)
            {
                stop_ids.push(id);
            }
        }
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let added = inner.get_added_tokens_decoder();
        let hidden = hidden.unwrap_or_else(|| {
            added
                .iter()
                .filter(|(_, t)| t.special)
                .map(|(&id, _)| id)
                .collect()
        });
        let mut specials: Vec<String> = added
            .iter()
            .filter(|(id, t)| hidden.contains(id) && t.special && !t.content.is_empty())
            .map(|(_, t)| t.content.clone())
            .collect();
        specials.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        specials.dedup();
        let find_special = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&specials)
            .ok();
        let mut visible: Vec<(String, u32)> = added
            .iter()
            .filter(|(id, t)| !hidden.contains(id) && t.special && !t.content.is_empty())
            .map(|(&id, t)| (t.content.clone(), id))
            .collect();
        visible.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.cmp(b)));
        visible.dedup_by(|a, b| a.0 == b.0);
        let find_visible = (!visible.is_empty())
            .then(|| {
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(visible.iter().map(|v| v.0.as_str()))
                    .ok()
            })
            .flatten();
        Self {
            inner,
            plain,
            specials,
            find_special,
            hidden,
            visible,
            find_visible,
            stop_ids,
            bos,
            eos,
            chat_template,
            add_bos: false,
        }
    }

    /// The special-token strings (`<|im_start|>`, …), longest first.
    pub fn special_strings(&self) -> &[String] {
        &self.specials
    }

    /// The first special-token string in `text`, if any (one pass).
    pub fn special_in(&self, text: &str) -> Option<&str> {
        match &self.find_special {
            Some(ac) => {
                let m = ac.find(text)?;
                self.specials
                    .get(m.pattern().as_usize())
                    .map(String::as_str)
            }
            // No automaton (it could not be built): the same answer, one scan a string.
            None => self
                .specials
                .iter()
                .filter_map(|s| text.find(s.as_str()).map(|i| (i, s.as_str())))
                .min()
                .map(|(_, s)| s),
        }
    }

    /// Encodes `text` with the byte ranges `plain` (sorted, disjoint, on character
    /// boundaries) read as ordinary text: a user's `<|im_end|>` there is characters, not the
    /// end of their turn. Outside them special-token strings map to their ids, as in
    /// [`Self::encode`], which this equals when `plain` is empty.
    pub fn encode_with_plain(
        &self,
        text: &str,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut at = 0;
        let piece = |tok: &tokenizers::Tokenizer, s: &str, ids: &mut Vec<u32>| -> Result<()> {
            if !s.is_empty() {
                ids.extend_from_slice(tok.encode(s, false).map_err(tok_err)?.get_ids());
            }
            Ok(())
        };
        for r in plain {
            let (Some(before), Some(inside)) = (text.get(at..r.start), text.get(r.clone())) else {
                return Err(tok_err(format!("plain range {r:?} is not within the text")));
            };
            piece(&self.inner, before, &mut ids)?;
            // Control tokens are characters here; text tokens (GGUF user-defined) stay whole.
            let mut from = 0;
            if let Some(ac) = &self.find_visible {
                for m in ac.find_iter(inside) {
                    let Some(&(_, id)) = self.visible.get(m.pattern().as_usize()) else {
                        continue;
                    };
                    piece(&self.plain, &inside[from..m.start()], &mut ids)?;
                    ids.push(id);
                    from = m.end();
                }
            }
            piece(&self.plain, &inside[from..], &mut ids)?;
            at = r.end;
        }
        piece(&self.inner, text.get(at..).unwrap_or(""), &mut ids)?;
        Ok(ids)
    }

    /// Writes the tokenizer as a Hugging Face `tokenizer.json`.
    pub fn save_json(&self, path: &Path) -> Result<()> {
        self.inner.save(path, false).map_err(tok_err)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes text; special-token strings in it (e.g. `<|im_start|>`) map to their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(tok_err)?
            .get_ids()
            .to_vec())
    }

    /// Encodes a prompt given as text (a completion's), with the BOS token first when the
    /// model's tokenizer adds one ([`Tokenizer::add_bos`]), as Hugging Face's and vLLM's
    /// `add_special_tokens` do. Chat templates write their own.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        if let Some((b, _)) = self.bos.as_ref().filter(|_| self.add_bos)
            && ids.first() != Some(b)
        {
            ids.insert(0, *b);
        }
        Ok(ids)
    }

    /// Text of `ids`; `skip_special` leaves out control tokens (not user-defined ones).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        if skip_special {
            let kept: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|i| !self.hidden.contains(i))
                .collect();
            return self.inner.decode(&kept, false).map_err(tok_err);
        }
        self.inner.decode(ids, false).map_err(tok_err)
    }

    /// Whether tokens decode byte by byte (GPT-2 style byte-level BPE): then a token's text is
    /// exactly its bytes wherever it stands, which structured output relies on.
    pub fn is_byte_level(&self) -> bool {
        use tokenizers::DecoderWrapper;
        match self.inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => true,
            Some(DecoderWrapper::Sequence(seq)) => seq
                .get_decoders()
                .iter()
                .all(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
            _ => false,
        }
    }

    /// Ids of the special added tokens (chat markers, end-of-sequence and the like).
    pub fn special_ids(&self) -> std::collections::HashSet<u32> {
        self.inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect()
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes one token stands for. Byte-level BPE: its symbols mapped back to their bytes
    /// (a special token, or any other whose symbols are not all in the map, as its decoded
    /// text). Another vocabulary (SentencePiece style): a byte-fallback `<0xXX>` token as that
    /// byte, else the token's string with each `▁` a space. A token may hold part of a UTF-8
    /// character: these bytes are exact where its text is not.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        if let Some(s) = self.inner.id_to_token(id) {
            if !self.is_byte_level() {
                return piece_bytes(&s);
            }
            let bytes: Option<Vec<u8>> = s.chars().map(byte_of_symbol).collect();
            if let Some(b) = bytes {
                return b;
            }
        }
        self.decode(&[id], false)
            .map(String::into_bytes)
            .unwrap_or_default()
    }

    /// A stable hash of the vocabulary (id → token), used to check that two models share one.
    pub fn vocab_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for id in 0..self.vocab_size() as u32 {
            if let Some(t) = self.inner.id_to_token(id) {
                h.update(id.to_le_bytes());
                h.update(t.as_bytes());
            }
        }
        format!("{:x}", h.finalize())
    }
}

/// The bytes a token of a vocabulary that is not byte-level stands for: `<0xXX>` (byte
/// fallback) is that byte; otherwise the string, with SentencePiece's `▁` as a space.
fn piece_bytes(s: &str) -> Vec<u8> {
    match byte_fallback(s) {
        Some(b) => vec![b],
        None => s.replace('\u{2581}', " ").into_bytes(),
    }
}

/// The byte of a byte-fallback token, `<0xXX>`.
fn byte_fallback(s: &str) -> Option<u8> {
    let h = s.strip_prefix("<0x")?.strip_suffix('>')?;
    if h.len() != 2 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(h, 16).ok()
}

/// The byte a GPT-2 byte-level BPE symbol stands for: printable bytes stand for themselves,
/// the other 68 were shifted to U+0100.. in order.
fn byte_of_symbol(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let u = c as u32;
    if u < 256 && printable(u) {
        return Some(u as u8);
    }
    let n = u.checked_sub(256)?;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

/// Incremental detokenizer: emits text only once it is valid UTF-8 and stable, so multi-token
/// characters are never split in a stream.
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds one token; returns newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let prev = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        if now.len() > prev.len() && !now.ends_with('\u{fffd}') {
            let new = now.get(prev.len()..).unwrap_or("").to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(new))
        } else {
            Ok(None)
        }
    }

    /// Releases whatever text [`Self::push`] has held back (an unfinished UTF-8 character, or
    /// text that ends in U+FFFD, such as a token that is "�" itself), unconditionally: for the
    /// end of a stream (EOS, a token limit), where nothing more will complete it.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let prev = tok.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tok.decode(&self.ids[self.prefix..], true)?;
        let new = (prev.len()..=now.len())
            .find(|&i| now.is_char_boundary(i))
            .and_then(|i| now.get(i..))
            .unwrap_or("")
            .to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(new)
    }
}

/// A GGUF token type as a number.
fn token_type(v: &candle_core::quantized::gguf_file::Value) -> Option<i64> {
    use candle_core::quantized::gguf_file::Value::*;
    match v {
        I32(t) => Some(*t as i64),
        U32(t) => Some(*t as i64),
        I8(t) => Some(*t as i64),
        U8(t) => Some(*t as i64),
        I16(t) => Some(*t as i64),
        U16(t) => Some(*t as i64),
        I64(t) => Some(*t),
        U64(t) => i64::try_from(*t).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{self, Value};
    use std::str::FromStr;

    /// A GGUF holding only a tokenizer: the 256 byte-level symbols, `ab` (which no merge
    /// builds), `cd` (which the one merge does), and `<|begin_of_text|>` (BOS, a control
    /// token); `extra` adds keys (the pre-tokenizer among them) or replaces them.
    fn gguf_tokenizer(name: &str, extra: &[(&str, Value)]) -> Result<Tokenizer> {
        let mut tokens: Vec<String> = crate::tiny::byte_chars()
            .iter()
            .map(|c| c.to_string())
            .collect();
        tokens.extend(["ab", "cd", "<|begin_of_text|>"].map(String::from));
        let mut types = vec![Value::I32(1); tokens.len()];
        if let Some(last) = types.last_mut() {
            *last = Value::I32(3);
        }
        let strs =
            |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
        let mut md: Vec<(String, Value)> = vec![
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.tokens".into(), strs(&tokens)),
            ("tokenizer.ggml.merges".into(), strs(&["c d".to_string()])),
            ("tokenizer.ggml.token_type".into(), Value::Array(types)),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(258)),
        ];
        for (k, v) in extra {
            md.retain(|(key, _)| key.as_str() != *k);
            md.push((k.to_string(), v.clone()));
        }
        let md_ref: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let p = std::env::temp_dir().join(format!(
            "dspark-tok-unit-{}-{name}.gguf",
            std::process::id()
        ));
        let mut f = std::fs::File::create(&p).unwrap();
        gguf_file::write(&mut f, &md_ref, &[]).unwrap();
        drop(f);
        let t = Tokenizer::load(&p);
        let _ = std::fs::remove_file(&p);
        t
    }

    fn pre(name: &str) -> (&'static str, Value) {
        ("tokenizer.ggml.pre", Value::String(name.to_string()))
    }

    /// Llama 3's pre-tokenizer ignores merges for a word the vocabulary holds whole and adds
    /// BOS, as llama.cpp reads it, unless the file says otherwise; other pre-tokenizers (and a
    /// file that names none, read as GPT-2's) keep the file's word.
    /// GGUF user-defined tokens (type 4, Qwen2.5's `<tool_call>`) are text: kept whole in a
    /// user's plain text, as Hugging Face keeps its `special: false` added tokens, while a
    /// control token there is characters.
    #[test]
    fn gguf_user_defined_tokens_stay_whole_in_plain_text() {
        let mut tokens: Vec<String> = crate::tiny::byte_chars()
            .iter()
            .map(|c| c.to_string())
            .collect();
        tokens.extend(["ab", "cd", "<|begin_of_text|>", "<tool_call>"].map(String::from));
        let mut types = vec![Value::I32(1); tokens.len()];
        types[258] = Value::I32(3);
        types[259] = Value::I32(4);
        let strs = Value::Array(tokens.iter().map(|s| Value::String(s.clone())).collect());
        let t = gguf_tokenizer(
            "user-defined",
            &[
                ("tokenizer.ggml.tokens", strs),
                ("tokenizer.ggml.token_type", Value::Array(types)),
            ],
        )
        .unwrap();
        let text = "x<tool_call>y<|begin_of_text|><tool_call>";
        let whole = t.encode(text).unwrap();
        assert_eq!(whole, [120, 259, 121, 258, 259]);
        assert_eq!(
            t.encode_with_plain(text, &[0..text.len()]).unwrap()[..3],
            [120, 259, 121]
        );
        let plain = t.encode_with_plain(text, &[0..text.len()]).unwrap();
        assert_eq!(plain.last(), Some(&259));
        assert!(
            !plain.contains(&258),
            "a control token in plain text is characters"
        );
        assert_eq!(
            t.decode(&plain, false).unwrap(),
            text,
            "plain text decodes to itself"
        );
        // Only part plain: outside it both are tokens.
        assert_eq!(t.encode_with_plain(text, &[0..1]).unwrap(), whole);
    }

    #[test]
    fn llama3_gguf_ignores_merges_and_adds_bos_by_default() {
        for name in ["llama-bpe", "llama3"] {
            let t = gguf_tokenizer(name, &[pre(name)]).unwrap();
            assert_eq!(t.encode("ab").unwrap(), [256], "{name}");
            assert_eq!(t.encode("cd").unwrap(), [257], "{name}");
            assert!(t.add_bos, "{name}");
            assert_eq!(t.encode_prompt("ab").unwrap(), [258, 256], "{name}");
            // What the file says wins.
            let t = gguf_tokenizer(
                &format!("{name}-said"),
                &[
                    pre(name),
                    ("tokenizer.ggml.ignore_merges", Value::Bool(false)),
                    ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
                ],
            )
            .unwrap();
            assert_eq!(t.encode("ab").unwrap(), [97, 98], "{name}");
            assert!(!t.add_bos, "{name}");
            assert_eq!(t.encode_prompt("ab").unwrap(), [97, 98], "{name}");
        }
        for (name, extra) in [("gpt2", vec![pre("gpt2")]), ("none", vec![])] {
            let t = gguf_tokenizer(name, &extra).unwrap();
            assert_eq!(t.encode("ab").unwrap(), [97, 98], "{name}");
            assert_eq!(t.encode("cd").unwrap(), [257], "{name}");
            assert!(!t.add_bos, "{name}");
        }
    }

    /// A Llama-2-style (SentencePiece) tokenizer.json: `▁` for a space, `<0xXX>` byte
    /// fallback, no byte-level map.
    fn sentencepiece_tokenizer() -> Tokenizer {
        let json = r#"{
          "version": "1.0",
          "truncation": null,
          "padding": null,
          "added_tokens": [
            {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}
          ],
          "normalizer": null,
          "pre_tokenizer": null,
          "post_processor": null,
          "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
          ]},
          "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": {"<unk>": 0, "<0x0A>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "t": 5,
                      "▁t": 6, "é": 7, "▁▁": 8, "�": 9, "<0x41>x": 10},
            "merges": ["▁ t"]
          }
        }"#;
        let inner = tokenizers::Tokenizer::from_str(json).unwrap();
        Tokenizer::finish(inner, None, None, None, None)
    }

    #[test]
    fn token_bytes_of_a_sentencepiece_vocabulary() {
        let t = sentencepiece_tokenizer();
        assert!(!t.is_byte_level());
        let bytes = |id: u32| t.token_bytes(id);
        assert_eq!(bytes(1), [0x0A]);
        assert_eq!(bytes(2), [0xC3]);
        assert_eq!(bytes(3), [0xA9]);
        assert_eq!(bytes(4), b" ");
        assert_eq!(bytes(5), b"t");
        assert_eq!(bytes(6), b" t");
        assert_eq!(bytes(7), "é".as_bytes());
        assert_eq!(bytes(8), b"  ");
        assert_eq!(bytes(9), "�".as_bytes());
        assert_eq!(bytes(10), b"<0x41>x");
        assert_eq!(bytes(0), b"<unk>");
        // A character in byte-fallback tokens: its bytes, one a token.
        let mut two = bytes(2);
        two.extend(bytes(3));
        assert_eq!(std::str::from_utf8(&two).unwrap(), "é");
    }

    #[test]
    fn stream_decoder_finish_releases_held_text() {
        let t = sentencepiece_tokenizer();
        // A token that is "�" itself, then the end: push holds it, finish releases it.
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&t, 5).unwrap().as_deref(), Some("t"));
        assert_eq!(d.push(&t, 9).unwrap(), None);
        assert_eq!(d.finish(&t).unwrap(), "�");
        assert_eq!(d.finish(&t).unwrap(), "", "released once");
        // A character cut by the token limit: what there is of it.
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&t, 5).unwrap().as_deref(), Some("t"));
        assert_eq!(d.push(&t, 2).unwrap(), None);
        assert_eq!(d.finish(&t).unwrap(), "�");
        // A character completed: push releases it, finish has nothing left.
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&t, 2).unwrap(), None);
        assert_eq!(d.push(&t, 3).unwrap().as_deref(), Some("é"));
        assert_eq!(d.finish(&t).unwrap(), "");
        assert_eq!(StreamDecoder::new().finish(&t).unwrap(), "");
    }
}
