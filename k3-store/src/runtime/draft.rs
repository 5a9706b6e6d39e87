//! The draft trunk (`draft.bin` + `draft.json`, SPEC.md §6.10): a quantized copy of every
//! layer's trunk that a worker holds in RAM to draft ids for speculative decoding.
//!
//! **Packing** ([`pack_draft`], `k3-ctl pack-trunk --draft int8|int4`): each layer's trunk run
//! is read, and every BF16 matrix `[rows, cols]` with `rows > 1` and `cols` a multiple of 32 is
//! quantized
//! (`k3_proto::quant`): its codes keep the tensor's name (`I8` or `U8`), its scales are added as
//! name + `.qscale` (`F32`). `kv_b_proj` stays BF16 (MLA applies `W_UKᵀ` from its rows), and so do
//! the small vectors (norms, biases, conv kernels), copied verbatim. Tensors are laid out in name
//! order at 64-byte offsets; each run starts at a 4096-byte offset of `draft.bin`.
//!
//! **Identity and integrity** (draft format [`DRAFT_FORMAT`]): `draft.json` records its `kind`,
//! the model identity it was packed from (`model.model_id` and `model.id_kind`, the checkpoint's
//! content identity, [`ModelIdentity`], as the packed trunk records it) and each run's XXH3-64. [`DraftSource::open`] refuses (exit 2) another
//! format, another checkpoint (both identities named), fewer layers than the run needs, a run or
//! tensor outside its file or run, and a run whose checksum does not match: every run is checked
//! when it is loaded. A draft model is lossy by design, but it must be the draft of THIS model.
//!
//! **Serving** ([`DraftSource`]): the whole file is read once into memory; layers are served
//! from it, the model-level tensors (embedding, lm_head, final norm, output AttnRes) are the
//! target source's own regions. A draft source reads no routed expert: a draft model runs its
//! MoE layers either on the shared experts alone, or also on the routed experts the target's
//! cache holds right now ([`ResidentExperts`], [`WeightSource::resident_experts`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use k3_proto::quant::{quantizable, quantize_bf16, QuantKind, SCALE_SUFFIX};
use k3_proto::Dtype;
use serde::{Deserialize, Serialize};

use crate::runtime::catalog::Catalog;
use crate::runtime::identity::{IdentityKind, ModelIdentity};
use crate::runtime::io::{align_up, AlignedBuf, DiskFile, ALIGN};
use crate::runtime::source::{
    ExpertBatch, LayerLayout, LayerRun, Region, SourceError, SourceStats, TensorLoc, WeightSource,
};
use crate::runtime::trunk::{
    model_dir_of, open_shards, parse_hash, run_checksum, write_packed, write_sparse, Interrupt,
    JsonLayer, JsonModel, JsonTensor, PackProgress, PackSummary, TrunkError, TrunkLayout,
};

/// File names inside a draft-trunk directory.
pub const DRAFT_BIN: &str = "draft.bin";
/// See [`DRAFT_BIN`].
pub const DRAFT_JSON: &str = "draft.json";
/// The draft format this code writes and accepts (2: bound to the model's content identity,
/// `model.model_id` + `model.id_kind`; 1 recorded the sampled `checkpoint_id`).
pub const DRAFT_FORMAT: u32 = 2;
/// Largest `draft.json` parsed.
const MAX_JSON_BYTES: u64 = 64 << 20;
/// Tensor alignment inside a run.
const TENSOR_ALIGN: u64 = 64;

/// The whole `draft.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftJson {
    /// [`DRAFT_FORMAT`].
    pub format: u32,
    /// int8 or int4.
    pub kind: QuantKind,
    /// Run alignment in `draft.bin` (4096).
    pub align: u64,
    /// The checkpoint the draft was made from (`trunk_bytes` = the draft's run bytes).
    pub model: JsonModel,
    /// One entry per layer.
    pub layers: Vec<JsonLayer>,
}

