//! Structured output (OpenAI's `response_format: {"type": "json_schema"}`, and the parameters
//! of a forced tool call): a JSON schema compiled into a byte-level validator whose state is
//! `Copy`, so the token mask of [`crate::json`] can try every vocabulary token on a copy.
//!
//! The supported subset covers what Pydantic models and OpenAI's strict schemas produce, and
//! everything the validator accepts conforms to the schema:
//! - `type`: `object` (`properties` in the order given, `required`; no other keys are
//!   produced), or with `additionalProperties: {schema}` and no `properties` a map of any
//!   keys; `array` (`items`, `minItems`, `maxItems`); `string` (`minLength`, `maxLength`,
//!   `pattern`, `format`); `integer` and `number` (`minimum`, `maximum`, `exclusiveMinimum`,
//!   `exclusiveMaximum`); `boolean`; `null`; a list of types;
//! - `enum` and `const` of any JSON values;
//! - `$ref` into the schema (`#/$defs/…`, `#/definitions/…`), not recursive;
//! - `anyOf` / `oneOf` whose branches a value's first byte tells apart (an optional field,
//!   `anyOf: [{…}, {"type": "null"}]`; unions of different types; any set of `enum`s and
//!   `const`s), and `allOf` of one schema;
//! - annotations (`title`, `description`, `default`, `examples`, …) are ignored, as are
//!   `format`s other than `date-time`, `date`, `time`, `uuid`, `email`, `ipv4`, `hostname`
//!   and `uri` (JSON Schema makes `format` an annotation).
//!
//! Anything else (recursive `$ref`, `multipleOf`, `uniqueItems`, unions of two objects, …) is
//! refused with a message naming it, rather than produced unchecked. The root must be an
//! object.
//!
//! Bounded numbers are written without an exponent (integers with at most 18 digits, numbers
//! with at most 9 integer and 6 fraction digits), and every prefix the validator takes can
//! still end inside the bounds. Strings under
//! a `pattern` or `format` are checked against a DFA of the pattern over their decoded bytes;
//! they take the short escapes (`\n`, `\"`, …) but not `\u`.

use crate::json::{StrChars, StrStep};
use std::collections::HashMap;
use std::fmt::Write as _;

/// Deepest nesting of objects and arrays a schema may have.
pub const MAX_DEPTH: usize = 12;
/// Most properties of one object, and most values of one `enum`.
pub const MAX_CHOICES: usize = 32;
/// Longest property name or `enum`/`const` value, as JSON text.
pub const MAX_TEXT: usize = 1024;
/// Longest run of whitespace bytes between tokens of the document.
pub const MAX_WS_RUN: u8 = 32;
/// Most DFA states of one `pattern` or `format`.
pub const MAX_PATTERN_STATES: usize = 4096;
/// Most distinct `pattern`s and `format`s of one schema (each is a DFA built per request).
pub const MAX_PATTERNS: usize = 16;
/// Most DFA states of all of one schema's patterns together: a table of 512 bytes a state,
/// so 8192 states hold 4 MiB while the request runs (16 patterns of 4096 states each would
/// hold 32 MiB, for a schema of a few hundred bytes).
pub const MAX_SCHEMA_PATTERN_STATES: usize = 8192;
/// Most references one `$ref` may lead through before reaching a schema that is not one.
pub const MAX_REF_CHAIN: usize = 32;
/// Largest `minLength`, `maxLength`, `minItems` or `maxItems`.
pub const MAX_COUNT: u64 = u16::MAX as u64 - 1;
/// Digits of a bounded `integer` (it fits an i64).
const INT_DIGITS: u32 = 18;
/// Integer and fraction digits of a bounded `number`: 15 digits in all, so parsers that read
/// it as a double keep its order against every bound (no two such decimals, nor one of them
/// and a double's shortest form of more digits, round to the same double). Its bounds count in
/// units of 10^-6.
const NUM_INT_DIGITS: u32 = 9;
const FRAC_DIGITS: u32 = 6;
const NUM_SCALE: i128 = 10i128.pow(FRAC_DIGITS);

/// The integer digits a bounded number may have.
fn int_digits(integer: bool) -> u32 {
    if integer { INT_DIGITS } else { NUM_INT_DIGITS }
}

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Object(Vec<Prop>),
    /// An object of any keys whose values are all of one schema.
    Map(u16),
    Array {
        item: u16,
        min: u16,
        max: u16,
    },
    String {
        min: u16,
        max: u16,
        pattern: Option<u16>,
    },
    Number(Num),
    /// The JSON texts the value may be (`enum`, `const`, `boolean`, `null`).
    Literals(Vec<Vec<u8>>),
    /// Branches with disjoint first bytes.
    AnyOf(Vec<u16>),
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Num {
    integer: bool,
    /// Inclusive bounds in units (1 for `integer`, 10^-6 for `number`), when bounded.
    bounds: Option<(i128, i128)>,
}

#[derive(Clone, Debug, PartialEq)]
struct Prop {
    /// The key as JSON text, quotes included.
    key: Vec<u8>,
    node: u16,
    required: bool,
}

/// A regular expression as a DFA over UTF-8 bytes, pruned to the states from which the text
/// can still match: a `pattern` or `format` over a JSON string's decoded bytes, or a whole
/// answer (vLLM's `guided_regex` and `guided_choice`). State 0 is the start.
#[derive(Clone, Debug, PartialEq)]
pub struct Pattern {
    /// `next[s * 256 + b]`, `DEAD` where no match can follow.
    next: Vec<u16>,
    /// Whether the string may end in state s.
    accept: Vec<bool>,
}

const DEAD: u16 = u16::MAX;

/// The short escapes a pattern string takes: the byte after `\` and the byte it stands for.
const ESCAPES: [(u8, u8); 8] = [
    (b'b', 0x08),
    (b'f', 0x0C),
    (b'n', b'\n'),
    (b'r', b'\r'),
    (b't', b'\t'),
    (b'"', b'"'),
    (b'\\', b'\\'),
    (b'/', b'/'),
];

impl Pattern {
    /// Compiles a JSON Schema (ECMA-262) `pattern`: unanchored, so the string must contain a
    /// match. Where ECMA-262 and the Unicode readings of Python and Rust differ (`\d`, `\w`,
    /// `.`), the narrower one is kept, so every reader accepts the string. Only characters a
    /// pattern string can write are read (no control characters but `\b\f\n\r\t`).
    fn compile(src: &str) -> Result<Self, String> {
        let label = format!("`pattern` {src:?}");
        if src.len() > MAX_REGEX {
            return Err(format!("{label} is longer than {MAX_REGEX} bytes"));
        }
        let rust = ecma_to_rust(src);
        // Alone first, so that an unbalanced pattern cannot close the wrapping's groups.
        regex_automata::util::syntax::parse(&rust)
            .map_err(|e| format!("{label} is not supported: {e}"))?;
        let writable = |b: u8| b >= 0x20 || ESCAPES.iter().any(|e| e.1 == b);
        Self::build(&format!("(?s:.*)(?:{rust})(?s:.*)"), &label, writable)
    }

    /// A regex the whole text must match (Rust `regex` syntax, Unicode classes), as vLLM's
    /// `guided_regex` has it.
    pub fn full_match(src: &str) -> Result<Self, String> {
        if src.len() > MAX_REGEX {
            return Err(format!("the regex is longer than {MAX_REGEX} bytes"));
        }
        regex_automata::util::syntax::parse(src)
            .map_err(|e| format!("regex {src:?} is not supported: {e}"))?;
        Self::build(&format!("(?:{src})"), &format!("regex {src:?}"), |_| true)
    }

    /// States of the automaton.
    fn states(&self) -> usize {
        self.accept.len()
    }

    /// A regex matching exactly one of `choices` (vLLM's `guided_choice`).
    pub fn one_of(choices: &[String]) -> Result<Self, String> {
        Self::full_match(&choice_regex(choices))
    }

    /// Whether the text may end in state `s`.
    pub fn accepts(&self, s: u16) -> bool {
        self.accept.get(s as usize).copied().unwrap_or(false)
    }

    /// The state after byte `b`; None where no match can follow.
    pub fn next(&self, s: u16, b: u8) -> Option<u16> {
        Some(self.step(s as u32, b)).filter(|&n| n != DEAD)
    }

    /// The DFA of `regex` over the bytes `writable` allows.
    fn build(regex: &str, src: &str, writable: impl Fn(u8) -> bool) -> Result<Self, String> {
        use regex_automata::{
            Anchored, MatchKind,
            dfa::{Automaton, StartKind, dense},
            util::{start, syntax},
        };
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(8 << 20))
                    .determinize_size_limit(Some(8 << 20)),
            )
            .syntax(syntax::Config::new().unicode(true).utf8(true))
            // The NFA is built before the DFA's limits apply: `a{4000000000}` would copy `a`
            // four billion times.
            .thompson(regex_automata::nfa::thompson::Config::new().nfa_size_limit(Some(1 << 20)))
            .build(regex)
            .map_err(|e| format!("{src} is not supported: {e}"))?;
        let s0 = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| format!("{src}: {e}"))?;
        let mut ids = HashMap::from([(s0, 0usize)]);
        let mut order = vec![s0];
        let mut next = Vec::new();
        let mut accept = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let s = order[i];
            accept.push(dfa.is_match_state(dfa.next_eoi_state(s)));
            for b in 0..=255u8 {
                let t = dfa.next_state(s, b);
                if dfa.is_dead_state(t) || dfa.is_quit_state(t) || !writable(b) {
                    next.push(DEAD);
                    continue;
                }
                let n = ids.len();
                let id = *ids.entry(t).or_insert_with(|| {
                    order.push(t);
                    n
                });
                if id >= MAX_PATTERN_STATES {
                    return Err(format!("{src} needs more than {MAX_PATTERN_STATES} states"));
                }
                next.push(id as u16);
            }
            i += 1;
        }
        // Keep only states from which an accepting one is reachable: a walk back from the
        // accepting states over reversed edges, O(states · 256). (Sweeping forward until
        // nothing changes takes a pass per state of a long chain: `[a-z]{4000}` took seconds.)
        let n = order.len();
        let mut back: Vec<Vec<u16>> = vec![Vec::new(); n];
        for s in 0..n {
            let mut last = DEAD;
            for &t in &next[s * 256..(s + 1) * 256] {
                // Runs of bytes to one state (a class) add one edge.
                if t != DEAD && t != last {
                    back[t as usize].push(s as u16);
                    last = t;
                }
            }
        }
        let mut live = accept.clone();
        let mut todo: Vec<usize> = (0..n).filter(|&s| live[s]).collect();
        while let Some(t) = todo.pop() {
            for &s in &back[t] {
                if !live[s as usize] {
                    live[s as usize] = true;
                    todo.push(s as usize);
                }
            }
        }
        if !live[0] {
            return Err(format!("{src} matches no string"));
        }
        for t in &mut next {
            if *t != DEAD && !live[*t as usize] {
                *t = DEAD;
            }
        }
        Ok(Self { next, accept })
    }

    /// Whether the whole of `bytes` is accepted.
    fn matches_all(&self, bytes: &[u8]) -> bool {
        let mut s = 0u16;
        for &b in bytes {
            match self.next(s, b) {
                Some(n) => s = n,
                None => return false,
            }
        }
        self.accepts(s)
    }

    fn step(&self, s: u32, b: u8) -> u16 {
        self.next
            .get(s as usize * 256 + b as usize)
            .copied()
            .unwrap_or(DEAD)
    }
}

/// Longest `guided_regex` (or `guided_choice`, joined), in bytes.
pub const MAX_REGEX: usize = 16 << 10;

