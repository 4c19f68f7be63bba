//! JSON mode (OpenAI's `response_format: {"type": "json_object"}`): a byte-level JSON
//! validator small enough to copy once per vocabulary token, and the token mask it implies.
//!
//! The mask is part of the sampling transform: a token that cannot continue a valid JSON object
//! gets logit −∞ before anything else, and end-of-sequence is allowed only once the object is
//! closed. Plain decoding and speculative verification apply the same mask at every position,
//! so speculative output is exactly the masked target distribution.
//!
//! Two limits keep a small model from wandering: objects and arrays nest at most
//! [`MAX_DEPTH`] deep, and at most [`MAX_WS_RUN`] whitespace bytes follow each other outside
//! strings.

use crate::json_schema::{Pattern, Schema, SchemaState};
use crate::tokenizer::Tokenizer;
use std::sync::Arc;

/// Deepest nesting of objects and arrays.
pub const MAX_DEPTH: u8 = 64;
/// Longest run of whitespace bytes between tokens of the document.
pub const MAX_WS_RUN: u8 = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    /// Before the top-level object.
    Start,
    /// A value must start (after `:`, or `,` in an array).
    Value,
    /// After `{`: a key or `}`.
    ObjFirst,
    /// After `,` in an object: a key.
    ObjKey,
    /// After a key: `:`.
    Colon,
    /// After a value inside a container: `,` or its closer.
    After,
    /// After `[`: a value or `]`.
    ArrFirst,
    Str {
        key: bool,
    },
    Num(Num),
    /// Inside `true` (0), `false` (1) or `null` (2), `at` bytes matched.
    Lit {
        lit: u8,
        at: u8,
    },
    /// The top-level object is closed.
    Done,
}

const LITS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// What one byte did to a string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StrStep {
    More,
    Closed,
    Bad,
}

/// The inside of a JSON string, byte by byte: escapes, `\u` surrogates in pairs only, and
/// UTF-8 without overlong forms, surrogates or code points past U+10FFFF, so whatever it
/// takes decodes to the same text and parses with a strict parser.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StrChars {
    /// 0 characters, 1 after `\`, 2 `\u` digits, 3 a high surrogate wants `\`, 4 … `u`,
    /// 5 the low surrogate's digits.
    mode: u8,
    /// UTF-8 continuation bytes (mode 0) or hex digits (modes 2, 5) still due.
    due: u8,
    /// The range the next UTF-8 continuation byte must fall in.
    lo: u8,
    hi: u8,
    /// The `\u` digits so far.
    hex: u16,
}

impl StrChars {
    /// Between characters: printable ASCII but `"` and `\` only adds characters here.
    pub(crate) fn between_chars(&self) -> bool {
        self.mode == 0 && self.due == 0
    }

    /// Right after a `\`: the next byte names the escape.
    pub(crate) fn after_backslash(&self) -> bool {
        self.mode == 1
    }

    pub(crate) fn push(&mut self, b: u8) -> StrStep {
        use StrStep::*;
        match self.mode {
            0 if self.due > 0 => {
                if !(self.lo..=self.hi).contains(&b) {
                    return Bad;
                }
                self.due -= 1;
                (self.lo, self.hi) = (0x80, 0xBF);
                More
            }
            0 => {
                let (due, lo, hi) = match b {
                    b'"' => return Closed,
                    b'\\' => {
                        self.mode = 1;
                        return More;
                    }
                    0x20..=0x7F => return More,
                    0xC2..=0xDF => (1, 0x80, 0xBF),
                    0xE0 => (2, 0xA0, 0xBF),
                    0xE1..=0xEC | 0xEE..=0xEF => (2, 0x80, 0xBF),
                    0xED => (2, 0x80, 0x9F),
                    0xF0 => (3, 0x90, 0xBF),
                    0xF1..=0xF3 => (3, 0x80, 0xBF),
                    0xF4 => (3, 0x80, 0x8F),
                    _ => return Bad,
                };
                (self.due, self.lo, self.hi) = (due, lo, hi);
                More
            }
            1 => {
                match b {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.mode = 0,
                    b'u' => (self.mode, self.due, self.hex) = (2, 4, 0),
                    _ => return Bad,
                }
                More
            }
            2 | 5 => {
                let Some(d) = (b as char).to_digit(16) else {
                    return Bad;
                };
                self.hex = self.hex << 4 | d as u16;
                self.due -= 1;
                if self.due > 0 {
                    return More;
                }
                let (high, low) = (
                    (0xD800..=0xDBFF).contains(&self.hex),
                    (0xDC00..=0xDFFF).contains(&self.hex),
                );
                self.mode = match (self.mode, high, low) {
                    (2, true, _) => 3,
                    (2, _, true) | (5, _, false) => return Bad,
                    _ => 0,
                };
                More
            }
            3 if b == b'\\' => {
                self.mode = 4;
                More
            }
            4 if b == b'u' => {
                (self.mode, self.due, self.hex) = (5, 4, 0);
                More
            }
            _ => Bad,
        }
    }
}

