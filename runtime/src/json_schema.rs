//! Structured output (OpenAI's `response_format: {"type": "json_schema"}`): a JSON schema
//! compiled into a byte-level validator whose state is `Copy`, so the token mask of
//! [`crate::json`] can try every vocabulary token on a copy.
//!
//! The supported subset is the one structured-output schemas use most, and everything the
//! validator accepts conforms to the schema:
//! - `type`: `object` (`properties`, `required`; no other keys are produced, and properties
//!   come in the order of their names), `array` (`items`), `string`, `integer`, `number`,
//!   `boolean`, `null`;
//! - `enum` and `const` of any JSON values;
//! - annotations (`title`, `description`, `default`, `examples`, `$schema`) are ignored;
//!   `additionalProperties` may be given (none are produced).
//!
//! Anything else (`$ref`, `anyOf`, `pattern`, `minimum`, `maxLength`, …) is refused with a
//! message naming it, rather than produced unchecked. The root must be an object.

use crate::json::{StrChars, StrStep};
use std::fmt::Write as _;

/// Deepest nesting of objects and arrays a schema may have.
pub const MAX_DEPTH: usize = 12;
/// Most properties of one object, and most values of one `enum`.
pub const MAX_CHOICES: usize = 32;
/// Longest property name or `enum`/`const` value, as JSON text.
pub const MAX_TEXT: usize = 1024;
/// Longest run of whitespace bytes between tokens of the document.
pub const MAX_WS_RUN: u8 = 32;

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Object(Vec<Prop>),
    Array(u16),
    String,
    Integer,
    Number,
    /// The JSON texts the value may be (`enum`, `const`, `boolean`, `null`).
    Literals(Vec<Vec<u8>>),
}

#[derive(Clone, Debug, PartialEq)]
struct Prop {
    /// The key as JSON text, quotes included.
    key: Vec<u8>,
    node: u16,
    required: bool,
}

/// A compiled schema.
#[derive(Clone, Debug, PartialEq)]
pub struct Schema {
    nodes: Vec<Node>,
}

impl Schema {
    /// Compiles a schema; an error names what is not supported.
    pub fn compile(v: &serde_json::Value) -> Result<Self, String> {
        let mut s = Self { nodes: Vec::new() };
        if v.get("type").and_then(|t| t.as_str()) != Some("object")
            || v.get("enum").is_some()
            || v.get("const").is_some()
        {
            return Err(
                "the schema's root must have \"type\": \"object\" (and no `enum` or `const`)"
                    .into(),
            );
        }
        s.node(v, 0)?;
        Ok(s)
    }

    fn node(&mut self, v: &serde_json::Value, depth: usize) -> Result<u16, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| format!("a schema must be an object, got {v}"))?;
        if depth >= MAX_DEPTH {
            return Err(format!("schemas nest at most {MAX_DEPTH} deep"));
        }
        const KNOWN: [&str; 12] = [
            "type",
            "properties",
            "required",
            "items",
            "enum",
            "const",
            "title",
            "description",
            "default",
            "examples",
            "$schema",
            "additionalProperties",
        ];
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(format!("schema keyword `{k}` is not supported"));
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
            let texts: Vec<Vec<u8>> = vals.iter().map(|x| x.to_string().into_bytes()).collect();
            if texts.iter().any(|t| t.len() > MAX_TEXT) {
                return Err(format!(
                    "`enum`/`const` values are at most {MAX_TEXT} bytes"
                ));
            }
            Ok(Node::Literals(texts))
        };
        let node = if let Some(c) = obj.get("const") {
            literal_texts(std::slice::from_ref(c))?
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
                    let empty = serde_json::Map::new();
                    let props = match obj.get("properties") {
                        None => &empty,
                        Some(p) => p.as_object().ok_or("`properties` must be an object")?,
                    };
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
                        let node = self.node(sub, depth + 1)?;
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
                    Node::Array(self.node(items, depth + 1)?)
                }
                Some("string") => Node::String,
                Some("integer") => Node::Integer,
                Some("number") => Node::Number,
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
        let id = u16::try_from(self.nodes.len()).map_err(|_| "the schema is too large")?;
        self.nodes.push(node);
        Ok(id)
    }

    /// The root node (compiled last).
    fn root(&self) -> u16 {
        (self.nodes.len() - 1) as u16
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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Frame {
    node: u16,
    stage: u8,
    /// Objects: the index of the next property that may come.
    next: u8,
    /// Keys or literals still possible (bit i).
    cand: u32,
    /// Bytes matched of a key or literal.
    pos: u16,
    /// Inside a string value.
    chars: StrChars,
}

/// Where a document stands against a schema. `Copy`; every call takes the schema it was
/// started with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchemaState {
    frames: [Frame; MAX_DEPTH],
    depth: u8,
    ws: u8,
    done: bool,
}

impl SchemaState {
    pub fn new(schema: &Schema) -> Self {
        let mut frames = [Frame::default(); MAX_DEPTH];
        frames[0].node = schema.root();
        Self {
            frames,
            depth: 0,
            ws: 0,
            done: false,
        }
    }

    /// Whether the document is complete (then only the end may follow).
    pub fn complete(&self) -> bool {
        self.done
    }

