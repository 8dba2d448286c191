//! What a run records as its steps finish, written by the lead rank into `output.dir`:
//!
//! - `metrics.jsonl`, one line per optimizer step: the run's record, and the source every
//!   other view is checked against;
//! - `tensorboard/` event files with the same numbers (`output.tensorboard = true`), for the
//!   dashboard users already run;
//! - `summary.json` when the run ends: data statistics, memory and the machine, which
//!   `finetune report` shows beside the curves.
//!
//! Nothing is written before the first step has run (input that fails early leaves no
//! folder). A resumed run keeps the lines and events up to its checkpoint's step and appends
//! from there, so both views read as one uninterrupted run, never with a step twice.

use crate::error::{Error, Result};
use crate::tensorboard::EventWriter;
use crate::train::StepMetrics;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The event folder inside `output.dir`.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// How the run ended and what it held, for `summary.json`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RunSummaryFile {
    pub data: crate::data::DataStats,
    /// The process's peak resident set (VmHWM), MB; none where /proc is not there.
    pub peak_rss_mb: Option<f64>,
    /// The lead rank's memory account, bytes per kind.
    pub memory: Option<serde_json::Value>,
    pub world_size: usize,
    /// The signal that stopped the run early, if one did.
    pub interrupted: Option<usize>,
    pub cpu: String,
    /// Which op versions and GEMM kernels the run used.
    #[serde(default)]
    pub kernels: String,
}

pub struct RunLog {
    out_dir: PathBuf,
    recipe_text: String,
    tensorboard: bool,
    metrics: Option<std::fs::File>,
    events: Option<EventWriter>,
}

impl RunLog {
    /// A log for `out_dir` that writes nothing until the first step (or a resume).
    pub fn new(out_dir: &Path, recipe_text: &str, tensorboard: bool) -> RunLog {
        RunLog { out_dir: out_dir.to_path_buf(), recipe_text: recipe_text.to_string(), tensorboard, metrics: None, events: None }
    }

    fn metrics_path(&self) -> PathBuf {
        self.out_dir.join("metrics.jsonl")
    }

    /// Continue a run resumed at `step`: keep the metrics lines (and events) of steps up to
    /// it and append after them.
    pub fn resume(&mut self, step: usize) -> Result<()> {
        let path = self.metrics_path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let kept: Vec<(&str, StepMetrics)> =
            text.lines().filter_map(|l| serde_json::from_str::<StepMetrics>(l).ok().map(|m| (l, m))).filter(|(_, m)| m.step <= step).collect();
        // The lines as they were written: parsing and printing them again can move a float by
        // an ulp (serde_json's default parser does not round-trip every f64).
        let lines: String = kept.iter().map(|(l, _)| format!("{l}\n")).collect();
        let kept: Vec<StepMetrics> = kept.into_iter().map(|(_, m)| m).collect();
        // Lines a crash took before they reached the disk (checkpoints sync them, see `sync`;
        // an older run or a lost disk cache may still lack some): said, not silently skipped.
        let have: std::collections::HashSet<usize> = kept.iter().map(|m| m.step).collect();
        let missing: Vec<usize> = (1..=step).filter(|s| !have.contains(s)).collect();
        if let (Some(first), Some(last)) = (missing.first(), missing.last()) {
            crate::note!(
                "warning: {} has no lines for {} of the steps {first}..={last} (a crash lost them before they reached the disk, or the checkpoint is another folder's); the run continues from step {step}",
                path.display(),
                missing.len()
            );
        }
        crate::fsutil::write_atomic(&path, lines.as_bytes())?;
        // What the run continues with (the keys a resume may change, such as max_steps).
        crate::fsutil::write_atomic(&self.out_dir.join("recipe.resolved.toml"), self.recipe_text.as_bytes())?;
        self.metrics = Some(std::fs::OpenOptions::new().append(true).open(&path).map_err(|e| Error::io(&path, e))?);
        if self.tensorboard {
            // Steps the kept events lack (TensorBoard was off for part of the run) are filled
            // in from their metrics lines, so the dashboard covers the whole run.
            let now = crate::tensorboard::now();
            let mut w = EventWriter::resume(&self.out_dir.join(TENSORBOARD_DIR), step as i64, now)?;
            let logged: std::collections::HashSet<i64> = crate::tensorboard::read_scalars(w.path())?.into_iter().map(|(s, ..)| s).collect();
            for m in kept.iter().filter(|m| !logged.contains(&(m.step as i64))) {
                w.scalars(m.step as i64, m.wall_time.unwrap_or(now), &scalars(m))?;
            }
            self.events = Some(w);
        }
        Ok(())
    }

