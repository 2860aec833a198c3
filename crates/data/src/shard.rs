//! Token shards: a 32-byte header followed by little-endian token ids.
//!
//! ```text
//! offset  size  field
//!      0     8  magic  b"FRLMTOK\0"
//!      8     4  version (u32 LE) = 1
//!     12     4  bytes per token (u32 LE): 2 = u16, 4 = u32
//!     16     8  token count (u64 LE)
//!     24     8  zero padding (keeps the payload 32-byte aligned)
//!     32     -  tokens
//! ```
//! Shards are memory-mapped, so a corpus larger than RAM costs only page cache,
//! and opening one is O(1). The header carries the count, so a file cut short
//! by a crashed writer is detected instead of silently training on less data.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};

/// First 8 bytes of every shard.
pub const MAGIC: [u8; 8] = *b"FRLMTOK\0";
/// The format version this crate reads and writes.
pub const VERSION: u32 = 1;
/// Size of the header in bytes.
pub const HEADER_LEN: usize = 32;

/// On-disk width of one token id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    /// The narrowest width that holds every id of a `vocab_size` vocabulary:
    /// u16 halves disk and page-cache use for vocabularies up to 65 536.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// Bytes per token; also the dtype code stored in the header.
    pub fn size(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        match code {
            2 => Some(TokenDtype::U16),
            4 => Some(TokenDtype::U32),
            _ => None,
        }
    }
}

fn header(dtype: TokenDtype, count: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(dtype.size() as u32).to_le_bytes());
    h[16..24].copy_from_slice(&count.to_le_bytes());
    h
}

/// Streams tokens into a new shard. Nothing appears at `path` until
/// [`finish`](ShardWriter::finish): the data goes to `<path>.tmp`, which is
/// renamed over `path` at the end, so readers never see a half-written shard.
pub struct ShardWriter {
    path: PathBuf,
    tmp: PathBuf,
    out: Option<BufWriter<File>>,
    dtype: TokenDtype,
    count: u64,
}

impl ShardWriter {
    /// Starts a shard at `path` storing ids as `dtype`
    /// (use [`TokenDtype::for_vocab`] to pick u16 when the vocabulary allows).
    pub fn create(path: impl AsRef<Path>, dtype: TokenDtype) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&header(dtype, 0)).map_err(|e| Error::io(&tmp, e))?;
        Ok(ShardWriter { path, tmp, out: Some(out), dtype, count: 0 })
    }

    /// Appends `tokens`; an id too wide for the shard's dtype is an error.
    pub fn write(&mut self, tokens: &[u32]) -> Result<()> {
        let out = self.out.as_mut().expect("ShardWriter used after finish");
        let mut buf = Vec::with_capacity(tokens.len() * self.dtype.size());
        match self.dtype {
            TokenDtype::U16 => {
                for &t in tokens {
                    let t = u16::try_from(t)
                        .map_err(|_| Error::invalid(format!("{}: token id {t} does not fit a u16 shard", self.path.display())))?;
                    buf.extend_from_slice(&t.to_le_bytes());
                }
            }
            TokenDtype::U32 => tokens.iter().for_each(|t| buf.extend_from_slice(&t.to_le_bytes())),
        }
        out.write_all(&buf).map_err(|e| Error::io(&self.tmp, e))?;
        self.count += tokens.len() as u64;
        Ok(())
    }

    /// Tokens written so far.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// True when nothing has been written.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Writes the final header, syncs and renames into place; returns the token count.
    pub fn finish(mut self) -> Result<u64> {
        let out = self.out.take().expect("ShardWriter finished twice");
        let mut file = out.into_inner().map_err(|e| Error::io(&self.tmp, e.into_error()))?;
        let io = |e| Error::io(&self.tmp, e);
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header(self.dtype, self.count)).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        Ok(self.count)
    }
}

