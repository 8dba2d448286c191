//! Seeded mutation fuzzing of every file a user hands us, through the real entry points, in
//! the normal suite (no nightly toolchain, no extra crates): thousands of mutations each of a
//! recipe, a safetensors model, an Arrow IPC dataset, a JSONL dataset, a GGUF file and an
//! adapter_config.json. For every case: no panic, no abort, no single allocation over
//! `ALLOC_LIMIT`, and an error, when there is one, names the file it is about.
//!
//! A failure prints the format, the seed and the error; rerun one case with
//! `FUZZ_ONLY=<format>:<seed> cargo test --release --test fuzz -- --nocapture`.

mod common;
use common::*;
use finetune::rng::Rng;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};

/// No input this small may make us ask for more than this in one allocation.
const ALLOC_LIMIT: usize = 1 << 30;

/// Refuses (and reports) any single allocation over `ALLOC_LIMIT`. Refusing makes Rust abort
/// the process, which fails the test binary loudly; the message says which case did it.
struct Bounded;

thread_local! {
    /// The format and seed this thread is running (const-initialised: readable from the
    /// allocator without allocating).
    static CASE: std::cell::Cell<(&'static str, u64)> = const { std::cell::Cell::new(("", 0)) };
}

unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            report_big_alloc(layout.size());
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            report_big_alloc(layout.size());
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_LIMIT {
            report_big_alloc(new_size);
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Bounded = Bounded;

/// Write "allocation of N bytes in case C" to stderr without allocating.
fn report_big_alloc(size: usize) {
    let mut buf = [0u8; 96];
    let mut n = 0;
    let mut put = |s: &[u8]| {
        for &b in s {
            if n < buf.len() {
                buf[n] = b;
                n += 1;
            }
        }
    };
    let num = |mut v: usize, out: &mut dyn FnMut(&[u8])| {
        let mut d = [0u8; 20];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        out(&d[i..]);
    };
    put(b"\nfuzz: refused an allocation of ");
    num(size, &mut put);
    put(b" bytes in case ");
    let (format, seed) = CASE.with(|c| c.get());
    put(format.as_bytes());
    put(b":");
    num(seed as usize, &mut put);
    put(b"\n");
    // SAFETY: writing a stack buffer to fd 2.
    unsafe { libc::write(2, buf.as_ptr().cast(), n) };
}

// ------------------------------------------------------------------ mutations

/// One random edit of `data`: flip, overwrite with a boundary value, insert, delete,
/// duplicate or truncate. Text inputs also get number and token edits.
fn mutate(rng: &mut Rng, data: &mut Vec<u8>, focus: std::ops::Range<usize>) {
    let pick = |rng: &mut Rng, len: usize| if len == 0 { 0 } else { rng.below(len as u64) as usize };
    let in_focus = |rng: &mut Rng, data: &Vec<u8>| {
        let end = focus.end.min(data.len());
        let start = focus.start.min(end);
        start + pick(rng, end - start)
    };
    const BOUNDARY: &[u64] = &[0, 1, 2, 0x7f, 0x80, 0xff, 0x7fff, 0xffff, 0x7fff_ffff, 0xffff_ffff, u64::MAX, u64::MAX / 2, 1 << 40];
    match rng.below(9) {
        0 | 1 => {
            let i = in_focus(rng, data);
            if i < data.len() {
                data[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            // A little-endian boundary value over 1, 2, 4 or 8 bytes.
            let v = BOUNDARY[pick(rng, BOUNDARY.len())];
            let w = 1 << rng.below(4);
            let i = in_focus(rng, data);
            for k in 0..w {
                if i + k < data.len() {
                    data[i + k] = (v >> (8 * k)) as u8;
                }
            }
        }
        3 => {
            let i = in_focus(rng, data);
            let n = 1 + pick(rng, 16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
            data.splice(i..i, bytes);
        }
        4 => {
            let i = in_focus(rng, data);
            let n = (1 + pick(rng, 32)).min(data.len() - i.min(data.len()));
            data.drain(i..i + n);
        }
        5 => {
            let i = in_focus(rng, data);
            let n = (1 + pick(rng, 64)).min(data.len() - i.min(data.len()));
            let copy = data[i..i + n].to_vec();
            let j = in_focus(rng, data);
            data.splice(j..j, copy);
        }
        6 => {
            let i = in_focus(rng, data);
            data.truncate(i);
        }
        7 => {
            // Replace a run of ASCII digits with a boundary number (text formats).
            let i = in_focus(rng, data);
            if let Some(s) = (i..data.len()).find(|&k| data[k].is_ascii_digit()) {
                let e = (s..data.len()).find(|&k| !data[k].is_ascii_digit()).unwrap_or(data.len());
                let words: &[&[u8]] = &[b"0", b"-1", b"1e308", b"nan", b"inf", b"99999999999999999999", b"4294967296", b"18446744073709551615", b"1e-320"];
                data.splice(s..e, words[pick(rng, words.len())].iter().copied());
            }
        }
        _ => {
            // Swap in a token that means something to one of our parsers.
            let words: &[&[u8]] = &[b"\"", b"{", b"}", b"[", b"]", b"\n", b"\xef\xbb\xbf", b"\xff\xfe", b"\\u0000", b"null", b"=", b",", b"\x00"];
            let i = in_focus(rng, data);
            data.splice(i..i, words[pick(rng, words.len())].iter().copied());
        }
    }
}

/// Up to three mutations.
fn mutated(seed: u64, original: &[u8], focus: std::ops::Range<usize>) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut data = original.to_vec();
    for _ in 0..1 + rng.below(3) {
        mutate(&mut rng, &mut data, focus.clone());
    }
    data
}

// ------------------------------------------------------------------ the harness

struct Finding {
    format: &'static str,
    seed: u64,
    what: String,
}

/// Every format `fuzz` runs (what `FUZZ_ONLY` may name).
const FORMATS: [&str; 6] = ["recipe", "safetensors", "adapter_config", "arrow", "jsonl", "gguf"];

/// The seeds of `format` to run, and whether `FUZZ_ONLY` chose them: all `cases` where it is
/// unset; else it must name a format of [`FORMATS`], optionally `:seed` under that format's
/// `cases` (a name that matches no case would run none and pass having checked nothing).
/// Parsed, so `jsonl:03` is seed 3.
fn seeds(format: &str, cases: u64) -> Result<(std::ops::Range<u64>, bool), String> {
    let Ok(only) = std::env::var("FUZZ_ONLY") else { return Ok((0..cases, false)) };
    let (f, seed) = match only.split_once(':') {
        Some((f, s)) => (f, Some(s.parse::<u64>().map_err(|_| format!("FUZZ_ONLY={only}: the seed after ':' must be a number"))?)),
        None => (only.as_str(), None),
    };
    if !FORMATS.contains(&f) {
        return Err(format!("FUZZ_ONLY={only}: no format {f:?}; the formats are {FORMATS:?}"));
    }
    match seed {
        _ if f != format => Ok((0..0, true)),
        None => Ok((0..cases, true)),
        Some(seed) if seed < cases => Ok((seed..seed + 1, true)),
        Some(_) => Err(format!("FUZZ_ONLY={only}: {format} runs seeds 0 to {}", cases - 1)),
    }
}

/// Run `cases` mutations of `format` through `run` (which returns the error text, if any).
/// Each error must contain `names` (the file's name).
fn fuzz(format: &'static str, cases: u64, names: &str, findings: &mut Vec<Finding>, mut run: impl FnMut(u64) -> Option<String>) {
    let checked = if FORMATS.contains(&format) { seeds(format, cases) } else { Err(format!("fuzz: add {format:?} to FORMATS")) };
    // Said on stderr too: `quiet_panics` silences the panic's own message.
    let (seeds, only) = checked.unwrap_or_else(|e| {
        eprintln!("{e}");
        panic!("{e}")
    });
    let (mut errors, mut oks) = (0, 0);
    for seed in seeds {
        CASE.with(|c| c.set((format, seed)));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(seed)));
        match result {
            Err(p) => {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                findings.push(Finding { format, seed, what: format!("panicked: {msg}") });
            }
            Ok(Some(e)) => {
                errors += 1;
                if only {
                    println!("{format}:{seed}: {e}");
                }
                if !e.contains(names) {
                    findings.push(Finding { format, seed, what: format!("error does not name {names}: {e}") });
                }
            }
            Ok(None) => oks += 1,
        }
    }
    println!("{format}: {errors} errors, {oks} accepted");
}

fn report(findings: Vec<Finding>) {
    let n = findings.len();
    for f in findings.iter().take(30) {
        eprintln!("{}:{}: {}", f.format, f.seed, f.what);
    }
    assert_eq!(n, 0, "{n} finding(s); rerun one with FUZZ_ONLY=<format>:<seed>");
}

/// Panics from the cases are findings, not noise on stderr.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|_| {}));
}

fn err_text<T>(r: finetune::Result<T>) -> Option<String> {
    r.err().map(|e| {
        // As main prints it: the error and its chain.
        let mut s = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(c) = src {
            s.push_str(&format!(": {c}"));
            src = c.source();
        }
        s
    })
}

const RECIPE: &str = r#"
[model]
path = "model"
dtype = "f32"
[lora]
rank = 4
alpha = 8
dropout = 0.1
targets = ["q_proj", "v_proj"]
[data]
train = "data"
format = "tokenized"
max_seq_len = 32
shuffle = true
shuffle_buffer = 16
packing = true
[train]
max_steps = 4
micro_batch_size = 2
grad_accum_steps = 2
lr = 1e-3
lr_scheduler = "cosine"
warmup_steps = 1
max_grad_norm = 1.0
[checkpoint]
every_steps = 2
keep_last = 2
[output]
dir = "out"
[dist]
world_size = 1
"#;

// ------------------------------------------------------------------ the tests

#[test]
fn mutated_recipes_are_loaded_or_refused_naming_the_recipe() {
    quiet_panics();
    let mut findings = Vec::new();
    fuzz("recipe", 4000, "fuzz-recipe.toml", &mut findings, |seed| {
        let text = mutated(seed, RECIPE.as_bytes(), 0..RECIPE.len());
        let text = String::from_utf8_lossy(&text);
        err_text(finetune::recipe::LoadedRecipe::from_str(&text, Path::new("fuzz-recipe.toml"), Path::new("."), &[]))
    });
    report(findings);
}

/// A workspace with the tiny model (and a tokenizer) and a tokenized dataset.
fn workspace() -> tempfile::TempDir {
    let ws = tiny_workspace(12, (4, 18), Some(RECIPE));
    finetune::synth::write_tokenizer(&ws.path().join("model"), 256).unwrap();
    ws
}

/// The model loaded as training and generation load it: config, weights, every tensor.
fn load_model(model: &Path) -> finetune::Result<()> {
    let dir = finetune::weights::ModelDir::resolve(model.to_str().unwrap_or_default(), Path::new("."))?;
    finetune::generate::Generator::load(&dir, None).map(|_| ())
}

#[test]
fn mutated_safetensors_models_load_or_are_refused_naming_the_file() {
    quiet_panics();
    let ws = workspace();
    let model = ws.path().join("model");
    let file = model.join("model.safetensors");
    let original = std::fs::read(&file).unwrap();
    let header = 8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let mut findings = Vec::new();
    fuzz("safetensors", 1500, "model.safetensors", &mut findings, |seed| {
        // Mostly the header (where a parser can be fooled), sometimes anywhere.
        let focus = if seed % 4 == 0 { 0..original.len() } else { 0..header };
        std::fs::write(&file, mutated(seed, &original, focus)).unwrap();
        err_text(load_model(&model))
    });
    report(findings);
}

#[test]
fn mutated_adapter_configs_load_or_are_refused_naming_the_adapter() {
    quiet_panics();
    let ws = workspace();
    let dir = run_dir(ws.path(), "run", &RECIPE.replace("\"model\"", "\"../model\"").replace("\"data\"", "\"../data\""));
    finetune::train::run(&finetune::recipe::LoadedRecipe::load(&dir.join("recipe.toml"), &["train.max_steps=1".into()]).unwrap()).unwrap();
    let adapter = dir.join("out/adapter");
    let cfg_path = adapter.join("adapter_config.json");
    let original = std::fs::read(&cfg_path).unwrap();
    let cfg = finetune::config::ModelConfig::from_file(&ws.path().join("model/config.json")).unwrap();
    let mut findings = Vec::new();
    let names = adapter.display().to_string();
    fuzz("adapter_config", 3000, &names, &mut findings, |seed| {
        std::fs::write(&cfg_path, mutated(seed, &original, 0..original.len())).unwrap();
        // The export reader and the training loader, which must agree.
        let a = finetune::export::PeftAdapter::open(&adapter);
        match a {
            Ok(a) => err_text(a.load(&cfg)),
            Err(e) => err_text::<()>(Err(e)),
        }
    });
    report(findings);
}

/// The loader of `recipe.toml` in `ws` with `overrides`, reading up to 40 examples.
fn read_examples(ws: &Path, overrides: &[String]) -> finetune::Result<()> {
    let loaded = finetune::recipe::LoadedRecipe::load(&ws.join("recipe.toml"), overrides)?;
    let model = finetune::weights::ModelDir::resolve(&loaded.recipe.model.path, &loaded.dir)?;
    let mut l = finetune::train::open_loader(&loaded, &model, 256, finetune::data::Role::Train)?;
    for _ in 0..40 {
        l.next_example()?;
    }
    Ok(())
}

fn arrow_file(data: &Path) -> PathBuf {
    std::fs::read_dir(data).unwrap().flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == "arrow")).unwrap()
}

