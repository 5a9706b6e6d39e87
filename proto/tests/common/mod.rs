//! Test helpers: a throw-away directory and a minimal safetensors writer (data left as sparse
//! holes).

#![allow(dead_code)]

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A unique temporary directory (`tempfile`), removed on drop.
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        TempDir(
            tempfile::Builder::new()
                .prefix(&format!("k3-proto-{tag}-"))
                .tempdir()
                .unwrap(),
        )
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    pub fn join(&self, f: &str) -> PathBuf {
        self.0.path().join(f)
    }
}

/// One tensor to write.
#[derive(Clone, Debug)]
pub struct T {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
}

pub fn t(name: &str, dtype: &str, shape: &[u64]) -> T {
    T {
        name: name.to_string(),
        dtype: dtype.to_string(),
        shape: shape.to_vec(),
    }
}

pub fn dtype_size(d: &str) -> u64 {
    match d {
        "BF16" | "F16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "U8" | "I8" | "BOOL" => 1,
        "I64" | "U64" | "F64" => 8,
        other => panic!("test writer: unknown dtype {other}"),
    }
}

/// Where the writer put a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    pub name: String,
    /// Absolute offset in the file.
    pub offset: u64,
    pub nbytes: u64,
}

/// Header JSON for `tensors` laid out back to back; returns the JSON and the relative offsets.
pub fn header_json(tensors: &[T]) -> (String, Vec<(u64, u64)>) {
    let mut s = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut off = 0u64;
    let mut spans = Vec::with_capacity(tensors.len());
    for t in tensors {
        let n: u64 = t.shape.iter().product::<u64>() * dtype_size(&t.dtype);
        let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        s.push_str(&format!(
            ",\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            t.name,
            t.dtype,
            dims.join(","),
            off,
            off + n
        ));
        spans.push((off, off + n));
        off += n;
    }
    s.push('}');
    (s, spans)
}

/// Writes `[len][header][data]` with an arbitrary header text and declared length; the file is
/// extended (sparsely) to `8 + header.len() + data_len` bytes.
pub fn write_raw(path: &Path, declared_len: u64, header: &[u8], data_len: u64) {
    let mut f = File::create(path).unwrap();
    f.write_all(&declared_len.to_le_bytes()).unwrap();
    f.write_all(header).unwrap();
    f.set_len(8 + header.len() as u64 + data_len).unwrap();
}

/// Writes a well-formed shard (header padded with spaces to a multiple of 8).
pub fn write_shard(path: &Path, tensors: &[T]) -> Vec<Placed> {
    let (mut h, spans) = header_json(tensors);
    while h.len() % 8 != 0 {
        h.push(' ');
    }
    let data_len = spans.last().map(|s| s.1).unwrap_or(0);
    write_raw(path, h.len() as u64, h.as_bytes(), data_len);
    let base = 8 + h.len() as u64;
    tensors
        .iter()
        .zip(spans)
        .map(|(t, (b, e))| Placed {
            name: t.name.clone(),
            offset: base + b,
            nbytes: e - b,
        })
        .collect()
}

/// Writes `model.safetensors.index.json` mapping each name to its file.
pub fn write_index_json(dir: &Path, entries: &[(&str, &str)]) {
    let mut s = String::from("{\"metadata\":{\"total_size\":0},\"weight_map\":{");
    for (i, (n, f)) in entries.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!("\"{n}\":\"{f}\""));
    }
    s.push_str("}}");
    std::fs::write(dir.join("model.safetensors.index.json"), s).unwrap();
}
