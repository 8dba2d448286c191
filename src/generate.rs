//! Text generation with a KV cache: greedy or temperature / top-p sampling, optional chat
//! template, an adapter applied unmerged (or a merged model loaded directly).

use crate::chat::{ChatTemplate, Message};
use crate::error::{Error, Result};
use crate::lora::Adapters;
use crate::model::{KvCache, Model};
use crate::rng::Rng;
use crate::weights::{ModelDir, ResidentWeights};
use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct SampleOptions {
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    pub top_p: f64,
    /// Sampling from the k likeliest tokens only (0: all). `None`: generation_config.json's
    /// `top_k`, else transformers' default, 50.
    pub top_k: Option<usize>,
    /// transformers' repetition penalty (1 = none), greedy or not. `None`:
    /// generation_config.json's `repetition_penalty`, else 1.
    pub repetition_penalty: Option<f64>,
    pub seed: u64,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions { max_new_tokens: 128, temperature: 0.0, top_p: 1.0, top_k: None, repetition_penalty: None, seed: 0 }
    }
}

/// What generation_config.json sets that `generate` follows where the command line does not
/// (transformers' `generate` takes them from there too).
#[derive(Clone, Debug, Default)]
struct GenerationDefaults {
    top_k: Option<usize>,
    repetition_penalty: Option<f64>,
}

impl GenerationDefaults {
    /// `gen` (generation_config.json in `dir`, or null)'s values; a note where it asks for
    /// sampling, which this does only when told (`--temperature`): greedy is what `eval` and
    /// a first look want.
    fn of(dir: &Path, gen: &serde_json::Value) -> Self {
        if gen.get("do_sample").and_then(|v| v.as_bool()) == Some(true) {
            let t = gen.get("temperature").map_or("1".into(), |v| v.to_string());
            crate::note!(
                "note: {}/generation_config.json asks for sampling (do_sample, temperature {t}), as transformers' generate would; this generates greedily unless --temperature is given",
                dir.display()
            );
        }
        GenerationDefaults {
            top_k: gen.get("top_k").and_then(|v| v.as_u64()).map(|k| k as usize),
            repetition_penalty: gen.get("repetition_penalty").and_then(|v| v.as_f64()),
        }
    }
}

pub struct Generator {
    pub model: Model,
    pub adapters: Adapters,
    pub tokenizer: tokenizers::Tokenizer,
    /// The model's own chat template.
    pub chat: Option<ChatTemplate>,
    /// The one the adapter was trained with, where the run's was not the model's own (the
    /// adapter's `chat_template.jinja`): the tuned model's prompts go through it.
    adapter_chat: Option<ChatTemplate>,
    /// Variables the chat template is given beside the conversation (`--chat-template-kwargs`:
    /// DeepSeek-V3.1's `thinking`, Qwen3's `enable_thinking`).
    pub chat_vars: crate::chat::Vars,
    stop: Vec<u32>,
    defaults: GenerationDefaults,
    tok_path: std::path::PathBuf,
}

/// The ids generation stops on, where transformers' `generate` stops: the `eos_token_id` (one
/// or a list) of generation_config.json where the folder has that file, else config.json's
/// (`GenerationMixin` loads the one and falls back to the other; it never asks the
/// tokenizer). A union with the tokenizer's eos_token and the usual end-of-turn names cut
/// answers short where transformers runs on (a base model that writes `</s>` mid-text).
pub fn stop_ids(dir: &Path) -> Result<Vec<u32>> {
    stop_ids_of(dir, &crate::chat::optional_json(dir, "generation_config.json")?)
}

/// [`stop_ids`] with generation_config.json (`gen`, null where there is none) read already.
fn stop_ids_of(dir: &Path, gen: &serde_json::Value) -> Result<Vec<u32>> {
    let cfg = if gen.is_null() { crate::chat::optional_json(dir, "config.json")? } else { gen.clone() };
    Ok(match cfg.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        Some(x) => x.as_u64().map(|x| x as u32).into_iter().collect(),
        None => Vec::new(),
    })
}

