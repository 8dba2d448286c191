//! Durable file writes: write to a temporary sibling, fsync, rename, fsync the folder. A
//! reader (or a crash) sees the old file or the new one, never half of one.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |f| f.write_all(bytes).map_err(|e| Error::io(path, e)))
}

/// Write `path` through `fill` (a seekable writer on a temporary sibling), durably: `path`
/// appears whole or not at all, and a failed `fill` leaves nothing behind.
pub fn write_with(path: &Path, fill: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<()>) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let written = (|| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?);
        fill(&mut f)?;
        let f = f.into_inner().map_err(|e| Error::io(&tmp, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))
    })();
    // A failed rename (a folder at `path`) leaves no temporary behind either.
    let done = written.and_then(|_| rename_durable(&tmp, path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// `<prefix><owner>-<pid>`: the start of a staging folder's name that [`sweep_stale_staging`]
/// can tell is this process's. `owner` stands for this host and pid namespace, since a pid
/// is only meaningful there (another container or NFS client writing the same folder may
/// run under the same number).
pub fn staging_name(prefix: &str) -> String {
    format!("{prefix}{}-{}", staging_owner(), std::process::id())
}

/// A hash of the hostname and the pid namespace's inode (16 hex digits).
fn staging_owner() -> String {
    use std::os::unix::fs::MetadataExt;
    let ns = std::fs::metadata("/proc/self/ns/pid").map(|m| m.ino()).unwrap_or(0);
    // FNV-1a: stable across runs and builds (std's hasher is not promised to be).
    let h = format!("{}\n{ns}", hostname()).bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    format!("{h:016x}")
}

/// Remove the staging folders in `parent` named by [`staging_name`] for `prefix` whose process
/// is gone: what a writer killed before it could clean up left (a signal, `kill -9`, a full
/// disk that stopped the cleanup). Only folders of this host and pid namespace are judged;
/// those of live processes (another export to the same folder) stay.
pub fn sweep_stale_staging(parent: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    let mine = format!("{prefix}{}-", staging_owner());
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(&mine) else { continue };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let Ok(pid) = digits.parse::<i32>() else { continue };
        if pid as u32 != std::process::id() && !process_alive(pid) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// This host's name, made safe for a file name (other characters as `_`; "localhost" when
/// it has none). A container's is its own, which tells processes of two containers apart.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name: String = if rc == 0 { String::from_utf8_lossy(&buf[..end]).into() } else { String::new() };
    let name: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// Whether process `pid` exists (it may belong to another user).
fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// fsync `tmp` (a file or a folder), rename it over `dst`, fsync the folder. An error of that
/// last fsync says that `dst` is in place all the same.
pub fn rename_durable(tmp: &Path, dst: &Path) -> Result<()> {
    sync_staged(tmp)?;
    std::fs::rename(tmp, dst).map_err(|e| Error::io(dst, e))?;
    match dst.parent() {
        Some(parent) => sync_dir(parent).map_err(|e| placed_but(dst, e)),
        None => Ok(()),
    }
}

/// fsync what was staged at `tmp`: a file (any error is one), or a folder (as [`sync_dir`]).
fn sync_staged(tmp: &Path) -> Result<()> {
    if tmp.is_dir() {
        return sync_dir(tmp);
    }
    std::fs::File::open(tmp).and_then(|f| f.sync_all()).map_err(|e| Error::io(tmp, e))
}

/// The error of a folder's fsync after `dst` was renamed into it, saying `dst` is there.
pub fn placed_but(dst: &Path, e: Error) -> Error {
    match e {
        Error::Io { path, source } => {
            let msg = format!("{} is in place, but this folder's fsync after it failed, so it may not survive a crash: {source}", dst.display());
            Error::Io { path, source: std::io::Error::new(source.kind(), msg) }
        }
        other => other,
    }
}

/// fsync the folder `dir`, which makes the renames and creations in it durable. A filesystem
/// that cannot fsync a folder (it answers EINVAL, ENOTSUP or ENOSYS: some network and FUSE
/// ones) keeps them as durable as it can, so that is not an error; any other (EIO) is, since
/// what was renamed there may be lost at the next crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let Ok(d) = std::fs::File::open(dir) else { return Ok(()) };
    match d.sync_all() {
        Err(e) if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOTSUP | libc::ENOSYS | libc::EBADF)) => Err(Error::io(dir, e)),
        _ => Ok(()),
    }
}

