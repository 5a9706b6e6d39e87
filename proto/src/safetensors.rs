//! The checkpoint index: every tensor of every safetensors shard, bounds-checked, stored
//! compactly (SPEC.md §2.1).
//!
//! A shard is `[u64 LE header length][JSON header][data]`; each header entry gives `dtype`,
//! `shape` and `data_offsets` relative to the start of the data. [`CheckpointIndex::open`] reads
//! only the headers (never the data), bounds every length and offset against the file size
//! before allocating, and parses the JSON straight into compact records (no JSON DOM).
//!
//! Memory: one 64-byte record per tensor + its canonical name in a shared arena + a 4-byte slot
//! in an open-addressing hash table (≈150 bytes per tensor at the release's name lengths;
//! [`CheckpointIndex::heap_bytes`]).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::dtype::Dtype;
use crate::names::{self, TensorClass};

/// The optional shard list written next to sharded checkpoints.
pub const INDEX_JSON: &str = "model.safetensors.index.json";
/// Largest shard header accepted (real ones are ~1 MB).
pub const MAX_HEADER_BYTES: u64 = 256 << 20;
/// Largest `model.safetensors.index.json` accepted (the release's is ~40 MB).
pub const MAX_INDEX_JSON_BYTES: u64 = 1 << 30;
/// Most dimensions stored per tensor.
pub const MAX_NDIM: usize = 4;
/// Errors listed individually before the rest are only counted.
const MAX_LISTED_ERRORS: usize = 50;

/// Why a checkpoint could not be indexed. Every message names the file and, where there is one,
/// the tensor.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no *.safetensors shards and no {INDEX_JSON}", dir.display())]
    NoShards { dir: PathBuf },
    #[error("{}: {msg}", path.display())]
    IndexJson { path: PathBuf, msg: String },
    #[error("{}: weight_map names shard file `{shard}`, which does not exist", index.display())]
    MissingShard { index: PathBuf, shard: String },
    #[error("{}: {msg}", path.display())]
    Header { path: PathBuf, msg: String },
    #[error("{}: tensor `{tensor}`: {msg}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error("tensor `{tensor}` appears twice: in {} and in {}", first.display(), second.display())]
    Duplicate {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("{}: tensor `{tensor}`: {msg}", index.display())]
    WeightMap {
        index: PathBuf,
        tensor: String,
        msg: String,
    },
    /// A skipped (unreadable-dtype) tensor whose name occurs twice.
    #[error("tensor `{tensor}` appears twice in the checkpoint")]
    Repeated { tensor: String },
    #[error("{msg}")]
    Limit { msg: String },
    #[error("{}", list_errors(.0, .1))]
    Many(Vec<IndexError>, usize),
}

fn list_errors(errors: &[IndexError], unlisted: &usize) -> String {
    let mut s = format!("{} problems:", errors.len() + unlisted);
    for e in errors {
        s.push_str("\n  - ");
        s.push_str(&e.to_string());
    }
    if *unlisted > 0 {
        s.push_str(&format!("\n  - … and {unlisted} more"));
    }
    s
}

impl IndexError {
    /// The individual problems (flattens [`IndexError::Many`]).
    pub fn problems(&self) -> Vec<String> {
        match self {
            IndexError::Many(v, more) => {
                let mut out: Vec<String> = v.iter().map(|e| e.to_string()).collect();
                if *more > 0 {
                    out.push(format!("… and {more} more problems"));
                }
                out
            }
            e => vec![e.to_string()],
        }
    }

    fn from_list(mut v: Vec<IndexError>) -> IndexError {
        if v.len() == 1 {
            return v.remove(0);
        }
        let more = v.len().saturating_sub(MAX_LISTED_ERRORS);
        v.truncate(MAX_LISTED_ERRORS);
        IndexError::Many(v, more)
    }
}

/// One tensor (compact record).
#[derive(Clone, Copy, Debug)]
struct Rec {
    /// Absolute offset in the shard file.
    offset: u64,
    nbytes: u64,
    shape: [u64; MAX_NDIM],
    name_off: u32,
    name_len: u16,
    shard: u16,
    dtype: Dtype,
    ndim: u8,
}

const _: () = assert!(std::mem::size_of::<Rec>() == 64);

