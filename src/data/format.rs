//! Record formats and rendering: a row becomes token ids and labels.
//!
//! Formats: `tokenized` (input_ids, labels), `text` (continued pretraining: every token
//! trained), `alpaca` (instruction / input / output), `prompt_completion` (prompt /
//! completion) and `messages` (a list of {role, content}, multi-turn). Column names are
//! remappable (`[data.columns]`).
//!
//! Templates: `alpaca` (the Stanford Alpaca prompt), `raw` (prompt and completion
//! concatenated), `model` (the model's own chat template, as transformers'
//! `apply_chat_template`), or a built-in chat template: `chatml`, `deepseek`, `llama3`.
//!
//! Loss masking: by default only what the assistant says is trained. Where the chat template
//! marks it with `{% generation %}` blocks, that is the text of those blocks, as TRL's
//! `assistant_only_loss` trains it (`generation_spans`); otherwise each assistant turn's text
//! and its end-of-turn marker, found in the rendered conversation by rendering it up to each
//! turn (with and without the generation prompt; see `assistant_spans`). A token that overlaps
//! such a span is trained. For prompt/completion records, the tokens of the completion
//! (prompt and completion tokenized as one text, as TRL does).
//! `train_on_prompt = true` trains on every token (pre-tokenized rows with `labels` keep
//! theirs, as TRL does; a note says so).
//!
//! Truncation happens before the cost: with a token limit set (the loader sets
//! `data.max_seq_len`), only a bounded prefix of each text (a conversation: of its rendering)
//! is tokenized, and assistant turns are looked for only there; see
//! [`Formatter::set_token_limit`].

use super::{Example, IGNORE};
use crate::chat::{ChatTemplate, Message};
use crate::data::source::RowRef;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const FORMATS: &[&str] = &["tokenized", "text", "alpaca", "prompt_completion", "messages"];
/// The columns a format reads, each with whether every row must have it (the others are
/// read where present).
fn format_columns(format: &str) -> &'static [(&'static str, bool)] {
    match format {
        "tokenized" => &[("input_ids", true), ("labels", false), ("attention_mask", false), ("completion_mask", false), ("assistant_masks", false)],
        "text" => &[("text", true)],
        "alpaca" => &[("instruction", true), ("input", false), ("output", true)],
        "prompt_completion" => &[("prompt", true), ("completion", true), ("tools", false), ("chat_template_kwargs", false)],
        // `tools` and `chat_template_kwargs` as TRL's SFTTrainer reads them: the template's
        // `tools` and extra variables (V3.1's `thinking`, Qwen3's `enable_thinking`).
        _ => &[("messages", true), ("tools", false), ("chat_template_kwargs", false)],
    }
}

/// Whether the note on a built-in template's missing markers was printed (once a process:
/// a Formatter is built per rank and for eval data too).
static TEMPLATE_MARKERS_NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Whether the note that answers are trained without an end-of-sequence token was printed.
static NO_EOS_NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub const TEMPLATES: &[&str] = &["model", "alpaca", "raw", "chatml", "deepseek", "llama3"];

/// The endings that make `data.template` a path to a Jinja file rather than one of
/// [`TEMPLATES`]: those TRL's `chat_template_path` reads as a template file.
pub const TEMPLATE_FILE_ENDINGS: &[&str] = &[".jinja", ".j2"];

/// Whether `data.template`'s value names a Jinja file.
pub fn is_template_file(name: &str) -> bool {
    TEMPLATE_FILE_ENDINGS.iter().any(|e| name.ends_with(e))
}

/// ChatML (Qwen, SmolLM): `<|im_start|>role\ncontent<|im_end|>\n`.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
/// DeepSeek LLM chat: `User: ...\n\nAssistant: ...<eos>`.
const DEEPSEEK: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";
/// Llama 3 instruct.
const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// The Stanford Alpaca prompt (the plain template most instruction datasets were made for).
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately \
             completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides \
             further context. Write a response that appropriately completes the request.\n\n\
             ### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        )
    }
}

/// A record before tokenization.
pub enum Record {
    Tokens(Vec<i64>, Option<Vec<i64>>),
    Text(String),
    /// Single-turn prompt and answer (alpaca, prompt_completion).
    PromptCompletion(String, String),
    /// A conversation, the template variables its record sets (`tools`, ...), and where a
    /// conversational prompt/completion record's completion starts (everything from there
    /// is trained, as TRL trains it; `None`: a messages record, whose assistant turns are).
    Conversation(Vec<Message>, crate::chat::Vars, Option<usize>),
}

/// Why a record could not be used (reported, and skipped with on_bad_record = "skip").
pub struct BadRecord(pub String);

impl BadRecord {
    /// A row's read error as a bad record: its message without the file, which whoever
    /// reports the record names once.
    fn from_row_error(e: Error) -> Self {
        match e {
            Error::Data { msg, .. } => BadRecord(msg),
            e => BadRecord(e.to_string()),
        }
    }
}

enum Template {
    Alpaca,
    Raw,
    /// Boxed: the template is large next to the other variants' nothing.
    Chat(Box<ChatTemplate>),
}

/// Tokens past the limit that a cut prefix must still yield: merges across the cut only
/// change the last few tokens before it, so with this many to spare the kept ones are those
/// of the whole text.
const CUT_MARGIN: usize = 64;
/// Upper end for the bytes one token is assumed to cover when sizing a prefix. Real vocabs
/// hold runs of 80+ spaces; sizing every prefix for those would tokenize 2-3x more than typical
/// text needs, and a prefix that turns out too short is simply doubled.
const MAX_TOKEN_BYTES: usize = 64;