/// Put the folder `tmp` where the folder `dst` is (or is not yet) so that `dst` is, at every
/// moment, the old folder or the new one, never missing (a crash or a reader in between would
/// find no adapter): the two are swapped in one step (Linux `renameat2(RENAME_EXCHANGE)`) and
/// the old one, now at `tmp`, removed. Where the filesystem cannot swap, the old one is
/// removed first.
pub fn replace_dir_durable(tmp: &Path, dst: &Path) -> Result<()> {
    if !dst.exists() {
        return rename_durable(tmp, dst);
    }
    sync_staged(tmp)?;
    if exchange(tmp, dst).is_ok() {
        let synced = dst.parent().map_or(Ok(()), sync_dir).map_err(|e| placed_but(dst, e));
        // The old folder; one left by a crash here is cleaned as a stale temporary.
        let _ = std::fs::remove_dir_all(tmp);
        return synced;
    }
    std::fs::remove_dir_all(dst).map_err(|e| Error::io(dst, e))?;
    rename_durable(tmp, dst)
}

/// Swap two paths atomically.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput));
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that outlive the call; the syscall reads nothing else.
    let rc = unsafe { libc::syscall(libc::SYS_renameat2, libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Write a safetensors file. The safetensors crate writes through a private temporary file
/// (mode 0600) and renames it; give the result the mode any other file we write gets (0666
/// less the umask), and report I/O failures (a full disk) as I/O errors naming the file,
/// never as a malformed safetensors file.
pub fn write_safetensors<S, V, I>(data: I, meta: Option<std::collections::HashMap<String, String>>, path: &Path) -> Result<()>
where
    S: AsRef<str> + Ord + std::fmt::Display,
    V: safetensors::View,
    I: IntoIterator<Item = (S, V)>,
{
    safetensors::serialize_to_file(data, meta, path).map_err(|e| safetensors_write_error(path, e))?;
    use std::os::unix::fs::PermissionsExt;
    let mode = 0o666 & !umask();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| Error::io(path, e))
}

/// Copy the file `src` to `dst` with the mode any file we write gets (0666 less the umask,
/// not the source's: a 0600 tokenizer beside readable weights would be unreadable to those
/// the umask lets read the rest). An error names the file written, where a full disk or a
/// read-only folder fails it.
pub fn copy_file(src: &Path, dst: &Path) -> Result<u64> {
    use std::os::unix::fs::PermissionsExt;
    let n = std::fs::copy(src, dst).map_err(|e| Error::io(dst, e))?;
    std::fs::set_permissions(dst, std::fs::Permissions::from_mode(0o666 & !umask())).map_err(|e| Error::io(dst, e))?;
    Ok(n)
}

/// A candle error met writing `path` (its GGUF writer), as an I/O error naming the file and
/// keeping the OS error (a full disk is ENOSPC, which the hints recognise), not its text.
pub fn candle_write_error(path: &Path, e: candle_core::Error) -> Error {
    match e {
        candle_core::Error::Io(io) => Error::io(path, io),
        candle_core::Error::WithBacktrace { inner, .. } | candle_core::Error::Context { inner, .. } | candle_core::Error::WithPath { inner, .. } => candle_write_error(path, *inner),
        other => Error::io(path, std::io::Error::other(other.to_string())),
    }
}

fn safetensors_write_error(path: &Path, e: safetensors::SafeTensorError) -> Error {
    match e {
        safetensors::SafeTensorError::IoError(io) => Error::io(path, io),
        other => Error::Safetensors { file: path.to_path_buf(), msg: other.to_string() },
    }
}

/// The process umask, read without changing it (`umask(2)` can only be read by setting it,
/// which would race with other threads creating files).
fn umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Umask:").map(|v| v.trim().to_string())))
        .and_then(|v| u32::from_str_radix(&v, 8).ok())
        .unwrap_or(0o022)
}