/// Where a JSON document stands after some bytes. `Copy`: the mask tries every token on a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsonState {
    st: St,
    /// Bit d set: nesting level d is an object (else an array).
    kinds: u64,
    depth: u8,
    /// Whitespace bytes in a row.
    ws: u8,
    /// Inside a string: escapes and UTF-8 under way.
    chars: StrChars,
    /// Inside a number: digits of its integer part, then of its exponent.
    digits: u8,
}

/// Most digits of a number's integer part, and of its exponent: the largest number written is
/// under 1e200, which every JSON reader holds in an f64 (serde_json refuses `1e400`).
pub const MAX_INT_DIGITS: usize = 100;
pub const MAX_EXP_DIGITS: usize = 2;

impl Default for JsonState {
    fn default() -> Self {
        Self::new()
    }
}

impl JsonState {
    pub fn new() -> Self {
        Self {
            st: St::Start,
            kinds: 0,
            depth: 0,
            ws: 0,
            chars: StrChars::default(),
            digits: 0,
        }
    }

    /// Inside a string, between characters: any printable ASCII byte but `"` and `\` keeps
    /// it there (the mask's fast path).
    pub fn in_string(&self) -> bool {
        matches!(self.st, St::Str { .. }) && self.chars.between_chars()
    }

    /// Whether the document is a complete JSON object (then only the end may follow).
    pub fn complete(&self) -> bool {
        self.st == St::Done
    }

    /// Feeds bytes; false (and the state is then meaningless) if they cannot continue a valid
    /// document.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.push(b))
    }

    /// Feeds one byte; false if it cannot continue a valid document.
    pub fn push(&mut self, b: u8) -> bool {
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        match self.st {
            // Nothing follows the document but the end.
            St::Done => return false,
            St::Str { key } => {
                return match self.chars.push(b) {
                    StrStep::More => true,
                    StrStep::Closed => {
                        self.st = if key { St::Colon } else { St::After };
                        true
                    }
                    StrStep::Bad => false,
                };
            }
            St::Num(n) => return self.number_byte(n, b),
            St::Lit { lit, at } => {
                let word = LITS[lit as usize];
                if word.get(at as usize) != Some(&b) {
                    return false;
                }
                self.st = if at as usize + 1 == word.len() {
                    St::After
                } else {
                    St::Lit { lit, at: at + 1 }
                };
                return true;
            }
            _ => {}
        }
        // Structural states: whitespace, bounded.
        if ws {
            if self.ws >= MAX_WS_RUN {
                return false;
            }
            self.ws += 1;
            return true;
        }
        self.ws = 0;
        match (self.st, b) {
            (St::Start, b'{') => self.open(true),
            (St::Value | St::ArrFirst, _) => {
                if self.st == St::ArrFirst && b == b']' {
                    return self.close(false);
                }
                self.value_start(b)
            }
            (St::ObjFirst, b'}') => self.close(true),
            (St::ObjFirst | St::ObjKey, b'"') => {
                self.st = St::Str { key: true };
                self.chars = StrChars::default();
                true
            }
            (St::Colon, b':') => {
                self.st = St::Value;
                true
            }
            (St::After, b',') => {
                self.st = if self.top_is_object() {
                    St::ObjKey
                } else {
                    St::Value
                };
                true
            }
            (St::After, b'}') if self.top_is_object() => self.close(true),
            (St::After, b']') if !self.top_is_object() => self.close(false),
            _ => false,
        }
    }

    fn top_is_object(&self) -> bool {
        self.depth > 0 && self.kinds >> (self.depth - 1) & 1 == 1
    }

    fn open(&mut self, object: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        let bit = 1u64 << self.depth;
        self.kinds = if object {
            self.kinds | bit
        } else {
            self.kinds & !bit
        };
        self.depth += 1;
        self.st = if object { St::ObjFirst } else { St::ArrFirst };
        true
    }

    fn close(&mut self, object: bool) -> bool {
        if self.depth == 0 || self.top_is_object() != object {
            return false;
        }
        self.depth -= 1;
        self.st = if self.depth == 0 { St::Done } else { St::After };
        true
    }

    fn value_start(&mut self, b: u8) -> bool {
        self.st = match b {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b'"' => {
                self.chars = StrChars::default();
                St::Str { key: false }
            }
            b'-' => {
                self.digits = 0;
                St::Num(Num::Minus)
            }
            b'0'..=b'9' => {
                self.digits = 1;
                St::Num(if b == b'0' { Num::Zero } else { Num::Int })
            }
            b't' => St::Lit { lit: 0, at: 1 },
            b'f' => St::Lit { lit: 1, at: 1 },
            b'n' => St::Lit { lit: 2, at: 1 },
            _ => return false,
        };
        true
    }

    fn number_byte(&mut self, n: Num, b: u8) -> bool {
        use Num::*;
        let digit = b.is_ascii_digit();
        let next = match (n, b) {
            (Minus, b'0') => Some(Zero),
            (Minus, b'1'..=b'9') => Some(Int),
            (Int, _) if digit => Some(Int),
            (Zero | Int, b'.') => Some(Dot),
            (Dot | Frac, _) if digit => Some(Frac),
            (Zero | Int | Frac, b'e' | b'E') => Some(E),
            (E, b'+' | b'-') => Some(ESign),
            (E | ESign | Exp, _) if digit => Some(Exp),
            _ => None,
        };
        if let Some(s) = next {
            match (n, s) {
                (Minus, _) => self.digits = 1,
                (_, E) => self.digits = 0,
                (_, Int | Exp) => {
                    let max = if s == Int {
                        MAX_INT_DIGITS
                    } else {
                        MAX_EXP_DIGITS
                    };
                    if self.digits as usize >= max {
                        return false;
                    }
                    self.digits += 1;
                }
                _ => {}
            }
            self.st = St::Num(s);
            return true;
        }
        // The number ends here if it may; the byte then belongs to what follows it.
        if matches!(n, Zero | Int | Frac | Exp) {
            self.st = St::After;
            self.push(b)
        } else {
            false
        }
    }
}

