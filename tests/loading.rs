//! Loading checkpoints and data the ways users have them: sharded, bf16, from the hf-hub
//! cache, alpaca records with a tokenizer; and the reproducibility claims of training.

mod common;
use arrow_array::{ArrayRef, RecordBatch, StringArray};
use common::*;
use finetune::config::ModelConfig;
use finetune::data::{alpaca_prompt, Formatter, Record, IGNORE};
use finetune::recipe::LoadedRecipe;
use finetune::synth::{counting_rows, write_model, write_tokenized_dataset, TinyShape};
use std::path::Path;
use std::sync::Arc;

#[test]
fn deepseek_7b_rank64_qkvo_has_62_914_560_trainable_params() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let recipe = LoadedRecipe::load(&root.join("recipes/deepseek-7b-lora.toml"), &[]).unwrap().recipe;
    assert_eq!(recipe.model.path, "deepseek-ai/deepseek-llm-7b-base");
    let cfg = ModelConfig::from_file(&root.join("recipes/models/deepseek-llm-7b-base/config.json")).unwrap();
    let (trainable, all) = finetune::train::trainable_parameters(&cfg, &recipe.lora.spec(&cfg));
    assert_eq!(trainable, 62_914_560);
    assert_eq!(all, 6_973_280_256);
    assert_eq!(
        finetune::train::format_trainable(trainable, all),
        "trainable params: 62,914,560 || all params: 6,973,280,256 || trainable%: 0.9022"
    );
}

const RECIPE: &str = r#"
[model]
path = "model"
[lora]
rank = 4
alpha = 8
targets = ["q_proj", "v_proj", "down_proj"]
[data]
train = "data"
shuffle = false
[train]
max_steps = 3
micro_batch_size = 2
grad_accum_steps = 2
lr = 1e-2
[output]
dir = "out"
"#;

fn workspace(shape: &TinyShape, shards: usize) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    write_model(&d.path().join("model"), shape, 7, shards).unwrap();
    write_tokenized_dataset(&d.path().join("data"), &counting_rows(16, shape.vocab, 3, 5, 20)).unwrap();
    std::fs::write(d.path().join("recipe.toml"), RECIPE).unwrap();
    d
}

/// Train from scratch (these tests rerun in the same folder with other settings).
fn train(dir: &Path, extra: &[&str]) -> Vec<finetune::train::StepMetrics> {
    let mut o: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    o.push("checkpoint.resume=never".into());
    let r = LoadedRecipe::load(&dir.join("recipe.toml"), &o).unwrap();
    finetune::train::run(&r).unwrap().steps
}

fn losses(m: &[finetune::train::StepMetrics]) -> Vec<f64> {
    m.iter().map(|s| s.loss).collect()
}

#[test]
fn sharded_checkpoint_trains_exactly_like_single_file() {
    let single = workspace(&TinyShape::default(), 1);
    let sharded = workspace(&TinyShape::default(), 3);
    assert!(sharded.path().join("model/model.safetensors.index.json").is_file());
    assert_eq!(losses(&train(single.path(), &[])), losses(&train(sharded.path(), &[])));
}

/// A folder with both model.safetensors and an index over shards trains on model.safetensors,
/// the file transformers loads from it (the adapter must fit the base PEFT will load).
#[test]
fn a_folder_with_a_single_file_and_an_index_trains_on_the_single_file_as_transformers_loads_it() {
    let both = workspace(&TinyShape::default(), 3);
    write_model(&both.path().join("single"), &TinyShape::default(), 8, 1).unwrap();
    std::fs::copy(both.path().join("single/model.safetensors"), both.path().join("model/model.safetensors")).unwrap();
    let other = workspace(&TinyShape::default(), 1);
    write_model(&other.path().join("model"), &TinyShape::default(), 8, 1).unwrap();
    assert_eq!(losses(&train(both.path(), &[])), losses(&train(other.path(), &[])));
}

/// bf16 against f32 losses, relative, over 3 steps of the tiny model: the weights rounded to
/// bf16 (and, on a bf16 unit, the operands). Measured 1.7e-4 on Zen 4 (bf16 operands).
const BF16_BOUND: f64 = 5e-4;

