//! Frozen base weights: the provider interface model code reads them through
//! ([`WeightSource`], [`Frozen`]) and the dtype each tensor is kept in. Beside it: finding a
//! checkpoint (`model_dir`), reading safetensors (`files`), tables left in their file
//! (`row_table`), the plain sources (`resident`), quantized ones (`quantized`, `bnb`), the
//! ZeRO-3 window (`window`) and what a checkpoint holds that no layer reads (`unread`).
//!
//! Invariant: frozen weights are plain tensors, never `Var`s, so autograd never makes them a
//! leaf it owes a gradient to. Model code asks a [`WeightSource`] for tensors by HF name; the
//! resident source here holds the whole base, and the ZeRO-3 source (a later layer) gathers
//! shards just in time. Model code cannot tell the difference.

use crate::error::Result;
use candle_core::{DType, Device, Tensor};

pub mod bnb;
mod files;
mod model_dir;
pub mod quantized;
mod resident;
mod row_table;
mod unread;
pub mod window;

pub use files::*;
pub use model_dir::*;
pub use resident::*;
pub use row_table::*;
pub use unread::{note_unread, unread, Asked};
pub use window::{Held, Unit, Window};

/// Where frozen tensors come from. `get` returns the tensor named `name` (full HF key) with the
/// given shape in the compute dtype, or an error naming the tensor and the files searched.
pub trait WeightSource: Send + Sync {
    /// The tensor in the storage dtype (shape checked).
    fn get_stored(&self, name: &str, shape: &[usize]) -> Result<Tensor>;
    /// What `get` hands out: f32 on CPU, the storage dtype on GPUs.
    fn compute_dtype(&self) -> DType;
    /// Whether a tensor exists (for optional tensors such as a tied lm_head).
    fn contains(&self, name: &str) -> bool;
    /// Where `get` puts tensors (asking for a tensor just to learn this would convert it,
    /// or under ZeRO-3 gather it).
    fn device(&self) -> &Device;
    /// The dtype of frozen matmul operands (`get_matmul`): the compute dtype, unless the
    /// source was told to hand bf16 weights to `ops::frozen_linear` (a bf16 base on a CPU with a bf16 unit).
    fn matmul_dtype(&self) -> DType {
        self.compute_dtype()
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.to_dtype(self.compute_dtype())?)
    }
    /// A projection weight as the frozen matmul takes it.
    fn get_matmul(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.to_dtype(self.matmul_dtype())?)
    }
    /// Check that `name` exists with `shape` (`Model::load`), materialising it only where
    /// the source must (a resident base reads it; ZeRO-3 joins the gather every rank makes).
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.get_stored(name, shape).map(drop)
    }
    /// Check a table the model reads only by rows through [`embedding`](Self::embedding)
    /// (an untied token embedding). A resident base on the host leaves it in its file (see
    /// [`RowTable`]).
    fn check_rows(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.check(name, shape)
    }
    /// Check a table the model reads only in runs of rows through
    /// [`get_matmul_rows`](Self::get_matmul_rows) (an untied LM head, which the loss reads in
    /// chunks). A resident base told to (`ResidentWeights::with_head_in_file`) leaves it in its
    /// file.
    fn check_head(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.check(name, shape)
    }
    /// Bytes of the base (in the storage dtype) left in files by `check_rows` and
    /// `check_head`, not held.
    fn bytes_in_files(&self) -> usize {
        0
    }
    /// Rows start..start+len of `name` [V, H] as the frozen matmul takes them: the LM head,
    /// which the loss reads in chunks (`ops::loss`). Only those rows are converted.
    fn get_matmul_rows(&self, name: &str, shape: &[usize], start: usize, len: usize) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.narrow(0, start, len)?.to_dtype(self.matmul_dtype())?)
    }
    /// Rows `ids` [N] (u32) of the table `name` [V, H], as [N, H] in the compute dtype. Only
    /// the picked rows are converted: converting the whole table first cost a 113 MB copy
    /// per step (135M model).
    fn embedding(&self, name: &str, shape: &[usize], ids: &Tensor) -> Result<Tensor> {
        Ok(self.get_stored(name, shape)?.index_select(ids, 0)?.to_dtype(self.compute_dtype())?)
    }
    /// Called once the model has loaded (`Model::load` asks for every tensor it uses): drop
    /// what only loading needed (the memory map). Later requests for a tensor not asked for
    /// then are errors. Sources that read on every request keep everything.
    fn seal(&self) {}
}

/// A view of a [`WeightSource`] under a name prefix, like candle's `VarBuilder::pp`.
#[derive(Clone)]
pub struct Frozen<'a> {
    src: &'a dyn WeightSource,
    prefix: String,
}

