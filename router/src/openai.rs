//! OpenAI request bodies, their validation, and the error body every 4xx carries.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

/// An OpenAI-style error: status and `{"error":{"message","type","param","code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
    /// The target worker whose engine failed the request (a gRPC `INTERNAL` while opening), for
    /// the router's failover; never sent to the client.
    pub worker: Option<String>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
            retry_after: None,
            worker: None,
        }
    }
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            worker: None,
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = axum::http::HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
            }
        }
        r
    }
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `/tokenize`: one of `prompt` or `messages`.
#[derive(Deserialize, Debug)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    /// The BOS around the text: a prompt's default true, messages' false.
    pub add_special_tokens: Option<bool>,
    /// Rendered into the template as chat requests' are (OpenAI function definitions).
    pub tools: Option<Value>,
    #[serde(flatten)]
    pub template: TemplateOptions,
}

/// `/detokenize`.
#[derive(Deserialize, Debug)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// A boolean that may be `null` (OpenAI types these flags "boolean or null", and clients that
/// serialize every field send `"stream": null`): null reads as false, as when it is left out.
fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

/// Most prompts in one completions request.
pub const MAX_PROMPTS: usize = 256;

/// Most sequences (prompts × n) in one request: each is placed, admitted and kept as a
/// request of its own.
pub const MAX_SEQUENCES: usize = 256;

/// Most log-probability entries (token or alternative, prompt or output) a request that does
/// not stream may ask for: its whole answer is built in memory before any byte is sent, and a
/// few million entries are already hundreds of MB of JSON. A stream sends them as they come.
pub const MAX_LOGPROB_ENTRIES: u64 = 4_000_000;

/// Most chat `messages` in one request: each is rendered, scanned for special tokens and kept
/// apart on its own; a real conversation is far shorter.
pub const MAX_MESSAGES: usize = 4096;

/// Most bytes of a client's own value an error message repeats.
const ECHO_LIMIT: usize = 128;

/// `s` as an error message quotes it: at most [`ECHO_LIMIT`] bytes (cut at a character) and
/// `…` when cut, so a megabyte `model` or key is not sent back (and logged) whole.
pub fn clip(s: &str) -> std::borrow::Cow<'_, str> {
    if s.len() <= ECHO_LIMIT {
        return s.into();
    }
    let mut end = ECHO_LIMIT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end]).into()
}

/// `stream_options`, with vLLM's defaults: given at all, the stream ends with a usage chunk
/// unless `include_usage` is false (or null); `continuous_usage_stats` puts the usage so far
/// on every chunk.
#[derive(Deserialize, Debug)]
pub struct StreamOptions {
    #[serde(default = "yes", deserialize_with = "null_is_false")]
    pub include_usage: bool,
    #[serde(default, deserialize_with = "null_is_false")]
    pub continuous_usage_stats: bool,
}

fn yes() -> bool {
    true
}

/// Fields shared by both endpoints.
#[derive(Deserialize, Debug)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension (vLLM): -1 or 0 = off.
    pub top_k: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Extension (vLLM).
    pub repetition_penalty: Option<f64>,
    pub stop: Option<StringOrList>,
    pub seed: Option<i64>,
    pub n: Option<i64>,
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Completions: the number of alternatives per token (0..=20); chat: `true` to report
    /// log-probabilities, with `top_logprobs` alternatives.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    pub echo: Option<bool>,
    /// Extension: draft length for this request.
    pub gamma: Option<i64>,
    /// Extension (as in vLLM): return the generated token ids with each choice / chunk.
    #[serde(default, deserialize_with = "null_is_false")]
    pub return_token_ids: bool,
    /// Extension (vLLM): keep generating past the end-of-sequence token (benchmarks that
    /// want fixed output lengths).
    #[serde(default, deserialize_with = "null_is_false")]
    pub ignore_eos: bool,
    /// Extension (vLLM): after temperature, drop tokens less likely than `min_p` times the
    /// most likely one.
    pub min_p: Option<f64>,
    /// Token id (as a string key) -> bias in [-100, 100] added to its logit.
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    /// Extension (vLLM): no end-of-sequence, stop token or stop string ends the answer before
    /// this many tokens.
    pub min_tokens: Option<i64>,
    /// Extension (vLLM): more tokens that end the completion (they are part of it).
    pub stop_token_ids: Option<Vec<i64>>,
    /// `{"type": "json_object"}` (JSON mode) or `{"type": "text"}`.
    pub response_format: Option<Value>,
    /// Extension (vLLM guided decoding): the answer is a document of this JSON schema (an
    /// object, or its JSON text).
    pub guided_json: Option<Value>,
    /// Extension (vLLM): the whole answer matches this regex.
    pub guided_regex: Option<Value>,
    /// Extension (vLLM): the answer is one of these strings.
    pub guided_choice: Option<Value>,
    /// Extension (vLLM): refused (context-free grammars are not supported).
    pub guided_grammar: Option<Value>,
    /// Extension (vLLM ≥ 0.10): `{"json" | "regex" | "choice" | "json_object": …}`.
    pub structured_outputs: Option<Value>,
    /// Parameters that would change the answer and that this server does not implement: read
    /// so that a request asking for them is refused by name (serde would drop them, and the
    /// client would get an answer to another question).
    pub suffix: Option<Value>,
    pub best_of: Option<i64>,
    pub include_stop_str_in_output: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub truncate_prompt_tokens: Option<Value>,
    pub prompt_logprobs: Option<Value>,
    pub use_beam_search: Option<bool>,
    pub bad_words: Option<Value>,
    pub allowed_token_ids: Option<Value>,
    pub guided_whitespace_pattern: Option<Value>,
    pub logits_processors: Option<Value>,
    /// Extension (vLLM): the tokenizer's special tokens (the BOS) around a prompt given as
    /// text; completions default to true, chat to false (its template writes them).
    pub add_special_tokens: Option<bool>,
}

