//! [`TrunkLayout`]: where each layer's trunk run is read from (a packed `trunk.bin`, or the
//! checkpoint's shards), where its tensors sit in it, and the check a read run must pass.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k3_proto::quant::QuantKind;

use super::format::{bound_checksum, TensorHashes, TrunkCodec, TRUNK_BIN};
use super::pack::contiguous_run;
use crate::runtime::catalog::{Catalog, TensorExtent};
use crate::runtime::io::{span_len, AlignedBuf, DiskFile, FileStamp, ReadError, ALIGN};
use crate::runtime::ring::{ChecksumMismatch, Runs};
use crate::runtime::source::{LayerLayout, Storage, TensorLoc};

/// Copy chunk of whole-run reads (`k3-ctl verify`): constant memory whatever the layer size.
const CHUNK: u64 = 64 << 20;

/// A piece of a scattered layer: bytes `[off, off+len)` of `shard` go to `dst` in the buffer.
#[derive(Clone, Debug)]
pub(super) struct Piece {
    pub shard: u16,
    pub off: u64,
    pub len: u64,
    pub dst: u64,
}

/// Where a layer's bytes come from.
#[derive(Clone, Debug)]
pub(super) enum RunSource {
    /// A run in `trunk.bin`.
    Packed { file_off: u64 },
    /// One contiguous run in a shard.
    Contiguous { shard: u16, off: u64 },
    /// Tensor by tensor, assembled into this module's own layout.
    Scattered { pieces: Vec<Piece> },
}

/// What a packed run's bytes must hash to (format 5): its layer's descriptor digest and the bound
/// checksum `trunk.json` records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunCheck {
    /// [`super::format::layer_digest`] of the layer's descriptors as opened.
    pub digest: u64,
    /// The recorded [`super::format::bound_checksum`].
    pub want: u64,
}

/// How to read one layer and where its tensors land.
#[derive(Clone, Debug)]
pub struct LayerPlan {
    /// Length of the run (the region handed to the engine).
    pub run_len: u64,
    /// Tensor offsets inside the run.
    pub layout: Arc<LayerLayout>,
    /// What the run must hash to (`None` when read from the shards).
    pub check: Option<RunCheck>,
    /// XXH3-64 of each CHECKPOINT tensor recorded in `trunk.json` (`None` when read from the
    /// shards).
    pub tensor_xxh3: Option<Arc<BTreeMap<String, u64>>>,
    pub(super) source: RunSource,
}

/// The read plan for every layer's trunk.
#[derive(Debug)]
pub struct TrunkLayout {
    pub(super) layers: Vec<Option<LayerPlan>>,
    pub(super) shards: Vec<Arc<DiskFile>>,
    pub(super) packed: Option<Arc<DiskFile>>,
    pub(super) packed_dir: Option<PathBuf>,
    pub(super) trunk_id: Option<u128>,
    pub(super) seal: Option<u128>,
    pub(super) codec: Option<TrunkCodec>,
}

/// Open every shard file of a catalog (shared by trunk streaming and the expert cache).
pub fn open_shards(cat: &Catalog) -> Result<Vec<Arc<DiskFile>>, ReadError> {
    cat.shard_paths()
        .iter()
        .map(|p| DiskFile::open(p).map(Arc::new))
        .collect()
}

/// The plan of a layer read from one contiguous run of its shard.
fn contiguous_plan(ts: &[TensorExtent], shard: u16, start: u64, len: u64) -> LayerPlan {
    LayerPlan {
        run_len: len,
        layout: Arc::new(LayerLayout::new(
            ts.iter()
                .map(|t| TensorLoc {
                    name: t.name.clone(),
                    off: t.off - start,
                    nbytes: t.nbytes,
                    dtype: t.dtype,
                    storage: Storage::Raw,
                    source_xxh3: None,
                })
                .collect(),
        )),
        check: None,
        tensor_xxh3: None,
        source: RunSource::Contiguous { shard, off: start },
    }
}

