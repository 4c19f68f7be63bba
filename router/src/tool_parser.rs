//! Tool calls in a model's own words (`tool_choice: "auto"`), for models whose chat template
//! asks for Hermes-style calls, as Qwen2.5's and Hermes' do:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! As vLLM's `--tool-call-parser hermes`: the text before the first call is the message's
//! content, each block is one call, and text between and after the blocks is dropped. A whole answer
//! whose blocks do not all parse stays text; streamed, what went out before a bad block
//! stands, and the bad block is text unless a call went out already.

use serde_json::Value;

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

/// One call: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// A block's call, if it is `{"name": one of `tools`, "arguments": {…}}` (arguments may also
/// come as JSON text of an object, or be missing for none).
fn call(block: &str, tools: &[String]) -> Option<Call> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    let name = v.get("name")?.as_str()?;
    if !tools.iter().any(|t| t == name) {
        return None;
    }
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(Value::String(s)) => {
            let a: Value = serde_json::from_str(s).ok()?;
            a.is_object().then(|| a.to_string())?
        }
        Some(_) => return None,
    };
    Some(Call {
        name: name.to_owned(),
        arguments,
    })
}

/// A whole answer: its content (before the first call; None if empty) and its calls. An
/// answer with a block that does not parse, or not closed, is all content.
pub fn parse(text: &str, tools: &[String]) -> (Option<String>, Vec<Call>) {
    let Some(first) = text.find(OPEN) else {
        return (Some(text.to_owned()), Vec::new());
    };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(r) = rest.strip_prefix(OPEN) {
        let Some(end) = r.find(CLOSE) else {
            return (Some(text.to_owned()), Vec::new());
        };
        match call(&r[..end], tools) {
            Some(c) => calls.push(c),
            None => return (Some(text.to_owned()), Vec::new()),
        }
        // Text between and after the blocks is dropped (as vLLM's parser finds every block).
        rest = &r[end + CLOSE.len()..];
        match rest.find(OPEN) {
            Some(next) => rest = &rest[next..],
            None => break,
        }
    }
    let content = text[..first].trim_end();
    let content = (!content.is_empty()).then(|| content.to_owned());
    (content, calls)
}

/// What a streamed answer releases.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    Content(String),
    Call(Call),
}

/// A streamed answer, piece by piece: content goes out as it comes, except text that may
/// be the start of `<tool_call>`; a call goes out once its block closes.
#[derive(Debug, Default)]
pub struct Stream {
    tools: Vec<String>,
    /// Text not released yet: a possible start of a block, or a block under way.
    held: String,
    /// Inside a block (held starts with `<tool_call>`).
    in_call: bool,
    /// White space that ended the content released so far: sent with the next text, or
    /// dropped if a call comes first (as a whole answer's content is trimmed before its call).
    trailing: String,
    /// Calls released; after the first, text between blocks is dropped.
    pub calls: usize,
}