impl Common {
    /// A parameter asked for with a value that would change the answer and that is not
    /// implemented here: refused naming it (the default values pass).
    fn check_unsupported(&self) -> Result<(), ApiError> {
        let no = |what: &str, param: &'static str| {
            Err(ApiError::bad(
                format!("{what} is not supported"),
                Some(param),
            ))
        };
        if matches!(&self.suffix, Some(Value::String(s)) if !s.is_empty())
            || matches!(&self.suffix, Some(v) if !v.is_null() && !v.is_string())
        {
            return no("`suffix` (fill-in-the-middle)", "suffix");
        }
        if let Some(b) = self.best_of
            && b != self.n.unwrap_or(1)
        {
            return no("`best_of` other than `n`", "best_of");
        }
        if self.skip_special_tokens == Some(false) {
            return no("`skip_special_tokens: false`", "skip_special_tokens");
        }
        if self
            .truncate_prompt_tokens
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return no("`truncate_prompt_tokens`", "truncate_prompt_tokens");
        }
        if self.prompt_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
            return no(
                "`prompt_logprobs` (use `echo` with `logprobs`)",
                "prompt_logprobs",
            );
        }
        if self.use_beam_search == Some(true) {
            return no("`use_beam_search`", "use_beam_search");
        }
        let listed = |v: &Option<Value>| match v {
            None | Some(Value::Null) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if listed(&self.bad_words) {
            return no("`bad_words`", "bad_words");
        }
        if listed(&self.allowed_token_ids) {
            return no(
                "`allowed_token_ids` (use `logit_bias` or `guided_choice`)",
                "allowed_token_ids",
            );
        }
        if listed(&self.logits_processors) {
            return no("`logits_processors`", "logits_processors");
        }
        if self
            .guided_whitespace_pattern
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return no("`guided_whitespace_pattern`", "guided_whitespace_pattern");
        }
        Ok(())
    }
}

/// How a chat's messages become its prompt: Hugging Face's `apply_chat_template` options, as
/// vLLM takes them on chat requests and `/tokenize`.
#[derive(Deserialize, Debug, Default)]
pub struct TemplateOptions {
    /// Open the assistant's turn after the messages (default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of answering it: the prompt ends where
    /// its text ends (a prefilled answer). Excludes `add_generation_prompt`.
    pub continue_final_message: Option<bool>,
    /// More variables for the template (Qwen3's `enable_thinking`…).
    pub chat_template_kwargs: Option<Value>,
    /// A request's own template: refused (the server renders its model's).
    pub chat_template: Option<Value>,
}

/// [`TemplateOptions`] checked.
#[derive(Debug, Default, Clone)]
pub struct Templating {
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub kwargs: Option<serde_json::Map<String, Value>>,
}

/// Most `chat_template_kwargs` entries.
pub const MAX_TEMPLATE_KWARGS: usize = 64;

impl TemplateOptions {
    pub fn checked(&self) -> Result<Templating, ApiError> {
        if self.chat_template.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad(
                "a request's own `chat_template` is not supported (the model's is used)",
                Some("chat_template"),
            ));
        }
        let cont = self.continue_final_message.unwrap_or(false);
        let open = self.add_generation_prompt.unwrap_or(!cont);
        if cont && open {
            return Err(ApiError::bad(
                "`continue_final_message` and `add_generation_prompt` cannot both be true",
                Some("continue_final_message"),
            ));
        }
        let kwargs = match &self.chat_template_kwargs {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) if m.len() <= MAX_TEMPLATE_KWARGS => Some(m.clone()),
            Some(Value::Object(_)) => {
                return Err(ApiError::bad(
                    format!("at most {MAX_TEMPLATE_KWARGS} `chat_template_kwargs`"),
                    Some("chat_template_kwargs"),
                ));
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "`chat_template_kwargs` is an object",
                    Some("chat_template_kwargs"),
                ));
            }
        };
        if let Some(name) = kwargs.as_ref().and_then(|k| {
            k.keys()
                .find(|n| dspark_runtime::chat::RESERVED_VARIABLES.contains(&n.as_str()))
        }) {
            return Err(ApiError::bad(
                format!(
                    "`{}` is set by the server, not through `chat_template_kwargs`",
                    clip(name)
                ),
                Some("chat_template_kwargs"),
            ));
        }
        Ok(Templating {
            add_generation_prompt: open,
            continue_final_message: cont,
            kwargs,
        })
    }
}

/// Most `guided_choice` strings, and the longest one in bytes.
pub const MAX_CHOICES: usize = 256;
pub const MAX_CHOICE_BYTES: usize = 1024;

/// What guided decoding asks the answer to be, however the request spelled it.
enum Guided {
    Json(Value),
    JsonObject,
    Regex(String),
    Choice(Vec<String>),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Option<Prompt>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant turn's function calls, sent back in a later request.
    pub tool_calls: Option<Value>,
    /// A `tool` turn: the call it answers.
    pub tool_call_id: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Option<Vec<ChatMessage>>,
    /// OpenAI function definitions (`[{"type": "function", "function": {"name", ...}}]`).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    /// Accepted; a forced call is always one call.
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub template: TemplateOptions,
    #[serde(flatten)]
    pub common: Common,
}

/// `tools` as the template sees them: a tool without `type` (or with `null`) is a function,
/// and says so, as vLLM fills it in before rendering (templates write `tool | tojson`).
pub fn typed_tools(tools: &Value) -> Value {
    let mut tools = tools.clone();
    if let Some(list) = tools.as_array_mut() {
        for t in list.iter_mut() {
            if let Some(m) = t.as_object()
                && m.get("type").is_none_or(Value::is_null)
            {
                // First, where a client that sends it writes it.
                let mut typed = serde_json::Map::new();
                typed.insert("type".into(), Value::String("function".into()));
                typed.extend(
                    m.iter()
                        .filter(|(k, _)| *k != "type")
                        .map(|(k, v)| (k.clone(), v.clone())),
                );
                *t = Value::Object(typed);
            }
        }
    }
    tools
}

