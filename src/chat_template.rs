//! The engine's chat template, rendered as the engine renders it (precise mode).
//!
//! In precise mode (`routing.hashing = "precise"`) the gateway's prompt blocks must be
//! the engine's own KV blocks: the same token ids cut at the same places. vLLM renders
//! a chat request through the model's Jinja chat template (with
//! `add_generation_prompt`) and tokenizes the text without adding special tokens; a
//! completion prompt is tokenized as given, with them. [`ChatTemplate`] does the
//! rendering with minijinja (plus the Python string methods real templates call), from
//! a `.jinja` file or the `chat_template` of a `tokenizer_config.json`, loaded once at
//! config load. Rendering and tokenizing happen on the shard, off the fast bytes path;
//! see docs/real-vllm.md, "Precise mode", for the cost.

use minijinja::{Environment, Value};
use std::path::Path;

const TEMPLATE_NAME: &str = "chat";

/// A loaded chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    path: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("path", &self.path)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads `path`: a Jinja file, or a `tokenizer_config.json` with a string
    /// `chat_template` (its `bos_token` / `eos_token` are read too).
    #[allow(clippy::disallowed_methods)] // read once at config load, off the shards
    pub fn load(path: &str) -> Result<ChatTemplate, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("cannot read `{path}`: {e}"))?;
        let (source, bos, eos) = if path.ends_with(".json") {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("`{path}` is not JSON: {e}"))?;
            let source = v["chat_template"]
                .as_str()
                .ok_or_else(|| format!("`{path}` has no string `chat_template`"))?
                .to_string();
            let token = |k: &str| match &v[k] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .unwrap_or_default()
                    .to_string(),
                _ => String::new(),
            };
            (source, token("bos_token"), token("eos_token"))
        } else {
            (text, String::new(), String::new())
        };
        Self::from_source(source, bos, eos, path)
    }

    /// The template next to a `tokenizer.json`: `chat_template.jinja`, else the
    /// `chat_template` of `tokenizer_config.json`, in the same directory.
    pub fn find_beside(tokenizer_path: &str) -> Option<String> {
        let dir = Path::new(tokenizer_path).parent()?;
        ["chat_template.jinja", "tokenizer_config.json"]
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.is_file())
            .map(|p| p.to_string_lossy().into_owned())
    }

    pub fn from_source(
        source: String,
        bos_token: String,
        eos_token: String,
        path: &str,
    ) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| format!("`{path}` is not a valid chat template: {e}"))?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            path: path.to_string(),
        })
    }

    /// Renders a chat request's `messages` (and `tools`, if any) with the generation
    /// prompt, as vLLM does before tokenizing.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, minijinja::Error> {
        let tmpl = self.env.get_template(TEMPLATE_NAME)?;
        tmpl.render(minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => true,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t =
            ChatTemplate::from_source(CHATML.into(), String::new(), String::new(), "t").unwrap();
        let messages = serde_json::json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"}
        ]);
        assert_eq!(
            t.render(&messages, None).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}";
        let t = ChatTemplate::from_source(src.into(), String::new(), String::new(), "t").unwrap();
        let ok = serde_json::json!([{"role": "user", "content": "  hi "}]);
        assert_eq!(t.render(&ok, None).unwrap(), "HI");
        let bad = serde_json::json!([{"role": "system", "content": "x"}]);
        assert!(t
            .render(&bad, None)
            .unwrap_err()
            .to_string()
            .contains("first must be user"));
    }

    #[test]
    fn a_broken_template_is_refused_at_load() {
        let e =
            ChatTemplate::from_source("{% for %}".into(), String::new(), String::new(), "x.jinja")
                .unwrap_err();
        assert!(e.contains("x.jinja"), "{e}");
    }
}