#[test]
fn bf16_base_trains_close_to_f32() {
    let f32_ws = workspace(&TinyShape::default(), 1);
    let bf16_ws = workspace(&TinyShape { dtype: candle_core::DType::BF16, ..Default::default() }, 1);
    let a = losses(&train(f32_ws.path(), &["model.dtype=f32"]));
    let b = losses(&train(bf16_ws.path(), &["model.dtype=\"bf16\""]));
    assert_eq!(a.len(), b.len());
    let worst = a.iter().zip(&b).map(|(x, y)| rel(*y, *x)).fold(0.0, f64::max);
    println!("f32 {a:?} vs bf16 {b:?}: max relative diff {worst:.2e}");
    assert!(worst < BF16_BOUND, "f32 {a:?} vs bf16 {b:?}: {worst:e} relative");
}

/// On a CPU without a bf16 unit a bf16 checkpoint kept bf16 (the default there) trains as the
/// same checkpoint converted to f32 does: its frozen matmuls widen the weights to f32 math
/// (`ops::widen`), nothing rounded. The two differ only in how the GEMM blocks its sums.
#[test]
#[cfg_attr(bf16_unit, ignore = "a bf16 unit runs a bf16 base on bf16 operands instead")]
fn a_bf16_base_without_a_bf16_unit_trains_as_its_f32_conversion() {
    let ws = workspace(&TinyShape { dtype: candle_core::DType::BF16, ..Default::default() }, 1);
    let auto = LoadedRecipe::load(&ws.path().join("recipe.toml"), &[]).unwrap().recipe.model.dtype;
    assert_eq!(auto, "bf16", "model.dtype = \"auto\" keeps a bf16 checkpoint bf16");
    let kept = train(ws.path(), &[]);
    let converted = train(ws.path(), &["model.dtype=f32"]);
    let worst = kept.iter().zip(&converted).map(|(a, b)| rel(a.loss, b.loss).max(rel(a.grad_norm, b.grad_norm))).fold(0.0, f64::max);
    println!("bf16 kept vs f32: losses {:?} vs {:?}; max relative diff {worst:.2e}", losses(&kept), losses(&converted));
    assert!(worst < 5e-7, "loss or grad_norm differs by {worst:e} relative (measured 1.7e-7 on an AVX2 EPYC)");
}

#[test]
fn qwen2_tied_without_lm_head_tensor_loads() {
    let ws = workspace(&TinyShape { arch: "Qwen2ForCausalLM", tie: true, ..Default::default() }, 1);
    let st = load_tensors(&ws.path().join("model/model.safetensors"));
    assert!(!st.contains_key("lm_head.weight"));
    assert!(st.contains_key("model.layers.0.self_attn.q_proj.bias"));
    assert_eq!(train(ws.path(), &[]).len(), 3);
}

/// A tied config beside a stored lm_head.weight that differs from the embedding: transformers
/// (5.24) keeps the stored head ("both are present in the checkpoints with different values,
/// so we will NOT tie them"), so training must see the model an untied config describes.
#[test]
fn a_tied_config_with_a_different_stored_head_trains_on_the_stored_head() {
    let ws = workspace(&TinyShape::default(), 2);
    assert!(load_tensors(&ws.path().join("model/model-00002-of-00002.safetensors")).contains_key("lm_head.weight"));
    let untied = losses(&train(ws.path(), &[]));
    common::edit_json(&ws.path().join("model/config.json"), |c| c["tie_word_embeddings"] = true.into());
    let cfg = finetune::weights::ModelDir::resolve("model", ws.path()).unwrap().config().unwrap();
    assert!(!cfg.tie_word_embeddings, "the stored head differs, so the model is untied");
    let plan = finetune::weights::ModelDir::config_for_plan(&LoadedRecipe::load(&ws.path().join("recipe.toml"), &[]).unwrap()).unwrap();
    assert!(!plan.tie_word_embeddings, "`finetune plan` counts the head training holds");
    assert_eq!(losses(&train(ws.path(), &[])), untied);
}

