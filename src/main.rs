//! The `finetune` command line. The only place that uses anyhow: library errors are typed;
//! here they are printed once, whole chain, no backtrace, with a hint where one helps.

use clap::Parser;
use finetune::recipe::LoadedRecipe;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "finetune", version, about = "LoRA fine-tuning of DeepSeek-style models (Llama / Qwen2) on CPU or GPU")]
struct Cli {
    /// The TOML recipe (model, lora, data, train, output).
    #[arg(long)]
    recipe: PathBuf,
    /// Override a recipe key, e.g. --set train.lr=2e-4 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
}

fn hint(e: &finetune::Error) -> Option<&'static str> {
    use finetune::Error as E;
    match e {
        E::Recipe { .. } => Some("fix the key in the recipe, or override it with --set section.key=value"),
        E::Model { .. } | E::Config { .. } => Some("model.path must name a local HF folder (config.json + *.safetensors) or a cached repo id"),
        E::Safetensors { .. } | E::MissingTensor { .. } | E::Shape { .. } => {
            Some("the checkpoint does not match its config.json; re-download or re-export it")
        }
        E::Data { .. } => Some("check data.train and data.format in the recipe"),
        E::Adapter { .. } => Some("lora.init_from must be a PEFT adapter folder matching lora.rank/alpha/targets"),
        _ => None,
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let recipe = LoadedRecipe::load(&cli.recipe, &cli.overrides)?;
    finetune::train::run(&recipe)?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
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