/// The regex of exactly one of `choices`.
pub fn choice_regex(choices: &[String]) -> String {
    let alts: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
    alts.join("|")
}

/// `text` as a regex that matches it literally.
fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// White space in both ECMA-262's `\s` and Rust's, and in either.
const WS_BOTH: &str =
    r"\t\n\x0B\x0C\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}";
const WS_EITHER: &str = r"\t\n\x0B\x0C\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}";

/// An ECMA-262 pattern in the regex crate's syntax. Where the readings differ, the narrower
/// set is kept: `\d`, `\w` are ASCII (ECMA-262) where they add characters and Unicode (Python,
/// Rust) where a negated class takes them away; `.` leaves out the line terminators ECMA-262
/// does; inside a class, `[`, `&&`, `~~` and `--` are the literal characters ECMA-262 reads.
fn ecma_to_rust(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len() + 16);
    // Inside a class, and whether it is negated.
    let mut class: Option<bool> = None;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        i += 1;
        match (ch, class) {
            ('\\', _) => {
                let Some(&e) = c.get(i) else {
                    out.push('\\');
                    continue;
                };
                i += 1;
                let set = match e {
                    'd' | 'D' => "0-9",
                    'w' | 'W' => "0-9A-Za-z_",
                    // Neither reading of `\s` holds the other (U+0085 is Rust's only, U+FEFF
                    // ECMA-262's): both present, the intersection adds, the union takes away.
                    's' | 'S' => {
                        let negated = class == Some(true);
                        let lower = e == 's';
                        let set = if lower != negated { WS_BOTH } else { WS_EITHER };
                        let caret = if lower { "" } else { "^" };
                        out.push_str(&format!("[{caret}{set}]"));
                        continue;
                    }
                    _ => {
                        out.push('\\');
                        out.push(e);
                        continue;
                    }
                };
                // The ASCII set where the class shorthand adds (positive context), Unicode's
                // where it takes away (`\D`, `\W`, or inside a negated class).
                let negated = class == Some(true);
                if e.is_ascii_uppercase() == negated {
                    let caret = if e.is_ascii_uppercase() { "^" } else { "" };
                    out.push_str(&format!("[{caret}{set}]"));
                } else {
                    out.push('\\');
                    out.push(e);
                }
            }
            ('[', None) => {
                // `[\s\S]` is "any character" in every reading: kept whole (the narrowing
                // of each half would leave out U+0085 and U+FEFF).
                let rest: String = c[i..c.len().min(i + 5)].iter().collect();
                if rest == "\\s\\S]" || rest == "\\S\\s]" {
                    out.push_str(r"[\s\S]");
                    i += 5;
                    continue;
                }
                let negated = c.get(i) == Some(&'^');
                if negated {
                    i += 1;
                }
                if c.get(i) == Some(&']') {
                    // ECMA-262's empty class matches nothing; negated, anything.
                    i += 1;
                    out.push_str(if negated { r"[\s\S]" } else { r"[^\s\S]" });
                    continue;
                }
                out.push_str(if negated { "[^" } else { "[" });
                class = Some(negated);
            }
            (']', Some(_)) => {
                out.push(']');
                class = None;
            }
            ('[' | '&' | '~', Some(_)) => {
                out.push('\\');
                out.push(ch);
            }
            ('-', Some(_)) if c.get(i) == Some(&'-') || out.ends_with("\\-") => out.push_str("\\-"),
            ('.', None) => out.push_str(r"[^\n\r\x{2028}\x{2029}]"),
            _ => out.push(ch),
        }
    }
    out
}

/// The pattern of a `format` produced; others are annotations and ignored.
fn format_pattern(f: &str) -> Option<String> {
    const DATE: &str = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))";
    const TIME: &str = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
    const LABEL: &str = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
    const OCTET: &str = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
    Some(match f {
        "date" => format!("^{DATE}$"),
        "time" => format!("^{TIME}$"),
        "date-time" => format!("^{DATE}T{TIME}$"),
        "uuid" => {
            r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$".into()
        }
        "email" => format!(r"^[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@{LABEL}(?:\.{LABEL})+$"),
        "ipv4" => format!(r"^(?:{OCTET}\.){{3}}{OCTET}$"),
        "hostname" => format!(r"^{LABEL}(?:\.{LABEL})*$"),
        "uri" => r"^[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+$".into(),
        _ => return None,
    })
}

/// A compiled schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Schema {
    nodes: Vec<Node>,
    patterns: Vec<Pattern>,
    root: u16,
}

/// What compiling needs beside the arena: the whole schema (for `$ref`), the references being
/// expanded (a cycle is refused) and those done.
struct Compiler<'a> {
    doc: &'a serde_json::Value,
    expanding: Vec<String>,
    /// By reference and depth: the depth bounds what lies below.
    refs: HashMap<(String, usize), u16>,
    patterns: HashMap<String, u16>,
    /// `pattern`s and `format`s beside `enum`s and `const`s, compiled to filter the values.
    enum_patterns: usize,
}

/// Keywords that say nothing about which values are valid.
const ANNOTATIONS: [&str; 12] = [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "readOnly",
    "writeOnly",
    "deprecated",
];

impl Schema {
    /// Compiles a schema; an error names what is not supported.
    pub fn compile(v: &serde_json::Value) -> Result<Self, String> {
        let mut s = Self {
            nodes: Vec::new(),
            patterns: Vec::new(),
            root: 0,
        };
        if v.get("type").and_then(|t| t.as_str()) != Some("object")
            || v.get("enum").is_some()
            || v.get("const").is_some()
        {
            return Err(
                "the schema's root must have \"type\": \"object\" (and no `enum` or `const`)"
                    .into(),
            );
        }
        let mut c = Compiler {
            doc: v,
            expanding: Vec::new(),
            refs: HashMap::new(),
            patterns: HashMap::new(),
            enum_patterns: 0,
        };
        s.root = s.node(&mut c, v, 0)?;
        Ok(s)
    }

    fn push(&mut self, node: Node) -> Result<u16, String> {
        let id = u16::try_from(self.nodes.len())
            .ok()
            .filter(|&i| i < u16::MAX)
            .ok_or("the schema is too large")?;
        self.nodes.push(node);
        Ok(id)
    }