/// One layer's draft run: the bytes and where each tensor sits.
fn draft_run(
    kind: QuantKind,
    index: &k3_proto::safetensors::CheckpointIndex,
    layout: &LayerLayout,
    run: &[u8],
) -> Result<(Vec<u8>, BTreeMap<String, JsonTensor>), TrunkError> {
    let mut out = Vec::new();
    let mut tensors = BTreeMap::new();
    let mut put = |name: String, dtype: Dtype, bytes: &[u8], out: &mut Vec<u8>| {
        let off = align_to(out.len() as u64, TENSOR_ALIGN);
        out.resize(off as usize, 0);
        out.extend_from_slice(bytes);
        tensors.insert(
            name,
            JsonTensor {
                off,
                nbytes: bytes.len() as u64,
                dtype,
                xxh3: String::new(),
                codec: None,
                stored: None,
            },
        );
    };
    for t in layout.tensors() {
        let bytes = usize::try_from(t.off)
            .ok()
            .zip(usize::try_from(t.nbytes).ok())
            .and_then(|(o, n)| run.get(o..o.checked_add(n)?))
            .ok_or_else(|| TrunkError::draft(format!("{} lies outside its layer run", t.name)))?;
        let info = index
            .get(&t.name)
            .ok_or_else(|| TrunkError::draft(format!("{} is not in the index", t.name)))?;
        let shape = info.shape();
        if !quantizable(&t.name, t.dtype, shape) {
            put(t.name.clone(), t.dtype, bytes, &mut out);
            continue;
        }
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        if bytes.len() != rows * cols * 2 {
            return Err(TrunkError::draft(format!(
                "{}: {} bytes for BF16 {shape:?}",
                t.name,
                bytes.len()
            )));
        }
        let (codes, scales) = quantize_bf16(kind, bytes, rows, cols)
            .map_err(|e| TrunkError::draft(format!("{}: {e}", t.name)))?;
        let dt = match kind {
            QuantKind::Int8 => Dtype::I8,
            QuantKind::Int4 => Dtype::U8,
        };
        put(t.name.clone(), dt, &codes, &mut out);
        put(
            format!("{}{SCALE_SUFFIX}", t.name),
            Dtype::F32,
            &scales,
            &mut out,
        );
    }
    Ok((out, tensors))
}

