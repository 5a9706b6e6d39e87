//! The base log-probabilities file (`k3-worker --perplexity FILE --save-logprobs OUT`, read
//! back with `--kl-base OUT`; SPEC.md §6.16): every scored position's log-probabilities over the
//! whole vocabulary, as the exact model gave them, so a lossy run can be compared with it
//! position by position (llama.cpp's KL-divergence mode works the same way).
//!
//! Layout (little-endian): a 64-byte header — magic `K3LP`, version 1 (u32), vocabulary (u32),
//! window (u32), positions (u64), the XXH3-64 of the scored text's ids (u64; [`ids_hash`]), the
//! codec of the trunk the base ran on (16 bytes, NUL-padded), zeros — then `positions` rows of
//! `vocabulary` f32 log-probabilities, in window order. A file that is not exactly that, or
//! another text's, window's or vocabulary's, is refused (exit 2). It is written under a
//! temporary name and renamed into place (removed on an error or a SIGINT/SIGTERM; a killed
//! writer's is removed by the next).

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// `K3LP`.
pub const MAGIC: [u8; 4] = *b"K3LP";
/// The layout version written and read.
pub const VERSION: u32 = 1;
/// Header bytes.
pub const HEADER_BYTES: usize = 64;

/// XXH3-64 of the scored ids (u32 little-endian each) and the window: what ties a base file to
/// the text it was made from.
pub fn ids_hash(ids: &[u32], window: usize) -> u64 {
    let mut b = Vec::with_capacity(4 * ids.len() + 8);
    b.extend_from_slice(&(window as u64).to_le_bytes());
    for id in ids {
        b.extend_from_slice(&id.to_le_bytes());
    }
    k3_store::runtime::trunk::run_checksum(&b)
}

/// What a base file is about (its header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Vocabulary size (floats per row).
    pub vocab: u32,
    /// The window the text was scored in.
    pub window: u32,
    /// Rows.
    pub positions: u64,
    /// [`ids_hash`] of the text.
    pub ids_xxh3: u64,
    /// The codec of the trunk the base ran on (`"ecbf16"`, `"raw"`, … or empty: the shards).
    pub codec: String,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..8].copy_from_slice(&VERSION.to_le_bytes());
        h[8..12].copy_from_slice(&self.vocab.to_le_bytes());
        h[12..16].copy_from_slice(&self.window.to_le_bytes());
        h[16..24].copy_from_slice(&self.positions.to_le_bytes());
        h[24..32].copy_from_slice(&self.ids_xxh3.to_le_bytes());
        let c = self.codec.as_bytes();
        h[32..32 + c.len().min(16)].copy_from_slice(&c[..c.len().min(16)]);
        h
    }

    fn decode(h: &[u8; HEADER_BYTES]) -> Result<Header, LogprobsError> {
        let u32_at = |at: usize| u32::from_le_bytes(h[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        if h[0..4] != MAGIC {
            return Err(LogprobsError::NotOne("no K3LP magic"));
        }
        if u32_at(4) != VERSION {
            return Err(LogprobsError::NotOne("a version this build does not read"));
        }
        if h[48..].iter().any(|&b| b != 0) {
            return Err(LogprobsError::NotOne("non-zero reserved bytes"));
        }
        let codec = h[32..48].split(|&b| b == 0).next().unwrap_or_default();
        Ok(Header {
            vocab: u32_at(8),
            window: u32_at(12),
            positions: u64_at(16),
            ids_xxh3: u64_at(24),
            codec: String::from_utf8_lossy(codec).into_owned(),
        })
    }

    /// The exact file length this header gives (`None` on overflow).
    fn file_len(&self) -> Option<u64> {
        self.positions
            .checked_mul(self.vocab as u64)?
            .checked_mul(4)?
            .checked_add(HEADER_BYTES as u64)
    }
}

/// Why a base file cannot be written or used.
#[derive(Debug, thiserror::Error)]
pub enum LogprobsError {
    /// Not a base file (exit 2).
    #[error("not a K3LP base log-probabilities file: {0}")]
    NotOne(&'static str),
    /// A base file of other positions (exit 2).
    #[error(
        "made for {theirs}, this run scores {ours} (the same --perplexity text, --ppl-window and \
         vocabulary are needed)"
    )]
    Mismatch {
        /// What the file's header says.
        theirs: String,
        /// What this run scores.
        ours: String,
    },
    /// Its length is not what its header gives (exit 2).
    #[error("{got} bytes, but its header gives {want:?} (cut short or appended to)")]
    Length {
        /// Bytes.
        got: u64,
        /// What the header gives.
        want: Option<u64>,
    },
    /// Reading or writing failed (exit 1).
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl LogprobsError {
    /// Refused (exit 2) rather than failed (exit 1).
    pub fn is_refusal(&self) -> bool {
        !matches!(self, LogprobsError::Io { .. })
    }
}

/// A base file being written: rows appended in order, renamed into place by [`Writer::finish`];
/// dropped unfinished (an error, an interrupt), its temporary file is removed.
pub struct Writer {
    out: Option<BufWriter<std::fs::File>>,
    tmp: PathBuf,
    path: PathBuf,
    rows: u64,
    header: Header,
}

impl Writer {
    /// Start `path` (its directory must exist) for rows of `header`; a dead writer's temporaries
    /// in the directory are removed first.
    pub fn create(path: &Path, header: Header) -> Result<Writer, LogprobsError> {
        let io = |source| LogprobsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| io(std::io::Error::other("no file name")))?;
        for p in k3_store::runtime::trunk::remove_stale_temporaries(dir, &[&name]) {
            tracing::info!("removed {}, left by a writer that is gone", p.display());
        }
        let tmp = dir.join(k3_store::runtime::trunk::temp_name(
            &name,
            std::process::id(),
        ));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io)?;
        let mut w = Writer {
            out: Some(BufWriter::with_capacity(1 << 20, f)),
            tmp,
            path: path.to_path_buf(),
            rows: 0,
            header,
        };
        let h = w.header.encode();
        w.write(&h)?;
        Ok(w)
    }

    fn write(&mut self, b: &[u8]) -> Result<(), LogprobsError> {
        let out = self.out.as_mut().expect("open until finished");
        out.write_all(b).map_err(|source| LogprobsError::Io {
            path: self.tmp.clone(),
            source,
        })
    }

    /// Append one position's log-probabilities.
    pub fn row(&mut self, logp: &[f32]) -> Result<(), LogprobsError> {
        assert_eq!(
            logp.len(),
            self.header.vocab as usize,
            "a row of the vocabulary"
        );
        let mut b = Vec::with_capacity(4 * logp.len());
        for v in logp {
            b.extend_from_slice(&v.to_le_bytes());
        }
        self.write(&b)?;
        self.rows += 1;
        Ok(())
    }

    /// Check every row was written, sync and rename into place.
    pub fn finish(mut self) -> Result<(), LogprobsError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LogprobsError::Io { path, source }
        };
        if self.rows != self.header.positions {
            return Err(LogprobsError::Length {
                got: self.rows,
                want: Some(self.header.positions),
            });
        }
        let out = self.out.take().expect("open until finished");
        let f = out
            .into_inner()
            .map_err(|e| io(&self.tmp)(e.into_error()))?;
        f.sync_all().map_err(io(&self.tmp))?;
        std::fs::rename(&self.tmp, &self.path).map_err(io(&self.path))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A base file being read, row by row.
