//! The packed trunk (`trunk.bin` + `trunk.json`, SPEC.md §6.1) and the per-layer read plan.
//!
//! A layer's *trunk* is every non-expert tensor of the layer (attention, norms, router, shared
//! experts). Packing copies each layer's trunk run verbatim into `trunk.bin`, each run starting at a
//! 4096-aligned offset and padded to a multiple of 4096, so a layer is one `O_DIRECT` read.
//!
//! **Contiguity rule** (the packer's precondition): sorted by offset, a layer's trunk tensors lie
//! in one shard and each starts exactly where the previous one ends. Safetensors has no padding
//! between tensor data (the format forbids holes in the byte buffer), so any gap means some other
//! tensor sits between two trunk tensors; the packer refuses rather than copying foreign bytes.
//!
//! Without a packed trunk a [`TrunkLayout`] reads layers straight from the shards: a contiguous
//! layer is still one read; otherwise each tensor is read into its own place in a buffer laid out
//! by this module (64-byte aligned, name order).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use k3_proto::Dtype;
use serde::{Deserialize, Serialize};

use crate::catalog::{Catalog, TensorExtent};
use crate::io::{align_down, align_up, span_len, AlignedBuf, DiskFile, ReadError, ALIGN};
use crate::source::{LayerLayout, TensorLoc};

/// File names inside a packed-trunk directory.
pub const TRUNK_BIN: &str = "trunk.bin";
/// See [`TRUNK_BIN`].
pub const TRUNK_JSON: &str = "trunk.json";

/// Largest `trunk.json` we agree to parse (the real one is a few hundred KB).
const MAX_JSON_BYTES: u64 = 64 << 20;

/// One tensor in `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonTensor {
    /// Offset inside the layer run.
    pub off: u64,
    /// Byte length.
    pub nbytes: u64,
    /// Element type (`"BF16"`, `"F32"`, …).
    pub dtype: Dtype,
}

/// One layer in `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonLayer {
    /// Offset of the run in `trunk.bin` (a multiple of `align`).
    pub file_off: u64,
    /// Run length (unpadded).
    pub nbytes: u64,
    /// Tensors by full checkpoint name.
    pub tensors: BTreeMap<String, JsonTensor>,
}

/// Identity of the checkpoint a trunk was packed from (k3 addition; optional when reading).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonModel {
    /// Decoder layers packed.
    pub n_layers: usize,
    /// Sum of the unpadded run lengths.
    pub trunk_bytes: u64,
    /// FNV-1a 64 over the packed tensors' (name, dtype, nbytes), hex.
    pub tensors_hash: String,
}

/// The whole `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkJson {
    /// Run alignment in `trunk.bin` (4096).
    pub align: u64,
    /// Checkpoint identity (absent in files written by kimi-k3-in-c).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<JsonModel>,
    /// One entry per layer, index = layer.
    pub layers: Vec<JsonLayer>,
}

/// Why packing or opening a packed trunk did not happen.
#[derive(Debug, thiserror::Error)]
pub enum TrunkError {
    /// The checkpoint or the packed trunk does not satisfy the format (exit 2).
    #[error("{0}")]
    Refused(String),
    /// A read or write failed (exit 1).
    #[error("{0}")]
    Io(String),
}

impl From<ReadError> for TrunkError {
    fn from(e: ReadError) -> Self {
        TrunkError::Io(e.0)
    }
}

