//! The checkpoint's chat template, rendered with minijinja the way Hugging Face's
//! `apply_chat_template` renders it with jinja2: `trim_blocks` and `lstrip_blocks`, Python
//! string and dict methods, HF's `tojson` (Python `json.dumps`, no HTML escaping) and
//! `raise_exception`. Tools are deep-sorted and also handed to the template as Kimi's
//! TypeScript declaration (`tools_ts_str`), as Kimi's tokenizer does.
//!
//! The template comes from `chat_template.jinja` in the checkpoint folder, else from
//! `tokenizer_config.json`'s `chat_template`, else the Kimi-K2.5 template this crate ships
//! (`templates/kimi_k25_chat_template.jinja`).

use std::path::{Path, PathBuf};

use kernels::files::{TEXT_FILE_LIMIT, read_text_bounded};
use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::{Map, Value};
use thiserror::Error;

use crate::text::tokenizer::Tokenizer;
use crate::text::tool_declaration::{deep_sort, encode_tools, write_python_json};

/// The Kimi-K2.5 chat template (reconstructed; see the file's header).
pub const KIMI_K25_TEMPLATE: &str = include_str!("../../templates/kimi_k25_chat_template.jinja");
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

#[derive(Debug, Error)]
pub enum TemplateError {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("chat template ({source_name}): {message}")]
    Render {
        source_name: String,
        message: String,
    },
}

/// The most template instructions one rendering may run. A request's size alone does not
/// bound a template's work: Kimi's template rebuilds its tool-response queue for every call,
/// so 12,000 tool calls cost 20 s of CPU. 2·10⁶ renders ~2,000 tool calls with their results
/// (100 calls cost ~10⁵) and stops any request within about a second.
pub const RENDER_FUEL: u64 = 2_000_000;

/// Where a template came from (for messages).
#[derive(Clone, Debug)]
pub enum TemplateSource {
    File(PathBuf),
    TokenizerConfig(PathBuf),
    Builtin,
}

impl std::fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File(p) => write!(f, "{}", p.display()),
            Self::TokenizerConfig(p) => write!(f, "{} `chat_template`", p.display()),
            Self::Builtin => write!(f, "built-in Kimi-K2.5 template"),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: TemplateSource,
}

/// What to render: OpenAI-style `messages` and `tools`, plus template keyword arguments
/// (`chat_template_kwargs`, e.g. `{"thinking": false}`).
#[derive(Clone, Debug, Default)]
pub struct RenderRequest<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a [Value]>,
    pub add_generation_prompt: bool,
    pub kwargs: Option<&'a Map<String, Value>>,
}

