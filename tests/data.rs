//! The data pipeline: sources, formats, chat templates vs transformers, loss masking,
//! overflow and bad-record policies, token-budget batching, evaluation, inspect.

mod common;
use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field};
use common::*;
use finetune::chat::Message;
use finetune::data::source::Split;
use finetune::data::{BadRecord, Formatter, Loader, LoaderOptions, Record, Role, IGNORE};
use finetune::synth::{write_model, TinyShape};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn opts() -> LoaderOptions {
    LoaderOptions {
        max_seq_len: 4096,
        shuffle: false,
        shuffle_buffer: 8,
        seed: 0,
        packing: false,
        overflow: "truncate".into(),
        on_bad_record: "error".into(),
        eval_fraction: 0.0,
        role: Role::Train,
    }
}

/// A model folder whose tokenizer is SmolLM2's (from the fixture) over a tiny random model.
fn smol_tokenizer_model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    write_model(&m, &TinyShape { vocab: 49152, hidden: 32, heads: 2, kv_heads: 1, inter: 64, layers: 1, ..Default::default() }, 0, 1).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("chat-templates").join(f), m.join(f)).unwrap();
    }
    m
}

fn formatter(model: &Path, format: &str, template: Option<&str>, train_on_prompt: bool) -> Formatter {
    Formatter::new(format, template, &Default::default(), train_on_prompt, model, 49152).unwrap()
}

/// A copy of `model` in `root/<name>` with `chat-templates/<name>.jinja` as its template (as
/// a model folder holds DeepSeek-R1-Distill's or Qwen3's).
fn with_template(root: &Path, model: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    copy_dir(model, &dir);
    std::fs::copy(fixture(&format!("chat-templates/{name}.jinja")), dir.join("chat_template.jinja")).unwrap();
    dir
}

/// `finetune data inspect --recipe <dir>/r.toml <args>`, the recipe's [data] section
/// `data_keys` over `model` (its other sections the least a recipe needs).
fn data_inspect(dir: &Path, model: &str, data_keys: &str, args: &[&str]) -> std::process::Output {
    let r = dir.join("r.toml");
    std::fs::write(&r, format!("[model]\npath = \"{model}\"\n[lora]\nrank = 2\nalpha = 4\n[data]\n{data_keys}[train]\nmax_steps = 1\nlr = 1e-3\n[output]\ndir = \"out\"\n")).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_finetune")).args(["data", "inspect", "--recipe"]).arg(&r).args(args).output().unwrap()
}

#[test]
fn chat_templates_give_the_token_ids_transformers_gives() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("chat-templates/expected.json")).unwrap()).unwrap();
    let (r1, qwen3) = (with_template(d.path(), &m, "r1"), with_template(d.path(), &m, "qwen3"));
    for (i, c) in f["cases"].as_array().unwrap().iter().enumerate() {
        let name = c["template"].as_str().unwrap();
        let fmt = match name {
            "r1" => formatter(&r1, "messages", Some("model"), false),
            "qwen3" => formatter(&qwen3, "messages", Some("model"), false),
            _ => formatter(&m, "messages", Some(name), false),
        };
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        let ex = fmt.render_conversation(&msgs, 0).unwrap().ok().unwrap_or_else(|| panic!("case {i} ({name}) refused"));
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(ex.input_ids, want, "template {name}: {}", c["text"]);
        // What is trained: each answer as the template renders it in the conversation, and its
        // end of turn. R1's generation prompt opens "<think>\n", which its turns do not have
        // (the reasoning is dropped); Qwen3 drops "Blue."'s reasoning once a question follows.
        let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
        let trained = fmt.decode(&trained);
        match (name, i % 2) {
            ("r1", 0) => assert_eq!(trained, "\n\nThe answer is 42.<｜end▁of▁sentence｜>"),
            // (This vocabulary has no DeepSeek special tokens: "><" is one token, which starts
            // in the first turn's end marker, so it is trained with it.)
            ("r1", _) => assert_eq!(trained, "Blue.<｜end▁of▁sentence｜><Green.<｜end▁of▁sentence｜>"),
            ("qwen3", 0) => assert_eq!(trained, "<think>\nsix sevens\n</think>\n\nThe answer is 42.<|im_end|>\n"),
            ("qwen3", _) => assert_eq!(trained, "Blue.<|im_end|>\n<think>\nnot blue again\n</think>\n\nGreen.<|im_end|>\n"),
            _ => assert!(!trained.is_empty()),
        }
    }
}

#[test]
fn template_features_render_as_transformers_renders_them() {
    // tests/fixtures/chat-templates/features.json (features.py): transformers' tojson, loop
    // controls, dict order, tools and extra variables, special tokens, CRLF, rsplit.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("chat-templates/features.json")).unwrap()).unwrap();
    for c in f.as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        std::fs::write(m.join("chat_template.jinja"), c["template"].as_str().unwrap()).unwrap();
        let t = finetune::chat::ChatTemplate::from_model_dir(&m).unwrap().unwrap();
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        let mut vars: finetune::chat::Vars = c["kwargs"].as_object().unwrap().clone();
        if !c["tools"].is_null() {
            vars.insert("tools".into(), c["tools"].clone());
        }
        let got = t.render_with(&msgs, &vars, c["add_generation_prompt"].as_bool().unwrap()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, c["text"].as_str().unwrap(), "{name}");
    }
}

#[test]
fn only_assistant_turns_and_their_end_of_turn_are_trained() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let msgs = vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Name a color."),
        Message::new("assistant", "Blue."),
        Message::new("user", "Another?"),
        Message::new("assistant", "Green."),
    ];
    let fmt = formatter(&m, "messages", Some("model"), false);
    let ex = fmt.render_conversation(&msgs, 0).unwrap().ok().unwrap();
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    let text = fmt.decode(&trained);
    assert_eq!(text, "Blue.<|im_end|>\nGreen.<|im_end|>\n", "trained text");
    let all = formatter(&m, "messages", Some("model"), true).render_conversation(&msgs, 0).unwrap().ok().unwrap();
    assert!(all.labels.iter().all(|&l| l != IGNORE), "train_on_prompt trains everything");
    // DeepSeek style: the answer and EOS.
    let ds = formatter(&m, "messages", Some("deepseek"), false).render_conversation(&msgs, 0).unwrap().ok().unwrap();
    let trained: Vec<u32> = ds.input_ids.iter().zip(&ds.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert_eq!(fmt.decode(&trained), " Blue.<|im_end|> Green.<|im_end|>");
    // A conversation that opens with the assistant: SmolLM2's template writes its default
    // system prompt with the first turn, which is not the assistant's to learn.
    let opens = [Message::new("assistant", "Hi there."), Message::new("user", "Hello.")];
    let ex = fmt.render_conversation(&opens, 0).unwrap().ok().unwrap();
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert!(fmt.decode(&ex.input_ids).contains("You are a helpful AI assistant"));
    assert_eq!(fmt.decode(&trained), "Hi there.<|im_end|>\n");
    // Phi-3's shape: EOS after the last turn only, so a turn's marker as the last one
    // ("<|im_end|>\n<|endoftext|>") agrees with what follows it mid-conversation
    // ("<|im_end|>\n<|im_start|>") on "<|": the next turn's first token is not trained.
    let phi = d.path().join("phi");
    copy_dir(&m, &phi);
    let tmpl = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>{% endif %}";
    std::fs::write(phi.join("chat_template.jinja"), tmpl).unwrap();
    let fmt = formatter(&phi, "messages", Some("model"), false);
    let ex = fmt.render_conversation(&msgs, 0).unwrap().ok().unwrap();
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert_eq!(fmt.decode(&trained), "Blue.<|im_end|>\nGreen.<|im_end|>\n<|endoftext|>");
}

#[test]
fn a_templates_generation_blocks_decide_what_is_trained_as_trls_assistant_only_loss() {
    // tests/fixtures/chat-templates/generation-masks.json (generation_masks.py): transformers'
    // return_assistant_tokens_mask for templates whose {% generation %} blocks mark every
    // answer, the last one only, the content without its end-of-turn, or sit indented with
    // whitespace control, and for TRL's training templates (DeepSeek-V3, R1-Distill, Qwen3,
    // Llama 3, gpt-oss, Nemotron 3 Nano, DiffusionGemma) on random conversations with reasoning
    // and tool calls; and conversational prompt/completion records, as TRL trains them with
    // assistant_only_loss. FINETUNE_GENERATION_MASKS names a wider file (`--sweep`) to check instead.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let path = std::env::var_os("FINETUNE_GENERATION_MASKS").map(PathBuf::from).unwrap_or_else(|| fixture("chat-templates/generation-masks.json"));
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut formatters = BTreeMap::new();
    for (name, source) in f["templates"].as_object().unwrap() {
        let dir = d.path().join(format!("t{}", formatters.len()));
        copy_dir(&m, &dir);
        std::fs::write(dir.join("chat_template.jinja"), source.as_str().unwrap()).unwrap();
        formatters.insert(name.clone(), (formatter(&dir, "messages", None, false), dir));
    }
    for (i, c) in f["cases"].as_array().unwrap().iter().enumerate() {
        let name = c["template"].as_str().unwrap();
        let fmt = &formatters[name].0;
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        let ex = fmt.render_conversation(&msgs, 0).unwrap().unwrap_or_else(|b| panic!("case {i} ({name}): {}", b.0));
        let ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(c["assistant_masks"].clone()).unwrap();
        let labels: Vec<i64> = ids.iter().zip(&mask).map(|(&t, &k)| if k == 1 { t as i64 } else { IGNORE }).collect();
        assert_eq!(ex.input_ids, ids, "case {i} ({name})");
        assert_eq!(ex.labels, labels, "case {i} ({name}): {:?}", fmt.decode(&ex.input_ids));
    }
    // Conversational prompt/completion records: what both TRL's masks keep.
    let pc = f["prompt_completion"].as_array().map(Vec::as_slice).unwrap_or_default();
    for (i, c) in pc.iter().enumerate() {
        let name = c["template"].as_str().unwrap();
        let fmt = formatter(&formatters[name].1, "prompt_completion", None, false);
        let p = d.path().join("pc.jsonl");
        write_jsonl(&p, &[c["record"].to_string()]);
        let mut rows = finetune::data::source::Rows::open(&p).unwrap();
        let (r, _) = rows.next_row().unwrap();
        let rec = fmt.read(&r).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
        let ex = fmt.tokenize(rec, 0).unwrap().unwrap_or_else(|b| panic!("prompt/completion {i} ({name}): {}", b.0));
        let ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(c["mask"].clone()).unwrap();
        let labels: Vec<i64> = ids.iter().zip(&mask).map(|(&t, &k)| if k == 1 { t as i64 } else { IGNORE }).collect();
        assert_eq!((&ex.input_ids, &ex.labels), (&ids, &labels), "prompt/completion {i} ({name})");
    }
    // A conversation the blocks mark nothing in is a bad record saying so, not a record
    // with nothing to learn; and a message holding the marks' characters is caught.
    let Some((fmt, _)) = formatters.get("last") else { return };
    let b = fmt.render_conversation(&[Message::new("assistant", "a"), Message::new("user", "q")], 0).unwrap().unwrap_err();
    assert!(b.0.contains("{% generation %} blocks mark nothing"), "{}", b.0);
    let b = fmt.render_conversation(&[Message::new("user", "q"), Message::new("assistant", "a\u{FDD1}b")], 0).unwrap().unwrap_err();
    assert!(b.0.contains("holds U+FDD0 or U+FDD1"), "{}", b.0);
    // A completion the blocks miss says so; a record cut before its blocks is left to the
    // loader, which names the truncation.
    let pc = formatter(&formatters["last"].1, "prompt_completion", None, false);
    let p = d.path().join("miss.jsonl");
    write_jsonl(&p, &[serde_json::json!({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}).to_string()]);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    let rec = pc.read(&r).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
    let b = pc.tokenize(rec, 0).unwrap().err().unwrap();
    assert!(b.0.contains("nothing in the completion is inside"), "{}", b.0);
    let mut cut = formatter(&formatters["every"].1, "messages", None, false);
    cut.set_token_limit(Some(8));
    let ex = cut.render_conversation(&[Message::new("user", &"long ".repeat(3000)), Message::new("assistant", "a")], 0).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
    assert!(ex.labels.iter().all(|&l| l == IGNORE));
}

/// A template that does not compile stops the run before any record, naming its file, not
/// every record as bad one by one.
#[test]
fn a_chat_template_that_does_not_compile_is_an_error_naming_its_file() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    std::fs::write(m.join("chat_template.jinja"), "{% for m in messages %}{{ m.content }}").unwrap();
    let e = Formatter::new("messages", None, &Default::default(), false, &m, 49152).err().unwrap().to_string();
    assert!(e.contains("chat_template.jinja") && e.contains("chat template:") && e.contains("set data.template"), "{e}");
    let f = d.path().join("t.jinja");
    std::fs::write(&f, "{{ messages[0].content ").unwrap();
    let e = Formatter::new("messages", Some(f.to_str().unwrap()), &Default::default(), false, &m, 49152).err().unwrap().to_string();
    assert!(e.contains("t.jinja") && e.contains("chat template:"), "{e}");
}

