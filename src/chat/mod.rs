//! Chat templates: the model's own Jinja `chat_template` (tokenizer_config.json or
//! chat_template.jinja) rendered with minijinja the way transformers' `apply_chat_template`
//! does: `messages`, `add_generation_prompt`, the special tokens as variables,
//! `raise_exception`, `tools` and `documents` (None unless a record has `tools`), a record's
//! `chat_template_kwargs` as TRL passes them, jinja2's loop controls, dicts in insertion
//! order, and Python's string methods and transformers' `tojson` (`python.rs`).

mod python;

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// The message's other keys (`reasoning_content`, `tool_calls`, `name`, ...), handed to the
    /// template as they are: templates read them (Qwen3 and DeepSeek-V3.1 render
    /// `reasoning_content` inside the turn), and transformers passes every key through.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into(), extra: Default::default() }
    }

    /// The same message with other content (its other keys kept; a `content: null` replaced).
    pub fn with_content(&self, content: &str) -> Self {
        let mut m = Message { content: content.into(), ..self.clone() };
        m.extra.remove("content");
        m
    }

    /// An assistant message with no content (`"content": null`, as OpenAI-style tool-call
    /// turns have): the template sees None, which is what selects its tool-call branch.
    pub fn without_content(role: &str) -> Self {
        let mut m = Message::new(role, "");
        m.extra.insert("content".into(), serde_json::Value::Null);
        m
    }
}

/// Template variables beyond the conversation, by name (a record's `tools`, its
/// `chat_template_kwargs`).
pub type Vars = serde_json::Map<String, serde_json::Value>;

/// Names `apply_chat_template` binds itself: a record's `chat_template_kwargs` cannot set them.
pub const RESERVED_VARS: &[&str] = &["messages", "add_generation_prompt", "tools", "documents", "conversation", "chat_template", "continue_final_message", "tokenize"];

/// The file a folder holds its chat template in (a model's, which transformers reads before
/// tokenizer_config.json's `chat_template`, or an adapter's: the template it was trained with).
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

pub struct ChatTemplate {
    source: String,
    origin: PathBuf,
    bos_token: String,
    eos_token: String,
    /// tokenizer_config.json's other special tokens (`unk_token`, `pad_token`, ...), which
    /// transformers also hands the template.
    other_tokens: Vec<(String, String)>,
    /// Why this template cannot be used (kept rather than failing at load, so a model whose
    /// template is unusable still loads for plain generation).
    problem: Option<String>,
    /// Seconds since the Unix epoch when the template was loaded (what `strftime_now` formats).
    now: u64,
    /// The template compiled once, on first use (a record's turns render it several times
    /// each), or why it does not compile.
    env: std::sync::OnceLock<std::result::Result<Compiled, String>>,
}