impl Stream {
    pub fn new(tools: Vec<String>) -> Self {
        Self {
            tools,
            ..Default::default()
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Out> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else {
                    break;
                };
                let block = self.held[OPEN.len()..end].to_owned();
                let raw = self.held[..end + CLOSE.len()].to_owned();
                self.held.drain(..end + CLOSE.len());
                self.in_call = false;
                match call(&block, &self.tools) {
                    Some(c) => {
                        self.calls += 1;
                        self.trailing.clear();
                        out.push(Out::Call(c));
                    }
                    // Not a call after all: the block is text.
                    None => self.release(raw, &mut out),
                }
                continue;
            }
            if let Some(start) = self.held.find(OPEN) {
                let before: String = self.held.drain(..start).collect();
                self.release(before, &mut out);
                self.in_call = true;
                continue;
            }
            // Hold back a tail that may begin `<tool_call>`.
            let keep = (1..OPEN.len())
                .rev()
                .find(|&n| self.held.ends_with(&OPEN[..n]))
                .unwrap_or(0);
            let cut = self.held.len() - keep;
            let before: String = self.held.drain(..cut).collect();
            self.release(before, &mut out);
            break;
        }
        out
    }

    /// The answer ended: whatever is held is text.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        self.in_call = false;
        self.release(held, &mut out);
        if self.calls == 0 && !self.trailing.is_empty() {
            out.push(Out::Content(std::mem::take(&mut self.trailing)));
        }
        out
    }

    fn release(&mut self, text: String, out: &mut Vec<Out>) {
        // After a call, only further calls count.
        if text.is_empty() || self.calls > 0 {
            return;
        }
        let body = text.trim_end();
        if !body.is_empty() {
            let mut c = std::mem::take(&mut self.trailing);
            c.push_str(body);
            out.push(Out::Content(c));
        }
        self.trailing.push_str(&text[body.len()..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<String> {
        vec!["get_weather".into(), "noop".into()]
    }

    #[test]
    fn whole_answers_split_into_content_and_calls() {
        let t = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"noop\"}</tool_call>";
        let (content, calls) = parse(t, &tools());
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls,
            vec![
                Call {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                Call {
                    name: "noop".into(),
                    arguments: "{}".into()
                }
            ]
        );
        // Text between blocks does not hide the later ones.
        let (content, calls) = parse(
            "<tool_call>{\"name\": \"noop\"}</tool_call> Now: <tool_call>{\"name\": \"get_weather\"}</tool_call> done",
            &tools(),
        );
        assert_eq!((content, calls.len()), (None, 2));
        let (content, calls) = parse(
            "<tool_call>{\"name\": \"noop\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
            &tools(),
        );
        assert_eq!((content, calls.len()), (None, 1));
        assert_eq!(calls[0].arguments, "{\"a\":1}");
        // Plain text, a broken block, an unknown function, an unclosed block: all text.
        for t in [
            "Sunny.",
            "<tool_call>{\"name\": \"get_weather\", </tool_call>",
            "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"noop\"}",
            "<tool_call>{\"name\": \"noop\", \"arguments\": [1]}</tool_call>",
        ] {
            assert_eq!(parse(t, &tools()), (Some(t.to_owned()), Vec::new()), "{t}");
        }
    }

    #[test]
    fn streams_release_content_at_once_and_calls_when_closed() {
        let t = "Checking <the> weather.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"noop\"}</tool_call>";
        // Every way of cutting the text into pieces gives the same releases.
        for step in 1..=7 {
            let mut s = Stream::new(tools());
            let mut outs = Vec::new();
            let bytes: Vec<char> = t.chars().collect();
            for piece in bytes.chunks(step) {
                let piece: String = piece.iter().collect();
                for o in s.push(&piece) {
                    // Content never carries any part of a call.
                    if let Out::Content(c) = &o {
                        assert!(!c.contains('{'), "step {step}: {c:?}");
                    }
                    outs.push(o);
                }
            }
            outs.extend(s.finish());
            let content: String = outs
                .iter()
                .filter_map(|o| match o {
                    Out::Content(c) => Some(c.as_str()),
                    _ => None,
                })
                .collect();
            // As the whole answer's content: the white space before the call is not sent.
            assert_eq!(content, "Checking <the> weather.", "step {step}");
            assert_eq!(parse(t, &tools()).0.as_deref(), Some(content.as_str()));
            let calls: Vec<&Call> = outs
                .iter()
                .filter_map(|o| match o {
                    Out::Call(c) => Some(c),
                    _ => None,
                })
                .collect();
            assert_eq!(calls.len(), 2, "step {step}");
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(s.calls, 2);
        }
        // Only white space before a call: no content, streamed or whole.
        let t = "\n\n<tool_call>{\"name\": \"noop\"}</tool_call>";
        let mut s = Stream::new(tools());
        let outs: Vec<Out> = s.push(t).into_iter().chain(s.finish()).collect();
        assert!(matches!(outs.as_slice(), [Out::Call(_)]), "{outs:?}");
        assert_eq!(parse(t, &tools()).0, None);
        // A held-back `<tool` that never becomes a call, an unclosed block, and white space
        // with no call after it come out as text at the end.
        for t in [
            "a <tool",
            "a <tool_call>{\"name\": \"noop\"",
            "a \n b \n",
            " \n",
        ] {
            let mut s = Stream::new(tools());
            let mut text = String::new();
            for o in s.push(t).into_iter().chain(s.finish()) {
                match o {
                    Out::Content(c) => text.push_str(&c),
                    Out::Call(c) => panic!("{c:?}"),
                }
            }
            assert_eq!(text, t);
        }
    }
}
