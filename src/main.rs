//! The `finetune` command line. The only place that uses anyhow: library errors are typed;
//! here they are printed once, whole chain, no backtrace, with a hint where one helps.

use clap::{Args, Parser, Subcommand};
use finetune::recipe::LoadedRecipe;
use std::path::PathBuf;
use std::process::ExitCode;

/// Large tensors get transparent huge pages (`finetune::alloc`).
#[global_allocator]
static ALLOC: finetune::alloc::HugePages = finetune::alloc::HugePages;

#[derive(Parser)]
#[command(
    name = "finetune",
    version,
    about = "LoRA fine-tuning of DeepSeek-style models (Llama, Qwen2, DeepSeek-V2/V3) in one binary",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `finetune --recipe R.toml` is `finetune train --recipe R.toml`.
    #[command(flatten)]
    train: Option<TrainArgs>,
}

#[derive(Args)]
struct TrainArgs {
    /// The TOML recipe (model, lora, data, train, output).
    #[arg(long)]
    recipe: PathBuf,
    /// Override a recipe key, e.g. --set train.lr=2e-4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Train LoRA adapters as a recipe says.
    Train(TrainArgs),
    /// Print the logits of a model (with an optional PEFT adapter) for token ids, as JSON
    /// `{"logits": [[V floats] per position]}`: for comparing with other runtimes.
    Logits {
        /// Model folder, .gguf file or cached repo id.
        #[arg(long)]
        model: String,
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// Comma-separated token ids.
        #[arg(long)]
        tokens: String,
    },
    /// Export a run's adapter (PEFT format) or merge it into the base model (HF safetensors).
    Export(ExportArgs),
    /// Convert a llama.cpp GGUF file (llama, qwen2 or deepseek2 architecture) into an HF model folder.
    Import {
        #[arg(long)]
        gguf: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// Storage dtype of the weights: f32, bf16 or f16 [default: the file's, F16 or BF16
        /// where all its matrices are stored so, else f32, which holds every dequantised value]
        #[arg(long)]
        dtype: Option<String>,
        /// Shard the weights above this size.
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
    },
    /// Generate text with a model (and optionally an adapter).
    Generate {
        #[arg(long)]
        model: String,
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// Repeatable: the model is loaded once and each prompt answered in turn, under a
        /// `--- prompt N` line when there are several.
        #[arg(long, required = true)]
        prompt: Vec<String>,
        /// Wrap the prompt as a user turn in the model's chat template.
        #[arg(long)]
        chat: bool,
        /// With --chat: template variables as a JSON object, e.g. '{"thinking": true}'
        /// (DeepSeek-V3.1) or '{"enable_thinking": false}' (Qwen3).
        #[arg(long, requires = "chat")]
        chat_template_kwargs: Option<String>,
        /// At least 1.
        #[arg(long, default_value_t = 128, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        max_new_tokens: usize,
        /// 0 = greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        /// Sample from the k likeliest tokens only (0: all; default: generation_config.json's
        /// top_k, else 50, as transformers).
        #[arg(long)]
        top_k: Option<usize>,
        /// transformers' repetition penalty, greedy too (1: none; default:
        /// generation_config.json's, else 1).
        #[arg(long)]
        repetition_penalty: Option<f64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Memory per device and on the host for a recipe on 1..N ranks, from config.json alone.
    Plan {
        /// The TOML recipe.
        #[arg(long)]
        recipe: PathBuf,
        /// World sizes to plan for, e.g. 1,2,4,8 (default: the recipe's).
        #[arg(long, value_delimiter = ',')]
        world_size: Vec<usize>,
        /// Override a recipe key (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        overrides: Vec<String>,
    },
    /// Exact-match evaluation on alpaca records (instruction/input/output): the base model's
    /// greedy answers beside the adapter's, with the accuracy of each.
    Eval {
        #[arg(long)]
        model: String,
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// Alpaca records: an HF datasets folder (its `test` split by default; `path:split` names
        /// another), an .arrow, .parquet or .jsonl file, or a folder of them.
        #[arg(long)]
        data: PathBuf,
        /// At least 1 (0 would score an empty expected output as correct).
        #[arg(long, default_value_t = 48, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        max_new_tokens: usize,
        /// Wrap prompts in the model's chat template instead of the Alpaca prompt.
        #[arg(long)]
        chat: bool,
        /// With --chat: template variables as a JSON object, e.g. '{"thinking": true}'.
        #[arg(long, requires = "chat")]
        chat_template_kwargs: Option<String>,
    },
    /// Write <run>/report.html and <run>/loss.png: the loss (and eval loss) against steps and
    /// tokens with the learning rate, the recipe, data statistics, throughput and memory.
    Report {
        /// A run's output folder (output.dir).
        #[arg(long)]
        run: PathBuf,
    },
    /// Look at the data as training will see it.
    Data {
        #[command(subcommand)]
        cmd: DataCmd,
    },
    /// Write a random-weight model and a toy tokenized dataset (for trying the tool and tests).
    Synth {
        /// Output folder: <out>/model and <out>/data are written.
        #[arg(long)]
        out: PathBuf,
        /// Model shape: "tiny" (hidden 64, 2 layers), "smollm2-135m" (the benchmark shape) or
        /// "deepseek-llm-7b" (7B: use --gguf, which writes one tensor at a time; an f32 HF folder needs ~28 GB of memory).
        #[arg(long, default_value = "tiny")]
        shape: String,
        /// Architecture: llama or qwen2.
        #[arg(long, default_value = "llama")]
        arch: String,
        /// Dataset rows.
        #[arg(long, default_value_t = 256)]
        rows: usize,
        /// Tie the output projection to the embedding.
        #[arg(long)]
        tie: bool,
        /// Shortest and longest row, in tokens.
        #[arg(long, default_value_t = 8)]
        seq_min: usize,
        #[arg(long, default_value_t = 48)]
        seq_max: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Storage dtype of the HF model's weights: f32, or bf16 (as the hub ships most
        /// checkpoints).
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Write the model as a llama.cpp GGUF file (<out>/model.gguf) quantized to this
        /// type (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, f32) instead of an HF folder: one tensor is
        /// generated at a time, so a 7B-shaped file needs only its quantized size in memory.
        #[arg(long)]
        gguf: Option<String>,
    },
}

#[derive(Subcommand)]
enum DataCmd {
    /// Stream examples through the loader as training would (tokenization included) and
    /// report rows/s and peak memory; for benchmarks.
    Stream {
        #[command(flatten)]
        train: TrainArgs,
        /// Examples to read.
        #[arg(long, default_value_t = 100_000)]
        rows: u64,
    },
    /// Print the first examples with the trained tokens marked, the token-length histogram,
    /// and how many rows would be truncated, dropped or skipped. Rows are read in the files'
    /// order, one record each (no shuffle, no packing), whatever the recipe says.
    Inspect {
        #[command(flatten)]
        train: TrainArgs,
        /// Examples to print.
        #[arg(long, default_value_t = 3)]
        n: usize,
        /// Rows to scan for the histogram (default: all).
        #[arg(long)]
        scan: Option<u64>,
    },
}

fn stream(t: &TrainArgs, rows: u64) -> anyhow::Result<()> {
    let recipe = LoadedRecipe::load(&t.recipe, &t.overrides)?;
    let model_dir = finetune::weights::ModelDir::of_recipe(&recipe)?;
    let cfg = model_dir.config()?;
    let started = std::time::Instant::now();
    let mut loader = finetune::train::open_loader(&recipe, &model_dir, cfg.vocab_size, finetune::data::Role::Train)?;
    let mut tokens = 0usize;
    for _ in 0..rows {
        tokens += loader.next_example()?.input_ids.len();
    }
    let secs = started.elapsed().as_secs_f64();
    let hwm = finetune::runlog::resident_mb(true).unwrap_or(0.0);
    println!(
        "{{\"rows\": {rows}, \"tokens\": {tokens}, \"seconds\": {secs:.2}, \"rows_per_s\": {:.0}, \"tokens_per_s\": {:.0}, \"peak_rss_mb\": {hwm:.1}}}",
        rows as f64 / secs,
        tokens as f64 / secs
    );
    Ok(())
}

fn inspect(t: &TrainArgs, n: usize, scan: Option<u64>) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let mut recipe = LoadedRecipe::load(&t.recipe, &t.overrides)?;
    // Read here in the files' order, one record a row; the epoch line is the training's.
    let trained = recipe.recipe.clone();
    let reordered = [("data.shuffle", trained.data.shuffle), ("data.packing", trained.data.packing)];
    recipe.recipe.data.shuffle = false;
    recipe.recipe.data.packing = false;
    let r = &recipe.recipe;
    let model_dir = finetune::weights::ModelDir::of_recipe(&recipe)?;
    let cfg = model_dir.config()?;
    let mut loader = finetune::train::open_loader(&recipe, &model_dir, cfg.vocab_size, finetune::data::Role::Train)?;
    let color = std::io::stdout().is_terminal();
    let (open, close) = if color { ("\x1b[32m", "\x1b[0m") } else { ("«", "»") };
    let off: Vec<&str> = reordered.iter().filter(|(_, on)| *on).map(|(k, _)| *k).collect();
    let order = if off.is_empty() { String::new() } else { format!("; in the files' order, one record a row ({} off here; training does them)", off.join(", ")) };
    println!("data: {} rows; format {}{order}; trained tokens shown as {open}like this{close}\n", loader.total_rows(), r.data.format);
    for i in 0..n.min(loader.total_rows() as usize) {
        let ex = loader.next_example()?;
        // Past the last usable record the loader starts the data over (bad, dropped or
        // held-out rows are skipped): the rest would be repeats.
        if loader.state().cursor.epoch > 0 {
            println!("(that is every usable record: the data has {i}; see the counts below)\n");
            break;
        }
        // Token t is trained where position t - 1 predicts it: never the first token, whatever
        // its label (a tokenizer that adds no BOS leaves the first label set).
        let trains = |t: usize| t > 0 && ex.labels[t] != finetune::data::IGNORE;
        let trained = (0..ex.input_ids.len()).filter(|&t| trains(t)).count();
        println!("--- example {i}: {} tokens, {trained} trained", ex.input_ids.len());
        let mut out = String::new();
        let mut start = 0;
        while start < ex.input_ids.len() {
            let on = trains(start);
            let mut end = start;
            while end < ex.input_ids.len() && trains(end) == on {
                end += 1;
            }
            let text = loader.formatter().decode(&ex.input_ids[start..end]);
            if on {
                out.push_str(&format!("{open}{text}{close}"));
            } else {
                out.push_str(&text);
            }
            start = end;
        }
        println!("{out}\n");
    }
    let (lengths, bad, bad_examples) = loader.scan_lengths(scan.unwrap_or(u64::MAX))?;
    let max = r.data.max_seq_len;
    let over = lengths.iter().filter(|&&l| l > max).count();
    println!("token lengths of {} rows (before truncation):", lengths.len());
    let mut bucket = 1usize;
    let top = lengths.iter().copied().max().unwrap_or(0);
    let width = 40.0;
    let biggest = {
        let mut b = 1usize;
        let mut m = 0usize;
        while b / 2 <= top {
            m = m.max(lengths.iter().filter(|&&l| l <= b && l > b / 2).count());
            b *= 2;
        }
        m.max(1)
    };
    while bucket / 2 <= top {
        let c = lengths.iter().filter(|&&l| l <= bucket && l > bucket / 2).count();
        if c > 0 {
            println!("  {:>6}-{:<6} {:>8} {}", bucket / 2 + 1, bucket, c, "#".repeat(((c as f64 / biggest as f64) * width).ceil() as usize));
        }
        bucket *= 2;
    }
    let verb = if r.data.overflow == "drop" { "dropped" } else { "truncated" };
    println!("\n{over} of {} rows are longer than data.max_seq_len = {max} and would be {verb} (data.overflow = \"{}\")", lengths.len(), r.data.overflow);
    if bad > 0 {
        println!("{bad} bad record(s) (data.on_bad_record = \"{}\"), e.g. {}", r.data.on_bad_record, bad_examples.join("; "));
    }
    // What train.max_steps makes of the data, as training says it.
    let world = finetune::dist::layout(&r.dist, &r.model.device, &|k| std::env::var(k).ok()).map_or(1, |l| l.world);
    println!("{}", finetune::train::describe_epoch(&trained, loader.records(), world));
    Ok(())
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["run", "adapter"])))]
struct ExportArgs {
    /// A training output folder (holds adapter/ and checkpoints/).
    #[arg(long)]
    run: Option<PathBuf>,
    /// With --run: export this checkpoint (e.g. step-000100) instead of the final adapter.
    #[arg(long, requires = "run")]
    checkpoint: Option<String>,
    /// A PEFT adapter folder (trained by us, PEFT, or anyone).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// The base model (local folder or cached repo id); default: the adapter's base_model_name_or_path.
    #[arg(long)]
    base: Option<String>,
    /// Merge the adapter into the base and write a full model.
    #[arg(long)]
    merge: bool,
    /// Dtype of the merged model (default: the base's): f32, bf16, f16.
    #[arg(long)]
    dtype: Option<String>,
    /// Cut merged shards at this size (e.g. 5GB); default: the base's shard layout.
    #[arg(long)]
    max_shard_size: Option<String>,
    /// Skip the logits check of the merged model.
    #[arg(long)]
    no_verify: bool,
    /// "peft" (an adapter folder, or with --merge an HF model), or "gguf": the adapter as a
    /// llama.cpp LoRA GGUF file (`llama-cli -m base.gguf --lora OUT`); --out is then a file.
    #[arg(long, default_value = "peft")]
    format: String,
    /// Output folder (must not exist or be empty); with --format gguf, the .gguf file.
    #[arg(long)]
    out: PathBuf,
}

