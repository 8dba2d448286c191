//! `RowTable`: a table the model reads only by rows (an untied embedding or LM head) left in
//! its file and read a row range at a time through a handle opened at load.
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;

/// A 2-D table whose rows are read from its file when asked for (`pread`) and never held:
/// the token embedding, of which a step reads one row per token, while a resident copy of
/// the whole table is vocab x hidden (420 MB of DeepSeek-V2-Lite's in bf16, 840 MB of
/// DeepSeek 7B's). Reading through the memory map instead would leave every row ever read
/// (and the pages the kernel maps around it) in the process's memory.
pub struct RowTable {
    pub(super) file: std::fs::File,
    pub(super) path: PathBuf,
    pub(super) name: String,
    /// Where row 0 starts in the file.
    pub(super) offset: u64,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// As stored in the file.
    pub(super) dtype: DType,
}

impl RowTable {
    /// Rows `ids` as stored: [ids.len(), cols] on the host.
    pub fn read(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(Tensor::from_raw_buffer(&self.read_bytes(ids)?, self.dtype, &[ids.len(), self.cols], &Device::Cpu)?)
    }

    /// Rows start..start+len as stored, [len, cols] on the host: one read of contiguous bytes,
    /// straight into the tensor's buffer.
    pub fn read_range(&self, start: usize, len: usize) -> Result<Tensor> {
        if start + len > self.rows {
            let msg = format!("rows {start}..{} asked of the {} rows of `{}`", start + len, self.rows, self.name);
            return Err(Error::Model { what: "row range".into(), msg });
        }
        let (n, at) = (len * self.cols, self.offset + (start * self.cols * self.dtype.size_in_bytes()) as u64);
        let shape = (len, self.cols);
        Ok(match self.dtype {
            DType::BF16 => Tensor::from_vec(self.read_into::<half::bf16>(n, at)?, shape, &Device::Cpu)?,
            DType::F16 => Tensor::from_vec(self.read_into::<half::f16>(n, at)?, shape, &Device::Cpu)?,
            _ => Tensor::from_vec(self.read_into::<f32>(n, at)?, shape, &Device::Cpu)?,
        })
    }

    /// Rows start..start+len as the file's bytes.
    pub(super) fn range_bytes(&self, start: usize, len: usize) -> Result<Vec<u8>> {
        let row = self.cols * self.dtype.size_in_bytes();
        self.read_into::<u8>(len * row, self.offset + (start * row) as u64)
    }

    /// `n` elements (f32, bf16, f16 or bytes) read from the file at byte `at`, straight into
    /// memory nothing zeroed first, in a piece per thread: the loss reads the LM head this way
    /// every step (420 MB of DeepSeek-V2-Lite's in 8 MB chunks, `ops::loss`). Measured with
    /// 30 MB chunks: 42-44 ms of a 1.4 s step on Zen 5 when each chunk was zeroed and then
    /// copied in by one thread, 19-22 ms so.
    fn read_into<T: PlainBits>(&self, n: usize, at: u64) -> Result<Vec<T>> {
        use rayon::prelude::*;
        let bytes = n * std::mem::size_of::<T>();
        let mut buf: Vec<T> = Vec::with_capacity(n);
        let base = buf.as_mut_ptr() as usize;
        let piece = bytes.div_ceil(rayon::current_num_threads().max(1)).max(4 << 20);
        (0..bytes.div_ceil(piece.max(1))).into_par_iter().try_for_each(|i| {
            let (from, to) = (i * piece, ((i + 1) * piece).min(bytes));
            // SAFETY: bytes from..to of the vector's capacity, written by this piece alone.
            unsafe { pread_exact(&self.file, (base + from) as *mut u8, to - from, at + from as u64) }
        })
        .map_err(|e| Error::io(&self.path, e))?;
        // SAFETY: the pieces wrote all `bytes` bytes; T is plain bits (`PlainBits`: every bit
        // pattern is a value).
        unsafe { buf.set_len(n) };
        Ok(buf)
    }

    /// Ask the kernel, from a thread of its own, to read the whole table into the page cache
    /// (which is not this process's memory). The embedding is read a few rows per step, and the
    /// rows a step's tokens name are otherwise read from disk one by one on the step's thread:
    /// DeepSeek-V2-Lite's untied embedding (420 MB) cost ~95 ms of a 2.8 s MoE step on random
    /// tokens (2-core Zen 4 VM, 2026-11-28: 512 blocking 4 KB reads), every step, as new ids
    /// came. A head read whole each step is in the cache after its first, and costs nothing here.
    pub(super) fn read_ahead(&self) {
        #[cfg(target_os = "linux")]
        if let Ok(file) = self.file.try_clone() {
            use std::os::unix::io::AsRawFd;
            let (at, len) = (self.offset, (self.rows * self.cols * self.dtype.size_in_bytes()) as u64);
            // In 2 MB pieces: Linux reads at most the device's readahead window per call (8 MB of
            // the 420 MB here when asked for all of it at once). Advice only: a failure leaves
            // the reads as they were.
            const PIECE: u64 = 2 << 20;
            std::thread::spawn(move || {
                for from in (at..at + len).step_by(PIECE as usize) {
                    let n = PIECE.min(at + len - from);
                    // SAFETY: posix_fadvise reads no memory of ours; the fd is live for the call.
                    unsafe { libc::posix_fadvise(file.as_raw_fd(), from as libc::off_t, n as libc::off_t, libc::POSIX_FADV_WILLNEED) };
                }
            });
        }
    }

    pub(super) fn read_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let row = self.cols * self.dtype.size_in_bytes();
        let mut buf = vec![0u8; ids.len() * row];
        for (dst, &id) in buf.chunks_exact_mut(row.max(1)).zip(ids) {
            if id as usize >= self.rows {
                let msg = format!("token id {id} is past the {} rows of `{}` (the model's vocab_size; a tokenizer of another model?)", self.rows, self.name);
                return Err(Error::Model { what: "token ids".into(), msg });
            }
            self.file.read_exact_at(dst, self.offset + (id as usize * row) as u64).map_err(|e| Error::io(&self.path, e))?;
        }
        Ok(buf)
    }
}

/// Element types any bytes are a value of (no padding, no invalid bit patterns), which
/// `RowTable::read_into` fills straight from a file.
trait PlainBits: Copy + Send {}
impl PlainBits for f32 {}
impl PlainBits for half::bf16 {}
impl PlainBits for half::f16 {}
impl PlainBits for u8 {}

/// `len` bytes of `file` from byte `at` into `dst` (short reads continued, EINTR retried; the
/// end of the file first is an error).
///
/// # Safety
/// `dst` is valid for `len` bytes of writes, by this call alone.
unsafe fn pread_exact(file: &std::fs::File, dst: *mut u8, len: usize, at: u64) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let mut done = 0;
    while done < len {
        // SAFETY: dst + done .. dst + len is ours to write (the caller's contract).
        let got = unsafe { libc::pread(file.as_raw_fd(), dst.add(done).cast(), len - done, (at + done as u64) as libc::off_t) };
        match got {
            0 => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("the file ends before byte {}", at + len as u64))),
            n if n > 0 => done += n as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}