/// A stored head equal to the embedding (some tools save both) keeps the model tied: one table.
#[test]
fn a_tied_config_with_an_equal_stored_head_stays_tied() {
    let ws = workspace(&TinyShape { tie: true, ..Default::default() }, 1);
    let path = ws.path().join("model/model.safetensors");
    let tied = losses(&train(ws.path(), &[]));
    let mut st = load_tensors(&path);
    st.insert("lm_head.weight".into(), st["model.embed_tokens.weight"].clone());
    candle_core::safetensors::save(&st, &path).unwrap();
    let cfg = finetune::weights::ModelDir::resolve("model", ws.path()).unwrap().config().unwrap();
    assert!(cfg.tie_word_embeddings);
    assert_eq!(losses(&train(ws.path(), &[])), tied);
}

/// `finetune logits` on `model`, returning its stderr (the notes loading printed).
fn logits_notes(model: &Path) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune")).args(["logits", "--tokens", "1,2,3", "--model"]).arg(model).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stderr).unwrap()
}

/// A bias the config does not call for changes the math: it is named, as transformers lists
/// it among the unexpected keys, rather than dropped without a word. What every checkpoint
/// holds, and a stored head equal to a tied embedding, are not.
#[test]
fn tensors_no_layer_reads_are_named_when_the_model_loads() {
    for shape in [TinyShape::default(), TinyShape { arch: "Qwen2ForCausalLM", tie: true, ..Default::default() }] {
        let ws = workspace(&shape, 1);
        assert_eq!(logits_notes(&ws.path().join("model")), "", "{}", shape.arch);
    }
    let ws = workspace(&TinyShape { tie: true, ..Default::default() }, 1);
    let path = ws.path().join("model/model.safetensors");
    let mut st = load_tensors(&path);
    st.insert("lm_head.weight".into(), st["model.embed_tokens.weight"].clone());
    candle_core::safetensors::save(&st, &path).unwrap();
    assert_eq!(logits_notes(&ws.path().join("model")), "");
    let h = st["model.norm.weight"].dims()[0];
    st.insert("model.layers.0.self_attn.q_proj.bias".into(), candle_core::Tensor::zeros(h, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap());
    candle_core::safetensors::save(&st, &path).unwrap();
    let notes = logits_notes(&ws.path().join("model"));
    assert!(notes.contains("1 tensor in") && notes.contains("`model.layers.0.self_attn.q_proj.bias`") && notes.contains("attention_bias"), "{notes}");
}

#[test]
fn repo_id_resolves_through_the_hf_hub_cache() {
    let ws = workspace(&TinyShape::default(), 1);
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--acme--tiny-llama");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    let commit = "abc1230000000000000000000000000000000000";
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    std::fs::create_dir_all(repo.join("snapshots")).unwrap();
    std::fs::rename(ws.path().join("model"), repo.join("snapshots").join(commit)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_finetune"))
        .args(["--recipe", &ws.path().join("recipe.toml").display().to_string(), "--set", "model.path=acme/tiny-llama"])
        .env("HF_HUB_CACHE", cache.path())
        // Nothing listens there: a cache filled by another tool (no markers for the optional
        // files it lacks) is used as it is when the hub is out of reach, with a warning.
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning") && err.contains("using the cached snapshot"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ws.path().join("out/adapter/adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["base_model_name_or_path"], "acme/tiny-llama");
}

#[test]
fn training_is_deterministic_with_dropout_and_shuffle() {
    let ws = workspace(&TinyShape::default(), 1);
    let args = ["lora.dropout=0.1", "data.shuffle=true", "data.shuffle_buffer=5", "train.seed=9"];
    let a = train(ws.path(), &args);
    let b = train(ws.path(), &args);
    assert_eq!(losses(&a), losses(&b));
    let c = train(ws.path(), &["lora.dropout=0.1", "data.shuffle=true", "data.shuffle_buffer=5", "train.seed=10"]);
    assert_ne!(losses(&a), losses(&c), "the seed must matter");
}

#[test]
fn activation_checkpointing_changes_nothing_even_with_dropout() {
    let ws = workspace(&TinyShape::default(), 1);
    let a = train(ws.path(), &["lora.dropout=0.2", "train.activation_checkpointing=true"]);
    let adapter_a = load_tensors(&ws.path().join("out/adapter/adapter_model.safetensors"));
    let b = train(ws.path(), &["lora.dropout=0.2", "train.activation_checkpointing=false"]);
    let adapter_b = load_tensors(&ws.path().join("out/adapter/adapter_model.safetensors"));
    for (x, y) in a.iter().zip(&b) {
        assert!(rel(x.loss, y.loss) < 1e-6 && rel(x.grad_norm, y.grad_norm) < 1e-5, "{x:?} vs {y:?}");
    }
    for (k, t) in &adapter_a {
        assert!(max_abs_diff(t, &adapter_b[k]) < 1e-6, "{k}");
    }
}

/// "auto" checkpointing keeps the attention outputs, SwiGLU inputs and projection outputs of
/// layers for their recomputation and skips the down projection there, and leaves the last layers out of
/// checkpointing when the budget holds them whole: the same arithmetic on the same values,
/// so the same bits, whatever the budget.
#[test]
fn auto_checkpointing_trains_the_same_bits_as_recomputing_everything() {
    let ws = workspace(&TinyShape::default(), 1);
    let base = ["lora.dropout=0.1", "lora.targets=[\"q_proj\", \"v_proj\", \"o_proj\"]"];
    let a = train(ws.path(), &[&base[..], &["train.activation_checkpointing=true"]].concat());
    let adapter_a = load_tensors(&ws.path().join("out/adapter/adapter_model.safetensors"));
    // 2 layers of ~21 MB each when whole (mostly attention scratch at seq 2048).
    // Per layer at 2 x 2048 tokens: attention output 1.06 MB, SwiGLU inputs 4 MB, projection
    // outputs 3 MB (k_proj's by the frozen matmul, the others' by the LoRA op).
    for budget in ["0", "12", "20", "32", "64"] {
        let mb = format!("train.activation_memory_mb={budget}");
        let b = train(ws.path(), &[&base[..], &["train.activation_checkpointing=auto", &mb]].concat());
        let adapter_b = load_tensors(&ws.path().join("out/adapter/adapter_model.safetensors"));
        assert_eq!(losses(&a), losses(&b), "budget {budget} MB");
        // What was kept, as the run reports it: with room for everything, both kinds in every layer.
        let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ws.path().join("out/summary.json")).unwrap()).unwrap();
        let said = summary["kernels"].as_str().unwrap().to_string();
        let layers = TinyShape::default().layers;
        let want = match budget {
            "12" => format!("attention outputs of {layers}, the SwiGLU inputs of {layers} and the projection outputs of 0 of {layers} layers (~"),
            "20" => format!("attention outputs of {layers}, the SwiGLU inputs of {layers} and the projection outputs of {layers} of {layers} layers (~"),
            "32" => format!("attention outputs of {l}, the SwiGLU inputs of {l} and the projection outputs of {l} of {layers} layers; the last 1 not checkpointed", l = layers - 1),
            "64" => "none needed".to_string(),
            _ => "every layer recomputed".to_string(),
        };
        assert!(said.contains(&want), "budget {budget} MB: {said}");
        for (k, t) in &adapter_a {
            assert_eq!(max_abs_diff(t, &adapter_b[k]), 0.0, "{k}, budget {budget} MB");
        }
    }
}