fn export(a: &ExportArgs) -> anyhow::Result<()> {
    use finetune::export::{export_adapter_only, merge, parse_size, ExportOptions, PeftAdapter};
    // clap's `requires` is not enforced beside `--adapter` (which conflicts with `--run`).
    if let (Some(c), None) = (&a.checkpoint, &a.run) {
        anyhow::bail!("--checkpoint {c} picks a checkpoint of --run's run; with --adapter, name the checkpoint's adapter folder itself (<run>/checkpoints/{c}/adapter)");
    }
    let adapter_dir = match (&a.run, &a.adapter) {
        (Some(run), _) => match &a.checkpoint {
            Some(c) => {
                // As resume does: a checkpoint is what its manifest says, or it is not used.
                let dir = run.join("checkpoints").join(c);
                if !dir.is_dir() {
                    let names: Vec<String> = finetune::checkpoint::list(run).iter().filter_map(|(_, p)| p.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
                    let have = if names.is_empty() { format!("{} holds none", run.join("checkpoints").display()) } else { format!("the run has {}", names.join(", ")) };
                    anyhow::bail!("--checkpoint {c}: no such checkpoint ({have})");
                }
                finetune::checkpoint::verify(&dir).map_err(|why| anyhow::anyhow!("checkpoint {} is damaged or incomplete: {why}; export another one (see {})", dir.display(), run.join("checkpoints").display()))?;
                dir.join("adapter")
            }
            None => run.join("adapter"),
        },
        (None, Some(ad)) => ad.clone(),
        (None, None) => anyhow::bail!("give --run DIR or --adapter DIR"),
    };
    if !adapter_dir.is_dir() {
        anyhow::bail!("adapter folder {} does not exist (check --run/--checkpoint/--adapter)", adapter_dir.display());
    }
    let adapter = PeftAdapter::open(&adapter_dir)?;
    let base_name = a.base.clone().or(adapter.base_model.clone()).ok_or_else(|| {
        anyhow::anyhow!("the adapter names no base model; pass --base MODEL")
    })?;
    let base = match (&a.run, &a.base) {
        // The run's own base: at the hub commit it trained on.
        (Some(run), None) => finetune::weights::ModelDir::of_run(run, &base_name, std::path::Path::new("."))?,
        _ => finetune::weights::ModelDir::resolve(&base_name, std::path::Path::new("."))?,
    };
    if let Some(run) = &a.run {
        finetune::train::check_export_base(run, a.checkpoint.as_deref(), &base)?;
    }
    let dtype = match a.dtype.as_deref() {
        None => None,
        Some("f32") => Some(candle_core::DType::F32),
        Some("bf16") => Some(candle_core::DType::BF16),
        Some("f16") => Some(candle_core::DType::F16),
        Some(other) => anyhow::bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    let max_shard_size = a.max_shard_size.as_deref().map(parse_size).transpose().map_err(|e| anyhow::anyhow!("--max-shard-size: {e}"))?;
    // They shape the merged model only: the adapter is written as trained, so taking them
    // without --merge would write something other than what was asked, with exit 0.
    let merge_only = [("--dtype", a.dtype.is_some()), ("--max-shard-size", a.max_shard_size.is_some()), ("--no-verify", a.no_verify)];
    if let (false, Some((flag, _))) = (a.merge, merge_only.iter().find(|(_, set)| *set)) {
        anyhow::bail!("{flag} applies to --merge (the merged model); the adapter alone is written as trained (f32, one file): add --merge, or drop {flag}");
    }
    match (a.format.as_str(), a.merge) {
        ("gguf", true) => anyhow::bail!("--format gguf writes the adapter alone; merge with --format peft (a merged HF model), then convert it with llama.cpp"),
        ("gguf", false) => {
            if a.out.is_dir() {
                anyhow::bail!("--out {}: with --format gguf, --out names the .gguf file to write, not a folder", a.out.display());
            }
            // As the folder outputs refuse a non-empty --out: never replace a file unasked.
            if a.out.exists() {
                anyhow::bail!("--out {}: the file exists (choose another --out, or remove it first)", a.out.display());
            }
            // Ctrl-C stops it as it stops a merge: no file, exit 130.
            let stop = install_signal_handlers(EXPORT_STOPPING)?;
            let r = finetune::export::gguf::export_gguf_adapter(&adapter, &base, &a.out, Some(&stop))?;
            finetune::note!("adapter (llama.cpp LoRA GGUF) written to {} ({} bytes); use it with: llama-cli -m <base>.gguf --lora {}", r.out.display(), r.total_bytes, r.out.display());
            return Ok(());
        }
        ("peft", _) => {}
        (other, _) => anyhow::bail!("--format {other}: expected peft or gguf"),
    }
    if !a.merge {
        let r = export_adapter_only(&adapter, &base, &a.out)?;
        finetune::note!("adapter (PEFT format) written to {} ({} bytes)", r.out.display(), r.total_bytes);
        if let Some(c) = base.config().ok().and_then(|cfg| adapter.spec.peft_caveat(&cfg)) {
            finetune::note!("{c}");
        }
        return Ok(());
    }
    let opts = ExportOptions { merge: true, dtype, max_shard_size, no_verify: a.no_verify, stop: Some(install_signal_handlers(EXPORT_STOPPING)?), ..Default::default() };
    note_quantized_merge(a.run.as_deref().and_then(run_quantize).as_deref());
    let r = merge(&base, &adapter, &a.out, &opts)?;
    print_merge_report(&r);
    Ok(())
}

fn logits(model: &str, adapter: Option<&std::path::Path>, tokens: &str) -> anyhow::Result<()> {
    let ids: Vec<u32> = tokens.split(',').map(|t| t.trim().parse::<u32>()).collect::<Result<_, _>>().map_err(|e| anyhow::anyhow!("--tokens {tokens}: {e} (expected comma-separated token ids)"))?;
    let dir = finetune::weights::ModelDir::resolve(model, std::path::Path::new("."))?;
    // Token ids in, logits out: no tokenizer needed (parity fixtures' model folders have none).
    let (model, adapters) = finetune::generate::Generator::load_model(&dir, adapter)?;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= model.cfg.vocab_size) {
        anyhow::bail!("--tokens: id {bad} is past the vocabulary ({} tokens)", model.cfg.vocab_size);
    }
    let n = ids.len();
    let t = candle_core::Tensor::from_vec(ids, (1, n), &candle_core::Device::Cpu)?;
    let l: Vec<Vec<f32>> = model.logits(&t, &adapters)?.squeeze(0)?.to_vec2()?;
    // JSON has no NaN: serde would print null, a "result" that reads as data with exit 0.
    if let Some(p) = l.iter().position(|row| row.iter().any(|x| !x.is_finite())) {
        anyhow::bail!("the logits hold NaN or inf at position {p}: the model's weights{} are not finite, or its config gives non-finite values", if adapter.is_some() { " or the adapter's" } else { "" });
    }
    println!("{}", serde_json::json!({ "logits": l }));
    Ok(())
}

fn eval(model: &str, adapter: Option<&std::path::Path>, data: &std::path::Path, max_new_tokens: usize, chat: bool, chat_kwargs: Option<&str>) -> anyhow::Result<()> {
    use finetune::data::source::Rows;
    let dir = finetune::weights::ModelDir::resolve(model, std::path::Path::new("."))?;
    let mut g = finetune::generate::Generator::load(&dir, adapter)?;
    if let Some(k) = chat_kwargs {
        g.set_chat_template_kwargs(k)?;
    }
    let base = g.no_adapters()?;
    let mut rows = Rows::open(data)?;
    rows.require_columns(&["instruction", "output"])?;
    let opts = finetune::generate::SampleOptions { max_new_tokens, ..Default::default() };
    if !chat && g.adapter_has_template() {
        finetune::note!("note: the adapter carries the chat template its run trained with; without --chat both columns are prompted in the alpaca format instead, which measures the tuned model on prompts it was not trained on");
    }
    let (mut ok_base, mut ok_tuned, mut n) = (0, 0, 0);
    let started = std::time::Instant::now();
    for _ in 0..rows.total_rows {
        let (instruction, input, expected) = {
            let (r, _) = rows.next_row()?;
            // A missing instruction or answer is an error naming the row, never "" scored.
            (r.required_string("instruction")?, r.string("input")?.unwrap_or_default(), r.required_string("output")?)
        };
        let prompt = if chat {
            if input.is_empty() { instruction.clone() } else { format!("{instruction}\n\n{input}") }
        } else {
            finetune::data::alpaca_prompt(&instruction, &input)
        };
        // Each model prompted as it was trained: the adapter may carry the template its run used.
        let b = g.decode(&g.generate_ids_with(&g.base_prompt_ids(&prompt, chat)?, &opts, &base)?)?;
        let t = match adapter {
            Some(_) => Some(g.decode(&g.generate_ids_with(&g.prompt_ids(&prompt, chat)?, &opts, &g.adapters)?)?),
            None => None,
        };
        n += 1;
        let hit = |s: &str| s.trim() == expected.trim();
        ok_base += usize::from(hit(&b));
        ok_tuned += usize::from(t.as_deref().is_some_and(hit));
        let clip = |s: &str| {
            let s = s.trim().replace('\n', "\\n");
            if s.chars().count() > 60 { format!("{}…", s.chars().take(60).collect::<String>()) } else { s }
        };
        println!("| {} | {} | {} {} | {} |", clip(&input), clip(&expected), if hit(&b) { "✓" } else { "✗" }, clip(&b),
                 t.as_deref().map(|t| format!("{} {}", if hit(t) { "✓" } else { "✗" }, clip(t))).unwrap_or_default());
    }
    let pct = |k: usize| 100.0 * k as f64 / n.max(1) as f64;
    println!("\nexact match on {n} held-out prompts: base {ok_base}/{n} ({:.0}%)", pct(ok_base));
    if adapter.is_some() {
        println!("exact match with the adapter: {ok_tuned}/{n} ({:.0}%)", pct(ok_tuned));
    }
    finetune::note!("evaluated in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// A run that quantised its base on load (`model.quantize`) merges into the checkpoint's own
/// full-precision weights, as QLoRA merges do: say so, since the merged model is not quite
/// the one training saw (it differs by the quantisation error).
fn note_quantized_merge(quantize: Option<&str>) {
    if let Some(q) = quantize {
        finetune::note!(
            "note: the run trained on its base quantised on load (model.quantize = \"{q}\"); the adapter is merged into the checkpoint's full-precision weights, as QLoRA merges are, so the merged model differs from what training saw by the quantisation error"
        );
    }
}

/// `model.quantize` as a run's `recipe.resolved.toml` records it (`ModelDir::of_run` has
/// read the file already, refusing a damaged one).
fn run_quantize(run: &std::path::Path) -> Option<String> {
    let t = finetune::runlog::read_resolved_recipe(run).ok()??;
    t.get("model")?.get("quantize")?.as_str().map(str::to_string)
}

fn print_merge_report(r: &finetune::export::ExportReport) {
    finetune::note!(
        "merged model written to {}: {} tensor(s) merged, {} shard(s), {:.1} MB; peak tensor memory {:.1} MB (one shard)",
        r.out.display(),
        r.merged_tensors,
        r.shards,
        r.total_bytes as f64 / 1e6,
        r.peak_buffered_bytes as f64 / 1e6
    );
    match r.max_logit_diff {
        Some(d) => finetune::note!("verified: max |logits(merged) - logits(base + adapter)| = {d:e}"),
        None => finetune::note!("not verified (--no-verify)"),
    }
}

/// The hint printed under an error: what usually fixes that kind of error. `recipe`: whether
/// the command reads a recipe (`train`, `plan`, `data`), so a hint may name its keys; the
/// other commands take paths as flags.
fn hint(e: &finetune::Error, recipe: bool) -> Option<&'static str> {
    use finetune::Error as E;
    let adapter_file = |f: &str| f.contains("adapter_model");
    match e {
        // Not a key: the file is not TOML (the message says where).
        E::Recipe { key, .. } if key == "(syntax)" => Some("the recipe must be TOML: fix the line and column named above"),
        E::Recipe { .. } => Some("fix the key in the recipe, or override it with --set section.key=value"),
        // Say themselves which sequence or token and which limit.
        E::Model { what, .. } if what == "sequence length" || what == "token ids" => None,
        E::Model { what, .. } if what.starts_with("lora.") && recipe => Some("fix the key in the recipe, or override it with --set section.key=value"),
        E::Model { what, .. } if what.starts_with("lora.") => Some("the adapter names modules this base does not have: use it with the base named in its adapter_config.json"),
        E::Model { .. } if recipe => {
            Some("model.path must name a local HF folder (config.json + *.safetensors), a llama.cpp .gguf file, or a hub repo id (org/name)")
        }
        E::Model { .. } => Some("--model (export: --base, or the base the adapter names) must name a local HF folder (config.json + *.safetensors), a llama.cpp .gguf file, or a hub repo id (org/name)"),
        // The message names the config.json key and what is supported.
        E::Config { .. } => None,
        E::Shape { file, .. } if adapter_file(file) => Some("the adapter was trained on another base model (or with another rank): use the base it names in adapter_config.json"),
        E::Safetensors { file, .. } if adapter_file(&file.to_string_lossy()) => {
            Some("the adapter file is damaged or incomplete: export it again (finetune export --run), or use another checkpoint of the run")
        }
        E::Safetensors { .. } => Some("the file is damaged or incomplete (an interrupted download or copy?): re-download or re-export it"),
        E::MissingTensor { .. } | E::Shape { .. } => {
            Some("the checkpoint does not match its config.json; re-download or re-export it")
        }
        E::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) && recipe => Some(
            "free space on that disk (a lower checkpoint.keep_last prunes older checkpoints as the run resumes; or point output.dir elsewhere) and rerun: the newest complete checkpoint is intact and the run resumes from it",
        ),
        E::Io { source, .. } if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
            Some("free space on that disk (or write --out elsewhere) and rerun: nothing half-written was left at --out")
        }
        E::Gguf { .. } => Some("GGUF models of the llama, qwen2 and deepseek2 architectures are read (see the README's GGUF section for the tensor types); check the key or tensor named above"),
        E::Data { .. } if recipe => Some("check the data.train or data.eval named above, and data.format, in the recipe"),
        E::Data { .. } => Some("--data must name a .jsonl, .json, .parquet or .arrow file, or a datasets folder"),
        E::Hub { .. } => Some(
            "HF_TOKEN for gated repos, HF_ENDPOINT for a mirror, HF_HUB_OFFLINE=1 for the cache alone (HF_HUB_CACHE or HF_HOME say where it is); or name a local folder instead (model.path / data.train, or --model / --data)",
        ),
        E::Adapter { .. } if recipe => Some("an adapter must be a plain LoRA in PEFT's format (adapter_config.json + adapter_model.safetensors); as lora.init_from it must also match lora.rank, lora.alpha and lora.targets"),
        E::Adapter { .. } => Some("an adapter must be a plain LoRA in PEFT's format (adapter_config.json + adapter_model.safetensors) trained on this base model"),
        // The message names the file and what it lacks.
        E::Tokenizer { .. } => None,
        E::Dist { .. } | E::PeerFailed { .. } => {
            Some("a rank failed or stalled; the newest checkpoint is intact: rerun to resume (dist.timeout_s sets how long ranks wait)")
        }
        _ => None,
    }
}