/// Every token's bytes, for masking.
pub struct JsonVocab {
    /// Empty for tokens that may never appear in a document (special tokens, empty ones).
    bytes: Vec<Box<[u8]>>,
    /// End-of-sequence tokens: allowed once the object is complete.
    stop_ids: Vec<u32>,
    /// Tokens of printable ASCII without `"` or `\`: inside a string they only add
    /// characters, so the mask allows them there without running the validator.
    plain: Vec<bool>,
    /// Tokens that may appear in a document (not end-of-sequence, not special, not empty),
    /// grouped by their first byte.
    by_first: Vec<Vec<u32>>,
}

impl JsonVocab {
    pub fn new(tok: &Tokenizer) -> Self {
        let special = tok.special_ids();
        let bytes = (0..tok.vocab_size() as u32)
            .map(|id| {
                if special.contains(&id) {
                    Box::default()
                } else {
                    tok.token_bytes(id).into_boxed_slice()
                }
            })
            .collect::<Vec<Box<[u8]>>>();
        let plain = bytes
            .iter()
            .enumerate()
            .map(|(id, b)| {
                !tok.stop_ids.contains(&(id as u32))
                    && !b.is_empty()
                    && b.iter()
                        .all(|&c| (0x20..0x7F).contains(&c) && c != b'"' && c != b'\\')
            })
            .collect();
        let mut by_first = vec![Vec::new(); 256];
        for (id, b) in bytes.iter().enumerate() {
            if let Some(&first) = b.first()
                && !tok.stop_ids.contains(&(id as u32))
            {
                by_first[first as usize].push(id as u32);
            }
        }
        Self {
            bytes,
            stop_ids: tok.stop_ids.clone(),
            plain,
            by_first,
        }
    }

    /// Whether `token` may follow a document at `st` (end-of-sequence: only after a complete
    /// object).
    pub fn allows<D: Document>(&self, st: &D, token: u32) -> bool {
        if self.stop_ids.contains(&token) {
            return st.complete();
        }
        match self.bytes.get(token as usize) {
            Some(b) if !b.is_empty() => {
                let mut s = *st;
                s.push_bytes(b)
            }
            _ => false,
        }
    }