/// Most functions a request may define.
pub const MAX_TOOLS: usize = 128;

/// A function call the output must be: its name and its `parameters` schema (compiled and
/// checked), which the arguments are decoded under.
#[derive(Debug, Clone, PartialEq)]
pub struct ForcedCall {
    pub name: String,
    pub parameters: Value,
}

impl ChatRequest {
    /// Validates `tools` and `tool_choice`; the call the output must be, if any.
    ///
    /// `"required"` (with one function) and a named function decode the arguments under the
    /// function's `parameters`, as vLLM's guided tool choice does, so the call always parses.
    /// `"auto"` would need a parser of each model's own tool-call format, which this server
    /// does not have: like vLLM without `--enable-auto-tool-choice`, it is refused.
    pub fn forced_call(&self) -> Result<Option<ForcedCall>, ApiError> {
        match self.tool_mode(false)? {
            ToolMode::Forced(f) => Ok(Some(f)),
            _ => Ok(None),
        }
    }

    /// As [`ChatRequest::forced_call`]; with `auto` (a tool-call parser is configured),
    /// `"auto"` with tools gives [`ToolMode::Auto`]: the model answers freely and its calls
    /// are parsed out of the text.
    pub fn tool_mode(&self, auto: bool) -> Result<ToolMode, ApiError> {
        let bad = |m: String| ApiError::bad(m, Some("tools"));
        let mut funcs: Vec<(String, Value)> = Vec::new();
        match &self.tools {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) => {
                if list.len() > MAX_TOOLS {
                    return Err(bad(format!("at most {MAX_TOOLS} tools")));
                }
                for t in list {
                    // `type` left out (or null) is a function, as vLLM reads it.
                    if !matches!(t.get("type"), None | Some(Value::Null))
                        && t.get("type").and_then(Value::as_str) != Some("function")
                    {
                        return Err(bad(
                            "each tool must be {\"type\": \"function\", \"function\": {...}}"
                                .into(),
                        ));
                    }
                    let f = t
                        .get("function")
                        .filter(|f| f.is_object())
                        .ok_or_else(|| bad("a tool needs a `function` object".into()))?;
                    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
                    if name.is_empty()
                        || name.len() > 64
                        || !name
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                    {
                        return Err(bad(format!(
                            "function name `{name}`: 1 to 64 letters, digits, `_` or `-`"
                        )));
                    }
                    if funcs.iter().any(|(n, _)| n == name) {
                        return Err(bad(format!("function `{name}` is defined twice")));
                    }
                    let params = match f.get("parameters") {
                        None | Some(Value::Null) => {
                            serde_json::json!({"type": "object", "properties": {}})
                        }
                        // `{"type": "object"}` alone is how many tools say "no arguments"
                        // (MCP's, among others): the empty object.
                        Some(Value::Object(o))
                            if o.get("type").and_then(Value::as_str) == Some("object")
                                && o.keys().all(|k| {
                                    ["type", "title", "description", "$schema", "$id", "$comment"]
                                        .contains(&k.as_str())
                                }) =>
                        {
                            let mut o = o.clone();
                            o.insert("properties".into(), serde_json::json!({}));
                            Value::Object(o)
                        }
                        Some(p) => p.clone(),
                    };
                    funcs.push((name.to_string(), params));
                }
            }
            Some(_) => return Err(bad("`tools` must be a list".into())),
        }
        let choice_bad = |m: &str| ApiError::bad(m, Some("tool_choice"));
        let names = || funcs.iter().map(|(n, _)| n.clone()).collect();
        let name = match &self.tool_choice {
            None | Some(Value::Null) if funcs.is_empty() => return Ok(ToolMode::None),
            Some(Value::String(c)) if c == "none" => return Ok(ToolMode::None),
            None | Some(Value::Null) if auto => return Ok(ToolMode::Auto(names())),
            None | Some(Value::Null) => return Err(choice_bad(AUTO_REFUSED)),
            Some(Value::String(c)) if c == "auto" => {
                if funcs.is_empty() {
                    return Ok(ToolMode::None);
                }
                if auto {
                    return Ok(ToolMode::Auto(names()));
                }
                return Err(choice_bad(AUTO_REFUSED));
            }
            Some(Value::String(c)) if c == "required" => match funcs.len() {
                0 => return Err(choice_bad("tool_choice `required` needs `tools`")),
                1 => funcs[0].0.clone(),
                _ => {
                    return Err(choice_bad(
                        "tool_choice `required` with several tools: name the function \
                         ({\"type\": \"function\", \"function\": {\"name\": ...}})",
                    ));
                }
            },
            Some(c @ Value::Object(_)) => {
                let n = c
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| {
                        matches!(c.get("type"), None | Some(Value::Null))
                            || c.get("type").and_then(Value::as_str) == Some("function")
                    })
                    .ok_or_else(|| {
                        choice_bad(
                            "tool_choice must be `none`, `auto`, `required` or \
                             {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                    })?;
                if !funcs.iter().any(|(f, _)| f == n) {
                    return Err(choice_bad(&format!(
                        "tool_choice names `{n}`, which `tools` does not define"
                    )));
                }
                n.to_string()
            }
            Some(_) => {
                return Err(choice_bad(
                    "tool_choice must be `none`, `auto`, `required` or \
                     {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ));
            }
        };
        let parameters = funcs
            .into_iter()
            .find(|(f, _)| *f == name)
            .map(|(_, p)| p)
            .unwrap_or_default();
        dspark_runtime::json_schema::Schema::compile(&parameters)
            .map_err(|e| bad(format!("function `{name}` parameters: {e}")))?;
        Ok(ToolMode::Forced(ForcedCall { name, parameters }))
    }
}

/// How a chat request's `tools` shape its answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// Text.
    None,
    /// One call of this function, its arguments decoded under its schema.
    Forced(ForcedCall),
    /// The model's own words, with calls of these functions parsed out.
    Auto(Vec<String>),
}

const AUTO_REFUSED: &str = "tool_choice `auto` (the default with `tools`) needs a parser of \
    this model's own tool-call format: start the router with --tool-call-parser hermes if the \
    model writes <tool_call> blocks (Qwen2.5, Hermes), or set tool_choice to `required` or {\"type\": \"function\", \"function\": {\"name\": ...}} (the arguments are \
    then decoded under the function's parameters schema), or `none`";

/// Validated generation settings.
#[derive(Debug, Clone)]
pub struct GenSettings {
    pub max_tokens: usize,
    /// The request gave no max_tokens (nor max_completion_tokens): `max_tokens` is the default,
    /// which chat trims to the room the prompt leaves; a given one is refused if it overflows.
    pub max_tokens_defaulted: bool,
    pub sampling: kernels::sampling::SamplingParams,
    pub stop: Vec<String>,
    pub seed: u64,
    pub stream: bool,
    pub include_usage: bool,
    /// The stop string that ends the answer is part of its text (vLLM's
    /// `include_stop_str_in_output`).
    pub include_stop: bool,
    /// Every chunk carries the usage so far (`stream_options.continuous_usage_stats`).
    pub continuous_usage: bool,
    pub gamma: u32,
    pub return_token_ids: bool,
    /// Log-probability of each output token and this many alternatives; None: not asked.
    pub logprobs: Option<usize>,
    /// Choices to generate (each a request of its own, sampled with seed + index).
    pub n: usize,
    /// Completions: the prompt precedes the completion in the text (and in the
    /// log-probabilities, its first token with none).
    pub echo: bool,
    /// `echo` with `max_tokens: 0`: the prompt only, scored.
    pub score_only: bool,
    pub ignore_eos: bool,
    pub min_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// JSON mode: the output is one JSON object.
    pub json: bool,
    /// Structured output: the output is a document of this schema (its JSON text, checked).
    pub json_schema: Option<String>,
    /// Guided decoding: the whole output matches this regex (checked).
    pub regex: Option<String>,
    /// Chat: the output is the arguments of a call of this function (`tool_calls`).
    pub tool_call: Option<String>,
    /// Chat, `tool_choice: "auto"`: calls of these functions are parsed out of the output.
    pub auto_tools: Option<Vec<String>>,
}

pub const MAX_STOPS: usize = 16;
/// Most `logit_bias` entries per request (each costs an add per sampled position).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most `stop_token_ids` per request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Most choices per request.
pub const MAX_N: usize = 16;
/// Most alternatives per token (OpenAI's bound; the target worker enforces the same).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Common {
    /// Checks every field against this server's limits and the tokenizer's `vocab` size.
    pub fn settings(
        &self,
        default_max: usize,
        limit: usize,
        vocab: usize,
    ) -> Result<GenSettings, ApiError> {
        self.check_unsupported()?;
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
            Some(_) => {
                return Err(ApiError::bad(
                    format!("n must be in 1..={MAX_N}"),
                    Some("n"),
                ));
            }
        };
        let top = match self.top_logprobs {
            None => None,
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
            Some(_) => {
                return Err(ApiError::bad(
                    format!("top_logprobs must be in 0..={}", MAX_TOP_LOGPROBS),
                    Some("top_logprobs"),
                ));
            }
        };
        let logprobs = match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {
                if top.is_some_and(|n| n > 0) {
                    return Err(ApiError::bad(
                        "top_logprobs needs logprobs: true",
                        Some("top_logprobs"),
                    ));
                }
                None
            }
            Some(Value::Bool(true)) => Some(top.unwrap_or(0)),
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= MAX_TOP_LOGPROBS as u64) => {
                n.as_u64().map(|n| n as usize)
            }
            Some(_) => {
                return Err(ApiError::bad(
                    format!(
                        "logprobs must be true or false (chat) or a number of alternatives in \
                         0..={} (completions)",
                        MAX_TOP_LOGPROBS
                    ),
                    Some("logprobs"),
                ));
            }
        };
        // As OpenAI and vLLM: options of a stream on a request that does not stream are a
        // mistake worth saying (the usage asked for would never come as a chunk).
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::bad(
                "stream_options is only allowed with stream: true",
                Some("stream_options"),
            ));
        }
        let echo = self.echo == Some(true);
        let max = self.max_completion_tokens.or(self.max_tokens);
        let score_only = echo && max == Some(0);
        let max_tokens = match max {
            None => default_max,
            // Echo without generating: the prompt scored (one token is made, and dropped).
            Some(0) if echo => 1,
            Some(m) if m < 1 => {
                return Err(ApiError::bad(
                    "max_tokens must be at least 1",
                    Some("max_tokens"),
                ));
            }
            Some(m) if m as u64 > limit as u64 => {
                return Err(ApiError::bad(
                    format!("max_tokens {m} is over this server's limit of {limit}"),
                    Some("max_tokens"),
                ));
            }
            Some(m) => m as usize,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad(
                "temperature must be in [0, 2]",
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad("top_p must be in (0, 1]", Some("top_p")));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(_) => {
                return Err(ApiError::bad(
                    "top_k must be -1, 0 or positive",
                    Some("top_k"),
                ));
            }
        };
        let pen = |v: Option<f64>, name: &'static str| -> Result<f32, ApiError> {
            let v = v.unwrap_or(0.0);
            if (-2.0..=2.0).contains(&v) {
                Ok(v as f32)
            } else {
                Err(ApiError::bad(
                    format!("{name} must be in [-2, 2]"),
                    Some(name),
                ))
            }
        };
        let presence = pen(self.presence_penalty, "presence_penalty")?;
        let frequency = pen(self.frequency_penalty, "frequency_penalty")?;
        let rep = self.repetition_penalty.unwrap_or(1.0);
        if !(rep > 0.0 && rep <= 10.0) {
            return Err(ApiError::bad(
                "repetition_penalty must be in (0, 10]",
                Some("repetition_penalty"),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StringOrList::One(s)) => vec![s.clone()],
            Some(StringOrList::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(ApiError::bad(
                format!("stop takes at most {MAX_STOPS} non-empty strings of up to 256 bytes"),
                Some("stop"),
            ));
        }
        let gamma = match self.gamma {
            None => 0,
            Some(g) if (0..=32).contains(&g) => g as u32,
            Some(_) => return Err(ApiError::bad("gamma must be in [0, 32]", Some("gamma"))),
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::bad("min_p must be in [0, 1]", Some("min_p")));
        }
        let token = |t: i64, name: &'static str| -> Result<u32, ApiError> {
            u32::try_from(t)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::bad(
                        format!("{name}: token id {t} outside the vocabulary of {vocab}"),
                        Some(name),
                    )
                })
        };
        let mut bias = Vec::new();
        if let Some(m) = &self.logit_bias {
            if m.len() > MAX_LOGIT_BIAS {
                return Err(ApiError::bad(
                    format!("logit_bias takes at most {MAX_LOGIT_BIAS} tokens"),
                    Some("logit_bias"),
                ));
            }
            for (k, &b) in m {
                let t = k.trim().parse::<i64>().map_err(|_| {
                    ApiError::bad(
                        format!("logit_bias keys are token ids, got {:?}", clip(k)),
                        Some("logit_bias"),
                    )
                })?;
                let t = token(t, "logit_bias")?;
                if !(-100.0..=100.0).contains(&b) {
                    return Err(ApiError::bad(
                        format!("logit_bias for token {t} must be in [-100, 100], got {b}"),
                        Some("logit_bias"),
                    ));
                }
                if bias.iter().any(|&(u, _)| u == t) {
                    return Err(ApiError::bad(
                        format!("logit_bias names token {t} twice"),
                        Some("logit_bias"),
                    ));
                }
                bias.push((t, b as f32));
            }
        }
        let stop_token_ids = self
            .stop_token_ids
            .iter()
            .flatten()
            .map(|&t| token(t, "stop_token_ids"))
            .collect::<Result<Vec<u32>, _>>()?;
        if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::bad(
                format!("stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids"),
                Some("stop_token_ids"),
            ));
        }
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(m) if m >= 0 && m as u64 <= max_tokens as u64 => m as usize,
            Some(m) => {
                return Err(ApiError::bad(
                    format!("min_tokens must be in [0, max_tokens = {max_tokens}], got {m}"),
                    Some("min_tokens"),
                ));
            }
        };
        let mut json_schema = None;
        let json = match &self.response_format {
            None => false,
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => false,
                Some("json_object") => true,
                Some("json_schema") => {
                    let schema = f
                        .get("json_schema")
                        .and_then(|j| j.get("schema"))
                        .ok_or_else(|| {
                            ApiError::bad(
                                "response_format json_schema needs `json_schema.schema`",
                                Some("response_format"),
                            )
                        })?;
                    dspark_runtime::json_schema::Schema::compile(schema).map_err(|e| {
                        ApiError::bad(format!("json_schema: {e}"), Some("response_format"))
                    })?;
                    json_schema = Some(schema.to_string());
                    true
                }
                _ => {
                    return Err(ApiError::bad(
                        "response_format type must be `text`, `json_object` or `json_schema`",
                        Some("response_format"),
                    ));
                }
            },
        };
        let mut json = json;
        let mut regex = None;
        if let Some((g, param)) = self.guided()? {
            if self
                .response_format
                .as_ref()
                .is_some_and(|f| f.get("type").and_then(Value::as_str) != Some("text"))
            {
                return Err(ApiError::bad(
                    format!("{param} cannot be combined with response_format"),
                    Some(param),
                ));
            }
            let bad = |e: String| ApiError::bad(format!("{param}: {e}"), Some(param));
            match g {
                Guided::JsonObject => json = true,
                Guided::Json(schema) => {
                    dspark_runtime::json_schema::Schema::compile(&schema).map_err(bad)?;
                    json_schema = Some(schema.to_string());
                    json = true;
                }
                Guided::Regex(r) => {
                    dspark_runtime::json_schema::Pattern::full_match(&r).map_err(bad)?;
                    regex = Some(r);
                }
                Guided::Choice(c) => {
                    let r = dspark_runtime::json_schema::choice_regex(&c);
                    dspark_runtime::json_schema::Pattern::full_match(&r).map_err(bad)?;
                    regex = Some(r);
                }
            }
        }
        if (json || regex.is_some()) && min_tokens > 0 {
            return Err(ApiError::bad(
                "min_tokens cannot be combined with JSON mode or guided decoding",
                Some("min_tokens"),
            ));
        }
        if (json || regex.is_some()) && self.ignore_eos {
            // Once the document is whole only the end may follow: ignored, the request would
            // write end tokens up to max_tokens.
            return Err(ApiError::bad(
                "ignore_eos cannot be combined with JSON mode or guided decoding",
                Some("ignore_eos"),
            ));
        }
        let mut sampling = kernels::sampling::SamplingParams {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
            repetition_penalty: rep as f32,
            presence_penalty: presence,
            frequency_penalty: frequency,
            min_p: min_p as f32,
            ..Default::default()
        };
        sampling.set_logit_bias(bias);
        sampling
            .validate()
            .map_err(|e| ApiError::bad(e.to_string(), None))?;
        Ok(GenSettings {
            max_tokens,
            max_tokens_defaulted: max.is_none(),
            sampling,
            stop,
            seed: self
                .seed
                .map(|s| s as u64)
                .unwrap_or_else(crate::random_u64),
            stream: self.stream,
            include_stop: self.include_stop_str_in_output.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            // As vLLM's: only with the final usage.
            continuous_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage && o.continuous_usage_stats),
            gamma,
            return_token_ids: self.return_token_ids,
            logprobs,
            n,
            echo,
            score_only,
            ignore_eos: self.ignore_eos,
            min_tokens,
            stop_token_ids,
            json,
            json_schema,
            regex,
            tool_call: None,
            auto_tools: None,
        })
    }

    /// vLLM's guided decoding, as `guided_json` / `guided_regex` / `guided_choice` or as
    /// `structured_outputs`; at most one of them. With the parameter's name, for errors.
    fn guided(&self) -> Result<Option<(Guided, &'static str)>, ApiError> {
        if self.guided_grammar.is_some() {
            return Err(ApiError::bad(
                "guided_grammar is not supported (use guided_json, guided_regex or \
                 guided_choice)",
                Some("guided_grammar"),
            ));
        }
        let mut found = Vec::new();
        if let Some(v) = &self.guided_json {
            found.push((Guided::Json(schema_value(v, "guided_json")?), "guided_json"));
        }
        if let Some(v) = &self.guided_regex {
            found.push((
                Guided::Regex(regex_text(v, "guided_regex")?),
                "guided_regex",
            ));
        }
        if let Some(v) = &self.guided_choice {
            found.push((
                Guided::Choice(choices(v, "guided_choice")?),
                "guided_choice",
            ));
        }
        if let Some(so) = &self.structured_outputs {
            const P: &str = "structured_outputs";
            let o = so
                .as_object()
                .ok_or_else(|| ApiError::bad("structured_outputs must be an object", Some(P)))?;
            // Keys sent as null (a dumped model's unused fields) say nothing.
            for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
                match k.as_str() {
                    "json" => found.push((Guided::Json(schema_value(v, P)?), P)),
                    "regex" => found.push((Guided::Regex(regex_text(v, P)?), P)),
                    "choice" => found.push((Guided::Choice(choices(v, P)?), P)),
                    "json_object" if v.as_bool() == Some(true) => {
                        found.push((Guided::JsonObject, P))
                    }
                    "json_object" => {}
                    "whitespace_pattern" if !v.is_null() => {
                        return Err(ApiError::bad(
                            "structured_outputs.whitespace_pattern is not supported",
                            Some(P),
                        ));
                    }
                    "disable_fallback"
                    | "disable_any_whitespace"
                    | "disable_additional_properties"
                    | "whitespace_pattern" => {}
                    other => {
                        return Err(ApiError::bad(
                            format!(
                                "structured_outputs.{other} is not supported (use json, regex, \
                                 choice or json_object)"
                            ),
                            Some(P),
                        ));
                    }
                }
            }
        }
        if found.len() > 1 {
            return Err(ApiError::bad(
                "give one guided decoding constraint (guided_json, guided_regex, guided_choice \
                 or one key of structured_outputs)",
                Some(found[1].1),
            ));
        }
        Ok(found.pop())
    }
}