/// The hint for a device that ran out of memory (CUDA's and cuBLAS's words for it, whatever
/// the error's kind: a rank's failure carries them too), which the error's own kind would
/// otherwise hint at wrongly ("a rank failed or stalled"). Training is what runs on GPUs.
fn out_of_memory_hint(text: &str, recipe: bool) -> Option<&'static str> {
    let oom = ["CUDA_ERROR_OUT_OF_MEMORY", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation"].iter().any(|m| text.contains(m));
    match oom && recipe {
        false => None,
        true => Some(
            "the GPU ran out of memory: `finetune plan` estimates each GPU's share. Lower it with smaller micro-batches (train.micro_batch_size halved and \
             grad_accum_steps doubled keep the examples a step, and a resume may change them so; with batch_by = \"tokens\", data.max_tokens), a lower \
             train.activation_memory_mb, or the base sharded with dist.zero_stage = 3 over more GPUs",
        ),
    }
}

#[cfg(test)]
mod hint_tests {
    #[test]
    fn a_cuda_out_of_memory_error_gets_the_memory_hint_not_its_kinds() {
        let cuda = "step 3: compute: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")";
        assert!(super::out_of_memory_hint(cuda, true).is_some_and(|h| h.contains("train.micro_batch_size") && h.contains("grad_accum_steps")));
        assert!(super::out_of_memory_hint("rank 1 failed: CUBLAS_STATUS_ALLOC_FAILED", true).is_some());
        assert_eq!(super::out_of_memory_hint("no such file", true), None);
    }
}