impl ChatTemplate {
    pub fn new(text: &str, source: TemplateSource) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("default delimiters"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_filter("tojson", python_tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", text.to_string())
            .map_err(|e| TemplateError::Render {
                source_name: source.to_string(),
                message: describe(&e),
            })?;
        Ok(Self { env, source })
    }

    /// The checkpoint's template: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template`, else the built-in Kimi-K2.5 template.
    pub fn from_dir(dir: &Path) -> Result<Self, TemplateError> {
        let file = dir.join(CHAT_TEMPLATE_FILE);
        if file.exists() {
            let text =
                read_text_bounded(&file, TEXT_FILE_LIMIT).map_err(|e| TemplateError::Load {
                    path: file.clone(),
                    message: e.to_string(),
                })?;
            return Self::new(&text, TemplateSource::File(file));
        }
        let config = dir.join(crate::text::tokenizer::TOKENIZER_CONFIG_FILE);
        if config.exists() {
            let load_error = |message: String| TemplateError::Load {
                path: config.clone(),
                message,
            };
            let text = read_text_bounded(&config, TEXT_FILE_LIMIT)
                .map_err(|e| load_error(e.to_string()))?;
            let json: Value = serde_json::from_str(&text).map_err(|e| load_error(e.to_string()))?;
            let template = match json.get("chat_template") {
                Some(Value::String(t)) => Some(t.clone()),
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(String::from),
                _ => None,
            };
            if let Some(template) = template {
                return Self::new(&template, TemplateSource::TokenizerConfig(config));
            }
        }
        Self::new(KIMI_K25_TEMPLATE, TemplateSource::Builtin)
    }

    /// Renders a conversation to prompt ids. Only the template's own markers become control
    /// tokens: every string of the request is text, whatever it spells
    /// ([`crate::text::control_tokens`]).
    pub fn render_ids(
        &self,
        request: &RenderRequest<'_>,
        tokenizer: &Tokenizer,
    ) -> Result<Vec<u32>, TemplateError> {
        let control = tokenizer.control_tokens();
        let messages: Vec<Value> = request
            .messages
            .iter()
            .map(|m| control.inert_value(m))
            .collect();
        let tools: Option<Vec<Value>> = request
            .tools
            .map(|tools| tools.iter().map(|t| control.inert_value(t)).collect());
        let kwargs = request.kwargs.map(|k| control.inert_map(k));
        let rendered = self.render(&RenderRequest {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt: request.add_generation_prompt,
            kwargs: kwargs.as_ref(),
        })?;
        Ok(tokenizer.encode_prompt(&rendered))
    }

    /// Renders a conversation to prompt text, as Hugging Face's `apply_chat_template` does
    /// (strings that spell special tokens included: [`ChatTemplate::render_ids`] is what a
    /// server encodes).
    pub fn render(&self, request: &RenderRequest<'_>) -> Result<String, TemplateError> {
        let mut context = Map::new();
        context.insert("messages".into(), Value::Array(request.messages.to_vec()));
        context.insert(
            "add_generation_prompt".into(),
            request.add_generation_prompt.into(),
        );
        // Kimi's tokenizer passes `thinking=True` unless told otherwise.
        context.insert("thinking".into(), true.into());
        match request.tools {
            Some(tools) if !tools.is_empty() => {
                let sorted: Vec<Value> = tools.iter().map(deep_sort).collect();
                // An encoder failure falls back to the template's JSON, as Kimi's tokenizer does.
                if let Ok(ts) = encode_tools(&sorted) {
                    context.insert("tools_ts_str".into(), ts.into());
                }
                context.insert("tools".into(), Value::Array(sorted));
            }
            _ => {
                context.insert("tools".into(), Value::Null);
            }
        }
        if let Some(kwargs) = request.kwargs {
            for (k, v) in kwargs {
                context.insert(k.clone(), v.clone());
            }
        }
        let template = self.env.get_template("chat").expect("added in new()");
        template
            .render(JinjaValue::from(minijinja::value::Serde(&context)))
            .map_err(|e| TemplateError::Render {
                source_name: self.source.to_string(),
                message: describe(&e),
            })
    }
}

fn describe(e: &JinjaError) -> String {
    if e.kind() == ErrorKind::OutOfFuel {
        return format!(
            "rendering this conversation takes more than the template's bound of {RENDER_FUEL} \
             steps (about 2,000 tool calls with their results): shorten it"
        );
    }
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        message.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    message
}

/// HF's `tojson`: Python `json.dumps(x, ensure_ascii=False)` with optional `separators` and
/// `sort_keys` (no HTML escaping, unlike Jinja's own filter).
fn python_tojson(value: JinjaValue, kwargs: Kwargs) -> Result<JinjaValue, JinjaError> {
    let mut json: Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (mut item_sep, mut key_sep) = (", ".to_string(), ": ".to_string());
    if let Some(separators) = kwargs.get::<Option<Vec<String>>>("separators")?
        && let [item, key] = separators.as_slice()
    {
        item_sep = item.clone();
        key_sep = key.clone();
    }
    if kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false) {
        json = deep_sort(&json);
    }
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<JinjaValue> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_python_json(&json, &mut out, &item_sep, &key_sep);
    Ok(JinjaValue::from_safe_string(out))
}

fn raise_exception(message: String) -> Result<JinjaValue, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(_format: String) -> Result<JinjaValue, JinjaError> {
    Err(JinjaError::new(
        ErrorKind::InvalidOperation,
        "strftime_now is not supported: the prompt would depend on the clock",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_builtin_template_ends_with_think_unless_thinking_is_off() {
        let t = ChatTemplate::new(KIMI_K25_TEMPLATE, TemplateSource::Builtin).unwrap();
        let messages = [json!({"role": "user", "content": "Hi"})];
        let on = t
            .render(&RenderRequest {
                messages: &messages,
                add_generation_prompt: true,
                ..Default::default()
            })
            .unwrap();
        assert!(
            on.ends_with("<|im_assistant|>assistant<|im_middle|><think>"),
            "{on}"
        );
        let off_kwargs = json!({"thinking": false});
        let off = t
            .render(&RenderRequest {
                messages: &messages,
                add_generation_prompt: true,
                kwargs: off_kwargs.as_object(),
                ..Default::default()
            })
            .unwrap();
        assert!(off.ends_with("<think></think>"), "{off}");
    }

    #[test]
    fn raise_exception_is_a_render_error() {
        let t = ChatTemplate::new(
            "{{ raise_exception('no system allowed') }}",
            TemplateSource::Builtin,
        )
        .unwrap();
        let err = t.render(&RenderRequest::default()).unwrap_err().to_string();
        assert!(err.contains("no system allowed"), "{err}");
    }
}