    /// Record one finished step (creating the output folder with the resolved recipe on the
    /// first).
    pub fn append(&mut self, m: &StepMetrics) -> Result<()> {
        if self.metrics.is_none() {
            std::fs::create_dir_all(&self.out_dir).map_err(|e| Error::io(&self.out_dir, e))?;
            crate::fsutil::write_atomic(&self.out_dir.join("recipe.resolved.toml"), self.recipe_text.as_bytes())?;
            let path = self.metrics_path();
            self.metrics = Some(std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?);
        }
        let path = self.metrics_path();
        let line = serde_json::to_string(m).map_err(|e| Error::Train(e.to_string()))?;
        if let Some(f) = self.metrics.as_mut() {
            writeln!(f, "{line}").and_then(|_| f.flush()).map_err(|e| Error::io(&path, e))?;
        }
        if self.tensorboard {
            if self.events.is_none() {
                self.events = Some(EventWriter::create(&self.out_dir.join(TENSORBOARD_DIR), m.wall_time.unwrap_or_else(crate::tensorboard::now))?);
            }
            if let Some(w) = self.events.as_mut() {
                w.scalars(m.step as i64, m.wall_time.unwrap_or_else(crate::tensorboard::now), &scalars(m))?;
            }
        }
        Ok(())
    }

    /// Make the metrics lines written so far durable (before a checkpoint: a checkpoint that
    /// survives a crash then never has steps its metrics.jsonl lost).
    pub fn sync(&self) -> Result<()> {
        if let Some(f) = &self.metrics {
            f.sync_all().map_err(|e| Error::io(self.metrics_path(), e))?;
        }
        Ok(())
    }

    /// Make what was written durable, and write `summary.json` (atomically).
    pub fn finish(&mut self, summary: &RunSummaryFile) -> Result<()> {
        if let Some(f) = &self.metrics {
            f.sync_all().map_err(|e| Error::io(self.metrics_path(), e))?;
        }
        if let Some(w) = self.events.as_mut() {
            w.flush()?;
        }
        if self.metrics.is_some() {
            let text = serde_json::to_string_pretty(summary).map_err(|e| Error::Train(e.to_string()))?;
            crate::fsutil::write_atomic(&self.out_dir.join("summary.json"), text.as_bytes())?;
        }
        Ok(())
    }
}

/// The TensorBoard scalars of one step: the metrics line's numbers under the tags the
/// dashboards group by section.
/// A run's `recipe.resolved.toml`, as read back by `export --run` (the hub commit the base
/// was trained at, whether the base was quantised on load). Absent in a folder that is not a
/// run's (an adapter copied elsewhere); present but unreadable, it is an error.
pub fn read_resolved_recipe(run: &Path) -> Result<Option<toml::Table>> {
    let file = run.join("recipe.resolved.toml");
    match std::fs::read_to_string(&file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(&file, e)),
        Ok(t) => Ok(Some(t.parse::<toml::Table>().map_err(|e| Error::Recipe {
            file: file.display().to_string(),
            key: "(syntax)".into(),
            msg: format!("the run's record of its recipe is damaged: {}", e.message()),
        })?)),
    }
}

pub fn scalars(m: &StepMetrics) -> Vec<(&'static str, f64)> {
    let mut v = vec![("train/loss", m.loss), ("train/lr", m.lr), ("train/grad_norm", m.grad_norm), ("train/tokens_per_s", m.tokens_per_s)];
    if let Some(e) = m.eval_loss {
        v.push(("eval/loss", e));
    }
    if let Some(r) = m.rss_mb {
        v.push(("memory/rss_mb", r));
    }
    v
}

/// This process's resident set now (`VmRSS`) or at its peak (`VmHWM`), MB, from /proc.
pub fn resident_mb(peak: bool) -> Option<f64> {
    let key = if peak { "VmHWM:" } else { "VmRSS:" };
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Whether this x86 CPU has `feature` (as `is_x86_feature_detected!` names it); false elsewhere.
pub fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match feature {
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

/// The CPU's model name and the vector features the kernels choose by, for the record.
pub fn cpu_description() -> String {
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let mut feats = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        for (f, on) in [
            ("avx2", cpu_has("avx2")),
            ("avx512f", cpu_has("avx512f")),
            ("avx512bf16", crate::ops::cpu_bf16::avx512_bf16()),
            ("amx", crate::ops::cpu_bf16::amx_detect_and_enable()),
        ] {
            if on {
                feats.push(f);
            }
        }
    }
    format!("{name}, {} threads{}", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1), if feats.is_empty() { String::new() } else { format!(", {}", feats.join(" ")) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resuming keeps the lines of the steps before the checkpoint byte for byte. These two
    /// grad_norm values came back an ulp off when the lines were parsed and printed again (a
    /// GPU run's resume check caught it).
    #[test]
    fn resume_keeps_the_earlier_metrics_lines_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"step":1,"loss":5.799017989358236,"lr":0.0,"grad_norm":0.9129807718190871,"tokens":26,"tokens_per_s":551.0}"#,
            r#"{"step":2,"loss":5.918411974553709,"lr":0.001,"grad_norm":1.0686278257440787,"tokens":37,"tokens_per_s":2354.0}"#,
            r#"{"step":3,"loss":5.8812,"lr":0.00075,"grad_norm":1.096,"tokens":51,"tokens_per_s":2833.0}"#,
        ];
        std::fs::write(dir.path().join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
        let mut log = RunLog::new(dir.path(), "", false);
        log.resume(2).unwrap();
        let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(text, format!("{}\n{}\n", lines[0], lines[1]));
    }
}
