//! The data pipeline: sources, formats, chat templates vs transformers, loss masking,
//! overflow and bad-record policies, token-budget batching, evaluation, inspect.

mod common;
use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field};
use common::*;
use finetune::chat::Message;
use finetune::data::{BadRecord, Formatter, Loader, LoaderOptions, Record, Role, IGNORE};
use finetune::synth::{write_model, TinyShape};
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

#[test]
fn chat_templates_give_the_token_ids_transformers_gives() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("chat-templates/expected.json")).unwrap()).unwrap();
    for c in f["cases"].as_array().unwrap() {
        let name = c["template"].as_str().unwrap();
        let fmt = formatter(&m, "messages", Some(name), false);
        let msgs: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
        let ex = fmt.render_conversation(&msgs, 0).unwrap().ok().unwrap();
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        assert_eq!(ex.input_ids, want, "template {name}: {}", c["text"]);
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
}

fn write_jsonl(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn loader(specs: &[PathBuf], split: Option<&str>, fmt: Formatter, o: LoaderOptions) -> finetune::Result<Loader> {
    Loader::open(specs, split, fmt, o)
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
    let mut w = parquet::arrow::ArrowWriter::try_new(std::fs::File::create(&pq).unwrap(), batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    // DatasetDict with a train split (Arrow stream)
    let dd = d.path().join("dict");
    std::fs::create_dir_all(dd.join("train")).unwrap();
    finetune::synth::write_arrow_stream(&dd.join("train/data-00000-of-00001.arrow"), &[batch.clone()]).unwrap();
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
    let e = loader(&[dd.clone()], None, formatter(&m, "text", None, false), opts()).err().unwrap().to_string();
    assert!(e.contains("DatasetDict") && e.contains("train"), "{e}");
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
    let e = loader(&[p.clone()], None, formatter(&m, "messages", None, false), opts()).unwrap();
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
    let e = loader(&[p.clone()], None, formatter(&m, "text", None, false), opts()).err().unwrap().to_string();
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
    let mut l = loader(&[p.clone()], None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 4, ..opts() }).unwrap();
    assert_eq!(l.next_example().unwrap().input_ids.len(), 4);
    assert_eq!(l.stats.truncated, 1);
    let mut l = loader(&[p], None, formatter(&m, "text", None, false), LoaderOptions { max_seq_len: 4, overflow: "drop".into(), ..opts() }).unwrap();
    let ex = l.next_example().unwrap();
    assert!(ex.input_ids.len() <= 4);
    assert_eq!(l.stats.dropped, 1);
}

#[test]
fn token_budget_batches_group_similar_lengths_under_the_budget() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let p = d.path().join("t.jsonl");
    let lines: Vec<String> = (0..40).map(|i| serde_json::json!({"text": "w ".repeat(1 + (i * 7) % 30)}).to_string()).collect();
    write_jsonl(&p, &lines);
    let mk = || loader(&[p.clone()], None, formatter(&m, "text", None, false), LoaderOptions { shuffle_buffer: 40, shuffle: true, seed: 3, ..opts() }).unwrap();
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
    write_jsonl(&p, &[serde_json::json!({"prompt": "Say hi", "completion": "hi there"}).to_string(), serde_json::json!({"prompt": "x ".repeat(50), "completion": "y"}).to_string()]);
    std::fs::write(d.path().join("r.toml"), format!("[model]\npath = \"{}\"\n[lora]\nrank = 2\nalpha = 4\n[data]\ntrain = \"pc.jsonl\"\nformat = \"prompt_completion\"\nmax_seq_len = 64\n[train]\nmax_steps = 1\nlr = 1e-3\n[output]\ndir = \"out\"\n", m.display())).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["data", "inspect", "--recipe", &d.path().join("r.toml").display().to_string(), "--n", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("«hi there<|im_end|>\n»"), "{text}");
    assert!(text.contains("1 of 2 rows are longer than data.max_seq_len = 64"), "{text}");
    assert!(!d.path().join("out").exists(), "inspect writes nothing");
}

#[test]
fn record_formats_render_as_documented() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    // prompt_completion through the model's chat template: only the completion (and end of turn) trained.
    let f = formatter(&m, "prompt_completion", None, false);
    let ex = f.tokenize(Record::Conversation(vec![Message::new("user", "2+2?"), Message::new("assistant", "4")]), 0).unwrap().ok().unwrap();
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

#[test]
fn a_tokenizer_larger_than_the_model_is_a_bad_record_not_a_crash() {
    let d = tempfile::tempdir().unwrap();
    let m = smol_tokenizer_model(d.path());
    let f = Formatter::new("text", None, &Default::default(), false, &m, 100).unwrap();
    let Err(BadRecord(msg)) = f.tokenize(Record::Text("Hello world".into()), 7).unwrap() else { panic!("must be rejected") };
    assert!(msg.contains("row 7") && msg.contains("outside the model's vocabulary"), "{msg}");
}