#[allow(clippy::too_many_arguments)]
fn synth(out: &std::path::Path, (shape, arch, dtype): (&str, &str, &str), rows: usize, tie: bool, len: (usize, usize), seed: u64, gguf: Option<&str>) -> anyhow::Result<()> {
    use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, write_tokenizer, TinyShape};
    let mut s = match shape {
        "tiny" => TinyShape::default(),
        "smollm2-135m" => TinyShape::smollm2_135m(),
        "deepseek-llm-7b" => TinyShape::deepseek_llm_7b(),
        other => anyhow::bail!("--shape {other}: expected tiny, smollm2-135m or deepseek-llm-7b"),
    };
    s.arch = match arch {
        "llama" => "LlamaForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        other => anyhow::bail!("--arch {other}: expected llama or qwen2"),
    };
    s.tie |= tie;
    s.dtype = match dtype {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        other => anyhow::bail!("--dtype {other}: expected f32 or bf16"),
    };
    if len.0 < 2 || len.0 > len.1 {
        anyhow::bail!("--seq-min/--seq-max: need 2 <= min <= max");
    }
    match gguf {
        Some(q) => {
            let dtype = match q {
                "f32" => candle_core::quantized::GgmlDType::F32,
                "q4_1" => candle_core::quantized::GgmlDType::Q4_1,
                q => finetune::weights::quantized::parse_format(q).ok_or_else(|| anyhow::anyhow!("--gguf {q}: expected q8_0, q4_0, q4_1, q4_k, q5_k, q6_k or f32"))?,
            };
            std::fs::create_dir_all(out)?;
            finetune::synth::write_gguf_model(&out.join("model.gguf"), &s, seed, dtype)?;
        }
        None => {
            write_model(&out.join("model"), &s, seed, 1)?;
            write_tokenizer(&out.join("model"), s.vocab)?;
        }
    }
    write_tokenized_dataset(&out.join("data"), &counting_rows(rows, s.vocab, seed + 1, len.0, len.1))?;
    finetune::note!("wrote {}/{} and {}/data", out.display(), if gguf.is_some() { "model.gguf" } else { "model" }, out.display());
    Ok(())
}

