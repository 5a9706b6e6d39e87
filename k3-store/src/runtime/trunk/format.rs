//! `trunk.json` (format [`TRUNK_FORMAT`], SPEC.md §6.1): its types, the hashes that bind every
//! descriptor to the bytes it describes, and the typed reasons a trunk is refused.
//!
//! Three hashes, each over what the one before cannot see:
//! * a tensor's `xxh3`: XXH3-64 of the CHECKPOINT tensor's bytes (whatever the codec), and the
//!   **trunk identity** `model.trunk_id` over them ([`trunk_id`]): what `k3-ctl verify --trunk`
//!   compares with the checkpoint;
//! * a layer's `xxh3`, its **bound checksum** ([`bound_checksum`]): the XXH3-64 of the run as
//!   written combined with the layer's **descriptor digest** ([`layer_digest`]: its index,
//!   `file_off`, `nbytes` and every tensor's name, `off`, `stored`, `codec`, `dtype`, `nbytes`
//!   and `xxh3`).
//!   Checked when the run is read, so an edited offset, size, codec or layer order fails the
//!   read as surely as a changed byte;
//! * the **seal** `model.seal` ([`seal`]): XXH3-128 over the header (format, align, codec,
//!   identities, counts) and every layer's digest and bound checksum, checked when `trunk.json`
//!   is opened: an edited descriptor, or a layer checksum recomputed after a change to
//!   `trunk.bin`, is refused before any byte is read.
//!
//! None is a signature: a file whose every hash was recomputed after an edit (a deliberate,
//! consistent forgery) opens and runs; only `k3-ctl verify --trunk`, which re-derives every
//! stored tensor from the checkpoint, catches it (docs/RELIABILITY.md, "Trunk integrity").

use std::collections::BTreeMap;
use std::hash::Hasher as _;
use std::path::{Path, PathBuf};

use k3_proto::quant::QuantKind;
use k3_proto::Dtype;
use serde::{Deserialize, Serialize};

use crate::runtime::identity::{IdentityError, ModelIdentity};
use crate::runtime::io::{AllocError, ReadError};
use crate::runtime::ring::ChecksumMismatch;
use crate::runtime::source::Storage;

/// File names inside a packed-trunk directory.
pub const TRUNK_BIN: &str = "trunk.bin";
/// See [`TRUNK_BIN`].
pub const TRUNK_JSON: &str = "trunk.json";

/// Largest `trunk.json` we agree to parse (the real one is a few hundred KB).
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// The trunk format this code writes and accepts. 5 binds every descriptor to the content
/// (bound layer checksums, the seal) and adds the quantized codecs; formats 3 (raw) and 4
/// (EC-BF16) left tensor offsets, sizes, codecs and the layer order unchecked and are refused
/// (re-pack).
pub const TRUNK_FORMAT: u32 = 5;

/// Offset alignment of every tensor inside a run (what the kernels' loads like).
pub const TENSOR_ALIGN: u64 = 64;

/// How a whole trunk was packed (`trunk.json`'s `codec`, `k3-ctl pack-trunk --codec`): which
/// storages its tensors may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrunkCodec {
    /// Every tensor as in the checkpoint.
    Raw,
    /// BF16 matrices EC-BF16 coded where smaller (exact).
    Ecbf16,
    /// Quantizable matrices int8 (lossy); other matrices EC-BF16 where smaller.
    Int8,
    /// Quantizable matrices int4 (lossy); other matrices EC-BF16 where smaller.
    Int4,
}

impl TrunkCodec {
    /// The name `trunk.json` and `--codec` use.
    pub const fn name(self) -> &'static str {
        match self {
            TrunkCodec::Raw => "raw",
            TrunkCodec::Ecbf16 => "ecbf16",
            TrunkCodec::Int8 => "int8",
            TrunkCodec::Int4 => "int4",
        }
    }

    /// The quantization of a lossy trunk (`None`: the checkpoint's numbers exactly).
    pub const fn quant(self) -> Option<QuantKind> {
        match self {
            TrunkCodec::Int8 => Some(QuantKind::Int8),
            TrunkCodec::Int4 => Some(QuantKind::Int4),
            TrunkCodec::Raw | TrunkCodec::Ecbf16 => None,
        }
    }

    /// Whether a trunk of this codec may store a tensor as `s`.
    pub fn allows(self, s: Storage) -> bool {
        match s {
            Storage::Raw => true,
            Storage::EcBf16 => self != TrunkCodec::Raw,
            Storage::Int8 => self == TrunkCodec::Int8,
            Storage::Int4 => self == TrunkCodec::Int4,
        }
    }
}