impl Generator {
    /// Load a model folder (f32 compute) with an optional PEFT adapter.
    pub fn load(model: &ModelDir, adapter: Option<&Path>) -> Result<Self> {
        let (llama, adapters) = Self::load_model(model, adapter)?;
        let tok_path = model.dir.join("tokenizer.json");
        if let (Some(gguf), false) = (&model.gguf, tok_path.is_file()) {
            // A GGUF's tokenizer is described from its metadata into the cache: name the key
            // the file lacks, not the cache file.
            let msg = "missing: the file holds no tokenizer, and generate needs one (training on tokenized data does not)";
            return Err(Error::Gguf { file: gguf.clone(), key: "tokenizer.ggml.model".into(), msg: msg.into() });
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer { path: tok_path.clone(), msg: e.to_string() })?;
        let chat = ChatTemplate::from_model_dir(&model.dir)?;
        let adapter_chat = match adapter {
            Some(a) if a.join(crate::chat::TEMPLATE_FILE).is_file() => Some(ChatTemplate::from_file(&a.join(crate::chat::TEMPLATE_FILE), &model.dir)?),
            // The older save (TRL with transformers 4): the tokenizer saved beside the adapter,
            // its template in tokenizer_config.json, which AutoTokenizer on that folder reads.
            Some(a) if a.join("tokenizer_config.json").is_file() => ChatTemplate::from_model_dir(a)?,
            _ => None,
        };
        // One read of generation_config.json for where generation stops and what it defaults to.
        let gen = crate::chat::optional_json(&model.dir, "generation_config.json")?;
        let stop = stop_ids_of(&model.dir, &gen)?;
        let defaults = GenerationDefaults::of(&model.dir, &gen);
        Ok(Generator { model: llama, adapters, tokenizer, chat, adapter_chat, chat_vars: Default::default(), stop, defaults, tok_path })
    }