fn align_to(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Pack the draft trunk of the checkpoint in `model_dir` into `out_dir/draft.bin` +
/// `draft.json` (written under temporary names and renamed into place, like a packed trunk).
pub fn pack_draft(
    model_dir: &Path,
    out_dir: &Path,
    kind: QuantKind,
    stop: &Interrupt,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<PackSummary, TrunkError> {
    let t0 = Instant::now();
    let cfg = k3_proto::config::ModelConfig::load(&model_dir.join("config.json"))
        .map_err(|e| TrunkError::draft(format!("{}: {e}", model_dir.display())))?;
    let index = k3_proto::safetensors::CheckpointIndex::open(model_dir)
        .map_err(|e| TrunkError::draft(format!("checkpoint index {}: {e}", model_dir.display())))?;
    let cat = Catalog::from_index(&index, &cfg).map_err(|e| TrunkError::draft(e.to_string()))?;
    let id = ModelIdentity::of(&cat)?;
    let layout = TrunkLayout::from_catalog(&cat, open_shards(&cat)?);
    let n = cat.n_layers();
    let bytes_total: u64 = (0..n).map(|l| cat.trunk_bytes(l)).sum();
    let (mut pos, mut largest, mut written) = (0u64, 0u64, 0u64);
    write_packed(out_dir, DRAFT_BIN, DRAFT_JSON, stop, &mut |out, werr| {
        let mut layers = Vec::with_capacity(n);
        let mut done = 0u64;
        for l in 0..n {
            stop.check()?;
            let plan = layout
                .plan(l)
                .ok_or_else(|| TrunkError::draft(format!("layer {l} has no trunk tensors")))?;
            let len = usize::try_from(layout.buf_len(l))
                .map_err(|_| TrunkError::draft(format!("layer {l} is too large")))?;
            let mut buf = AlignedBuf::zeroed(len)?;
            let at = layout.read_layer(l, buf.as_mut_slice())?;
            let run = &buf.as_slice()[at..at + plan.run_len as usize];
            layout.verify_run(l, run)?;
            let (bytes, tensors) = draft_run(kind, &index, &plan.layout, run)?;
            write_sparse(out, pos, &bytes).map_err(werr)?;
            layers.push(JsonLayer {
                file_off: pos,
                nbytes: bytes.len() as u64,
                xxh3: format!("{:016x}", run_checksum(&bytes)),
                tensors,
            });
            let padded =
                align_up(bytes.len() as u64).ok_or_else(|| TrunkError::draft("run too large"))?;
            pos += padded;
            written += bytes.len() as u64;
            largest = largest.max(bytes.len() as u64);
            done += plan.run_len;
            progress(&PackProgress {
                layers_done: l + 1,
                layers_total: n,
                bytes_done: done,
                bytes_total,
            });
        }
        let json = DraftJson {
            format: DRAFT_FORMAT,
            kind,
            align: ALIGN as u64,
            model: JsonModel::of(n, written, &id),
            layers,
        };
        let text = serde_json::to_string_pretty(&json).map_err(|e| TrunkError::Write {
            path: out_dir.join(DRAFT_JSON),
            source: e.into(),
        })?;
        Ok((pos, text))
    })?;
    Ok(PackSummary {
        layers: n,
        bytes: written,
        file_bytes: pos,
        largest_run: largest,
        seconds: t0.elapsed().as_secs_f64(),
        stored_as: BTreeMap::from([(kind.name(), n)]),
    })
}

/// The bytes of `draft.bin` and the runs in it, as listed by `draft.json`.
fn read_json(dir: &Path) -> Result<DraftJson, TrunkError> {
    let jp = dir.join(DRAFT_JSON);
    let refuse = |m: String| TrunkError::draft(format!("{}: {m}", jp.display()));
    let meta = std::fs::metadata(&jp)
        .map_err(|e| TrunkError::draft(format!("cannot read {}: {e}", jp.display())))?;
    if meta.len() > MAX_JSON_BYTES {
        return Err(refuse(format!("{} bytes is implausibly large", meta.len())));
    }
    let text = std::fs::read_to_string(&jp)
        .map_err(|e| TrunkError::draft(format!("cannot read {}: {e}", jp.display())))?;
    let json: DraftJson =
        serde_json::from_str(&text).map_err(|e| refuse(format!("not a draft.json: {e}")))?;
    if json.format != DRAFT_FORMAT {
        return Err(refuse(format!(
            "draft format {} (this k3 reads {DRAFT_FORMAT}): re-run `k3-ctl pack-trunk --draft`",
            json.format
        )));
    }
    if json.model.n_layers != json.layers.len() {
        return Err(refuse(format!(
            "model.n_layers {} but {} layer entries",
            json.model.n_layers,
            json.layers.len()
        )));
    }
    Ok(json)
}

/// A checked `draft.json` of the checkpoint a worker or the store runs: where each layer's run
/// lies in `draft.bin`, its checksum and its tensors.
#[derive(Debug)]
pub struct DraftFile {
    dir: PathBuf,
    json: DraftJson,
    layouts: Vec<Arc<LayerLayout>>,
    sums: Vec<u64>,
}

impl DraftFile {
    /// Read `dir/draft.json` and check it against the checkpoint `cat` describes for the first
    /// `n_layers` layers: format, identity, layer count, every tensor inside its run, a
    /// checksum per run (refusals, exit 2). The runs themselves are checked when read.
    pub fn open(dir: &Path, cat: &Catalog, n_layers: usize) -> Result<DraftFile, TrunkError> {
        let mut json = read_json(dir)?;
        let jp = dir.join(DRAFT_JSON);
        let refuse = |m: String| TrunkError::draft(format!("{}: {m}", jp.display()));
        let packed = parse_hash(&json.model.model_id, 32);
        let packed_kind = IdentityKind::parse(&json.model.id_kind);
        let (Some(packed), Some(packed_kind)) = (packed, packed_kind) else {
            return Err(refuse(format!(
                "model.model_id {:?} / model.id_kind {:?}: missing, zero or malformed",
                json.model.model_id, json.model.id_kind
            )));
        };
        let id = ModelIdentity::of(cat)?;
        if (packed, packed_kind) != (id.id, id.kind) {
            return Err(refuse(format!(
                "made from model {packed:032x} ({}), but {} is model {id}: re-run `k3-ctl pack-trunk --draft {} {} {}`",
                packed_kind.name(),
                model_dir_of(cat),
                json.kind.name(),
                model_dir_of(cat),
                dir.display()
            )));
        }
        if json.layers.len() < n_layers {
            return Err(refuse(format!(
                "{} layers, the model runs {n_layers}",
                json.layers.len()
            )));
        }
        json.layers.truncate(n_layers);
        let mut layouts = Vec::with_capacity(n_layers);
        let mut sums = Vec::with_capacity(n_layers);
        for (l, jl) in json.layers.iter().enumerate() {
            if jl.file_off.checked_add(jl.nbytes).is_none() {
                return Err(refuse(format!("layer {l}: the run's end overflows")));
            }
            sums.push(
                parse_hash(&jl.xxh3, 16).ok_or_else(|| refuse(format!("layer {l}: no checksum")))?
                    as u64,
            );
            let mut tensors = Vec::with_capacity(jl.tensors.len());
            for (name, t) in &jl.tensors {
                if t.off.checked_add(t.nbytes).is_none_or(|e| e > jl.nbytes) {
                    return Err(refuse(format!("{name} lies outside layer {l}'s run")));
                }
                tensors.push(TensorLoc {
                    name: name.clone(),
                    off: t.off,
                    nbytes: t.nbytes,
                    dtype: t.dtype,
                    storage: Default::default(),
                    source_xxh3: None,
                });
            }
            layouts.push(Arc::new(LayerLayout::new(tensors)));
        }
        Ok(DraftFile {
            dir: dir.to_path_buf(),
            json,
            layouts,
            sums,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// int8 or int4.
    pub fn kind(&self) -> QuantKind {
        self.json.kind
    }

    /// Layers described.
    pub fn n_layers(&self) -> usize {
        self.json.layers.len()
    }

    /// Layer `l`'s run: `(offset in draft.bin, bytes)`.
    pub fn run(&self, l: usize) -> (u64, u64) {
        let jl = &self.json.layers[l];
        (jl.file_off, jl.nbytes)
    }

    /// Bytes of the runs.
    pub fn run_bytes(&self) -> u64 {
        self.json.layers.iter().map(|l| l.nbytes).sum()
    }

    /// Where the last described run ends in `draft.bin`.
    pub fn end(&self) -> u64 {
        resident_bytes(&self.json, self.n_layers())
    }

    /// Open `draft.bin` (a refusal if it is missing or shorter than the runs).
    pub fn open_bin(&self) -> Result<DiskFile, TrunkError> {
        let path = self.dir.join(DRAFT_BIN);
        let bin = DiskFile::open(&path).map_err(|e| TrunkError::draft(e.0))?;
        let end = self.end();
        if end > bin.len() {
            return Err(TrunkError::draft(format!(
                "{}: runs end at byte {end}, the file has {} bytes",
                path.display(),
                bin.len()
            )));
        }
        Ok(bin)
    }

    /// Check layer `l`'s run bytes against its checksum (a refusal naming a damaged file).
    pub fn verify(&self, l: usize, run: &[u8]) -> Result<(), TrunkError> {
        if run.len() as u64 != self.run(l).1 || run_checksum(run) != self.sums[l] {
            return Err(TrunkError::draft(format!(
                "{}: layer {l}: the run's checksum does not match (a damaged draft.bin): re-pack it",
                self.dir.join(DRAFT_BIN).display()
            )));
        }
        Ok(())
    }

    /// A draft source over `runs` (the runs of layers `0..runs.len()`, already checked) with the
    /// target's model-level tensors from `model_tensor`.
    pub fn source(
        &self,
        runs: Vec<Region>,
        model_tensor: &dyn Fn(&str) -> Result<Region, SourceError>,
    ) -> Result<DraftSource, TrunkError> {
        if runs.len() > self.n_layers() {
            return Err(TrunkError::draft(format!(
                "{} draft runs for {} layers",
                runs.len(),
                self.n_layers()
            )));
        }
        let runs = runs
            .into_iter()
            .zip(&self.layouts)
            .enumerate()
            .map(|(layer, (region, layout))| LayerRun {
                layer,
                region,
                layout: layout.clone(),
            })
            .collect();
        use k3_proto::names::{EMBED, FINAL_NORM, LM_HEAD, OUT_RES_NORM, OUT_RES_PROJ};
        let mut model = Vec::new();
        for name in [EMBED, LM_HEAD, FINAL_NORM, OUT_RES_NORM, OUT_RES_PROJ] {
            let r = model_tensor(name).map_err(|e| TrunkError::draft(e.to_string()))?;
            model.push((name.to_string(), r));
        }
        Ok(DraftSource {
            kind: self.kind(),
            runs,
            model,
            bytes: self.run_bytes(),
        })
    }
}

/// A draft trunk held in memory, serving a draft model (see the module doc).
pub struct DraftSource {
    kind: QuantKind,
    runs: Vec<LayerRun>,
    model: Vec<(String, Region)>,
    bytes: u64,
}

impl std::fmt::Debug for DraftSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftSource")
            .field("kind", &self.kind)
            .field("layers", &self.runs.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl DraftSource {
    /// What `dir/draft.json` says: the kind and the bytes [`DraftSource::open`] would hold for
    /// `n_layers` layers (for the memory plan, before anything is read).
    pub fn probe(dir: &Path, n_layers: usize) -> Result<(QuantKind, u64), TrunkError> {
        let json = read_json(dir)?;
        Ok((json.kind, resident_bytes(&json, n_layers)))
    }

    /// Load the first `n_layers` runs of the draft trunk in `dir` into this process's memory
    /// ([`DraftFile::open`]'s checks, then every run's checksum), with the target's model-level
    /// tensors from `model_tensor`.
    pub fn open(
        dir: &Path,
        cat: &Catalog,
        n_layers: usize,
        model_tensor: &dyn Fn(&str) -> Result<Region, SourceError>,
    ) -> Result<DraftSource, TrunkError> {
        let file = DraftFile::open(dir, cat, n_layers)?;
        let bin = file.open_bin()?;
        let (buf, at) = bin.read_region(0, file.end())?;
        let owner: Arc<dyn crate::runtime::source::ByteOwner> = Arc::new(buf);
        let mut runs = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let (off, len) = file.run(l);
            let region = Region::new(owner.clone(), at + off as usize, len as usize)
                .ok_or_else(|| TrunkError::draft(format!("layer {l}: run outside draft.bin")))?;
            file.verify(l, region.bytes())?;
            runs.push(region);
        }
        file.source(runs, model_tensor)
    }

    /// int8 or int4.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// Bytes of the runs it serves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Where the last of the first `n_layers` runs ends in `draft.bin`: the bytes a worker reads.
fn resident_bytes(json: &DraftJson, n_layers: usize) -> u64 {
    json.layers
        .iter()
        .take(n_layers)
        .map(|l| l.file_off.saturating_add(l.nbytes))
        .max()
        .unwrap_or(0)
}

impl WeightSource for DraftSource {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.model
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r.clone())
            .ok_or_else(|| SourceError::Missing(name.to_string()))
    }

    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        self.runs
            .get(l)
            .cloned()
            .ok_or_else(|| SourceError::Invalid(format!("layer {l} is not in the draft trunk")))
    }

    fn experts(&self, l: usize, _ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        Err(SourceError::Invalid(format!(
            "a draft source reads no routed expert (layer {l}): see ResidentExperts"
        )))
    }

    fn resident_layer(&self, l: usize) -> Option<LayerRun> {
        self.runs.get(l).cloned()
    }

    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }
}

/// A draft source whose routed experts are those the TARGET source holds in memory now
/// ([`WeightSource::resident_experts`]): never a read, never a wait, not counted in the target's
/// statistics; an expert that is not resident is an `Err` (the draft model skips it).
pub struct ResidentExperts<'a> {
    /// The draft trunk.
    pub draft: &'a DraftSource,
    /// The job's own source.
    pub target: &'a dyn WeightSource,
}

impl WeightSource for ResidentExperts<'_> {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.draft.model_tensor(name)
    }

    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        self.draft.layer(l)
    }

    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        Ok(self.target.resident_experts(l, ids))
    }

    fn resident_layer(&self, l: usize) -> Option<LayerRun> {
        self.draft.resident_layer(l)
    }

    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }
}