fn plan(recipe: &std::path::Path, worlds: &[usize], overrides: &[String]) -> anyhow::Result<()> {
    let loaded = LoadedRecipe::load(recipe, overrides)?;
    let r = &loaded.recipe;
    let cfg = finetune::weights::ModelDir::config_for_plan(&loaded)?;
    let layout = finetune::dist::layout(&r.dist, &r.model.device, &|_| None)
        .map_err(|(key, msg)| finetune::Error::Recipe { file: recipe.display().to_string(), key, msg })?;
    // The portable path allocates on a CPU what it allocates on a GPU: plan it as one.
    let on_gpu = layout.local.iter().any(|(_, d)| *d != finetune::device::DeviceSpec::Cpu) || r.model.kernels() == finetune::ops::Kernels::Portable;
    let worlds = if worlds.is_empty() { vec![layout.world] } else { worlds.to_vec() };
    // The bounds a recipe's dist.world_size has (past them the arithmetic would wrap).
    let max = finetune::recipe::MAX_WORLD_SIZE;
    if let Some(&w) = worlds.iter().find(|&&w| w == 0 || w > max) {
        anyhow::bail!("--world-size {w}: world sizes must be between 1 and {max}");
    }
    // The adapters `train` would refuse (a target this model lacks) are refused here too.
    finetune::lora::Adapters::check_spec(&cfg, &r.lora.spec(&cfg))?;
    let quant = finetune::weights::quantized::plan_base(&loaded, &cfg)?;
    // As `train` refuses it.
    if quant.is_some() {
        finetune::train::check_quantized_unsharded(&loaded, worlds.iter().copied().max().unwrap_or(1))?;
    }
    let copied = finetune::weights::tables_copied(&loaded);
    let plans: Vec<_> = worlds.iter().map(|&w| finetune::dist::plan::plan_with(&cfg, r, w, on_gpu, quant.as_ref(), &copied)).collect();
    print!("{}", finetune::dist::plan::render(&cfg, r, &plans, on_gpu));
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // Commands that only print end quietly on a closed stdout (`| head`), as any Unix tool
    // does, instead of panicking in println!. Training and export keep SIGPIPE ignored: a run
    // whose `| tee` went away with Ctrl-C must still checkpoint (its stderr lines are `note!`s).
    if matches!(cli.command, Some(Command::Data { .. } | Command::Generate { .. } | Command::Plan { .. } | Command::Logits { .. } | Command::Eval { .. })) {
        // SAFETY: restoring a signal's default disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match (cli.command, cli.train) {
        (Some(Command::Train(t)), _) | (None, Some(t)) => {
            let recipe = LoadedRecipe::load(&t.recipe, &t.overrides)?;
            let stop = install_signal_handlers(TRAIN_STOPPING)?;
            let summary = finetune::train::run_with(&recipe, &finetune::train::RunOptions { stop: Some(stop.clone()), ..Default::default() })?;
            // A signal after the last step stops the end-of-run exports (not the run: its
            // adapter is written), with the command that writes them later.
            let unwritten = |e: finetune::Error, what: &str, how: &str| -> anyhow::Error {
                let run = summary.output_dir.display();
                match e {
                    finetune::Error::Interrupted { .. } => anyhow::Error::new(e).context(format!(
                        "training finished and its adapter is in {run}/adapter, but the {what} was not written; \
                         write it with `finetune export --run {run} {how}`"
                    )),
                    other => other.into(),
                }
            };
            // Only the process holding the folder writes there (under several processes,
            // rank 0's).
            if summary.interrupted.is_none() && recipe.recipe.export.merged && summary.lock.is_some() {
                let e = &recipe.recipe.export;
                let run = &summary.output_dir;
                let adapter = finetune::export::PeftAdapter::open(&run.join("adapter"))?;
                let base = finetune::train::run_base(run, &recipe.recipe.model.path, &recipe.dir)?;
                // A rerun replaces the merged folder only once the new one is complete.
                let out = run.join("merged");
                let opts = finetune::export::ExportOptions {
                    merge: true,
                    dtype: e.dtype.as_deref().map(finetune::weights::parse_dtype),
                    max_shard_size: e.max_shard_size.as_deref().map(finetune::export::parse_size).transpose().map_err(|m| anyhow::anyhow!("export.max_shard_size: {m}"))?,
                    no_verify: false,
                    kernels: recipe.recipe.model.kernels(),
                    replace: true,
                    stop: Some(stop.clone()),
                };
                note_quantized_merge(recipe.recipe.model.quantize.as_deref());
                let merged = finetune::export::merge(&base, &adapter, &out, &opts).map_err(|e| unwritten(e, "merged model", &format!("--merge --out {}", out.display())))?;
                print_merge_report(&merged);
            }
            if summary.interrupted.is_none() && recipe.recipe.export.gguf && summary.lock.is_some() {
                let gguf = summary.output_dir.join("adapter.gguf");
                let gguf_unwritten = |e| unwritten(e, "llama.cpp GGUF adapter", &format!("--format gguf --out {}", gguf.display()));
                finetune::export::stop_requested(&stop).map_err(gguf_unwritten)?;
                let adapter = finetune::export::PeftAdapter::open(&summary.output_dir.join("adapter"))?;
                let base = finetune::train::run_base(&summary.output_dir, &recipe.recipe.model.path, &recipe.dir)?;
                let r = finetune::export::gguf::export_gguf_adapter(&adapter, &base, &gguf, Some(&stop)).map_err(gguf_unwritten)?;
                finetune::note!("adapter (llama.cpp LoRA GGUF) written to {}", r.out.display());
            }
            if let Some(sig) = summary.interrupted {
                let at = summary.checkpoint.map(|d| d.display().to_string()).unwrap_or_default();
                let how = match recipe.recipe.checkpoint.resume.as_str() {
                    "auto" => "the same command".to_string(),
                    // Rerunning with "never" or a pinned checkpoint would set this progress aside.
                    _ => "the same command plus --set checkpoint.resume=auto".to_string(),
                };
                finetune::note!(
                    "stopped by {}; checkpoint saved at {at}.\nresume with {how} \
                     (checkpoint.resume = \"auto\" continues from the newest valid checkpoint)",
                    finetune::error::signal_name(sig as i64)
                );
                return Ok(signal_exit(sig));
            }
        }
        (Some(Command::Export(a)), _) => export(&a)?,
        (Some(Command::Data { cmd: DataCmd::Inspect { train, n, scan } }), _) => inspect(&train, n, scan)?,
        (Some(Command::Data { cmd: DataCmd::Stream { train, rows } }), _) => stream(&train, rows)?,
        (Some(Command::Import { gguf, out, dtype, max_shard_size }), _) => {
            let dtype = match dtype.as_deref() {
                Some("f32") => Some(candle_core::DType::F32),
                Some("bf16") => Some(candle_core::DType::BF16),
                Some("f16") => Some(candle_core::DType::F16),
                Some(other) => anyhow::bail!("--dtype {other}: expected f32, bf16 or f16"),
                None => None,
            };
            let limit = finetune::export::parse_size(&max_shard_size).map_err(|e| anyhow::anyhow!("--max-shard-size: {e}"))?;
            let r = finetune::gguf::import(&gguf, &out, dtype, limit)?;
            finetune::note!("imported {} tensors into {} ({} shard(s)), in {}", r.tensors, out.display(), r.shards, finetune::weights::torch_dtype_name(r.dtype));
        }
        (Some(Command::Generate { model, adapter, prompt, chat, chat_template_kwargs, max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed }), _) => {
            let dir = finetune::weights::ModelDir::resolve(&model, std::path::Path::new("."))?;
            let mut g = finetune::generate::Generator::load(&dir, adapter.as_deref())?;
            if let Some(k) = &chat_template_kwargs {
                g.set_chat_template_kwargs(k)?;
            }
            let opts = finetune::generate::SampleOptions { max_new_tokens, temperature, top_p, top_k, repetition_penalty, seed };
            for (i, p) in prompt.iter().enumerate() {
                if prompt.len() > 1 {
                    println!("{}--- prompt {}", if i > 0 { "\n" } else { "" }, i + 1);
                }
                println!("{}", g.generate(p, chat, &opts)?);
            }
        }
        (Some(Command::Report { run }), _) => {
            let paths = finetune::report::write_report(&run)?;
            finetune::note!("report written to {} ({})", paths.html.display(), paths.png.display());
        }
        (Some(Command::Plan { recipe, world_size, overrides }), _) => plan(&recipe, &world_size, &overrides)?,
        (Some(Command::Logits { model, adapter, tokens }), _) => logits(&model, adapter.as_deref(), &tokens)?,
        (Some(Command::Eval { model, adapter, data, max_new_tokens, chat, chat_template_kwargs }), _) => {
            eval(&model, adapter.as_deref(), &data, max_new_tokens, chat, chat_template_kwargs.as_deref())?
        }
        (Some(Command::Synth { out, shape, arch, rows, tie, seq_min, seq_max, seed, dtype, gguf }), _) => {
            synth(&out, (&shape, &arch, &dtype), rows, tie, (seq_min, seq_max), seed, gguf.as_deref())?
        }
        (None, None) => anyhow::bail!("nothing to do: try `finetune --recipe recipes/tiny-lora.toml` or `finetune --help`"),
    }
    Ok(ExitCode::SUCCESS)
}