/// A JSON schema given as an object or as its JSON text.
fn schema_value(v: &Value, param: &'static str) -> Result<Value, ApiError> {
    match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| {
            ApiError::bad(format!("{param}: the schema is not JSON: {e}"), Some(param))
        }),
        Value::Object(_) => Ok(v.clone()),
        _ => Err(ApiError::bad(
            format!("{param} must be a JSON schema (an object or its JSON text)"),
            Some(param),
        )),
    }
}

fn regex_text(v: &Value, param: &'static str) -> Result<String, ApiError> {
    v.as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .ok_or_else(|| ApiError::bad(format!("{param} must be a non-empty string"), Some(param)))
}

fn choices(v: &Value, param: &'static str) -> Result<Vec<String>, ApiError> {
    let list = v
        .as_array()
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| ApiError::bad(format!("{param} must be a list of strings"), Some(param)))?;
    if list.is_empty() || list.len() > MAX_CHOICES {
        return Err(ApiError::bad(
            format!("{param} takes 1 to {MAX_CHOICES} strings"),
            Some(param),
        ));
    }
    if let Some(c) = list
        .iter()
        .find(|c| c.is_empty() || c.len() > MAX_CHOICE_BYTES)
    {
        return Err(ApiError::bad(
            format!(
                "{param}: each choice is 1 to {MAX_CHOICE_BYTES} bytes, got {:?}",
                clip(c)
            ),
            Some(param),
        ));
    }
    Ok(list)
}

