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

fn synth(out: &std::path::Path, shape: &str, arch: &str, rows: usize, seed: u64) -> anyhow::Result<()> {
    use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
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
    write_model(&out.join("model"), &s, seed, 1)?;
    write_tokenized_dataset(&out.join("data"), &counting_rows(rows, s.vocab, seed + 1, 8, 48))?;
    eprintln!("wrote {}/model and {}/data", out.display(), out.display());
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match (cli.command, cli.train) {
        (Some(Command::Train(t)), _) | (None, Some(t)) => {
            let recipe = LoadedRecipe::load(&t.recipe, &t.overrides)?;
            finetune::train::run(&recipe)?;
        }
        (Some(Command::Synth { out, shape, arch, rows, seed }), _) => synth(&out, &shape, &arch, rows, seed)?,
        (None, None) => anyhow::bail!("nothing to do: try `finetune --recipe recipes/tiny-lora.toml` or `finetune --help`"),
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
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
