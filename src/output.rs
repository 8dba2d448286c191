//! The output folder belongs to one run at a time.
//!
//! - **One writer.** A run holds an exclusive `flock` on `<output.dir>/.finetune.lock` from
//!   setup until it returns (the merged export included). A second run on the same folder is
//!   refused at once, naming the folder and the holder's pid and host. The lock is the kernel's, tied to
//!   the open file: it dies with the process, so a SIGKILLed run never leaves the folder
//!   locked.
//! - **Runs kept apart.** Files of a run that is not being continued (`checkpoint.resume =
//!   "never"`, or checkpoints newer than the one resumed from) are moved into
//!   `<output.dir>/previous/<UTC time>/`, never deleted and never mixed with the new run's: a
//!   new run's checkpoints are then never pruned against an old run's step numbers, and a
//!   later `resume = "auto"` cannot pick up the old run.

use crate::error::{Error, Result};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

const LOCK: &str = ".finetune.lock";

/// What a previous run leaves in its output folder (besides `previous/` and the lock), and
/// whether each is a folder.
pub const RUN_FILES: &[(&str, bool)] = &[("checkpoints", true), ("metrics.jsonl", false), ("adapter", true), ("merged", true), ("recipe.resolved.toml", false), ("tensorboard", true), ("summary.json", false), ("report.html", false), ("loss.png", false), ("adapter.gguf", false)];

/// Of those, what a run writes once it has ended (beside its checkpoints, metrics and events):
/// set aside when the run goes on past that step.
pub const FINAL_OUTPUTS: &[&str] = &["adapter", "merged", "adapter.gguf", "summary.json", "report.html", "loss.png"];

/// The exclusive right to write an output folder, held until dropped.
#[derive(Debug)]
pub struct RunLock {
    /// Held open for its lock; never read.
    _file: std::fs::File,
    dir: PathBuf,
    /// This run created the folder: if it ends having written nothing else, it is removed
    /// again, so input that fails during setup leaves nothing behind.
    created: bool,
}

impl RunLock {
    /// Take the folder (creating it if needed), or say who holds it; the error names
    /// `recipe_file` and its key `output.dir`.
    pub fn acquire(dir: &Path, recipe_file: &str) -> Result<RunLock> {
        let created = !dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let path = dir.join(LOCK);
        // A run that gave its folder up may unlink the lock file between our open and our
        // flock; a lock on an unlinked file protects nothing, so check we locked the file
        // the path names, and retry otherwise.
        let (mut own_waits, mut replaced) = (0, 0);
        loop {
            let mut file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| Error::io(&path, e))?;
            if !try_flock(&file).map_err(|e| Error::io(&path, e))? {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                // Held under this process's own pid: a lock this process has just released
                // whose open file a child being spawned by another thread still shares,
                // between its fork and its exec (close-on-exec ends that). Wait that out.
                if holder.starts_with(&format!("pid {} on {},", std::process::id(), crate::fsutil::hostname())) && own_waits < 60 {
                    own_waits += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
                let holder = if holder.is_empty() { "another process".to_string() } else { holder.to_string() };
                return Err(Error::Recipe {
                    file: recipe_file.to_string(),
                    key: "output.dir".into(),
                    msg: format!(
                        "{} is in use by another finetune run ({holder}); one run writes a folder at a time: \
                         wait for it to end, or set output.dir to another folder",
                        dir.display()
                    ),
                });
            }
            if !same_file(&file, &path) {
                replaced += 1;
                if replaced == 8 {
                    return Err(Error::io(&path, std::io::Error::other("the lock file kept being replaced while locking it")));
                }
                continue;
            }
            // The host names the pid's machine or container (its pid namespace).
            let me = format!("pid {} on {}, started {}", std::process::id(), crate::fsutil::hostname(), utc_stamp(std::time::SystemTime::now(), " ", ":"));
            file.set_len(0).and_then(|_| file.rewind()).and_then(|_| file.write_all(me.as_bytes())).map_err(|e| Error::io(&path, e))?;
            return Ok(RunLock { _file: file, dir: dir.to_path_buf(), created });
        }
    }
}

/// The exclusive right to stage one export output (`out`'s `.NAME.tmp` beside it), held until
/// dropped: two writers of one output (two `finetune export`s, or an export and a run's own
/// end-of-run merge) would share that staging folder, and one of them exited 0 over a folder
/// the other had half replaced. The lock file is `.NAME.lock` beside it.
pub struct StagingLock {
    file: std::fs::File,
    path: PathBuf,
}