    /// Sets the logit of every token that may not follow `st` to −∞. Should nothing be allowed
    /// (a vocabulary without the byte needed), end-of-sequence stays open so the request ends.
    pub fn mask<D: Document>(&self, st: &D, logits: &mut [f32]) {
        self.mask_with(st, logits, true)
    }

    /// [`JsonVocab::mask`]; `fast: false` runs the validator on every candidate token (the
    /// reference the fast path is measured against).
    fn mask_with<D: Document>(&self, st: &D, logits: &mut [f32], fast: bool) {
        let mut keep = vec![false; logits.len()];
        let room = if fast { st.plain_room() } else { None };
        // Only tokens whose first byte the document takes can be allowed: outside strings that
        // is a handful of bytes, so most of the vocabulary is never run through the validator.
        for (b, group) in self.by_first.iter().enumerate() {
            let mut s = *st;
            if group.is_empty() || !s.push(b as u8) {
                continue;
            }
            // Outside strings a large group (tokens starting with a space: a third of the
            // vocabulary) mostly dies at its second byte: which bytes may follow is worked out
            // once, and only tokens that pass run the validator.
            let second = (fast && room.is_none() && group.len() > 64).then(|| {
                let mut ok = [false; 256];
                for (x, o) in ok.iter_mut().enumerate() {
                    let mut c = s;
                    *o = c.push(x as u8);
                }
                ok
            });
            for &t in group {
                let t = t as usize;
                let bytes = &self.bytes[t];
                let ok = if self.plain[t]
                    && let Some(r) = room
                {
                    bytes.len() <= r
                } else if let (Some(sec), Some(&x)) = (&second, bytes.get(1)) {
                    sec[x as usize] && {
                        let mut c = s;
                        c.push_bytes(&bytes[1..])
                    }
                } else {
                    let mut c = s;
                    c.push_bytes(&bytes[1..])
                };
                if let Some(k) = keep.get_mut(t) {
                    *k = ok;
                }
            }
        }
        if st.complete() {
            for &t in &self.stop_ids {
                if let Some(k) = keep.get_mut(t as usize) {
                    *k = true;
                }
            }
        }
        let mut any = false;
        for (l, &k) in logits.iter_mut().zip(&keep) {
            if k {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            for &t in &self.stop_ids {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = 0.0;
                }
            }
        }
    }

    /// The state after `token` (unchanged for end-of-sequence tokens); None if not allowed.
    pub fn advance<D: Document>(&self, st: &D, token: u32) -> Option<D> {
        if self.stop_ids.contains(&token) {
            return Some(*st);
        }
        let b = self.bytes.get(token as usize).filter(|b| !b.is_empty())?;
        let mut s = *st;
        s.push_bytes(b).then_some(s)
    }

    /// [`JsonVocab::mask`] for a request's format and document.
    pub fn mask_doc(&self, f: &Format, d: &Doc, logits: &mut [f32]) {
        self.mask_doc_with(f, d, logits, true)
    }

    /// [`JsonVocab::mask_doc`]; `fast: false` without the plain-token fast path (benchmarks).
    pub fn mask_doc_with(&self, f: &Format, d: &Doc, logits: &mut [f32], fast: bool) {
        match (f, d) {
            (Format::Object, Doc::Object(st)) => self.mask_with(st, logits, fast),
            (Format::Schema(schema), Doc::Schema(st)) => {
                self.mask_with(&Bound { schema, st: *st }, logits, fast)
            }
            (Format::Regex(p), Doc::Regex(s)) => {
                self.mask_with(&Matched { p, s: *s }, logits, fast)
            }
            // A document of another format: nothing may follow but the end.
            _ => self.mask_with(&Done, logits, fast),
        }
    }

    /// [`JsonVocab::advance`] for a request's format and document.
    pub fn advance_doc(&self, f: &Format, d: &Doc, token: u32) -> Option<Doc> {
        match (f, d) {
            (Format::Object, Doc::Object(st)) => self.advance(st, token).map(Doc::Object),
            (Format::Schema(schema), Doc::Schema(st)) => self
                .advance(&Bound { schema, st: *st }, token)
                .map(|b| Doc::Schema(b.st)),
            (Format::Regex(p), Doc::Regex(s)) => self
                .advance(&Matched { p, s: *s }, token)
                .map(|m| Doc::Regex(m.s)),
            _ => None,
        }
    }
}