/// `data.template` may name a Jinja file (TRL's `chat_template_path`), relative to the
/// recipe: it renders the records, the adapter carries it for generate and export, and a
/// resume refuses it edited.
#[test]
fn a_recipes_template_file_trains_and_travels_with_the_adapter() {
    let d = tempfile::tempdir().unwrap();
    smol_tokenizer_model(d.path());
    let msgs = |q: &str, a: &str| serde_json::json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}).to_string();
    write_jsonl(&d.path().join("chat.jsonl"), &(0..8).map(|i| msgs(&format!("q{i}"), &format!("answer {i}"))).collect::<Vec<_>>());
    std::fs::create_dir(d.path().join("templates")).unwrap();
    let tmpl = "{% for m in messages %}[{{ m.role }}] {% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
    let tmpl_path = d.path().join("templates/train.jinja");
    std::fs::write(&tmpl_path, tmpl).unwrap();
    let recipe = "[model]\npath = \"model\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"chat.jsonl\"\nformat = \"messages\"\ntemplate = \"templates/train.jinja\"\n\
                  max_seq_len = 32\nshuffle = false\n[train]\nmax_steps = 2\nmicro_batch_size = 2\nlr = 1e-2\n[checkpoint]\nevery_steps = 1\n[output]\ndir = \"out\"\n";
    std::fs::write(d.path().join("r.toml"), recipe).unwrap();
    let load = |extra: &[&str]| finetune::recipe::LoadedRecipe::load(&d.path().join("r.toml"), &extra.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    // What is trained: the file's generation blocks (the answer and its <|im_end|>).
    let r = load(&[]).unwrap();
    let md = finetune::weights::ModelDir::of_recipe(&r).unwrap();
    let mut l = finetune::train::open_loader(&r, &md, 49152, Role::Train).unwrap();
    let ex = l.next_example().unwrap();
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &t)| t != IGNORE).map(|(&t, _)| t).collect();
    let text = l.formatter().decode(&ex.input_ids);
    assert!(text.starts_with("[user] q") && text.contains("[assistant] answer "), "{text}");
    // (" answer" is one token, which straddles the block's start: trained, as transformers marks it.)
    assert_eq!(l.formatter().decode(&trained), " answer 0<|im_end|>", "{text}");
    finetune::train::run(&r).unwrap();
    let adapter = d.path().join("out/adapter");
    assert_eq!(std::fs::read_to_string(adapter.join("chat_template.jinja")).unwrap(), tmpl);
    // generate --adapter renders its prompt with the adapter's template, not the model's.
    let g = finetune::generate::Generator::load(&md, Some(&adapter)).unwrap();
    assert_eq!(g.chat_prompt("hi").unwrap(), "[user] hi[assistant] ");
    assert!(g.base_chat_prompt("hi").unwrap().contains("<|im_start|>"), "the base is prompted with its own (eval's base column)");
    assert!(finetune::generate::Generator::load(&md, None).unwrap().chat_prompt("hi").unwrap().contains("<|im_start|>"), "the model's own without the adapter");
    // export: the merged model and the adapter copy carry it (transformers reads it first).
    let peft = finetune::export::PeftAdapter::open(&adapter).unwrap();
    finetune::export::merge(&md, &peft, &d.path().join("merged"), &Default::default()).unwrap();
    assert_eq!(std::fs::read_to_string(d.path().join("merged/chat_template.jinja")).unwrap(), tmpl);
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("merged/tokenizer_config.json")).unwrap()).unwrap();
    assert!(cfg.get("chat_template").is_none(), "the base's template key is dropped, as transformers drops it beside a .jinja");
    assert!(std::fs::read_to_string(md.dir.join("tokenizer_config.json")).unwrap().contains("chat_template"), "the base's own file is untouched");
    // Each checkpoint's adapter carries it too (export --checkpoint, generate --adapter).
    assert_eq!(std::fs::read_to_string(d.path().join("out/checkpoints/step-000001/adapter/chat_template.jinja")).unwrap(), tmpl);
    finetune::export::export_adapter_only(&peft, &md, &d.path().join("copy")).unwrap();
    assert_eq!(std::fs::read_to_string(d.path().join("copy/chat_template.jinja")).unwrap(), tmpl);
    // An edited template is not the run's: resuming from its checkpoint is refused, naming the key.
    std::fs::write(&tmpl_path, tmpl.replace("[assistant]", "[bot]")).unwrap();
    let e = finetune::train::run(&load(&["train.max_steps=3"]).unwrap()).unwrap_err().to_string();
    assert!(e.contains("data.template") && e.contains("chat template's file"), "{e}");
    // A built-in template is carried too (a base without one of its own can then chat); the
    // model's own is not copied.
    finetune::train::run(&load(&["data.template=\"chatml\"", "output.dir=\"out2\""]).unwrap()).unwrap();
    assert!(std::fs::read_to_string(d.path().join("out2/adapter/chat_template.jinja")).unwrap().contains("<|im_start|>"));
    finetune::train::run(&load(&["data.template=\"model\"", "output.dir=\"out3\"", "data.max_seq_len=128"]).unwrap()).unwrap();
    assert!(!d.path().join("out3/adapter/chat_template.jinja").exists());
    // A path that is not a file, and a name that is neither built in nor a .jinja path.
    let e = finetune::train::run(&load(&["data.template=\"templates/missing.jinja\""]).unwrap()).unwrap_err().to_string();
    assert!(e.contains("data.template") && e.contains("missing.jinja is not a file"), "{e}");
    let e = load(&["data.template=\"chatmll\""]).unwrap_err().to_string();
    assert!(e.contains("or a path to a .jinja or .j2 file") && e.contains("chatml"), "{e}");
}

/// A model folder with tests/fixtures/spm-tokenizer's tokenizer (SentencePiece-style: it marks
/// the start of a text with "▁" and adds BOS) over a tiny random model, and the fixture's
/// expected.json.
fn spm_tokenizer_model(dir: &Path) -> (PathBuf, serde_json::Value) {
    let m = dir.join("model");
    write_model(&m, &TinyShape { vocab: 400, hidden: 32, heads: 2, kv_heads: 1, inter: 64, layers: 1, ..Default::default() }, 0, 1).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("spm-tokenizer").join(f), m.join(f)).unwrap();
    }
    let f = serde_json::from_str(&std::fs::read_to_string(fixture("spm-tokenizer/expected.json")).unwrap()).unwrap();
    (m, f)
}

/// Make the model's tokenizer append EOS itself (offsets (0, 0), like its BOS).
fn post_processor_appends_eos(model: &Path) {
    let tj = model.join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tj).unwrap()).unwrap();
    t["post_processor"]["single"].as_array_mut().unwrap().push(serde_json::json!({"SpecialToken": {"id": "</s>", "type_id": 0}}));
    t["post_processor"]["special_tokens"]["</s>"] = serde_json::json!({"id": "</s>", "ids": [2], "tokens": ["</s>"]});
    std::fs::write(&tj, t.to_string()).unwrap();
}

/// A tokenizer_config.json or special_tokens_map.json that is there but does not parse is an
/// error naming it, in every format: read as absent, a stray comma swapped the eos_token it
/// names for config.json's id and trained another end token with exit 0.
#[test]
fn a_corrupt_tokenizer_config_is_an_error_not_another_eos() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let cfg = m.join("tokenizer_config.json");
    let good = std::fs::read_to_string(&cfg).unwrap();
    for name in ["tokenizer_config.json", "special_tokens_map.json"] {
        std::fs::write(&cfg, &good).unwrap();
        std::fs::write(m.join(name), "{\"eos_token\": \"</s>\",}").unwrap();
        for format in ["alpaca", "text", "messages"] {
            let e = Formatter::new(format, None, &Default::default(), false, &m, 49152).err().map(|e| e.to_string());
            let e = e.unwrap_or_else(|| panic!("{name}, {format}: accepted"));
            assert!(e.contains(name) && e.contains("not valid JSON"), "{name}, {format}: {e}");
        }
        let _ = std::fs::remove_file(m.join("special_tokens_map.json"));
    }
}

#[test]
fn prompt_and_completion_are_tokenized_as_one_text_as_trl_does() {
    // tests/fixtures/spm-tokenizer: a SentencePiece-style tokenizer (it marks the start of a
    // text with "▁") and TRL's ids and labels for three records, one ending with EOS already.
    let d = tempfile::tempdir().unwrap();
    let (m, f) = spm_tokenizer_model(d.path());
    let fmt = Formatter::new("prompt_completion", Some("raw"), &Default::default(), false, &m, 400).unwrap();
    for c in f["cases"].as_array().unwrap() {
        let rec = finetune::data::format::Record::PromptCompletion(c["prompt"].as_str().unwrap().into(), c["completion"].as_str().unwrap().into());
        let ex = fmt.tokenize(rec, 0).unwrap().ok().unwrap();
        let (ids, labels): (Vec<u32>, Vec<i64>) = (serde_json::from_value(c["ids"].clone()).unwrap(), serde_json::from_value(c["labels"].clone()).unwrap());
        assert_eq!((&ex.input_ids, &ex.labels), (&ids, &labels), "{c}");
    }
    // A tokenizer whose post-processor appends EOS itself (offsets (0, 0), like BOS): that EOS
    // ends the completion and is trained, once.
    post_processor_appends_eos(&m);
    let fmt = Formatter::new("prompt_completion", Some("raw"), &Default::default(), false, &m, 400).unwrap();
    let c = &f["cases"][0];
    let rec = finetune::data::format::Record::PromptCompletion(c["prompt"].as_str().unwrap().into(), c["completion"].as_str().unwrap().into());
    let ex = fmt.tokenize(rec, 0).unwrap().ok().unwrap();
    let (ids, labels): (Vec<u32>, Vec<i64>) = (serde_json::from_value(c["ids"].clone()).unwrap(), serde_json::from_value(c["labels"].clone()).unwrap());
    assert_eq!((&ex.input_ids, &ex.labels), (&ids, &labels), "the post-processor's EOS");
}