/// One tensor in `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonTensor {
    /// Offset inside the layer run.
    pub off: u64,
    /// Byte length of the CHECKPOINT tensor.
    pub nbytes: u64,
    /// Element type of the checkpoint tensor (`"BF16"`, `"F32"`, …).
    pub dtype: Dtype,
    /// XXH3-64 of the checkpoint tensor's bytes, 16 hex digits (a draft trunk's quantized tensors
    /// have none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub xxh3: String,
    /// How the tensor is stored in the run (every tensor of a packed trunk; absent in a draft
    /// trunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<Storage>,
    /// Bytes the tensor takes in the run (`nbytes` when raw; every tensor of a packed trunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored: Option<u64>,
}

/// One layer in `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonLayer {
    /// Offset of the run in `trunk.bin` (a multiple of `align`).
    pub file_off: u64,
    /// Run length (unpadded).
    pub nbytes: u64,
    /// The run's bound checksum ([`bound_checksum`]), 16 hex digits (a draft trunk: the run's
    /// plain XXH3-64).
    #[serde(default)]
    pub xxh3: String,
    /// Tensors by full checkpoint name.
    pub tensors: BTreeMap<String, JsonTensor>,
}

/// Identity of the checkpoint a trunk was packed from, and of the trunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JsonModel {
    /// Decoder layers packed.
    pub n_layers: usize,
    /// Sum of the unpadded run lengths.
    pub trunk_bytes: u64,
    /// The content identity of the checkpoint packed ([`ModelIdentity`]), 32 hex digits.
    #[serde(default)]
    pub model_id: String,
    /// How it was computed: `"manifest"` or `"sampled"`.
    #[serde(default)]
    pub id_kind: String,
    /// [`trunk_id`] of the recorded tensor hashes, 32 hex digits (a draft trunk has none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trunk_id: String,
    /// [`seal`] over every descriptor and layer checksum, 32 hex digits (a draft trunk has
    /// none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub seal: String,
}

/// The whole `trunk.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrunkJson {
    /// Trunk format ([`TRUNK_FORMAT`]; absent, i.e. 0, in files of older packers and of
    /// kimi-k3-in-c, which are refused).
    #[serde(default)]
    pub format: u32,
    /// How the trunk was packed (absent before format 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<TrunkCodec>,
    /// Run alignment in `trunk.bin` (4096).
    pub align: u64,
    /// Checkpoint identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<JsonModel>,
    /// One entry per layer, index = layer.
    pub layers: Vec<JsonLayer>,
}

impl JsonModel {
    /// The `model` entry of a packed file: `n_layers` layers, `trunk_bytes` of runs, the
    /// checkpoint's content identity; the trunk identity and the seal are filled in by the
    /// packer ([`seal_json`]), and stay empty for a draft trunk.
    pub fn of(n_layers: usize, trunk_bytes: u64, id: &ModelIdentity) -> Self {
        JsonModel {
            n_layers,
            trunk_bytes,
            model_id: format!("{:032x}", id.id),
            id_kind: id.kind.name().into(),
            trunk_id: String::new(),
            seal: String::new(),
        }
    }
}

/// A non-zero hash of exactly `digits` hex digits.
pub(crate) fn parse_hash(s: &str, digits: usize) -> Option<u128> {
    if s.len() != digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(s, 16).ok().filter(|&v| v != 0)
}

/// XXH3-64 of a byte run (a draft trunk's run checksum; a packed tensor's source hash).
pub fn run_checksum(run: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(run)
}