pub struct Formatter {
    pub format: String,
    columns: BTreeMap<String, String>,
    tokenizer: Option<tokenizers::Tokenizer>,
    tok_path: PathBuf,
    eos: Option<u32>,
    template: Template,
    train_on_prompt: bool,
    vocab: usize,
    /// Only the first this many tokens of a record are kept (None: tokenize everything).
    token_limit: Option<usize>,
    /// Bytes of text one token covers at most: the longest vocab entry's length, capped.
    token_bytes: usize,
    /// The note that train_on_prompt leaves a row's `labels` as they are was printed.
    labels_noted: std::sync::atomic::AtomicBool,
    /// Whether `template` is the model's own chat template.
    models_template: bool,
}

impl Formatter {
    /// `template` None picks the default for the format (alpaca -> "alpaca", prompt_completion
    /// and messages -> "model").
    pub fn new(
        format: &str,
        template: Option<&str>,
        columns: &BTreeMap<String, String>,
        train_on_prompt: bool,
        model_dir: &Path,
        vocab: usize,
    ) -> Result<Self> {
        let tok_path = model_dir.join("tokenizer.json");
        let needs_tokenizer = format != "tokenized";
        let tokenizer = if needs_tokenizer {
            if !tok_path.is_file() {
                return Err(Error::Tokenizer {
                    path: tok_path.clone(),
                    msg: format!("not found; data.format = \"{format}\" needs the model's tokenizer.json (or use format = \"tokenized\")"),
                });
            }
            let mut t = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer { path: tok_path.clone(), msg: e.to_string() })?;
            // tokenizer.json may carry the truncation and padding its exporter last used
            // (e.g. max_length 512, pad to 128). transformers resets both on every call, and
            // here they would silently cut records short or fill them with pad tokens that are
            // then trained on: the loader does its own truncation and the collator its own
            // padding.
            t.with_truncation(None).map_err(|e| Error::Tokenizer { path: tok_path.clone(), msg: e.to_string() })?;
            t.with_padding(None);
            Some(t)
        } else {
            None
        };
        let token_bytes = tokenizer
            .as_ref()
            .and_then(|t| t.get_vocab(true).keys().map(String::len).max())
            .unwrap_or(1)
            .clamp(1, MAX_TOKEN_BYTES);
        let (bos_s, eos_s) = crate::chat::model_special_tokens(model_dir)?;
        // The EOS appended to answers: the tokenizer's eos_token, else config.json's id. A
        // token named but not in the vocabulary, or an id past the model's, is an error
        // naming where it came from (falling back to the other silently trained another token).
        let (eos, eos_from) = match (tokenizer.as_ref(), eos_s.as_deref()) {
            (Some(t), Some(e)) => {
                let id = t.token_to_id(e).ok_or_else(|| Error::Tokenizer {
                    path: model_dir.join("tokenizer_config.json"),
                    msg: format!("eos_token `{e}` (here or in special_tokens_map.json) is not a token of {}", tok_path.display()),
                })?;
                (Some(id), "tokenizer_config.json")
            }
            _ => (eos_from_config(model_dir)?, "config.json"),
        };
        if let Some(id) = eos.filter(|&id| id as usize >= vocab) {
            let msg = format!("the end-of-sequence token it names is id {id}, past the model's vocabulary of {vocab} (config.json vocab_size)");
            return Err(Error::Tokenizer { path: model_dir.join(eos_from), msg });
        }
        let name = template.unwrap_or(match format {
            "alpaca" => "alpaca",
            "prompt_completion" | "messages" => "model",
            _ => "raw",
        });
        let bos = bos_s.unwrap_or_default();
        let eos_text = eos_s.unwrap_or_default();
        let mut models_template = false;
        let template = match name {
            "alpaca" => Template::Alpaca,
            "raw" => Template::Raw,
            "chatml" | "deepseek" | "llama3" => {
                // A built-in template's markers that the vocabulary lacks are trained as the
                // plain text they spell (several tokens each), as transformers would render
                // them: allowed, but said, since it is rarely what was meant.
                let (source, markers): (&str, &[&str]) = match name {
                    "chatml" => (CHATML, &["<|im_start|>", "<|im_end|>"]),
                    "llama3" => (LLAMA3, &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
                    _ => (DEEPSEEK, &[]),
                };
                let missing: Vec<&str> = markers.iter().copied().filter(|m| tokenizer.as_ref().is_some_and(|t| t.token_to_id(m).is_none())).collect();
                if !missing.is_empty() && !TEMPLATE_MARKERS_NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    crate::note!(
                        "note: data.template = \"{name}\": {} {} of {}, so the template writes {} as plain text (several tokens each); \
                         the model's own template (data.template = \"model\") or one written for its tokens may be what you want",
                        missing.join(", "),
                        if missing.len() == 1 { "is not a token" } else { "are not tokens" },
                        tok_path.display(),
                        if missing.len() == 1 { "it" } else { "them" }
                    );
                }
                Template::Chat(Box::new(ChatTemplate::from_source(source, &bos, &eos_text)))
            }
            // A Jinja file the recipe names (its path resolved by the caller), as TRL's
            // `chat_template_path`: with the model's special tokens.
            file if is_template_file(file) => {
                let t = ChatTemplate::from_file(Path::new(file), model_dir)?;
                t.usable()?;
                Template::Chat(Box::new(t))
            }
            _ => {
                let t = ChatTemplate::from_model_dir(model_dir)?.ok_or_else(|| Error::Tokenizer {
                    path: model_dir.join("tokenizer_config.json"),
                    msg: "the model has no chat template; set data.template to chatml, deepseek or llama3 (or alpaca or raw for single-turn records)".into(),
                })?;
                // Before any record: an unusable template would make every one of them bad.
                t.usable().map_err(|e| match e {
                    Error::Tokenizer { path, msg } => Error::Tokenizer { path, msg: format!("{msg}; set data.template to chatml, deepseek or llama3 (or alpaca or raw for single-turn records)") },
                    other => other,
                })?;
                models_template = true;
                Template::Chat(Box::new(t))
            }
        };
        if format == "messages" && matches!(template, Template::Alpaca | Template::Raw) {
            return Err(Error::Train(format!("data.template = \"{name}\" cannot render multi-turn messages; use model, chatml, deepseek or llama3")));
        }
        // Alpaca and raw records end with the EOS (TRL appends eos_token to completions):
        // without one the model never learns where its answer stops. (Tokenized rows are
        // trained as given.)
        if eos.is_none() && tokenizer.is_some() && matches!(template, Template::Alpaca | Template::Raw) && !NO_EOS_NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            crate::note!(
                "note: {} names no end-of-sequence token (tokenizer_config.json's eos_token, config.json's eos_token_id): records are trained without one, so the tuned model will not learn where an answer ends",
                model_dir.display()
            );
        }
        Ok(Formatter {
            format: format.into(),
            columns: columns.clone(),
            tokenizer,
            tok_path,
            eos,
            template,
            train_on_prompt,
            vocab,
            token_limit: None,
            token_bytes,
            labels_noted: Default::default(),
            models_template,
        })
    }

    /// Keep only the first `limit` tokens of each record, and spend only what that needs: a
    /// text (a conversation: its whole rendering, which is linear in its size) is tokenized
    /// from a prefix of `(limit + 64) * K` bytes (cut on a char boundary), K being the most
    /// bytes one token covers (the longest vocab entry, capped at 64). The prefix
    /// must still yield `limit + 64` tokens, else it is doubled and tried again, so the first
    /// `limit` tokens are those of the whole record (the 64 absorb merges across the cut) and a
    /// cut record is always longer than `limit`. Records are then at least `limit + 64` tokens
    /// long, not their full length, when cut.
    pub fn set_token_limit(&mut self, limit: Option<usize>) {
        self.token_limit = limit;
    }

    /// The time the chat template renders for `strftime_now` (None without a chat template).
    pub fn template_time(&self) -> Option<u64> {
        match &self.template {
            Template::Chat(t) => Some(t.now()),
            _ => None,
        }
    }

    pub fn set_template_time(&mut self, secs: u64) {
        if let Template::Chat(t) = &mut self.template {
            t.set_now(secs);
        }
    }

    /// Tokens a cut prefix must yield, and the byte bound to try first; None without a limit.
    fn cut_budget(&self) -> Option<(usize, usize)> {
        let need = self.token_limit?.saturating_add(CUT_MARGIN);
        Some((need, need.saturating_mul(self.token_bytes)))
    }

    fn col<'a>(&'a self, name: &'a str) -> &'a str {
        self.columns.get(name).map(String::as_str).unwrap_or(name)
    }

    /// Every column a format reads (the names `[data.columns]` may remap), required or not.
    pub fn columns_read(format: &str) -> Vec<&'static str> {
        format_columns(format).iter().map(|(n, _)| *n).collect()
    }

    /// The dataset columns `[data.columns]` maps a read column to (for checking they exist).
    pub fn mapped_columns(&self) -> impl Iterator<Item = (&str, &str)> {
        self.columns.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Columns a dataset must have for this format (after remapping).
    pub fn required_columns(&self) -> Vec<String> {
        format_columns(&self.format).iter().filter(|(_, required)| *required).map(|(n, _)| self.col(n).to_string()).collect()
    }

    /// Read a row as a record. Problems with the row's content are `Ok(Err(BadRecord))`.
    pub fn read(&self, r: &RowRef) -> Result<std::result::Result<Record, BadRecord>> {
        if let Some(msg) = r.bad_line() {
            return Ok(Err(BadRecord(msg)));
        }
        let bad = BadRecord::from_row_error;
        let need = |c: &str| -> std::result::Result<String, BadRecord> {
            r.string(self.col(c)).map_err(bad)?.ok_or_else(|| BadRecord(format!("{}: `{}` is missing or null", r.at(), self.col(c))))
        };
        Ok(Ok(match self.format.as_str() {
            "tokenized" => {
                let ids = match r.int_list(self.col("input_ids")) {
                    Ok(v) => v,
                    Err(e) => return Ok(Err(bad(e))),
                };
                // A list column of the row, if the dataset has it.
                let list = |name: &str| -> std::result::Result<Option<Vec<i64>>, BadRecord> {
                    if !r.has(self.col(name)) {
                        return Ok(None);
                    }
                    r.int_list(self.col(name)).map(Some).map_err(bad)
                };
                let labels = match list("labels") {
                    Ok(l) => l,
                    Err(b) => return Ok(Err(b)),
                };
                // As TRL, given labels decide even with train_on_prompt (its
                // completion_only_loss = False leaves them alone): said once, not silently.
                if labels.is_some() && self.train_on_prompt && !self.labels_noted.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    crate::note!(
                        "note: data.train_on_prompt = true leaves rows that carry `labels` as they are ({}): their labels say which tokens are trained, as in TRL; \
                         drop the labels column (or set its -100s to the token ids) to train on every token",
                        r.at()
                    );
                }
                // What TRL's SFTTrainer writes when it tokenizes: without `labels`, its
                // `completion_mask` (prompt/completion data) or `assistant_masks`
                // (assistant_only_loss) says which tokens are trained, and `attention_mask`
                // marks padding, which is dropped (an input, not just an untrained label).
                let mut masks = Vec::new();
                for name in ["attention_mask", "completion_mask", "assistant_masks"] {
                    match list(name) {
                        Ok(Some(m)) if m.len() != ids.len() => {
                            return Ok(Err(BadRecord(format!("{}: {name} has {} entries but input_ids has {}", r.at(), m.len(), ids.len()))))
                        }
                        Ok(m) => masks.push(m),
                        Err(b) => return Ok(Err(b)),
                    }
                }
                let [attention, completion, assistant]: [Option<Vec<i64>>; 3] = masks.try_into().unwrap_or_default();
                // Both masks, where both are there, as TRL's collator applies both; neither
                // with train_on_prompt (TRL's completion_only_loss / assistant_only_loss off).
                let trained: Option<Vec<bool>> = match (completion, assistant) {
                    _ if self.train_on_prompt => None,
                    (None, None) => None,
                    (c, a) => Some((0..ids.len()).map(|i| c.as_ref().is_none_or(|c| c[i] != 0) && a.as_ref().is_none_or(|a| a[i] != 0)).collect()),
                };
                let labels = labels.or_else(|| trained.map(|m| ids.iter().zip(&m).map(|(&t, &k)| if k { t } else { IGNORE }).collect()));
                // Padding sits at the ends of a row. A 0 between 1s would splice the tokens
                // on either side together (transformers keeps their positions apart), so such a
                // row is refused rather than trained as a different sequence.
                if let Some(a) = &attention {
                    let (first, last) = (a.iter().position(|&k| k != 0), a.iter().rposition(|&k| k != 0));
                    if let (Some(f), Some(l)) = (first, last) {
                        if let Some(i) = (f..l).find(|&i| a[i] == 0) {
                            return Ok(Err(BadRecord(format!(
                                "{}: attention_mask has a 0 at position {i} between 1s; only padding at the ends of a row is supported (drop those positions from input_ids, or split the row)",
                                r.at()
                            ))));
                        }
                    }
                }
                match attention {
                    // (labels of another length are reported as such by `tokenize`)
                    Some(a) if labels.as_ref().is_none_or(|l| l.len() == ids.len()) => {
                        let unpadded = |v: &[i64]| v.iter().zip(&a).filter(|(_, &k)| k != 0).map(|(&x, _)| x).collect::<Vec<_>>();
                        Record::Tokens(unpadded(&ids), labels.map(|l| unpadded(&l)))
                    }
                    _ => Record::Tokens(ids, labels),
                }
            }
            "text" => match need("text") {
                Ok(t) => Record::Text(t),
                Err(b) => return Ok(Err(b)),
            },
            "alpaca" => {
                let (instruction, output) = match (need("instruction"), need("output")) {
                    (Ok(i), Ok(o)) => (i, o),
                    (Err(b), _) | (_, Err(b)) => return Ok(Err(b)),
                };
                let input = r.string(self.col("input")).map_err(bad).map(|v| v.unwrap_or_default());
                let input = match input {
                    Ok(i) => i,
                    Err(b) => return Ok(Err(b)),
                };
                match self.template {
                    Template::Alpaca => Record::PromptCompletion(alpaca_prompt(&instruction, &input), output),
                    Template::Raw => Record::PromptCompletion(if input.is_empty() { instruction } else { format!("{instruction}\n\n{input}") }, output),
                    Template::Chat(_) => {
                        let user = if input.is_empty() { instruction } else { format!("{instruction}\n\n{input}") };
                        Record::Conversation(vec![Message::new("user", &user), Message::new("assistant", &output)], Default::default(), None)
                    }
                }
            }
            // TRL's conversational prompt/completion: both columns lists of messages.
            "prompt_completion" if matches!(r.json(self.col("prompt")), Ok(Some(serde_json::Value::Array(_)))) => match self.conversational_pair(r) {
                Ok(rec) => rec,
                Err(b) => return Ok(Err(b)),
            },
            "prompt_completion" => {
                let (p, c) = match (need("prompt"), need("completion")) {
                    (Ok(p), Ok(c)) => (p, c),
                    (Err(b), _) | (_, Err(b)) => return Ok(Err(b)),
                };
                match self.template {
                    Template::Alpaca => Record::PromptCompletion(alpaca_prompt(&p, ""), c),
                    Template::Raw => Record::PromptCompletion(p, c),
                    Template::Chat(_) => Record::Conversation(vec![Message::new("user", &p), Message::new("assistant", &c)], Default::default(), None),
                }
            }
            _ => match r.messages(self.col("messages")) {
                Ok(Some(m)) => {
                    if !m.iter().any(|m| m.role == "assistant") {
                        return Ok(Err(BadRecord(format!("{}: no assistant turn in `{}`", r.at(), self.col("messages")))));
                    }
                    match self.template_vars(r) {
                        Ok(vars) => Record::Conversation(m, vars, None),
                        Err(b) => return Ok(Err(b)),
                    }
                }
                Ok(None) => return Ok(Err(BadRecord(format!("{}: `{}` is missing or null", r.at(), self.col("messages"))))),
                Err(e) => return Ok(Err(bad(e))),
            },
        }))
    }

    /// A conversational prompt/completion record (TRL's format: `prompt` and `completion`
    /// lists of messages, the completion opening with the assistant) as one conversation
    /// whose completion is trained.
    fn conversational_pair(&self, r: &crate::data::source::RowRef) -> std::result::Result<Record, BadRecord> {
        let (pc, cc) = (self.col("prompt"), self.col("completion"));
        if !matches!(self.template, Template::Chat(_)) {
            return Err(BadRecord(format!("{}: `{pc}` is a list of messages, which needs a chat template (data.template = \"model\" with a model that has one, or chatml / deepseek / llama3)", r.at())));
        }
        let list = |c: &str| match r.messages(c) {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(BadRecord(format!("{}: `{c}` is missing or null", r.at()))),
            Err(e) => Err(BadRecord::from_row_error(e)),
        };
        let (mut messages, completion) = (list(pc)?, list(cc)?);
        if completion.first().is_none_or(|m| m.role != "assistant") {
            return Err(BadRecord(format!("{}: `{cc}` must open with an assistant turn", r.at())));
        }
        let from = messages.len();
        messages.extend(completion);
        Ok(Record::Conversation(messages, self.template_vars(r)?, Some(from)))
    }

    /// A messages record's template variables, as TRL's SFTTrainer passes them to
    /// `apply_chat_template`: `tools` (a list of tool schemas, or that list as JSON text, as
    /// datasets often store it) and the entries of `chat_template_kwargs` (an object).
    fn template_vars(&self, r: &crate::data::source::RowRef) -> std::result::Result<crate::chat::Vars, BadRecord> {
        let bad = |msg: String| BadRecord(format!("{}: {msg}", r.at()));
        let mut vars = crate::chat::Vars::new();
        let (tools, kwargs) = (self.col("tools"), self.col("chat_template_kwargs"));
        if let Some(v) = r.json(tools).map_err(BadRecord::from_row_error)? {
            let list = match v {
                serde_json::Value::String(s) => serde_json::from_str(&s).ok().filter(serde_json::Value::is_array).ok_or_else(|| bad(format!("`{tools}` is text that is not a JSON list of tool schemas")))?,
                v @ serde_json::Value::Array(_) => v,
                other => return Err(bad(format!("`{tools}` must be a list of tool schemas, got {other}"))),
            };
            vars.insert("tools".into(), list);
        }
        match r.json(kwargs).map_err(BadRecord::from_row_error)? {
            None => {}
            Some(serde_json::Value::Object(o)) => {
                for (k, v) in o {
                    if crate::chat::RESERVED_VARS.contains(&k.as_str()) {
                        return Err(bad(format!("`{kwargs}` sets `{k}`, which the chat template is given by finetune itself")));
                    }
                    vars.insert(k, v);
                }
            }
            Some(other) => return Err(bad(format!("`{kwargs}` must be an object of template variables, got {other}"))),
        }
        Ok(vars)
    }

    fn encode(&self, text: &str, special: bool) -> Result<tokenizers::Encoding> {
        let t = self.tokenizer.as_ref().ok_or_else(|| Error::Tokenizer { path: self.tok_path.clone(), msg: "no tokenizer loaded".into() })?;
        t.encode(text, special).map_err(|e| Error::Tokenizer { path: self.tok_path.clone(), msg: e.to_string() })
    }

    /// Tokens of `text` (ids and byte offsets), or with a token limit of a prefix long enough
    /// for it (see [`Self::set_token_limit`]), and how many bytes of `text` were tokenized.
    fn encode_prefix(&self, text: &str, special: bool) -> Result<(tokenizers::Encoding, usize)> {
        let Some((need, mut bytes)) = self.cut_budget() else { return Ok((self.encode(text, special)?, text.len())) };
        loop {
            if text.len() <= bytes {
                return Ok((self.encode(text, special)?, text.len()));
            }
            let end = char_floor(text, bytes);
            let enc = self.encode(&text[..end], special)?;
            if enc.get_ids().len() >= need {
                return Ok((enc, end));
            }
            bytes = bytes.saturating_mul(2);
        }
    }

    /// Ids of `text` (or of a prefix long enough for the token limit), trained from where
    /// they stop agreeing with the ids of its first `from` bytes (the prompt) tokenized alone
    /// (all with train_on_prompt), then EOS unless the text already ends with it. TRL's
    /// tokenization: the prompt and the completion as one text, so a tokenizer that marks the
    /// start of a text (SentencePiece's "▁") does so once, a token that spans the boundary is
    /// the completion's (TRL's `common_prefix_length`), and an EOS the data already has is not
    /// doubled.
    fn encode_trained_from(&self, text: &str, from: usize) -> Result<Example> {
        let mut ids = self.encode_prefix(text, true)?.0.get_ids().to_vec();
        let mut labels = self.trained_after_prefix(&ids, &self.encode_prefix(&text[..from], true)?.0);
        if let Some(eos) = self.eos.filter(|&e| ids.last() != Some(&e)) {
            ids.push(eos);
            labels.push(eos as i64);
        }
        Ok(Example::new(ids, labels))
    }

    /// Labels of `ids`, trained from where they stop agreeing with `prompt`'s ids (TRL's
    /// `common_prefix_length`), or all of them with train_on_prompt.
    fn trained_after_prefix(&self, ids: &[u32], prompt: &tokenizers::Encoding) -> Vec<i64> {
        let n = if self.train_on_prompt { 0 } else { ids.iter().zip(prompt.get_ids()).take_while(|(a, b)| a == b).count() };
        ids.iter().enumerate().map(|(i, &t)| if i >= n { t as i64 } else { IGNORE }).collect()
    }

    /// Tokenize a record. `index` names the row in messages ("row {index}": its number in
    /// its file, `RowRef::number`).
    pub fn tokenize(&self, rec: Record, index: impl std::fmt::Display) -> Result<std::result::Result<Example, BadRecord>> {
        let ex = match rec {
            Record::Tokens(ids, labels) => {
                let labels = labels.unwrap_or_else(|| ids.clone());
                if labels.len() != ids.len() {
                    return Ok(Err(BadRecord(format!("row {index}: labels has {} entries but input_ids has {}", labels.len(), ids.len()))));
                }
                let mut input_ids = Vec::with_capacity(ids.len());
                for &t in &ids {
                    if t < 0 || t as usize >= self.vocab {
                        return Ok(Err(BadRecord(format!("row {index}: token id {t} outside the vocabulary [0, {})", self.vocab))));
                    }
                    input_ids.push(t as u32);
                }
                if let Some(&l) = labels.iter().find(|&&l| l != IGNORE && (l < 0 || l as usize >= self.vocab)) {
                    return Ok(Err(BadRecord(format!("row {index}: label {l} is neither -100 nor a token id in [0, {})", self.vocab))));
                }
                Example::new(input_ids, labels)
            }
            Record::Text(t) => self.encode_trained_from(&t, 0)?,
            Record::PromptCompletion(p, c) => {
                let from = p.len();
                self.encode_trained_from(&(p + &c), from)?
            }
            Record::Conversation(m, vars, completion_from) => match self.render_conversation_with(&m, &vars, completion_from, &index)? {
                Ok(ex) => ex,
                Err(b) => return Ok(Err(b)),
            },
        };
        if ex.input_ids.is_empty() {
            return Ok(Err(BadRecord(format!("row {index}: no tokens"))));
        }
        // A tokenizer may know more tokens than the model has embeddings for.
        if let Some(&t) = ex.input_ids.iter().find(|&&t| t as usize >= self.vocab) {
            return Ok(Err(BadRecord(format!("row {index}: token id {t} is outside the model's vocabulary [0, {}) (tokenizer and model disagree)", self.vocab))));
        }
        Ok(Ok(ex))
    }

    /// Render the whole conversation with the chat template (the text transformers'
    /// `apply_chat_template` gives, which is what is trained), tokenize it (with a token limit,
    /// a prefix of the rendered text long enough for it) and label the assistant turns found
    /// in it ([`assistant_spans`]). A template error, or an assistant turn that cannot be
    /// found, makes the record bad (reported, or skipped with on_bad_record = "skip").
    pub fn render_conversation(&self, m: &[Message], index: impl std::fmt::Display) -> Result<std::result::Result<Example, BadRecord>> {
        self.render_conversation_with(m, &Default::default(), None, index)
    }

    /// [`Self::render_conversation`] with template variables beside the conversation; with
    /// `completion_from`, a prompt/completion pair: the completion (messages from that index)
    /// is trained from where the conversation's ids stop agreeing with those of the prompt
    /// rendered with its generation prompt, as TRL trains it.
    pub fn render_conversation_with(&self, m: &[Message], vars: &crate::chat::Vars, completion_from: Option<usize>, index: impl std::fmt::Display) -> Result<std::result::Result<Example, BadRecord>> {
        let Template::Chat(t) = &self.template else {
            return Ok(Err(BadRecord(format!("row {index}: the template cannot render conversations"))));
        };
        let text = match t.render_with(m, vars, false) {
            Ok(s) => s,
            Err(e) => return Ok(Err(BadRecord(format!("row {index}: {e}")))),
        };
        let (enc, tokenized) = self.encode_prefix(&text, false)?;
        let ids = enc.get_ids().to_vec();
        // The template's `{% generation %}` blocks, where it has them: what is trained.
        let blocks = match (self.train_on_prompt, t.has_generation_blocks()) {
            (false, true) => match generation_spans(t, m, vars, &text) {
                Ok(s) => Some(s),
                Err(msg) => return Ok(Err(BadRecord(format!("row {index}: {msg}")))),
            },
            _ => None,
        };
        let labels = if let Some(k) = completion_from {
            // TRL's rule: the completion starts where the ids of the prompt rendered with its
            // generation prompt stop agreeing with the whole conversation's.
            let prompt = match t.render_with(&m[..k], vars, true) {
                Ok(s) => s,
                Err(e) => return Ok(Err(BadRecord(format!("row {index}: {e}")))),
            };
            self.trained_after_prefix(&ids, &self.encode_prefix(&prompt, false)?.0)
        } else if blocks.is_some() {
            ids.iter().map(|&id| id as i64).collect()
        } else {
            // Turns that start past the tokens kept need not be looked for (each costs renders).
            let kept = self.token_limit.and_then(|l| enc.get_offsets().get(l.saturating_sub(1)).map(|o| o.1 + 1)).unwrap_or(tokenized);
            let spans = match self.train_on_prompt {
                true => Vec::new(),
                false => match assistant_spans(t, m, vars, &text, kept.min(tokenized), enc.get_offsets()) {
                    Ok(s) => s,
                    Err(msg) => return Ok(Err(BadRecord(format!("row {index}: {msg}")))),
                },
            };
            ids.iter()
                .zip(enc.get_offsets())
                // A token that starts in a span, or straddles its start (a span found by bytes
                // may start inside a token: "<" shared by a generation prompt and a tool call's
                // first special token), is trained.
                .map(|(&id, &(start, end))| {
                    let trained = spans.iter().any(|s| s.contains(&start) || (start < s.start && s.start < end));
                    if self.train_on_prompt || trained { id as i64 } else { IGNORE }
                })
                .collect()
        };
        let Some(blocks) = blocks else { return Ok(Ok(Example::new(ids, labels))) };
        // Only tokens that overlap a block, as transformers' assistant mask marks them (one
        // that straddles an empty block too); a completion's besides, as TRL's
        // `assistant_only_loss` keeps only what both its masks keep.
        let labels: Vec<i64> = labels
            .into_iter()
            .zip(enc.get_offsets())
            .map(|(l, &(start, end))| if blocks.iter().any(|s| start < s.end && end > s.start) { l } else { IGNORE })
            .collect();
        // Nothing kept: say why, unless the text was cut (the loader then names the truncation).
        if labels.iter().all(|&l| l == IGNORE) && tokenized == text.len() {
            let msg = match completion_from {
                Some(_) => "nothing in the completion is inside the chat template's {% generation %} blocks, so nothing would be trained \
                            (TRL's assistant_only_loss trains what both mark; set data.train_on_prompt = true to train on everything)",
                None => "the chat template's {% generation %} blocks mark nothing in this conversation, so nothing would be trained \
                         (the template marks what the assistant says; set data.train_on_prompt = true to train on everything)",
            };
            return Ok(Err(BadRecord(format!("row {index}: {msg}"))));
        }
        Ok(Ok(Example::new(ids, labels)))
    }

    /// The chat template's source where it is not the model's own (a built-in one, or a file
    /// the recipe names): what the run's adapter carries.
    pub fn template_not_the_models(&self) -> Option<&str> {
        match &self.template {
            Template::Chat(t) if !self.models_template => Some(t.source()),
            _ => None,
        }
    }

    /// Decode ids (for `data inspect`).
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(ids, false).unwrap_or_default(),
            None => format!("{ids:?}"),
        }
    }
}

