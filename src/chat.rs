//! Chat templates: the model's own Jinja `chat_template` (tokenizer_config.json or
//! chat_template.jinja) rendered with minijinja the way transformers' `apply_chat_template`
//! does: `messages`, `add_generation_prompt`, the special tokens as variables,
//! `raise_exception`, and Python string methods (`.strip()`, `.startswith()`, ...).

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

pub struct ChatTemplate {
    source: String,
    origin: PathBuf,
    bos_token: String,
    eos_token: String,
    /// Why this template cannot be used (kept rather than failing at load, so a model whose
    /// template is unusable still loads for plain generation).
    problem: Option<String>,
}

/// `bos_token` and `eos_token` of a tokenizer_config.json (plain strings or {content: ...}).
pub fn special_tokens(cfg: &serde_json::Value) -> (Option<String>, Option<String>) {
    let get = |k: &str| {
        let t = cfg.get(k)?;
        t.as_str().map(String::from).or_else(|| t.get("content").and_then(|c| c.as_str()).map(String::from))
    };
    (get("bos_token"), get("eos_token"))
}

impl ChatTemplate {
    /// The model folder's template: `chat_template.jinja`, else `chat_template` in
    /// tokenizer_config.json. `None` when the model has none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => serde_json::from_str(&t).map_err(|e| Error::Tokenizer { path: cfg_path.clone(), msg: format!("not valid JSON: {e}") })?,
            Err(_) => serde_json::Value::Null,
        };
        let (bos, eos) = special_tokens(&cfg);
        let (bos_token, eos_token) = (bos.unwrap_or_default(), eos.unwrap_or_default());
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            return Ok(Some(ChatTemplate { source, origin: jinja, bos_token, eos_token, problem: None }));
        }
        let source = match cfg.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            // A list of named templates: take "default", as transformers does. Without one,
            // transformers refuses; an empty template here would render every conversation as
            // "" and make every record bad for a reason nobody could see.
            Some(serde_json::Value::Array(list)) => {
                let name = |t: &serde_json::Value| t.get("name").and_then(|n| n.as_str()).map(String::from);
                let default = list.iter().find(|t| name(t).as_deref() == Some("default"));
                match default.map(|t| t.get("template").and_then(|s| s.as_str())) {
                    Some(Some(s)) => s.to_string(),
                    Some(None) => return Ok(Some(Self::unusable(cfg_path, "chat_template `default` has no string `template`".into()))),
                    None => {
                        let names: Vec<String> = list.iter().filter_map(name).collect();
                        let msg = format!("chat_template lists named templates ({}) but none is called `default`", names.join(", "));
                        return Ok(Some(Self::unusable(cfg_path, msg)));
                    }
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(ChatTemplate { source, origin: cfg_path, bos_token, eos_token, problem: None }))
    }

    fn unusable(origin: PathBuf, problem: String) -> Self {
        ChatTemplate { source: String::new(), origin, bos_token: String::new(), eos_token: String::new(), problem: Some(problem) }
    }

    pub fn from_source(source: &str, bos_token: &str, eos_token: &str) -> Self {
        ChatTemplate { source: source.into(), origin: PathBuf::from("(built-in)"), bos_token: bos_token.into(), eos_token: eos_token.into(), problem: None }
    }

    /// Whether the template can render at all (an error naming the file and why not).
    pub fn usable(&self) -> Result<()> {
        match &self.problem {
            Some(p) => Err(Error::Tokenizer { path: self.origin.clone(), msg: p.clone() }),
            None => Ok(()),
        }
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.usable()?;
        let err = |e: minijinja::Error| Error::Tokenizer { path: self.origin.clone(), msg: format!("chat template: {e}") };
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String { String::new() });
        // transformers renders with jinja2's trim_blocks and lstrip_blocks on.
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(err)?;
        env.set_syntax(syntax);
        env.add_template("chat", &self.source).map_err(err)?;
        let t = env.get_template("chat").map_err(err)?;
        t.render(minijinja::context! {
            messages => messages
                .iter()
                .map(|m| minijinja::context! { role => m.role.clone(), content => m.content.clone() })
                .collect::<Vec<_>>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(err)
    }
}