/// The trunk identity: XXH3-128 over every layer's tensors (in `trunk.json` order: layer, then
/// name) — name, length and recorded XXH3-64 of the checkpoint tensor. It does not depend on the
/// codec: two trunks with the same identity were packed from the same tensor bytes.
pub fn trunk_id(layers: &[JsonLayer]) -> Result<u128, Refusal> {
    let mut h = twox_hash::XxHash3_128::new();
    h.write(b"k3-trunk-id/1\0");
    h.write(&(layers.len() as u64).to_le_bytes());
    for (l, jl) in layers.iter().enumerate() {
        h.write(&(jl.tensors.len() as u64).to_le_bytes());
        for (name, t) in &jl.tensors {
            let sum = parse_hash(&t.xxh3, 16).ok_or_else(|| Refusal::BadHash {
                what: format!("layer {l}: {name}: tensor hash xxh3"),
                value: t.xxh3.clone(),
            })?;
            h.write(name.as_bytes());
            h.write(&[0]);
            h.write(&t.nbytes.to_le_bytes());
            h.write(&(sum as u64).to_le_bytes());
        }
    }
    Ok(h.finish_128())
}

/// Layer `l`'s descriptor digest: XXH3-64 over the domain `k3-trunk-layer/5`, `l`, the run's
/// `file_off` and `nbytes`, and per tensor in name order its name, `off`, `stored`, codec name,
/// dtype name, `nbytes` and recorded hash text. Part of the layer's [`bound_checksum`].
pub fn layer_digest(l: usize, jl: &JsonLayer) -> u64 {
    let mut h = twox_hash::XxHash3_64::new();
    h.write(b"k3-trunk-layer/5\0");
    for v in [l as u64, jl.file_off, jl.nbytes, jl.tensors.len() as u64] {
        h.write(&v.to_le_bytes());
    }
    for (name, t) in &jl.tensors {
        h.write(name.as_bytes());
        h.write(&[0]);
        h.write(&t.off.to_le_bytes());
        h.write(&t.stored.unwrap_or(u64::MAX).to_le_bytes());
        h.write(t.codec.map_or("-", Storage::name).as_bytes());
        h.write(&[0]);
        h.write(t.dtype.name().as_bytes());
        h.write(&[0]);
        h.write(&t.nbytes.to_le_bytes());
        h.write(t.xxh3.as_bytes());
        h.write(&[0]);
    }
    h.finish()
}

/// A run's bound checksum: XXH3-64 over the domain `k3-trunk-run/5`, its layer's
/// [`layer_digest`] and the XXH3-64 of its bytes ([`bound_checksum_of`] of [`run_checksum`]): the
/// cost of the plain hash, and any change to a descriptor changes it as surely as a changed
/// byte.
pub fn bound_checksum(digest: u64, run: &[u8]) -> u64 {
    bound_checksum_of(digest, run_checksum(run))
}

/// [`bound_checksum`] from the run's plain XXH3-64 (a packer hashes the run as it writes it,
/// before its descriptors, and so its digest, are all known).
pub fn bound_checksum_of(digest: u64, plain: u64) -> u64 {
    let mut b = [0u8; 32];
    b[..16].copy_from_slice(b"k3-trunk-run/5\0\0");
    b[16..24].copy_from_slice(&digest.to_le_bytes());
    b[24..].copy_from_slice(&plain.to_le_bytes());
    twox_hash::XxHash3_64::oneshot(&b)
}

/// The seal over a whole `trunk.json`: XXH3-128 over the domain `k3-trunk-seal/5`, the format,
/// `align`, the codec, `model`'s identities and counts, and per layer its digest and recorded
/// checksum text. Everything the file says is under it.
pub fn seal(json: &TrunkJson, digests: &[u64]) -> u128 {
    let mut h = twox_hash::XxHash3_128::new();
    h.write(b"k3-trunk-seal/5\0");
    h.write(&json.format.to_le_bytes());
    h.write(&json.align.to_le_bytes());
    h.write(json.codec.map_or("-", TrunkCodec::name).as_bytes());
    h.write(&[0]);
    if let Some(m) = &json.model {
        for s in [&m.model_id, &m.id_kind, &m.trunk_id] {
            h.write(s.as_bytes());
            h.write(&[0]);
        }
        h.write(&(m.n_layers as u64).to_le_bytes());
        h.write(&m.trunk_bytes.to_le_bytes());
    }
    h.write(&(json.layers.len() as u64).to_le_bytes());
    for (jl, d) in json.layers.iter().zip(digests) {
        h.write(&d.to_le_bytes());
        h.write(jl.xxh3.as_bytes());
        h.write(&[0]);
    }
    h.finish_128()
}