/// A template compiled, and whether its source has `{% generation %}` blocks (found while
/// rewriting them, so a record's mask does not scan the source again).
struct Compiled {
    env: minijinja::Environment<'static>,
    generation_blocks: bool,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A special token of a tokenizer_config.json (a plain string or {content: ...}).
fn special_token(cfg: &serde_json::Value, key: &str) -> Option<String> {
    token_text(cfg.get(key)?)
}

/// A special token's text: a plain string or {content: ...}.
fn token_text(t: &serde_json::Value) -> Option<String> {
    t.as_str().map(String::from).or_else(|| t.get("content").and_then(|c| c.as_str()).map(String::from))
}

/// `bos_token` and `eos_token` of a tokenizer_config.json.
pub fn special_tokens(cfg: &serde_json::Value) -> (Option<String>, Option<String>) {
    (special_token(cfg, "bos_token"), special_token(cfg, "eos_token"))
}

/// A model folder's optional JSON file (`tokenizer_config.json`, `special_tokens_map.json`,
/// `generation_config.json`): Null where the folder has none. One that is there but cannot
/// be read or parsed is an error naming it: read as absent, a stray comma in
/// tokenizer_config.json swapped its eos_token for config.json's and trained another end
/// token with exit 0.
pub fn optional_json(dir: &Path, name: &str) -> Result<serde_json::Value> {
    let path = dir.join(name);
    match std::fs::read_to_string(&path) {
        Ok(t) => serde_json::from_str(&t).map_err(|e| Error::Config { path, msg: format!("not valid JSON: {e}") }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(serde_json::Value::Null),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// BOS and EOS of a model folder's tokenizer ([`with_special_tokens_map`]).
pub fn model_special_tokens(dir: &Path) -> Result<(Option<String>, Option<String>)> {
    let cfg = optional_json(dir, "tokenizer_config.json")?;
    Ok(special_tokens(&with_special_tokens_map(dir, cfg)?))
}

/// The special tokens a model folder's tokenizer has: those of tokenizer_config.json, and
/// each one it does not set from special_tokens_map.json (older and minimal repos name BOS
/// and EOS only there; without it a template's `{{ eos_token }}` rendered empty and every
/// assistant turn lost its end). transformers reads the map too (in its legacy path the map
/// wins where the two disagree; here tokenizer_config.json does). `cfg` is
/// tokenizer_config.json's object (Null where there is none).
pub fn with_special_tokens_map(dir: &Path, mut cfg: serde_json::Value) -> Result<serde_json::Value> {
    let serde_json::Value::Object(map) = optional_json(dir, "special_tokens_map.json")? else { return Ok(cfg) };
    if cfg.is_null() {
        cfg = serde_json::Value::Object(Default::default());
    }
    if let Some(obj) = cfg.as_object_mut() {
        for key in ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"] {
            let unset = obj.get(key).is_none_or(|v| v.is_null());
            if let (true, Some(v)) = (unset, map.get(key).filter(|v| token_text(v).is_some())) {
                obj.insert(key.into(), v.clone());
            }
        }
    }
    Ok(cfg)
}

/// The special tokens other than BOS and EOS that tokenizer_config.json names.
fn other_special_tokens(cfg: &serde_json::Value) -> Vec<(String, String)> {
    ["unk_token", "sep_token", "pad_token", "cls_token", "mask_token"].iter().filter_map(|k| Some((k.to_string(), special_token(cfg, k)?))).collect()
}

impl ChatTemplate {
    /// The model folder's template: `chat_template.jinja`, else `chat_template` in
    /// tokenizer_config.json. `None` when the model has none.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>> {
        let jinja = dir.join(TEMPLATE_FILE);
        if jinja.is_file() {
            return Self::from_file(&jinja, dir).map(Some);
        }
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = with_special_tokens_map(dir, optional_json(dir, "tokenizer_config.json")?)?;
        let (bos, eos) = special_tokens(&cfg);
        let (bos_token, eos_token) = (bos.unwrap_or_default(), eos.unwrap_or_default());
        let other_tokens = other_special_tokens(&cfg);
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
        Ok(Some(ChatTemplate { source, origin: cfg_path, bos_token, eos_token, other_tokens, problem: None, now: unix_now(), env: Default::default() }))
    }

    /// The Jinja template in `path` (a model's `chat_template.jinja`, or one a recipe names, as
    /// TRL's `chat_template_path`), with the special tokens of the model in `model_dir`.
    pub fn from_file(path: &Path, model_dir: &Path) -> Result<Self> {
        let cfg = with_special_tokens_map(model_dir, optional_json(model_dir, "tokenizer_config.json")?)?;
        let (bos, eos) = special_tokens(&cfg);
        let source = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Ok(ChatTemplate {
            source,
            origin: path.to_path_buf(),
            bos_token: bos.unwrap_or_default(),
            eos_token: eos.unwrap_or_default(),
            other_tokens: other_special_tokens(&cfg),
            problem: None,
            now: unix_now(),
            env: Default::default(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    fn unusable(origin: PathBuf, problem: String) -> Self {
        ChatTemplate { source: String::new(), origin, bos_token: String::new(), eos_token: String::new(), other_tokens: Vec::new(), problem: Some(problem), now: 0, env: Default::default() }
    }

    pub fn from_source(source: &str, bos_token: &str, eos_token: &str) -> Self {
        ChatTemplate {
            source: source.into(),
            origin: PathBuf::from("(built-in)"),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            other_tokens: Vec::new(),
            problem: None,
            now: unix_now(),
            env: Default::default(),
        }
    }

    /// What `strftime_now` formats (seconds since the epoch): a resumed run renders with the
    /// time its checkpoint recorded, so its records are tokenized as the uninterrupted run's.
    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn set_now(&mut self, secs: u64) {
        self.now = secs;
        // Compiled with the old time in `strftime_now`: compiled again on next use.
        self.env = Default::default();
    }

    /// Whether the template can render at all: it was found whole and compiles (an error
    /// naming the file and why not).
    pub fn usable(&self) -> Result<()> {
        self.compiled().map(|_| ())
    }

    /// The compiled template (compiled on first use), or why it cannot render.
    fn compiled(&self) -> Result<&Compiled> {
        if let Some(p) = &self.problem {
            return Err(Error::Tokenizer { path: self.origin.clone(), msg: p.clone() });
        }
        let env = self.env.get_or_init(|| self.compile().map_err(|e| e.to_string()));
        env.as_ref().map_err(|m| Error::Tokenizer { path: self.origin.clone(), msg: format!("chat template: {m}") })
    }

    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, &Vars::new(), add_generation_prompt)
    }

    /// Render with template variables `vars` beside the conversation (a record's `tools`
    /// and `chat_template_kwargs`), as transformers' `apply_chat_template` renders.
    pub fn render_with(&self, messages: &[Message], vars: &Vars, add_generation_prompt: bool) -> Result<String> {
        self.render_ctx(messages, vars, add_generation_prompt, false)
    }

    /// Whether the template marks what the assistant says with transformers' `{% generation %}`
    /// blocks (what `return_assistant_tokens_mask`, and so TRL's `assistant_only_loss`, reads).
    pub fn has_generation_blocks(&self) -> bool {
        self.compiled().is_ok_and(|c| c.generation_blocks)
    }

    /// The conversation rendered as [`Self::render_with`] renders it (no generation prompt),
    /// with the byte ranges of the text its `{% generation %}` blocks wrote, in order
    /// (transformers' generation indices, empty ones included: its mask trains a token that
    /// straddles one; a block inside another is part of the outer one's range). The text holds U+FDD0 / U+FDD1 where a message did (the
    /// marks): a caller compares it with the plain rendering to catch that.
    pub fn render_generation_spans(&self, messages: &[Message], vars: &Vars) -> Result<(String, Vec<std::ops::Range<usize>>)> {
        let marked = self.render_ctx(messages, vars, false, true)?;
        let mut text = String::with_capacity(marked.len());
        let (mut spans, mut depth, mut start) = (Vec::new(), 0usize, 0);
        for c in marked.chars() {
            match c {
                GENERATION_OPEN => {
                    if depth == 0 {
                        start = text.len();
                    }
                    depth += 1;
                }
                GENERATION_CLOSE if depth > 0 => {
                    depth -= 1;
                    if depth == 0 {
                        spans.push(start..text.len());
                    }
                }
                c => text.push(c),
            }
        }
        Ok((text, spans))
    }

    fn render_ctx(&self, messages: &[Message], vars: &Vars, add_generation_prompt: bool, mark_generation: bool) -> Result<String> {
        use minijinja::Value;
        let env = &self.compiled()?.env;
        let err = |msg: String| Error::Tokenizer { path: self.origin.clone(), msg: format!("chat template: {msg}") };
        let t = env.get_template("chat").map_err(|e| err(e.to_string()))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                // A message's keys in the record's order (Python dicts keep it): role and
                // content first, as records have them, then the others.
                let mut o: indexmap::IndexMap<Value, Value> = indexmap::IndexMap::new();
                o.insert("role".into(), m.role.clone().into());
                if !m.extra.contains_key("content") {
                    o.insert("content".into(), m.content.clone().into());
                }
                // Keys whose value is None are left out, as transformers 5 leaves them out
                // (Arrow gives every message every key any message has: `tool_calls: None`
                // on plain turns, which `'tool_calls' in message` templates would render as
                // tool calls), except `content`, whose None marks a tool-call turn.
                o.extend(m.extra.iter().filter(|(k, v)| !v.is_null() || k.as_str() == "content").map(|(k, v)| (Value::from(k.clone()), jinja_value(v))));
                alias_reasoning(&mut o);
                Value::from_object(o)
            })
            .collect();
        let mut ctx: indexmap::IndexMap<Value, Value> = indexmap::IndexMap::new();
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        for (k, v) in &self.other_tokens {
            ctx.insert(k.clone().into(), v.clone().into());
        }
        for (k, v) in vars {
            ctx.insert(k.clone().into(), jinja_value(v));
        }
        ctx.insert(MARK_GENERATION.into(), mark_generation.into());
        // minijinja 3.0.5 panics on some templates jinja2 renders (a `{% continue %}` inside a
        // `{% with %}` inside a loop): an error naming the template, not a crashed run.
        let ctx = Value::from_object(ctx);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.render(ctx))) {
            Ok(rendered) => rendered.map_err(|e| err(e.to_string())),
            Err(_) => Err(err("minijinja failed on this template (it panicked; see the message above), where jinja2 may render it: \
                               choose another data.template, or simplify the template"
                .into())),
        }
    }

