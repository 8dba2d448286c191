//! Chat templates: the model's own Jinja `chat_template` (tokenizer_config.json or
//! chat_template.jinja) rendered with minijinja the way transformers' `apply_chat_template`
//! does: `messages`, `add_generation_prompt`, the special tokens as variables,
//! `raise_exception`, and Python string methods (`.strip()`, `.startswith()`, ...) with
//! Python's whitespace and line breaks (`python_string_methods`).

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

    /// The same message with other content (its other keys kept).
    pub fn with_content(&self, content: &str) -> Self {
        Message { content: content.into(), ..self.clone() }
    }

    /// An assistant message with no content (`"content": null`, as OpenAI-style tool-call
    /// turns have): the template sees None, which is what selects its tool-call branch.
    pub fn without_content(role: &str) -> Self {
        let mut m = Message::new(role, "");
        m.extra.insert("content".into(), serde_json::Value::Null);
        m
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
    /// Seconds since the Unix epoch when the template was loaded (what `strftime_now` formats).
    now: u64,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
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
            return Ok(Some(ChatTemplate { source, origin: jinja, bos_token, eos_token, problem: None, now: unix_now() }));
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
        Ok(Some(ChatTemplate { source, origin: cfg_path, bos_token, eos_token, problem: None, now: unix_now() }))
    }

    fn unusable(origin: PathBuf, problem: String) -> Self {
        ChatTemplate { source: String::new(), origin, bos_token: String::new(), eos_token: String::new(), problem: Some(problem), now: 0 }
    }

    pub fn from_source(source: &str, bos_token: &str, eos_token: &str) -> Self {
        ChatTemplate { source: source.into(), origin: PathBuf::from("(built-in)"), bos_token: bos_token.into(), eos_token: eos_token.into(), problem: None, now: unix_now() }
    }

    /// What `strftime_now` formats (seconds since the epoch): a resumed run renders with the
    /// time its checkpoint recorded, so its records are tokenized as the uninterrupted run's.
    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn set_now(&mut self, secs: u64) {
        self.now = secs;
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
        env.set_unknown_method_callback(python_string_methods);
        env.add_filter("trim", |s: String, chars: Option<String>| trim(&s, chars.as_deref(), true, true));
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        // transformers: `datetime.now().strftime(format)` (Llama 3.x's "Today Date"). The time
        // is the template's (when the run loaded it), so one run renders one date throughout.
        let now = self.now;
        env.add_function("strftime_now", move |fmt: String| -> String { strftime(&fmt, now) });
        // transformers renders with jinja2's trim_blocks and lstrip_blocks on.
        let syntax = minijinja::syntax::SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(err)?;
        env.set_syntax(syntax);
        let source = without_generation_tags(&self.source);
        env.add_template("chat", &source).map_err(err)?;
        let t = env.get_template("chat").map_err(err)?;
        t.render(minijinja::context! {
            messages => messages
                .iter()
                .map(|m| {
                    let mut o: std::collections::BTreeMap<String, minijinja::Value> = m.extra.iter().map(|(k, v)| (k.clone(), jinja_value(v))).collect();
                    o.insert("role".into(), m.role.clone().into());
                    if !m.extra.contains_key("content") {
                        o.insert("content".into(), m.content.clone().into());
                    }
                    minijinja::Value::from_object(o)
                })
                .collect::<Vec<_>>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        })
        .map_err(err)
    }
}

/// Whitespace as Python's `str.isspace` has it (jinja2's `trim` and `.strip()` are Python's):
/// Rust's `char::is_whitespace` plus the ASCII separators 0x1c-0x1f.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// `s.strip(chars)` / `.lstrip` / `.rstrip` (`left`, `right`): `chars` or Python's whitespace.
fn trim(s: &str, chars: Option<&str>, left: bool, right: bool) -> String {
    let strip = |c: char| chars.map_or_else(|| py_space(c), |set| set.contains(c));
    let s = if left { s.trim_start_matches(strip) } else { s };
    let s = if right { s.trim_end_matches(strip) } else { s };
    s.to_string()
}