/// The plan of a layer whose tensors are read one by one into a buffer (64-byte aligned, in
/// checkpoint order).
fn scattered_plan(ts: &[TensorExtent]) -> LayerPlan {
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
            storage: Storage::Raw,
            source_xxh3: None,
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
        check: None,
        tensor_xxh3: None,
        source: RunSource::Scattered { pieces },
    }
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
                    Ok((shard, start, len)) => contiguous_plan(ts, shard, start, len),
                    Err(_) => scattered_plan(ts),
                })
            })
            .collect();
        TrunkLayout {
            layers,
            shards,
            packed: None,
            packed_dir: None,
            trunk_id: None,
            seal: None,
            codec: None,
        }
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Check layer `l`'s run bytes (as handed to the engine) against the bound checksum
    /// `trunk.json` records for it (SPEC.md §6.1: the run's bytes and the layer's descriptors);
    /// a layer read from the shards has none and always passes. The error names the layer, both
    /// checksums and the file.
    pub fn verify_run(&self, l: usize, run: &[u8]) -> Result<(), ChecksumMismatch> {
        let Some(check) = self.plan(l).and_then(|p| p.check) else {
            return Ok(());
        };
        let got = bound_checksum(check.digest, run);
        if got == check.want {
            return Ok(());
        }
        let file = self
            .packed
            .as_ref()
            .map(|f| f.path().display().to_string())
            .unwrap_or_else(|| TRUNK_BIN.into());
        Err(ChecksumMismatch {
            layer: l,
            file,
            bytes: run.len(),
            got,
            want: check.want,
        })
    }

    /// The bound checksum of layer `l`'s run as this layout reads it (from `trunk.bin`), and the
    /// XXH3-64 of each of its tensors as stored (by name), read in chunks of at most 64 MiB
    /// whatever the layer size: what `k3-ctl verify --trunk` compares with `trunk.json` (the
    /// stored bytes of a raw tensor are the checkpoint's, and hash to its recorded `xxh3`).
    /// A layer read from the shards has no bound checksum: its plain XXH3-64 is returned.
    /// `on_bytes` is called with the bytes of each chunk read.
    pub fn checksum_layer_tensors(
        &self,
        l: usize,
        on_bytes: &mut dyn FnMut(u64),
    ) -> Result<(u64, BTreeMap<String, u64>), ReadError> {
        let p = self
            .plan(l)
            .ok_or_else(|| ReadError::msg(format!("layer {l} is not in the checkpoint")))?;
        let mut per_tensor = TensorHashes::new(
            (p.layout.tensors().iter()).map(|t| (t.name.clone(), t.off, t.nbytes)),
        );
        let finish = |plain: u64| match p.check {
            Some(c) => super::format::bound_checksum_of(c.digest, plain),
            None => plain,
        };
        let Some((f, off, len)) = self.span_file(l)? else {
            let mut buf = AlignedBuf::zeroed(self.buf_len(l) as usize).map_err(ReadError::msg)?;
            let inner = self.read_layer(l, buf.as_mut_slice())?;
            let run = &buf.as_slice()[inner..inner + p.run_len as usize];
            on_bytes(run.len() as u64);
            per_tensor.feed(0, run);
            return Ok((
                finish(super::format::run_checksum(run)),
                per_tensor.finish(),
            ));
        };
        let chunk = len.min(CHUNK);
        let mut buf = AlignedBuf::zeroed(chunk as usize + 2 * ALIGN).map_err(ReadError::msg)?;
        let mut h = twox_hash::XxHash3_64::new();
        let mut done = 0u64;
        while done < len {
            let take = (len - done).min(chunk);
            let inner = f.read_span(off + done, take, buf.as_mut_slice())?;
            let bytes = &buf.as_slice()[inner..inner + take as usize];
            std::hash::Hasher::write(&mut h, bytes);
            per_tensor.feed(done, bytes);
            done += take;
            on_bytes(take);
        }
        Ok((finish(std::hash::Hasher::finish(&h)), per_tensor.finish()))
    }

    /// Tensor `name` of layer `l` as stored (from `trunk.bin`, or the checkpoint's bytes when
    /// read from the shards): a buffer and where the tensor starts in it.
    pub fn read_tensor(&self, l: usize, name: &str) -> Result<(AlignedBuf, usize, u64), ReadError> {
        let p = self
            .plan(l)
            .ok_or_else(|| ReadError::msg(format!("layer {l} is not in the checkpoint")))?;
        let t = (p.layout.get(name))
            .ok_or_else(|| ReadError::msg(format!("layer {l} has no tensor {name}")))?;
        let (f, at) = match (&p.source, self.span_file(l)?) {
            (_, Some((f, off, _))) => (f, off + t.off),
            (RunSource::Scattered { pieces }, None) => {
                let pc = (pieces.iter().find(|pc| pc.dst == t.off))
                    .ok_or_else(|| ReadError::msg(format!("{name}: no piece at {}", t.off)))?;
                (self.shard(pc.shard)?, pc.off)
            }
            _ => {
                return Err(ReadError::msg(format!(
                    "layer {l}: {name} cannot be located"
                )))
            }
        };
        let need =
            span_len(at, t.nbytes).ok_or_else(|| ReadError::msg(format!("{name}: too large")))?;
        let mut buf = AlignedBuf::zeroed(need as usize).map_err(ReadError::msg)?;
        let inner = f.read_span(at, t.nbytes, buf.as_mut_slice())?;
        Ok((buf, inner, t.nbytes))
    }

    /// The trunk identity of a packed trunk ([`super::format::trunk_id`]; `None` when read from
    /// the shards).
    pub fn trunk_id(&self) -> Option<u128> {
        self.trunk_id
    }

    /// The seal of a packed trunk ([`super::format::seal`]): equal seals, equal descriptors and
    /// layer checksums (`None` when read from the shards).
    pub fn seal(&self) -> Option<u128> {
        self.seal
    }

    /// How the packed trunk was packed (`None` when read from the shards: the checkpoint's
    /// bytes).
    pub fn codec(&self) -> Option<TrunkCodec> {
        self.codec
    }

    /// The quantization of a lossy trunk (`None`: exact).
    pub fn quant(&self) -> Option<QuantKind> {
        self.codec.and_then(TrunkCodec::quant)
    }

    /// What a store tells its clients about this trunk (`k3_proto::wire::TrunkInfo`): the
    /// codec, the seal and, when lossy, the label its outputs carry.
    pub fn info(&self) -> k3_proto::wire::TrunkInfo {
        k3_proto::wire::TrunkInfo {
            codec: self.codec.map_or(String::new(), |c| c.name().to_string()),
            seal: self.seal.map_or(String::new(), |s| format!("{s:032x}")),
            lossy: self
                .quant()
                .map_or(String::new(), k3_proto::quant::lossy_label),
        }
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
            .ok_or_else(|| ReadError::msg(format!("layer {l} is not in the checkpoint")))?;
        Ok(match &p.source {
            RunSource::Packed { file_off } => {
                let f = self
                    .packed
                    .as_ref()
                    .ok_or_else(|| ReadError::msg("no trunk.bin"))?;
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
            return Err(ReadError::msg(format!(
                "layer {l} is not in the checkpoint"
            )));
        };
        if (dst.len() as u64) < *run_len {
            return Err(ReadError::msg(format!(
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
    /// buffer, written into `window` (`at` a multiple of [`crate::runtime::io::ALIGN`], `window`
    /// aligned; see [`DiskFile::read_span_window`]). Returns the run's offset in the whole buffer,
    /// like `read_layer`. Only for [`TrunkLayout::windowed`] layers.
    pub fn read_layer_window(
        &self,
        l: usize,
        window: &mut [u8],
        at: usize,
    ) -> Result<usize, ReadError> {
        match self.span_file(l)? {
            Some((f, off, len)) => f.read_span_window(off, len, window, at),
            None => Err(ReadError::msg(format!(
                "layer {l} is scattered over its shards: it cannot be read by windows"
            ))),
        }
    }

    fn shard(&self, s: u16) -> Result<&DiskFile, ReadError> {
        self.shards
            .get(s as usize)
            .map(|f| &**f)
            .ok_or_else(|| ReadError::msg(format!("shard {s} is not open")))
    }
}

/// The trunk's layers as the ring streams them: a layer's run is bytes of the pack (or of the
/// shards), whatever they encode.
impl Runs for TrunkLayout {
    fn count(&self) -> usize {
        self.n_layers()
    }
    fn buf_len(&self, l: usize) -> u64 {
        TrunkLayout::buf_len(self, l)
    }
    fn run_len(&self, l: usize) -> u64 {
        self.plan(l).map_or(0, |p| p.run_len)
    }
    fn windowed(&self, l: usize) -> bool {
        TrunkLayout::windowed(self, l)
    }
    fn read(&self, l: usize, dst: &mut [u8]) -> Result<usize, ReadError> {
        self.read_layer(l, dst)
    }
    fn read_window(&self, l: usize, dst: &mut [u8], at: usize) -> Result<usize, ReadError> {
        self.read_layer_window(l, dst, at)
    }
    fn verify(&self, l: usize, run: &[u8]) -> Result<(), ChecksumMismatch> {
        self.verify_run(l, run)
    }
    fn stamp(&self, l: usize) -> Option<FileStamp> {
        let (f, _, _) = self.span_file(l).ok()??;
        f.stamp()
    }
}