/// Fill in `json.model`'s trunk identity and seal (the packer's last step, after every layer's
/// bound checksum is recorded).
pub fn seal_json(json: &mut TrunkJson) -> Result<(), Refusal> {
    let tid = trunk_id(&json.layers)?;
    let digests: Vec<u64> = (json.layers.iter().enumerate())
        .map(|(l, jl)| layer_digest(l, jl))
        .collect();
    if let Some(m) = json.model.as_mut() {
        m.trunk_id = format!("{tid:032x}");
    }
    let s = seal(json, &digests);
    if let Some(m) = json.model.as_mut() {
        m.seal = format!("{s:032x}");
    }
    Ok(())
}

/// XXH3-64 of each tensor of a run fed to it in order, chunk by chunk (a tensor may straddle
/// chunks): what `k3-ctl verify` recomputes for the raw tensors of a run.
pub struct TensorHashes {
    /// (name, start, end) inside the run, by start, and its running hash.
    spans: Vec<(String, u64, u64, twox_hash::XxHash3_64)>,
}

impl TensorHashes {
    /// For tensors given as (name, offset inside the run, bytes).
    pub fn new(tensors: impl IntoIterator<Item = (String, u64, u64)>) -> TensorHashes {
        let mut spans: Vec<_> = tensors
            .into_iter()
            .map(|(n, off, len)| (n, off, off + len, twox_hash::XxHash3_64::new()))
            .collect();
        spans.sort_by_key(|s| s.1);
        TensorHashes { spans }
    }

    /// Bytes `[at, at + chunk.len())` of the run.
    pub fn feed(&mut self, at: u64, chunk: &[u8]) {
        let end = at + chunk.len() as u64;
        for (_, s, e, h) in &mut self.spans {
            let (lo, hi) = ((*s).max(at), (*e).min(end));
            if lo < hi {
                h.write(&chunk[(lo - at) as usize..(hi - at) as usize]);
            }
        }
    }

    /// Each tensor's hash, by name.
    pub fn finish(self) -> BTreeMap<String, u64> {
        self.spans
            .into_iter()
            .map(|(n, _, _, h)| (n, h.finish()))
            .collect()
    }
}