    /// The template in an environment set up as transformers renders chat templates.
    fn compile(&self) -> std::result::Result<Compiled, minijinja::Error> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(python::string_methods);
        env.add_filter("trim", |s: String, chars: Option<String>| python::trim(&s, chars.as_deref(), true, true));
        env.add_filter("tojson", python::tojson);
        env.set_formatter(python::formatter);
        // jinja2's tests, where minijinja's differ: None is neither iterable nor a sequence
        // (minijinja: both, as an empty one; Nemotron 3 reads `tools is iterable and tools |
        // length`), and strings and dicts are sequences (they have a length and items).
        env.add_test("iterable", |v: &minijinja::Value| !v.is_none() && v.try_iter().is_ok());
        env.add_test("sequence", |v: &minijinja::Value| {
            use minijinja::value::ValueKind::*;
            matches!(v.kind(), Seq | String | Bytes | Map | Undefined)
        });
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        // transformers: `datetime.now().strftime(format)` (Llama 3.x's "Today Date"). The time
        // is the template's (when the run loaded it), so one run renders one date throughout.
        let now = self.now;
        env.add_function("strftime_now", move |fmt: String| -> String { strftime(&fmt, now) });
        // transformers renders with jinja2's trim_blocks and lstrip_blocks on.
        env.set_syntax(minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build()?);
        env.add_filter(GENERATION_FILTER, |state: &minijinja::State, body: String| -> String {
            match state.lookup(MARK_GENERATION).is_some_and(|v| v.is_true()) {
                true => format!("{GENERATION_OPEN}{body}{GENERATION_CLOSE}"),
                false => body,
            }
        });
        let (source, generation_blocks) = generation_as_filter(&self.source).map_err(|m| minijinja::Error::new(minijinja::ErrorKind::SyntaxError, m))?;
        // jinja2 reads every line break of a template (\r\n, \r) as \n.
        env.add_template_owned("chat", source.replace("\r\n", "\n").replace('\r', "\n"))?;
        Ok(Compiled { env, generation_blocks })
    }
}