#[derive(Debug)]
struct ShardMeta {
    path: PathBuf,
    len: u64,
    data_start: u64,
}

/// Every tensor of a checkpoint directory.
#[derive(Debug)]
pub struct CheckpointIndex {
    /// Sorted by (shard, offset): iteration is physical order.
    recs: Vec<Rec>,
    arena: String,
    /// Open addressing, linear probing; `EMPTY` or an index into `recs`. Length is a power of 2.
    table: Vec<u32>,
    shards: Vec<ShardMeta>,
    /// `TensorClass::Other` tensors left out (dtype k3 does not read, or more than 4 dims).
    skipped: Vec<String>,
    /// The shard set came from `model.safetensors.index.json` (not from a directory scan).
    listed: bool,
}

/// A table slot holds an 8-bit hash tag (high bits) and a 24-bit record index; all ones = empty.
const EMPTY: u32 = u32::MAX;
const SLOT_INDEX: u32 = 0x00ff_ffff;
/// Most tensors one index holds (33× the release's 497,220).
pub const MAX_TENSORS: usize = SLOT_INDEX as usize;

fn slot_tag(h: u64) -> u32 {
    ((h >> 56) as u32) << 24
}

/// One tensor of the index.
#[derive(Clone, Copy, Debug)]
pub struct TensorInfo<'a> {
    /// Canonical name.
    pub name: &'a str,
    pub dtype: Dtype,
    pub shard: u16,
    /// Absolute byte offset in the shard file (8 + header_len + data_offsets[0]).
    pub offset: u64,
    pub nbytes: u64,
    shape: [u64; MAX_NDIM],
    ndim: u8,
}

impl TensorInfo<'_> {
    /// The tensor's dimensions (at most 4).
    pub fn shape(&self) -> &[u64] {
        &self.shape[..self.ndim as usize]
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape().iter().product()
    }
}

/// A fast non-cryptographic hash of a name (FxHash-style over 8-byte words).
fn hash_name(s: &str) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h: u64 = 0;
    let b = s.as_bytes();
    let mut chunks = b.chunks_exact(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    let tail = chunks.remainder();
    let mut w = [0u8; 8];
    w[..tail.len()].copy_from_slice(tail);
    h = (h.rotate_left(5) ^ u64::from_le_bytes(w) ^ ((b.len() as u64) << 56)).wrapping_mul(K);
    // Final avalanche so the low bits (used for the slot) depend on every byte.
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^ (h >> 32)
}

impl CheckpointIndex {
    /// Indexes `dir`: the shard set comes from `model.safetensors.index.json` if present (every
    /// weight_map entry is then checked against the shard headers), else from `*.safetensors`.
    pub fn open(dir: &Path) -> Result<CheckpointIndex, IndexError> {
        let index_path = dir.join(INDEX_JSON);
        let (files, weight_map) = if index_path.is_file() {
            let wm = read_index_json(dir, &index_path)?;
            (wm.files.clone(), Some(wm))
        } else {
            (scan_shards(dir)?, None)
        };
        if files.is_empty() {
            return Err(IndexError::NoShards {
                dir: dir.to_path_buf(),
            });
        }
        if files.len() > usize::from(u16::MAX) {
            return Err(IndexError::Limit {
                msg: format!(
                    "{}: {} shards (at most {} supported)",
                    dir.display(),
                    files.len(),
                    u16::MAX
                ),
            });
        }
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        let outs = read_all_shards(&paths, weight_map.as_ref());
        let mut errors = Vec::new();
        let mut ok = Vec::with_capacity(outs.len());
        for o in outs {
            match o {
                Ok(s) => ok.push(s),
                Err(e) => errors.push(e),
            }
        }
        if !errors.is_empty() {
            return Err(IndexError::from_list(errors));
        }
        let diffs: Vec<WeightMapDiff> =
            ok.iter_mut().map(|o| std::mem::take(&mut o.diff)).collect();
        // The listed names are no longer needed: free them before the merge allocates.
        let listed_in_index_json = weight_map.is_some();
        drop(weight_map);
        let mut index = merge(ok, paths)?;
        if listed_in_index_json {
            index.report_weight_map(&index_path, &files, diffs)?;
        }
        index.listed = listed_in_index_json;
        Ok(index)
    }