/// minijinja-contrib's Python string methods, with Python's whitespace and line boundaries
/// where they differ from Rust's: `strip`/`lstrip`/`rstrip` without arguments, `split()`
/// without a separator, and `splitlines` (which also breaks at \r, \v, \f, 0x1c-0x1e,
/// 0x85, U+2028 and U+2029, where Rust's `lines` breaks at \n only).
fn python_string_methods(state: &mut minijinja::State, value: &minijinja::Value, method: &str, args: &[minijinja::Value]) -> std::result::Result<minijinja::Value, minijinja::Error> {
    use minijinja::value::from_args;
    let Some(s) = value.as_str() else {
        return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args);
    };
    match method {
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Ok(trim(s, chars, method != "rstrip", method != "lstrip").into())
        }
        "split" if args.first().is_none_or(|a| a.is_none()) => {
            let (_, max): (Option<minijinja::Value>, Option<i64>) = from_args(args)?;
            Ok(split_whitespace(s, max.filter(|&m| m >= 0).map(|m| m as usize)).into_iter().map(minijinja::Value::from).collect())
        }
        "splitlines" => {
            let (keepends,): (Option<bool>,) = from_args(args)?;
            Ok(splitlines(s, keepends.unwrap_or(false)).into_iter().map(minijinja::Value::from).collect())
        }
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// Python's `s.split(None, max)`: runs of whitespace separate, none at the ends.
fn split_whitespace(s: &str, max: Option<usize>) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s.trim_start_matches(py_space);
    while !rest.is_empty() {
        if max.is_some_and(|m| out.len() == m) {
            out.push(rest.to_string());
            break;
        }
        let end = rest.find(py_space).unwrap_or(rest.len());
        out.push(rest[..end].to_string());
        rest = rest[end..].trim_start_matches(py_space);
    }
    out
}

/// Python's `s.splitlines(keepends)`.
fn splitlines(s: &str, keepends: bool) -> Vec<String> {
    let boundary = |c: char| matches!(c, '\n' | '\r' | '\x0b' | '\x0c' | '\x1c' | '\x1d' | '\x1e' | '\u{85}' | '\u{2028}' | '\u{2029}');
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find(boundary) {
        let end = if rest[i..].starts_with("\r\n") { i + 2 } else { i + rest[i..].chars().next().map_or(1, char::len_utf8) };
        out.push(rest[..if keepends { end } else { i }].to_string());
        rest = &rest[end..];
    }
    if !rest.is_empty() {
        out.push(rest.to_string());
    }
    out
}

/// `source` with transformers' `{% generation %}` ... `{% endgeneration %}` (its jinja extension
/// marking what the assistant says, for `return_assistant_tokens_mask`) as a block that always
/// renders, whitespace control kept: the same text, where minijinja would refuse the unknown tag.
fn without_generation_tags(source: &str) -> std::borrow::Cow<'_, str> {
    if !source.contains("generation") {
        return source.into();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        out += &rest[..open];
        let tag = &rest[open..];
        let Some(close) = tag.find("%}") else {
            rest = tag;
            break;
        };
        let inner = &tag[2..close];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        let replaced = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(r) => out += &format!("{{%{lead} {r} {trail}%}}"),
            None => out += &tag[..close + 2],
        }
        rest = &tag[close + 2..];
    }
    out += rest;
    out.into()
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
        serde_json::Value::Object(o) => Value::from_object(o.iter().map(|(k, v)| (k.clone(), jinja_value(v))).collect::<std::collections::BTreeMap<String, Value>>()),
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
        assert_eq!(without_generation_tags("{% if x %}a{% endif %}"), "{% if x %}a{% endif %}");
    }

    #[test]
    fn a_message_hands_its_other_keys_to_the_template() {
        let t = ChatTemplate::from_source("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}{{ m.content }};{% endfor %}", "", "");
        let mut a = Message::new("assistant", "42");
        a.extra.insert("reasoning_content".into(), "6 x 7".into());
        assert_eq!(t.render(&[Message::new("user", "q"), a], false).unwrap(), "user:q;assistant:[6 x 7]42;");
    }
}