/// Names a message's reasoning goes by, in the order transformers 5 looks for it.
const REASONING_KEYS: &[&str] = &["reasoning_content", "thinking", "reasoning"];

/// transformers 5's aliasing of a message's reasoning: the first of [`REASONING_KEYS`] the
/// message has is also its `reasoning_content` and, unless it has one, its `thinking` (the
/// first key either way), so a dataset's `reasoning` reaches templates that read `reasoning_content`
/// (Qwen3, DeepSeek-V3.1) and gpt-oss's, which read `thinking`.
fn alias_reasoning(o: &mut indexmap::IndexMap<minijinja::Value, minijinja::Value>) {
    let Some(r) = REASONING_KEYS.iter().find_map(|&k| o.get(&minijinja::Value::from(k))).cloned() else { return };
    // `{"thinking": r, **message, "reasoning_content": r}`: `thinking` first either way.
    let thinking = o.shift_remove(&minijinja::Value::from("thinking")).unwrap_or_else(|| r.clone());
    o.shift_insert(0, "thinking".into(), thinking);
    o.insert("reasoning_content".into(), r);
}

/// The filter `{% generation %}` blocks become, and the variable that tells it to mark them.
const GENERATION_FILTER: &str = "__finetune_generation";
const MARK_GENERATION: &str = "__finetune_mark_generation";
/// What the filter writes around a block's text when asked: Unicode noncharacters, which no
/// template writes and text for interchange should not hold.
const GENERATION_OPEN: char = '\u{FDD0}';
const GENERATION_CLOSE: char = '\u{FDD1}';