    /// Number of indexed tensors.
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    /// Whether no tensor was indexed.
    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    fn info(&self, r: &Rec) -> TensorInfo<'_> {
        let start = r.name_off as usize;
        TensorInfo {
            name: &self.arena[start..start + usize::from(r.name_len)],
            dtype: r.dtype,
            shard: r.shard,
            offset: r.offset,
            nbytes: r.nbytes,
            shape: r.shape,
            ndim: r.ndim,
        }
    }

    fn name_of(&self, i: usize) -> &str {
        let r = &self.recs[i];
        let start = r.name_off as usize;
        &self.arena[start..start + usize::from(r.name_len)]
    }

    fn find(&self, name: &str) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        let mask = self.table.len() - 1;
        let h = hash_name(name);
        let tag = slot_tag(h);
        let mut slot = h as usize & mask;
        loop {
            let e = self.table[slot];
            if e == EMPTY {
                return None;
            }
            if e & !SLOT_INDEX == tag {
                let i = (e & SLOT_INDEX) as usize;
                if self.name_of(i) == name {
                    return Some(i);
                }
            }
            slot = (slot + 1) & mask;
        }
    }

    /// Lookup by canonical name (a legacy-prefixed name is canonicalised first).
    pub fn get(&self, name: &str) -> Option<TensorInfo<'_>> {
        let name = names::canonical(name);
        self.find(&name).map(|i| self.info(&self.recs[i]))
    }

    /// All tensors in physical order: by shard, then by offset.
    pub fn iter(&self) -> impl Iterator<Item = TensorInfo<'_>> + '_ {
        self.recs.iter().map(|r| self.info(r))
    }

    /// Number of shard files.
    pub fn n_shards(&self) -> usize {
        self.shards.len()
    }

    /// Path of shard `shard`. Panics if `shard >= n_shards()`.
    pub fn shard_path(&self, shard: u16) -> &Path {
        &self.shards[usize::from(shard)].path
    }

    /// File size of shard `shard` in bytes. Panics if `shard >= n_shards()`.
    pub fn shard_len(&self, shard: u16) -> u64 {
        self.shards[usize::from(shard)].len
    }

    /// Absolute offset of the data region of shard `shard` (8 + header length).
    pub fn shard_data_start(&self, shard: u16) -> u64 {
        self.shards[usize::from(shard)].data_start
    }

    /// Whether the shard set came from `model.safetensors.index.json` (false: every
    /// `*.safetensors` file of the directory, which cannot tell a missing shard).
    pub fn listed_in_index_json(&self) -> bool {
        self.listed
    }

    /// Names of `TensorClass::Other` tensors left out of the index (dtype k3 does not read, or
    /// more than 4 dimensions).
    pub fn skipped(&self) -> &[String] {
        &self.skipped
    }

    /// Heap memory held by the index, in bytes.
    pub fn heap_bytes(&self) -> usize {
        self.recs.capacity() * std::mem::size_of::<Rec>()
            + self.arena.capacity()
            + self.table.capacity() * std::mem::size_of::<u32>()
            + self.shards.capacity() * std::mem::size_of::<ShardMeta>()
            + self
                .shards
                .iter()
                .map(|s| s.path.as_os_str().len())
                .sum::<usize>()
            + self.skipped.capacity() * std::mem::size_of::<String>()
            + self.skipped.iter().map(|s| s.capacity()).sum::<usize>()
    }

    /// Turns the per-shard differences between the weight_map and the headers into errors.
    fn report_weight_map(
        &self,
        index_path: &Path,
        files: &[String],
        diffs: Vec<WeightMapDiff>,
    ) -> Result<(), IndexError> {
        let mut errors = Vec::new();
        let err = |tensor: &str, msg: String| IndexError::WeightMap {
            index: index_path.to_path_buf(),
            tensor: tensor.to_string(),
            msg,
        };
        let misplaced: HashSet<&str> = diffs
            .iter()
            .flat_map(|d| d.not_in_header.iter().map(|s| s.as_str()))
            .collect();
        for (shard, d) in diffs.iter().enumerate() {
            let file = &files[shard];
            for name in &d.not_in_header {
                match self.find(name) {
                    Some(i) => errors.push(err(
                        name,
                        format!(
                            "listed in {file} but found in {}",
                            self.shard_path(self.recs[i].shard).display()
                        ),
                    )),
                    None if self.skipped.iter().any(|s| s == name) => errors.push(err(
                        name,
                        format!("listed in {file} but found in another shard"),
                    )),
                    None => errors.push(err(
                        name,
                        format!("listed in {file} but that shard's header has no such tensor"),
                    )),
                }
            }
            for name in &d.listed_twice {
                errors.push(err(name, "listed twice in the weight_map".into()));
            }
            for name in &d.not_listed {
                if !misplaced.contains(name.as_str()) {
                    errors.push(err(
                        name,
                        format!("present in {file} but not listed in the weight_map"),
                    ));
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(IndexError::from_list(errors))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// model.safetensors.index.json

/// The parsed weight_map: shard file names (sorted) and, per shard, the names listed for it.
struct WeightMap {
    files: Vec<String>,
    /// Every listed name (as spelled in the file), back to back.
    arena: String,
    /// Per shard: `(offset, len)` in `arena` of each name listed for that shard.
    by_shard: Vec<Vec<(u32, u32)>>,
}

impl WeightMap {
    fn names_of(&self, shard: usize) -> impl Iterator<Item = &str> + '_ {
        self.by_shard[shard]
            .iter()
            .map(|&(o, l)| &self.arena[o as usize..][..l as usize])
    }
}

fn valid_shard_file_name(f: &str) -> bool {
    !f.is_empty()
        && f != "."
        && f != ".."
        && !f.contains('/')
        && !f.contains('\\')
        && !f.contains('\0')
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, IndexError> {
    let io = |source| IndexError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len > max {
        return Err(IndexError::IndexJson {
            path: path.to_path_buf(),
            msg: format!("{len} bytes, more than the {max} accepted"),
        });
    }
    let mut buf = Vec::with_capacity(len as usize);
    f.by_ref().take(max).read_to_end(&mut buf).map_err(io)?;
    Ok(buf)
}

fn read_index_json(dir: &Path, path: &Path) -> Result<WeightMap, IndexError> {
    let buf = read_bounded(path, MAX_INDEX_JSON_BYTES)?;
    let json_err = |msg: String| IndexError::IndexJson {
        path: path.to_path_buf(),
        msg,
    };
    let mut raw = RawWeightMap::default();
    let mut de = serde_json::Deserializer::from_slice(&buf);
    IndexFileSeed(&mut raw)
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| json_err(format!("malformed: {e}")))?;
    drop(buf);
    if !raw.seen_weight_map {
        return Err(json_err("no `weight_map` object".into()));
    }
    if raw.entries.is_empty() {
        return Err(json_err("`weight_map` is empty".into()));
    }
    // Shard ids follow sorted file names.
    let mut order: Vec<usize> = (0..raw.files.len()).collect();
    order.sort_by(|&a, &b| raw.files[a].cmp(&raw.files[b]));
    let mut remap = vec![0u16; raw.files.len()];
    let mut files = Vec::with_capacity(raw.files.len());
    let mut errors = Vec::new();
    for (new, &old) in order.iter().enumerate() {
        let f = &raw.files[old];
        if !valid_shard_file_name(f) {
            errors.push(json_err(format!(
                "weight_map names shard `{f}`, which is not a plain file name"
            )));
        } else if !dir.join(f).is_file() {
            errors.push(IndexError::MissingShard {
                index: path.to_path_buf(),
                shard: f.clone(),
            });
        }
        remap[old] = new as u16;
        files.push(f.clone());
    }
    if !errors.is_empty() {
        return Err(IndexError::from_list(errors));
    }
    let mut by_shard: Vec<Vec<(u32, u32)>> = vec![Vec::new(); files.len()];
    for (o, l, s) in raw.entries {
        by_shard[usize::from(remap[usize::from(s)])].push((o, l));
    }
    Ok(WeightMap {
        files,
        arena: raw.arena,
        by_shard,
    })
}

#[derive(Default)]
struct RawWeightMap {
    files: Vec<String>,
    file_ids: HashMap<String, u16>,
    arena: String,
    /// `(offset, len)` in `arena`, shard id in `files`.
    entries: Vec<(u32, u32, u16)>,
    seen_weight_map: bool,
}

/// Top level of the index file: `weight_map` is read, everything else ignored.
struct IndexFileSeed<'a>(&'a mut RawWeightMap);

impl<'de> DeserializeSeed<'de> for IndexFileSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for IndexFileSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with a `weight_map`")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        while let Some(k) = m.next_key::<Str<'de>>()? {
            if k.0 == "weight_map" {
                if self.0.seen_weight_map {
                    return Err(de::Error::custom("`weight_map` appears twice"));
                }
                self.0.seen_weight_map = true;
                m.next_value_seed(WeightMapSeed(&mut *self.0))?;
            } else {
                m.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

struct WeightMapSeed<'a>(&'a mut RawWeightMap);

impl<'de> DeserializeSeed<'de> for WeightMapSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for WeightMapSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map from tensor name to shard file name")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        let w = self.0;
        while let Some(name) = m.next_key::<Str<'de>>()? {
            let file = m.next_value::<Str<'de>>()?;
            let id = match w.file_ids.get(file.0.as_ref()) {
                Some(&id) => id,
                None => {
                    if w.files.len() >= usize::from(u16::MAX) {
                        return Err(de::Error::custom("more than 65535 shard files"));
                    }
                    let id = w.files.len() as u16;
                    w.files.push(file.0.to_string());
                    w.file_ids.insert(file.0.into_owned(), id);
                    id
                }
            };
            // The file is at most 1 GiB, so offsets and lengths fit in u32.
            let off = w.arena.len() as u32;
            w.arena.push_str(&name.0);
            w.entries.push((off, name.0.len() as u32, id));
        }
        Ok(())
    }
}