/// Generation stops where transformers' generate stops: generation_config.json's eos ids where
/// the file is there, else config.json's; not the tokenizer's eos_token or end-of-turn names
/// (a union of all of them cut answers short where transformers ran on).
#[test]
fn generate_stops_on_the_eos_ids_transformers_stops_on() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let cfg_path = m.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["eos_token_id"] = serde_json::json!(5);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let _ = std::fs::remove_file(m.join("generation_config.json"));
    assert_eq!(finetune::generate::stop_ids(&m).unwrap(), [5], "config.json's where there is no generation_config.json");
    std::fs::write(m.join("generation_config.json"), r#"{"eos_token_id": [7, 8]}"#).unwrap();
    assert_eq!(finetune::generate::stop_ids(&m).unwrap(), [7, 8], "generation_config.json's, alone");
    std::fs::write(m.join("generation_config.json"), r#"{"do_sample": false}"#).unwrap();
    assert_eq!(finetune::generate::stop_ids(&m).unwrap(), Vec::<u32>::new(), "a generation config without eos stops on none, as transformers");
}

#[test]
fn generate_feeds_a_plain_prompt_with_bos_as_it_was_trained() {
    // A prompt without a chat template is tokenized as training tokenizes text records and as
    // transformers does (BOS first); a template-rendered one gets no added tokens.
    let d = tempfile::tempdir().unwrap();
    let (m, f) = spm_tokenizer_model(d.path());
    let load = || finetune::generate::Generator::load(&finetune::weights::ModelDir::resolve(m.to_str().unwrap(), Path::new(".")).unwrap(), None).unwrap();
    let g = load();
    for c in f["cases"].as_array().unwrap() {
        let want: Vec<u32> = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
        assert_eq!(g.prompt_ids(c["prompt"].as_str().unwrap(), false).unwrap(), want, "{c}");
        assert_eq!(g.encode(c["prompt"].as_str().unwrap()).unwrap(), want[1..], "rendered text: no BOS added");
    }
    // A post-processor that also appends EOS: the prompt is to be continued, so no EOS.
    post_processor_appends_eos(&m);
    let c = &f["cases"][0];
    let want: Vec<u32> = serde_json::from_value(c["prompt_ids"].clone()).unwrap();
    assert_eq!(load().prompt_ids(c["prompt"].as_str().unwrap(), false).unwrap(), want);
    // --chat on a model without a template names the flag, not the tokenizer.
    let e = load().prompt_ids("hi", true).err().unwrap().to_string();
    assert!(e.contains("--chat") && e.contains("no chat template"), "{e}");
}

/// Several --prompt flags: one load, each prompt answered as it would be alone (its own
/// cache), under a header naming it.
#[test]
fn generate_answers_each_of_several_prompts_as_alone() {
    let d = tempfile::tempdir().unwrap();
    let (m, _) = spm_tokenizer_model(d.path());
    let run = |prompts: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"));
        c.args(["generate", "--max-new-tokens", "4", "--model"]).arg(&m);
        for p in prompts {
            c.args(["--prompt", p]);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let (a, b) = (run(&["hello"]), run(&["the cat"]));
    assert_eq!(run(&["hello", "the cat"]), format!("--- prompt 1\n{a}\n--- prompt 2\n{b}"));
}

#[test]
fn generate_chat_template_kwargs_reach_the_template() {
    // DeepSeek-V3.1's shape: the generation prompt opens <think> only with thinking = true.
    let d = tempfile::tempdir().unwrap();
    let (m, _) = spm_tokenizer_model(d.path());
    std::fs::write(m.join("chat_template.jinja"), "{% for m in messages %}U:{{ m.content }}{% endfor %}{% if add_generation_prompt %}A:{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}").unwrap();
    let mut g = finetune::generate::Generator::load(&finetune::weights::ModelDir::resolve(m.to_str().unwrap(), Path::new(".")).unwrap(), None).unwrap();
    assert_eq!(g.chat_prompt("hi").unwrap(), "U:hiA:</think>");
    g.set_chat_template_kwargs(r#"{"thinking": true}"#).unwrap();
    assert_eq!(g.chat_prompt("hi").unwrap(), "U:hiA:<think>");
    for (bad, says) in [("[1]", "expected a JSON object"), ("{thinking}", "not JSON"), (r#"{"add_generation_prompt": false}"#, "set by finetune itself")] {
        let e = g.set_chat_template_kwargs(bad).unwrap_err().to_string();
        assert!(e.contains("--chat-template-kwargs") && e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn pretokenized_rows_take_trls_masks_and_drop_padding() {
    // What SFTTrainer's tokenized datasets hold: no labels, a completion_mask (or
    // assistant_masks), and an attention_mask whose zeros are padding.
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("tok.jsonl");
    let rows = [
        serde_json::json!({"input_ids": [5, 6, 7, 8, 0, 0], "completion_mask": [0, 0, 1, 1, 0, 0], "attention_mask": [1, 1, 1, 1, 0, 0]}),
        serde_json::json!({"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 1]}),
        serde_json::json!({"input_ids": [5, 6, 7], "labels": [5, -100, 7], "completion_mask": [0, 0, 0]}),
        serde_json::json!({"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 0, 1, 1], "assistant_masks": [0, 1, 1, 1, 0]}),
        serde_json::json!({"input_ids": [5, 6, 7], "attention_mask": [1, 1]}),
        serde_json::json!({"input_ids": [0, 0, 5, 6], "attention_mask": [0, 0, 1, 1]}),
        serde_json::json!({"input_ids": [5, 6, 7, 8], "attention_mask": [1, 0, 1, 1]}),
    ];
    write_jsonl(&p, &rows.iter().map(|r| r.to_string()).collect::<Vec<_>>());
    let m = d.path().join("model");
    write_model(&m, &TinyShape::default(), 0, 1).unwrap();
    let fmt = Formatter::new("tokenized", None, &Default::default(), false, &m, 64).unwrap();
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    // (ids, labels) of the next row, or why it is a bad record.
    let mut next = || {
        let (r, _) = rows.next_row().unwrap();
        fmt.read(&r).unwrap().map(|rec| fmt.tokenize(rec, 0).unwrap().ok().map(|e| (e.input_ids, e.labels)).unwrap()).map_err(|b| b.0)
    };
    assert_eq!(next(), Ok((vec![5, 6, 7, 8], vec![-100, -100, 7, 8])), "padding dropped, completion trained");
    assert_eq!(next(), Ok((vec![5, 6, 7], vec![-100, 6, 7])), "assistant_masks");
    assert_eq!(next(), Ok((vec![5, 6, 7], vec![5, -100, 7])), "labels, where given, decide");
    assert_eq!(next(), Ok((vec![5, 6, 7, 8, 9], vec![-100, -100, -100, 8, -100])), "both masks, as TRL's collator applies both");
    let bad = next().unwrap_err();
    assert!(bad.contains("attention_mask has 2 entries"), "{bad}");
    assert_eq!(next(), Ok((vec![5, 6], vec![5, 6])), "left padding dropped");
    // A 0 between 1s would have trained 5 -> 7 -> 8 as one sequence.
    let bad = next().unwrap_err();
    assert!(bad.contains("attention_mask has a 0 at position 1 between 1s"), "{bad}");
    // train_on_prompt: the masks are not applied (TRL's completion_only_loss and
    // assistant_only_loss off); padding is still dropped and given labels still decide.
    let fmt = Formatter::new("tokenized", None, &Default::default(), true, &m, 64).unwrap();
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let mut next = || {
        let (r, _) = rows.next_row().unwrap();
        fmt.tokenize(fmt.read(&r).unwrap().ok().unwrap(), 0).unwrap().ok().map(|e| (e.input_ids, e.labels))
    };
    assert_eq!(next(), Some((vec![5, 6, 7, 8], vec![5, 6, 7, 8])));
    assert_eq!(next(), Some((vec![5, 6, 7], vec![5, 6, 7])));
    assert_eq!(next(), Some((vec![5, 6, 7], vec![5, -100, 7])));
}

fn write_jsonl(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn write_parquet(path: &Path, batch: &RecordBatch, props: Option<parquet::file::properties::WriterProperties>) {
    let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), props).unwrap();
    w.write(batch).unwrap();
    w.close().unwrap();
}

fn loader(specs: &[PathBuf], split: Option<&str>, fmt: Formatter, o: LoaderOptions) -> finetune::Result<Loader> {
    Loader::open(specs, Split::train(split), fmt, o)
}

#[test]
fn jsonl_parquet_arrow_and_dataset_dict_sources_read_the_same_records() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let texts = ["one two", "three", "four five six", "seven"];
    // JSONL
    let jl = d.path().join("a.jsonl");
    write_jsonl(&jl, &texts.iter().map(|t| serde_json::json!({"text": t}).to_string()).collect::<Vec<_>>());
    // Parquet (two row groups)
    let pq = d.path().join("b.parquet");
    let col: ArrayRef = Arc::new(StringArray::from(texts.to_vec()));
    let batch = RecordBatch::try_from_iter(vec![("text", col)]).unwrap();
    let props = parquet::file::properties::WriterProperties::builder().set_max_row_group_size(2).build();
    write_parquet(&pq, &batch, Some(props));
    // DatasetDict with a train split (Arrow stream)
    let dd = d.path().join("dict");
    std::fs::create_dir_all(dd.join("train")).unwrap();
    finetune::synth::write_arrow_stream(&dd.join("train/data-00000-of-00001.arrow"), std::slice::from_ref(&batch)).unwrap();
    std::fs::write(dd.join("train/state.json"), r#"{"_data_files":[{"filename":"data-00000-of-00001.arrow"}]}"#).unwrap();
    std::fs::write(dd.join("dataset_dict.json"), r#"{"splits":["train"]}"#).unwrap();

    let read = |specs: Vec<PathBuf>, split: Option<&str>, n: usize| -> Vec<Vec<u32>> {
        let mut l = loader(&specs, split, formatter(&m, "text", None, false), opts()).unwrap();
        (0..n).map(|_| l.next_example().unwrap().input_ids).collect()
    };
    let a = read(vec![jl.clone()], None, 4);
    assert_eq!(read(vec![pq.clone()], None, 4), a, "parquet");
    assert_eq!(read(vec![PathBuf::from(format!("{}:train", dd.display()))], None, 4), a, "dict:split");
    assert_eq!(read(vec![dd.clone()], Some("train"), 4), a, "data.split");
    let both = read(vec![jl.clone(), pq.clone()], None, 8);
    assert_eq!(&both[..4], &a[..]);
    assert_eq!(&both[4..], &a[..], "a list of sources is read in order");
    assert_eq!(read(vec![dd.clone()], None, 4), a, "a DatasetDict's train split when none is named (TRL's default)");
}

#[test]
fn a_source_with_several_splits_gives_training_train_and_evaluation_test_never_a_mix() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let lines = |split: &str| (0..3).map(|r| serde_json::json!({"text": format!("{split} {r}")}).to_string()).collect::<Vec<_>>();
    let texts = |specs: &[PathBuf], split: Split| -> finetune::Result<Vec<String>> {
        let f = formatter(&m, "text", None, false);
        let mut l = Loader::open(specs, split, f, opts())?;
        let f = formatter(&m, "text", None, false);
        Ok((0..l.total_rows()).map(|_| f.decode(&l.next_example().unwrap().input_ids).split(' ').next().unwrap().to_string()).collect())
    };
    // A plain folder whose file names say their split, as `datasets` reads them.
    let dir = d.path().join("plain");
    std::fs::create_dir_all(&dir).unwrap();
    write_jsonl(&dir.join("train.jsonl"), &lines("train"));
    write_jsonl(&dir.join("test.jsonl"), &lines("test"));
    write_jsonl(&dir.join("my-dev-00000.jsonl"), &lines("dev"));
    let spec = vec![dir.clone()];
    assert_eq!(texts(&spec, Split::train(None)).unwrap(), ["train"; 3]);
    assert_eq!(texts(&spec, Split::eval(None)).unwrap(), ["test"; 3]);
    assert_eq!(texts(&spec, Split::train(Some("validation"))).unwrap(), ["dev"; 3]);
    assert_eq!(texts(&[PathBuf::from(format!("{}:dev", dir.display()))], Split::train(None)).unwrap(), ["dev"; 3]);
    let e = texts(&spec, Split::train(Some("extra"))).err().unwrap().to_string();
    assert!(e.contains("no split `extra`") && e.contains("test, train, validation"), "{e}");
    // Without the default split, several are an error naming them (never all at once).
    std::fs::remove_file(dir.join("test.jsonl")).unwrap();
    let e = texts(&spec, Split::eval(None)).err().unwrap().to_string();
    assert!(e.contains("several splits (train, validation)") && e.contains(":<split>`"), "{e}");
    // Files without split names are one source, read whole; a `:split` on such a source (or a
    // save_to_disk Dataset) names nothing and is an error, not the whole set.
    let flat = d.path().join("flat");
    std::fs::create_dir_all(&flat).unwrap();
    write_jsonl(&flat.join("part-a.jsonl"), &lines("a"));
    write_jsonl(&flat.join("latest.jsonl"), &lines("b"));
    assert_eq!(texts(std::slice::from_ref(&flat), Split::eval(None)).unwrap().len(), 6);
    assert_eq!(texts(std::slice::from_ref(&flat), Split::train(Some("train"))).unwrap().len(), 6, "data.split applies where there are splits");
    let e = texts(&[PathBuf::from(format!("{}:test", flat.display()))], Split::eval(None)).err().unwrap().to_string();
    assert!(e.contains("has no splits") && e.contains("`:test`"), "{e}");
    let e = texts(&[PathBuf::from(format!("{}:train", flat.join("latest.jsonl").display()))], Split::train(None)).err().unwrap().to_string();
    assert!(e.contains("latest.jsonl") && e.contains("has no splits (a single file)") && e.contains("`:train`"), "{e}");
    // A DatasetDict: train for training, test for evaluation.
    let dd = d.path().join("dict");
    for split in ["train", "test"] {
        std::fs::create_dir_all(dd.join(split)).unwrap();
        let col: ArrayRef = Arc::new(StringArray::from((0..3).map(|_| format!("{split} x")).collect::<Vec<_>>()));
        let batch = RecordBatch::try_from_iter(vec![("text", col)]).unwrap();
        finetune::synth::write_arrow_stream(&dd.join(split).join("data-00000-of-00001.arrow"), &[batch]).unwrap();
        std::fs::write(dd.join(split).join("state.json"), r#"{"_data_files":[{"filename":"data-00000-of-00001.arrow"}]}"#).unwrap();
    }
    std::fs::write(dd.join("dataset_dict.json"), r#"{"splits":["train","test"]}"#).unwrap();
    assert_eq!(texts(std::slice::from_ref(&dd), Split::train(None)).unwrap(), ["train"; 3]);
    assert_eq!(texts(std::slice::from_ref(&dd), Split::eval(None)).unwrap(), ["test"; 3]);
    let e = texts(&[PathBuf::from(format!("{}:test", dd.join("train").display()))], Split::eval(None)).err().unwrap().to_string();
    assert!(e.contains("a single `datasets` Dataset"), "{e}");
}

#[test]
fn an_eval_source_that_training_reads_too_is_refused() {
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("model"), &TinyShape::default(), 0, 1).unwrap();
    finetune::synth::write_tokenized_dataset(&d.path().join("data"), &finetune::synth::counting_rows(8, 256, 4, 5, 12)).unwrap();
    let recipe = "[model]\npath = \"model\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"data\"\neval = \"./data/\"\n[train]\nmax_steps = 1\nlr = 1e-2\n[output]\ndir = \"out\"\n";
    std::fs::write(d.path().join("r.toml"), recipe).unwrap();
    let r = finetune::recipe::LoadedRecipe::load(&d.path().join("r.toml"), &[]).unwrap();
    let e = finetune::train::run(&r).expect_err("eval on training rows").to_string();
    assert!(e.contains("`data.eval`") && e.contains("data.train reads too"), "{e}");
    assert!(!d.path().join("out/adapter").exists());
}

/// A bad record is named by its row (and line) in the file the message names: across a list
/// of sources the count ran over all of them (`b.jsonl: row 8` for its row 3). And every
/// file of a list has its columns checked when the loader opens, not only the first.
#[test]
fn bad_records_are_named_by_their_row_in_their_own_file_and_every_files_columns_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let (a, b) = (d.path().join("a.jsonl"), d.path().join("b.jsonl"));
    write_jsonl(&a, &(0..5).map(|i| format!(r#"{{"input_ids": [1, 2, {i}]}}"#)).collect::<Vec<_>>());
    write_jsonl(&b, &[r#"{"input_ids": [1, 2]}"#.to_string(), r#"{"input_ids": [1, 999999]}"#.to_string()]);
    let mut l = loader(&[a.clone(), b], None, formatter(&m, "tokenized", None, false), opts()).unwrap();
    let e = (0..7).find_map(|_| l.next_example().err()).expect("the bad row stops the run").to_string();
    assert!(e.contains("b.jsonl") && e.contains("row 1 (line 2): token id 999999"), "{e}");
    // A Parquet file without the column, second in the list: refused at open, named.
    let pq = d.path().join("c.parquet");
    let col: ArrayRef = Arc::new(StringArray::from(vec!["x"]));
    let batch = RecordBatch::try_from_iter(vec![("other", col)]).unwrap();
    write_parquet(&pq, &batch, None);
    let e = loader(&[a, pq], None, formatter(&m, "tokenized", None, false), opts()).err().expect("opened").to_string();
    assert!(e.contains("c.parquet") && e.contains("no `input_ids` column") && e.contains("other"), "{e}");
}

/// data.split on sources that have no splits names nothing: before, every row was read (a
/// whole file trained on as "validation") with exit 0, where `file:validation` was refused.
#[test]
fn data_split_on_sources_without_splits_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let jl = d.path().join("a.jsonl");
    write_jsonl(&jl, &[r#"{"text": "one two"}"#.to_string()]);
    let plain = d.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    write_jsonl(&plain.join("rows.jsonl"), &[r#"{"text": "three"}"#.to_string()]);
    for specs in [vec![jl.clone()], vec![plain.clone()], vec![jl.clone(), plain.clone()]] {
        let e = loader(&specs, Some("validation"), formatter(&m, "text", None, false), opts()).err().map(|e| e.to_string());
        let e = e.unwrap_or_else(|| panic!("{specs:?}: read with data.split set"));
        assert!(e.contains("data.split") && e.contains("splits"), "{e}");
        loader(&specs, None, formatter(&m, "text", None, false), opts()).unwrap();
    }
    // In a list, data.split applies to the entries that have splits.
    let dict = d.path().join("dict");
    std::fs::create_dir_all(dict.join("validation")).unwrap();
    write_jsonl(&dict.join("validation/rows.jsonl"), &[r#"{"text": "four"}"#.to_string()]);
    std::fs::write(dict.join("dataset_dict.json"), r#"{"splits":["validation"]}"#).unwrap();
    let l = loader(&[jl, dict], Some("validation"), formatter(&m, "text", None, false), opts()).unwrap();
    assert_eq!(l.total_rows(), 2);
}

#[test]
fn data_split_does_not_pick_the_eval_sources_split() {
    // data.split = "train" names data.train's split; data.eval reads its own (here `test`,
    // whose rows lack the column the format needs: the error proves which split was read).
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("model"), &TinyShape::default(), 0, 1).unwrap();
    let rows = finetune::synth::counting_rows(8, 256, 4, 5, 12);
    finetune::synth::write_tokenized_dataset(&d.path().join("dict/train"), &rows).unwrap();
    std::fs::create_dir_all(d.path().join("dict/test")).unwrap();
    write_jsonl(&d.path().join("dict/test/test.jsonl"), &[r#"{"other": [1, 2, 3]}"#.to_string()]);
    std::fs::write(d.path().join("dict/dataset_dict.json"), r#"{"splits":["train","test"]}"#).unwrap();
    let recipe = "[model]\npath = \"model\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"dict\"\nsplit = \"train\"\neval = \"dict\"\n[train]\nmax_steps = 2\nlr = 1e-2\neval_every = 1\n[output]\ndir = \"out\"\n";
    std::fs::write(d.path().join("r.toml"), recipe).unwrap();
    let r = finetune::recipe::LoadedRecipe::load(&d.path().join("r.toml"), &[]).unwrap();
    let e = finetune::train::run(&r).expect_err("eval reads the test split").to_string();
    assert!(e.contains("test.jsonl") && e.contains("input_ids"), "{e}");
}

#[test]
fn messages_stored_as_arrow_structs_are_read() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let fields = vec![Field::new("role", DataType::Utf8, true), Field::new("content", DataType::Utf8, true)];
    let mut lb = ListBuilder::new(StructBuilder::from_fields(fields.clone(), 2));
    for (r, c) in [("user", "Hi"), ("assistant", "Hello!")] {
        let sb = lb.values();
        sb.field_builder::<StringBuilder>(0).unwrap().append_value(r);
        sb.field_builder::<StringBuilder>(1).unwrap().append_value(c);
        sb.append(true);
    }
    lb.append(true);
    let col: ArrayRef = Arc::new(lb.finish());
    let batch = RecordBatch::try_from_iter(vec![("messages", col)]).unwrap();
    let p = d.path().join("chat.arrow");
    finetune::synth::write_arrow_stream(&p, &[batch]).unwrap();
    let fmt = formatter(&m, "messages", None, false);
    let mut l = loader(&[p], None, fmt, opts()).unwrap();
    let ex = l.next_example().unwrap();
    let f2 = formatter(&m, "messages", None, false);
    let want = f2.render_conversation(&[Message::new("user", "Hi"), Message::new("assistant", "Hello!")], 0).unwrap().ok().unwrap();
    assert_eq!(ex, want);
}

/// ShareGPT's `from`/`value` messages are refused with what they are and what to convert them
/// to, from JSON lines and from Arrow structs alike.
#[test]
fn sharegpt_messages_are_named_as_such() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let jl = d.path().join("sg.jsonl");
    write_jsonl(&jl, &[r#"{"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}"#.to_string()]);
    let fields = vec![Field::new("from", DataType::Utf8, true), Field::new("value", DataType::Utf8, true)];
    let mut lb = ListBuilder::new(StructBuilder::from_fields(fields, 2));
    for (r, c) in [("human", "Hi"), ("gpt", "Hello!")] {
        let sb = lb.values();
        sb.field_builder::<StringBuilder>(0).unwrap().append_value(r);
        sb.field_builder::<StringBuilder>(1).unwrap().append_value(c);
        sb.append(true);
    }
    lb.append(true);
    let col: ArrayRef = Arc::new(lb.finish());
    let ar = d.path().join("sg.arrow");
    finetune::synth::write_arrow_stream(&ar, &[RecordBatch::try_from_iter(vec![("messages", col)]).unwrap()]).unwrap();
    for p in [jl, ar] {
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "messages", None, false), opts()).unwrap();
        let e = l.next_example().err().map(|e| e.to_string()).unwrap_or_else(|| "accepted".into());
        assert!(e.contains("ShareGPT") && e.contains("`role` and `content`"), "{}: {e}", p.display());
    }
}

#[test]
fn r1_distill_tool_calls_are_trained_with_their_turn() {
    // llama.cpp's copy of DeepSeek-R1-Distill-Qwen-32B's template (chat-templates/r1-tools.jinja)
    // writes a turn's tool calls before its content, after "<｜Assistant｜>", where the
    // generation prompt has "<｜Assistant｜><think>\n": the calls were left untrained (found by
    // content), the first special token of a null-content turn too (the span began one byte
    // into it), and a turn with empty content was refused. With a tokenizer that has no tool
    // tokens (R1-Distill's own), the "<" opening the calls is a token of its own, which the
    // generation prompt's "<think>" also opens: it was left untrained.
    let specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"];
    for n_special in [specials.len(), 4] {
        let d = tempfile::tempdir().unwrap();
        let m = smol_tokenizer_model(d.path());
        let tj = m.join("tokenizer.json");
        let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&tj).unwrap()).unwrap();
        for (i, s) in specials[..n_special].iter().enumerate() {
            t["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({"id": 49152 + i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
        }
        std::fs::write(&tj, t.to_string()).unwrap();
        std::fs::copy(fixture("chat-templates/r1-tools.jinja"), m.join("chat_template.jinja")).unwrap();
        let f = Formatter::new("messages", None, &Default::default(), false, &m, 49152 + n_special).unwrap();
        let call = serde_json::json!([{"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]);
        let calls = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>";
        let answer = "It is sunny.<｜end▁of▁sentence｜>";
        for (content, own) in [(serde_json::Value::Null, String::new()), ("Let me check.".into(), "<｜Assistant｜>Let me check.<｜end▁of▁sentence｜>".to_string()), ("".into(), "<｜Assistant｜><｜end▁of▁sentence｜>".to_string())] {
            let mut turn = match content.as_str() {
                Some(c) => Message::new("assistant", c),
                None => Message::without_content("assistant"),
            };
            turn.extra.insert("tool_calls".into(), call.clone());
            let msgs = [Message::new("user", "Weather in Paris?"), turn, Message::new("tool", "sunny"), Message::new("assistant", "It is sunny.")];
            let ex = f.render_conversation(&msgs, 0).unwrap().unwrap_or_else(|b| panic!("{content}: {}", b.0));
            let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
            let trained = f.decode(&trained);
            if n_special == specials.len() {
                assert_eq!(trained, format!("{calls}{own}{answer}"), "content {content}");
            } else {
                // (Plain-text tool markers may merge with what follows the turn: only the start
                // is exact here.)
                assert!(trained.starts_with("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"), "content {content}: {trained}");
            }
        }
    }
}

#[test]
fn a_qwen3_tool_call_turn_with_null_content_is_found_and_trained() {
    // Qwen3 writes "<think>\n\n</think>\n\n" into an answer after the last question only when it
    // is the last turn, so a tool-call turn is found by its content; a null content could not
    // be replaced (the placeholder kept the null) and every such record was bad.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    // Qwen3's template as its tokenizer_config.json ships it (with tool calls).
    std::fs::copy(fixture("chat-templates/qwen3-tools.jinja"), m.join("chat_template.jinja")).unwrap();
    let f = formatter(&m, "messages", None, false);
    let mut turn = Message::without_content("assistant");
    turn.extra.insert("tool_calls".into(), serde_json::json!([{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]));
    let msgs = [Message::new("user", "Weather in Paris?"), turn, Message::new("tool", "sunny"), Message::new("assistant", "It is sunny.")];
    let ex = f.render_conversation(&msgs, 0).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    let trained = f.decode(&trained);
    assert!(trained.starts_with("<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"), "{trained}");
    assert!(trained.ends_with("It is sunny.<|im_end|>\n") && !trained.contains("sunny</tool_response>"), "{trained}");
}

#[test]
fn a_tool_call_turn_with_null_content_renders_its_calls() {
    // DeepSeek-R1-Distill's template renders an assistant turn's tool_calls only when its
    // content is None (OpenAI-style `"content": null`).
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let r1 = with_template(d.path(), &m, "r1");
    let p = d.path().join("tools.jsonl");
    let call = serde_json::json!([{"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]);
    let msgs = serde_json::json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": call},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]);
    write_jsonl(&p, &[serde_json::json!({ "messages": msgs }).to_string()]);
    let f = formatter(&r1, "messages", None, false);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    let ex = f.tokenize(f.read(&r).unwrap().ok().unwrap(), 0).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
    let text = f.decode(&ex.input_ids);
    assert!(text.contains("<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Paris\"}"), "{text}");
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert!(f.decode(&trained).contains("weather") && f.decode(&trained).ends_with("It is sunny.<｜end▁of▁sentence｜>"), "{}", f.decode(&trained));
    // A user turn's content may not be null.
    write_jsonl(&p, &[serde_json::json!({"messages": [{"role": "user", "content": null}]}).to_string()]);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    assert!(f.read(&r).unwrap().err().is_some_and(|b| b.0.contains("only an assistant turn's may be null")));
}

#[test]
fn conversational_prompt_completion_trains_the_completion_as_trl_does() {
    // tests/fixtures/chat-templates/prompt-completion.json (prompt_completion.py): TRL's
    // tokenization of `prompt` / `completion` lists of messages: everything after the prompt
    // rendered with its generation prompt is trained, the completion's tool turn included.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("chat-templates/prompt-completion.json")).unwrap()).unwrap();
    let p = d.path().join("pc.jsonl");
    write_jsonl(&p, &f.as_array().unwrap().iter().map(|c| c["record"].to_string()).collect::<Vec<_>>());
    let fmt = formatter(&m, "prompt_completion", None, false);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    for c in f.as_array().unwrap() {
        let (r, _) = rows.next_row().unwrap();
        let ex = fmt.tokenize(fmt.read(&r).unwrap().unwrap_or_else(|b| panic!("{}", b.0)), 0).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
        let ids: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(c["completion_mask"].clone()).unwrap();
        let labels: Vec<i64> = ids.iter().zip(&mask).map(|(&t, &k)| if k == 1 { t as i64 } else { IGNORE }).collect();
        assert_eq!(ex.input_ids, ids, "{}", c["record"]);
        assert_eq!(ex.labels, labels, "{}", c["record"]);
    }
    // A completion that does not open with the assistant, or a prompt list without a chat
    // template, is a bad record naming why.
    write_jsonl(&p, &[serde_json::json!({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "x"}]}).to_string()]);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    assert!(fmt.read(&r).unwrap().err().is_some_and(|b| b.0.contains("must open with an assistant turn")));
    let raw = formatter(&m, "prompt_completion", Some("raw"), false);
    assert!(raw.read(&r).unwrap().err().is_some_and(|b| b.0.contains("needs a chat template")));
    // A cell of the wrong type: the record's message names the row and column, and leaves the
    // file to the error that reports it (it was named twice).
    write_jsonl(&p, &[serde_json::json!({"prompt": "hi", "completion": 5}).to_string()]);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    let b = fmt.read(&r).unwrap().err().unwrap().0;
    assert!(b.starts_with("row 0 (line 1): column `completion`: expected a string"), "{b}");
}

#[test]
fn a_records_tools_and_chat_template_kwargs_reach_the_template() {
    // As TRL's SFTTrainer passes them: apply_chat_template(messages, tools=row["tools"],
    // **row["chat_template_kwargs"]). tools may be JSON text, as datasets often store it.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    std::fs::write(m.join("chat_template.jinja"), "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{% if thinking %}<think>{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}").unwrap();
    let tools = serde_json::json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]);
    let msgs = serde_json::json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]);
    let p = d.path().join("tools.jsonl");
    let rows = [
        serde_json::json!({"messages": msgs, "tools": tools, "chat_template_kwargs": {"thinking": true}}),
        serde_json::json!({"messages": msgs, "tools": tools.to_string()}),
        serde_json::json!({"messages": msgs}),
        serde_json::json!({"messages": msgs, "tools": {"name": "weather"}}),
        serde_json::json!({"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": true}}),
    ];
    write_jsonl(&p, &rows.iter().map(|r| r.to_string()).collect::<Vec<_>>());
    let f = formatter(&m, "messages", None, false);
    let mut it = finetune::data::source::Rows::open(&p).unwrap();
    let mut next = || {
        let (r, _) = it.next_row().unwrap();
        f.read(&r).unwrap().map(|rec| f.decode(&f.tokenize(rec, 0).unwrap().ok().unwrap().input_ids)).map_err(|b| b.0)
    };
    let schema = r#"{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}"#;
    assert_eq!(next().unwrap(), format!("{schema}<think>user: Hi\nassistant: Hello\n"));
    assert_eq!(next().unwrap(), format!("{schema}user: Hi\nassistant: Hello\n"));
    assert_eq!(next().unwrap(), "user: Hi\nassistant: Hello\n");
    assert!(next().unwrap_err().contains("`tools` must be a list of tool schemas"));
    assert!(next().unwrap_err().contains("sets `add_generation_prompt`"));
}

/// Two answers in a row under Qwen3's template: the last one's empty think block, which the
/// template writes only in the last turn, is that turn's (transformers' assistant mask, from
/// the template with `{% generation %}` around each answer, trains it too).
#[test]
fn a_qwen3_answer_after_an_answer_trains_its_think_block() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let q = with_template(d.path(), &m, "qwen3");
    let f = formatter(&q, "messages", None, false);
    let msgs: Vec<Message> = serde_json::from_value(serde_json::json!([
        {"role": "user", "content": "q1"}, {"role": "user", "content": "q1b"},
        {"role": "assistant", "content": "a1"}, {"role": "assistant", "content": "a1b"}
    ]))
    .unwrap();
    let ex = f.render_conversation(&msgs, 0).unwrap().ok().unwrap();
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert_eq!(f.decode(&trained), "a1<|im_end|>\n<think>\n\n</think>\n\na1b<|im_end|>\n");
}

/// Qwen3's template reads `messages[0]` before its loop: the empty conversation before an
/// opening assistant turn, which the loss mask renders to find the turn, is an error there.
/// It names the cause and the way out, not only the template's undefined value.
#[test]
fn a_conversation_opening_with_the_assistant_under_a_template_that_reads_the_first_message_names_the_cause() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let q = with_template(d.path(), &m, "qwen3");
    let msgs: Vec<Message> = serde_json::from_value(serde_json::json!([
        {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    ]))
    .unwrap();
    let Err(e) = formatter(&q, "messages", None, false).render_conversation(&msgs, 0).unwrap() else { panic!("rendered") };
    let e = e.0;
    assert!(e.contains("opens with an assistant turn") && e.contains("data.train_on_prompt = true"), "{e}");
    // As the message says: trained on the prompt too, it renders.
    let ex = formatter(&q, "messages", None, true).render_conversation(&msgs, 0).unwrap().ok().unwrap();
    assert!(ex.labels.iter().all(|&l| l != IGNORE), "{:?}", ex.labels);
}

#[test]
fn a_messages_other_keys_reach_the_template_from_jsonl_and_arrow() {
    // Qwen3's template renders `reasoning_content` inside the last answer; dropping the key
    // would train an empty <think></think> instead.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let q = with_template(d.path(), &m, "qwen3");
    let turns = [("user", "6*7?", None), ("assistant", "42", Some("six sevens"))];
    let fields = vec![Field::new("role", DataType::Utf8, true), Field::new("content", DataType::Utf8, true), Field::new("reasoning_content", DataType::Utf8, true)];
    let mut lb = ListBuilder::new(StructBuilder::from_fields(fields.clone(), 2));
    for (r, c, why) in turns {
        let sb = lb.values();
        sb.field_builder::<StringBuilder>(0).unwrap().append_value(r);
        sb.field_builder::<StringBuilder>(1).unwrap().append_value(c);
        sb.field_builder::<StringBuilder>(2).unwrap().append_option(why);
        sb.append(true);
    }
    lb.append(true);
    let col: ArrayRef = Arc::new(lb.finish());
    let arrow = d.path().join("chat.arrow");
    finetune::synth::write_arrow_stream(&arrow, &[RecordBatch::try_from_iter(vec![("messages", col)]).unwrap()]).unwrap();
    let jsonl = d.path().join("chat.jsonl");
    let msgs: Vec<serde_json::Value> = turns.iter().map(|(r, c, why)| serde_json::json!({"role": r, "content": c, "reasoning_content": why})).collect();
    write_jsonl(&jsonl, &[serde_json::json!({ "messages": msgs }).to_string()]);
    let mut got = Vec::new();
    for p in [arrow, jsonl] {
        let mut l = loader(&[p], None, formatter(&q, "messages", None, false), opts()).unwrap();
        got.push(l.next_example().unwrap());
    }
    assert_eq!(got[0], got[1], "Arrow and JSONL");
    let f = formatter(&q, "messages", None, false);
    let trained: Vec<u32> = got[0].input_ids.iter().zip(&got[0].labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert_eq!(f.decode(&trained), "<think>\nsix sevens\n</think>\n\n42<|im_end|>\n");
}

#[test]
fn bad_records_are_skipped_and_counted_or_stop_the_run_naming_the_row() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("bad.jsonl");
    let good = serde_json::json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).to_string();
    let no_assistant = serde_json::json!({"messages": [{"role": "user", "content": "q"}]}).to_string();
    let wrong_type = serde_json::json!({"messages": "not a list"}).to_string();
    let missing = serde_json::json!({"other": 1}).to_string();
    let mut bytes = [good.clone(), no_assistant, wrong_type, missing, "{not json".to_string()].join("\n").into_bytes();
    bytes.extend(b"\n\xff\xfe\n");
    bytes.extend(good.as_bytes());
    std::fs::write(&p, bytes).unwrap();
    let e = loader(std::slice::from_ref(&p), None, formatter(&m, "messages", None, false), opts()).unwrap();
    let mut e = e;
    e.next_example().unwrap();
    let err = e.next_example().err().unwrap().to_string();
    assert!(err.contains("row 1") && err.contains("no assistant turn") && err.contains("on_bad_record"), "{err}");

    let mut l = loader(&[p], None, formatter(&m, "messages", None, false), LoaderOptions { on_bad_record: "skip".into(), ..opts() }).unwrap();
    let a = l.next_example().unwrap();
    let b = l.next_example().unwrap();
    assert_eq!(a, b, "the two good rows");
    assert_eq!(l.stats.bad, 5);
    let report = l.stats.report(4096).join(" ");
    assert!(report.contains("row 1") && report.contains("row 2") && report.contains("not valid JSON") && report.contains("invalid UTF-8"), "{report}");
}

#[test]
fn a_dataset_with_no_usable_rows_is_an_error_not_a_hang() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("empty.jsonl");
    std::fs::write(&p, "").unwrap();
    let e = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), opts()).err().unwrap().to_string();
    assert!(e.contains("no rows"), "{e}");
    write_jsonl(&p, &[r#"{"text": 5}"#.to_string()]);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { on_bad_record: "skip".into(), ..opts() }).unwrap();
    let e = l.next_example().err().unwrap().to_string();
    assert!(e.contains("no usable records"), "{e}");
}

#[test]
fn overflow_truncates_or_drops_and_counts() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("t.jsonl");
    write_jsonl(&p, &["a b c d e f g h i j k l".to_string(), "x".to_string()].map(|t| serde_json::json!({"text": t}).to_string()));
    let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 4, ..opts() }).unwrap();
    assert_eq!(l.next_example().unwrap().input_ids.len(), 4);
    assert_eq!(l.stats.truncated, 1);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 4, overflow: "drop".into(), ..opts() }).unwrap();
    let ex = l.next_example().unwrap();
    assert!(ex.input_ids.len() <= 4);
    assert_eq!(l.stats.dropped, 1);
}

/// Token batches hold whole records: one longer than the budget is an error naming it, never
/// a micro-batch over the budget; a max_seq_len above the budget is fine while none is.
#[test]
fn a_record_longer_than_the_token_budget_is_an_error_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("t.jsonl");
    let short = serde_json::json!({"text": "a b"}).to_string();
    write_jsonl(&p, &[short.clone(), short.clone(), short]);
    let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 512, ..opts() }).unwrap();
    assert!(l.next_token_batch(16).unwrap().iter().all(|e| e.input_ids.len() <= 16));
    write_jsonl(&p, &[serde_json::json!({"text": "w ".repeat(40)}).to_string()]);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 512, ..opts() }).unwrap();
    let e = l.next_token_batch(16).unwrap_err().to_string();
    assert!(e.contains("t.jsonl") && e.contains("row 0") && e.contains("data.max_tokens = 16"), "{e}");
}

/// The counts are of the dataset's records: later passes read the same ones again.
#[test]
fn records_are_counted_once_however_many_passes_read_them() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("t.jsonl");
    let rows = ["a b c d e f g h i j k l", "x", "m n o p q r s t"].map(|t| serde_json::json!({"text": t}).to_string());
    write_jsonl(&p, &[rows[0].clone(), rows[1].clone(), "{not json".to_string(), rows[2].clone()]);
    for overflow in ["truncate", "drop"] {
        let o = LoaderOptions { max_seq_len: 4, overflow: overflow.into(), on_bad_record: "skip".into(), ..opts() };
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), o).unwrap();
        for _ in 0..10 {
            l.next_example().unwrap(); // 3 or 1 usable rows a pass: several passes
        }
        let long = if overflow == "drop" { l.stats.dropped } else { l.stats.truncated };
        assert_eq!((long, l.stats.bad, l.stats.bad_examples.len()), (2, 1, 1), "{overflow}: {:?}", l.stats);
    }
}

#[test]
fn token_budget_batches_group_similar_lengths_under_the_budget() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("t.jsonl");
    let lines: Vec<String> = (0..40).map(|i| serde_json::json!({"text": "w ".repeat(1 + (i * 7) % 30)}).to_string()).collect();
    write_jsonl(&p, &lines);
    let mk = || loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), LoaderOptions { shuffle_buffer: 40, shuffle: true, seed: 3, ..opts() }).unwrap();
    let (mut a, mut b) = (mk(), mk());
    let mut sizes = Vec::new();
    for _ in 0..6 {
        let x = a.next_token_batch(64).unwrap();
        assert_eq!(x, b.next_token_batch(64).unwrap(), "seeded and deterministic");
        let longest = x.iter().map(|e| e.input_ids.len()).max().unwrap();
        let shortest = x.iter().map(|e| e.input_ids.len()).min().unwrap();
        assert!(x.len() == 1 || longest * x.len() <= 64, "over budget: {} x {longest}", x.len());
        sizes.push((x.len(), shortest, longest));
    }
    assert!(sizes.iter().any(|s| s.0 > 1), "{sizes:?}");
    assert!(sizes.iter().all(|s| s.2 - s.1 <= 8), "lengths within a batch are close: {sizes:?}");
}

#[test]
fn eval_loss_is_logged_and_held_out_rows_are_not_trained_on() {
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("model"), &TinyShape::default(), 0, 1).unwrap();
    let rows = finetune::synth::counting_rows(40, 256, 4, 5, 12);
    finetune::synth::write_tokenized_dataset(&d.path().join("data"), &rows).unwrap();
    std::fs::write(d.path().join("r.toml"), "[model]\npath = \"model\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"data\"\neval_fraction = 0.25\n[train]\nmax_steps = 4\nmicro_batch_size = 2\nlr = 1e-2\neval_every = 2\n[output]\ndir = \"out\"\n").unwrap();
    let r = finetune::recipe::LoadedRecipe::load(&d.path().join("r.toml"), &[]).unwrap();
    let s = finetune::train::run(&r).unwrap();
    let evals: Vec<Option<f64>> = s.steps.iter().map(|m| m.eval_loss).collect();
    assert!(evals[0].is_none() && evals[1].is_some() && evals[2].is_none() && evals[3].is_some(), "{evals:?}");
    assert!(std::fs::read_to_string(d.path().join("out/metrics.jsonl")).unwrap().contains("eval_loss"));
    let held: Vec<u64> = (0..40).filter(|&i| finetune::data::is_held_out(i, 0.25, 0)).collect();
    assert!(!held.is_empty() && held.len() < 20, "{held:?}");
    let fmt = Formatter::new("tokenized", None, &Default::default(), false, &d.path().join("model"), 256).unwrap();
    let mut train = loader(&[d.path().join("data")], None, fmt, LoaderOptions { eval_fraction: 0.25, ..opts() }).unwrap();
    let seen: Vec<Vec<u32>> = (0..(40 - held.len())).map(|_| train.next_example().unwrap().input_ids).collect();
    for i in held {
        let ids: Vec<u32> = rows[i as usize].0.iter().map(|&x| x as u32).collect();
        assert!(!seen.contains(&ids), "held-out row {i} was trained on");
    }
}