impl Drop for ShardWriter {
    /// An unfinished writer (error or early return) leaves no temp file behind.
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A read-only, memory-mapped token shard.
pub struct Shard {
    path: PathBuf,
    map: Mmap,
    dtype: TokenDtype,
    len: usize,
}

impl Shard {
    /// Maps `path` and validates its header and length.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        if file_len < HEADER_LEN as u64 {
            let magic_ok = {
                let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
                MAGIC.starts_with(&bytes[..bytes.len().min(8)]) && !bytes.is_empty()
            };
            let msg = if magic_ok {
                format!("truncated token shard ({file_len} bytes, header needs {HEADER_LEN})")
            } else {
                "not a ferrolm token shard (bad magic)".to_string()
            };
            return Err(Error::format(&path, msg));
        }
        // SAFETY: memmap2 requires that the file is not modified or truncated while mapped.
        // ferrolm never writes a shard in place: ShardWriter writes a temp file and renames it
        // over the name, which replaces the directory entry and leaves this mapping's inode
        // untouched. Another process truncating the file under us is outside what we can check
        // (the kernel then raises SIGBUS on access, as for any mapped file). The length used
        // below comes from the mapping itself, and every read is bounds-checked slice access.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        if map[0..8] != MAGIC {
            return Err(Error::format(&path, "not a ferrolm token shard (bad magic)"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(map[o..o + 4].try_into().unwrap());
        let version = u32_at(8);
        if version != VERSION {
            return Err(Error::format(&path, format!("unsupported token shard version {version} (this build reads {VERSION})")));
        }
        let code = u32_at(12);
        let dtype = TokenDtype::from_code(code).ok_or_else(|| Error::format(&path, format!("unsupported token dtype code {code}")))?;
        let count = u64::from_le_bytes(map[16..24].try_into().unwrap());
        let expected = count.checked_mul(dtype.size() as u64).and_then(|b| b.checked_add(HEADER_LEN as u64));
        if expected != Some(file_len) {
            return Err(Error::format(
                &path,
                format!(
                    "truncated or corrupt token shard: header says {count} tokens of {} bytes, \
                     file holds {} payload bytes",
                    dtype.size(),
                    file_len - HEADER_LEN as u64
                ),
            ));
        }
        let len =
            usize::try_from(count).map_err(|_| Error::format(&path, format!("{count} tokens do not fit this machine's address space")))?;
        Ok(Shard { path, map, dtype, len })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the shard holds no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// On-disk token width.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The file this shard was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The largest token id, `None` for an empty shard. Reads every token (a sequential scan of
    /// the mapping: about a second per GB from page cache, longer from a cold disk).
    pub fn max_id(&self) -> Option<u32> {
        let bytes = &self.map[HEADER_LEN..];
        match self.dtype {
            TokenDtype::U16 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).max(),
            TokenDtype::U32 => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).max(),
        }
    }

    /// Checks that every id is below `vocab_size`; the error names the shard, the first bad
    /// id and its position. A u16 shard needs no scan when the vocabulary covers all of u16.
    pub fn check_ids(&self, vocab_size: usize) -> Result<()> {
        if self.dtype == TokenDtype::U16 && vocab_size > u16::MAX as usize {
            return Ok(());
        }
        match self.max_id() {
            Some(m) if m as usize >= vocab_size => {
                let pos = (0..self.len).find(|&i| self.get(i) as usize >= vocab_size).unwrap_or(0);
                Err(Error::format(
                    &self.path,
                    format!(
                        "token id {} at position {pos} is out of range for the tokenizer's vocabulary of {vocab_size} \
                         (largest id in this shard: {m}): the shard was prepared with another tokenizer",
                        self.get(pos)
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Token `i`. Panics if `i >= len()` (an indexing bug, like slice indexing).
    pub fn get(&self, i: usize) -> u32 {
        assert!(i < self.len, "token index {i} out of range for {} ({} tokens)", self.path.display(), self.len);
        let o = HEADER_LEN + i * self.dtype.size();
        match self.dtype {
            TokenDtype::U16 => u16::from_le_bytes([self.map[o], self.map[o + 1]]) as u32,
            TokenDtype::U32 => u32::from_le_bytes(self.map[o..o + 4].try_into().unwrap()),
        }
    }

    /// Tokens `start .. start + len`. Panics when out of range, like slice indexing.
    pub fn slice(&self, start: usize, len: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(len);
        self.extend_into(start, len, |t| out.push(t));
        out
    }

    /// Feeds tokens `start .. start + len` to `f` without an intermediate Vec
    /// (the loader converts straight into its i32 batch buffers).
    pub(crate) fn extend_into(&self, start: usize, len: usize, mut f: impl FnMut(u32)) {
        let end = start.checked_add(len).filter(|&e| e <= self.len);
        assert!(end.is_some(), "range {start}+{len} out of range for {} ({} tokens)", self.path.display(), self.len);
        let w = self.dtype.size();
        let bytes = &self.map[HEADER_LEN + start * w..HEADER_LEN + (start + len) * w];
        match self.dtype {
            TokenDtype::U16 => bytes.chunks_exact(2).for_each(|c| f(u16::from_le_bytes([c[0], c[1]]) as u32)),
            TokenDtype::U32 => bytes.chunks_exact(4).for_each(|c| f(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        }
    }
}