/// A string borrowed from the input when it has no escapes.
struct Str<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

fn scan_shards(dir: &Path) -> Result<Vec<String>, IndexError> {
    let io = |source| IndexError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name.ends_with(".safetensors") && entry.path().is_file() {
            files.push(name);
        }
    }
    files.sort();
    Ok(files)
}

// ---------------------------------------------------------------------------------------------
// Shard headers

/// What one shard contributes.
struct ShardOut {
    recs: Vec<Rec>,
    arena: String,
    skipped: Vec<String>,
    len: u64,
    data_start: u64,
    diff: WeightMapDiff,
}

/// Reads every shard header, in parallel when there are several cores. Results are in `paths`
/// order.
fn read_all_shards(paths: &[PathBuf], wm: Option<&WeightMap>) -> Vec<Result<ShardOut, IndexError>> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(paths.len())
        .clamp(1, 16);
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<Result<ShardOut, IndexError>>> =
        (0..paths.len()).map(|_| None).collect();
    let worker = || {
        let mut mine = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= paths.len() {
                break;
            }
            mine.push((i, read_shard(&paths[i], i as u16, wm)));
        }
        mine
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads).map(|_| s.spawn(worker)).collect();
        let mut all = worker();
        for h in handles {
            match h.join() {
                Ok(v) => all.extend(v),
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        for (i, r) in all {
            results[i] = Some(r);
        }
    });
    results
        .into_iter()
        .zip(paths)
        .map(|(r, p)| {
            r.unwrap_or_else(|| {
                Err(IndexError::Header {
                    path: p.clone(),
                    msg: "shard was not read".into(),
                })
            })
        })
        .collect()
}