    fn node(
        &mut self,
        c: &mut Compiler<'_>,
        v: &serde_json::Value,
        depth: usize,
    ) -> Result<u16, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| format!("a schema must be an object, got {v}"))?;
        if depth >= MAX_DEPTH {
            return Err(format!("schemas nest at most {MAX_DEPTH} deep"));
        }
        let literal = obj.contains_key("enum") || obj.contains_key("const");
        if literal && obj.contains_key("enum") && obj.contains_key("const") {
            return Err("`enum` cannot be combined with `const`".into());
        }
        if literal && (obj.contains_key("pattern") || obj.contains_key("format")) {
            c.enum_patterns += 1;
            if c.enum_patterns > MAX_PATTERNS {
                return Err(format!(
                    "a schema takes at most {MAX_PATTERNS} `pattern`s or `format`s beside \
                     `enum`s and `const`s"
                ));
            }
        }
        const KNOWN: [&str; 20] = [
            "type",
            "properties",
            "required",
            "items",
            "enum",
            "const",
            "additionalProperties",
            "$ref",
            "anyOf",
            "oneOf",
            "allOf",
            "minItems",
            "maxItems",
            "minLength",
            "maxLength",
            "pattern",
            "format",
            "minimum",
            "maximum",
            "exclusiveMinimum",
        ];
        if let Some(k) = obj.keys().find(|k| {
            !KNOWN.contains(&k.as_str())
                && !ANNOTATIONS.contains(&k.as_str())
                && k.as_str() != "exclusiveMaximum"
        }) {
            return Err(format!("schema keyword `{k}` is not supported"));
        }
        // Combinators and references stand alone (beside annotations).
        let alone = |kw: &str| -> Result<(), String> {
            match obj
                .keys()
                .find(|k| k.as_str() != kw && !ANNOTATIONS.contains(&k.as_str()))
            {
                Some(k) => Err(format!("`{kw}` cannot be combined with `{k}`")),
                None => Ok(()),
            }
        };
        if let Some(r) = obj.get("$ref") {
            alone("$ref")?;
            let r = r.as_str().ok_or("`$ref` must be a string")?;
            return self.reference(c, r, depth);
        }
        if let Some(all) = obj.get("allOf") {
            alone("allOf")?;
            return match all.as_array().map(Vec::as_slice) {
                Some([one]) => self.node(c, one, depth),
                _ => Err("`allOf` is supported with one schema only".into()),
            };
        }
        for kw in ["anyOf", "oneOf"] {
            if let Some(list) = obj.get(kw) {
                alone(kw)?;
                let list = list
                    .as_array()
                    .filter(|l| !l.is_empty() && l.len() <= MAX_CHOICES)
                    .ok_or_else(|| format!("`{kw}` takes 1 to {MAX_CHOICES} schemas"))?;
                let mut branches = Vec::new();
                for b in list {
                    branches.push(self.node(c, b, depth)?);
                }
                return self.any_of(branches, kw);
            }
        }
        if let Some(types) = obj.get("type").and_then(|t| t.as_array()) {
            // A list of types: one branch per type, each with the other keywords.
            if obj.contains_key("enum") || obj.contains_key("const") {
                return Err("a list of types cannot be combined with `enum` or `const`".into());
            }
            if types.is_empty() || types.len() > 7 {
                return Err("`type` lists 1 to 7 types".into());
            }
            let mut branches = Vec::new();
            for t in types {
                let mut one = obj.clone();
                one.insert("type".into(), t.clone());
                branches.push(self.node(c, &serde_json::Value::Object(one), depth)?);
            }
            return self.any_of(branches, "type");
        }
        let literal_texts = |vals: &[serde_json::Value]| -> Result<Node, String> {
            if vals.is_empty() || vals.len() > MAX_CHOICES {
                return Err(format!("`enum` takes 1 to {MAX_CHOICES} values"));
            }
            // With `enum`/`const`, `type` may only restate what the values are.
            if let Some(k) = ["properties", "required", "items"]
                .iter()
                .find(|k| obj.contains_key(**k))
            {
                return Err(format!("`{k}` cannot be combined with `enum` or `const`"));
            }
            if let Some(t) = obj.get("type") {
                let fits = |x: &serde_json::Value| match t.as_str() {
                    Some("string") => x.is_string(),
                    Some("integer") => x.is_i64() || x.is_u64(),
                    Some("number") => x.is_number(),
                    Some("boolean") => x.is_boolean(),
                    Some("null") => x.is_null(),
                    Some("object") => x.is_object(),
                    Some("array") => x.is_array(),
                    _ => false,
                };
                if let Some(x) = vals.iter().find(|x| !fits(x)) {
                    return Err(format!("`enum`/`const` value {x} is not of type {t}"));
                }
            }
            let keep = enum_filter(obj)?;
            let mut texts: Vec<Vec<u8>> = Vec::new();
            for x in vals.iter().filter(|x| keep(x)) {
                let t = x.to_string().into_bytes();
                if !texts.contains(&t) {
                    texts.push(t);
                }
            }
            if texts.is_empty() {
                return Err("no `enum`/`const` value meets the schema's other keywords".into());
            }
            if texts.iter().any(|t| t.len() > MAX_TEXT) {
                return Err(format!(
                    "`enum`/`const` values are at most {MAX_TEXT} bytes"
                ));
            }
            Ok(Node::Literals(texts))
        };
        let count = |kw: &str| -> Result<Option<u16>, String> {
            match obj.get(kw) {
                None => Ok(None),
                Some(n) => n
                    .as_u64()
                    .filter(|&n| n <= MAX_COUNT)
                    .map(|n| Some(n as u16))
                    .ok_or_else(|| format!("`{kw}` must be an integer from 0 to {MAX_COUNT}")),
            }
        };
        let node = if let Some(x) = obj.get("const") {
            literal_texts(std::slice::from_ref(x))?
        } else if let Some(e) = obj.get("enum") {
            let vals = e.as_array().ok_or("`enum` must be a list")?;
            literal_texts(vals)?
        } else {
            match obj.get("type").and_then(|t| t.as_str()) {
                Some("object") => {
                    let required: Vec<&str> = match obj.get("required") {
                        None => Vec::new(),
                        Some(r) => r
                            .as_array()
                            .and_then(|a| a.iter().map(|x| x.as_str()).collect())
                            .ok_or("`required` must be a list of names")?,
                    };
                    let props = match obj.get("properties") {
                        None => None,
                        Some(p) => Some(p.as_object().ok_or("`properties` must be an object")?),
                    };
                    match obj.get("additionalProperties") {
                        // Without `properties`, an object of any keys and values is meant;
                        // all this would write is `{}`.
                        None | Some(serde_json::Value::Bool(true)) if props.is_none() => {
                            return Err("objects of any keys and values are not supported: \
                                give `properties`, or `additionalProperties` a schema (or \
                                use response_format json_object)"
                                .into());
                        }
                        None | Some(serde_json::Value::Bool(_)) => {}
                        Some(extra) => {
                            if props.is_some_and(|p| !p.is_empty()) || !required.is_empty() {
                                return Err("`additionalProperties` with a schema is \
                                    supported only without `properties` and `required`"
                                    .into());
                            }
                            let value = self.node(c, extra, depth + 1)?;
                            return self.push(Node::Map(value));
                        }
                    }
                    let empty = serde_json::Map::new();
                    let props = props.unwrap_or(&empty);
                    if props.len() > MAX_CHOICES {
                        return Err(format!("objects take at most {MAX_CHOICES} properties"));
                    }
                    if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
                        return Err(format!("required property `{r}` is not in `properties`"));
                    }
                    let mut out = Vec::new();
                    for (k, sub) in props {
                        if k.len() + 2 > MAX_TEXT {
                            return Err(format!("property names are at most {MAX_TEXT} bytes"));
                        }
                        let node = self.node(c, sub, depth + 1)?;
                        out.push(Prop {
                            key: serde_json::Value::String(k.clone())
                                .to_string()
                                .into_bytes(),
                            node,
                            required: required.contains(&k.as_str()),
                        });
                    }
                    Node::Object(out)
                }
                Some("array") => {
                    let items = obj.get("items").ok_or("an array schema needs `items`")?;
                    let min = count("minItems")?.unwrap_or(0);
                    let max = count("maxItems")?.unwrap_or(u16::MAX);
                    if min > max {
                        return Err("`minItems` is above `maxItems`".into());
                    }
                    Node::Array {
                        item: self.node(c, items, depth + 1)?,
                        min,
                        max,
                    }
                }
                Some("string") => {
                    let min = count("minLength")?.unwrap_or(0);
                    let max = count("maxLength")?.unwrap_or(u16::MAX);
                    if min > max {
                        return Err("`minLength` is above `maxLength`".into());
                    }
                    let src = match (obj.get("pattern"), obj.get("format")) {
                        (Some(p), None) => {
                            Some(p.as_str().ok_or("`pattern` must be a string")?.to_owned())
                        }
                        (None, Some(f)) => {
                            format_pattern(f.as_str().ok_or("`format` must be a string")?)
                        }
                        (Some(_), Some(_)) => {
                            return Err("`pattern` cannot be combined with `format`".into());
                        }
                        (None, None) => None,
                    };
                    let pattern = match src {
                        None => None,
                        Some(_) if min > 0 || max < u16::MAX => {
                            return Err("`minLength`/`maxLength` cannot be combined with \
                                `pattern` or `format` (say the length in the pattern)"
                                .into());
                        }
                        Some(src) => Some(match c.patterns.get(&src) {
                            Some(&i) => i,
                            None => {
                                if self.patterns.len() >= MAX_PATTERNS {
                                    return Err(format!(
                                        "a schema takes at most {MAX_PATTERNS} distinct \
                                         `pattern`s and `format`s"
                                    ));
                                }
                                let i = u16::try_from(self.patterns.len())
                                    .map_err(|_| "too many patterns")?;
                                let p = Pattern::compile(&src)?;
                                let states: usize =
                                    self.patterns.iter().chain([&p]).map(Pattern::states).sum();
                                if states > MAX_SCHEMA_PATTERN_STATES {
                                    return Err(format!(
                                        "a schema's `pattern`s and `format`s need at most \
                                         {MAX_SCHEMA_PATTERN_STATES} automaton states together \
                                         ({states} here)"
                                    ));
                                }
                                self.patterns.push(p);
                                c.patterns.insert(src, i);
                                i
                            }
                        }),
                    };
                    Node::String { min, max, pattern }
                }
                Some(t @ ("integer" | "number")) => {
                    Node::Number(number_bounds(obj, t == "integer")?)
                }
                Some("boolean") => Node::Literals(vec![b"true".to_vec(), b"false".to_vec()]),
                Some("null") => Node::Literals(vec![b"null".to_vec()]),
                Some(t) => return Err(format!("type `{t}` is not supported")),
                None => {
                    let mut m = String::from("each schema needs a `type`, `enum` or `const`");
                    let _ = write!(m, " (got {v})");
                    return Err(m);
                }
            }
        };
        self.push(node)
    }

    /// A `$ref` into this schema (a JSON pointer after `#`), compiled once.
    fn reference(&mut self, c: &mut Compiler<'_>, r: &str, depth: usize) -> Result<u16, String> {
        if let Some(&id) = c.refs.get(&(r.to_owned(), depth)) {
            return Ok(id);
        }
        let pointer = r
            .strip_prefix('#')
            .ok_or_else(|| format!("`$ref` {r:?} must point into the schema (`#/$defs/…`)"))?;
        if c.expanding.iter().any(|e| e == r) || pointer.is_empty() {
            return Err(format!("recursive `$ref` {r:?} is not supported"));
        }
        // A chain of references nests no data, so MAX_DEPTH does not bound it; the stack must.
        if c.expanding.len() >= MAX_REF_CHAIN {
            return Err(format!(
                "`$ref`s lead through at most {MAX_REF_CHAIN} others"
            ));
        }
        let target = c
            .doc
            .pointer(pointer)
            .ok_or_else(|| format!("`$ref` {r:?} points at nothing"))?;
        c.expanding.push(r.to_owned());
        let id = self.node(c, target, depth);
        c.expanding.pop();
        let id = id?;
        c.refs.insert((r.to_owned(), depth), id);
        Ok(id)
    }

    /// Branches a value's first byte tells apart. `enum`s and `const`s merge into one set of
    /// literals, and an unbounded `integer` beside an unbounded `number` adds nothing.
    fn any_of(&mut self, branches: Vec<u16>, kw: &str) -> Result<u16, String> {
        let mut flat = Vec::new();
        for b in branches {
            match &self.nodes[b as usize] {
                Node::AnyOf(inner) => flat.extend(inner.iter().copied()),
                _ => flat.push(b),
            }
        }
        // `oneOf` wants exactly one branch to match: branches that share a value are refused
        // rather than merged.
        let one = kw == "oneOf";
        let overlap = || "`oneOf` branches that share a value are not supported".to_string();
        let mut lits: Vec<Vec<u8>> = Vec::new();
        let mut rest = Vec::new();
        for &b in &flat {
            match &self.nodes[b as usize] {
                Node::Literals(l) => {
                    let mut mine: Vec<&Vec<u8>> = Vec::new();
                    for t in l {
                        if !lits.contains(t) {
                            lits.push(t.clone());
                            mine.push(t);
                        } else if one && !mine.contains(&t) {
                            return Err(overlap());
                        }
                    }
                }
                _ => rest.push(b),
            }
        }
        let unbounded = |n: &Node, integer: bool| matches!(n, Node::Number(Num { integer: i, bounds: None }) if *i == integer);
        if rest
            .iter()
            .any(|&b| unbounded(&self.nodes[b as usize], false))
        {
            if one
                && rest
                    .iter()
                    .any(|&b| unbounded(&self.nodes[b as usize], true))
            {
                return Err(overlap());
            }
            rest.retain(|&b| !unbounded(&self.nodes[b as usize], true));
        }
        if lits.len() > MAX_CHOICES {
            return Err(format!(
                "`{kw}` allows at most {MAX_CHOICES} literal values"
            ));
        }
        if !lits.is_empty() {
            rest.push(self.push(Node::Literals(lits))?);
        }
        for (i, &a) in rest.iter().enumerate() {
            for &b in &rest[i + 1..] {
                if let Some(x) = (0..=255u8).find(|&x| self.first(a, x) && self.first(b, x)) {
                    return Err(format!(
                        "`{kw}` branches must start differently (an object, an array, a \
                         string, a number, or literals); two of them can start with {:?}",
                        x as char
                    ));
                }
            }
        }
        match rest.as_slice() {
            [one] => Ok(*one),
            _ => self.push(Node::AnyOf(rest)),
        }
    }

    /// Whether a value of `node` may start with byte `b`.
    fn first(&self, node: u16, b: u8) -> bool {
        match self.nodes.get(node as usize) {
            Some(Node::Object(_) | Node::Map(_)) => b == b'{',
            Some(Node::Array { .. }) => b == b'[',
            Some(Node::String { .. }) => b == b'"',
            Some(Node::Number(_)) => b == b'-' || b.is_ascii_digit(),
            Some(Node::Literals(l)) => l.iter().any(|t| t.first() == Some(&b)),
            Some(Node::AnyOf(bs)) => bs.iter().any(|&n| self.first(n, b)),
            None => false,
        }
    }
}