/// `source` with transformers' `{% generation %}` ... `{% endgeneration %}` (its jinja extension
/// marking what the assistant says, for `return_assistant_tokens_mask`) as a filter block
/// around a `with` block, whitespace control kept (all are block tags, so trim_blocks and
/// lstrip_blocks treat them alike): the same text, where minijinja would refuse the unknown
/// tag, and the filter marks where the block's text starts and ends when a render asks for
/// it. The `with` gives the body its own scope, as jinja2 renders it as a macro (a `set`
/// inside does not change the variable outside). Expressions, comments and `raw` blocks are
/// left as they are (a tag inside a string is text). Also whether there was a block. A
/// `{% continue %}` or `{% break %}` in a block outside a loop of its own is refused, as jinja2
/// refuses it (the body is a macro there; minijinja would jump out of the `with`).
fn generation_as_filter(source: &str) -> std::result::Result<(std::borrow::Cow<'_, str>, bool), String> {
    if !source.contains("generation") {
        return Ok((source.into(), false));
    }
    // A tag's name without its whitespace control, and that control on each side.
    fn parts(inner: &str) -> (&str, &str, &str) {
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        (lead, body.trim(), trail)
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    // Loops open, and how many were open where each generation block still open began.
    let (mut loops, mut blocks) = (0usize, Vec::new());
    while let Some(open) = ["{{", "{%", "{#"].iter().filter_map(|d| rest.find(d)).min() {
        out += &rest[..open];
        let tag = &rest[open..];
        let (close, strings) = match &tag[..2] {
            "{{" => ("}}", true),
            "{#" => ("#}", false),
            _ => ("%}", true),
        };
        let Some(end) = tag_end(tag, 2, close, strings) else {
            rest = tag;
            break;
        };
        rest = &tag[end..];
        if close != "%}" {
            out += &tag[..end];
            continue;
        }
        let (lead, name, trail) = parts(&tag[2..end - 2]);
        match name {
            "generation" => {
                found = true;
                blocks.push(loops);
                out += &format!("{{%{lead} filter {GENERATION_FILTER} %}}{{% with {trail}%}}");
            }
            "endgeneration" => {
                blocks.pop();
                out += &format!("{{%{lead} endwith %}}{{% endfilter {trail}%}}");
            }
            "raw" => {
                // Up to and with its `endraw` tag, as written.
                out += &tag[..end];
                let mut search = 0;
                let stop = loop {
                    let Some(o) = rest[search..].find("{%").map(|o| search + o) else { break rest.len() };
                    let Some(c) = tag_end(rest, o + 2, "%}", false) else { break rest.len() };
                    if parts(&rest[o + 2..c - 2]).1 == "endraw" {
                        break c;
                    }
                    search = c;
                };
                out += &rest[..stop];
                rest = &rest[stop..];
            }
            "continue" | "break" if blocks.last() == Some(&loops) => {
                return Err(format!("`{{% {name} %}}` inside a {{% generation %}} block, outside a loop of its own: jinja2 refuses it ('{name}' not properly in loop)"));
            }
            _ => {
                if name.starts_with("for ") {
                    loops += 1;
                } else if name == "endfor" {
                    loops = loops.saturating_sub(1);
                }
                out += &tag[..end];
            }
        }
    }
    out += rest;
    Ok((out.into(), found))
}

/// The index just past the first `close` in `s` from byte `from`, outside string literals
/// ('...' or "...", backslash escapes) where `strings` (jinja2 lexes them inside `{{ }}` and
/// `{% %}`, so a `}}` in one does not end the tag).
fn tag_end(s: &str, from: usize, close: &str, strings: bool) -> Option<usize> {
    let (b, c) = (s.as_bytes(), close.as_bytes());
    let (mut i, mut quote) = (from, None);
    while i < b.len() {
        match quote {
            Some(_) if b[i] == b'\\' => i += 1,
            Some(q) if b[i] == q => quote = None,
            Some(_) => {}
            None if strings && (b[i] == b'\'' || b[i] == b'"') => quote = Some(b[i]),
            None if b[i..].starts_with(c) => return Some(i + c.len()),
            None => {}
        }
        i += 1;
    }
    None
}

/// A JSON value as the template sees it (null is Python's None).
fn jinja_value(v: &serde_json::Value) -> minijinja::Value {
    use minijinja::Value;
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (_, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(s) => Value::from(s.clone()),
        serde_json::Value::Array(a) => a.iter().map(jinja_value).collect(),
        serde_json::Value::Object(o) => Value::from_object(o.iter().map(|(k, v)| (Value::from(k.clone()), jinja_value(v))).collect::<indexmap::IndexMap<Value, Value>>()),
    }
}

/// Python's `time.strftime(fmt)` for a UTC time `secs` after the epoch: the directives chat
/// templates use (%d %m %Y %y %b %B %a %A %H %M %S %j %e %%), C locale; another directive is
/// kept as written.
fn strftime(fmt: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = (secs / 86_400) as i64;
    let (h, mi, s) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    let (y, m, d) = crate::output::civil_date(days);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize];
    let yday = before + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{d:02}"),
            Some('e') => out += &format!("{d:>2}"),
            Some('m') => out += &format!("{m:02}"),
            Some('Y') => out += &y.to_string(),
            Some('y') => out += &format!("{:02}", y % 100),
            Some('b') => out += &MONTHS[(m - 1) as usize][..3],
            Some('B') => out += MONTHS[(m - 1) as usize],
            Some('a') => out += &DAYS[wday][..3],
            Some('A') => out += DAYS[wday],
            Some('H') => out += &format!("{h:02}"),
            Some('M') => out += &format!("{mi:02}"),
            Some('S') => out += &format!("{s:02}"),
            Some('j') => out += &format!("{yday:03}"),
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
    fn string_methods_and_trim_follow_python_whitespace_and_line_breaks() {
        // tests/fixtures/chat-templates/python-strings.json: transformers' renderer (jinja2) on
        // contents with 0x1c-0x1f at the edges and every line break Python's splitlines honours.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat-templates/python-strings.json");
        let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let messages: Vec<Message> = serde_json::from_value(f["messages"].clone()).unwrap();
        let t = ChatTemplate::from_source(f["template"].as_str().unwrap(), "", "");
        assert_eq!(t.render(&messages, false).unwrap(), f["text"].as_str().unwrap());
    }

    #[test]
    fn strftime_formats_as_python_does() {
        // time.strftime(f, time.gmtime(s)) in Python for these instants.
        assert_eq!(strftime("%d %b %Y", 1_764_115_200), "26 Nov 2025");
        assert_eq!(strftime("%A %B %e, %y %H:%M:%S %j %%", 951_782_400 + 3_723), "Tuesday February 29, 00 01:02:03 060 %");
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
    }

    #[test]
    fn generation_tags_render_their_content_with_their_whitespace_control() {
        let t = ChatTemplate::from_source("{% for m in messages %}{{ m.role }}:\n{%- generation -%}\n {{ m.content }}{% endgeneration %};{% endfor %}", "", "");
        assert_eq!(t.render(&[Message::new("assistant", "hi")], false).unwrap(), "assistant:hi;");
        assert!(t.has_generation_blocks());
        // Marked: the blocks' text (every message's content here), in bytes; an empty block
        // where it stands.
        let (text, spans) = t.render_generation_spans(&[Message::new("user", "é"), Message::new("assistant", ""), Message::new("assistant", "hi")], &Vars::new()).unwrap();
        assert_eq!(text, "user:é;assistant:;assistant:hi;");
        assert_eq!(spans, vec![5..7, 18..18, 29..31]);
        // Nested: the outer block's range.
        let n = ChatTemplate::from_source("a{% generation %}b{% generation %}c{% endgeneration %}d{% endgeneration %}e{% generation %}f{% endgeneration %}", "", "");
        assert_eq!(n.render_generation_spans(&[], &Vars::new()).unwrap(), ("abcdef".to_string(), vec![1..4, 5..6]));
        assert!(!ChatTemplate::from_source("{{ 'generation' }}", "", "").has_generation_blocks());
        // Not in a comment or a raw block, which stay as written.
        let c = "{# {% generation %} #}{% raw %}{% generation %}{% endraw %}{{ 'x' }}";
        assert_eq!(generation_as_filter(c), Ok((c.into(), false)));
        assert_eq!(ChatTemplate::from_source(c, "", "").render(&[], false).unwrap(), "{% generation %}x");
        // Nor in a string, where `%}` or `}}` do not end the tag either; `{%}` is text there.
        let lit = "{{ 'a{% generation %}b}}{%}' }}{% set x = '%}{#' %}{{ x }}";
        assert_eq!(generation_as_filter(lit), Ok((lit.into(), false)));
        assert_eq!(ChatTemplate::from_source(lit, "", "").render(&[], false).unwrap(), "a{% generation %}b}}{%}%}{#");
        // A `continue` in a block outside a loop of its own is refused (jinja2 refuses it);
        // in a loop inside the block it is that loop's.
        let stray = "{% for m in messages %}{% generation %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endgeneration %}{% endfor %}";
        assert!(ChatTemplate::from_source(stray, "", "").usable().unwrap_err().to_string().contains("not properly in loop"));
        let inner = "{% generation %}{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}{% endgeneration %}";
        let t = ChatTemplate::from_source(inner, "", "");
        assert_eq!(t.render(&[Message::new("user", "q"), Message::new("assistant", "a")], false).unwrap(), "a");
        // A template minijinja panics on (jinja2 renders it): an error, not a crash.
        let with = ChatTemplate::from_source("{% for m in messages %}{% with %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endwith %}{% endfor %}", "", "");
        assert!(with.render(&[Message::new("user", "q")], false).unwrap_err().to_string().contains("minijinja failed on this template"));
        // The body has its own scope, as jinja2's macro body: a `set` inside stays inside.
        let scoped = ChatTemplate::from_source("{% set x = 'out' %}{% for m in messages %}{% generation %}{% set x = m.content %}{{ x }}{% endgeneration %}|{{ x }}{% endfor %}", "", "");
        assert_eq!(scoped.render(&[Message::new("assistant", "in")], false).unwrap(), "in|out");
        assert_eq!(generation_as_filter("{% if x %}a{% endif %}"), Ok(("{% if x %}a{% endif %}".into(), false)));
    }

    #[test]
    fn a_message_hands_its_other_keys_to_the_template() {
        let t = ChatTemplate::from_source("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}{{ m.content }};{% endfor %}", "", "");
        let mut a = Message::new("assistant", "42");
        a.extra.insert("reasoning_content".into(), "6 x 7".into());
        assert_eq!(t.render(&[Message::new("user", "q"), a], false).unwrap(), "user:q;assistant:[6 x 7]42;");
    }
}