/// With "auto" checkpointing and no budget, a micro-batch of rows that can hold more than 2048
/// tokens runs as passes of at most 2048 (`train::pass_tokens`): 8 rows of up to 700 tokens
/// as four passes of two. The same sums in another order: the same losses, gradient norms and
/// adapters as one pass (checkpointing on, which never splits) to f32 rounding, with dropout
/// too: each pass draws its rows' part of the micro-batch's masks (with every pass drawing
/// the first rows' masks the gradient norm differed by 4e-3). f32 matmuls on every CPU: on a
/// bf16 unit the activations are rounded to bf16 before each frozen matmul, and a last-bit
/// difference of the f32 GEMMs (whose blocking follows the rows of a pass) then flips a bf16
/// rounding now and then (grad norm 1.4e-6 apart on a Zen 5 EPYC), which is not what this
/// test is about.
#[test]
fn auto_checkpointing_runs_long_micro_batches_in_passes_with_the_same_results() {
    let shape = TinyShape::default();
    let ws = workspace(&shape, 1);
    write_tokenized_dataset(&ws.path().join("data"), &counting_rows(32, shape.vocab, 4, 500, 700)).unwrap();
    let base = ["lora.dropout=0.2", "train.micro_batch_size=8", "data.max_seq_len=1024", "train.max_steps=2", "model.matmul=f32"];
    let a = train(ws.path(), &[&base[..], &["train.activation_checkpointing=true"]].concat());
    let adapter_a = load_tensors(&ws.path().join("out/adapter/adapter_model.safetensors"));
    let b = train(ws.path(), &[&base[..], &["train.activation_checkpointing=auto"]].concat());
    let adapter_b = load_tensors(&ws.path().join("out/adapter/adapter_model.safetensors"));
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ws.path().join("out/summary.json")).unwrap()).unwrap();
    let said = summary["kernels"].as_str().unwrap();
    assert!(said.contains("MB per pass); the rows of a micro-batch over 2048 tokens run in passes of at most 2048"), "{said}");
    for (x, y) in a.iter().zip(&b) {
        println!("step {}: loss {:e}, grad_norm {:e} relative", x.step, rel(x.loss, y.loss), rel(x.grad_norm, y.grad_norm));
        // Measured on a Zen 3 EPYC: 5e-10 and 1.3e-8.
        assert!(rel(x.loss, y.loss) < 1e-8 && rel(x.grad_norm, y.grad_norm) < 1e-7, "{x:?} vs {y:?}");
    }
    for (k, t) in &adapter_a {
        println!("{k}: {:e}", max_abs_diff(t, &adapter_b[k]));
        assert!(max_abs_diff(t, &adapter_b[k]) < 1e-6, "{k}"); // measured: at most 4.9e-7 (lr 1e-2)
    }
}

