//! Chat templates rendered with a real Jinja engine (minijinja, with Python string methods).

use crate::{Result, RuntimeError};
use minijinja::{Environment, Error, ErrorKind, context};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's function calls, as OpenAI sends them back
    /// (`[{"id", "type": "function", "function": {"name", "arguments"}}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// Template variables the server sets, which a request's kwargs may not replace.
pub const RESERVED_VARIABLES: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The template renders an assistant turn's `tool_calls` itself.
    renders_tool_calls: bool,
}

impl ChatTemplate {
    pub fn new(template: &str, bos: &str, eos: &str) -> Result<Self> {
        // As Hugging Face's `apply_chat_template` sets up Jinja: blocks trimmed, `break` and
        // `continue`, its own `tojson` and `strftime_now`. Templates are written against
        // that, and a prompt that differs by a newline is another prompt.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            strftime(&fmt, std::time::SystemTime::now())
        });
        env.add_template_owned("chat", template.to_string())
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        Ok(Self {
            env,
            bos: bos.into(),
            eos: eos.into(),
            renders_tool_calls: template.contains("tool_calls"),
        })
    }

    /// Whether the template renders an assistant turn's `tool_calls` (Qwen2.5's does,
    /// SmolLM2's does not: the caller then puts the calls in the turn's text).
    pub fn renders_tool_calls(&self) -> bool {
        self.renders_tool_calls
    }

    pub fn from_tokenizer(tok: &crate::Tokenizer) -> Result<Self> {
        let t = tok
            .chat_template
            .as_deref()
            .ok_or_else(|| RuntimeError::Template("this model has no chat template".into()))?;
        let bos = tok.bos.as_ref().map(|b| b.1.as_str()).unwrap_or("");
        let eos = tok.eos.as_ref().map(|b| b.1.as_str()).unwrap_or("");
        Self::new(t, bos, eos)
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Self::render`] with the request's `tools` (OpenAI function definitions) in the
    /// template's `tools` variable, as Hugging Face's `apply_chat_template` passes them.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with_kwargs(messages, tools, add_generation_prompt, None)
    }

    /// [`Self::render_with_tools`] with more template variables (a request's
    /// `chat_template_kwargs`, such as Qwen3's `enable_thinking`), as Hugging Face's
    /// `apply_chat_template(**kwargs)` passes them. A variable the template sets itself
    /// (`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`) is refused.
    pub fn render_with_kwargs(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        let base = context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        };
        let ctx = match kwargs.filter(|k| !k.is_empty()) {
            None => base,
            Some(k) => {
                if let Some(name) = k.keys().find(|n| RESERVED_VARIABLES.contains(&n.as_str())) {
                    return Err(RuntimeError::Template(format!(
                        "the template variable `{name}` is set by the server, not a kwarg"
                    )));
                }
                context! { ..base, ..minijinja::Value::from_serialize(k) }
            }
        };
        tmpl.render(ctx)
            .map_err(|e| RuntimeError::Template(e.to_string()))
    }
}

/// Hugging Face's `tojson`: Python's `json.dumps` with `ensure_ascii=False` by default, so
/// `", "` and `": "` between items, no HTML escapes, and `indent`, `separators`, `sort_keys`,
/// `ensure_ascii` as keywords (minijinja's own writes compact JSON with `<` as `\u003c`).
fn tojson(
    v: minijinja::Value,
    indent: Option<minijinja::Value>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, Error> {
    let bad = |m: String| Error::new(ErrorKind::InvalidOperation, m);
    let indent = match indent.or(kwargs.get::<Option<minijinja::Value>>("indent")?) {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) => match (i.as_i64(), i.as_str()) {
            (Some(n), _) if (0..=64).contains(&n) => Some(" ".repeat(n as usize)),
            (_, Some(s)) if s.len() <= 64 => Some(s.to_string()),
            _ => {
                return Err(bad(format!(
                    "tojson: indent {i} is not a count or a string"
                )));
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let (item, key) = match kwargs.get::<Option<minijinja::Value>>("separators")? {
        Some(s) if !s.is_none() => {
            let parts: Vec<String> = s
                .try_iter()
                .map_err(|_| bad("tojson: separators is a pair of strings".into()))?
                .map(|p| p.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("tojson: separators is a pair of strings".into()))?;
            match <[String; 2]>::try_from(parts) {
                Ok([i, k]) => (i, k),
                Err(_) => return Err(bad("tojson: separators is a pair of strings".into())),
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&v).map_err(|e| bad(format!("tojson: {e}")))?;
    let mut out = String::new();
    let style = Dumps {
        indent: indent.as_deref(),
        item: &item,
        key: &key,
        sort_keys,
        ensure_ascii,
    };
    style.write(&json, 0, &mut out);
    Ok(out)
}

/// The shape of Python's `json.dumps` output.
struct Dumps<'a> {
    indent: Option<&'a str>,
    item: &'a str,
    key: &'a str,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl Dumps<'_> {
    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Array(a) if !a.is_empty() => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    self.between(i, level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.close(level, out);
                out.push(']');
            }
            J::Object(m) if !m.is_empty() => {
                let mut entries: Vec<(&String, &serde_json::Value)> = m.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.between(i, level + 1, out);
                    self.string(k, out);
                    out.push_str(self.key);
                    self.write(x, level + 1, out);
                }
                self.close(level, out);
                out.push('}');
            }
            J::Array(_) => out.push_str("[]"),
            J::Object(_) => out.push_str("{}"),
            J::String(s) => self.string(s, out),
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
                Some(f) => out.push_str(&py_float(f)),
                None => out.push_str(&n.to_string()),
            },
        }
    }

    fn between(&self, i: usize, level: usize, out: &mut String) {
        if i > 0 {
            out.push_str(self.item);
        }
        if let Some(ind) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn close(&self, level: usize, out: &mut String) {
        if let Some(ind) = self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as Python's `repr` writes it: the shortest digits that read back, positional from
/// 1e-4 up to 1e16 (with `.0` when whole), else `d.ddde±XX`.
fn py_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `-1.25e-7`.
    let e = format!("{v:e}");
    let (mant, exp) = e.split_once('e').unwrap_or((e.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let sign = if mant.starts_with('-') { "-" } else { "" };
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{body}")
    } else {
        let rest = if digits.len() > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{rest}e{es}{:02}", &digits[..1], exp.abs())
    }
}

/// `strftime` for the directives chat templates use (Llama 3's `strftime_now("%d %b %Y")`),
/// in UTC; others are left as written.
fn strftime(fmt: &str, now: std::time::SystemTime) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let (h, mi, s) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize];
    let yday = before + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[weekday];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(day),
            Some('a') => out.push_str(&day[..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", (h + 11) % 12 + 1)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_with_python_methods() {
        let t = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let ct = ChatTemplate::new(t, "", "").unwrap();
        let s = ct.render(&[Message::new("user", "  hi  ")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn tools_and_tool_calls_reach_the_template() {
        let t = "{% if tools %}[{{ tools | length }} tools: {{ tools[0].function.name }}]{% endif %}{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}call {{ m.tool_calls[0].function.name }}{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %};{% endfor %}";
        let ct = ChatTemplate::new(t, "", "").unwrap();
        assert!(ct.renders_tool_calls());
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]);
        let mut call = Message::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}]));
        let mut answer = Message::new("tool", "sunny");
        answer.tool_call_id = Some("call_1".into());
        let s = ct
            .render_with_tools(
                &[Message::new("user", "hi"), call, answer],
                Some(&tools),
                false,
            )
            .unwrap();
        assert_eq!(
            s,
            "[1 tools: get_weather]user:hi;assistant:call get_weather;tool:sunny for call_1;"
        );
        // Without tools the variable is undefined-like: the template's `if` skips it.
        let s = ct.render(&[Message::new("user", "hi")], false).unwrap();
        assert_eq!(s, "user:hi;");
        assert!(
            !ChatTemplate::new("{{ messages }}", "", "")
                .unwrap()
                .renders_tool_calls()
        );
    }

    /// A request's `chat_template_kwargs` reach the template as variables (Qwen3's
    /// `enable_thinking`); the server's own variables cannot be replaced through them.
    #[test]
    fn kwargs_reach_the_template_and_cannot_replace_its_variables() {
        let t = "{% for m in messages %}{{ m.content }}{% endfor %}|{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ add_generation_prompt }}";
        let ct = ChatTemplate::new(t, "", "").unwrap();
        let m = [Message::new("user", "hi")];
        let kw = |v: serde_json::Value| v.as_object().cloned().unwrap();
        let off = kw(serde_json::json!({"enable_thinking": false}));
        let on = kw(serde_json::json!({"enable_thinking": true}));
        assert_eq!(
            ct.render_with_kwargs(&m, None, true, None).unwrap(),
            "hi|True"
        );
        assert_eq!(
            ct.render_with_kwargs(&m, None, true, Some(&off)).unwrap(),
            "hi|<think></think>True"
        );
        assert_eq!(
            ct.render_with_kwargs(&m, None, true, Some(&on)).unwrap(),
            "hi|True"
        );
        for name in RESERVED_VARIABLES {
            let bad = kw(serde_json::json!({ name: false }));
            let e = ct
                .render_with_kwargs(&m, None, true, Some(&bad))
                .unwrap_err();
            assert!(e.to_string().contains(name), "{e}");
        }
    }

    #[test]
    fn raise_exception_and_bad_syntax_are_errors() {
        let ct = ChatTemplate::new("{{ raise_exception('no system') }}", "", "").unwrap();
        assert!(ct.render(&[], true).is_err());
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }

    /// Hugging Face renders with trimmed blocks, loop controls and Python's `json.dumps`:
    /// the strings below are what `apply_chat_template` gives for the same template and data.
    #[test]
    fn templates_render_as_hugging_face_renders_them() {
        let t = "{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n<{{ m.role }}>{{ m.content }}\n{% endfor %}\n";
        let ct = ChatTemplate::new(t, "", "").unwrap();
        let s = ct
            .render(
                &[
                    Message::new("user", "a"),
                    Message::new("skip", "x"),
                    Message::new("assistant", "b"),
                ],
                false,
            )
            .unwrap();
        assert_eq!(s, "<user>a\n<assistant>b\n");
        let t = "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ tools | tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True) }}";
        let ct = ChatTemplate::new(t, "", "").unwrap();
        let tools = serde_json::json!([{"name": "f", "description": "Don't use <b> & é", "parameters": {}, "n": [1, 2.5, null, true]}]);
        let s = ct.render_with_tools(&[], Some(&tools), false).unwrap();
        assert_eq!(
            s,
            concat!(
                r#"[{"name": "f", "description": "Don't use <b> & é", "parameters": {}, "n": [1, 2.5, null, true]}]"#,
                "|{\n  \"name\": \"f\",\n  \"description\": \"Don't use <b> & é\",\n  \"parameters\": {},\n  \"n\": [\n    1,\n    2.5,\n    null,\n    true\n  ]\n}|",
                r#"[{"description":"Don't use <b> & \u00e9","n":[1,2.5,null,true],"name":"f","parameters":{}}]"#
            )
        );
        let ct = ChatTemplate::new("{{ 1 | tojson(colour=1) }}", "", "").unwrap();
        assert!(ct.render(&[], false).is_err());
    }

    /// Python's `repr(float)`, as `json.dumps` writes floats.
    #[test]
    fn floats_are_written_as_python_writes_them() {
        for (v, want) in [
            (1e-7, "1e-07"),
            (0.00005, "5e-05"),
            (0.0001, "0.0001"),
            (-0.00012, "-0.00012"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (2.5, "2.5"),
            (100.0, "100.0"),
            (123.456, "123.456"),
            (1.5e300, "1.5e+300"),
            (-2.5e-300, "-2.5e-300"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(py_float(v), want, "{v}");
        }
    }

    #[test]
    fn strftime_writes_the_dates_templates_ask_for() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_709_211_909);
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %e, %y %H:%M:%S %j %I%p %% %Q", t),
            "Thursday February 29, 24 13:05:09 060 01PM % %Q"
        );
        let epoch = std::time::UNIX_EPOCH;
        assert_eq!(strftime("%a %Y-%m-%d", epoch), "Thu 1970-01-01");
        let t = epoch + std::time::Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(strftime("%Y-%m-%d %j", t), "2000-02-29 060");
    }
}