/// What the mask needs of a document: bytes in, and whether it is complete or inside a string.
pub trait Document: Copy {
    fn push(&mut self, b: u8) -> bool;
    fn complete(&self) -> bool;
    /// Between characters of a string, where printable ASCII without `"` or `\` only adds
    /// characters: how many more it takes (the mask's fast path); None elsewhere.
    fn plain_room(&self) -> Option<usize>;
    fn push_bytes(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.push(b))
    }
}

impl Document for JsonState {
    fn push(&mut self, b: u8) -> bool {
        JsonState::push(self, b)
    }
    fn complete(&self) -> bool {
        JsonState::complete(self)
    }
    fn plain_room(&self) -> Option<usize> {
        JsonState::in_string(self).then_some(usize::MAX)
    }
}

/// A schema's document with its schema at hand.
#[derive(Clone, Copy)]
struct Bound<'a> {
    schema: &'a Schema,
    st: SchemaState,
}

/// A document that takes no byte and is complete (a format mismatch: only the end may follow).
#[derive(Clone, Copy)]
struct Done;

impl Document for Done {
    fn push(&mut self, _: u8) -> bool {
        false
    }
    fn complete(&self) -> bool {
        true
    }
    fn plain_room(&self) -> Option<usize> {
        None
    }
}

impl Document for Bound<'_> {
    fn push(&mut self, b: u8) -> bool {
        self.st.push(self.schema, b)
    }
    fn complete(&self) -> bool {
        self.st.complete()
    }
    fn plain_room(&self) -> Option<usize> {
        self.st.plain_room(self.schema)
    }
}

/// An answer against a whole-text regex, in DFA state `s`.
#[derive(Clone, Copy)]
struct Matched<'a> {
    p: &'a Pattern,
    s: u16,
}

impl Document for Matched<'_> {
    fn push(&mut self, b: u8) -> bool {
        match self.p.next(self.s, b) {
            Some(n) => {
                self.s = n;
                true
            }
            None => false,
        }
    }
    /// The text may end here (it may also go on).
    fn complete(&self) -> bool {
        self.p.accepts(self.s)
    }
    fn plain_room(&self) -> Option<usize> {
        None
    }
}

/// What a structured-output request's answer must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// Any JSON object (`response_format: json_object`).
    Object,
    /// A document of this schema (`response_format: json_schema`).
    Schema(Arc<Schema>),
    /// Text the whole of which matches this regex (vLLM's `guided_regex`, `guided_choice`).
    Regex(Arc<Pattern>),
}

impl Format {
    /// The empty document.
    pub fn start(&self) -> Doc {
        match self {
            Format::Object => Doc::Object(JsonState::new()),
            Format::Schema(s) => Doc::Schema(SchemaState::new(s)),
            Format::Regex(_) => Doc::Regex(0),
        }
    }

    /// Feeds `bytes` to a document of this format; false if they cannot continue it.
    pub fn feed(&self, d: &mut Doc, bytes: &[u8]) -> bool {
        match (self, d) {
            (Format::Object, Doc::Object(s)) => s.push_bytes(bytes),
            (Format::Schema(schema), Doc::Schema(s)) => s.push_bytes(schema, bytes),
            (Format::Regex(p), Doc::Regex(s)) => {
                let mut m = Matched { p, s: *s };
                let ok = m.push_bytes(bytes);
                *s = m.s;
                ok
            }
            _ => false,
        }
    }
}