/// The exit status of a command stopped by `signal`: the shell's convention, 128 + its number
/// (130 for SIGINT, 143 for SIGTERM).
fn signal_exit(signal: usize) -> ExitCode {
    ExitCode::from(128u8.saturating_add(signal as u8))
}

/// What the first stop signal does, said when it arrives: a step can take minutes (a long
/// micro-batch, the shuffle buffer's first fill), and a signal that seems ignored gets a
/// second one, which loses the step.
const TRAIN_STOPPING: &[u8] = b"\nstop requested: training finishes the step in progress, saves a checkpoint and exits (an export after training stops and removes what it wrote); a second Ctrl-C stops at once, without that checkpoint\n";
const EXPORT_STOPPING: &[u8] = b"\nstop requested: the export stops at its next tensor and removes what it wrote\n";

/// First SIGINT/SIGTERM: say what happens (`first`, on rank 0 only: every rank of a
/// terminal's launch gets the signal), and ask the work to stop where it can (the training
/// loop after its step, with a checkpoint). A second one exits at once (the last complete
/// checkpoint still stands).
fn install_signal_handlers(first: &'static [u8]) -> anyhow::Result<std::sync::Arc<std::sync::atomic::AtomicUsize>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::Arc;
    let which = Arc::new(AtomicUsize::new(0));
    let stopping = Arc::new(AtomicBool::new(false));
    // As `dist::layout` reads it; unset is a single process.
    let lead = std::env::var("RANK").map_or(true, |r| r.trim().parse::<usize>() == Ok(0));
    for (sig, code) in [(SIGINT, 130), (SIGTERM, 143)] {
        // Registered before the flag: on the first signal it sees `false` and says what the
        // stop does. On the second it says why the run ends there, then exits (write(2) and
        // _exit(2) are async-signal-safe; nothing else runs in the handler).
        let again = stopping.clone();
        let action = move || {
            if !again.load(std::sync::atomic::Ordering::SeqCst) {
                if lead {
                    // SAFETY: a plain system call on a static buffer, allowed in a signal handler.
                    unsafe {
                        libc::write(2, first.as_ptr().cast(), first.len());
                    }
                }
            } else {
                const SAID: &[u8] = b"\nsecond stop signal: stopping at once; the last complete checkpoint, if one was saved, stands (checkpoint.resume = \"auto\" continues from it)\n";
                // SAFETY: plain system calls on a static buffer, allowed in a signal handler.
                unsafe {
                    if lead {
                        libc::write(2, SAID.as_ptr().cast(), SAID.len());
                    }
                    libc::_exit(code);
                }
            }
        };
        // SAFETY: the action only loads an atomic and makes async-signal-safe system calls.
        unsafe { signal_hook::low_level::register(sig, action) }?;
        signal_hook::flag::register(sig, stopping.clone())?;
        signal_hook::flag::register_usize(sig, which.clone(), sig as usize)?;
    }
    Ok(which)
}