/// A layer's graph holds the weights it was handed: with ZeRO-3 shards (or a quantized base) a
/// layer left whole would keep its gathered (dequantised) copy until backward, so "auto" then
/// keeps only attention outputs, SwiGLU inputs and projection outputs, whatever the budget.
#[test]
fn auto_checkpointing_leaves_layers_whole_only_where_the_base_stays_resident() {
    let ws = workspace(&TinyShape::default(), 1);
    let layers = TinyShape::default().layers;
    let said = |extra: &[&str]| {
        let base = ["train.max_steps=1", "train.activation_checkpointing=auto", "train.activation_memory_mb=64", "lora.targets=[\"q_proj\", \"v_proj\"]"];
        train(ws.path(), &[&base[..], extra].concat());
        let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ws.path().join("out/summary.json")).unwrap()).unwrap();
        summary["kernels"].as_str().unwrap().to_string()
    };
    assert!(said(&[]).contains("none needed"));
    let sharded = said(&["dist.zero_stage=3"]);
    assert!(sharded.contains(&format!("attention outputs of {layers}, the SwiGLU inputs of {layers} and the projection outputs of {layers} of {layers} layers (~")), "{sharded}");
}

/// With no `train.activation_memory_mb`, "auto" keeps everything costly to recompute in every
/// layer of a model whose layers all fit whole in a quarter of its base (a large vocabulary,
/// short rows: the base dwarfs the activations, as a MoE model's does), and never a whole
/// layer, unless an MLP is adapted (then none is checkpointed); elsewhere it keeps what the
/// default budget holds.
#[test]
fn auto_checkpointing_without_a_budget_keeps_all_that_is_costly_to_recompute_where_the_base_dwarfs_the_activations() {
    let big_vocab = TinyShape { vocab: 50_000, ..TinyShape::default() };
    let l = TinyShape::default().layers;
    let everything = format!("attention outputs of {l}, the SwiGLU inputs of {l} and the projection outputs of {l} of {l} layers (~");
    for (shape, want) in [(big_vocab, everything.as_str()), (TinyShape::default(), "recomputed from")] {
        let ws = workspace(&shape, 1);
        // No MLP target: the fused MLP runs, and its SwiGLU inputs can be kept.
        train(ws.path(), &["train.max_steps=1", "data.max_seq_len=16", "train.activation_checkpointing=auto", "lora.targets=[\"q_proj\", \"v_proj\"]"]);
        let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ws.path().join("out/summary.json")).unwrap()).unwrap();
        let said = summary["kernels"].as_str().unwrap();
        assert!(said.contains(want) && !said.contains("not checkpointed"), "vocab {}: {said}", shape.vocab);
    }
    // With an MLP adapted its SwiGLU inputs cannot be kept: the MLPs would be recomputed whole,
    // so no layer is checkpointed there.
    let ws = workspace(&TinyShape { vocab: 50_000, ..TinyShape::default() }, 1);
    train(ws.path(), &["train.max_steps=1", "data.max_seq_len=16", "train.activation_checkpointing=auto", "lora.targets=[\"q_proj\", \"down_proj\"]"]);
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ws.path().join("out/summary.json")).unwrap()).unwrap();
    assert!(summary["kernels"].as_str().unwrap().contains("none needed"), "{}", summary["kernels"]);
}