/// The largest char boundary of `s` at or below `n`.
fn char_floor(s: &str, n: usize) -> usize {
    let mut i = n.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Byte spans of `text` (the whole conversation `m` rendered) that the template's
/// `{% generation %}` blocks wrote: where a template marks what the assistant says, that is
/// what is trained, as transformers' `return_assistant_tokens_mask` and so TRL's
/// `assistant_only_loss` train it (a template may mark some turns only, or leave out the
/// end-of-turn marker).
fn generation_spans(t: &ChatTemplate, m: &[Message], vars: &crate::chat::Vars, text: &str) -> std::result::Result<Vec<std::ops::Range<usize>>, String> {
    let (marked, spans) = t.render_generation_spans(m, vars).map_err(|e| e.to_string())?;
    if marked != text {
        return Err("the chat template renders another text when its {% generation %} blocks are marked: a message holds U+FDD0 or U+FDD1 (the marks), \
                    or the template uses a block's text other than by writing it (set data.train_on_prompt = true, or choose data.template)"
            .into());
    }
    Ok(spans)
}

/// Byte spans of `text` (the whole conversation `m` rendered) that hold what the assistant
/// says, for templates without `{% generation %}` blocks: each assistant turn from the end of the prompt before it to the end of the turn,
/// end-of-turn marker included, for the turns that start within the first `limit` bytes.
///
/// Usually a turn starts where the conversation before it, rendered with the generation
/// prompt, ends in `text`, and ends where the conversation through it does. Where a template
/// breaks that (DeepSeek-R1's generation prompt opens `<think>\n`, which the stored turns do
/// not have; Qwen3 drops the reasoning of turns before the last question; Phi-3 ends a
/// conversation with EOS), the turn is found by its content, rendering the whole conversation
/// with the content replaced (what differs is the content); it then starts at its content,
/// or after the generation prompt where all of that is there, and ends with its end-of-turn
/// marker: what the template writes after the content when the turn is the last one, as far
/// as `text` has it.
fn assistant_spans(t: &ChatTemplate, m: &[Message], vars: &crate::chat::Vars, text: &str, limit: usize, tokens: &[(usize, usize)]) -> std::result::Result<Vec<std::ops::Range<usize>>, String> {
    let mut spans = Vec::new();
    for i in (0..m.len()).filter(|&i| m[i].role == "assistant") {
        match turn_span(t, m, vars, i, text, limit, tokens)? {
            Some(s) => spans.push(s),
            None => break,
        }
    }
    Ok(spans)
}

/// The byte span of assistant turn `i` of `m` in `text` (see [`assistant_spans`]); `None`
/// when it starts at or past `limit`.
fn turn_span(t: &ChatTemplate, m: &[Message], vars: &crate::chat::Vars, i: usize, text: &str, limit: usize, tokens: &[(usize, usize)]) -> std::result::Result<Option<std::ops::Range<usize>>, String> {
    let render = |msgs: &[Message], prompt: bool| t.render_with(msgs, vars, prompt).map_err(|e| e.to_string());
    let msg = &m[i];
    // A conversation that opens with the assistant: the turn is located against the empty
    // conversation before it, which templates that read `messages[0]` outside their loop
    // (Llama 3.1, Qwen2.5, Qwen3) cannot render, although they render the whole one.
    let prompt = render(&m[..i], true).map_err(|e| match i {
        0 => format!(
            "the conversation opens with an assistant turn, and the chat template cannot render the empty conversation before it, \
             which is how the loss mask finds where that turn starts ({e}); open it with a system or user message, or set data.train_on_prompt = true"
        ),
        _ => e,
    })?;
    let mut start = common_prefix(text, &prompt);
    // The conversation before the turn, where the generation prompt is not all there (the
    // usual case renders no more than it needs).
    let before = if start < prompt.len() { render(&m[..i], false)? } else { String::new() };
    if start < prompt.len() && prompt.starts_with(&before) {
        // Bytes agree by chance past the role header: "<" opens both R1's "<think>" and
        // its tool calls, which tokenizers without DeepSeek's tool tokens split off as a
        // token of its own. The header ends where a plain turn leaves the generation prompt.
        let mut plain = m[..i].to_vec();
        plain.push(Message::new("assistant", PLACEHOLDER));
        let header = common_prefix(&render(&plain, false)?, &prompt);
        if (before.len()..start).contains(&header) {
            start = header;
        }
    }
    if start >= limit {
        return Ok(None);
    }
    let through = render(&m[..=i], false)?;
    let ends_as_rendered = text.starts_with(&through);
    // As rendered: after the whole generation prompt; or, for a turn with no content (a
    // tool call), which cannot be found by its content below, from where the generation
    // prompt stops agreeing (R1's "<think>\n" is not written before tool calls).
    let no_content = msg.extra.get("content").is_some_and(serde_json::Value::is_null);
    if (start == prompt.len() || no_content) && ends_as_rendered && through.len() > start {
        return Ok(Some(start..through.len()));
    }
    // Found by its content: the whole conversation with this turn's content replaced by a
    // character no template writes around it (an empty content would let the common
    // prefix and suffix run into a content that starts or ends like its surroundings).
    let mut marked = m.to_vec();
    marked[i] = msg.with_content(PLACEHOLDER);
    let marked_text = render(&marked, false)?;
    let (from, to) = differing(text, &marked_text);
    // (An empty content, or one the template renders as nothing, such as R1's reasoning
    // alone, is found where the placeholder goes: from == to.)
    if to < from || marked_text == text {
        return Err(format!("assistant turn {i} cannot be found in the chat template's rendering of the conversation (set data.train_on_prompt = true, or choose data.template)"));
    }
    // Where the generation prompt is not all there (R1's "<think>\n"), the turn starts
    // where the text leaves it, so what the template writes in the turn before its content
    // (R1-Distill's tool calls) is trained, as long as the conversation before the turn
    // renders as it does without it. Where the whole generation prompt stands right before
    // the content, only moved (a template that writes a system prompt with the first turn
    // when the conversation opens with the assistant), the turn starts with its content.
    let generation_prompt = prompt.strip_prefix(before.as_str()).unwrap_or("");
    // The conversation through this turn with its content replaced, as the turn renders when
    // it is the last one: rendered once, where the start or the end needs it.
    let alone_text: std::cell::OnceCell<String> = std::cell::OnceCell::new();
    let alone = || -> std::result::Result<&str, String> {
        if let Some(a) = alone_text.get() {
            return Ok(a.as_str());
        }
        let mut alone = m[..=i].to_vec();
        alone[i] = msg.with_content(PLACEHOLDER);
        let rendered = render(&alone, false)?;
        Ok(alone_text.get_or_init(|| rendered).as_str())
    };
    let start = if start == prompt.len() {
        start.min(from)
    } else if !text[..from].ends_with(generation_prompt) && text.starts_with(&before) && start >= before.len() && start <= from {
        start
    } else {
        from - lead_in(alone()?, generation_prompt, &text[..from])
    };
    let end = if ends_as_rendered && through.len() > to {
        through.len()
    } else {
        // Its end-of-turn marker: what the template writes after the turn's content when
        // the turn is the last one, as far as `text` has it.
        let marker = &through[differing(&through, alone()?).1..];
        let end = to + common_prefix(&text[to..], marker);
        // A marker that agrees only in part may run into the next turn's first token
        // (Phi-3's "<|end|>\n<|endoftext|>" against "<|end|>\n<|user|>" agree on "<|"):
        // it ends where that token starts.
        tokens.iter().find(|&&(s, e)| s >= to && s < end && end < e).map_or(end, |&(s, _)| s)
    };
    Ok(Some(start..end))
}

/// Bytes before an assistant turn's content (which `text_before` ends at) that the template
/// writes after the turn's header when the turn is the last one (Qwen3's empty
/// `<think>\n\n</think>\n\n`), where `text_before` has the header and all of them there; else 0.
/// `alone`: the conversation through the turn, its content replaced by [`PLACEHOLDER`]. They
/// are the turn's: found by content only because an earlier turn renders otherwise in the
/// conversation than at its end (Qwen3 writes a turn's think block only when it is last, so
/// two answers in a row put the conversation before the second out of step).
fn lead_in(alone: &str, generation_prompt: &str, text_before: &str) -> usize {
    if generation_prompt.is_empty() {
        return 0;
    }
    let Some(pre) = alone.find(PLACEHOLDER).map(|p| &alone[..p]) else { return 0 };
    let Some(header) = pre.rfind(generation_prompt) else { return 0 };
    let lead = &pre[header + generation_prompt.len()..];
    let there = text_before.strip_suffix(lead).is_some_and(|t| t.ends_with(generation_prompt));
    if there { lead.len() } else { 0 }
}

/// Content that stands for an assistant turn's while it is looked for (a private-use char).
const PLACEHOLDER: &str = "\u{E000}";

/// The byte range of `a` where `a` and `b` differ: between their common prefix and suffix.
fn differing(a: &str, b: &str) -> (usize, usize) {
    let from = common_prefix(a, b);
    (from, a.len() - common_suffix(&a[from..], &b[from..]))
}

/// Bytes at the start of `a` and `b` that agree, on a char boundary of both.
fn common_prefix(a: &str, b: &str) -> usize {
    let n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    char_floor(a, n)
}

/// Bytes at the end of `a` and `b` that agree, on a char boundary of both.
fn common_suffix(a: &str, b: &str) -> usize {
    let mut n = a.bytes().rev().zip(b.bytes().rev()).take_while(|(x, y)| x == y).count();
    while !a.is_char_boundary(a.len() - n) {
        n -= 1;
    }
    n
}

/// config.json's `eos_token_id` (the first of a list); an id no u32 holds is an error.
fn eos_from_config(model_dir: &Path) -> Result<Option<u32>> {
    let path = model_dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { return Ok(None) };
    let Some(id) = v.get("eos_token_id") else { return Ok(None) };
    let Some(n) = id.as_u64().or_else(|| id.get(0).and_then(|x| x.as_u64())) else { return Ok(None) };
    u32::try_from(n).map(Some).map_err(|_| Error::Tokenizer { path, msg: format!("eos_token_id {n} is not a token id") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_never_splits_a_character() {
        let s = "aé€😀";
        assert_eq!(char_floor(s, 2), 1, "inside é");
        assert_eq!(char_floor(s, 3), 3);
        assert_eq!(char_floor(s, 5), 3, "inside €");
        assert_eq!(char_floor(s, 8), 6, "inside 😀");
        assert_eq!(char_floor(s, 100), s.len());
    }

    #[test]
    fn common_prefix_and_suffix_stop_on_a_char_boundary() {
        assert_eq!(common_prefix("abé", "abè"), 2, "é and è share their first byte");
        assert_eq!(common_suffix("xé!", "yè!"), 1);
        assert_eq!(common_prefix("abc", "abc"), 3);
        assert_eq!(common_suffix("", "abc"), 0);
    }
}