#[test]
fn mutated_arrow_datasets_stream_or_are_refused_naming_the_file() {
    quiet_panics();
    let ws = workspace();
    let file = arrow_file(&ws.path().join("data"));
    let name = file.file_name().unwrap().to_string_lossy().to_string();
    let original = std::fs::read(&file).unwrap();
    let mut findings = Vec::new();
    fuzz("arrow", 1500, &name, &mut findings, |seed| {
        std::fs::write(&file, mutated(seed, &original, 0..original.len())).unwrap();
        let skip = if seed % 3 == 0 { vec!["data.on_bad_record=skip".to_string()] } else { vec![] };
        err_text(read_examples(ws.path(), &skip))
    });
    report(findings);
}

const JSONL: &str = concat!(
    "{\"instruction\": \"Add the numbers\", \"input\": \"2 and 3\", \"output\": \"5\"}\n",
    "{\"instruction\": \"Name a colour\", \"input\": \"\", \"output\": \"blue\"}\n",
    "{\"instruction\": \"Reverse\", \"input\": \"abc\", \"output\": \"cba\"}\n",
    "{\"instruction\": \"Say hi\", \"output\": \"hi\"}\n",
);

#[test]
fn mutated_jsonl_datasets_stream_or_are_refused_naming_the_file() {
    quiet_panics();
    let ws = workspace();
    let file = ws.path().join("fuzz.jsonl");
    let mut findings = Vec::new();
    let base = ["data.train=fuzz.jsonl".to_string(), "data.format=alpaca".to_string()];
    fuzz("jsonl", 2000, "fuzz.jsonl", &mut findings, |seed| {
        std::fs::write(&file, mutated(seed, JSONL.as_bytes(), 0..JSONL.len())).unwrap();
        let mut o = base.to_vec();
        if seed % 3 == 0 {
            o.push("data.on_bad_record=skip".into());
        }
        err_text(read_examples(ws.path(), &o))
    });
    report(findings);
}