#[test]
fn data_inspect_marks_trained_tokens_and_counts_overflow() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("pc.jsonl");
    // The long row is long in its completion: one whose completion lies past max_seq_len has
    // no target tokens, a bad record (see data_inspect_surfaces_records_with_no_target_tokens).
    write_jsonl(&p, &[serde_json::json!({"prompt": "Say hi", "completion": "hi there"}).to_string(), serde_json::json!({"prompt": "y", "completion": "x ".repeat(50)}).to_string()]);
    let out = data_inspect(d.path(), &m.display().to_string(), "train = \"pc.jsonl\"\nformat = \"prompt_completion\"\nmax_seq_len = 64\n", &["--n", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("«hi there<|im_end|>\n»"), "{text}");
    assert!(text.contains("1 of 2 rows are longer than data.max_seq_len = 64"), "{text}");
    assert!(!d.path().join("out").exists(), "inspect writes nothing");
}

/// No position predicts the first token, so inspect never counts or marks it as trained, even
/// where its label is set (a text record through a tokenizer that adds no BOS): it said
/// "6 tokens, 6 trained" where training trains 5.
#[test]
fn data_inspect_never_counts_the_first_token_as_trained() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    write_jsonl(&d.path().join("t.jsonl"), &[serde_json::json!({"text": "one two three"}).to_string()]);
    let out = data_inspect(d.path(), &m.display().to_string(), "train = \"t.jsonl\"\nformat = \"text\"\n", &["--n", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = text.lines().find(|l| l.starts_with("--- example 0: ")).unwrap_or_else(|| panic!("{text}"));
    let nums: Vec<usize> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
    assert_eq!(nums[2], nums[1] - 1, "{line}");
    assert!(text.contains("one«"), "the first token is shown untrained: {text}");
}

/// `datasets` reads .json files in a data folder. Beside other data files finetune does not,
/// and says so; a folder of .json files alone (metadata aside) it reads.
#[test]
fn json_files_beside_other_data_are_named_as_not_read_and_a_folder_of_json_is_read() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let dir = d.path().join("data");
    std::fs::create_dir_all(&dir).unwrap();
    let row = serde_json::json!({"text": "a b c"}).to_string();
    write_jsonl(&dir.join("a.jsonl"), std::slice::from_ref(&row));
    write_jsonl(&dir.join("more.json"), &[row]);
    std::fs::write(dir.join("dataset_info.json"), "{}").unwrap();
    let inspect = || data_inspect(d.path(), &m.display().to_string(), "train = \"data\"\nformat = \"text\"\n", &["--n", "1"]);
    let out = inspect();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("more.json not read") && !err.contains("dataset_info.json"), "{err}");
    std::fs::remove_file(dir.join("a.jsonl")).unwrap();
    std::fs::write(dir.join("array.json"), serde_json::to_string_pretty(&serde_json::json!([{"text": "d e"}, {"text": "f"}])).unwrap()).unwrap();
    let out = inspect();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.starts_with("data: 3 rows"), "array.json's 2 and more.json's 1, not dataset_info.json: {text}");
}