impl<'a> Frozen<'a> {
    pub fn new(src: &'a dyn WeightSource) -> Self {
        Frozen { src, prefix: String::new() }
    }
    pub fn pp(&self, name: impl AsRef<str>) -> Self {
        let name = name.as_ref();
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Frozen { src: self.src, prefix }
    }
    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        self.src.get(&self.full(name), shape)
    }
    /// A projection weight for `ops::frozen_linear` (see [`WeightSource::get_matmul`]).
    pub fn get_matmul(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        self.src.get_matmul(&self.full(name), shape)
    }
    pub fn contains(&self, name: &str) -> bool {
        self.src.contains(&self.full(name))
    }
    /// A small tensor the model reads in f32 whatever the compute dtype (see [`stored_dtype`]).
    pub fn get_f32(&self, shape: &[usize], name: &str) -> Result<Tensor> {
        Ok(self.src.get_stored(&self.full(name), shape)?.to_dtype(DType::F32)?)
    }
}

/// The tables a resident base on the host would leave in their file (an untied embedding
/// and LM head) that the recipe's model files hold in a form read whole instead (FP8, f64):
/// those are copied at load, and `finetune plan` counts them so. Empty where the plan does not
/// look at weights (config.json alone, a GGUF file, a hub repo id).
pub fn tables_copied(loaded: &crate::recipe::LoadedRecipe) -> Vec<String> {
    let m = &loaded.recipe.model;
    let files = loaded.dir.join(&m.path).is_dir().then(|| ModelDir::resolve(&m.path, &loaded.dir).and_then(|d| d.open_weights()).ok()).flatten();
    let Some(files) = files else { return Vec::new() };
    let tables = ["model.embed_tokens.weight", "lm_head.weight"];
    tables.into_iter().filter(|n| files.file_of(n).is_some() && !files.rows_readable(n)).map(String::from).collect()
}

/// Bytes of the whole frozen base held in `storage` (each tensor in its [`stored_dtype`]).
pub fn frozen_bytes(cfg: &crate::config::ModelConfig, storage: DType) -> usize {
    cfg.frozen_tensors().iter().map(|(n, s)| s.iter().product::<usize>() * stored_dtype(n, storage).size_in_bytes()).sum()
}

/// The dtype a frozen tensor is kept in: the run's storage dtype, except the MoE router
/// (`mlp.gate.weight`) and DeepSeek-V3's router bias, which transformers keeps in f32 in a
/// 16-bit model (`_keep_in_fp32_modules_strict`): expert scores differ by less than bf16's
/// rounding of them, so rounding would change the choice. (The router runs in f32 whatever
/// the base dtype: held in bf16, its weights would be bf16 values.)
pub fn stored_dtype(name: &str, storage: DType) -> DType {
    if name.ends_with("e_score_correction_bias") || name.ends_with("mlp.gate.weight") {
        DType::F32
    } else {
        storage
    }
}