/// Where an answer stands against its [`Format`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doc {
    Object(JsonState),
    Schema(SchemaState),
    /// The regex's DFA state.
    Regex(u16),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(doc: &str) -> Option<bool> {
        let mut s = JsonState::new();
        s.push_bytes(doc.as_bytes()).then_some(s.complete())
    }

    /// Numbers stay ones serde_json reads: `1e400` and a 101-digit integer are refused.
    #[test]
    fn numbers_stay_in_f64_range() {
        let big = "9".repeat(MAX_INT_DIGITS);
        for (doc, ok) in [
            (
                format!(r#"{{"x": [{big}, -{big}.{big}e-99, 0E+12, 7e99]}}"#),
                true,
            ),
            (r#"{"x": 1e400}"#.to_string(), false),
            (r#"{"x": -0.5e-100}"#.to_string(), false),
            (format!(r#"{{"x": {big}0}}"#), false),
            (format!(r#"{{"x": -{big}1}}"#), false),
        ] {
            assert_eq!(accepts(&doc) == Some(true), ok, "{doc}");
            if ok {
                assert!(
                    serde_json::from_str::<serde_json::Value>(&doc).is_ok(),
                    "{doc}"
                );
            }
        }
    }

    #[test]
    fn valid_objects_are_accepted_and_complete() {
        for doc in [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,-2.5e+3,0,0.25,1E9,true,false,null,\"x\"],\"b\":{\"c\":{}}}",
            "{\"s\": \"esc \\\" \\\\ \\/ \\b\\f\\n\\r\\t \\u00e9 é ü 日本 🙂\"}",
            "{\"e\": [], \"f\": [[], [{}]], \"g\": -0.0e-0}",
        ] {
            assert_eq!(accepts(doc), Some(true), "{doc}");
            assert!(serde_json::from_str::<serde_json::Value>(doc).is_ok());
            // Nothing follows a complete document, whitespace neither.
            assert_eq!(accepts(&format!("{doc}\n")), None, "{doc}");
        }
    }

    #[test]
    fn prefixes_are_accepted_but_not_complete() {
        let doc = "{\"a\": [1, {\"b\": \"c\\u00e9\"}], \"n\": -12.5e3}";
        for cut in 0..doc.len() {
            if doc.is_char_boundary(cut) {
                assert_eq!(accepts(&doc[..cut]), Some(false), "{}", &doc[..cut]);
            }
        }
        // A number at the end of a prefix is not closed yet.
        assert_eq!(accepts("{\"n\": 12"), Some(false));
    }

    #[test]
    fn invalid_documents_are_refused() {
        for doc in [
            "[1]",
            "\"s\"",
            "1",
            "{\"a\" 1}",
            "{\"a\": 01}",
            "{\"a\": 1,}",
            "{,}",
            "{\"a\": [1,]}",
            "{\"a\": tru}",
            "{\"a\": truex}",
            "{\"a\": -}",
            "{\"a\": 1.}",
            "{\"a\": 1e}",
            "{\"a\": \"x\ny\"}",
            "{\"a\": \"\\x\"}",
            "{\"a\": \"\\u12g4\"}",
            "{\"a\": 1]",
            "{\"a\": [1}",
            "{} {}",
            "{}x",
            "{a: 1}",
        ] {
            let got = accepts(doc);
            assert!(got != Some(true), "{doc} was accepted: {got:?}");
            assert!(
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(doc).is_err()
            );
        }
        // Invalid UTF-8 inside a string: a stray byte, a cut character, an overlong form, a
        // surrogate, past U+10FFFF; and `\u` surrogates out of pairs.
        let bad: [&[u8]; 9] = [
            b"{\"a\": \"\xff\"}",
            b"{\"a\": \"\xc3\"}",
            b"{\"a\": \"\xe0\x80\x80\"}",
            b"{\"a\": \"\xed\xa0\x80\"}",
            b"{\"a\": \"\xf4\x90\x80\x80\"}",
            b"{\"a\": \"\\ud800\"}",
            b"{\"a\": \"\\udc00\"}",
            b"{\"a\": \"\\ud800\\u0041\"}",
            b"{\"a\": \"\\ud800x\"}",
        ];
        for doc in bad {
            let mut s = JsonState::new();
            assert!(!s.push_bytes(doc), "{:?}", String::from_utf8_lossy(doc));
        }
        // A pair is fine, as are the largest code points.
        let good: [&[u8]; 2] = [
            b"{\"a\": \"\\ud83d\\ude00\"}",
            b"{\"a\": \"\xf4\x8f\xbf\xbf \xef\xbf\xbd\"}",
        ];
        for doc in good {
            let mut s = JsonState::new();
            assert!(s.push_bytes(doc) && s.complete());
            assert!(serde_json::from_slice::<serde_json::Value>(doc).is_ok());
        }
    }

    #[test]
    fn nesting_and_whitespace_are_bounded() {
        let deep = "[".repeat(MAX_DEPTH as usize - 1);
        let mut s = JsonState::new();
        assert!(s.push_bytes(format!("{{\"a\": {deep}").as_bytes()));
        assert!(!{
            let mut c = s;
            c.push(b'[')
        });
        let mut c = s;
        assert!(c.push(b']'));
        let mut s = JsonState::new();
        assert!(s.push_bytes(&[b' '; MAX_WS_RUN as usize]));
        let mut c = s;
        assert!(!c.push(b'\n'));
        assert!(s.push(b'{'));
        // Whitespace inside strings is content, not counted.
        assert!(s.push_bytes(format!("\"{}\"", " ".repeat(100)).as_bytes()));
    }

    /// A document fed bytes through its format (the reference the mask is checked against).
    fn feed(f: &Format, d: &mut Doc, bytes: &[u8]) -> bool {
        f.feed(d, bytes)
    }

    #[test]
    fn the_mask_allows_exactly_the_tokens_that_keep_the_document_valid() {
        let path = crate::tiny::tiny_model_path(&crate::tiny::TinySpec::llama(5), "json-mask")
            .expect("tiny model");
        let tok = Tokenizer::load(&path).expect("tokenizer");
        let jv = JsonVocab::new(&tok);
        let n = tok.vocab_size();
        let special = tok.special_ids();
        let schema = Schema::compile(&serde_json::json!({"type": "object", "required": ["a"],
            "properties": {"a": {"type": "string"}, "b": {"type": "number"},
                "c": {"enum": ["x", "yz", 3]}}}))
        .expect("schema");
        let bounded = Schema::compile(&serde_json::json!({"type": "object",
            "required": ["s", "p", "n", "m"],
            "properties": {"s": {"type": "string", "maxLength": 2},
                "p": {"type": "string", "pattern": "^[a-c]+-\\d$"},
                "n": {"type": "number", "minimum": -1.5, "maximum": 20},
                "m": {"additionalProperties": {"type": "boolean"}, "type": "object"}}}))
        .expect("schema");
        let regex = crate::json_schema::Pattern::full_match("(yes|no)[.!]?").expect("regex");
        // Any object: the last document stops inside a two-byte character. The schema: inside
        // a key, a string value, a number, an enum. Bounds: a string at its length, in a
        // pattern, a bounded number, a map's key. A whole-answer regex.
        let cases: [(Format, Vec<&[u8]>); 4] = [
            (
                Format::Object,
                vec![
                    b"",
                    b"{",
                    b"{\"a\": \"x y",
                    b"{\"a\": 1",
                    b"{}",
                    b"{\"a\":[tr",
                    b"{\"a\": \"\xc3",
                ],
            ),
            (
                Format::Schema(Arc::new(schema)),
                vec![
                    b"",
                    b"{\"",
                    b"{\"a\": \"x y",
                    b"{\"a\": \"\", \"b\": 1",
                    b"{\"a\":\"\",\"c\":\"y",
                    b"{\"a\":\"\"}",
                ],
            ),
            (
                Format::Schema(Arc::new(bounded)),
                vec![
                    b"{\"s\": \"a",
                    b"{\"s\": \"ab",
                    b"{\"s\": \"\", \"p\": \"ab",
                    b"{\"s\": \"\", \"p\": \"ab-",
                    b"{\"s\": \"\", \"p\": \"a-1\", \"n\": -1",
                    b"{\"s\": \"\", \"p\": \"a-1\", \"n\": 2",
                    b"{\"s\": \"\", \"p\": \"a-1\", \"n\": 0, \"m\": {\"k",
                ],
            ),
            (
                Format::Regex(Arc::new(regex)),
                vec![b"", b"y", b"yes", b"no!"],
            ),
        ];
        for (f, docs) in &cases {
            for doc in docs {
                let mut d = f.start();
                assert!(feed(f, &mut d, doc), "{doc:?}");
                let complete = match (f, d) {
                    (_, Doc::Object(s)) => s.complete(),
                    (_, Doc::Schema(s)) => s.complete(),
                    (Format::Regex(p), Doc::Regex(s)) => p.accepts(s),
                    _ => false,
                };
                let mut logits = vec![0f32; n];
                jv.mask_doc(f, &d, &mut logits);
                let mut allowed = 0;
                for t in 0..n as u32 {
                    let ok = tok.stop_ids.contains(&t) && complete
                        || !special.contains(&t) && {
                            let b = tok.token_bytes(t);
                            let mut c = d;
                            !b.is_empty() && feed(f, &mut c, &b)
                        };
                    assert_eq!(logits[t as usize].is_finite(), ok, "{doc:?} token {t}");
                    allowed += ok as usize;
                }
                assert!(allowed > 0, "{doc:?}");
            }
        }
    }
}