#[test]
fn record_formats_render_as_documented() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    // prompt_completion through the model's chat template: only the completion (and end of turn) trained.
    let f = formatter(&m, "prompt_completion", None, false);
    let ex = f.tokenize(Record::Conversation(vec![Message::new("user", "2+2?"), Message::new("assistant", "4")], Default::default(), None), 0).unwrap().ok().unwrap();
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert_eq!(f.decode(&trained), "4<|im_end|>\n");
    // text: every token trained, EOS appended.
    let t = formatter(&m, "text", None, false).tokenize(Record::Text("hello world".into()), 0).unwrap().ok().unwrap();
    assert!(t.labels.iter().all(|&l| l != IGNORE));
    assert_eq!(f.decode(&t.input_ids), "hello world<|im_end|>");
}

#[test]
fn shuffling_permutes_shards_per_epoch_seeded_and_visits_every_row_once() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let mut specs = Vec::new();
    for f in 0..5 {
        let p = d.path().join(format!("s{f}.jsonl"));
        write_jsonl(&p, &(0..3).map(|r| serde_json::json!({"text": format!("w{f} r{r}")}).to_string()).collect::<Vec<_>>());
        specs.push(p);
    }
    let epoch = |seed: u64| -> Vec<Vec<u32>> {
        let o = LoaderOptions { shuffle: true, shuffle_buffer: 1, seed, ..opts() };
        let mut l = loader(&specs, None, formatter(&m, "text", None, false), o).unwrap();
        (0..15).map(|_| l.next_example().unwrap().input_ids).collect()
    };
    let (a, b, c) = (epoch(1), epoch(1), epoch(2));
    assert_eq!(a, b);
    assert_ne!(a, c);
    let mut sorted = a.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 15, "every row exactly once per epoch");
}