fn read_shard(path: &Path, shard: u16, wm: Option<&WeightMap>) -> Result<ShardOut, IndexError> {
    let io = |source| IndexError::Io {
        path: path.to_path_buf(),
        source,
    };
    let header_err = |msg: String| IndexError::Header {
        path: path.to_path_buf(),
        msg,
    };
    let mut f = File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len < 8 {
        return Err(header_err(format!(
            "file is {len} bytes, shorter than the 8-byte header length"
        )));
    }
    let mut lenbuf = [0u8; 8];
    f.read_exact(&mut lenbuf).map_err(io)?;
    let header_len = u64::from_le_bytes(lenbuf);
    if header_len > len - 8 {
        return Err(header_err(format!(
            "header length {header_len} exceeds the {} bytes after the length field \
             (truncated or not a safetensors file)",
            len - 8
        )));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(header_err(format!(
            "header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(io)?;
    drop(f);
    let data_start = 8 + header_len;
    let mut b = ShardBuilder {
        path,
        shard,
        data_len: len - data_start,
        data_start,
        recs: Vec::new(),
        arena: String::new(),
        skipped: Vec::new(),
        error: None,
    };
    let mut de = serde_json::Deserializer::from_slice(&header);
    let parsed = HeaderSeed(&mut b)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    if let Some(e) = b.error.take() {
        return Err(e);
    }
    parsed.map_err(|e| header_err(format!("malformed header JSON: {e}")))?;
    check_overlaps(path, &mut b.recs, &b.arena)?;
    let diff = match wm {
        Some(wm) => diff_weight_map(wm.names_of(usize::from(shard)), &b),
        None => WeightMapDiff::default(),
    };
    b.recs.shrink_to_fit();
    Ok(ShardOut {
        recs: b.recs,
        arena: b.arena,
        skipped: b.skipped,
        len,
        data_start,
        diff,
    })
}

/// How a shard's header differs from what the weight_map lists for it.
#[derive(Default)]
struct WeightMapDiff {
    not_in_header: Vec<String>,
    not_listed: Vec<String>,
    listed_twice: Vec<String>,
}

/// Compares (sorted, canonical) listed names with the header's names. Each list is capped.
fn diff_weight_map<'a>(
    listed: impl Iterator<Item = &'a str>,
    b: &ShardBuilder<'_>,
) -> WeightMapDiff {
    const CAP: usize = MAX_LISTED_ERRORS + 1;
    let mut want: Vec<Cow<'a, str>> = listed.map(names::canonical).collect();
    want.sort_unstable();
    let mut have: Vec<&str> = b
        .recs
        .iter()
        .map(|r| &b.arena[r.name_off as usize..][..usize::from(r.name_len)])
        .chain(b.skipped.iter().map(|s| s.as_str()))
        .collect();
    have.sort_unstable();
    let mut d = WeightMapDiff::default();
    let push = |v: &mut Vec<String>, s: &str| {
        if v.len() < CAP {
            v.push(s.to_string());
        }
    };
    let (mut i, mut j) = (0, 0);
    while i < want.len() || j < have.len() {
        if i > 0 && i < want.len() && want[i] == want[i - 1] {
            push(&mut d.listed_twice, &want[i]);
            i += 1;
            continue;
        }
        match (want.get(i), have.get(j)) {
            (Some(w), Some(h)) if w.as_ref() == *h => {
                i += 1;
                j += 1;
            }
            (Some(w), Some(h)) if w.as_ref() < *h => {
                push(&mut d.not_in_header, w);
                i += 1;
            }
            (Some(w), None) => {
                push(&mut d.not_in_header, w);
                i += 1;
            }
            (_, Some(h)) => {
                push(&mut d.not_listed, h);
                j += 1;
            }
            (None, None) => break,
        }
    }
    d
}

/// Sorts the records by offset and rejects tensors whose bytes overlap.
fn check_overlaps(path: &Path, recs: &mut [Rec], arena: &str) -> Result<(), IndexError> {
    recs.sort_unstable_by_key(|r| (r.offset, r.nbytes));
    let name = |r: &Rec| arena[r.name_off as usize..][..usize::from(r.name_len)].to_string();
    for w in recs.windows(2) {
        // Ends cannot overflow: both are bounded by the file size.
        if w[1].nbytes > 0 && w[0].offset + w[0].nbytes > w[1].offset {
            if name(&w[0]) == name(&w[1]) {
                return Err(IndexError::Tensor {
                    path: path.to_path_buf(),
                    tensor: name(&w[1]),
                    msg: "appears twice in this header".into(),
                });
            }
            return Err(IndexError::Tensor {
                path: path.to_path_buf(),
                tensor: name(&w[1]),
                msg: format!("its bytes overlap those of `{}`", name(&w[0])),
            });
        }
    }
    Ok(())
}

/// Accumulates one shard's records while its header is parsed.
struct ShardBuilder<'p> {
    path: &'p Path,
    shard: u16,
    data_len: u64,
    data_start: u64,
    recs: Vec<Rec>,
    arena: String,
    skipped: Vec<String>,
    /// The first validation error (parsing stops there).
    error: Option<IndexError>,
}

/// Bytes per element of safetensors dtypes k3 does not read (to bounds-check skipped tensors).
fn other_dtype_size(s: &str) -> Option<u64> {
    Some(match s {
        "BOOL" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "I16" | "U16" => 2,
        "I32" | "U32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

impl ShardBuilder<'_> {
    fn fail(&mut self, tensor: &str, msg: String) {
        self.error = Some(IndexError::Tensor {
            path: self.path.to_path_buf(),
            tensor: tensor.to_string(),
            msg,
        });
    }

    /// Validates one header entry and records it. `Err(())` = stop (error stored).
    fn add(&mut self, raw_name: &str, e: RawEntry<'_>) -> Result<(), ()> {
        let name = names::canonical(raw_name);
        let class = names::classify(&name);
        let [begin, end] = e.data_offsets;
        if begin > end {
            self.fail(&name, format!("data_offsets [{begin}, {end}] are inverted"));
            return Err(());
        }
        if end > self.data_len {
            self.fail(
                &name,
                format!(
                    "data_offsets end {end} is past the end of the data ({} bytes after the \
                     header; file truncated?)",
                    self.data_len
                ),
            );
            return Err(());
        }
        let span = end - begin;
        let Some(numel) = e.shape.numel else {
            self.fail(&name, "shape product overflows u64".into());
            return Err(());
        };
        let dtype = Dtype::parse(&e.dtype);
        let elem = match dtype {
            Some(d) => Some(d.size() as u64),
            None => other_dtype_size(&e.dtype),
        };
        if let Some(elem) = elem {
            match numel.checked_mul(elem) {
                Some(n) if n == span => {}
                Some(n) => {
                    self.fail(
                        &name,
                        format!(
                            "shape {:?} × {} bytes = {n} bytes, but data_offsets span {span} \
                             bytes",
                            e.shape.dims(),
                            elem
                        ),
                    );
                    return Err(());
                }
                None => {
                    self.fail(&name, "shape × dtype size overflows u64".into());
                    return Err(());
                }
            }
        }
        let needed = class != TensorClass::Other;
        let Some(dtype) = dtype else {
            if needed {
                self.fail(
                    &name,
                    format!(
                        "dtype {} is not one k3 reads (BF16, F16, F32, U8, I8)",
                        e.dtype
                    ),
                );
                return Err(());
            }
            self.skipped.push(name.into_owned());
            return Ok(());
        };
        if e.shape.ndim > MAX_NDIM {
            if needed {
                self.fail(
                    &name,
                    format!("{} dimensions (at most {MAX_NDIM} supported)", e.shape.ndim),
                );
                return Err(());
            }
            self.skipped.push(name.into_owned());
            return Ok(());
        }
        let name_len = match u16::try_from(name.len()) {
            Ok(n) => n,
            Err(_) => {
                let mut cut = 64;
                while !name.is_char_boundary(cut) {
                    cut -= 1;
                }
                self.fail(
                    &format!("{}…", &name[..cut]),
                    "name longer than 65535 bytes".into(),
                );
                return Err(());
            }
        };
        let name_off = match u32::try_from(self.arena.len()) {
            Ok(n) => n,
            Err(_) => {
                self.fail(&name, "shard header holds more than 4 GiB of names".into());
                return Err(());
            }
        };
        self.arena.push_str(&name);
        self.recs.push(Rec {
            offset: self.data_start + begin,
            nbytes: span,
            shape: e.shape.dims,
            name_off,
            name_len,
            shard: self.shard,
            dtype,
            ndim: e.shape.ndim as u8,
        });
        Ok(())
    }
}

/// A header entry as parsed.
#[derive(Deserialize)]
struct RawEntry<'a> {
    #[serde(borrow)]
    dtype: Cow<'a, str>,
    shape: RawShape,
    data_offsets: [u64; 2],
}

/// A shape: the first four dims, the true number of dims, and the checked element count.
struct RawShape {
    dims: [u64; MAX_NDIM],
    ndim: usize,
    numel: Option<u64>,
}

impl RawShape {
    fn dims(&self) -> &[u64] {
        &self.dims[..self.ndim.min(MAX_NDIM)]
    }
}

impl<'de> Deserialize<'de> for RawShape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawShape;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of dimensions")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<RawShape, A::Error> {
                let mut r = RawShape {
                    dims: [0; MAX_NDIM],
                    ndim: 0,
                    numel: Some(1),
                };
                while let Some(x) = s.next_element::<u64>()? {
                    if r.ndim < MAX_NDIM {
                        r.dims[r.ndim] = x;
                    }
                    r.ndim += 1;
                    r.numel = r.numel.and_then(|n| n.checked_mul(x));
                }
                Ok(r)
            }
        }
        d.deserialize_seq(V)
    }
}