/// Which `enum`/`const` values the keywords beside them allow (lengths, pattern, format,
/// bounds, item counts), as a validator reads them.
fn enum_filter(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<impl Fn(&serde_json::Value) -> bool, String> {
    // Read as strictly as beside a `type`: a bound that is not a number is an error, not
    // a bound dropped.
    let num = |k: &str| -> Result<Option<f64>, String> {
        obj.get(k)
            .map(|v| v.as_f64().ok_or_else(|| format!("`{k}` must be a number")))
            .transpose()
    };
    let count = |k: &str| -> Result<Option<u64>, String> {
        obj.get(k)
            .map(|v| v.as_u64().ok_or_else(|| format!("`{k}` must be a count")))
            .transpose()
    };
    let src = match (obj.get("pattern"), obj.get("format")) {
        (Some(p), None) => Some(p.as_str().ok_or("`pattern` must be a string")?.to_owned()),
        (None, Some(f)) => format_pattern(f.as_str().ok_or("`format` must be a string")?),
        (Some(_), Some(_)) => return Err("`pattern` cannot be combined with `format`".into()),
        (None, None) => None,
    };
    if obj.contains_key("additionalProperties") {
        return Err(
            "`additionalProperties` cannot be combined with `enum` or `const` \
                    (list only the objects it allows)"
                .into(),
        );
    }
    let pattern = src.map(|s| Pattern::compile(&s)).transpose()?;
    let (min_len, max_len) = (count("minLength")?, count("maxLength")?);
    let (min_items, max_items) = (count("minItems")?, count("maxItems")?);
    let (lo, hi) = (num("minimum")?, num("maximum")?);
    let (lo_ex, hi_ex) = (num("exclusiveMinimum")?, num("exclusiveMaximum")?);
    Ok(move |x: &serde_json::Value| match x {
        serde_json::Value::String(s) => {
            let n = s.chars().count() as u64;
            min_len.is_none_or(|m| n >= m)
                && max_len.is_none_or(|m| n <= m)
                && pattern.as_ref().is_none_or(|p| p.matches_all(s.as_bytes()))
        }
        serde_json::Value::Number(v) => v.as_f64().is_some_and(|v| {
            lo.is_none_or(|l| v >= l)
                && hi.is_none_or(|h| v <= h)
                && lo_ex.is_none_or(|l| v > l)
                && hi_ex.is_none_or(|h| v < h)
        }),
        serde_json::Value::Array(a) => {
            let n = a.len() as u64;
            min_items.is_none_or(|m| n >= m) && max_items.is_none_or(|m| n <= m)
        }
        _ => true,
    })
}

/// `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` as inclusive bounds in units.
fn number_bounds(
    obj: &serde_json::Map<String, serde_json::Value>,
    integer: bool,
) -> Result<Num, String> {
    let unit_scale = if integer { 0 } else { FRAC_DIGITS as i32 };
    let cap = if integer {
        10i128.pow(INT_DIGITS) - 1
    } else {
        10i128.pow(NUM_INT_DIGITS) * NUM_SCALE - 1
    };
    let mut lo = None;
    let mut hi = None;
    for (kw, low, exclusive) in [
        ("minimum", true, false),
        ("exclusiveMinimum", true, true),
        ("maximum", false, false),
        ("exclusiveMaximum", false, true),
    ] {
        let Some(x) = obj.get(kw) else { continue };
        let n = x
            .as_number()
            .ok_or_else(|| format!("`{kw}` must be a number"))?;
        // Rounded inward onto the unit grid; an exclusive bound on the grid moves one unit.
        let (q, exact) = to_units(&n.to_string(), unit_scale, low, cap)?;
        let b = match (low, exclusive && exact) {
            (true, true) => q.saturating_add(1),
            (false, true) => q.saturating_sub(1),
            _ => q,
        };
        if low {
            lo = Some(lo.map_or(b, |l: i128| l.max(b)));
        } else {
            hi = Some(hi.map_or(b, |h: i128| h.min(b)));
        }
    }
    if lo.is_none() && hi.is_none() {
        return Ok(Num {
            integer,
            bounds: None,
        });
    }
    let (lo, hi) = (lo.unwrap_or(-cap).max(-cap), hi.unwrap_or(cap).min(cap));
    if lo > hi {
        return Err(format!(
            "no {} is within the bounds (bounded integers have at most {INT_DIGITS} digits; \
             bounded numbers at most {NUM_INT_DIGITS} integer and {FRAC_DIGITS} fraction digits)",
            if integer { "integer" } else { "number" }
        ));
    }
    Ok(Num {
        integer,
        bounds: Some((lo, hi)),
    })
}

/// A JSON number's text times 10^scale, rounded up (`ceil`) or down, clamped just past `cap`;
/// and whether it was exact.
fn to_units(text: &str, scale: i32, ceil: bool, cap: i128) -> Result<(i128, bool), String> {
    let bad = || format!("bad number {text}");
    let (neg, t) = match text.strip_prefix('-') {
        Some(t) => (true, t),
        None => (false, text),
    };
    let (mant, exp) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], t[i + 1..].parse::<i32>().map_err(|_| bad())?),
        None => (t, 0),
    };
    let (int, frac) = mant.split_once('.').unwrap_or((mant, ""));
    let digits: String = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let e = exp.saturating_sub(frac.len() as i32).saturating_add(scale);
    let over = cap.saturating_add(1);
    let (mag, exact) = if digits.is_empty() {
        (0i128, true)
    } else if digits.len() > 38 {
        (over, true)
    } else {
        let m: i128 = digits.parse().map_err(|_| bad())?;
        if e >= 0 {
            let v = 10i128
                .checked_pow(e as u32)
                .and_then(|p| m.checked_mul(p))
                .unwrap_or(over);
            (v.min(over), true)
        } else if e < -38 {
            (0, false)
        } else {
            let p = 10i128.pow((-e) as u32);
            (m / p, m % p == 0)
        }
    };
    // Magnitude rounded toward zero; move outward where the rounding went the wrong way.
    let signed = if neg { -mag } else { mag };
    let v = match (exact, ceil, neg) {
        (false, true, false) => signed + 1,
        (false, false, true) => signed - 1,
        _ => signed,
    };
    Ok((v, exact))
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Frame {
    node: u16,
    stage: u8,
    /// Objects: the index of the next property that may come.
    next: u8,
    /// Keys or literals still possible (bit i); a pattern string's DFA state.
    cand: u32,
    /// Bytes matched of a key or literal; items of an array; characters of a string.
    pos: u16,
    /// Inside a string value, or a map's key.
    chars: StrChars,
}

/// A bounded number so far: integer part, fraction digits, sign.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct NumSoFar {
    int: u64,
    int_digits: u8,
    frac: u64,
    frac_digits: u8,
    neg: bool,
}

impl NumSoFar {
    /// Whether some way to go on from here (ending included) lands within `[lo, hi]` (in
    /// units: 1 for integers, 10^-6 for numbers), within the digits a bounded number has.
    fn feasible(&self, integer: bool, stage: u8, (lo, hi): (i128, i128)) -> bool {
        let unit: i128 = if integer { 1 } else { NUM_SCALE };
        let int = self.int as i128;
        // Magnitudes reachable, as closed ranges in units.
        let hit = |a: i128, b: i128| {
            let (a, b) = if self.neg { (-b, -a) } else { (a, b) };
            a <= hi && b >= lo
        };
        match stage {
            N_START | N_MINUS => hit(
                (integer && self.neg) as i128,
                10i128.pow(int_digits(integer)) * unit - 1,
            ),
            N_ZERO => hit(0, unit - 1),
            N_INT => (0..=int_digits(integer).saturating_sub(self.int_digits as u32)).any(|k| {
                let p = 10i128.pow(k);
                hit(int * p * unit, (int + 1) * p * unit - 1)
            }),
            N_DOT => hit(int * unit, int * unit + unit - 1),
            N_FRAC => {
                let step = 10i128.pow(FRAC_DIGITS - self.frac_digits as u32);
                let x = int * unit + self.frac as i128 * step;
                hit(x, x + step - 1)
            }
            _ => false,
        }
    }

    /// The value in units, if the number may end here.
    fn value(&self, integer: bool) -> i128 {
        let mag = if integer {
            self.int as i128
        } else {
            self.int as i128 * NUM_SCALE
                + self.frac as i128 * 10i128.pow(FRAC_DIGITS - self.frac_digits as u32)
        };
        if self.neg { -mag } else { mag }
    }
}

// Stages of a frame, by kind of node.
// Object: expect `{`, after `{`, in a key, before `:`, before a value, after a value, after `,`.
const O_OPEN: u8 = 0;
const O_FIRST: u8 = 1;
const O_KEY: u8 = 2;
const O_COLON: u8 = 3;
const O_VALUE: u8 = 4;
const O_AFTER: u8 = 5;
const O_COMMA: u8 = 6;
// Array: expect `[`, after `[`, after an item, after `,`.
const A_OPEN: u8 = 0;
const A_FIRST: u8 = 1;
const A_AFTER: u8 = 2;
const A_ITEM: u8 = 3;
// String: expect `"`, inside, closed.
const S_OPEN: u8 = 0;
const S_IN: u8 = 1;
const S_CLOSED: u8 = 2;
// Numbers: start, after `-`, `0`, integer digits, `.`, fraction digits, `e`, exponent sign,
// exponent digits.
const N_START: u8 = 0;
const N_MINUS: u8 = 1;
const N_ZERO: u8 = 2;
const N_INT: u8 = 3;
const N_DOT: u8 = 4;
const N_FRAC: u8 = 5;
const N_E: u8 = 6;
const N_ESIGN: u8 = 7;
const N_EXP: u8 = 8;

/// Where a document stands against a schema. `Copy`; every call takes the schema it was
/// started with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchemaState {
    frames: [Frame; MAX_DEPTH],
    depth: u8,
    ws: u8,
    done: bool,
    /// The bounded number being written (numbers are leaves: one at a time).
    num: NumSoFar,
}

impl SchemaState {
    pub fn new(schema: &Schema) -> Self {
        let mut frames = [Frame::default(); MAX_DEPTH];
        frames[0].node = schema.root;
        Self {
            frames,
            depth: 0,
            ws: 0,
            done: false,
            num: NumSoFar::default(),
        }
    }

    /// Whether the document is complete (then only the end may follow).
    pub fn complete(&self) -> bool {
        self.done
    }

    /// Inside a string value without a pattern, between characters: how many more
    /// characters it takes (the mask lets plain tokens that fit through without running the
    /// validator; each of their bytes is one character).
    pub fn plain_room(&self, schema: &Schema) -> Option<usize> {
        let f = self.frames.get((self.depth as usize).checked_sub(1)?)?;
        match schema.nodes.get(f.node as usize)? {
            Node::String {
                max, pattern: None, ..
            } if f.stage == S_IN && f.chars.between_chars() => Some(if *max == u16::MAX {
                usize::MAX
            } else {
                max.saturating_sub(f.pos) as usize
            }),
            _ => None,
        }
    }

