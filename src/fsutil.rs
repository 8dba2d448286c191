//! Durable file writes: write to a temporary sibling, fsync, rename, fsync the folder. A
//! reader (or a crash) sees the old file or the new one, never half of one.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    {
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    }
    rename_durable(&tmp, path)
}

/// fsync `tmp`, rename it over `dst`, fsync the folder.
pub fn rename_durable(tmp: &Path, dst: &Path) -> Result<()> {
    std::fs::File::open(tmp).and_then(|f| f.sync_all()).map_err(|e| Error::io(tmp, e))?;
    std::fs::rename(tmp, dst).map_err(|e| Error::io(dst, e))?;
    if let Some(parent) = dst.parent() {
        // Directory fsync makes the rename itself durable; not all filesystems allow it.
        if let Ok(d) = std::fs::File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}