    /// Inside a string value between characters (the mask's fast path for plain tokens).
    pub fn in_string(&self, schema: &Schema) -> bool {
        self.depth > 0 && {
            let f = &self.frames[self.depth as usize - 1];
            schema.nodes.get(f.node as usize) == Some(&Node::String)
                && f.stage == S_IN
                && f.chars.between_chars()
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
            Node::Array(item) => self.array_byte(schema, *item, b),
            Node::String => {
                let ok = self.string_byte(b);
                if ok && self.top().stage == S_CLOSED {
                    self.finish_value(schema);
                }
                ok
            }
            Node::Integer | Node::Number => {
                self.number_byte(schema, matches!(node, Node::Integer), b)
            }
            Node::Literals(lits) => self.literal_byte(schema, lits, b),
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
            Some(Node::Array(_)) => A_AFTER,
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

    fn array_byte(&mut self, schema: &Schema, item: u16, b: u8) -> bool {
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
            (A_FIRST | A_AFTER, b']') => {
                self.finish_value(schema);
                true
            }
            (A_AFTER, b',') => {
                self.top().stage = A_ITEM;
                true
            }
            (A_FIRST | A_ITEM, _) => self.start_value(schema, item, b),
            _ => false,
        }
    }

    fn string_byte(&mut self, b: u8) -> bool {
        let t = self.top();
        if t.stage == S_OPEN {
            if b != b'"' {
                return false;
            }
            t.stage = S_IN;
            t.chars = StrChars::default();
            return true;
        }
        match t.chars.push(b) {
            StrStep::More => true,
            StrStep::Closed => {
                t.stage = S_CLOSED;
                true
            }
            StrStep::Bad => false,
        }
    }

    fn number_byte(&mut self, schema: &Schema, integer: bool, b: u8) -> bool {
        let s = self.top().stage;
        let digit = b.is_ascii_digit();
        let next = match (s, b) {
            (N_START, b'-') => Some(N_MINUS),
            (N_START | N_MINUS, b'0') => Some(N_ZERO),
            (N_START | N_MINUS, b'1'..=b'9') => Some(N_INT),
            (N_INT, _) if digit => Some(N_INT),
            (N_ZERO | N_INT, b'.') if !integer => Some(N_DOT),
            (N_DOT | N_FRAC, _) if digit => Some(N_FRAC),
            (N_ZERO | N_INT | N_FRAC, b'e' | b'E') if !integer => Some(N_E),
            (N_E, b'+' | b'-') => Some(N_ESIGN),
            (N_E | N_ESIGN | N_EXP, _) if digit => Some(N_EXP),
            _ => None,
        };
        if let Some(n) = next {
            self.top().stage = n;
            return true;
        }
        // The number ends here if it may; the byte belongs to what follows.
        if matches!(s, N_ZERO | N_INT | N_FRAC | N_EXP) && self.depth > 1 {
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
    use serde_json::json;

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

    #[test]
    fn documents_of_the_schema_are_accepted_in_property_name_order() {
        let s = schema();
        for doc in [
            "{\"age\": 3, \"name\": \"Al\"}",
            " {\"age\":-1,\"color\":\"red\",\"name\":\"x\",\"ok\":true,\"pos\":{\"x\":1.5e3},\"tags\":[\"a\", \"b\"],\"v\":[1,\"a\"]}",
            "{\"age\": 0, \"color\": 1, \"name\": \"\\u00e9 \\\" é\"}",
            "{\"age\": 10, \"color\": null, \"name\": \"\", \"tags\": []}",
            "{ \"age\" : 7 , \"name\" : \"q\" , \"pos\" : { \"x\" : -0.5 } }",
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
        let doc = "{\"age\": 12, \"color\": \"green\", \"name\": \"x\"}";
        for cut in 0..doc.len() {
            assert_eq!(accepts(&s, &doc[..cut]), Some(false), "{}", &doc[..cut]);
        }
    }

    #[test]
    fn documents_outside_the_schema_are_refused() {
        let s = schema();
        for doc in [
            "{\"name\": \"Al\", \"age\": 3}",
            "{\"age\": 3}",
            "{\"age\": 3.5, \"name\": \"x\"}",
            "{\"age\": 1e3, \"name\": \"x\"}",
            "{\"age\": 01, \"name\": \"x\"}",
            "{\"age\": 1, \"color\": \"blue\", \"name\": \"x\"}",
            "{\"age\": 1, \"color\": \"redd\", \"name\": \"x\"}",
            "{\"age\": 1, \"name\": \"x\", \"zzz\": 1}",
            "{\"age\": 1, \"name\": \"x\", \"pos\": {}}",
            "{\"age\": 1, \"name\": 2}",
            "{\"age\": 1, \"name\": \"x\", \"ok\": 1}",
            "{\"age\": 1, \"name\": \"x\", \"tags\": [1]}",
            "{\"age\": 1, \"name\": \"x\", \"v\": [1, \"b\"]}",
            "{\"age\": 1, \"name\": \"x\",}",
            "{\"age\": 1, \"age\": 2, \"name\": \"x\"}",
            "{\"age\": 1, \"name\": \"x\"} x",
            "[1]",
        ] {
            assert_ne!(accepts(&s, doc), Some(true), "{doc}");
        }
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
                json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}}),
                "minimum",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": []}}}),
                "anyOf",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": ["string", "null"]}}}),
                "type",
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