/// The binary is compiled for x86-64-v3 (`.cargo/config.toml`): say so on a CPU without it
/// instead of dying on an illegal instruction later. `is_x86_feature_detected!` cannot tell
/// (it is constant `true` for features the build enables), so this reads CPUID itself. Best
/// effort: it runs first in `main`, before any of our vector code.
#[inline(never)]
fn check_cpu() -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 and 0x80000001 are read only if the
        // maximum leaves say they exist.
        #[allow(unused_unsafe)]
        let (leaf1_ecx, leaf7_ebx, ext_ecx) = unsafe {
            let max = __cpuid(0).eax;
            let max_ext = __cpuid(0x8000_0000).eax;
            let leaf7 = if max >= 7 { __cpuid_count(7, 0).ebx } else { 0 };
            let ext = if max_ext >= 0x8000_0001 { __cpuid(0x8000_0001).ecx } else { 0 };
            (__cpuid(1).ecx, leaf7, ext)
        };
        // XCR0 (which vector state the OS saves) is readable only when OSXSAVE is set.
        let xcr0 = if leaf1_ecx & (1 << 27) != 0 { read_xcr0() } else { 0 };
        let missing = cpu_v3::missing_v3(leaf1_ecx, leaf7_ebx, ext_ecx, xcr0);
        if !missing.is_empty() {
            return Err(format!(
                "this finetune binary was built for x86-64-v3, and this CPU (or OS) lacks {}; \
                 rebuild it for this CPU with: RUSTFLAGS=\"\" cargo build --release",
                missing.join(", ")
            ));
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
fn read_xcr0() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: XGETBV(0) is valid when CPUID.1:ECX.OSXSAVE is set (checked by the caller).
    unsafe { std::arch::asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags)) };
    ((hi as u64) << 32) | lo as u64
}