/// FNV-1a 64 over (name, dtype, nbytes) of the given tensors in order.
fn tensors_hash<'a>(it: impl Iterator<Item = (&'a str, Dtype, u64)>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: &[u8]| {
        for &x in b {
            h ^= x as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (n, d, b) in it {
        eat(n.as_bytes());
        eat(&[0]);
        eat(d.name().as_bytes());
        eat(&b.to_le_bytes());
    }
    format!("{h:016x}")
}

/// Check a layer's trunk tensors form one contiguous run in one shard; returns (shard, start, len).
pub fn contiguous_run(l: usize, ts: &[TensorExtent]) -> Result<(u16, u64, u64), String> {
    let mut v: Vec<&TensorExtent> = ts.iter().collect();
    v.sort_by_key(|t| (t.shard, t.off));
    let first = v
        .first()
        .ok_or_else(|| format!("layer {l} has no trunk tensors in the checkpoint"))?;
    let mut end = first.off;
    for t in &v {
        if t.shard != first.shard {
            return Err(format!(
                "layer {l}: trunk tensors span two shards ({} in shard {}, {} in shard {})",
                first.name, first.shard, t.name, t.shard
            ));
        }
        if t.off != end {
            return Err(format!(
                "layer {l}: trunk tensors are not one contiguous run: {} starts at {} but the \
                 previous trunk tensor ends at {end} (another tensor lies between them)",
                t.name, t.off
            ));
        }
        end = t.off + t.nbytes;
    }
    Ok((first.shard, first.off, end - first.off))
}

/// Progress of [`pack_trunk`], reported after each layer.
#[derive(Clone, Debug)]
pub struct PackProgress {
    /// Layers done.
    pub layers_done: usize,
    /// Layers in total.
    pub layers_total: usize,
    /// Bytes copied so far.
    pub bytes_done: u64,
    /// Bytes to copy in total.
    pub bytes_total: u64,
}

/// What [`pack_trunk`] produced.
#[derive(Clone, Debug)]
pub struct PackSummary {
    /// Layers packed.
    pub layers: usize,
    /// Unpadded trunk bytes copied.
    pub bytes: u64,
    /// Size of `trunk.bin` (with padding).
    pub file_bytes: u64,
    /// Largest run.
    pub largest_run: u64,
    /// Wall seconds.
    pub seconds: f64,
}

/// Copy chunk for packing: constant memory whatever the layer size.
const PACK_CHUNK: u64 = 64 << 20;

/// Pack every layer's trunk run of `cat` into `out_dir/trunk.bin` + `trunk.json`.
///
/// Every layer is checked before anything is written. `trunk.json` is written last (through a
/// temporary file and a rename), and any old one is removed first, so an interrupted pack never
/// leaves a `trunk.json` describing a different `trunk.bin`.
pub fn pack_trunk(
    cat: &Catalog,
    out_dir: &Path,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<PackSummary, TrunkError> {
    let t0 = Instant::now();
    let n = cat.n_layers();
    let mut runs = Vec::with_capacity(n);
    for l in 0..n {
        let r = contiguous_run(l, cat.trunk(l)).map_err(TrunkError::Refused)?;
        runs.push(r);
    }
    let bytes_total: u64 = runs.iter().map(|r| r.2).sum();
    std::fs::create_dir_all(out_dir)
        .map_err(|e| TrunkError::Io(format!("cannot create {}: {e}", out_dir.display())))?;
    let json_path = out_dir.join(TRUNK_JSON);
    let bin_path = out_dir.join(TRUNK_BIN);
    match std::fs::remove_file(&json_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(TrunkError::Io(format!(
                "cannot remove {}: {e}",
                json_path.display()
            )))
        }
    }
    let werr = |e: std::io::Error| TrunkError::Io(format!("writing {}: {e}", bin_path.display()));
    let out = std::fs::File::create(&bin_path).map_err(werr)?;
    let mut files: Vec<Option<DiskFile>> = (0..cat.shard_paths().len()).map(|_| None).collect();
    let mut buf = AlignedBuf::zeroed(PACK_CHUNK as usize + 2 * ALIGN).map_err(TrunkError::Io)?;
    let mut layers = Vec::with_capacity(n);
    let mut pos = 0u64;
    let mut done = 0u64;
    let mut largest = 0u64;
    for (l, &(shard, start, len)) in runs.iter().enumerate() {
        let f = match &mut files[shard as usize] {
            Some(f) => f,
            slot => slot.insert(DiskFile::open(&cat.shard_paths()[shard as usize])?),
        };
        let mut copied = 0u64;
        while copied < len {
            let take = (len - copied).min(PACK_CHUNK);
            let inner = f.read_span(start + copied, take, buf.as_mut_slice())?;
            write_sparse(
                &out,
                pos + copied,
                &buf.as_slice()[inner..inner + take as usize],
            )
            .map_err(werr)?;
            copied += take;
        }
        // The padding up to the next 4 KiB boundary is left as a hole (reads as zeros).
        let padded = align_up(len).ok_or_else(|| TrunkError::Refused("run too large".into()))?;
        let tensors = cat
            .trunk(l)
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    JsonTensor {
                        off: t.off - start,
                        nbytes: t.nbytes,
                        dtype: t.dtype,
                    },
                )
            })
            .collect();
        layers.push(JsonLayer {
            file_off: pos,
            nbytes: len,
            tensors,
        });
        pos += padded;
        done += len;
        largest = largest.max(len);
        progress(&PackProgress {
            layers_done: l + 1,
            layers_total: n,
            bytes_done: done,
            bytes_total,
        });
    }
    // Holes at the end (an all-zero last block, padding) still count toward the length.
    out.set_len(pos).map_err(werr)?;
    out.sync_all().map_err(werr)?;
    drop(out);
    let json = TrunkJson {
        align: ALIGN as u64,
        model: Some(JsonModel {
            n_layers: n,
            trunk_bytes: bytes_total,
            tensors_hash: tensors_hash((0..n).flat_map(|l| {
                cat.trunk(l)
                    .iter()
                    .map(|t| (t.name.as_str(), t.dtype, t.nbytes))
            })),
        }),
        layers,
    };
    let text = serde_json::to_string_pretty(&json)
        .map_err(|e| TrunkError::Io(format!("serialising trunk.json: {e}")))?;
    let tmp = out_dir.join("trunk.json.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &json_path))
        .map_err(|e| TrunkError::Io(format!("writing {}: {e}", json_path.display())))?;
    Ok(PackSummary {
        layers: n,
        bytes: bytes_total,
        file_bytes: pos,
        largest_run: largest,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Write `data` at `off`, leaving every all-zero 4 KiB block (aligned to the file) as a hole: a
/// sparse checkpoint (or a real one with zero pages) packs into a sparse `trunk.bin` with the
/// same bytes. The caller sets the final file length.
fn write_sparse(out: &std::fs::File, off: u64, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut i = 0usize;
    while i < data.len() {
        // Blocks follow the file's 4 KiB grid so holes are whole filesystem blocks.
        let block_end = (align_down(off + i as u64) + ALIGN as u64 - off) as usize;
        let end = block_end.min(data.len());
        let block = &data[i..end];
        if block.iter().any(|&b| b != 0) {
            out.write_all_at(block, off + i as u64)?;
        }
        i = end;
    }
    Ok(())
}

/// A piece of a scattered layer: bytes `[off, off+len)` of `shard` go to `dst` in the buffer.
#[derive(Clone, Debug)]
struct Piece {
    shard: u16,
    off: u64,
    len: u64,
    dst: u64,
}

/// Where a layer's bytes come from.
#[derive(Clone, Debug)]
enum RunSource {
    /// A run in `trunk.bin`.
    Packed { file_off: u64 },
    /// One contiguous run in a shard.
    Contiguous { shard: u16, off: u64 },
    /// Tensor by tensor, assembled into this module's own layout.
    Scattered { pieces: Vec<Piece> },
}

/// How to read one layer and where its tensors land.
#[derive(Clone, Debug)]
pub struct LayerPlan {
    /// Length of the run (the region handed to the engine).
    pub run_len: u64,
    /// Tensor offsets inside the run.
    pub layout: Arc<LayerLayout>,
    source: RunSource,
}

/// The read plan for every layer's trunk.
#[derive(Debug)]
pub struct TrunkLayout {
    layers: Vec<Option<LayerPlan>>,
    shards: Vec<Arc<DiskFile>>,
    packed: Option<Arc<DiskFile>>,
    packed_dir: Option<PathBuf>,
}

/// Open every shard file of a catalog (shared by trunk streaming and the expert cache).
pub fn open_shards(cat: &Catalog) -> Result<Vec<Arc<DiskFile>>, ReadError> {
    cat.shard_paths()
        .iter()
        .map(|p| DiskFile::open(p).map(Arc::new))
        .collect()
}

impl TrunkLayout {
    /// Read layers straight from the shards (no packed trunk).
    pub fn from_catalog(cat: &Catalog, shards: Vec<Arc<DiskFile>>) -> TrunkLayout {
        let layers = (0..cat.n_layers())
            .map(|l| {
                let ts = cat.trunk(l);
                if ts.is_empty() {
                    return None;
                }
                Some(match contiguous_run(l, ts) {
                    Ok((shard, start, len)) => LayerPlan {
                        run_len: len,
                        layout: Arc::new(LayerLayout::new(
                            ts.iter()
                                .map(|t| TensorLoc {
                                    name: t.name.clone(),
                                    off: t.off - start,
                                    nbytes: t.nbytes,
                                    dtype: t.dtype,
                                })
                                .collect(),
                        )),
                        source: RunSource::Contiguous { shard, off: start },
                    },
                    Err(_) => {
                        let mut pos = 0u64;
                        let mut locs = Vec::with_capacity(ts.len());
                        let mut pieces = Vec::with_capacity(ts.len());
                        let mut sorted: Vec<&TensorExtent> = ts.iter().collect();
                        sorted.sort_by_key(|t| (t.shard, t.off));
                        for t in sorted {
                            locs.push(TensorLoc {
                                name: t.name.clone(),
                                off: pos,
                                nbytes: t.nbytes,
                                dtype: t.dtype,
                            });
                            pieces.push(Piece {
                                shard: t.shard,
                                off: t.off,
                                len: t.nbytes,
                                dst: pos,
                            });
                            pos = (pos + t.nbytes).div_ceil(64) * 64;
                        }
                        LayerPlan {
                            run_len: pos,
                            layout: Arc::new(LayerLayout::new(locs)),
                            source: RunSource::Scattered { pieces },
                        }
                    }
                })
            })
            .collect();
        TrunkLayout {
            layers,
            shards,
            packed: None,
            packed_dir: None,
        }
    }

    /// Read layers from a packed trunk in `dir`, validated against the catalog: every trunk
    /// tensor the checkpoint has for a layer must be in `trunk.json` with the same length and
    /// dtype (and nothing else), every tensor must lie inside its run, and every run inside
    /// `trunk.bin`.
    pub fn from_packed(
        cat: &Catalog,
        shards: Vec<Arc<DiskFile>>,
        dir: &Path,
    ) -> Result<TrunkLayout, TrunkError> {
        let jp = dir.join(TRUNK_JSON);
        let refuse = |m: String| TrunkError::Refused(format!("{}: {m}", jp.display()));
        let meta = std::fs::metadata(&jp)
            .map_err(|e| TrunkError::Refused(format!("cannot read {}: {e}", jp.display())))?;
        if meta.len() > MAX_JSON_BYTES {
            return Err(refuse(format!("{} bytes is implausibly large", meta.len())));
        }
        let text = std::fs::read_to_string(&jp)
            .map_err(|e| TrunkError::Refused(format!("cannot read {}: {e}", jp.display())))?;
        let json: TrunkJson =
            serde_json::from_str(&text).map_err(|e| refuse(format!("not a trunk.json: {e}")))?;
        let bin = DiskFile::open(&dir.join(TRUNK_BIN)).map_err(|e| TrunkError::Refused(e.0))?;
        if json.align == 0 {
            return Err(refuse("align is 0".into()));
        }
        if let Some(m) = &json.model {
            if m.n_layers != json.layers.len() {
                return Err(refuse(format!(
                    "model.n_layers {} but {} layer entries",
                    m.n_layers,
                    json.layers.len()
                )));
            }
        }
        if json.layers.len() < cat.n_layers() {
            return Err(refuse(format!(
                "has {} layers, the checkpoint needs {}",
                json.layers.len(),
                cat.n_layers()
            )));
        }
        let mut layers = Vec::with_capacity(cat.n_layers());
        for l in 0..cat.n_layers() {
            let jl = &json.layers[l];
            let ts = cat.trunk(l);
            if ts.is_empty() {
                layers.push(None);
                continue;
            }
            if !jl.file_off.is_multiple_of(json.align) {
                return Err(refuse(format!(
                    "layer {l}: file_off {} is not a multiple of align {}",
                    jl.file_off, json.align
                )));
            }
            match jl.file_off.checked_add(jl.nbytes) {
                Some(end) if end <= bin.len() => {}
                _ => {
                    return Err(refuse(format!(
                        "layer {l}: run {}..+{} lies outside trunk.bin ({} bytes)",
                        jl.file_off,
                        jl.nbytes,
                        bin.len()
                    )))
                }
            }
            if jl.tensors.len() != ts.len() {
                let extra: Vec<&str> = jl
                    .tensors
                    .keys()
                    .filter(|k| ts.iter().all(|t| &t.name != *k))
                    .map(String::as_str)
                    .collect();
                if !extra.is_empty() {
                    return Err(refuse(format!(
                        "layer {l}: tensors not in the checkpoint: {}",
                        extra.join(", ")
                    )));
                }
            }
            let mut locs = Vec::with_capacity(ts.len());
            for t in ts {
                let jt = jl.tensors.get(&t.name).ok_or_else(|| {
                    refuse(format!(
                        "layer {l}: {} is missing (packed from another checkpoint?)",
                        t.name
                    ))
                })?;
                if jt.nbytes != t.nbytes || jt.dtype != t.dtype {
                    return Err(refuse(format!(
                        "layer {l}: {} is {} {} bytes in trunk.json but {} {} bytes in the checkpoint",
                        t.name, jt.dtype, jt.nbytes, t.dtype, t.nbytes
                    )));
                }
                match jt.off.checked_add(jt.nbytes) {
                    Some(end) if end <= jl.nbytes => {}
                    _ => {
                        return Err(refuse(format!(
                            "layer {l}: {} at {}..+{} lies outside its run of {} bytes",
                            t.name, jt.off, jt.nbytes, jl.nbytes
                        )))
                    }
                }
                locs.push(TensorLoc {
                    name: t.name.clone(),
                    off: jt.off,
                    nbytes: jt.nbytes,
                    dtype: jt.dtype,
                });
            }
            layers.push(Some(LayerPlan {
                run_len: jl.nbytes,
                layout: Arc::new(LayerLayout::new(locs)),
                source: RunSource::Packed {
                    file_off: jl.file_off,
                },
            }));
        }
        Ok(TrunkLayout {
            layers,
            shards,
            packed: Some(Arc::new(bin)),
            packed_dir: Some(dir.to_path_buf()),
        })
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// The packed-trunk directory, if reading from one.
    pub fn packed_dir(&self) -> Option<&Path> {
        self.packed_dir.as_deref()
    }

    /// True when every read goes through `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        match &self.packed {
            Some(p) => p.is_direct(),
            None => self.shards.iter().all(|s| s.is_direct()),
        }
    }

    /// The plan of layer `l` (`None` when the checkpoint lacks the layer).
    pub fn plan(&self, l: usize) -> Option<&LayerPlan> {
        self.layers.get(l)?.as_ref()
    }

    /// Buffer bytes needed to read layer `l` with [`TrunkLayout::read_layer`] (0 if absent).
    pub fn buf_len(&self, l: usize) -> u64 {
        let Some(p) = self.plan(l) else { return 0 };
        match &p.source {
            RunSource::Packed { file_off } => span_len(*file_off, p.run_len).unwrap_or(u64::MAX),
            RunSource::Contiguous { off, .. } => span_len(*off, p.run_len).unwrap_or(u64::MAX),
            RunSource::Scattered { .. } => p.run_len,
        }
    }

    /// Layer `l`'s run when it is one contiguous file range: the file and `(offset, length)`.
    /// `Ok(None)` for a run scattered over its shards.
    fn span_file(&self, l: usize) -> Result<Option<(&DiskFile, u64, u64)>, ReadError> {
        let p = self
            .plan(l)
            .ok_or_else(|| ReadError(format!("layer {l} is not in the checkpoint")))?;
        Ok(match &p.source {
            RunSource::Packed { file_off } => {
                let f = self
                    .packed
                    .as_ref()
                    .ok_or_else(|| ReadError("no trunk.bin".into()))?;
                Some((f, *file_off, p.run_len))
            }
            RunSource::Contiguous { shard, off } => Some((self.shard(*shard)?, *off, p.run_len)),
            RunSource::Scattered { .. } => None,
        })
    }

    /// Read layer `l` into `dst` (4096-aligned, at least [`TrunkLayout::buf_len`] bytes). Returns
    /// the offset in `dst` where the run starts.
    pub fn read_layer(&self, l: usize, dst: &mut [u8]) -> Result<usize, ReadError> {
        if let Some((f, off, len)) = self.span_file(l)? {
            return f.read_span(off, len, dst);
        }
        let Some(LayerPlan {
            run_len,
            source: RunSource::Scattered { pieces },
            ..
        }) = self.plan(l)
        else {
            return Err(ReadError(format!("layer {l} is not in the checkpoint")));
        };
        if (dst.len() as u64) < *run_len {
            return Err(ReadError(format!(
                "layer {l}: buffer of {} bytes, needs {run_len}",
                dst.len()
            )));
        }
        for pc in pieces {
            let d = &mut dst[pc.dst as usize..(pc.dst + pc.len) as usize];
            self.shard(pc.shard)?.read_exact_at(pc.off, d)?;
        }
        Ok(0)
    }

    /// True when layer `l` can be read window by window ([`TrunkLayout::read_layer_window`]):
    /// its run is one contiguous file range (packed, or contiguous in its shard).
    pub fn windowed(&self, l: usize) -> bool {
        self.plan(l)
            .is_some_and(|p| !matches!(p.source, RunSource::Scattered { .. }))
    }

    /// The part `[at, at + window.len())` of what [`TrunkLayout::read_layer`] writes into its
    /// buffer, written into `window` (`at` a multiple of [`crate::io::ALIGN`], `window` aligned;
    /// see [`DiskFile::read_span_window`]). Returns the run's offset in the whole buffer, like
    /// `read_layer`. Only for [`TrunkLayout::windowed`] layers.
    pub fn read_layer_window(
        &self,
        l: usize,
        window: &mut [u8],
        at: usize,
    ) -> Result<usize, ReadError> {
        match self.span_file(l)? {
            Some((f, off, len)) => f.read_span_window(off, len, window, at),
            None => Err(ReadError(format!(
                "layer {l} is scattered over its shards: it cannot be read by windows"
            ))),
        }
    }

    fn shard(&self, s: u16) -> Result<&DiskFile, ReadError> {
        self.shards
            .get(s as usize)
            .map(|f| &**f)
            .ok_or_else(|| ReadError(format!("shard {s} is not open")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, Spec};

    fn layer_bytes(t: &TrunkLayout, l: usize) -> (Vec<u8>, Arc<LayerLayout>) {
        let mut buf = AlignedBuf::zeroed(t.buf_len(l) as usize).unwrap();
        let inner = t.read_layer(l, buf.as_mut_slice()).unwrap();
        let p = t.plan(l).unwrap();
        (
            buf.as_slice()[inner..inner + p.run_len as usize].to_vec(),
            p.layout.clone(),
        )
    }

    fn check_all_layers(t: &TrunkLayout, spec: &Spec) {
        for l in 0..spec.n_layers {
            let (run, layout) = layer_bytes(t, l);
            let want = fixture::trunk_tensors(spec, l);
            assert_eq!(layout.tensors().len(), want.len());
            for (name, _, _) in want {
                let loc = layout.get(&name).unwrap();
                let got = &run[loc.off as usize..(loc.off + loc.nbytes) as usize];
                assert_eq!(
                    got,
                    &fixture::expected_tensor(spec, &name)[..],
                    "layer {l} {name}"
                );
            }
        }
    }

    #[test]
    fn pack_then_read_packed_and_unpacked_give_the_tensors() {
        let spec = Spec::small(5, 3);
        let w = fixture::write(&spec, "pack");
        let out = w.dir.join("packed");
        let mut seen = Vec::new();
        let s = pack_trunk(&w.catalog, &out, &mut |p| seen.push(p.layers_done)).unwrap();
        assert_eq!(seen, vec![1, 2, 3, 4, 5]);
        assert_eq!(s.layers, 5);
        let total: u64 = (0..5).map(|l| w.catalog.trunk_bytes(l)).sum();
        assert_eq!(s.bytes, total);
        let bin_len = std::fs::metadata(out.join(TRUNK_BIN)).unwrap().len();
        assert_eq!(bin_len, s.file_bytes);
        assert_eq!(bin_len % 4096, 0);
        let json: TrunkJson =
            serde_json::from_str(&std::fs::read_to_string(out.join(TRUNK_JSON)).unwrap()).unwrap();
        assert_eq!(json.align, 4096);
        for jl in &json.layers {
            assert_eq!(jl.file_off % 4096, 0);
        }
        let shards = open_shards(&w.catalog).unwrap();
        let packed = TrunkLayout::from_packed(&w.catalog, shards.clone(), &out).unwrap();
        check_all_layers(&packed, &spec);
        let direct = TrunkLayout::from_catalog(&w.catalog, shards);
        check_all_layers(&direct, &spec);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn pack_refuses_a_non_contiguous_layer_and_direct_reading_still_works() {
        let mut spec = Spec::small(4, 2);
        spec.scattered_layers = vec![2];
        let w = fixture::write(&spec, "scatter");
        let out = w.dir.join("packed");
        let e = pack_trunk(&w.catalog, &out, &mut |_| {}).unwrap_err();
        match e {
            TrunkError::Refused(m) => {
                assert!(m.contains("layer 2") && m.contains("contiguous"), "{m}")
            }
            other => panic!("expected refusal, got {other}"),
        }
        assert!(!out.join(TRUNK_JSON).exists());
        let t = TrunkLayout::from_catalog(&w.catalog, open_shards(&w.catalog).unwrap());
        check_all_layers(&t, &spec);
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    #[test]
    fn packed_trunk_is_validated_against_the_checkpoint() {
        let spec = Spec::small(3, 2);
        let w = fixture::write(&spec, "validate");
        let out = w.dir.join("packed");
        pack_trunk(&w.catalog, &out, &mut |_| {}).unwrap();
        let jp = out.join(TRUNK_JSON);
        let good: TrunkJson = serde_json::from_str(&std::fs::read_to_string(&jp).unwrap()).unwrap();
        let shards = open_shards(&w.catalog).unwrap();
        let try_with = |j: &TrunkJson| {
            std::fs::write(&jp, serde_json::to_string(j).unwrap()).unwrap();
            match TrunkLayout::from_packed(&w.catalog, shards.clone(), &out) {
                Err(TrunkError::Refused(m)) => m,
                Err(e) => panic!("expected refusal, got {e}"),
                Ok(_) => panic!("accepted a bad trunk.json"),
            }
        };
        let name = layer_name_q(1);
        let mut j = good.clone();
        j.layers[1].tensors.get_mut(&name).unwrap().nbytes -= 2;
        assert!(try_with(&j).contains("bytes in the checkpoint"));
        let mut j = good.clone();
        j.layers[1].tensors.get_mut(&name).unwrap().dtype = Dtype::F32;
        assert!(try_with(&j).contains(&name));
        let mut j = good.clone();
        j.layers[1].tensors.remove(&name);
        assert!(try_with(&j).contains("missing"));
        let mut j = good.clone();
        j.layers[2].tensors.get_mut(&layer_name_q(2)).unwrap().off = j.layers[2].nbytes;
        assert!(try_with(&j).contains("outside its run"));
        let mut j = good.clone();
        j.layers[2].file_off += 4096 * 1000;
        assert!(try_with(&j).contains("outside trunk.bin"));
        let mut j = good.clone();
        j.layers[0].file_off += 8;
        assert!(try_with(&j).contains("align"));
        let mut j = good.clone();
        j.layers.pop();
        assert!(try_with(&j).contains("model.n_layers"));
        j.model = None;
        assert!(try_with(&j).contains("needs 3"));
        let mut j = good.clone();
        j.layers[0].tensors.insert(
            "language_model.model.layers.0.extra".into(),
            JsonTensor {
                off: 0,
                nbytes: 2,
                dtype: Dtype::BF16,
            },
        );
        assert!(try_with(&j).contains("not in the checkpoint"));
        std::fs::write(&jp, "{\"align\": 4096").unwrap();
        assert!(matches!(
            TrunkLayout::from_packed(&w.catalog, shards.clone(), &out),
            Err(TrunkError::Refused(_))
        ));
        // Restored file is accepted again (the checks above are not vacuous).
        std::fs::write(&jp, serde_json::to_string(&good).unwrap()).unwrap();
        TrunkLayout::from_packed(&w.catalog, shards, &out).unwrap();
        std::fs::remove_dir_all(&w.dir).unwrap();
    }

    fn layer_name_q(l: usize) -> String {
        fixture::layer_name(l, "self_attn.q_proj.weight")
    }

    #[test]
    fn contiguity_rule_rejects_gaps_overlaps_and_two_shards() {
        let t = |name: &str, shard, off, nbytes| TensorExtent {
            name: name.into(),
            dtype: Dtype::BF16,
            shard,
            off,
            nbytes,
        };
        assert_eq!(
            contiguous_run(0, &[t("b", 0, 110, 10), t("a", 0, 100, 10)]).unwrap(),
            (0, 100, 20)
        );
        assert!(contiguous_run(0, &[t("a", 0, 100, 10), t("b", 0, 112, 10)]).is_err());
        assert!(contiguous_run(0, &[t("a", 0, 100, 10), t("b", 0, 105, 10)]).is_err());
        assert!(contiguous_run(0, &[t("a", 0, 100, 10), t("b", 1, 110, 10)]).is_err());
        assert!(contiguous_run(0, &[]).is_err());
    }
}

#[cfg(test)]
mod sparse_tests {
    use super::write_sparse;

    #[test]
    fn zero_blocks_become_holes_and_bytes_are_kept() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        // 64 blocks of zeros with a few non-zero bytes straddling block boundaries, written at
        // an unaligned offset.
        let mut data = vec![0u8; 64 * 4096];
        data[5] = 1;
        data[4095] = 2;
        data[4096] = 3;
        data[40 * 4096 + 17] = 4;
        let off = 100u64;
        write_sparse(&f, off, &data).unwrap();
        f.set_len(off + data.len() as u64 + 4096).unwrap();
        drop(f);
        let back = std::fs::read(&p).unwrap();
        assert_eq!(&back[off as usize..off as usize + data.len()], &data[..]);
        assert!(back[..off as usize].iter().all(|&b| b == 0));
        assert!(back[off as usize + data.len()..].iter().all(|&b| b == 0));
        // Only the blocks holding non-zero bytes were allocated (tmpfs and ext4 both report it).
        let allocated = std::fs::metadata(&p).unwrap().blocks() * 512;
        assert!(
            allocated <= 8 * 4096,
            "{allocated} bytes allocated for 4 non-zero blocks"
        );
    }
}