/// A cheap fingerprint of the files at `paths` (a folder: the files below it whose names
/// `keep` accepts, in path order, not looking into `skip` or hidden folders, nor into any
/// subfolder unless `descend`; a path that does not exist counts as absent): each file's
/// path below its root, its size, and its first and last MiB, hashed. It tells another model
/// or dataset put at the same path (other weights, other rows) from the one that was there
/// without reading gigabytes; a change confined to the middle of a file goes unseen.
pub fn fingerprint(paths: &[std::path::PathBuf], keep: &dyn Fn(&str) -> bool, skip: &Path, descend: bool) -> String {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Seek, SeekFrom};
    const MIB: u64 = 1 << 20;
    let mut h = Sha256::new();
    for root in paths {
        let mut files = Vec::new();
        let mut todo = vec![root.clone()];
        while let Some(p) = todo.pop() {
            match std::fs::metadata(&p) {
                // (Hidden folders, such as .git or .cache, are not the data.)
                Ok(m) if m.is_dir() && p != skip && (p == *root || descend && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'))) => {
                    todo.extend(std::fs::read_dir(&p).into_iter().flatten().flatten().map(|e| e.path()))
                }
                Ok(m) if m.is_file() && (p == *root || p.file_name().and_then(|n| n.to_str()).is_some_and(keep)) => files.push((p, m.len())),
                _ => {}
            }
        }
        files.sort();
        h.update(format!("{}\n", files.len()));
        for (p, len) in files {
            h.update(format!("{}\n{len}\n", p.strip_prefix(root).unwrap_or(&p).display()));
            let Ok(mut f) = std::fs::File::open(&p) else {
                h.update("unreadable\n");
                continue;
            };
            let mut buf = Vec::new();
            let _ = (&mut f).take(MIB).read_to_end(&mut buf);
            if len > MIB && f.seek(SeekFrom::Start(len.saturating_sub(MIB).max(MIB))).is_ok() {
                let _ = f.take(MIB).read_to_end(&mut buf);
            }
            h.update(&buf);
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_while_writing_weights_is_an_io_error_naming_enospc() {
        let path = Path::new("/out/adapter_model.safetensors");
        let e = safetensors_write_error(path, safetensors::SafeTensorError::IoError(std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("/out/adapter_model.safetensors") && text.contains("ENOSPC") && text.contains("full"), "{text}");
    }

    #[test]
    fn a_copied_file_gets_the_mode_written_files_get_not_the_sources() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (src, dst) = (d.path().join("tokenizer.json"), d.path().join("copy.json"));
        std::fs::write(&src, "{}").unwrap();
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o600)).unwrap();
        copy_file(&src, &dst).unwrap();
        assert_eq!(std::fs::metadata(&dst).unwrap().permissions().mode() & 0o777, 0o666 & !umask());
    }

    #[test]
    fn a_write_whose_rename_fails_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("loss.png");
        std::fs::create_dir(&path).unwrap(); // a folder where the file goes
        assert!(write_atomic(&path, b"png").is_err());
        assert!(!d.path().join(".loss.png.tmp").exists());
    }

    #[test]
    fn staging_folders_of_dead_processes_are_swept_and_live_ones_kept() {
        let d = tempfile::tempdir().unwrap();
        let owner = staging_owner();
        let dead = d.path().join(format!(".out.import-{owner}-999999999-0-1")); // past any pid_max
        let mine = d.path().join(format!("{}-0-1", staging_name(".out.import-")));
        let other = d.path().join(format!(".other.import-{owner}-999999999-0-1"));
        // Another host's or container's: its pid means nothing here.
        let elsewhere = d.path().join(".out.import-0123456789abcdef-999999999-0-1");
        for p in [&dead, &mine, &other, &elsewhere] {
            std::fs::create_dir_all(p.join("inside")).unwrap();
        }
        sweep_stale_staging(d.path(), ".out.import-");
        assert!(!dead.exists() && mine.exists() && other.exists() && elsewhere.exists());
    }

    #[test]
    fn a_replaced_folder_is_never_missing() {
        let d = tempfile::tempdir().unwrap();
        let (dst, tmp) = (d.path().join("adapter"), d.path().join(".adapter.tmp"));
        std::fs::create_dir(&dst).unwrap();
        std::fs::write(dst.join("v"), "0").unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watcher = {
            let (dst, done) = (dst.clone(), done.clone());
            std::thread::spawn(move || {
                let mut missing = 0;
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    missing += usize::from(!dst.exists());
                }
                missing
            })
        };
        for i in 1..=300 {
            std::fs::create_dir(&tmp).unwrap();
            std::fs::write(tmp.join("v"), i.to_string()).unwrap();
            replace_dir_durable(&tmp, &dst).unwrap();
            assert!(!tmp.exists());
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(watcher.join().unwrap(), 0, "the folder was seen missing");
        assert_eq!(std::fs::read_to_string(dst.join("v")).unwrap(), "300");
    }

    #[test]
    fn written_weights_are_as_readable_as_the_umask_allows() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let t = candle_core::Tensor::zeros(2, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        write_safetensors([("w", &t)], None, &path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask(), "mode {mode:o}");
    }
}