pub struct Reader {
    inp: BufReader<std::fs::File>,
    path: PathBuf,
    /// Its header.
    pub header: Header,
}

impl Reader {
    /// Open `path` and check it is a base file for `want` (vocabulary, window, positions, ids)
    /// of exactly the length its header gives.
    pub fn open(path: &Path, want: &Header) -> Result<Reader, LogprobsError> {
        let io = |source| LogprobsError::Io {
            path: path.to_path_buf(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        let mut inp = BufReader::with_capacity(1 << 20, f);
        let mut h = [0u8; HEADER_BYTES];
        if len < HEADER_BYTES as u64 {
            return Err(LogprobsError::NotOne("shorter than its header"));
        }
        inp.read_exact(&mut h).map_err(io)?;
        let header = Header::decode(&h)?;
        if header.file_len() != Some(len) {
            return Err(LogprobsError::Length {
                got: len,
                want: header.file_len(),
            });
        }
        let what = |h: &Header| {
            format!(
                "{} positions of a {}-id vocabulary in windows of {} (ids xxh3 {:016x})",
                h.positions, h.vocab, h.window, h.ids_xxh3
            )
        };
        if (
            header.vocab,
            header.window,
            header.positions,
            header.ids_xxh3,
        ) != (want.vocab, want.window, want.positions, want.ids_xxh3)
        {
            return Err(LogprobsError::Mismatch {
                theirs: what(&header),
                ours: what(want),
            });
        }
        Ok(Reader {
            inp,
            path: path.to_path_buf(),
            header,
        })
    }

    /// The next row into `out` (resized to the vocabulary).
    pub fn row(&mut self, out: &mut Vec<f32>) -> Result<(), LogprobsError> {
        let n = self.header.vocab as usize;
        let mut b = vec![0u8; 4 * n];
        self.inp
            .read_exact(&mut b)
            .map_err(|source| LogprobsError::Io {
                path: self.path.clone(),
                source,
            })?;
        out.clear();
        out.extend(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(positions: u64) -> Header {
        Header {
            vocab: 3,
            window: 8,
            positions,
            ids_xxh3: ids_hash(&[1, 2, 3], 8),
            codec: "ecbf16".into(),
        }
    }

    #[test]
    fn rows_round_trip_and_other_texts_or_lengths_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("base.k3lp");
        let mut w = Writer::create(&p, header(2)).unwrap();
        w.row(&[-0.1, -2.0, -3.5]).unwrap();
        w.row(&[-1.0, -0.5, -2.5]).unwrap();
        w.finish().unwrap();
        let mut r = Reader::open(&p, &header(2)).unwrap();
        assert_eq!(r.header.codec, "ecbf16");
        let mut row = Vec::new();
        r.row(&mut row).unwrap();
        assert_eq!(row, [-0.1, -2.0, -3.5]);
        r.row(&mut row).unwrap();
        assert_eq!(row, [-1.0, -0.5, -2.5]);
        // Another text, another length, a truncated file, not a base file.
        let mut other = header(2);
        other.ids_xxh3 = ids_hash(&[1, 2, 4], 8);
        assert!(matches!(
            Reader::open(&p, &other),
            Err(LogprobsError::Mismatch { .. })
        ));
        assert!(matches!(
            Reader::open(&p, &header(3)),
            Err(LogprobsError::Mismatch { .. })
        ));
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let e = Reader::open(&p, &header(2)).err().unwrap();
        assert!(
            matches!(e, LogprobsError::Length { .. }) && e.is_refusal(),
            "{e}"
        );
        std::fs::write(&p, b"hello").unwrap();
        assert!(Reader::open(&p, &header(2)).err().unwrap().is_refusal());
    }

    #[test]
    fn an_unfinished_file_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("base.k3lp");
        let mut w = Writer::create(&p, header(2)).unwrap();
        w.row(&[-0.1, -2.0, -3.5]).unwrap();
        // One row short: refused, and nothing left.
        assert!(w.finish().is_err());
        let w = Writer::create(&p, header(2)).unwrap();
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