/// Ten one-row-per-line records, each its own token sequence.
fn ten_rows(d: &Path) -> PathBuf {
    let p = d.join("ten.jsonl");
    write_jsonl(&p, &(0..10).map(|r| serde_json::json!({"text": format!("row {r}")}).to_string()).collect::<Vec<_>>());
    p
}

#[test]
fn a_shuffle_buffer_larger_than_the_dataset_still_visits_every_row_once_per_pass() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = ten_rows(d.path());
    for buffer in [3, 10, 10_000] {
        let o = LoaderOptions { shuffle: true, shuffle_buffer: buffer, seed: 5, ..opts() };
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), o).unwrap();
        let passes: Vec<Vec<Vec<u32>>> = (0..3).map(|_| (0..10).map(|_| l.next_example().unwrap().input_ids).collect()).collect();
        for (i, pass) in passes.iter().enumerate() {
            let mut rows = pass.clone();
            rows.sort();
            rows.dedup();
            assert_eq!(rows.len(), 10, "buffer {buffer}, pass {i}: a row served twice, another never");
        }
        assert!(passes[0] != passes[1] || passes[1] != passes[2], "buffer {buffer}: passes are reshuffled");
    }
}

/// A record truncated to max_seq_len holds only max_seq_len tokens while it waits in the shuffle
/// buffer or a token-batch pool (it kept its whole length's allocation: a buffer of 5000-token
/// rows at max_seq_len 256 held 20x what it used), and comes out with its positions and
/// segments whole.
#[test]
fn a_truncated_record_waits_in_the_buffer_at_its_truncated_size() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("long.jsonl");
    write_jsonl(&p, &(0..10).map(|r| serde_json::json!({"text": format!("row {r} ").repeat(200)}).to_string()).collect::<Vec<_>>());
    for pool in [false, true] {
        let o = LoaderOptions { shuffle: true, shuffle_buffer: 4, seed: 5, max_seq_len: 8, ..opts() };
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, true), o).unwrap();
        for _ in 0..12 {
            let examples = if pool { l.next_token_batch(64).unwrap() } else { vec![l.next_example().unwrap()] };
            for ex in examples {
                assert_eq!(ex.input_ids.len(), 8);
                assert!(ex.input_ids.capacity() <= 8 && ex.labels.capacity() <= 8, "pool {pool}: {} and {}", ex.input_ids.capacity(), ex.labels.capacity());
                assert_eq!(ex.positions, (0..8).collect::<Vec<u32>>());
                assert_eq!(ex.segments, vec![0; 8]);
            }
        }
    }
}

#[test]
fn a_token_batch_pool_never_holds_a_row_twice() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = ten_rows(d.path());
    for shuffle in [false, true] {
        let o = LoaderOptions { shuffle, shuffle_buffer: 64, seed: 2, ..opts() };
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), o).unwrap();
        let mut pass: Vec<Vec<u32>> = Vec::new();
        while pass.len() < 30 {
            let batch = l.next_token_batch(1000).unwrap();
            assert!(batch.len() <= 10, "shuffle {shuffle}: a batch of {} from 10 rows", batch.len());
            pass.extend(batch.into_iter().map(|e| e.input_ids));
        }
        for chunk in pass.chunks(10) {
            let mut rows = chunk.to_vec();
            rows.sort();
            rows.dedup();
            assert_eq!(rows.len(), 10, "shuffle {shuffle}: every pass holds each row once");
        }
    }
}

#[test]
fn a_restored_loader_continues_the_stream_across_pass_boundaries() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = ten_rows(d.path());
    let o = LoaderOptions { shuffle: true, shuffle_buffer: 4, seed: 8, ..opts() };
    let mk = || loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), o.clone()).unwrap();
    let mut whole = mk();
    let stream: Vec<Vec<u32>> = (0..40).map(|_| whole.next_example().unwrap().input_ids).collect();
    for k in 0..25 {
        let mut a = mk();
        for _ in 0..k {
            a.next_example().unwrap();
        }
        let mut b = mk();
        b.restore(&a.state()).unwrap();
        let rest: Vec<Vec<u32>> = (k..40).map(|_| b.next_example().unwrap().input_ids).collect();
        assert_eq!(rest, stream[k..], "restored after {k} examples");
    }
}

#[test]
fn a_tokenizer_larger_than_the_model_is_a_bad_record_not_a_crash() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let f = Formatter::new("text", None, &Default::default(), false, &m, 100).unwrap();
    let Err(BadRecord(msg)) = f.tokenize(Record::Text("Hello world".into()), 7).unwrap() else { panic!("must be rejected") };
    assert!(msg.contains("row 7") && msg.contains("outside the model's vocabulary"), "{msg}");
}

// ---------------------------------------------------------------- trust under misuse

/// `n` words of a deterministic pseudo-random text (so BPE merges vary along it).
fn words(n: usize, seed: u64) -> String {
    const W: &[&str] = &["alpha", "beta", "gamma", "delta", "tokens", "cut", "here", "the", "of", "merge", "a", "récit", "naïve", "x", "1234", "—", "\n"];
    let mut s = String::new();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(W[(x % W.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

fn skip() -> LoaderOptions {
    LoaderOptions { on_bad_record: "skip".into(), ..opts() }
}

fn texts_of(l: &mut Loader, n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|_| l.next_example().unwrap().input_ids).collect()
}

#[test]
fn jsonl_with_a_bom_reads_like_without() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let lines = ["one two", "three"].map(|t| serde_json::json!({"text": t}).to_string());
    let plain = d.path().join("plain.jsonl");
    write_jsonl(&plain, &lines);
    let bom = d.path().join("bom.jsonl");
    std::fs::write(&bom, [b"\xEF\xBB\xBF".as_slice(), (lines.join("\n") + "\n").as_bytes()].concat()).unwrap();
    let mut a = loader(&[plain], None, formatter(&m, "text", None, false), opts()).unwrap();
    let mut b = loader(&[bom], None, formatter(&m, "text", None, false), opts()).unwrap();
    assert_eq!(b.total_rows(), 2);
    assert_eq!(texts_of(&mut b, 4), texts_of(&mut a, 4));
    assert_eq!(b.stats.bad, 0);
}

#[test]
fn a_broken_or_non_object_first_jsonl_line_is_one_bad_record_not_the_columns() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let good = serde_json::json!({"text": "hello"}).to_string();
    // A .json file too, though it may hold one array: this one's first line is an array alone.
    for (first, name) in [("{\"text\": \"unterminated", "first.jsonl"), ("[1, 2, 3]", "first.jsonl"), ("[1, 2, 3]", "first.json"), ("[1, 2", "first.json"), ("\"just a string\"", "first.jsonl")] {
        let p = d.path().join(name);
        write_jsonl(&p, &[first.to_string(), good.clone(), good.clone()]);
        // skip: the columns come from the valid records; the first line is counted and reported.
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), skip()).unwrap();
        let ex = l.next_example().unwrap();
        assert_eq!(l.formatter().decode(&ex.input_ids), "hello<|im_end|>");
        assert_eq!(l.stats.bad, 1, "{first}");
        let report = l.stats.report(4096).join(" ");
        assert!(report.contains("line 1"), "{first}: {report}");
        // error: the run stops at that line, naming the file and the line.
        let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), opts()).unwrap();
        let e = l.next_example().err().unwrap().to_string();
        assert!(e.contains(name) && e.contains("line 1") && e.contains("on_bad_record"), "{first}: {e}");
    }
    // Blank lines do not shift the line numbers reported.
    let p = d.path().join("gaps.jsonl");
    write_jsonl(&p, &[good.clone(), String::new(), "  ".into(), "{oops".into()]);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), opts()).unwrap();
    l.next_example().unwrap();
    let e = l.next_example().err().unwrap().to_string();
    assert!(e.contains("row 1") && e.contains("line 4"), "{e}");
}

#[test]
fn a_jsonl_file_with_no_valid_record_is_an_error_naming_a_bad_line() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("all-bad.jsonl");
    write_jsonl(&p, &["{nope".to_string(), "[1]".to_string()]);
    let e = loader(&[p], None, formatter(&m, "text", None, false), skip()).err().unwrap().to_string();
    assert!(e.contains("all-bad.jsonl") && e.contains("line 1") && e.contains("no line"), "{e}");
}

#[test]
fn a_jsonl_key_spelled_like_an_internal_marker_is_just_data() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("k.jsonl");
    write_jsonl(&p, &[serde_json::json!({"text": "hi", "__bad_record__": "not an error"}).to_string()]);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), opts()).unwrap();
    let ex = l.next_example().unwrap();
    assert_eq!(l.formatter().decode(&ex.input_ids), "hi<|im_end|>");
}

#[test]
fn a_utf16_jsonl_file_is_an_error_saying_so() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("u16.jsonl");
    let text: Vec<u8> = "{\"text\": \"hi\"}\n".encode_utf16().flat_map(|u| u.to_le_bytes()).collect();
    std::fs::write(&p, [b"\xFF\xFE".as_slice(), &text].concat()).unwrap();
    let e = loader(&[p], None, formatter(&m, "text", None, false), skip()).err().unwrap().to_string();
    assert!(e.contains("u16.jsonl") && e.contains("UTF-16"), "{e}");
}

/// A prompt_completion dataset: row 0 fine, row 1 a prompt so long that the completion is cut
/// away at max_seq_len = 64, row 2 fine.
fn cut_response_data(dir: &Path) -> PathBuf {
    let p = dir.join("cut.jsonl");
    write_jsonl(
        &p,
        &[
            serde_json::json!({"prompt": "Say hi", "completion": "hi"}).to_string(),
            serde_json::json!({"prompt": "x ".repeat(200), "completion": "the answer"}).to_string(),
            serde_json::json!({"prompt": "Say bye", "completion": "bye"}).to_string(),
        ],
    );
    p
}

#[test]
fn a_record_whose_response_is_cut_away_is_a_bad_record() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = cut_response_data(d.path());
    let o = LoaderOptions { max_seq_len: 64, ..opts() };
    let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "prompt_completion", None, false), o.clone()).unwrap();
    l.next_example().unwrap();
    let e = l.next_example().err().unwrap().to_string();
    assert!(e.contains("cut.jsonl") && e.contains("row 1") && e.contains("no target tokens"), "{e}");

    let mut l = loader(&[p], None, formatter(&m, "prompt_completion", None, false), LoaderOptions { on_bad_record: "skip".into(), ..o }).unwrap();
    for _ in 0..2 {
        let ex = l.next_example().unwrap();
        assert!(ex.labels.iter().skip(1).any(|&t| t != IGNORE));
    }
    assert_eq!(l.stats.bad, 1);
    let report = l.stats.report(64).join(" ");
    assert!(report.contains("row 1") && report.contains("no target tokens"), "{report}");
}

#[test]
fn tokenized_records_with_every_label_ignored_and_empty_texts_are_bad_records() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("tok.jsonl");
    write_jsonl(
        &p,
        &[
            serde_json::json!({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}).to_string(),
            serde_json::json!({"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}).to_string(),
            // Only the first token is labelled, and position 0 predicts nothing of it.
            serde_json::json!({"input_ids": [1, 2], "labels": [1, -100]}).to_string(),
        ],
    );
    let tok = || Formatter::new("tokenized", None, &Default::default(), false, &m, 49152).unwrap();
    let mut l = loader(std::slice::from_ref(&p), None, tok(), skip()).unwrap();
    let a = l.next_example().unwrap();
    assert_eq!(l.next_example().unwrap(), a, "rows 1 and 2 skipped");
    assert_eq!(l.stats.bad, 2);
    let mut l = loader(&[p], None, tok(), opts()).unwrap();
    l.next_example().unwrap();
    let e = l.next_example().err().unwrap().to_string();
    assert!(e.contains("tok.jsonl") && e.contains("row 1") && e.contains("no target tokens"), "{e}");
    // An empty text is only an end-of-text token: nothing to predict it from.
    let t = d.path().join("empty-text.jsonl");
    write_jsonl(&t, &[r#"{"text": ""}"#.to_string(), r#"{"text": "ok"}"#.to_string()]);
    let mut l = loader(&[t], None, formatter(&m, "text", None, false), skip()).unwrap();
    l.next_example().unwrap();
    assert_eq!(l.stats.bad, 1);
}

#[test]
fn scanning_lengths_reports_records_with_no_target_tokens_or_stops_on_them() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = cut_response_data(d.path());
    let o = LoaderOptions { max_seq_len: 64, ..opts() };
    let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "prompt_completion", None, false), LoaderOptions { on_bad_record: "skip".into(), ..o.clone() }).unwrap();
    let (lengths, bad, examples) = l.scan_lengths(u64::MAX).unwrap();
    assert_eq!((lengths.len(), bad), (2, 1));
    assert!(examples[0].contains("row 1") && examples[0].contains("no target tokens"), "{examples:?}");
    let mut l = loader(&[p], None, formatter(&m, "prompt_completion", None, false), o).unwrap();
    let e = l.scan_lengths(u64::MAX).err().unwrap().to_string();
    assert!(e.contains("cut.jsonl") && e.contains("row 1") && e.contains("no target tokens"), "{e}");
}

#[test]
fn data_inspect_surfaces_records_with_no_target_tokens() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    cut_response_data(d.path());
    let recipe = |policy: &str| {
        let keys = format!("train = \"cut.jsonl\"\nformat = \"prompt_completion\"\nmax_seq_len = 64\non_bad_record = \"{policy}\"\n");
        data_inspect(d.path(), &m.display().to_string(), &keys, &["--n", "1"])
    };
    let out = recipe("skip");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("1 bad record") && text.contains("no target tokens"), "{text}");
    let out = recipe("error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(err.contains("cut.jsonl") && err.contains("row 1") && err.contains("no target tokens"), "{err}");
}