impl ChatMessage {
    pub fn text(&self) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(s)) => Ok(s.clone()),
            Some(Content::Parts(p)) => {
                // Joined by newlines, as vLLM joins them: "Hello" + "world" is not "Helloworld".
                let mut out = String::new();
                for (i, part) in p.iter().enumerate() {
                    if part.kind != "text" {
                        return Err(ApiError::bad(
                            format!(
                                "content part type `{}` is not supported (text only)",
                                part.kind
                            ),
                            Some("messages"),
                        ));
                    }
                    if i > 0 {
                        out.push('\n');
                    }
                    out.push_str(part.text.as_deref().unwrap_or(""));
                }
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoed values are cut to 128 bytes at a character, marked as cut; short ones pass.
    #[test]
    fn errors_clip_what_they_echo() {
        assert_eq!(clip("gpt-4"), "gpt-4");
        let long = "é".repeat(200);
        let c = clip(&long);
        assert!(c.len() <= ECHO_LIMIT + '…'.len_utf8(), "{}", c.len());
        assert!(c.ends_with('…') && c.starts_with("éé"));
        let v = json!({"messages": [{"role": "user", "content": "hi"}],
            "logit_bias": {"x".repeat(10_000): 1}});
        let cr: ChatRequest = serde_json::from_value(v).unwrap();
        let e = cr.common.settings(16, 4096, 1000).unwrap_err();
        assert!(e.message.len() < 300, "{}", e.message.len());
    }

    fn req(tools: Value, choice: Value) -> ChatRequest {
        let mut v = json!({"messages": [{"role": "user", "content": "hi"}]});
        if !tools.is_null() {
            v["tools"] = tools;
        }
        if !choice.is_null() {
            v["tool_choice"] = choice;
        }
        serde_json::from_value(v).expect("request")
    }

    #[test]
    fn text_parts_are_joined_by_newlines() {
        let r: ChatRequest =
            serde_json::from_value(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]}))
            .expect("request");
        let m = &r.messages.as_ref().expect("messages")[0];
        assert_eq!(m.text().expect("text"), "Hello\nworld");
        let r: ChatRequest =
            serde_json::from_value(json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}))
            .expect("request");
        assert!(r.messages.as_ref().expect("messages")[0].text().is_err());
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn settings(extra: Value) -> Result<GenSettings, ApiError> {
        let mut v = json!({"prompt": "hi"});
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        let r: CompletionRequest = serde_json::from_value(v).expect("request");
        r.common.settings(16, 64, 1000)
    }

    /// Flags sent as `null` (clients that serialize every field) read as left out; stream
    /// options without a stream are refused, as OpenAI and vLLM do.
    #[test]
    fn null_flags_read_as_false_and_stream_options_need_a_stream() {
        let s = settings(json!({"stream": null, "ignore_eos": null, "return_token_ids": null}))
            .expect("null flags");
        assert!(!s.stream && !s.ignore_eos && !s.return_token_ids);
        let s = settings(json!({"stream": true, "stream_options": {"include_usage": null}}))
            .expect("null include_usage");
        assert!(s.stream && !s.include_usage);
        let s = settings(json!({"stream": true, "stream_options": {"include_usage": true}}))
            .expect("usage");
        assert!(s.include_usage && !s.continuous_usage);
        // As vLLM's: options given, usage is on unless said off.
        let s = settings(json!({"stream": true, "stream_options": {}})).expect("usage");
        assert!(s.include_usage);
        let s =
            settings(json!({"stream": true, "stream_options": {"continuous_usage_stats": true}}))
                .expect("continuous");
        assert!(s.include_usage && s.continuous_usage);
        let s = settings(
            json!({"stream": true, "stream_options": {"include_usage": false,
                                "continuous_usage_stats": true}}),
        )
        .expect("off");
        assert!(!s.include_usage && !s.continuous_usage);
        let s = settings(json!({"stream": true})).expect("no options");
        assert!(!s.include_usage && !s.continuous_usage);
        for extra in [
            json!({"stream_options": {"include_usage": true}}),
            json!({"stream": false, "stream_options": {}}),
        ] {
            let e = settings(extra.clone()).err().expect("refused");
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
            assert!(
                e.message.contains("stream_options"),
                "{extra}: {}",
                e.message
            );
        }
    }

    /// Parameters that would change the answer and are not implemented are refused by name;
    /// their default values pass (clients that send every field).
    #[test]
    fn unimplemented_parameters_are_refused_by_name() {
        for (extra, param) in [
            (json!({"suffix": "\n    return x"}), "suffix"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"best_of": 1, "n": 2}), "best_of"),
            (json!({"skip_special_tokens": false}), "skip_special_tokens"),
            (
                json!({"truncate_prompt_tokens": 8}),
                "truncate_prompt_tokens",
            ),
            (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        ] {
            let e = settings(extra.clone()).err().expect("refused");
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
            assert_eq!(e.param, Some(param), "{extra}");
        }
        for extra in [
            json!({"suffix": null, "best_of": 1, "include_stop_str_in_output": false,
                   "skip_special_tokens": true, "truncate_prompt_tokens": null,
                   "prompt_logprobs": null}),
            json!({"suffix": "", "best_of": 2, "n": 2}),
        ] {
            settings(extra.clone()).expect(&extra.to_string());
        }
        assert!(
            settings(json!({"include_stop_str_in_output": true}))
                .expect("taken")
                .include_stop
        );
    }

    #[test]
    fn guided_decoding_takes_vllm_spellings_and_one_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for (extra, regex, schema_text, json) in [
            (json!({"guided_regex": "[ab]+"}), Some("[ab]+"), None, false),
            (
                json!({"guided_choice": ["a.b", "c"]}),
                Some("a\\.b|c"),
                None,
                false,
            ),
            (
                json!({"guided_json": schema}),
                None,
                Some(schema.to_string()),
                true,
            ),
            (
                json!({"guided_json": schema.to_string()}),
                None,
                Some(schema.to_string()),
                true,
            ),
            (
                json!({"structured_outputs": {"choice": ["x"]}}),
                Some("x"),
                None,
                false,
            ),
            (
                json!({"structured_outputs": {"regex": "x+"}}),
                Some("x+"),
                None,
                false,
            ),
            (
                json!({"structured_outputs": {"json": schema}}),
                None,
                Some(schema.to_string()),
                true,
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                None,
                None,
                true,
            ),
            (
                json!({"structured_outputs": {"regex": "x", "grammar": null, "choice": null}}),
                Some("x"),
                None,
                false,
            ),
            (
                json!({"guided_regex": "x", "response_format": {"type": "text"}}),
                Some("x"),
                None,
                false,
            ),
        ] {
            let s = settings(extra.clone()).unwrap_or_else(|e| panic!("{extra}: {}", e.message));
            assert_eq!(s.regex.as_deref(), regex, "{extra}");
            assert_eq!(s.json_schema, schema_text, "{extra}");
            assert_eq!(s.json, json, "{extra}");
        }
        for (extra, want) in [
            (json!({"guided_regex": "("}), "guided_regex"),
            (json!({"guided_regex": 3}), "must be a non-empty string"),
            (json!({"guided_regex": ""}), "must be a non-empty string"),
            (json!({"guided_choice": []}), "1 to"),
            (json!({"guided_choice": ["a", 1]}), "list of strings"),
            (json!({"guided_choice": [""]}), "1 to 1024 bytes"),
            (json!({"guided_json": "{nope"}), "not JSON"),
            (
                json!({"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}}),
                "multipleOf",
            ),
            (json!({"guided_grammar": "root ::= x"}), "not supported"),
            (
                json!({"guided_regex": "x", "ignore_eos": true}),
                "ignore_eos cannot",
            ),
            (
                json!({"structured_outputs": {"json_object": true, "whitespace_pattern": " "}}),
                "whitespace_pattern",
            ),
            (
                json!({"structured_outputs": {"grammar": "root ::= x"}}),
                "grammar",
            ),
            (json!({"structured_outputs": 3}), "object"),
            (
                json!({"guided_regex": "x", "guided_choice": ["x"]}),
                "one guided",
            ),
            (
                json!({"guided_regex": "x", "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"guided_regex": "x", "min_tokens": 2}), "min_tokens"),
        ] {
            let e = settings(extra.clone())
                .err()
                .unwrap_or_else(|| panic!("{extra}"));
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains(want), "{extra}: {}", e.message);
        }
    }

    #[test]
    fn auto_is_served_with_a_parser_and_refused_without() {
        let two = json!([weather(), {"type": "function", "function": {"name": "noop"}}]);
        for choice in [Value::Null, json!("auto")] {
            assert_eq!(
                req(two.clone(), choice.clone()).tool_mode(true).unwrap(),
                ToolMode::Auto(vec!["get_weather".into(), "noop".into()])
            );
            let e = req(two.clone(), choice).tool_mode(false).unwrap_err();
            assert!(e.message.contains("--tool-call-parser"), "{}", e.message);
        }
        assert_eq!(
            req(two.clone(), json!("none")).tool_mode(true).unwrap(),
            ToolMode::None
        );
        assert_eq!(
            req(json!([]), json!("auto")).tool_mode(true).unwrap(),
            ToolMode::None
        );
        assert!(matches!(
            req(json!([weather()]), json!("required"))
                .tool_mode(true)
                .unwrap(),
            ToolMode::Forced(_)
        ));
    }

    /// A tool without `type` reaches the template as the same tool with it (first, as clients
    /// write it): `tool | tojson` renders one prompt either way, as vLLM's.
    #[test]
    fn untyped_tools_render_as_typed_ones() {
        let typed = json!([{"type": "function", "function": {"name": "f"}}, {"type": "x"}]);
        let bare = json!([{"function": {"name": "f"}}, {"type": "x"}]);
        let null = json!([{"function": {"name": "f"}, "type": null}, {"type": "x"}]);
        for t in [&typed, &bare, &null] {
            assert_eq!(typed_tools(t).to_string(), typed.to_string());
        }
    }

    #[test]
    fn a_forced_call_is_the_named_or_only_function() {
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let noop = json!({"type": "function", "function": {"name": "noop"}});
        let two = json!([weather(), noop]);
        let f = req(two.clone(), named.clone())
            .forced_call()
            .unwrap()
            .unwrap();
        assert_eq!(f.name, "get_weather");
        assert_eq!(f.parameters["required"], json!(["city"]));
        // `type` left out of a tool and of the choice reads as a function (as vLLM's); another
        // type is refused.
        let untyped = json!([{"function": {"name": "get_weather"}}, {"type": null,
            "function": {"name": "noop"}}]);
        let f = req(untyped.clone(), json!({"function": {"name": "noop"}}))
            .forced_call()
            .unwrap()
            .unwrap();
        assert_eq!(f.name, "noop");
        assert!(
            req(
                json!([{"type": "code_interpreter", "function": {"name": "noop"}}]),
                json!("required")
            )
            .forced_call()
            .is_err()
        );
        assert!(
            req(
                untyped,
                json!({"type": "tool", "function": {"name": "noop"}})
            )
            .forced_call()
            .is_err()
        );
        let f = req(json!([weather()]), json!("required"))
            .forced_call()
            .unwrap()
            .unwrap();
        assert_eq!(f.name, "get_weather");
        // No parameters: an empty object.
        let f = req(json!([noop]), json!("required"))
            .forced_call()
            .unwrap()
            .unwrap();
        assert_eq!(f.parameters, json!({"type": "object", "properties": {}}));
        // `{"type": "object"}` alone (MCP's way to say no arguments): the empty object too,
        // which the schema compiler takes (it refuses free-form objects).
        let bare = json!({"type": "function", "function": {"name": "noop",
            "parameters": {"type": "object"}}});
        let f = req(json!([bare]), json!("required"))
            .forced_call()
            .unwrap()
            .unwrap();
        assert_eq!(f.parameters, json!({"type": "object", "properties": {}}));
        assert!(dspark_runtime::json_schema::Schema::compile(&f.parameters).is_ok());
        assert_eq!(req(Value::Null, Value::Null).forced_call().unwrap(), None);
        assert_eq!(req(two.clone(), json!("none")).forced_call().unwrap(), None);
        assert_eq!(req(json!([]), json!("auto")).forced_call().unwrap(), None);
    }

    #[test]
    fn bad_tools_and_choices_are_refused_by_name() {
        let two = json!([weather(), {"type": "function", "function": {"name": "noop"}}]);
        for (tools, choice, want) in [
            (two.clone(), Value::Null, "`auto`"),
            (two.clone(), json!("auto"), "`auto`"),
            (two.clone(), json!("required"), "name the function"),
            (json!([]), json!("required"), "needs `tools`"),
            (
                two.clone(),
                json!({"type": "function", "function": {"name": "nope"}}),
                "`nope`",
            ),
            (
                two.clone(),
                json!({"type": "tool", "function": {"name": "noop"}}),
                "tool_choice must be",
            ),
            (two.clone(), json!(3), "tool_choice must be"),
            (json!({"a": 1}), json!("none"), "must be a list"),
            (
                json!([{"type": "retrieval"}]),
                json!("none"),
                "\"function\"",
            ),
            (
                json!([{"type": "function"}]),
                json!("none"),
                "`function` object",
            ),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                json!("none"),
                "letters, digits",
            ),
            (
                json!([weather(), weather()]),
                json!("none"),
                "defined twice",
            ),
            (
                json!([{"type": "function", "function": {"name": "f",
                    "parameters": {"type": "object", "properties": {"x": {"type": "integer", "multipleOf": 2}}}}}]),
                json!("required"),
                "`multipleOf`",
            ),
        ] {
            let e = req(tools.clone(), choice.clone())
                .forced_call()
                .expect_err(&format!("{tools} / {choice}"));
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains(want), "{}: {want}", e.message);
        }
    }
}