impl Drop for StagingLock {
    /// Unlinked while still locked, so nothing is left beside the output: a writer that
    /// opened the old file meanwhile finds it replaced (`acquire` checks) and retries.
    fn drop(&mut self) {
        if same_file(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl StagingLock {
    /// Take it, or say the output is being written.
    pub fn acquire(out: &Path) -> Result<StagingLock> {
        let path = staging_lock_path(out);
        for _ in 0..8 {
            let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| Error::io(&path, e))?;
            if !try_flock(&file).map_err(|e| Error::io(&path, e))? {
                return Err(Error::io(out, std::io::Error::other("is being written by another finetune process (an export or a run's end-of-run merge): wait for it to end")));
            }
            // Locked the file the path names (not one a finishing writer just unlinked)?
            if same_file(&file, &path) {
                return Ok(StagingLock { file, path });
            }
        }
        Err(Error::io(&path, std::io::Error::other("the lock file kept being replaced while locking it")))
    }

    /// Whether a writer holds `out`'s staging now (a run's cleanup leaves its staging alone).
    pub fn held(out: &Path) -> bool {
        let path = staging_lock_path(out);
        let Ok(file) = std::fs::OpenOptions::new().read(true).open(&path) else { return false };
        matches!(try_flock(&file), Ok(false))
    }
}

fn staging_lock_path(out: &Path) -> PathBuf {
    beside(out, "lock")
}

/// `.NAME.EXT` beside `out` (NAME its file name): where an output is staged (`tmp`, by
/// `export::staged`, and cleaned up by `checkpoint::clean_temporaries`) and locked (`lock`).
pub fn beside(out: &Path, ext: &str) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.{ext}"))
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if !self.created {
            return;
        }
        let only_lock = std::fs::read_dir(&self.dir).map(|d| d.flatten().all(|e| e.file_name() == LOCK)).unwrap_or(false);
        if only_lock {
            // Unlinked while still locked: a run waiting on it re-checks and retries.
            let _ = std::fs::remove_file(self.dir.join(LOCK));
            let _ = std::fs::remove_dir(&self.dir);
        }
        // `_file` closes after this, releasing the lock.
    }
}