/// The loader's first example of `p` beside the unbounded tokenization of the same record
/// truncated to `max`.
fn bounded_and_full(m: &Path, p: &Path, format: &str, template: Option<&str>, max: usize) -> (finetune::data::Example, finetune::data::Example) {
    let mut l = loader(&[p.to_path_buf()], None, formatter(m, format, template, false), LoaderOptions { max_seq_len: max, ..opts() }).unwrap();
    let got = l.next_example().unwrap();
    assert_eq!(l.stats.truncated, 1, "{format}");
    let f = formatter(m, format, template, false);
    let mut rows = finetune::data::source::Rows::open(p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    let mut want = f.tokenize(f.read(&r).unwrap().ok().unwrap(), 0).unwrap().ok().unwrap();
    assert!(want.input_ids.len() > max);
    want.input_ids.truncate(max);
    want.labels.truncate(max);
    want.positions.truncate(max);
    want.segments.truncate(max);
    (got, want)
}

#[test]
fn a_field_cut_before_tokenizing_keeps_the_tokens_the_whole_field_gives() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let big = words(60_000, 1); // ~400 KB: cut at max_seq_len = 300, cheap to tokenize whole
    let cases = [
        ("text", None, serde_json::json!({"text": big})),
        ("prompt_completion", Some("raw"), serde_json::json!({"prompt": "Q: ", "completion": big})),
        ("prompt_completion", None, serde_json::json!({"prompt": words(20, 2), "completion": big})),
        ("alpaca", None, serde_json::json!({"instruction": words(10, 3), "input": "", "output": big})),
        // Tokens of 80 bytes (newline and indentation): the first prefix is too short for the
        // limit and has to grow.
        ("text", None, serde_json::json!({"text": format!("x\n{}", " ".repeat(80)).repeat(5000)})),
    ];
    for (i, (format, template, rec)) in cases.into_iter().enumerate() {
        let p = d.path().join(format!("c{i}.jsonl"));
        write_jsonl(&p, &[rec.to_string()]);
        let (got, want) = bounded_and_full(&m, &p, format, template, 300);
        assert_eq!(got, want, "{format} {template:?}");
    }
    // Many turns: only the ones before the bound are rendered, with the same result.
    let mut msgs = Vec::new();
    for t in 0..400 {
        msgs.push(serde_json::json!({"role": "user", "content": words(30, 10 + t)}));
        msgs.push(serde_json::json!({"role": "assistant", "content": words(40, 1000 + t)}));
    }
    let p = d.path().join("turns.jsonl");
    write_jsonl(&p, &[serde_json::json!({"messages": msgs}).to_string()]);
    let (got, want) = bounded_and_full(&m, &p, "messages", None, 300);
    assert_eq!(got, want, "messages");
    // A cut field means the record is over max_seq_len: overflow = "drop" drops it.
    let p = d.path().join("drop.jsonl");
    write_jsonl(&p, &[serde_json::json!({"text": big}).to_string(), serde_json::json!({"text": "short"}).to_string()]);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 300, overflow: "drop".into(), ..opts() }).unwrap();
    assert!(l.next_example().unwrap().input_ids.len() < 10);
    assert_eq!(l.stats.dropped, 1);
}

#[test]
fn a_20_mb_field_streams_in_bounded_memory_and_keeps_its_first_tokens() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let mut big = String::new();
    let mut seed = 0;
    while big.len() < 20 << 20 {
        big.push_str(&words(10_000, seed));
        seed += 1;
    }
    let short: String = big.chars().take(4000).collect();
    let p = d.path().join("big.jsonl");
    write_jsonl(&p, &[serde_json::json!({"text": big}).to_string(), serde_json::json!({"text": short}).to_string()]);
    drop(big);
    let recipe = d.path().join("r.toml");
    std::fs::write(&recipe, format!("[model]\npath = \"{}\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"big.jsonl\"\nformat = \"text\"\nmax_seq_len = 256\n[train]\nmax_steps = 1\nlr = 1e-3\n[output]\ndir = \"out\"\n", m.display())).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["data", "stream", "--recipe", &recipe.display().to_string(), "--rows", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let peak = report["peak_rss_mb"].as_f64().unwrap();
    // The process starts at ~35 MB and the record itself is 20 MB (held twice or three times
    // while parsed and read); tokenizing the whole field took 2.5 GB.
    assert!(peak < 250.0, "peak {peak} MB");
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 256, ..opts() }).unwrap();
    let (a, b) = (l.next_example().unwrap(), l.next_example().unwrap());
    assert_eq!(a.input_ids.len(), 256);
    assert_eq!(a, b, "the first 256 tokens of the 20 MB record are those of its 4000-char prefix");
    assert_eq!(l.stats.truncated, 2);
}

#[test]
fn rows_require_columns_names_the_missing_ones_and_the_file() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("texts.jsonl");
    write_jsonl(&p, &["{broken".to_string(), serde_json::json!({"text": "a", "instruction": "b"}).to_string()]);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let e = rows.require_columns(&["instruction", "output"]).err().unwrap().to_string();
    assert!(e.contains("texts.jsonl") && e.contains("`output`") && !e.contains("`instruction`,") && e.contains("columns are: text, instruction"), "{e}");
    rows.require_columns(&["text"]).unwrap();
    rows.require_columns(&[]).unwrap();
    // A bad line read as a string is an error naming its line, not an empty cell.
    let (r, _) = rows.next_row().unwrap();
    let e = r.string("instruction").err().unwrap().to_string();
    assert!(e.contains("texts.jsonl") && e.contains("line 1"), "{e}");
    // A cell that must be there, absent in this row.
    let (r, _) = rows.next_row().unwrap();
    assert_eq!(r.required_string("instruction").unwrap(), "b");
    let e = r.required_string("output").err().unwrap().to_string();
    assert!(e.contains("texts.jsonl") && e.contains("row 1 (line 2)") && e.contains("`output`") && e.contains("missing"), "{e}");
}

#[test]
fn a_column_remapped_to_one_the_data_lacks_is_an_error_not_an_empty_field() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("qa.jsonl");
    write_jsonl(&p, &[serde_json::json!({"instruction": "Add", "context": "2 and 3", "output": "5"}).to_string()]);
    let cols = |input: &str| [("input".to_string(), input.to_string())].into_iter().collect();
    let fmt = |input: &str| Formatter::new("alpaca", None, &cols(input), false, &m, 49152).unwrap();
    let e = loader(std::slice::from_ref(&p), None, fmt("contxt"), opts()).err().expect("a remap to nothing").to_string();
    assert!(e.contains("qa.jsonl") && e.contains("`input` to `contxt`") && e.contains("columns are:") && e.contains("context"), "{e}");
    let mut l = loader(&[p], None, fmt("context"), opts()).unwrap();
    let ex = l.next_example().unwrap();
    assert!(fmt("context").decode(&ex.input_ids).contains("2 and 3"));
}

#[test]
fn dictionary_encoded_string_columns_read_as_their_strings() {
    // pandas categoricals, and pyarrow's dictionary-typed columns, come back from Parquet as
    // dictionary arrays.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("cat.parquet");
    let col: ArrayRef = Arc::new(["one two", "three", "one two"].into_iter().collect::<arrow_array::DictionaryArray<arrow_array::types::Int32Type>>());
    let batch = RecordBatch::try_from_iter(vec![("text", col)]).unwrap();
    write_parquet(&p, &batch, None);
    let f = formatter(&m, "text", None, false);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), opts()).unwrap();
    let texts: Vec<String> = (0..3).map(|_| f.decode(&l.next_example().unwrap().input_ids)).collect();
    assert_eq!(texts, ["one two<|im_end|>", "three<|im_end|>", "one two<|im_end|>"]);
}

#[test]
fn a_compressed_or_unknown_data_file_is_an_error_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    for (name, says) in [("train.jsonl.gz", "decompress it first"), ("train.csv", "not a data format this reads")] {
        let p = d.path().join(name);
        std::fs::write(&p, b"\x1f\x8b\x08\x00").unwrap();
        let e = loader(&[p], None, formatter(&m, "text", None, false), opts()).err().unwrap().to_string();
        assert!(e.contains(name) && e.contains(says), "{e}");
    }
}

#[test]
fn null_token_ids_in_an_arrow_list_are_a_bad_record_not_token_zero() {
    use arrow_array::builder::Int32Builder;
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let mut lb = ListBuilder::new(Int32Builder::new());
    lb.values().append_value(5);
    lb.values().append_null();
    lb.values().append_value(7);
    lb.append(true);
    let col: ArrayRef = Arc::new(lb.finish());
    let batch = RecordBatch::try_from_iter(vec![("input_ids", col)]).unwrap();
    let p = d.path().join("nulls.arrow");
    finetune::synth::write_arrow_stream(&p, &[batch]).unwrap();
    let fmt = Formatter::new("tokenized", None, &Default::default(), false, &m, 49152).unwrap();
    let mut l = loader(&[p], None, fmt, opts()).unwrap();
    let e = l.next_example().err().unwrap().to_string();
    assert!(e.contains("nulls.arrow") && e.contains("row 0") && e.contains("null"), "{e}");
}

#[test]
fn evaluation_passes_apply_the_bad_record_policy() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("ev.jsonl");
    write_jsonl(&p, &[r#"{"text": "one"}"#.to_string(), r#"{"text": 5}"#.to_string(), r#"{"text": "two"}"#.to_string()]);
    let o = LoaderOptions { role: Role::Eval, ..opts() };
    let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "text", None, false), o.clone()).unwrap();
    let e = l.one_pass().err().unwrap().to_string();
    assert!(e.contains("ev.jsonl") && e.contains("row 1"), "{e}");
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { on_bad_record: "skip".into(), ..o }).unwrap();
    assert_eq!(l.one_pass().unwrap().len(), 2);
    assert_eq!(l.stats.bad, 1);
}

#[test]
fn truncation_and_padding_saved_in_tokenizer_json_do_not_cut_or_pad_records() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let plain = formatter(&m, "text", None, false).tokenize(Record::Text(words(40, 5)), 0).unwrap().ok().unwrap();
    let mut tj: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(m.join("tokenizer.json")).unwrap()).unwrap();
    tj["truncation"] = serde_json::json!({"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0});
    tj["padding"] = serde_json::json!({"strategy": {"Fixed": 200}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    std::fs::write(m.join("tokenizer.json"), tj.to_string()).unwrap();
    let got = formatter(&m, "text", None, false).tokenize(Record::Text(words(40, 5)), 0).unwrap().ok().unwrap();
    assert_eq!(got, plain);
}

#[test]
fn named_chat_templates_without_a_default_are_an_error_listing_the_names() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(m.join("tokenizer_config.json")).unwrap()).unwrap();
    cfg["chat_template"] = serde_json::json!([{"name": "tool_use", "template": "{{ messages[0]['content'] }}"}, {"name": "rag", "template": "x"}]);
    std::fs::write(m.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let e = Formatter::new("messages", None, &Default::default(), false, &m, 49152).err().unwrap().to_string();
    assert!(e.contains("tokenizer_config.json") && e.contains("tool_use") && e.contains("rag") && e.contains("default"), "{e}");
}

#[test]
fn a_dataset_dict_json_that_is_not_json_is_an_error_saying_so() {
    let d = tempfile::tempdir().unwrap();
    let dd = d.path().join("dict");
    std::fs::create_dir_all(dd.join("train")).unwrap();
    std::fs::write(dd.join("dataset_dict.json"), "{\"splits\": [\"train\"").unwrap();
    let e = finetune::data::source::shard_files(&dd, Split::train(Some("train"))).err().unwrap().to_string();
    assert!(e.contains("dataset_dict.json") && e.contains("not valid JSON"), "{e}");
}

#[test]
fn a_damaged_arrow_batch_is_an_error_naming_the_file_not_a_panic() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let col: ArrayRef = Arc::new(StringArray::from(vec!["one", "two"]));
    let p = d.path().join("damaged.arrow");
    finetune::synth::write_arrow_stream(&p, &[RecordBatch::try_from_iter(vec![("text", col)]).unwrap()]).unwrap();
    // Walk the stream's messages to the record batch and point its last buffer far past the
    // end of the message body.
    let mut bytes = std::fs::read(&p).unwrap();
    let mut pos = 0;
    let patch_at = loop {
        let u32_at = |b: &[u8], i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap()) as usize;
        let (len, header) = if u32_at(&bytes, pos) == 0xFFFF_FFFF { (u32_at(&bytes, pos + 4), 8) } else { (u32_at(&bytes, pos), 4) };
        let meta = &bytes[pos + header..pos + header + len];
        let msg = arrow_ipc::root_as_message(meta).unwrap();
        if let Some(rb) = msg.header_as_record_batch() {
            let bufs = rb.buffers().unwrap();
            let last = bufs.bytes().as_ptr() as usize + (bufs.len() - 1) * 16 - bytes.as_ptr() as usize;
            break last + 8; // the length field of the last {offset, length} pair
        }
        pos += header + len + msg.bodyLength() as usize;
    };
    bytes[patch_at..patch_at + 8].copy_from_slice(&(1i64 << 40).to_le_bytes());
    std::fs::write(&p, bytes).unwrap();
    let e = loader(&[p], None, formatter(&m, "text", None, false), skip()).err().unwrap().to_string();
    assert!(e.contains("damaged.arrow") && e.contains("outside"), "{e}");
}

