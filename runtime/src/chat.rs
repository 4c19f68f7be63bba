//! Chat templates rendered with a real Jinja engine (minijinja, with Python string methods).

use crate::{Result, RuntimeError};
use minijinja::{Environment, Error, ErrorKind, context};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
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
        })
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
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
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
    fn raise_exception_and_bad_syntax_are_errors() {
        let ct = ChatTemplate::new("{{ raise_exception('no system') }}", "", "").unwrap();
        assert!(ct.render(&[], true).is_err());
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
