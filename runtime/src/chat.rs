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

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The template renders an assistant turn's `tool_calls` itself.
    renders_tool_calls: bool,
}

impl ChatTemplate {
    pub fn new(template: &str, bos: &str, eos: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
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
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| RuntimeError::Template(e.to_string()))
    }
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

    #[test]
    fn raise_exception_and_bad_syntax_are_errors() {
        let ct = ChatTemplate::new("{{ raise_exception('no system') }}", "", "").unwrap();
        assert!(ct.render(&[], true).is_err());
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