#[test]
fn fresh_adapter_leaves_the_model_unchanged() {
    // B = 0 at init: the step-1 loss with LoRA equals the loss with LoRA on other modules.
    let ws = workspace(&TinyShape::default(), 1);
    let a = train(ws.path(), &["train.max_steps=1"]);
    let b = train(ws.path(), &["train.max_steps=1", "lora.targets=[\"o_proj\"]"]);
    assert_eq!(a[0].loss, b[0].loss);
}

/// A word-level tokenizer.json over the words of the alpaca prompt and the records, with
/// <s> prepended by its post-processor (as Llama tokenizers do).
fn write_word_tokenizer(dir: &Path, texts: &[&str]) {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    let all: String = texts.join(" ") + &alpaca_prompt("x", "") + &alpaca_prompt("x", "y");
    for w in all.split(|c: char| !c.is_alphanumeric()).chain(all.split(|c: char| c.is_alphanumeric() || c.is_whitespace())) {
        if !w.is_empty() && !vocab.contains_key(w) {
            let n = vocab.len();
            vocab.insert(w.to_string(), n.into());
        }
    }
    let special = |id: u32, c: &str| serde_json::json!({"id": id, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"eos_token": "</s>", "bos_token": "<s>"}"#).unwrap();
}

#[test]
fn alpaca_records_train_only_on_the_response() {
    let ws = workspace(&TinyShape::default(), 1);
    let (ins, inp, outp) = (["Add two numbers", "Name a color"], ["2 and 3", ""], ["The sum is 5", "Blue"]);
    let texts: Vec<&str> = ins.iter().chain(&inp).chain(&outp).copied().collect();
    write_word_tokenizer(&ws.path().join("model"), &texts);
    let f = Formatter::new("alpaca", None, &Default::default(), false, &ws.path().join("model"), 256).unwrap();
    let rec = Record::PromptCompletion(alpaca_prompt(ins[0], inp[0]), outp[0].to_string());
    let ex = f.tokenize(rec, 0).unwrap().ok().unwrap();
    assert_eq!(ex.input_ids[0], 1, "BOS from the tokenizer's post-processor");
    assert_eq!(*ex.input_ids.last().unwrap(), 2, "EOS appended");
    let trained: Vec<u32> = ex.input_ids.iter().zip(&ex.labels).filter(|(_, &l)| l != IGNORE).map(|(&t, _)| t).collect();
    assert_eq!(trained.len(), 4 + 1, "\"The sum is 5\" and EOS are trained, nothing of the prompt");
    for (t, l) in ex.input_ids.iter().zip(&ex.labels) {
        assert!(*l == IGNORE || *l == *t as i64);
    }

    let data = ws.path().join("alpaca");
    std::fs::create_dir_all(&data).unwrap();
    let col = |v: [&str; 2]| -> ArrayRef { Arc::new(StringArray::from(v.to_vec())) };
    let batch = RecordBatch::try_from_iter(vec![("instruction", col(ins)), ("input", col(inp)), ("output", col(outp))]).unwrap();
    finetune::synth::write_arrow_stream(&data.join("data.arrow"), &[batch]).unwrap();
    let m = train(ws.path(), &["data.train=alpaca", "data.format=alpaca", "train.grad_accum_steps=1"]);
    assert_eq!(m[0].tokens, 5 + 2, "targets: the two responses plus their EOS tokens");
}

/// Packing: the same records packed into one row give the same loss and LoRA gradients as
/// unpacked (positions restart per record, attention never crosses records).
#[test]
fn packed_records_give_the_same_loss_and_gradients_as_unpacked() {
    use finetune::data::{Example, MicroBatch};
    let ws = workspace(&TinyShape::default(), 1);
    let cfg = ModelConfig::from_file(&ws.path().join("model/config.json")).unwrap();
    let spec = finetune::lora::LoraSpec { rank: 4, alpha: 8.0, dropout: 0.0, targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()], routed_experts: false };
    let adapters = finetune::lora::Adapters::init(&cfg, spec, 1, &candle_core::Device::Cpu).unwrap();
    // Non-zero B so that LoRA changes the output and every grad is non-trivial.
    for (_, v) in adapters.params() {
        v.set(&(v.as_tensor().ones_like().unwrap() * 0.01).unwrap()).unwrap();
    }
    let files = finetune::weights::SafetensorsFiles::open(&[ws.path().join("model/model.safetensors")]).unwrap();
    let src = std::sync::Arc::new(finetune::weights::ResidentWeights::new(files, candle_core::DType::F32, candle_core::DType::F32, candle_core::Device::Cpu));
    let model = finetune::model::Model::load(src, cfg, &adapters).unwrap();
    let vars: Vec<candle_core::Var> = adapters.params().into_iter().map(|(_, v)| v.clone()).collect();
    let records: Vec<Example> = counting_rows(3, 256, 9, 5, 11).into_iter().map(|(i, l)| Example::new(i.iter().map(|&x| x as u32).collect(), l)).collect();
    let mut packed = records[0].clone();
    for (seg, r) in records.iter().enumerate().skip(1) {
        packed.input_ids.extend(&r.input_ids);
        packed.labels.extend(&r.labels);
        packed.positions.extend(&r.positions);
        packed.segments.extend(r.segments.iter().map(|_| seg as u32));
    }
    let run = |mb: &MicroBatch, ckpt: Option<&[KeepLayer]>| {
        let mut grads = vec![None; vars.len()];
        let loss = finetune::train::forward_backward(&model, &adapters, &vars, mb, 1.0, None, ckpt, &mut grads).unwrap();
        (loss, grads.into_iter().map(|g| g.unwrap().to_dtype(candle_core::DType::F32).unwrap()).collect::<Vec<_>>())
    };
    let unpacked = MicroBatch::collate(&records);
    let packed = MicroBatch::collate(&[packed]);
    assert_eq!(unpacked.num_targets(), packed.num_targets());
    let layers = model.cfg.num_hidden_layers;
    use finetune::ops::checkpoint::KeepLayer;
    let (recompute, keep) = (vec![KeepLayer::default(); layers], vec![KeepLayer { attention: true, swiglu: true, linears: true, whole: false }; layers]);
    // The last layer not checkpointed, the others recomputed.
    let mut mixed = recompute.clone();
    mixed[layers - 1].whole = true;
    for ckpt in [None, Some(&recompute[..]), Some(&keep[..]), Some(&mixed[..])] {
        let (l1, g1) = run(&unpacked, ckpt);
        let (l2, g2) = run(&packed, ckpt);
        assert!(rel(l2, l1) < 1e-6, "loss {l1} vs {l2}");
        for (a, b) in g1.iter().zip(&g2) {
            let d = max_abs_diff(a, b);
            assert!(d < 1e-6, "grad differs by {d}");
        }
    }
}