/// Why a packed trunk is refused (or a checkpoint cannot be packed): every case a test provokes
/// has its own variant, naming the layer and the tensor.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// `trunk.json` cannot be read.
    #[error("cannot read it: {0}")]
    Unreadable(#[source] std::io::Error),
    /// `trunk.bin` cannot be opened.
    #[error("cannot open trunk.bin: {0}")]
    Bin(#[source] ReadError),
    /// `trunk.json` is implausibly large.
    #[error("{0} bytes is implausibly large")]
    TooLarge(u64),
    /// Not JSON of this shape.
    #[error("not a trunk.json: {0}")]
    NotJson(#[source] serde_json::Error),
    /// Another format.
    #[error(
        "trunk format {0} (written by another k3-ctl or by kimi-k3-in-c; this one reads format \
         {TRUNK_FORMAT}, whose descriptors are bound to the content)"
    )]
    Format(u32),
    /// No `model` entry or no `codec`.
    #[error("no {0:?}")]
    Missing(&'static str),
    /// A hash or identity that is missing, zero or malformed.
    #[error("{what} {value:?} is missing, zero or not hex digits of the right length")]
    BadHash {
        /// Which field.
        what: String,
        /// Its text.
        value: String,
    },
    /// `model.id_kind` unknown.
    #[error("model.id_kind {0:?} is neither \"manifest\" nor \"sampled\"")]
    IdKind(String),
    /// The trunk identity does not match the tensor hashes.
    #[error(
        "model.trunk_id {recorded:032x} does not match its tensor hashes (they give \
         {computed:032x}): the file was edited"
    )]
    TrunkId {
        /// Recorded.
        recorded: u128,
        /// Computed.
        computed: u128,
    },
    /// The seal does not match the descriptors and layer checksums.
    #[error(
        "model.seal {recorded:032x} does not match the file's descriptors and layer checksums \
         (they give {computed:032x}): trunk.json was edited, or a layer checksum was recomputed \
         after trunk.bin changed"
    )]
    Seal {
        /// Recorded.
        recorded: u128,
        /// Computed.
        computed: u128,
    },
    /// `model.n_layers` disagrees with the entries.
    #[error("model.n_layers {n_layers} but {entries} layer entries")]
    LayerCount {
        /// Recorded.
        n_layers: usize,
        /// Entries.
        entries: usize,
    },
    /// Fewer layers than the checkpoint.
    #[error("has {has} layers, the checkpoint needs {needs}")]
    TooFewLayers {
        /// In the file.
        has: usize,
        /// In the checkpoint.
        needs: usize,
    },
    /// `align` is zero.
    #[error("align is 0")]
    ZeroAlign,
    /// A run not on the alignment.
    #[error("layer {layer}: file_off {file_off} is not a multiple of align {align}")]
    Unaligned {
        /// Layer.
        layer: usize,
        /// Its offset.
        file_off: u64,
        /// The alignment.
        align: u64,
    },
    /// A run that is empty or outside `trunk.bin`.
    #[error("layer {layer}: run {file_off}..+{nbytes} is empty or lies outside trunk.bin ({file_len} bytes)")]
    OutsideFile {
        /// Layer.
        layer: usize,
        /// Offset.
        file_off: u64,
        /// Length.
        nbytes: u64,
        /// File length.
        file_len: u64,
    },
    /// Two runs overlap.
    #[error("the runs of layer {a} ({a0}..{a1}) and layer {b} ({b0}..{b1}) overlap in trunk.bin")]
    Overlap {
        /// First layer.
        a: usize,
        /// Its start.
        a0: u64,
        /// Its end.
        a1: u64,
        /// Second layer.
        b: usize,
        /// Its start.
        b0: u64,
        /// Its end.
        b1: u64,
    },
    /// Packed from another checkpoint.
    #[error(
        "packed from model {packed:032x} ({packed_kind}), but {model_dir} is model {opened} (a \
         trunk from another checkpoint, the checkpoint changed, or its manifest was added or \
         removed since)"
    )]
    ForeignModel {
        /// The recorded identity.
        packed: u128,
        /// Its kind.
        packed_kind: &'static str,
        /// The checkpoint directory.
        model_dir: String,
        /// The opened checkpoint's identity (described).
        opened: String,
    },
    /// Tensors the checkpoint does not have.
    #[error("layer {layer}: tensors not in the checkpoint: {names}")]
    ExtraTensors {
        /// Layer.
        layer: usize,
        /// Their names.
        names: String,
    },
    /// A checkpoint tensor the file lacks.
    #[error("layer {layer}: {name} is missing (packed from another checkpoint?)")]
    MissingTensor {
        /// Layer.
        layer: usize,
        /// Name.
        name: String,
    },
    /// A tensor's recorded dtype or length differs from the checkpoint's.
    #[error("layer {layer}: {name} is {dtype} {nbytes} bytes in trunk.json but {ck_dtype} {ck_nbytes} bytes in the checkpoint")]
    TensorMismatch {
        /// Layer.
        layer: usize,
        /// Name.
        name: String,
        /// Recorded dtype.
        dtype: Dtype,
        /// Recorded length.
        nbytes: u64,
        /// Checkpoint dtype.
        ck_dtype: Dtype,
        /// Checkpoint length.
        ck_nbytes: u64,
    },
    /// A tensor's `codec`/`stored` that its dtype, length or the trunk's codec do not allow.
    #[error("layer {layer}: {name}: {problem}")]
    Stored {
        /// Layer.
        layer: usize,
        /// Name.
        name: String,
        /// What is wrong.
        problem: StoredProblem,
    },
    /// A tensor outside its run, not on a 64-byte offset, or overlapping another.
    #[error("layer {layer}: {name} at {off}..+{stored} lies outside its run of {run} bytes, off a 64-byte offset, or over another tensor")]
    OutsideRun {
        /// Layer.
        layer: usize,
        /// Name.
        name: String,
        /// Offset.
        off: u64,
        /// Stored length.
        stored: u64,
        /// Run length.
        run: u64,
    },
    /// The checkpoint cannot be packed: a layer's trunk tensors are not one contiguous run.
    #[error("{0}")]
    NotContiguous(String),
    /// The checkpoint index cannot be read, or has no shape for a tensor to pack.
    #[error("{0} is not in the checkpoint index")]
    NotIndexed(String),
    /// A quantized or coded tensor cannot be made.
    #[error("layer {layer}: {name}: {source}")]
    Encode {
        /// Layer.
        layer: usize,
        /// Name.
        name: String,
        /// Why.
        #[source]
        source: EncodeError,
    },
    /// A refusal of the draft trunk (`runtime::draft`), described.
    #[error("{0}")]
    Draft(String),
}