#[test]
fn mutated_gguf_files_import_or_are_refused_naming_the_file() {
    use candle_core::quantized::GgmlDType;
    quiet_panics();
    let ws = tempfile::tempdir().unwrap();
    let shape = common::gguf::shape();
    finetune::synth::write_model(&ws.path().join("hf"), &shape, 11, 1).unwrap();
    let gguf = ws.path().join("fuzz.gguf");
    common::gguf::write_gguf(&ws.path().join("hf"), &shape, GgmlDType::F32, &gguf);
    let original = std::fs::read(&gguf).unwrap();
    let header = finetune::gguf::read_header(&gguf).unwrap().1.tensor_data_offset as usize;
    let out = ws.path().join("imported");
    let mut findings = Vec::new();
    fuzz("gguf", 1500, "fuzz.gguf", &mut findings, |seed| {
        let focus = if seed % 5 == 0 { 0..original.len() } else { 0..header };
        std::fs::write(&gguf, mutated(seed, &original, focus)).unwrap();
        let r = finetune::gguf::import(&gguf, &out, Some(candle_core::DType::F32), 5_000_000_000);
        let failed = r.is_err();
        let e = err_text(r);
        if failed && out.exists() {
            return Some(format!("fuzz.gguf: a failed import left {}", out.display()));
        }
        let _ = std::fs::remove_dir_all(&out);
        e
    });
    report(findings);
}