/// Decoding of the CPUID bits x86-64-v3 needs, kept pure so a test can check it.
mod cpu_v3 {
    /// Names of the x86-64-v3 features the given CPUID words lack (empty: all present).
    pub fn missing_v3(leaf1_ecx: u32, leaf7_ebx: u32, ext_ecx: u32, xcr0: u64) -> Vec<&'static str> {
        let need: [(&str, bool); 9] = [
            ("FMA", leaf1_ecx & (1 << 12) != 0),
            ("MOVBE", leaf1_ecx & (1 << 22) != 0),
            ("AVX", leaf1_ecx & (1 << 28) != 0),
            ("F16C", leaf1_ecx & (1 << 29) != 0),
            ("AVX state saved by the OS (XCR0)", xcr0 & 0b110 == 0b110),
            ("BMI1", leaf7_ebx & (1 << 3) != 0),
            ("AVX2", leaf7_ebx & (1 << 5) != 0),
            ("BMI2", leaf7_ebx & (1 << 8) != 0),
            ("LZCNT", ext_ecx & (1 << 5) != 0),
        ];
        need.iter().filter(|(_, ok)| !ok).map(|(name, _)| *name).collect()
    }

    #[cfg(test)]
    mod tests {
        use super::missing_v3;

        #[test]
        fn a_cpu_without_the_v3_bits_is_told_which_it_lacks() {
            assert_eq!(missing_v3(0, 0, 0, 0).len(), 9);
            let all = (1 << 12 | 1 << 22 | 1 << 28 | 1 << 29, 1 << 3 | 1 << 5 | 1 << 8, 1 << 5, 0b111);
            assert!(missing_v3(all.0, all.1, all.2, all.3).is_empty());
            // AVX2 alone missing; the OS not saving YMM state counts as missing too.
            assert_eq!(missing_v3(all.0, 1 << 3 | 1 << 8, all.2, all.3), vec!["AVX2"]);
            assert_eq!(missing_v3(all.0, all.1, all.2, 0b011), vec!["AVX state saved by the OS (XCR0)"]);
        }

        #[test]
        fn this_machine_passes_the_check() {
            assert_eq!(super::super::check_cpu(), Ok(()));
        }
    }
}

/// candle's CPU thread pool spins up to 25,000 `pause`s (~0.5 ms) after each of its ops before
/// parking. Between candle ops our own kernels run on rayon's threads, so on a small machine
/// the spinning workers take the cores those kernels need (12% of a step's CPU samples at
/// batch 1 on 2 cores). A short spin keeps back-to-back candle ops quick. An explicit
/// CANDLE_BARRIER_POOL_SPIN_LIMIT in the environment wins.
///
/// The main thread is made worker 0 of rayon's global pool. Otherwise every parallel loop
/// the training thread starts is handed to the pool's own threads while the caller sleeps:
/// one more thread than cores, a wake-up and a sleep per loop (~23,000 context switches a
/// step at 1 x 512 on 2 cores, 4,900 after), and 15-17% of a step's time (alternating runs,
/// 1 x 512 and 4 x 512 on a 2-core AMX Xeon). Where the main thread waits for other threads
/// that use the pool (local ranks), it serves the pool meanwhile: see `train::run_ranks`.
fn tune_thread_pools() {
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_none() {
        // Called first thing in main, before any thread exists.
        std::env::set_var(VAR, "1000");
    }
    // Fails only if the global pool exists already, which nothing before this can cause.
    let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
}

fn main() -> ExitCode {
    if let Err(e) = check_cpu() {
        finetune::note!("error: {e}");
        return ExitCode::FAILURE;
    }
    tune_thread_pools();
    finetune::alloc::tune();
    let cli = Cli::parse();
    let recipe = matches!(cli.command, None | Some(Command::Train(_) | Command::Plan { .. } | Command::Data { .. }));
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            finetune::note!("error: {e}");
            // Printed once: a cause whose text its error already carries (an I/O error
            // names its file and then its OS error) is not repeated.
            let mut said = e.to_string();
            for cause in e.chain().skip(1) {
                let text = cause.to_string();
                if !said.contains(&text) {
                    finetune::note!("  caused by: {text}");
                    said = text;
                }
            }
            let text: String = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join("\n");
            if let Some(h) = out_of_memory_hint(&text, recipe).or_else(|| e.downcast_ref::<finetune::Error>().and_then(|e| hint(e, recipe))) {
                finetune::note!("hint: {h}");
            }
            match e.downcast_ref::<finetune::Error>() {
                Some(&finetune::Error::Interrupted { signal }) => signal_exit(signal),
                _ => ExitCode::FAILURE,
            }
        }
    }
}