/// `flock(LOCK_EX | LOCK_NB)`: Ok(false) when another open file holds it.
pub(crate) fn try_flock(file: &std::fs::File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

pub(crate) fn same_file(file: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Move `names` (relative to `out_dir`, those that exist) into a new
/// `<out_dir>/previous/<UTC time>/`, after copying `copies` there (files the run goes on
/// writing, such as metrics.jsonl, whose lines the new run replaces); returns that folder, or
/// None when there was nothing to move. The copies come first: a set-aside cut short (a kill
/// between two moves) leaves the rest in place to be set aside again by the rerun, but a copy
/// made after the moves would be made by no one, since the rerun finds nothing left to move.
pub fn set_aside(out_dir: &Path, names: &[PathBuf], copies: &[&str]) -> Result<Option<PathBuf>> {
    set_aside_by(out_dir, names, copies, &mut |from, to| crate::fsutil::rename_durable(from, to))
}

/// [`set_aside`] with the move given (a test makes it fail part way).
fn set_aside_by(out_dir: &Path, names: &[PathBuf], copies: &[&str], mv: &mut dyn FnMut(&Path, &Path) -> Result<()>) -> Result<Option<PathBuf>> {
    let present: Vec<&PathBuf> = names.iter().filter(|n| out_dir.join(n).symlink_metadata().is_ok()).collect();
    if present.is_empty() {
        return Ok(None);
    }
    let stamp = utc_stamp(std::time::SystemTime::now(), "-", "");
    let base = out_dir.join("previous");
    let mut dest = base.join(&stamp);
    let mut k = 1;
    while dest.exists() {
        k += 1;
        dest = base.join(format!("{stamp}-{k}"));
    }
    std::fs::create_dir_all(&dest).map_err(|e| Error::io(&dest, e))?;
    for name in copies.iter().filter(|n| out_dir.join(n).is_file()) {
        let (from, to) = (out_dir.join(name), dest.join(name));
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        crate::fsutil::write_with(&to, |w| std::fs::File::open(&from).and_then(|mut f| std::io::copy(&mut f, w)).map(|_| ()).map_err(|e| Error::io(&from, e)))?;
    }
    for rel in present {
        let to = dest.join(rel);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        mv(&out_dir.join(rel), &to)?;
    }
    Ok(Some(dest))
}

/// What of a previous run `out_dir` holds (the `RUN_FILES` present). Something else under
/// one of those names (a file called `checkpoints`) is not a run's and stays where it is.
pub fn previous_run_files(out_dir: &Path) -> Vec<PathBuf> {
    RUN_FILES
        .iter()
        .filter(|(n, dir)| out_dir.join(n).symlink_metadata().is_ok_and(|m| m.is_dir() == *dir))
        .map(|(n, _)| PathBuf::from(n))
        .collect()
}

/// (year, month 1-12, day 1-31) of the day `days` after 1970-01-01 (Howard Hinnant's
/// algorithm), without a date crate.
pub fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `YYYYMMDD<sep>HHMMSS` in UTC (with `tsep` between the time fields), without a date crate.
fn utc_stamp(t: std::time::SystemTime, sep: &str, tsep: &str) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_date(days as i64);
    let date = if sep == "-" { format!("{y:04}{m:02}{d:02}") } else { format!("{y:04}-{m:02}-{d:02}") };
    format!("{date}{sep}{:02}{tsep}{:02}{tsep}{:02}{}", rem / 3600, rem % 3600 / 60, rem % 60, if sep == "-" { "" } else { " UTC" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_stamps_read_as_calendar_time() {
        let t = |s: u64| std::time::UNIX_EPOCH + std::time::Duration::from_secs(s);
        assert_eq!(utc_stamp(t(0), "-", ""), "19700101-000000");
        // 2000-02-29 12:34:56 UTC (a leap day) and 2026-11-23 10:00:00 UTC.
        assert_eq!(utc_stamp(t(951_827_696), "-", ""), "20000229-123456");
        assert_eq!(utc_stamp(t(1_795_428_000), " ", ":"), "2026-11-23 10:00:00 UTC");
    }

    #[test]
    fn a_second_lock_on_a_folder_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let first = RunLock::acquire(&out, "r.toml").unwrap();
        let e = RunLock::acquire(&out, "r.toml").unwrap_err().to_string();
        assert!(e.contains("output.dir") && e.contains(&format!("pid {} on {}", std::process::id(), crate::fsutil::hostname())) && e.contains("run"), "{e}");
        drop(first);
        // Released and, since the folder held nothing else, removed.
        assert!(!out.exists());
        let again = RunLock::acquire(&out, "r.toml").unwrap();
        std::fs::write(out.join("metrics.jsonl"), "{}\n").unwrap();
        drop(again);
        assert!(out.join("metrics.jsonl").exists(), "a folder with output is kept");
    }

    #[test]
    fn setting_aside_moves_files_under_previous() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        std::fs::create_dir_all(out.join("checkpoints/step-000002")).unwrap();
        std::fs::write(out.join("metrics.jsonl"), "x\n").unwrap();
        let moved = set_aside(out, &previous_run_files(out), &[]).unwrap().unwrap();
        assert!(moved.starts_with(out.join("previous")));
        assert!(moved.join("checkpoints/step-000002").is_dir() && moved.join("metrics.jsonl").is_file());
        assert!(previous_run_files(out).is_empty());
        assert_eq!(set_aside(out, &previous_run_files(out), &[]).unwrap(), None);
    }

    #[test]
    fn a_set_aside_cut_short_has_already_copied_what_the_new_run_will_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path();
        for s in ["checkpoints/step-000018", "checkpoints/step-000020", "adapter"] {
            std::fs::create_dir_all(out.join(s)).unwrap();
        }
        std::fs::write(out.join("metrics.jsonl"), "16\n18\n20\n").unwrap();
        let names: Vec<PathBuf> = ["adapter", "checkpoints/step-000018", "checkpoints/step-000020"].iter().map(PathBuf::from).collect();
        // The second move fails, as a kill there would stop it.
        let mut moves = 0;
        let mut mv = |from: &Path, to: &Path| {
            moves += 1;
            if moves == 2 {
                return Err(Error::io(to, std::io::Error::other("killed")));
            }
            std::fs::rename(from, to).map_err(|e| Error::io(to, e))
        };
        assert!(set_aside_by(out, &names, &["metrics.jsonl"], &mut mv).is_err());
        let dest = std::fs::read_dir(out.join("previous")).unwrap().next().unwrap().unwrap().path();
        assert_eq!(std::fs::read_to_string(dest.join("metrics.jsonl")).unwrap(), "16\n18\n20\n", "the copy was made before the moves");
        assert!(dest.join("adapter").is_dir() && !out.join("adapter").exists());
        assert!(out.join("checkpoints/step-000018").is_dir() && out.join("metrics.jsonl").is_file());
        assert!(!dest.join(".metrics.jsonl.tmp").exists());
    }
}