/// Why a tensor's `codec`/`stored` pair is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoredProblem {
    /// No `codec` or no `stored`.
    #[error("no \"codec\" and \"stored\" (format 5 records both for every tensor)")]
    Missing,
    /// The trunk's codec does not allow the tensor's.
    #[error("stored {tensor} in a trunk packed as {trunk}")]
    Codec {
        /// The tensor's codec.
        tensor: &'static str,
        /// The trunk's.
        trunk: &'static str,
    },
    /// Raw with another length.
    #[error("stored raw in {stored} bytes, but the tensor is {nbytes} bytes")]
    RawLength {
        /// Stored.
        stored: u64,
        /// Checkpoint length.
        nbytes: u64,
    },
    /// A coded or quantized tensor that is not a BF16 matrix of a plausible length.
    #[error("{codec} in {stored} bytes from a {dtype} tensor of {nbytes} bytes (only BF16 matrices are coded or quantized, at the length their shape gives)")]
    Length {
        /// Codec.
        codec: &'static str,
        /// Stored.
        stored: u64,
        /// Dtype.
        dtype: Dtype,
        /// Checkpoint length.
        nbytes: u64,
    },
}

/// Why a tensor could not be coded or quantized at pack time.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// EC-BF16.
    #[error(transparent)]
    Coded(#[from] k3_proto::ecbf16::CodecError),
    /// int8/int4.
    #[error(transparent)]
    Quant(#[from] k3_proto::quant::QuantError),
}

/// Why packing or opening a packed trunk did not happen.
#[derive(Debug, thiserror::Error)]
pub enum TrunkError {
    /// The checkpoint or the packed trunk does not satisfy the format (exit 2); `path` names the
    /// file (or directory) and `repack` the command that writes a good one.
    #[error("{}", refused_text(path, problem, repack))]
    Refused {
        /// `trunk.json`, or the checkpoint directory.
        path: PathBuf,
        /// Why (boxed: the refusals carry names and numbers; the error stays small).
        #[source]
        problem: Box<Refusal>,
        /// `k3-ctl pack-trunk MODEL DIR`, when re-packing is the cure.
        repack: Option<String>,
    },
    /// The checkpoint's identity cannot be established (exit 2).
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// A layer read while packing does not match its checksum (exit 2).
    #[error(transparent)]
    Checksum(#[from] ChecksumMismatch),
    /// A read failed (exit 1).
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A buffer could not be had (exit 1).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// Writing an output file failed (exit 1).
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Packing was interrupted by a signal; its temporary files are removed (exit 1).
    #[error("interrupted by {0}; the temporary files were removed")]
    Interrupted(&'static str),
}

fn refused_text(path: &Path, problem: &Refusal, repack: &Option<String>) -> String {
    // (`problem` arrives as `&Box<Refusal>` deref-coerced.)
    let mut s = String::new();
    if !path.as_os_str().is_empty() {
        s = format!("{}: ", path.display());
    }
    s += &problem.to_string();
    if let Some(c) = repack {
        s += &format!(": re-run `{c}`");
    }
    s
}

impl TrunkError {
    /// A refusal about `path`, with no re-pack hint.
    pub fn refused(path: &Path, problem: Refusal) -> TrunkError {
        TrunkError::Refused {
            path: path.to_path_buf(),
            problem: Box::new(problem),
            repack: None,
        }
    }

    /// A refusal of a draft trunk (`runtime::draft`), described by its message (which names
    /// the file where it matters).
    pub fn draft(message: impl Into<String>) -> TrunkError {
        TrunkError::Refused {
            path: PathBuf::new(),
            problem: Box::new(Refusal::Draft(message.into())),
            repack: None,
        }
    }

    /// True when the trunk or checkpoint was refused (exit 2), false for a failure while
    /// reading or writing (exit 1).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            TrunkError::Refused { .. } | TrunkError::Identity(_) | TrunkError::Checksum(_)
        )
    }

    /// The refusal's reason, when this is one.
    pub fn refusal(&self) -> Option<&Refusal> {
        match self {
            TrunkError::Refused { problem, .. } => Some(problem.as_ref()),
            _ => None,
        }
    }
}