    /// The model (f32 compute) with an optional PEFT adapter, without a tokenizer (what
    /// `finetune logits` needs: it is given token ids).
    pub fn load_model(model: &ModelDir, adapter: Option<&Path>) -> Result<(Model, Adapters)> {
        let cfg = model.config()?;
        let adapters = match adapter {
            Some(dir) => crate::export::PeftAdapter::open(dir)?.load(&cfg)?,
            None => Adapters::none(&cfg)?,
        };
        // A quantized base (a GGUF file, a bitsandbytes checkpoint) is dequantised once, as it
        // is first used, and kept: generation runs every layer per token, so dequantising per
        // use would cost more than the forward.
        let reader: Option<Box<dyn crate::weights::quantized::BlockReader>> = match &model.gguf {
            Some(g) => Some(Box::new(crate::gguf::GgufReader::new(crate::gguf::open(g)?))),
            None => {
                let files = model.open_weights()?;
                crate::weights::bnb::is_bnb(&files).then(|| Box::new(crate::weights::bnb::BnbReader { files, storage: DType::F32 }) as Box<dyn crate::weights::quantized::BlockReader>)
            }
        };
        let src: Arc<dyn crate::weights::WeightSource> = match reader {
            Some(reader) => {
                let account = Arc::new(crate::dist::zero::Account::default());
                Arc::new(crate::weights::quantized::QuantizedWeights::new(reader, cfg.num_hidden_layers, 0, DType::F32, DType::F32, Device::Cpu, account).keep_dequantised())
            }
            None => Arc::new(ResidentWeights::new(model.open_weights()?, DType::F32, DType::F32, Device::Cpu)),
        };
        let llama = Model::load(src.clone(), cfg, &adapters)?;
        src.seal();
        crate::weights::note_unread(model, llama.asked(), &llama.cfg);
        Ok((llama, adapters))
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true).map_err(|e| Error::Tokenizer { path: self.tok_path.clone(), msg: e.to_string() })
    }

    /// Adapters that change nothing (for the base model's answers).
    /// Set the chat template's variables from `--chat-template-kwargs` (a JSON object, as
    /// transformers' `apply_chat_template(**kwargs)` takes them).
    pub fn set_chat_template_kwargs(&mut self, json: &str) -> Result<()> {
        let bad = |msg: String| Error::Generate(format!("--chat-template-kwargs: {msg}"));
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| bad(format!("not JSON ({e}); expected an object such as '{{\"thinking\": true}}'")))?;
        let serde_json::Value::Object(vars) = v else { return Err(bad(format!("expected a JSON object of template variables, got {v}"))) };
        if let Some(k) = vars.keys().find(|k| crate::chat::RESERVED_VARS.contains(&k.as_str())) {
            return Err(bad(format!("`{k}` is set by finetune itself")));
        }
        self.chat_vars = vars;
        Ok(())
    }

    pub fn no_adapters(&self) -> Result<Adapters> {
        Adapters::none(&self.model.cfg)
    }

    /// The prompt for one user turn, through the chat template the adapter was trained with
    /// (its own where it carries one, else the model's).
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        self.render_prompt(self.tuned_template(), user)
    }

    /// The prompt for one user turn as the base model is prompted: through the model's own
    /// template (the adapter's where the model has none).
    pub fn base_chat_prompt(&self, user: &str) -> Result<String> {
        self.render_prompt(self.base_template(), user)
    }

    /// Whether the adapter carries the chat template its run trained with.
    pub fn adapter_has_template(&self) -> bool {
        self.adapter_chat.is_some()
    }

    fn tuned_template(&self) -> Option<&ChatTemplate> {
        self.adapter_chat.as_ref().or(self.chat.as_ref())
    }

    fn base_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref().or(self.adapter_chat.as_ref())
    }

    fn render_prompt(&self, t: Option<&ChatTemplate>, user: &str) -> Result<String> {
        let t = t.ok_or_else(|| {
            Error::Generate(format!("--chat: {} has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); drop --chat to use the prompt as plain text", self.tok_path.parent().unwrap_or(&self.tok_path).display()))
        })?;
        t.render_with(&[Message::new("user", user)], &self.chat_vars, true)
    }

    /// Token ids of text the chat template rendered: no special tokens added (the template
    /// writes its own BOS), as transformers' `apply_chat_template` tokenizes it and as
    /// conversations are trained.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).map_err(|e| Error::Tokenizer { path: self.tok_path.clone(), msg: e.to_string() })
    }

    /// Token ids of a plain prompt (no chat template): with the special tokens the tokenizer
    /// adds before a text (BOS), as `text`, `alpaca` and `prompt_completion` records are
    /// trained and as transformers' tokenizer call gives; one its post-processor appends
    /// after the text (an EOS) is dropped, since the model is to continue the prompt.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, true).map_err(|e| Error::Tokenizer { path: self.tok_path.clone(), msg: e.to_string() })?;
        let added = |i: usize| enc.get_special_tokens_mask()[i] == 1 && enc.get_offsets()[i] == (0, 0);
        let mut n = enc.get_ids().len();
        let first_text = (0..n).find(|&i| !added(i));
        while first_text.is_some_and(|f| n > f + 1) && added(n - 1) {
            n -= 1;
        }
        Ok(enc.get_ids()[..n].to_vec())
    }

    /// The prompt's ids: through the model's chat template as one user turn (`chat`), else
    /// as plain text ([`Self::encode_plain`]).
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        self.ids_through(self.tuned_template(), prompt, chat)
    }

    /// [`Self::prompt_ids`] as the base model is prompted (`eval`'s base column).
    pub fn base_prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        self.ids_through(self.base_template(), prompt, chat)
    }

    fn ids_through(&self, t: Option<&ChatTemplate>, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        match chat {
            true => self.encode(&self.render_prompt(t, prompt)?),
            false => self.encode_plain(prompt),
        }
    }

    /// Generate a continuation of `prompt` (see [`Self::prompt_ids`]); returns the new text.
    pub fn generate(&self, prompt: &str, chat: bool, opts: &SampleOptions) -> Result<String> {
        let ids = self.prompt_ids(prompt, chat)?;
        let out = self.generate_ids(&ids, opts)?;
        self.tokenizer.decode(&out, true).map_err(|e| Error::Tokenizer { path: self.tok_path.clone(), msg: e.to_string() })
    }

    pub fn generate_ids(&self, prompt: &[u32], opts: &SampleOptions) -> Result<Vec<u32>> {
        self.generate_ids_with(prompt, opts, &self.adapters)
    }

    /// Generate with other adapters (e.g. none, for a before/after comparison on one load).
    pub fn generate_ids_with(&self, prompt: &[u32], opts: &SampleOptions, adapters: &Adapters) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(Error::Generate("the prompt is empty (no tokens)".into()));
        }
        // A tokenizer with added tokens past the embedding's rows (a resized vocabulary the
        // checkpoint does not have) would fail inside the embedding with a tensor error.
        if let Some(id) = prompt.iter().find(|&&i| i as usize >= self.model.cfg.vocab_size) {
            return Err(Error::Generate(format!(
                "the prompt's token id {id} ({}) is past the model's vocabulary (config.json vocab_size = {})",
                self.tok_path.display(),
                self.model.cfg.vocab_size
            )));
        }
        // A NaN temperature makes every probability NaN and the sampler falls back to
        // whatever sorts first: garbage text with exit 0. Refuse the options instead.
        if !(opts.temperature.is_finite() && opts.temperature >= 0.0) {
            return Err(Error::Generate(format!("--temperature {}: expected a finite number >= 0 (0 = greedy)", opts.temperature)));
        }
        if !(opts.top_p > 0.0 && opts.top_p <= 1.0) {
            return Err(Error::Generate(format!("--top-p {}: expected a number in (0, 1]", opts.top_p)));
        }
        let opts = &SampleOptions {
            top_k: Some(opts.top_k.or(self.defaults.top_k).unwrap_or(50)),
            repetition_penalty: Some(opts.repetition_penalty.or(self.defaults.repetition_penalty).unwrap_or(1.0)),
            ..opts.clone()
        };
        let penalty = opts.repetition_penalty.unwrap_or(1.0);
        if !(penalty.is_finite() && penalty > 0.0) {
            return Err(Error::Generate(format!("repetition penalty {penalty} (--repetition-penalty, else generation_config.json): expected a number > 0 (1 = none)")));
        }
        // The last token sampled is not run: the longest sequence is one short of both.
        let longest = prompt.len() + opts.max_new_tokens.saturating_sub(1);
        self.model.cfg.check_positions(longest).map_err(|msg| {
            Error::Generate(format!("{msg} (a prompt of {} tokens and --max-new-tokens {})", prompt.len(), opts.max_new_tokens))
        })?;
        let mut caches: Vec<KvCache> = vec![None; self.model.cfg.num_hidden_layers];
        let mut rng = Rng::new(opts.seed);
        let mut out = Vec::new();
        let mut input = prompt.to_vec();
        let mut offset = 0;
        for _ in 0..opts.max_new_tokens {
            let ids = Tensor::from_slice(&input, (1, input.len()), &Device::Cpu)?;
            let logits: Vec<f32> = self.model.step(&ids, offset, &mut caches, adapters)?.to_vec1()?;
            if logits.iter().any(|l| !l.is_finite()) {
                return Err(Error::Generate(format!(
                    "the model's logits hold NaN or inf at position {}: the base weights{} are not finite \
                     (or overflow in this dtype)",
                    offset + input.len() - 1,
                    if adapters.num_params() > 0 { " or the adapter" } else { "" }
                )));
            }
            offset += input.len();
            let mut logits = logits;
            if penalty != 1.0 {
                // transformers' RepetitionPenaltyLogitsProcessor: every token of the prompt and
                // of the answer so far, once, before any sampling warper.
                let mut seen = std::collections::HashSet::new();
                for &t in prompt.iter().chain(&out) {
                    if let Some(l) = logits.get_mut(t as usize).filter(|_| seen.insert(t)) {
                        *l = if *l < 0.0 { *l * penalty as f32 } else { *l / penalty as f32 };
                    }
                }
            }
            let next = sample(&logits, opts, &mut rng);
            if self.stop.contains(&next) {
                break;
            }
            out.push(next);
            input = vec![next];
        }
        Ok(out)
    }
}