    pub fn push_bytes(&mut self, schema: &Schema, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.push(schema, b))
    }

    fn space(&mut self, b: u8) -> Option<bool> {
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            if self.ws >= MAX_WS_RUN {
                return Some(false);
            }
            self.ws += 1;
            return Some(true);
        }
        self.ws = 0;
        None
    }

    /// Feeds one byte; false if it cannot continue a document the schema accepts.
    pub fn push(&mut self, schema: &Schema, b: u8) -> bool {
        if self.done {
            // Nothing follows the document but the end: trailing whitespace would only be
            // padding the model pays tokens for (and callers strip).
            return false;
        }
        if self.depth == 0 {
            // Before the root value.
            if let Some(ok) = self.space(b) {
                return ok;
            }
            return self.start_value(schema, self.frames[0].node, b);
        }
        let top = self.depth as usize - 1;
        let f = self.frames[top];
        let Some(node) = schema.nodes.get(f.node as usize) else {
            return false;
        };
        match node {
            Node::Object(props) => self.object_byte(schema, props, b),
            Node::Map(value) => self.map_byte(schema, *value, b),
            Node::Array { item, min, max } => self.array_byte(schema, *item, *min, *max, b),
            Node::String { min, max, pattern } => {
                let pattern = pattern.and_then(|p| schema.patterns.get(p as usize));
                let ok = self.string_byte(*min, *max, pattern, b);
                if ok && self.top().stage == S_CLOSED {
                    self.finish_value(schema);
                }
                ok
            }
            Node::Number(n) => self.number_byte(schema, *n, b),
            Node::Literals(lits) => self.literal_byte(schema, lits, b),
            // Never on the stack: `start_value` opens the branch instead.
            Node::AnyOf(_) => false,
        }
    }

    fn top(&mut self) -> &mut Frame {
        &mut self.frames[self.depth as usize - 1]
    }

    /// Opens a frame for `node` and feeds it its first byte.
    fn start_value(&mut self, schema: &Schema, node: u16, b: u8) -> bool {
        if self.depth as usize >= MAX_DEPTH {
            return false;
        }
        let cand = match schema.nodes.get(node as usize) {
            Some(Node::Literals(l)) => (1u64 << l.len()).wrapping_sub(1) as u32,
            Some(Node::AnyOf(branches)) => {
                return match branches.iter().find(|&&n| schema.first(n, b)) {
                    Some(&n) => self.start_value(schema, n, b),
                    None => false,
                };
            }
            Some(Node::Number(_)) => {
                self.num = NumSoFar::default();
                0
            }
            Some(_) => 0,
            None => return false,
        };
        self.frames[self.depth as usize] = Frame {
            node,
            stage: 0,
            next: 0,
            cand,
            pos: 0,
            chars: StrChars::default(),
        };
        self.depth += 1;
        self.push(schema, b)
    }

    /// The top frame's value is complete: back to its parent (or the document is done).
    fn finish_value(&mut self, schema: &Schema) {
        self.depth -= 1;
        if self.depth == 0 {
            self.done = true;
            return;
        }
        let parent = self.top();
        let node = parent.node;
        parent.stage = match schema.nodes.get(node as usize) {
            Some(Node::Array { .. }) => A_AFTER,
            _ => O_AFTER,
        };
    }

    fn object_byte(&mut self, schema: &Schema, props: &[Prop], b: u8) -> bool {
        let f = *self.top();
        // Keys that may come next: from `next` on, up to and including the first required one.
        let open_keys = || {
            let mut m = 0u32;
            for (i, p) in props.iter().enumerate().skip(f.next as usize) {
                m |= 1 << i;
                if p.required {
                    break;
                }
            }
            m
        };
        let may_close = props.iter().skip(f.next as usize).all(|p| !p.required);
        match f.stage {
            O_OPEN => {
                if b != b'{' {
                    return false;
                }
                self.top().stage = O_FIRST;
                true
            }
            O_FIRST | O_COMMA | O_AFTER | O_COLON | O_VALUE => {
                if let Some(ok) = self.space(b) {
                    return ok;
                }
                match (f.stage, b) {
                    (O_FIRST | O_COMMA, b'"') => {
                        let cand = open_keys();
                        if cand == 0 {
                            return false;
                        }
                        let t = self.top();
                        t.cand = cand;
                        t.pos = 1;
                        t.stage = O_KEY;
                        true
                    }
                    (O_FIRST | O_AFTER, b'}') if may_close => {
                        self.finish_value(schema);
                        true
                    }
                    (O_AFTER, b',') if open_keys() != 0 => {
                        self.top().stage = O_COMMA;
                        true
                    }
                    (O_COLON, b':') => {
                        self.top().stage = O_VALUE;
                        true
                    }
                    (O_VALUE, _) => {
                        let Some(p) = (f.next as usize).checked_sub(1).and_then(|i| props.get(i))
                        else {
                            return false;
                        };
                        self.start_value(schema, p.node, b)
                    }
                    _ => false,
                }
            }
            O_KEY => {
                let pos = f.pos as usize;
                let mut cand = 0u32;
                let mut done = None;
                for (i, p) in props.iter().enumerate() {
                    if f.cand >> i & 1 == 1 && p.key.get(pos) == Some(&b) {
                        cand |= 1 << i;
                        if p.key.len() == pos + 1 {
                            done = Some(i);
                        }
                    }
                }
                if cand == 0 {
                    return false;
                }
                let t = self.top();
                t.cand = cand;
                t.pos += 1;
                if let Some(i) = done {
                    // A key's closing quote: no other key can go on past it.
                    t.next = i as u8 + 1;
                    t.stage = O_COLON;
                }
                true
            }
            _ => false,
        }
    }

    /// An object of any keys (strings) whose values are of `value`.
    fn map_byte(&mut self, schema: &Schema, value: u16, b: u8) -> bool {
        let f = *self.top();
        if f.stage == O_OPEN {
            if b != b'{' {
                return false;
            }
            self.top().stage = O_FIRST;
            return true;
        }
        if f.stage == O_KEY {
            let t = self.top();
            return match t.chars.push(b) {
                StrStep::More => true,
                StrStep::Closed => {
                    t.stage = O_COLON;
                    true
                }
                StrStep::Bad => false,
            };
        }
        if let Some(ok) = self.space(b) {
            return ok;
        }
        match (f.stage, b) {
            (O_FIRST | O_COMMA, b'"') => {
                let t = self.top();
                t.chars = StrChars::default();
                t.stage = O_KEY;
                true
            }
            (O_FIRST | O_AFTER, b'}') => {
                self.finish_value(schema);
                true
            }
            (O_AFTER, b',') => {
                self.top().stage = O_COMMA;
                true
            }
            (O_COLON, b':') => {
                self.top().stage = O_VALUE;
                true
            }
            (O_VALUE, _) => self.start_value(schema, value, b),
            _ => false,
        }
    }

    fn array_byte(&mut self, schema: &Schema, item: u16, min: u16, max: u16, b: u8) -> bool {
        let f = *self.top();
        if f.stage == A_OPEN {
            if b != b'[' {
                return false;
            }
            self.top().stage = A_FIRST;
            return true;
        }
        if let Some(ok) = self.space(b) {
            return ok;
        }
        match (f.stage, b) {
            (A_FIRST | A_AFTER, b']') if f.pos >= min => {
                self.finish_value(schema);
                true
            }
            (A_AFTER, b',') if f.pos < max => {
                self.top().stage = A_ITEM;
                true
            }
            (A_FIRST | A_ITEM, b']') => false,
            (A_FIRST | A_ITEM, _) if f.pos < max => {
                self.top().pos += 1;
                self.start_value(schema, item, b)
            }
            _ => false,
        }
    }

    fn string_byte(&mut self, min: u16, max: u16, pattern: Option<&Pattern>, b: u8) -> bool {
        let t = self.top();
        if t.stage == S_OPEN {
            if b != b'"' {
                return false;
            }
            t.stage = S_IN;
            t.chars = StrChars::default();
            t.pos = 0;
            t.cand = 0;
            return true;
        }
        let before = t.chars;
        // A new character only where one more fits.
        if before.between_chars() && b != b'"' && max != u16::MAX && t.pos >= max {
            return false;
        }
        match t.chars.push(b) {
            StrStep::Bad => false,
            StrStep::Closed => {
                if t.pos < min || pattern.is_some_and(|p| !p.accept[t.cand as usize]) {
                    return false;
                }
                t.stage = S_CLOSED;
                true
            }
            StrStep::More => {
                if let Some(p) = pattern {
                    // The pattern reads the decoded string: an escape's byte once it is
                    // named, any other byte as it is.
                    let decoded = if before.after_backslash() {
                        match ESCAPES.iter().find(|e| e.0 == b) {
                            Some(&(_, x)) => Some(x),
                            None => return false,
                        }
                    } else if before.between_chars() && b == b'\\' {
                        // Only if some short escape can go on.
                        if ESCAPES.iter().all(|&(_, x)| p.step(t.cand, x) == DEAD) {
                            return false;
                        }
                        None
                    } else {
                        Some(b)
                    };
                    if let Some(x) = decoded {
                        let n = p.step(t.cand, x);
                        if n == DEAD {
                            return false;
                        }
                        t.cand = n as u32;
                    }
                }
                if t.chars.between_chars() {
                    t.pos = t.pos.saturating_add(1);
                    if t.pos > max {
                        return false;
                    }
                }
                true
            }
        }
    }

    fn number_byte(&mut self, schema: &Schema, n: Num, b: u8) -> bool {
        let s = self.top().stage;
        let digit = b.is_ascii_digit();
        let integer = n.integer;
        let exponent = n.bounds.is_none() && !integer;
        let next = match (s, b) {
            (N_START, b'-') => Some(N_MINUS),
            // `-0` is not written for an integer (some parsers read it as a float).
            (N_START, b'0') => Some(N_ZERO),
            (N_MINUS, b'0') if !integer => Some(N_ZERO),
            (N_START | N_MINUS, b'1'..=b'9') => Some(N_INT),
            (N_INT, _) if digit => Some(N_INT),
            (N_ZERO | N_INT, b'.') if !integer => Some(N_DOT),
            (N_DOT | N_FRAC, _) if digit => Some(N_FRAC),
            (N_ZERO | N_INT | N_FRAC, b'e' | b'E') if exponent => Some(N_E),
            (N_E, b'+' | b'-') => Some(N_ESIGN),
            (N_E | N_ESIGN | N_EXP, _) if digit => Some(N_EXP),
            _ => None,
        };
        if let Some(next) = next {
            if n.bounds.is_none() {
                // Unbounded, still one every JSON reader can hold in an f64 (`1e400` is out
                // of range for serde_json): counts in `num` (`frac_digits` counts the
                // exponent's).
                let num = &mut self.num;
                match next {
                    N_INT | N_ZERO if num.int_digits as usize >= crate::json::MAX_INT_DIGITS => {
                        return false;
                    }
                    N_INT | N_ZERO => num.int_digits += 1,
                    N_EXP if num.frac_digits as usize >= crate::json::MAX_EXP_DIGITS => {
                        return false;
                    }
                    N_EXP => num.frac_digits += 1,
                    _ => {}
                }
            }
            if let Some(bounds) = n.bounds {
                let mut num = self.num;
                let d = b.wrapping_sub(b'0') as u64;
                match next {
                    N_MINUS => num.neg = true,
                    N_INT | N_ZERO => {
                        if num.int_digits as u32 >= int_digits(integer) {
                            return false;
                        }
                        num.int = num.int * 10 + d;
                        num.int_digits += 1;
                    }
                    N_FRAC => {
                        if num.frac_digits as u32 >= FRAC_DIGITS {
                            return false;
                        }
                        num.frac = num.frac * 10 + d;
                        num.frac_digits += 1;
                    }
                    _ => {}
                }
                if !num.feasible(integer, next, bounds) {
                    return false;
                }
                self.num = num;
            }
            self.top().stage = next;
            return true;
        }
        // The number ends here if it may; the byte belongs to what follows.
        let in_bounds = n.bounds.is_none_or(|(lo, hi)| {
            let v = self.num.value(integer);
            lo <= v && v <= hi
        });
        if matches!(s, N_ZERO | N_INT | N_FRAC | N_EXP) && in_bounds && self.depth > 1 {
            self.finish_value(schema);
            self.push(schema, b)
        } else {
            false
        }
    }

    fn literal_byte(&mut self, schema: &Schema, lits: &[Vec<u8>], b: u8) -> bool {
        let f = *self.top();
        let pos = f.pos as usize;
        let mut cand = 0u32;
        let mut ended = false;
        for (i, l) in lits.iter().enumerate() {
            if f.cand >> i & 1 == 1 {
                if l.get(pos) == Some(&b) {
                    cand |= 1 << i;
                } else if l.len() == pos {
                    ended = true;
                }
            }
        }
        if cand != 0 {
            let t = self.top();
            t.cand = cand;
            t.pos += 1;
            return true;
        }
        // A literal that was complete ends here; the byte belongs to what follows.
        if ended && self.depth > 1 {
            self.finish_value(schema);
            return self.push(schema, b);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn schema() -> Schema {
        Schema::compile(&json!({
            "type": "object",
            "title": "a person",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "description": "years"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "color": {"enum": ["red", "green", 1, null]},
                "ok": {"type": "boolean"},
                "pos": {"type": "object", "properties": {"x": {"type": "number"}},
                        "required": ["x"], "additionalProperties": false},
                "v": {"const": [1, "a"]}
            },
            "required": ["name", "age"]
        }))
        .unwrap()
    }

    fn accepts(s: &Schema, doc: &str) -> Option<bool> {
        let mut st = SchemaState::new(s);
        st.push_bytes(s, doc.as_bytes()).then_some(st.complete())
    }

    /// Requests that would exhaust memory, time or the stack, and keywords that would be
    /// silently dropped, are refused, and quickly.
    #[test]
    fn hostile_and_silently_weakened_schemas_are_refused() {
        let t0 = std::time::Instant::now();
        for r in ["a{4000000000}", "(?:(?:a{1000}){1000}){1000}"] {
            assert!(Pattern::full_match(r).is_err(), "{r}");
        }
        let obj = |p: Value| json!({"type": "object", "properties": {"a": p}});
        let mut defs = serde_json::Map::new();
        for i in 0..100_000 {
            defs.insert(
                format!("d{i}"),
                json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        defs.insert("d100000".into(), json!({"type": "null"}));
        let mut chain = obj(json!({"$ref": "#/$defs/d0"}));
        chain["$defs"] = Value::Object(defs);
        let mut pats = serde_json::Map::new();
        for i in 0..MAX_PATTERNS + 1 {
            pats.insert(format!("p{i}"), json!({"enum": ["a"], "pattern": "^a$"}));
        }
        let big = json!({"type": "object", "properties": {
            "a": {"type": "string", "pattern": "^[a-z]{3000}$"},
            "b": {"type": "string", "pattern": "^[a-z]{2999}$"},
            "c": {"type": "string", "pattern": "^[a-z]{2998}$"},
        }});
        for (bad, says) in [
            (big, "automaton states together"),
            (chain, "lead through"),
            (
                obj(json!({"const": "a", "enum": ["b"]})),
                "cannot be combined with `const`",
            ),
            (
                obj(json!({"enum": ["ab"], "maxLength": 2.5})),
                "`maxLength` must be a count",
            ),
            (
                obj(json!({"enum": [3], "minimum": "3"})),
                "`minimum` must be a number",
            ),
            (
                obj(json!({"enum": ["a"], "pattern": 1})),
                "`pattern` must be a string",
            ),
            (
                obj(json!({"enum": ["a"], "pattern": "a", "format": "date"})),
                "cannot be combined with `format`",
            ),
            (
                obj(json!({"enum": [{"a": "x"}], "additionalProperties": {"type": "integer"}})),
                "`additionalProperties` cannot be combined",
            ),
            (obj(json!({"type": "object"})), "any keys and values"),
            (
                obj(json!({"type": "object", "additionalProperties": true})),
                "any keys and values",
            ),
            (json!({"type": "object"}), "any keys and values"),
            (
                json!({"type": "object", "properties": Value::Object(pats)}),
                "beside `enum`s",
            ),
        ] {
            let e = Schema::compile(&bad).expect_err(says);
            assert!(e.contains(says), "{says}: {e}");
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "{:?}",
            t0.elapsed()
        );
        // An object with no properties, said so, is `{}`; with a schema for values, a map.
        let s = Schema::compile(&obj(json!({"type": "object", "properties": {}}))).unwrap();
        assert_eq!(accepts(&s, r#"{"a": {}}"#), Some(true));
        // `\s` holds what both ECMA-262 and Rust call white space, `\S` what neither does.
        let ws = Pattern::compile("^\\s$").unwrap();
        let non = Pattern::compile("^\\S$").unwrap();
        let neg = Pattern::compile("^[^\\s]$").unwrap();
        for c in [" ", "\t", "\u{a0}", "\u{3000}"] {
            assert!(
                ws.matches_all(c.as_bytes()) && !non.matches_all(c.as_bytes()),
                "{c:?}"
            );
        }
        for c in ["\u{85}", "\u{feff}"] {
            assert!(
                !ws.matches_all(c.as_bytes()) && !non.matches_all(c.as_bytes()),
                "{c:?}"
            );
            assert!(!neg.matches_all(c.as_bytes()), "{c:?}");
        }
        assert!(non.matches_all(b"a") && neg.matches_all(b"a") && !ws.matches_all(b"a"));
        let any = Pattern::compile("^[\\s\\S]$").unwrap();
        for c in ["\u{85}", "\u{feff}", "a", " "] {
            assert!(any.matches_all(c.as_bytes()), "{c:?}");
        }
    }

    /// An unbounded number stays one serde_json reads: at most 100 integer digits and a
    /// two-digit exponent.
    #[test]
    fn unbounded_numbers_stay_in_f64_range() {
        let s = Schema::compile(&json!({"type": "object", "properties": {
            "x": {"type": "number"}, "n": {"type": "integer"}}}))
        .unwrap();
        let big = "9".repeat(100);
        for (doc, ok) in [
            (format!(r#"{{"x": 1.5e99, "n": {big}}}"#), true),
            (format!(r#"{{"x": -{big}.5E-99}}"#), true),
            (r#"{"x": 1e400}"#.to_string(), false),
            (r#"{"x": 1e+400}"#.to_string(), false),
            (format!(r#"{{"n": {big}9}}"#), false),
            (format!(r#"{{"x": {big}9}}"#), false),
        ] {
            assert_eq!(accepts(&s, &doc) == Some(true), ok, "{doc}");
            if ok {
                let v: Value = serde_json::from_str(&doc).expect(&doc);
                assert!(v.is_object());
            }
        }
    }

    #[test]
    fn documents_of_the_schema_are_accepted_in_property_order() {
        let s = schema();
        for doc in [
            "{\"name\": \"Al\", \"age\": 3}",
            " {\"name\":\"x\",\"age\":-1,\"tags\":[\"a\", \"b\"],\"color\":\"red\",\"ok\":true,\"pos\":{\"x\":1.5e3},\"v\":[1,\"a\"]}",
            "{\"name\": \"\\u00e9 \\\" é\", \"age\": 0, \"color\": 1}",
            "{\"name\": \"\", \"age\": 10, \"tags\": [], \"color\": null}",
            "{ \"name\" : \"q\" , \"age\" : 7 , \"pos\" : { \"x\" : -0.5 } }",
        ] {
            assert_eq!(accepts(&s, doc), Some(true), "{doc}");
            assert_eq!(
                accepts(&s, &format!("{doc} ")),
                None,
                "nothing follows: {doc}"
            );
            let v: serde_json::Value = serde_json::from_str(doc).unwrap();
            assert!(v["age"].is_i64() && v["name"].is_string(), "{v}");
        }
        // Prefixes are open, not complete.
        let doc = "{\"name\": \"x\", \"age\": 12, \"color\": \"green\"}";
        for cut in 0..doc.len() {
            assert_eq!(accepts(&s, &doc[..cut]), Some(false), "{}", &doc[..cut]);
        }
    }

    #[test]
    fn documents_outside_the_schema_are_refused() {
        let s = schema();
        for doc in [
            "{\"age\": 3, \"name\": \"Al\"}",
            "{\"age\": 3}",
            "{\"name\": \"x\", \"age\": 3.5}",
            "{\"name\": \"x\", \"age\": 1e3}",
            "{\"name\": \"x\", \"age\": 01}",
            "{\"name\": \"x\", \"age\": 1, \"color\": \"blue\"}",
            "{\"name\": \"x\", \"age\": 1, \"color\": \"redd\"}",
            "{\"name\": \"x\", \"age\": 1, \"zzz\": 1}",
            "{\"name\": \"x\", \"age\": 1, \"pos\": {}}",
            "{\"name\": 2, \"age\": 1}",
            "{\"name\": \"x\", \"age\": 1, \"ok\": 1}",
            "{\"name\": \"x\", \"age\": 1, \"tags\": [1]}",
            "{\"name\": \"x\", \"age\": 1, \"v\": [1, \"b\"]}",
            "{\"name\": \"x\", \"age\": 1,}",
            "{\"name\": \"x\", \"age\": 1, \"age\": 2}",
            "{\"name\": \"x\", \"age\": 1} x",
            "[1]",
        ] {
            assert_ne!(accepts(&s, doc), Some(true), "{doc}");
        }
    }

    /// What OpenAI's `parse()` sends for a Pydantic model (`to_strict_json_schema`): `$defs`
    /// and `$ref`, optional fields as `anyOf` with null, bounds, formats, a map.
    fn pydantic() -> Value {
        json!({
            "$defs": {"Addr": {"properties": {
                "city": {"title": "City", "type": "string"},
                "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Zip"}},
                "required": ["city", "zip"], "title": "Addr", "type": "object",
                "additionalProperties": false}},
            "properties": {
                "name": {"maxLength": 20, "title": "Name", "type": "string"},
                "age": {"maximum": 130, "minimum": 0, "title": "Age", "type": "integer"},
                "kind": {"enum": ["cat", "dog"], "title": "Kind", "type": "string"},
                "home": {"$ref": "#/$defs/Addr"},
                "tags": {"items": {"type": "string"}, "maxItems": 3, "title": "Tags",
                         "type": "array"},
                "born": {"format": "date", "title": "Born", "type": "string"},
                "id": {"format": "uuid", "title": "Id", "type": "string"},
                "score": {"maximum": 1, "minimum": 0, "title": "Score", "type": "number"},
                "extra": {"additionalProperties": {"type": "integer"}, "title": "Extra",
                          "type": "object"}},
            "required": ["name", "age", "kind", "home", "tags", "born", "id", "score", "extra"],
            "title": "P", "type": "object", "additionalProperties": false
        })
    }

    #[test]
    fn pydantic_schemas_compile_and_hold() {
        let s = Schema::compile(&pydantic()).unwrap();
        let good = |name: &str, age: &str, home: &str, tags: &str, born: &str, score: &str| {
            format!(
                "{{\"name\": {name}, \"age\": {age}, \"kind\": \"cat\", \"home\": {home}, \
                 \"tags\": {tags}, \"born\": {born}, \
                 \"id\": \"123e4567-e89b-12d3-a456-426614174000\", \"score\": {score}, \
                 \"extra\": {{\"a b\": 1, \"\": -2}}}}"
            )
        };
        let base = [
            "\"Tom\"",
            "3",
            "{\"city\": \"Oslo\", \"zip\": null}",
            "[\"a\"]",
            "\"2024-02-28\"",
            "0.25",
        ];
        let doc = |i: usize, x: &str| {
            let mut p = base;
            p[i] = x;
            good(p[0], p[1], p[2], p[3], p[4], p[5])
        };
        assert_eq!(
            accepts(&s, &doc(0, base[0])),
            Some(true),
            "{}",
            doc(0, base[0])
        );
        for (i, x) in [
            (0, "\"12345678901234567890\""),
            (0, "\"\\n\\u00e9\""),
            (1, "0"),
            (1, "130"),
            (2, "{\"city\": \"Oslo\", \"zip\": \"0150\"}"),
            (3, "[]"),
            (3, "[\"a\", \"b\", \"c\"]"),
            (4, "\"2000-12-31\""),
            (5, "0"),
            (5, "1"),
            (5, "1.000"),
            (5, "0.999999"),
        ] {
            assert_eq!(accepts(&s, &doc(i, x)), Some(true), "{}", doc(i, x));
        }
        for (i, x) in [
            (0, "\"123456789012345678901\""),
            (1, "-1"),
            (1, "131"),
            (1, "1300"),
            (1, "1.0"),
            (2, "{\"city\": \"Oslo\"}"),
            (2, "{\"city\": \"Oslo\", \"zip\": 150}"),
            (3, "[\"a\", \"b\", \"c\", \"d\"]"),
            (4, "\"2024-02-30\""),
            (4, "\"2024-2-3\""),
            (5, "1.0000000000000000001"),
            (5, "0.999999999999999999"),
            (5, "0.1234567"),
            (5, "-0.1"),
            (5, "2"),
            (5, "1e-3"),
        ] {
            assert_ne!(accepts(&s, &doc(i, x)), Some(true), "{}", doc(i, x));
        }
        let bad_id = doc(0, base[0]).replace("426614174000", "42661417400g");
        assert_ne!(accepts(&s, &bad_id), Some(true));
        let bad_map = doc(0, base[0]).replace("\"\": -2", "\"\": \"x\"");
        assert_ne!(accepts(&s, &bad_map), Some(true));
        // Properties follow the schema's order, not their names'.
        let swapped = doc(0, base[0]).replace(
            "\"name\": \"Tom\", \"age\": 3",
            "\"age\": 3, \"name\": \"Tom\"",
        );
        assert_ne!(accepts(&s, &swapped), Some(true));
    }

    #[test]
    fn numbers_end_only_inside_their_bounds_and_never_strand() {
        let cases = [
            json!({"type": "integer", "minimum": -5, "maximum": 17}),
            json!({"type": "integer", "exclusiveMinimum": 9, "exclusiveMaximum": 1000}),
            json!({"type": "integer", "minimum": 2.5, "maximum": 2.9e1}),
            json!({"type": "number", "minimum": -0.5, "exclusiveMaximum": 0.25}),
            json!({"type": "number", "minimum": 120, "maximum": 125.5}),
            json!({"type": "number", "exclusiveMinimum": 0}),
        ];
        for (n, c) in cases.iter().enumerate() {
            let s = Schema::compile(&json!({"type": "object", "required": ["a"],
                "properties": {"a": c}}))
            .unwrap();
            let lo = c
                .get("minimum")
                .or(c.get("exclusiveMinimum"))
                .and_then(Value::as_f64);
            let hi = c
                .get("maximum")
                .or(c.get("exclusiveMaximum"))
                .and_then(Value::as_f64);
            let (lo_ex, hi_ex) = (
                c.get("exclusiveMinimum").is_some(),
                c.get("exclusiveMaximum").is_some(),
            );
            let inside = |x: f64| {
                lo.is_none_or(|l| if lo_ex { x > l } else { x >= l })
                    && hi.is_none_or(|h| if hi_ex { x < h } else { x <= h })
            };
            let integer = c["type"] == "integer";
            // Every number text up to 5 characters over `-0123456789.`: accepted exactly
            // when it is a number of the type within the bounds.
            let alphabet = b"-0123456789.";
            let mut texts = vec![String::new()];
            for _ in 0..5 {
                let mut more = Vec::new();
                for t in &texts {
                    for &ch in alphabet {
                        more.push(format!("{t}{}", ch as char));
                    }
                }
                texts.extend(more);
                texts.dedup();
            }
            texts.sort();
            texts.dedup();
            for t in texts.iter().filter(|t| !t.is_empty()) {
                let doc = format!("{{\"a\": {t}}}");
                let parsed = serde_json::from_str::<Value>(&doc).ok();
                // (`-0` is an integer to JSON Schema, but not written for one.)
                let want = parsed.as_ref().is_some_and(|v| {
                    let a = v["a"].as_f64();
                    a.is_some_and(|x| inside(x) && (!integer || x.fract() == 0.0))
                }) && !(integer && (t.contains('.') || t.starts_with("-0")));
                assert_eq!(accepts(&s, &doc) == Some(true), want, "case {n}: {doc}");
                // Every prefix the validator takes can still end inside the bounds.
                let mut st = SchemaState::new(&s);
                assert!(st.push_bytes(&s, b"{\"a\": "));
                let mut ok = true;
                for &b in t.as_bytes() {
                    ok = st.push(&s, b);
                    if !ok {
                        break;
                    }
                }
                if ok && !st.clone().push(&s, b'}') {
                    assert!(
                        alphabet.iter().any(|&b| st.clone().push(&s, b)),
                        "case {n}: {t} is a dead end"
                    );
                }
            }
        }
        let e = Schema::compile(&json!({"type": "object", "properties":
            {"a": {"type": "integer", "minimum": 3, "maximum": 2.5}}}))
        .unwrap_err();
        assert!(e.contains("bounds"), "{e}");
    }

    /// A long chain of states (near the state cap) compiles at once: the liveness walk is
    /// linear. A forward sweep until nothing changed took a pass per state (about a second
    /// per such pattern in release, many in a debug build), on the server's async runtime.
    #[test]
    fn a_pattern_near_the_state_cap_compiles_quickly() {
        let t0 = std::time::Instant::now();
        let p = Pattern::full_match("[a-z]{4000}").unwrap();
        let took = t0.elapsed();
        assert!(p.matches_all("x".repeat(4000).as_bytes()));
        assert!(!p.matches_all("x".repeat(3999).as_bytes()));
        assert!(took < std::time::Duration::from_secs(2), "{took:?}");
        // States that reach an accepting one only through bytes that cannot be written are
        // dead: `b` (which needs a `c`) here, and the whole of `bc`.
        let p = Pattern::build("(?:a|bc+)", "t", |b| b != b'c').unwrap();
        assert!(p.matches_all(b"a"));
        assert_eq!(p.next(0, b'b'), None);
        let e = Pattern::build("(?:bc)", "t", |b| b != b'c')
            .map(|_| ())
            .unwrap_err();
        assert!(e.contains("matches no string"), "{e}");
    }

    #[test]
    fn patterns_and_formats_hold_on_the_decoded_string() {
        let s = Schema::compile(&json!({"type": "object", "required": ["a", "b", "c", "d"],
            "properties": {
                "a": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
                "b": {"type": "string", "pattern": "x\"y"},
                "c": {"type": "string", "format": "date-time"},
                "d": {"type": "string", "minLength": 2, "maxLength": 3}}}))
        .unwrap();
        let doc = |a: &str, b: &str, c: &str, d: &str| {
            format!("{{\"a\": \"{a}\", \"b\": \"{b}\", \"c\": \"{c}\", \"d\": \"{d}\"}}")
        };
        let (a, b, c, d) = ("AB-123", "..x\\\"y..", "2024-01-31T23:59:60Z", "é\\n");
        assert_ne!(accepts(&s, &doc(a, b, c, d)), Some(true), "second 60");
        let c = "2024-01-31T23:59:59.5+02:00";
        assert_eq!(accepts(&s, &doc(a, b, c, d)), Some(true));
        for bad in [
            doc("AB-1234", b, c, d),
            doc("Ab-123", b, c, d),
            doc("AB-١٢٣", b, c, d),
            doc(a, "xy", c, d),
            doc(a, "x\\u0022y", c, d),
            doc(a, b, "2024-01-31 23:59:59Z", d),
            doc(a, b, c, "a"),
            doc(a, b, c, "abcd"),
        ] {
            assert_ne!(accepts(&s, &bad), Some(true), "{bad}");
        }
        for (bad, want) in [
            (json!({"type": "string", "pattern": "("}), "pattern"),
            (
                json!({"type": "string", "pattern": "a", "maxLength": 3}),
                "maxLength",
            ),
            (
                json!({"type": "string", "pattern": "a", "format": "date"}),
                "format",
            ),
            (
                json!({"type": "string", "pattern": "[^\\s\\S]"}),
                "no string",
            ),
        ] {
            let e =
                Schema::compile(&json!({"type": "object", "properties": {"a": bad}})).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        // Unknown formats are annotations.
        assert!(
            Schema::compile(&json!({"type": "object", "properties":
            {"a": {"type": "string", "format": "color"}}}))
            .is_ok()
        );
    }

    #[test]
    fn unions_are_told_apart_by_their_first_byte() {
        let s = Schema::compile(&json!({"type": "object", "required": ["a", "b", "c"],
            "properties": {
                "a": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"},
                                {"type": "array", "items": {"type": "boolean"}}]},
                "b": {"oneOf": [{"enum": ["x", "y"]}, {"const": "z"}, {"type": "boolean"}]},
                "c": {"type": ["number", "null"], "minimum": 0}}}))
        .unwrap();
        for (a, b, c, ok) in [
            ("1", "\"z\"", "null", true),
            ("\"s\"", "\"x\"", "0.5", true),
            ("null", "true", "3", true),
            ("[true, false]", "false", "0", true),
            ("1.5", "\"z\"", "null", false),
            ("[1]", "\"z\"", "null", false),
            ("1", "\"w\"", "null", false),
            ("1", "\"z\"", "-1", false),
        ] {
            let doc = format!("{{\"a\": {a}, \"b\": {b}, \"c\": {c}}}");
            assert_eq!(accepts(&s, &doc) == Some(true), ok, "{doc}");
        }
        for (bad, want) in [
            (
                json!({"anyOf": [{"type": "object", "properties": {"a": {"type": "null"}}}, {"type": "object", "properties": {}}]}),
                "start differently",
            ),
            (
                json!({"anyOf": [{"type": "string"}, {"const": "a"}]}),
                "start differently",
            ),
            (
                json!({"anyOf": [{"type": "integer", "minimum": 1}, {"type": "number"}]}),
                "start differently",
            ),
            (
                json!({"anyOf": [{"type": "string"}], "type": "string"}),
                "cannot be combined",
            ),
            (
                json!({"allOf": [{"type": "string"}, {"type": "null"}]}),
                "allOf",
            ),
        ] {
            let e =
                Schema::compile(&json!({"type": "object", "properties": {"a": bad}})).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn references_resolve_once_and_cycles_are_refused() {
        let s = Schema::compile(&json!({"type": "object", "required": ["a", "b"],
            "definitions": {"P": {"type": "object", "required": ["x"],
                "properties": {"x": {"type": "integer"}}}},
            "properties": {"a": {"$ref": "#/definitions/P", "description": "first"},
                           "b": {"allOf": [{"$ref": "#/definitions/P"}]}}}))
        .unwrap();
        assert_eq!(
            accepts(&s, "{\"a\": {\"x\": 1}, \"b\": {\"x\": 2}}"),
            Some(true)
        );
        assert_ne!(accepts(&s, "{\"a\": {\"x\": 1}, \"b\": {}}"), Some(true));
        for (bad, want) in [
            (
                json!({"type": "object", "$defs": {"N": {"type": "object", "properties":
                {"next": {"$ref": "#/$defs/N"}}}}, "properties": {"a": {"$ref": "#/$defs/N"}}}),
                "recursive",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#"}}}),
                "recursive",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/Q"}}}),
                "nothing",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "other.json"}}}),
                "into",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/x", "type": "string"}}}),
                "cannot be combined",
            ),
        ] {
            let e = Schema::compile(&bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    /// A random walk over the bytes the validator takes; every state it reaches can go on or
    /// is complete, and the documents it completes are what an independent check accepts.
    #[test]
    fn random_documents_never_strand_and_satisfy_the_schema() {
        let v = pydantic();
        let s = Schema::compile(&v).unwrap();
        let mut rng = 0x9E3779B97F4A7C15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let prefer = b"\"}],:0123456789-.aZ ";
        let mut done = 0;
        for _ in 0..200 {
            let mut st = SchemaState::new(&s);
            let mut out = Vec::new();
            while !st.complete() && out.len() < 4000 {
                let allowed: Vec<u8> = (0..=255u8).filter(|&b| st.clone().push(&s, b)).collect();
                assert!(
                    !allowed.is_empty(),
                    "dead end after {}",
                    String::from_utf8_lossy(&out)
                );
                let pick = if next() % 3 == 0 {
                    allowed[(next() % allowed.len() as u64) as usize]
                } else {
                    *prefer
                        .iter()
                        .find(|b| allowed.contains(b))
                        .unwrap_or(&allowed[(next() % allowed.len() as u64) as usize])
                };
                assert!(st.push(&s, pick));
                out.push(pick);
            }
            if !st.complete() {
                continue;
            }
            done += 1;
            let text = String::from_utf8(out).unwrap();
            let d: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
            check(&d, &v).unwrap_or_else(|e| panic!("{e}: {text}"));
        }
        assert!(done >= 150, "only {done} of 200 walks completed");
    }

    /// An independent check of the Pydantic schema's constraints (the `regex` crate for
    /// formats).
    fn check(d: &Value, v: &Value) -> Result<(), String> {
        let p = &v["properties"];
        let keys: Vec<&String> = d.as_object().ok_or("not an object")?.keys().collect();
        let want: Vec<&String> = p.as_object().unwrap().keys().collect();
        if keys != want {
            return Err(format!("keys {keys:?}"));
        }
        let name = d["name"].as_str().ok_or("name")?;
        if name.chars().count() > 20 {
            return Err("name too long".into());
        }
        let age = d["age"].as_i64().ok_or("age")?;
        if !(0..=130).contains(&age) {
            return Err("age".into());
        }
        if !["cat", "dog"].contains(&d["kind"].as_str().ok_or("kind")?) {
            return Err("kind".into());
        }
        let home = d["home"].as_object().ok_or("home")?;
        if home.len() != 2
            || !home["city"].is_string()
            || !(home["zip"].is_string() || home["zip"].is_null())
        {
            return Err("home".into());
        }
        let tags = d["tags"].as_array().ok_or("tags")?;
        if tags.len() > 3 || !tags.iter().all(Value::is_string) {
            return Err("tags".into());
        }
        let date = regex::Regex::new(r"^\d{4}-\d{2}-\d{2}$").unwrap();
        let born = d["born"].as_str().ok_or("born")?;
        let (m, day): (u32, u32) = (
            born[5..7].parse().unwrap_or(0),
            born[8..].parse().unwrap_or(0),
        );
        let days = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
        if !date.is_match(born) || !(1..=12).contains(&m) || day < 1 || day > days[m as usize - 1] {
            return Err("born".into());
        }
        let uuid =
            regex::Regex::new(r"^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$").unwrap();
        if !uuid.is_match(d["id"].as_str().ok_or("id")?) {
            return Err("id".into());
        }
        let score = d["score"].as_f64().ok_or("score")?;
        if !(0.0..=1.0).contains(&score) {
            return Err("score".into());
        }
        if !d["extra"]
            .as_object()
            .ok_or("extra")?
            .values()
            .all(Value::is_i64)
        {
            return Err("extra".into());
        }
        Ok(())
    }

    /// Every byte string up to `len` over `alphabet` after `prefix` that the validator takes
    /// either completes or can go on: no dead ends.
    fn no_dead_ends(s: &Schema, prefix: &str, alphabet: &[u8], len: usize) {
        let mut frontier = vec![SchemaState::new(s)];
        assert!(frontier[0].push_bytes(s, prefix.as_bytes()), "{prefix}");
        for _ in 0..len {
            let mut next = Vec::new();
            for st in &frontier {
                if !st.complete() {
                    assert!(
                        (0..=255u8).any(|b| st.clone().push(s, b)),
                        "dead end under {prefix}"
                    );
                }
                for &b in alphabet {
                    let mut n = *st;
                    if n.push(s, b) && !next.contains(&n) {
                        next.push(n);
                    }
                }
            }
            frontier = next;
        }
    }

    #[test]
    fn review_cases_hold() {
        // A string at its maxLength takes no new character, not even the start of one.
        let s = Schema::compile(&json!({"type": "object", "required": ["s"],
            "properties": {"s": {"type": "string", "maxLength": 1}}}))
        .unwrap();
        no_dead_ends(&s, "{\"s\":\"", b"a\\\"u0\xC3\xA9}n", 5);
        assert_eq!(accepts(&s, "{\"s\":\"\\n\"}"), Some(true));
        assert_eq!(accepts(&s, "{\"s\":\"\u{e9}\"}"), Some(true));
        assert_ne!(accepts(&s, "{\"s\":\"a\\n\"}"), Some(true));
        // A string without maxLength has no length cap (the mask lets plain tokens through).
        let s = Schema::compile(&json!({"type": "object", "required": ["s"],
            "properties": {"s": {"type": "string"}}}))
        .unwrap();
        let long = format!("{{\"s\":\"{}\"}}", "a".repeat(70_000));
        assert_eq!(accepts(&s, &long), Some(true));
        // Bounded numbers keep their order as doubles: 15 digits at most.
        let s = Schema::compile(&json!({"type": "object", "required": ["x"],
            "properties": {"x": {"type": "number", "exclusiveMaximum": 1}}}))
        .unwrap();
        assert_eq!(accepts(&s, "{\"x\": 0.999999}"), Some(true));
        assert_ne!(accepts(&s, "{\"x\": 0.9999999}"), Some(true));
        assert_ne!(accepts(&s, "{\"x\": 1}"), Some(true));
        // A reference reused deeper is compiled again at that depth (and refused if too deep).
        let mut leaf = json!({"type": "string"});
        for _ in 0..10 {
            leaf = json!({"type": "object", "required": ["a"], "properties": {"a": leaf}});
        }
        let e = Schema::compile(&json!({"type": "object", "$defs": {"D": leaf},
            "properties": {"x": {"$ref": "#/$defs/D"},
                "y": {"type": "array", "items": {"$ref": "#/$defs/D"}}}}))
        .unwrap_err();
        assert!(e.contains("deep"), "{e}");
        // oneOf branches that share a value.
        for bad in [
            json!({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            json!({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b", "c"]}]}),
            json!({"oneOf": [{"type": "boolean"}, {"const": true}]}),
        ] {
            let e =
                Schema::compile(&json!({"type": "object", "properties": {"a": bad}})).unwrap_err();
            assert!(e.contains("share"), "{e}");
        }
        // Keywords beside an enum filter its values.
        let s = Schema::compile(&json!({"type": "object", "required": ["a", "b"],
            "properties": {"a": {"enum": ["a", "bbbb"], "minLength": 3},
                           "b": {"enum": [1, 5], "minimum": 3}}}))
        .unwrap();
        assert_eq!(accepts(&s, "{\"a\": \"bbbb\", \"b\": 5}"), Some(true));
        assert_ne!(accepts(&s, "{\"a\": \"a\", \"b\": 5}"), Some(true));
        assert_ne!(accepts(&s, "{\"a\": \"bbbb\", \"b\": 1}"), Some(true));
        assert!(
            Schema::compile(&json!({"type": "object", "properties":
            {"a": {"enum": ["a"], "minLength": 3}}}))
            .unwrap_err()
            .contains("no `enum`")
        );
        // Narrow readings of \D, \W, [^\d] and `.`; control characters no string can write.
        let s = Schema::compile(&json!({"type": "object", "required": ["a", "b", "c", "d"],
            "properties": {"a": {"type": "string", "pattern": "^\\W$"},
                           "b": {"type": "string", "pattern": "^[^\\d]$"},
                           "c": {"type": "string", "pattern": "^.$"},
                           "d": {"type": "string", "pattern": "^[a&&b]$"}}}))
        .unwrap();
        let doc = |a: &str, b: &str, c: &str, d: &str| {
            format!("{{\"a\": \"{a}\", \"b\": \"{b}\", \"c\": \"{c}\", \"d\": \"{d}\"}}")
        };
        assert_eq!(accepts(&s, &doc("!", "x", "x", "&")), Some(true));
        for bad in [
            doc("\u{e9}", "x", "x", "&"),
            doc("!", "\u{663}", "x", "&"),
            doc("!", "x", "\\r", "&"),
            doc("!", "x", "\u{2028}", "&"),
        ] {
            assert_ne!(accepts(&s, &bad), Some(true), "{bad}");
        }
        for (bad, want) in [("^\\x01$", "no string"), ("a)|(b", "not supported")] {
            let e = Schema::compile(&json!({"type": "object", "properties":
                {"a": {"type": "string", "pattern": bad}}}))
            .unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        // Year 0000 is no date; too many distinct patterns are refused.
        let s = Schema::compile(&json!({"type": "object", "required": ["d"],
            "properties": {"d": {"type": "string", "format": "date"}}}))
        .unwrap();
        assert_ne!(accepts(&s, "{\"d\": \"0000-01-01\"}"), Some(true));
        assert_eq!(accepts(&s, "{\"d\": \"0001-01-01\"}"), Some(true));
        let many: serde_json::Map<String, Value> = (0..MAX_PATTERNS + 1)
            .map(|i| {
                (
                    format!("p{i}"),
                    json!({"type": "string", "pattern": format!("^{i}$")}),
                )
            })
            .collect();
        let e = Schema::compile(&json!({"type": "object", "properties": many})).unwrap_err();
        assert!(e.contains("distinct"), "{e}");
    }

    #[test]
    fn whole_text_regexes_and_choices_match_the_whole_answer() {
        let run = |p: &Pattern, text: &str| {
            let mut s = 0u16;
            for &b in text.as_bytes() {
                match p.next(s, b) {
                    Some(n) => s = n,
                    None => return None,
                }
            }
            Some(p.accepts(s))
        };
        let p = Pattern::full_match(r"(yes|no)( \d+)?").unwrap();
        assert_eq!(run(&p, "yes"), Some(true));
        assert_eq!(run(&p, "no 12"), Some(true));
        assert_eq!(run(&p, "no "), Some(false), "open: a number may follow");
        assert_eq!(run(&p, "yess"), None);
        assert_eq!(run(&p, " yes"), None);
        let c = Pattern::one_of(&["a+b".into(), "(x)".into(), "é".into()]).unwrap();
        assert_eq!(run(&c, "a+b"), Some(true));
        assert_eq!(run(&c, "(x)"), Some(true));
        assert_eq!(run(&c, "é"), Some(true));
        assert_eq!(run(&c, "aab"), None);
        assert_eq!(run(&c, "x"), None);
        for (bad, want) in [("(", "not supported"), ("[^\\s\\S]", "no string")] {
            let e = Pattern::full_match(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        assert!(Pattern::full_match(&"a".repeat(MAX_REGEX + 1)).is_err());
    }

    #[test]
    fn unsupported_schemas_are_refused_by_name() {
        for (bad, want) in [
            (
                json!({"type": "array", "items": {"type": "string"}}),
                "root",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
                "$ref",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}),
                "multipleOf",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": []}}}),
                "anyOf",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}, "uniqueItems": true}}}),
                "uniqueItems",
            ),
            (json!({"type": "object", "properties": {"a": {}}}), "type"),
            (
                json!({"type": "object", "properties": {"a": {"type": "array"}}}),
                "items",
            ),
            (
                json!({"type": "object", "required": ["b"], "properties": {"a": {"type": "string"}}}),
                "`b`",
            ),
            (
                json!({"type": "object", "properties": {"a": {"enum": (0..40).collect::<Vec<_>>()}}}),
                "enum",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 100000}}}),
                "maxLength",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 2}}}),
                "minItems",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "object",
                    "properties": {"x": {"type": "string"}}, "additionalProperties": {"type": "string"}}}}),
                "additionalProperties",
            ),
        ] {
            let e = Schema::compile(&bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        for (bad, want) in [
            (json!({"type": "object", "enum": [1]}), "root"),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "enum": [1]}}}),
                "not of type",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "object", "properties": {}, "enum": [{}]}}}),
                "cannot be combined",
            ),
            (
                json!({"type": "object", "properties": {"a": {"const": "x".repeat(2000)}}}),
                "bytes",
            ),
            (
                json!({"type": "object", "properties": {"x".repeat(2000): {"type": "string"}}}),
                "bytes",
            ),
        ] {
            let e = Schema::compile(&bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        // `type` restating the values is fine.
        let s = Schema::compile(&json!({"type": "object", "required": ["a"],
            "properties": {"a": {"type": "string", "enum": ["x", "y"]}}}))
        .unwrap();
        assert_eq!(accepts(&s, "{\"a\": \"y\"}"), Some(true));
        assert_ne!(accepts(&s, "{\"a\": \"z\"}"), Some(true));
        // Too deep.
        let mut v = json!({"type": "string"});
        for _ in 0..MAX_DEPTH + 1 {
            v = json!({"type": "object", "properties": {"a": v}});
        }
        assert!(Schema::compile(&v).unwrap_err().contains("deep"));
    }
}