/// Parse a dtype name from the recipe.
pub fn parse_dtype(s: &str) -> DType {
    match s {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use std::collections::HashMap;
    use std::path::Path;

    fn table(rows: usize, cols: usize, dtype: DType, seed: f32) -> Tensor {
        let v: Vec<f32> = (0..rows * cols).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn rows_of(t: &Tensor, ids: &[u32]) -> Tensor {
        t.index_select(&Tensor::new(ids, &Device::Cpu).unwrap(), 0).unwrap()
    }

    #[test]
    fn unread_names_what_no_layer_asks_for_but_not_what_is_stored_beside_it() {
        let asked: std::collections::BTreeSet<String> =
            ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight"].iter().map(|s| s.to_string()).collect();
        let stored: Vec<String> = [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.weight_scale_inv",    // FP8 block scales
            "model.layers.0.self_attn.q_proj.weight.absmax",       // bitsandbytes' quant state
            "model.layers.0.self_attn.q_proj.SCB",                 // its 8-bit row scales
            "model.layers.0.self_attn.k_proj.SCB",                 // k_proj.weight was not asked
            "model.layers.0.self_attn.q_proj.bias",                // a bias the config left out
            "model.layers.0.self_attn.rotary_emb.inv_freq",        // an old buffer
            "model.layers.1.mlp.experts.1.up_proj.weight",
            "model.layers.1.mlp.experts.10.up_proj.weight",        // not experts.1's
            "model.layers.2.embed_tokens.weight",                  // V3's MTP layer (2 layers)
            "model.vision_tower.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            unread(stored.iter(), &asked, 2),
            ["model.layers.0.self_attn.k_proj.SCB", "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.experts.10.up_proj.weight", "model.vision_tower.weight"]
        );
    }

    #[test]
    fn stored_dtypes_are_read_from_the_headers_and_only_all_bf16_is_all_bf16() {
        let root = tempfile::tempdir().unwrap();
        use safetensors::Dtype as S;
        for (name, dtype, want) in [("m16", DType::F16, S::F16), ("mbf", DType::BF16, S::BF16), ("m32", DType::F32, S::F32)] {
            crate::synth::write_model(&root.path().join(name), &crate::synth::TinyShape { dtype, ..Default::default() }, 1, 1).unwrap();
            let got = stored_dtypes(name, None, root.path(), &|_| true).unwrap();
            assert_eq!(got.into_iter().collect::<Vec<_>>(), [want], "{name}");
            assert_eq!(stored_all_bf16(name, None, root.path()), want == S::BF16, "{name}");
        }
        assert_eq!(stored_dtypes("missing", None, root.path(), &|_| true), None);
    }

    #[test]
    fn a_row_table_reads_the_rows_a_copy_holds_in_every_float_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        // A small tensor first, so the tables do not start at data offset 0.
        let mut map = HashMap::from([("a.norm".to_string(), table(1, 3, DType::F32, 0.0).flatten_all().unwrap())]);
        for (name, dtype) in [("t.bf16", DType::BF16), ("t.f32", DType::F32), ("t.f16", DType::F16)] {
            map.insert(name.to_string(), table(7, 5, dtype, name.len() as f32));
        }
        candle_core::safetensors::save(&map, &path).unwrap();
        let files = SafetensorsFiles::open(&[path]).unwrap();
        let ids = [6u32, 0, 3, 3];
        for name in ["t.bf16", "t.f32", "t.f16"] {
            let t = files.row_table(name, &[7, 5]).unwrap().expect("a float matrix");
            let want = rows_of(&files.load(name, &[7, 5], &Device::Cpu).unwrap(), &ids);
            let got = t.read(&ids).unwrap();
            assert_eq!(got.dtype(), want.dtype(), "{name}");
            let diff = (got.to_dtype(DType::F32).unwrap() - want.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
            let err = t.read(&[7]).unwrap_err().to_string();
            assert!(err.contains("token id 7") && err.contains(name) && err.contains("7 rows"), "{err}");
        }
        assert!(matches!(files.row_table("t.bf16", &[7, 6]), Err(Error::Shape { .. })));
    }

    /// The resident source reads the embedding from its file after sealing, converted as its
    /// copy would have been: an f32 table in a bf16 run is rounded to bf16 first.
    #[test]
    fn a_resident_base_reads_embedding_rows_from_the_file_with_the_copys_rounding() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let emb = table(9, 4, DType::F32, 1.0);
        candle_core::safetensors::save(&HashMap::from([("model.embed_tokens.weight".to_string(), emb.clone())]), &path).unwrap();
        let src = ResidentWeights::new(SafetensorsFiles::open(&[path]).unwrap(), DType::BF16, DType::F32, Device::Cpu);
        src.check_rows("model.embed_tokens.weight", &[9, 4]).unwrap();
        src.seal();
        assert_eq!((src.resident_bytes(), src.bytes_in_files()), (0, 9 * 4 * 2), "the table is not copied, and counted as bf16 left in the file");
        let ids = Tensor::new(&[8u32, 2, 2], &Device::Cpu).unwrap();
        let got = src.embedding("model.embed_tokens.weight", &[9, 4], &ids).unwrap();
        let want = rows_of(&emb, &[8, 2, 2]).to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0);
    }

    /// Pages of `path` in the page cache, of those in bytes `from..to` (mincore on a map).
    #[cfg(target_os = "linux")]
    fn pages_cached(path: &Path, from: usize, to: usize) -> (usize, usize) {
        let file = std::fs::File::open(path).unwrap();
        // SAFETY: a read-only map of a file no one writes while the test runs.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let page = 4096;
        let mut v = vec![0u8; map.len().div_ceil(page)];
        // SAFETY: the map is live and `v` has a byte per page of it.
        assert_eq!(unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), v.as_mut_ptr()) }, 0);
        let pages = &v[from / page..to.div_ceil(page)];
        (pages.iter().filter(|&&b| b & 1 == 1).count(), pages.len())
    }

    /// An embedding left in its file is read into the page cache from a thread of its own, so
    /// a step's token rows are not each a blocking read from disk.
    #[test]
    #[cfg(target_os = "linux")]
    fn an_embedding_left_in_its_file_is_read_into_the_page_cache_ahead_of_its_rows() {
        use std::os::unix::io::AsRawFd;
        // Beside the test binary, in the build's folder: a disk's file system, where /tmp may
        // be tmpfs, which keeps every page and so could not show reading ahead.
        let beside_binary = std::env::current_exe().unwrap().parent().unwrap().to_path_buf();
        let dir = tempfile::tempdir_in(beside_binary).unwrap();
        let path = dir.path().join("model.safetensors");
        // 64 MB of bf16: more than the kernel reads around the map's first touch and the
        // check's reads of the first and last rows.
        let (rows, cols) = (32768, 1024);
        candle_core::safetensors::save(&HashMap::from([("model.embed_tokens.weight".to_string(), table(rows, cols, DType::BF16, 3.0))]), &path).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        // SAFETY: advice on a live fd.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        let (table_at, table_end) = (len - rows * cols * 2, len);
        let (cached, pages) = pages_cached(&path, table_at, table_end);
        assert!(cached <= 2, "the build folder's file system kept {cached} of {pages} pages after DONTNEED (tmpfs?), so reading ahead cannot be seen: build on a disk");
        let src = ResidentWeights::new(SafetensorsFiles::open(std::slice::from_ref(&path)).unwrap(), DType::BF16, DType::F32, Device::Cpu);
        src.check_rows("model.embed_tokens.weight", &[rows, cols]).unwrap();
        src.seal();
        let start = std::time::Instant::now();
        let mut seen = pages_cached(&path, table_at, table_end);
        while seen.0 < seen.1 && start.elapsed() < std::time::Duration::from_secs(20) {
            std::thread::sleep(std::time::Duration::from_millis(20));
            seen = pages_cached(&path, table_at, table_end);
        }
        // WILLNEED is advice, which a busy kernel may cut short: all of them here alone, 16345
        // of 16385 during the whole suite in CI (2026-11-29). Without it, 2.
        assert!(seen.0 * 100 >= seen.1 * 99, "{} of {} pages of the table in the page cache 20 s after it was left in its file", seen.0, seen.1);
    }

    /// A head left in its file hands the loss the rows a resident copy would (an f32 table
    /// in a bf16 run with bf16 matmuls: rounded to bf16), a run of rows per read, and reads
    /// whole when asked for whole; only a source told to leaves it there.
    #[test]
    fn a_resident_base_reads_head_row_chunks_from_the_file_as_its_copy_would() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let head = table(9, 4, DType::F32, 2.0);
        let map = HashMap::from([("a.norm".to_string(), table(1, 3, DType::F32, 0.0).flatten_all().unwrap()), ("lm_head.weight".to_string(), head.clone())]);
        candle_core::safetensors::save(&map, &path).unwrap();
        let open = |in_file: bool| {
            let src = ResidentWeights::new(SafetensorsFiles::open(std::slice::from_ref(&path)).unwrap(), DType::BF16, DType::F32, Device::Cpu);
            let src = src.with_matmul_dtype(DType::BF16).with_head_in_file(in_file);
            src.check_head("lm_head.weight", &[9, 4]).unwrap();
            src.seal();
            src
        };
        let (file, copy) = (open(true), open(false));
        assert_eq!((file.resident_bytes(), file.bytes_in_files()), (0, 9 * 4 * 2), "the head is not copied, and counted as bf16 left in the file");
        assert_eq!((copy.resident_bytes(), copy.bytes_in_files()), (9 * 4 * 2, 0), "not told to: held");
        let same = |a: Tensor, b: Tensor| {
            assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()));
            let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        };
        for (start, len) in [(0, 9), (2, 5), (8, 1)] {
            let got = file.get_matmul_rows("lm_head.weight", &[9, 4], start, len).unwrap();
            same(got.clone(), copy.get_matmul_rows("lm_head.weight", &[9, 4], start, len).unwrap());
            same(got, head.narrow(0, start, len).unwrap().to_dtype(DType::BF16).unwrap());
        }
        same(file.get_matmul("lm_head.weight", &[9, 4]).unwrap(), copy.get_matmul("lm_head.weight", &[9, 4]).unwrap());
        let err = file.get_matmul_rows("lm_head.weight", &[9, 4], 5, 5).unwrap_err().to_string();
        assert!(err.contains("rows 5..10") && err.contains("9 rows") && err.contains("lm_head.weight"), "{err}");
        assert!(matches!(file.get_matmul_rows("lm_head.weight", &[9, 5], 0, 1), Err(Error::Shape { .. })));
    }
}