/// Greedy (temperature 0) or temperature, top-k and nucleus sampling (transformers' order:
/// temperature, then the k likeliest, then the nucleus of those).
fn sample(logits: &[f32], opts: &SampleOptions, rng: &mut Rng) -> u32 {
    let argmax = || logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32;
    if opts.temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(usize, f64)> = logits.iter().enumerate().map(|(i, &l)| (i, ((l as f64 - max) / opts.temperature).exp())).collect();
    let z: f64 = p.iter().map(|x| x.1).sum();
    p.iter_mut().for_each(|x| x.1 /= z);
    p.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(k) = opts.top_k.filter(|&k| k > 0 && k < p.len()) {
        // Ties with the k-th stay, as transformers' `scores < kth` keeps them.
        let kth = p[k - 1].1;
        p.retain(|x| x.1 >= kth);
        let z: f64 = p.iter().map(|x| x.1).sum();
        p.iter_mut().for_each(|x| x.1 /= z);
    }
    let mut cum = 0.0;
    let mut keep = p.len();
    for (i, x) in p.iter().enumerate() {
        cum += x.1;
        if cum >= opts.top_p {
            keep = i + 1;
            break;
        }
    }
    let p = &p[..keep];
    let total: f64 = p.iter().map(|x| x.1).sum();
    let mut u = rng.next_f64() * total;
    for x in p {
        u -= x.1;
        if u <= 0.0 {
            return x.0 as u32;
        }
    }
    p.last().map_or_else(argmax, |x| x.0 as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// top_k keeps the k likeliest tokens (transformers' TopKLogitsWarper, default 50 when
    /// sampling), ties with the k-th included; 0 keeps all.
    #[test]
    fn top_k_samples_only_the_k_likeliest_tokens() {
        let logits = [0.0f32, 3.0, 1.0, 2.0, 2.0];
        let drawn = |k: usize| {
            let opts = SampleOptions { temperature: 1.0, top_k: Some(k), ..Default::default() };
            let mut rng = Rng::new(7);
            (0..2000).map(|_| sample(&logits, &opts, &mut rng)).collect::<std::collections::BTreeSet<u32>>()
        };
        assert_eq!(drawn(1), [1].into());
        assert_eq!(drawn(2), [1, 3, 4].into(), "the tie with the 2nd likeliest stays");
        assert_eq!(drawn(0), [0, 1, 2, 3, 4].into());
    }
}
