//! The `finetune` command line. The only place that uses anyhow: library errors are typed;
//! here they are printed once, whole chain, no backtrace, with a hint where one helps.

use clap::{Args, Parser, Subcommand};
use finetune::recipe::LoadedRecipe;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "finetune",
    version,
    about = "LoRA fine-tuning of DeepSeek-style models (Llama / Qwen2) in one binary",
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
    /// Write a random-weight model and a toy tokenized dataset (for trying the tool and tests).
    Synth {
        /// Output folder: <out>/model and <out>/data are written.
        #[arg(long)]
        out: PathBuf,
        /// Model shape: "tiny" (hidden 64, 2 layers) or "smollm2-135m" (the benchmark shape).
        #[arg(long, default_value = "tiny")]
        shape: String,
        /// Architecture: llama or qwen2.
        #[arg(long, default_value = "llama")]
        arch: String,
        /// Dataset rows.
        #[arg(long, default_value_t = 256)]
        rows: usize,
        /// Shortest and longest row, in tokens.
        #[arg(long, default_value_t = 8)]
        seq_min: usize,
        #[arg(long, default_value_t = 48)]
        seq_max: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn hint(e: &finetune::Error) -> Option<&'static str> {
    use finetune::Error as E;
    match e {
        E::Recipe { .. } => Some("fix the key in the recipe, or override it with --set section.key=value"),
        E::Model { .. } | E::Config { .. } => {
            Some("model.path must name a local HF folder (config.json + *.safetensors) or a repo id in the hf-hub cache")
        }
        E::Safetensors { .. } | E::MissingTensor { .. } | E::Shape { .. } => {
            Some("the checkpoint does not match its config.json; re-download or re-export it")
        }
        E::Data { .. } => Some("check data.train and data.format in the recipe"),
        E::Adapter { .. } => Some("lora.init_from must be a PEFT adapter folder matching lora.rank, lora.alpha and lora.targets"),
        E::Tokenizer { .. } => Some("the model folder needs tokenizer.json for text formats"),
        _ => None,
    }
}

fn synth(out: &std::path::Path, shape: &str, arch: &str, rows: usize, len: (usize, usize), seed: u64) -> anyhow::Result<()> {
    use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, write_tokenizer, TinyShape};
    let mut s = match shape {
        "tiny" => TinyShape::default(),
        "smollm2-135m" => TinyShape::smollm2_135m(),
        other => anyhow::bail!("--shape {other}: expected tiny or smollm2-135m"),
    };
    s.arch = match arch {
        "llama" => "LlamaForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        other => anyhow::bail!("--arch {other}: expected llama or qwen2"),
    };
    if len.0 < 2 || len.0 > len.1 {
        anyhow::bail!("--seq-min/--seq-max: need 2 <= min <= max");
    }
    write_model(&out.join("model"), &s, seed, 1)?;
    write_tokenizer(&out.join("model"), s.vocab)?;
    write_tokenized_dataset(&out.join("data"), &counting_rows(rows, s.vocab, seed + 1, len.0, len.1))?;
    eprintln!("wrote {}/model and {}/data", out.display(), out.display());
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match (cli.command, cli.train) {
        (Some(Command::Train(t)), _) | (None, Some(t)) => {
            let recipe = LoadedRecipe::load(&t.recipe, &t.overrides)?;
            let stop = install_signal_handlers()?;
            let summary = finetune::train::run_with(&recipe, &finetune::train::RunOptions { stop: Some(stop) })?;
            if let Some(sig) = summary.interrupted {
                let (name, code) = if sig == 15 { ("SIGTERM", 143) } else { ("SIGINT", 130) };
                let at = summary.checkpoint.map(|d| d.display().to_string()).unwrap_or_default();
                eprintln!(
                    "stopped by {name}; checkpoint saved at {at}.\nresume with the same command \
                     (checkpoint.resume = \"auto\" continues from the newest valid checkpoint)"
                );
                return Ok(ExitCode::from(code));
            }
        }
        (Some(Command::Synth { out, shape, arch, rows, seq_min, seq_max, seed }), _) => {
            synth(&out, &shape, &arch, rows, (seq_min, seq_max), seed)?
        }
        (None, None) => anyhow::bail!("nothing to do: try `finetune --recipe recipes/tiny-lora.toml` or `finetune --help`"),
    }
    Ok(ExitCode::SUCCESS)
}

/// First SIGINT/SIGTERM: ask the loop to finish its step and checkpoint. A second one exits
/// at once (the last complete checkpoint still stands).
fn install_signal_handlers() -> anyhow::Result<std::sync::Arc<std::sync::atomic::AtomicUsize>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::Arc;
    let which = Arc::new(AtomicUsize::new(0));
    let stopping = Arc::new(AtomicBool::new(false));
    for (sig, code) in [(SIGINT, 130), (SIGTERM, 143)] {
        // Registered before the flag: on the first signal it sees `false` and does nothing.
        signal_hook::flag::register_conditional_shutdown(sig, code, stopping.clone())?;
        signal_hook::flag::register(sig, stopping.clone())?;
        signal_hook::flag::register_usize(sig, which.clone(), sig as usize)?;
    }
    Ok(which)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            if let Some(h) = e.downcast_ref::<finetune::Error>().and_then(hint) {
                eprintln!("hint: {h}");
            }
            ExitCode::FAILURE
        }
    }
}