/// The header object: `__metadata__` is skipped, every other key is a tensor.
struct HeaderSeed<'a, 'p>(&'a mut ShardBuilder<'p>);

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a safetensors header object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        while let Some(k) = m.next_key::<Str<'de>>()? {
            if k.0 == "__metadata__" {
                m.next_value::<IgnoredAny>()?;
                continue;
            }
            let entry: RawEntry<'de> = m
                .next_value()
                .map_err(|e| de::Error::custom(format_args!("tensor `{}`: {e}", k.0)))?;
            if self.0.add(&k.0, entry).is_err() {
                return Err(de::Error::custom("invalid tensor"));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Merge

fn merge(outs: Vec<ShardOut>, paths: Vec<PathBuf>) -> Result<CheckpointIndex, IndexError> {
    let n: usize = outs.iter().map(|o| o.recs.len()).sum();
    let arena_len: usize = outs.iter().map(|o| o.arena.len()).sum();
    if n > MAX_TENSORS || arena_len > u32::MAX as usize {
        return Err(IndexError::Limit {
            msg: format!("{n} tensors with {arena_len} bytes of names exceed the index limits"),
        });
    }
    let mut recs = Vec::with_capacity(n);
    let mut arena = String::with_capacity(arena_len);
    let mut skipped = Vec::new();
    let mut shards = Vec::with_capacity(outs.len());
    for (o, path) in outs.into_iter().zip(paths) {
        let base = arena.len() as u32;
        arena.push_str(&o.arena);
        recs.extend(o.recs.into_iter().map(|mut r| {
            r.name_off += base;
            r
        }));
        skipped.extend(o.skipped);
        shards.push(ShardMeta {
            path,
            len: o.len,
            data_start: o.data_start,
        });
    }
    let cap = (n + n / 2).next_power_of_two().max(16);
    let mut index = CheckpointIndex {
        recs,
        arena,
        table: vec![EMPTY; cap],
        shards,
        skipped,
        listed: false,
    };
    let mask = cap - 1;
    let mut errors = Vec::new();
    for i in 0..n {
        let name = index.name_of(i);
        let h = hash_name(name);
        let tag = slot_tag(h);
        let mut slot = h as usize & mask;
        loop {
            let e = index.table[slot];
            if e == EMPTY {
                // i < MAX_TENSORS, so the entry is never all ones.
                index.table[slot] = tag | i as u32;
                break;
            }
            let j = e & SLOT_INDEX;
            if e & !SLOT_INDEX == tag && index.name_of(j as usize) == name {
                errors.push(IndexError::Duplicate {
                    tensor: name.to_string(),
                    first: index.shard_path(index.recs[j as usize].shard).to_path_buf(),
                    second: index.shard_path(index.recs[i].shard).to_path_buf(),
                });
                break;
            }
            slot = (slot + 1) & mask;
        }
        if errors.len() > MAX_LISTED_ERRORS {
            break;
        }
    }
    // Skipped names may also collide with indexed ones or each other.
    if errors.is_empty() && !index.skipped.is_empty() {
        let mut seen = HashSet::new();
        for s in &index.skipped {
            if index.find(s).is_some() || !seen.insert(s.as_str()) {
                errors.push(IndexError::Repeated { tensor: s.clone() });
            }
        }
    }
    if !errors.is_empty() {
        return Err(IndexError::from_list(errors));
    }
    Ok(index)
}