/// An Arrow IPC file (pyarrow's `ipc.new_file`, Feather v2) ends with a footer and its magic;
/// one cut after a record batch (an interrupted copy) used to read as the batches before the
/// cut, half the rows, with exit 0. pyarrow refuses it too.
#[test]
fn an_arrow_ipc_file_cut_short_is_an_error_not_fewer_rows() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let texts: Vec<String> = (0..12).map(|i| format!("word {i}")).collect();
    let mut w = arrow_ipc::writer::FileWriter::try_new(Vec::new(), &arrow_schema::Schema::new(vec![Field::new("text", DataType::Utf8, false)])).unwrap();
    let mut cuts = Vec::new();
    for part in texts.chunks(3) {
        let col: ArrayRef = Arc::new(StringArray::from(part.to_vec()));
        w.write(&RecordBatch::try_from_iter(vec![("text", col)]).unwrap()).unwrap();
        cuts.push(w.get_ref().len());
    }
    w.finish().unwrap();
    let bytes = w.into_inner().unwrap();
    let (full, cut) = (d.path().join("full.arrow"), d.path().join("cut.arrow"));
    std::fs::write(&full, &bytes).unwrap();
    std::fs::write(&cut, &bytes[..cuts[1]]).unwrap(); // schema + 2 of 4 batches, no footer
    let l = loader(std::slice::from_ref(&full), None, formatter(&m, "text", None, false), opts()).unwrap();
    assert_eq!(l.total_rows(), 12);
    let e = match loader(&[cut], None, formatter(&m, "text", None, false), opts()) {
        Ok(l) => format!("read {} rows", l.total_rows()),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("cut.arrow") && e.contains("cut short"), "{e}");
}

/// A template that renders a turn by what follows it (Qwen3 marks the last assistant turn)
/// must see the same turns whether or not the record is cut: before, cutting dropped the
/// later turns, so the kept assistant turn became the last one and rendered differently,
/// trained with exit 0, while the whole record is refused.
#[test]
fn cutting_a_long_conversation_keeps_the_turns_a_lookahead_template_reads() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let cfg = m.join("tokenizer_config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    c["chat_template"] = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}".into();
    std::fs::write(&cfg, c.to_string()).unwrap();
    let msgs = serde_json::json!([
        {"role": "user", "content": words(10, 1)},
        {"role": "assistant", "content": words(60_000, 2)},
        {"role": "user", "content": words(10, 3)},
        {"role": "assistant", "content": words(10, 4)},
    ]);
    let p = d.path().join("lookahead.jsonl");
    write_jsonl(&p, &[serde_json::json!({"messages": msgs}).to_string()]);
    let f = formatter(&m, "messages", None, false);
    let mut rows = finetune::data::source::Rows::open(&p).unwrap();
    let (r, _) = rows.next_row().unwrap();
    // The first assistant turn renders without <think></think> once a turn follows it, so it
    // is not a prefix of the conversation through it: found by its content instead.
    let whole = f.tokenize(f.read(&r).unwrap().ok().unwrap(), 0).unwrap().ok().expect("a lookahead template's turns are found");
    let trained: Vec<u32> = whole.input_ids.iter().zip(&whole.labels).filter(|(_, &l)| l != -100).map(|(&t, _)| t).collect();
    let tok = tokenizers::Tokenizer::from_file(m.join("tokenizer.json")).unwrap();
    // (This template has no generation prompt, so a turn's header counts as its own.)
    let want = format!("<|im_start|>assistant\n{}<|im_end|>\n<|im_start|>assistant\n<think></think>{}<|im_end|>\n", words(60_000, 2), words(10, 4));
    assert_eq!(tok.decode(&trained, false).unwrap(), want, "both answers and their end-of-turn markers, nothing else");
    // Cut to 300 tokens, the record is the whole one's first 300 tokens and labels: the whole
    // conversation is rendered (what the template does with later turns stays), then cut.
    let mut l = loader(std::slice::from_ref(&p), None, formatter(&m, "messages", None, false), LoaderOptions { max_seq_len: 300, ..opts() }).unwrap();
    let cut = l.next_example().unwrap();
    assert_eq!((&cut.input_ids[..], &cut.labels[..]), (&whole.input_ids[..300], &whole.labels[..300]));
}

#[test]
fn bos_and_eos_named_only_in_special_tokens_map_json_are_the_tokenizers() {
    // transformers takes the special tokens tokenizer_config.json does not set from
    // special_tokens_map.json (older and minimal repos name BOS and EOS only there). Read from
    // tokenizer_config.json alone, a template's {{ bos_token }} / {{ eos_token }} rendered
    // empty (every assistant turn lost its end), and without config.json's eos_token_id an
    // alpaca answer got no EOS.
    let d = tempfile::tempdir().unwrap();
    let both = smol_tokenizer_model(d.path());
    let map_only = d.path().join("map-only");
    copy_dir(&both, &map_only);
    let map = std::cell::RefCell::new(serde_json::Map::new());
    edit_json(&map_only.join("tokenizer_config.json"), |cfg| {
        for k in ["bos_token", "eos_token"] {
            map.borrow_mut().insert(k.into(), serde_json::json!({"content": cfg[k].clone(), "lstrip": false}));
            cfg.as_object_mut().unwrap().remove(k);
        }
    });
    std::fs::write(map_only.join("special_tokens_map.json"), serde_json::Value::Object(map.into_inner()).to_string()).unwrap();
    for dir in [&both, &map_only] {
        edit_json(&dir.join("config.json"), |c| {
            c.as_object_mut().unwrap().remove("eos_token_id");
        });
    }
    let msgs = [Message::new("user", "hi"), Message::new("assistant", "yo")];
    let rendered = |m: &Path| {
        let ex = formatter(m, "messages", Some("deepseek"), false).render_conversation(&msgs, 0).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
        (ex.input_ids, ex.labels)
    };
    let want = rendered(&both);
    let f = formatter(&both, "messages", Some("deepseek"), false);
    assert!(f.decode(&want.0).starts_with("<|im_start|>User: hi") && f.decode(&want.0).ends_with("Assistant: yo<|im_end|>"), "{}", f.decode(&want.0));
    assert_eq!(rendered(&map_only), want);
    let p = d.path().join("a.jsonl");
    write_jsonl(&p, &[serde_json::json!({"instruction": "Say yo", "input": "", "output": "yo"}).to_string()]);
    let alpaca = |m: &Path| {
        let f = formatter(m, "alpaca", Some("raw"), false);
        let mut rows = finetune::data::source::Rows::open(&p).unwrap();
        let (r, _) = rows.next_row().unwrap();
        let ex = f.tokenize(f.read(&r).unwrap().ok().unwrap(), 0).unwrap().unwrap_or_else(|b| panic!("{}", b.0));
        f.decode(&ex.input_ids)
    };
    assert!(alpaca(&both).ends_with("yo<|im_end|>"), "{}", alpaca(&both));
    assert_eq!(alpaca(&map_only), alpaca(&both));
}

#[test]
fn an_eos_token_the_vocabulary_lacks_or_an_eos_id_past_it_is_an_error_naming_where_it_came_from() {
    // A tokenizer_config.json eos_token not in the vocabulary silently fell back to
    // config.json's id (another token trained as EOS); an id past u32 wrapped; an id past the
    // vocabulary was blamed on the first data row.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let edit = |file: &str, f: &dyn Fn(&mut serde_json::Value)| edit_json(&m.join(file), f);
    let err = || Formatter::new("alpaca", None, &Default::default(), false, &m, 49152).err().expect("accepted").to_string();
    edit("tokenizer_config.json", &|v| v["eos_token"] = "<|nonexistent|>".into());
    let e = err();
    assert!(e.contains("tokenizer_config.json") && e.contains("eos_token `<|nonexistent|>`") && e.contains("not a token"), "{e}");
    edit("tokenizer_config.json", &|v| {
        v.as_object_mut().unwrap().remove("eos_token");
    });
    edit("config.json", &|v| v["eos_token_id"] = 4294967301u64.into());
    let e = err();
    assert!(e.contains("config.json") && e.contains("eos_token_id 4294967301"), "{e}");
    edit("config.json", &|v| v["eos_token_id"] = 99999.into());
    let e = err();
    assert!(e.contains("config.json") && e.contains("id 99999, past the model's vocabulary of 49152"), "{e}");
}

/// The first two examples a loader gives for `src` (the datasets-json files hold two records).
fn two_examples(src: &Path, f: Formatter) -> Vec<finetune::data::Example> {
    let mut l = loader(&[src.to_path_buf()], None, f, opts()).unwrap();
    (0..2).map(|_| l.next_example().unwrap()).collect()
}

#[test]
fn datasets_json_fields_in_parquet_and_arrow_train_the_tokens_their_jsonl_trains() {
    // `datasets` 5 stores a field whose shape differs between records (tool-call arguments,
    // tool schemas, messages with different keys) as JSON text; read as a string, the
    // arguments rendered as a quoted string and the schemas as escaped JSON, with exit 0.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let q = with_template(d.path(), &m, "qwen3-tools");
    let dir = fixture("datasets-json");
    for name in ["nested", "whole"] {
        let want = two_examples(&dir.join(format!("{name}.jsonl")), formatter(&q, "messages", None, false));
        assert_ne!(want[0], want[1]);
        let mut stored = vec![format!("{name}.parquet"), format!("{name}_arrow")];
        if name == "nested" {
            stored.extend(["nested.noschema.parquet", "nested.gzip.parquet", "nested.brotli.parquet", "nested.lz4.parquet"].map(String::from));
        }
        for s in stored {
            assert_eq!(two_examples(&dir.join(&s), formatter(&q, "messages", None, false)), want, "{s}");
        }
    }
    let text = formatter(&q, "messages", None, false).decode(&two_examples(&dir.join("nested.parquet"), formatter(&q, "messages", None, false))[1].input_ids);
    assert!(text.contains(r#""arguments": {"n": 3, "sides": [6, 6, 6]}"#), "{text}");
}

#[test]
fn a_column_datasets_types_null_reads_as_missing_as_jsonl_nulls_do() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let dir = fixture("datasets-json");
    let want = two_examples(&dir.join("alpaca_null_input.jsonl"), formatter(&m, "alpaca", None, false));
    for s in ["alpaca_null_input.parquet", "alpaca_null_input_arrow"] {
        assert_eq!(two_examples(&dir.join(s), formatter(&m, "alpaca", None, false)), want, "{s}");
    }
}

#[test]
fn a_json_file_holding_one_array_of_records_reads_as_its_lines_would() {
    // Stanford's alpaca_data.json layout (`json.dump(records, f, indent=4)`), which
    // `datasets`' json loader reads; it was "no line is a JSON object".
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let recs = [
        serde_json::json!({"instruction": "Give a color.", "input": "", "output": "Blue, with a \"quote\", a ] and a , inside."}),
        serde_json::json!({"instruction": "Count\n to 3.", "input": "x", "output": "1, 2, 3 \\ {"}),
    ];
    let jsonl = d.path().join("a.jsonl");
    write_jsonl(&jsonl, &recs.iter().map(|r| r.to_string()).collect::<Vec<_>>());
    let want = two_examples(&jsonl, formatter(&m, "alpaca", None, false));
    let pretty = d.path().join("pretty.json");
    std::fs::write(&pretty, format!("\u{feff}\n{}\n", serde_json::to_string_pretty(&recs).unwrap())).unwrap();
    let compact = d.path().join("compact.json");
    std::fs::write(&compact, serde_json::to_string(&recs).unwrap()).unwrap();
    for p in [&pretty, &compact] {
        assert_eq!(two_examples(p, formatter(&m, "alpaca", None, false)), want, "{}", p.display());
    }
    // Cut short: an error naming the file, not fewer rows.
    let cut = d.path().join("cut.json");
    let text = serde_json::to_string_pretty(&recs).unwrap();
    std::fs::write(&cut, &text[..text.len() - 30]).unwrap();
    let e = loader(&[cut], None, formatter(&m, "alpaca", None, false), opts()).err().unwrap().to_string();
    assert!(e.contains("cut.json") && e.contains("JSON array") && e.contains("cut short"), "{e}");
    // A bad element is named by its row and the line it starts on.
    let bad = d.path().join("bad.json");
    std::fs::write(&bad, "[\n  {\"instruction\": \"a\", \"output\": \"b\"},\n  3\n]\n").unwrap();
    let mut l = loader(&[bad], None, formatter(&m, "alpaca", None, false), opts()).unwrap();
    l.next_example().unwrap();
    let e = l.next_example().err().unwrap().to_string();
    assert!(e.contains("row 1 (line 3)") && e.contains("got a number"), "{e}");
}

#[test]
fn pythons_nan_and_infinity_in_a_json_line_read_as_null() {
    // json.dumps writes them for float fields; `datasets` reads such a file.
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("nan.jsonl");
    write_jsonl(&p, &[
        r#"{"instruction": "NaN", "input": "-Infinity \" NaN", "output": "o", "score": NaN, "w": [Infinity, -Infinity]}"#.to_string(),
        r#"{"instruction": "NaN", "input": "-Infinity \" NaN", "output": "o", "score": null, "w": [null, null]}"#.to_string(),
    ]);
    let ex = two_examples(&p, formatter(&m, "alpaca", None, false));
    assert_eq!(ex[0], ex[1]);
    let text = formatter(&m, "alpaca", None, false).decode(&ex[0].input_ids);
    assert!(text.contains("NaN") && text.contains("-Infinity \" NaN"), "strings untouched: {text}");
}

#[test]
fn a_built_in_templates_markers_the_vocabulary_lacks_are_named_once() {
    // Llama 3's markers on SmolLM2's vocabulary: written as plain text, several tokens each.
    let d = tempfile::tempdir().unwrap();
    smol_tokenizer_model(d.path());
    let chat = serde_json::json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).to_string();
    write_jsonl(&d.path().join("chat.jsonl"), &[chat.clone(), chat]);
    let inspect = |template: &str| {
        let o = data_inspect(d.path(), "model", "train = \"chat.jsonl\"\nformat = \"messages\"\n", &["--n", "2", "--set", &format!("data.template={template}")]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let err = inspect("llama3");
    assert_eq!(err.matches("<|start_header_id|>, <|end_header_id|>, <|eot_id|> are not tokens of").count(), 1, "{err}");
    assert!(!inspect("chatml").contains("are not tokens"), "SmolLM2 has ChatML's tokens");
}

#[test]
fn data_inspect_stops_at_the_last_usable_record_instead_of_repeating_rows() {
    let d = tempfile::tempdir().unwrap();
    smol_tokenizer_model(d.path());
    let chat = serde_json::json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).to_string();
    write_jsonl(&d.path().join("chat.jsonl"), &[chat, "{broken".into()]);
    let o = data_inspect(d.path(), "model", "train = \"chat.jsonl\"\nformat = \"messages\"\non_bad_record = \"skip\"\n", &["--n", "3"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("--- example 0") && !out.contains("--- example 1") && out.contains("every usable record: the data has 1"), "{out}");
}
