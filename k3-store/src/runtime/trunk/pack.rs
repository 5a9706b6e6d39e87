//! Writing a packed trunk (`k3-ctl pack-trunk`, SPEC.md §6.1) and the file discipline every
//! large-file writer of the store crate shares ([`write_packed`]): temporary names, renames into
//! place, no temporary left behind on an error, a SIGINT or a SIGTERM, and a later run removing
//! the temporaries a killed one left.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use k3_proto::ecbf16::{choose_codec, encode_with_palette, HighBytes, TensorCodec, WIDTHS};
use k3_proto::quant::{encode_matrix, quantizable, QuantKind};
use k3_proto::safetensors::CheckpointIndex;
use k3_proto::Dtype;

use super::format::{
    bound_checksum_of, layer_digest, seal_json, EncodeError, JsonLayer, JsonModel, JsonTensor,
    Refusal, TrunkCodec, TrunkError, TrunkJson, TENSOR_ALIGN, TRUNK_BIN, TRUNK_FORMAT, TRUNK_JSON,
};
use crate::runtime::catalog::{Catalog, TensorExtent};
use crate::runtime::identity::ModelIdentity;
use crate::runtime::io::{align_down, align_up, span_len, AlignedBuf, DiskFile, ALIGN};
use crate::runtime::source::Storage;

/// Largest escape rate an EC-BF16 width may have to be chosen (the census's default cap,
/// SPEC.md §6.13).
pub const DEFAULT_MAX_ESCAPE: f64 = 0.01;

/// The index width `--codec ecbf16` codes with: 4 bits (12 bits a weight).
pub const DEFAULT_WIDTH: u8 = 4;

/// Index widths `--codec ecbf16:auto` chooses from per tensor: the smaller of 3 and 4 bits whose
/// escapes stay under the cap.
pub const AUTO_WIDTHS: [u8; 2] = [3, 4];

/// How `pack_trunk` stores the tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct PackOptions {
    /// The trunk's codec.
    pub codec: TrunkCodec,
    /// EC-BF16 index widths to choose from (for `ecbf16`, and for the matrices an `int8`/`int4`
    /// trunk does not quantize).
    pub widths: Vec<u8>,
    /// Largest escape rate of a chosen EC-BF16 width.
    pub max_escape: f64,
}

impl PackOptions {
    /// `codec` with the default EC-BF16 width and escape cap.
    pub fn new(codec: TrunkCodec) -> PackOptions {
        PackOptions {
            codec,
            widths: vec![DEFAULT_WIDTH],
            max_escape: DEFAULT_MAX_ESCAPE,
        }
    }
}

/// Whether a trunk tensor is a matrix the packer may EC-BF16 code: a BF16 `[rows, cols]` with
/// more than one row (a `[1, E]` AttnRes query is a vector the binder widens) that is not
/// `kv_b_proj` (MLA multiplies by its transpose straight from the raw rows, SPEC.md §3.6).
pub fn codable(name: &str, dtype: Dtype, shape: &[u64]) -> bool {
    dtype == Dtype::BF16
        && shape.len() == 2
        && shape[0] > 1
        && shape[1] > 0
        && !name.ends_with("kv_b_proj.weight")
}

/// Check a layer's trunk tensors form one contiguous run in one shard; returns (shard, start, len).
// String error because its callers turn the message into different things by context (a
// refusal at pack time, a scattered read plan when a source is built).
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

/// Progress of a pack, reported after each tensor and each layer.
#[derive(Clone, Debug)]
pub struct PackProgress {
    /// Layers done.
    pub layers_done: usize,
    /// Layers in total.
    pub layers_total: usize,
    /// Checkpoint bytes read so far.
    pub bytes_done: u64,
    /// Checkpoint bytes to read in total.
    pub bytes_total: u64,
}

/// What a pack produced.
#[derive(Clone, Debug)]
pub struct PackSummary {
    /// Layers packed.
    pub layers: usize,
    /// Unpadded run bytes written.
    pub bytes: u64,
    /// Size of the data file (with padding).
    pub file_bytes: u64,
    /// Largest run.
    pub largest_run: u64,
    /// Wall seconds.
    pub seconds: f64,
    /// Tensors per storage.
    pub stored_as: BTreeMap<&'static str, usize>,
}

/// SIGINT and SIGTERM turned into a flag a long writer polls ([`Interrupt::check`]) so it stops
/// at the next chunk and removes its temporary files; a second signal ends the process at once
/// (exit 1). Dropping it restores the signals' previous handling.
#[derive(Debug, Default)]
pub struct Interrupt {
    pub(super) int: Arc<AtomicBool>,
    pub(super) term: Arc<AtomicBool>,
    ids: Vec<signal_hook::SigId>,
}

impl Interrupt {
    /// A flag nothing sets (tests, library callers).
    pub fn never() -> Interrupt {
        Interrupt::default()
    }

    /// Register SIGINT and SIGTERM (until dropped).
    pub fn on_signals() -> std::io::Result<Interrupt> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut i = Interrupt::default();
        for (sig, flag) in [(SIGINT, i.int.clone()), (SIGTERM, i.term.clone())] {
            // A second signal (the flag already set) exits with status 1.
            i.ids.push(signal_hook::flag::register_conditional_shutdown(
                sig,
                1,
                flag.clone(),
            )?);
            i.ids.push(signal_hook::flag::register(sig, flag)?);
        }
        Ok(i)
    }

    /// `Err(Interrupted)` once a signal arrived.
    pub fn check(&self) -> Result<(), TrunkError> {
        match self.signal() {
            Some(sig) => Err(TrunkError::Interrupted(sig)),
            None => Ok(()),
        }
    }

    /// The signal that arrived (`"SIGINT"` or `"SIGTERM"`), if one did.
    pub fn signal(&self) -> Option<&'static str> {
        if self.int.load(Ordering::Relaxed) {
            Some("SIGINT")
        } else if self.term.load(Ordering::Relaxed) {
            Some("SIGTERM")
        } else {
            None
        }
    }
}

impl Drop for Interrupt {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Pack every layer's trunk of `cat` (a checkpoint directory with its index, which gives the
/// shapes) into `out_dir/trunk.bin` + `trunk.json` (format
/// [`TRUNK_FORMAT`]). Every layer's precondition is checked before anything is written. Per
/// layer, the tensors in checkpoint order, each at the next [`TENSOR_ALIGN`] offset of the run
/// (the gaps zero): copied (`raw`), EC-BF16 coded where [`codable`] and smaller (`ecbf16`, and
/// the matrices a quantized trunk does not quantize), or quantized where
/// [`k3_proto::quant::quantizable`] (`int8`, `int4`). Runs start at 4 KiB offsets. `trunk.json`
/// records each tensor's checkpoint length, dtype and XXH3-64 (so the trunk identity does not
/// depend on the codec), its codec and stored size, each run's bound checksum and the seal.
/// Memory: about the largest tensor twice (read and encoded).
pub fn pack_trunk(
    cat: &Catalog,
    out_dir: &Path,
    opts: &PackOptions,
    stop: &Interrupt,
    progress: &mut dyn FnMut(&PackProgress),
) -> Result<PackSummary, TrunkError> {
    let model_dir = PathBuf::from(crate::runtime::identity::model_dir_of(cat));
    let refuse = |p: Refusal| TrunkError::refused(&model_dir, p);
    if let Some(w) = opts.widths.iter().find(|w| !WIDTHS.contains(w)) {
        let e = k3_proto::ecbf16::CodecError::Width(*w);
        return Err(refuse(Refusal::Encode {
            layer: 0,
            name: "--codec".into(),
            source: e.into(),
        }));
    }
    let t0 = Instant::now();
    let n = cat.n_layers();
    for l in 0..n {
        contiguous_run(l, cat.trunk(l)).map_err(|m| refuse(Refusal::NotContiguous(m)))?;
    }
    // The shapes of the matrices to code or quantize.
    let index = CheckpointIndex::open(&model_dir)
        .map_err(|e| refuse(Refusal::NotIndexed(format!("the checkpoint index ({e})"))))?;
    let index = &index;
    let id = ModelIdentity::of(cat)?;
    let bytes_total: u64 = (0..n).map(|l| cat.trunk_bytes(l)).sum();
    let mut files: Vec<Option<DiskFile>> = (0..cat.shard_paths().len()).map(|_| None).collect();
    let mut sum = PackSummary {
        layers: n,
        bytes: 0,
        file_bytes: 0,
        largest_run: 0,
        seconds: 0.0,
        stored_as: BTreeMap::new(),
    };
    write_packed(out_dir, TRUNK_BIN, TRUNK_JSON, stop, &mut |out, werr| {
        let mut w = LayerWriter {
            cat,
            index,
            opts,
            files: &mut files,
            buf: AlignedBuf::zeroed(0)?,
            done: 0,
            bytes_total,
        };
        let mut layers = Vec::with_capacity(n);
        for l in 0..n {
            let jl = w.layer(l, out, sum.file_bytes, werr, stop, progress, &mut sum)?;
            sum.file_bytes += align_up(jl.nbytes).ok_or_else(|| {
                refuse(Refusal::NotContiguous(format!("layer {l}: run too large")))
            })?;
            sum.bytes += jl.nbytes;
            sum.largest_run = sum.largest_run.max(jl.nbytes);
            layers.push(jl);
        }
        let mut json = TrunkJson {
            format: TRUNK_FORMAT,
            codec: Some(opts.codec),
            align: ALIGN as u64,
            model: Some(JsonModel::of(n, sum.bytes, &id)),
            layers,
        };
        seal_json(&mut json).map_err(&refuse)?;
        let text = serde_json::to_string_pretty(&json).map_err(|e| TrunkError::Write {
            path: out_dir.join(TRUNK_JSON),
            source: e.into(),
        })?;
        Ok((sum.file_bytes, text))
    })?;
    sum.seconds = t0.elapsed().as_secs_f64();
    Ok(sum)
}

/// What packing one layer needs: the checkpoint, the options, the open shards and a reused
/// read buffer.
struct LayerWriter<'a> {
    cat: &'a Catalog,
    index: &'a CheckpointIndex,
    opts: &'a PackOptions,
    files: &'a mut Vec<Option<DiskFile>>,
    buf: AlignedBuf,
    done: u64,
    bytes_total: u64,
}

impl LayerWriter<'_> {
    /// Write layer `l`'s run at `pos` of `out`; its `trunk.json` entry.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &mut self,
        l: usize,
        out: &std::fs::File,
        pos: u64,
        werr: &dyn Fn(std::io::Error) -> TrunkError,
        stop: &Interrupt,
        progress: &mut dyn FnMut(&PackProgress),
        sum: &mut PackSummary,
    ) -> Result<JsonLayer, TrunkError> {
        let mut ts: Vec<&TensorExtent> = self.cat.trunk(l).iter().collect();
        ts.sort_by_key(|t| (t.shard, t.off));
        let mut run_hash = twox_hash::XxHash3_64::new();
        let mut tensors = BTreeMap::new();
        let mut at = 0u64;
        for t in ts {
            stop.check()?;
            let inner = self.read(t)?;
            let raw = &self.buf.as_slice()[inner..inner + t.nbytes as usize];
            let raw_hash = twox_hash::XxHash3_64::oneshot(raw);
            let (storage, encoded) = encode(self.cat, self.index, self.opts, l, t, raw)?;
            let bytes = encoded.as_deref().unwrap_or(raw);
            // Zeros up to the tensor's aligned offset (holes in the file), then its bytes.
            let off = at.div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN;
            std::hash::Hasher::write(
                &mut run_hash,
                &[0u8; TENSOR_ALIGN as usize][..(off - at) as usize],
            );
            std::hash::Hasher::write(&mut run_hash, bytes);
            write_sparse(out, pos + off, bytes).map_err(werr)?;
            at = off + bytes.len() as u64;
            *sum.stored_as.entry(storage.name()).or_default() += 1;
            tensors.insert(
                t.name.clone(),
                JsonTensor {
                    off,
                    nbytes: t.nbytes,
                    dtype: t.dtype,
                    xxh3: format!("{raw_hash:016x}"),
                    codec: Some(storage),
                    stored: Some(bytes.len() as u64),
                },
            );
            self.done += t.nbytes;
            progress(&PackProgress {
                layers_done: l,
                layers_total: self.cat.n_layers(),
                bytes_done: self.done,
                bytes_total: self.bytes_total,
            });
        }
        let mut jl = JsonLayer {
            file_off: pos,
            nbytes: at,
            xxh3: String::new(),
            tensors,
        };
        let plain = std::hash::Hasher::finish(&run_hash);
        jl.xxh3 = format!("{:016x}", bound_checksum_of(layer_digest(l, &jl), plain));
        progress(&PackProgress {
            layers_done: l + 1,
            layers_total: self.cat.n_layers(),
            bytes_done: self.done,
            bytes_total: self.bytes_total,
        });
        Ok(jl)
    }

    /// Read tensor `t` into the buffer (grown to fit, the old one freed first); where its bytes
    /// start in it.
    fn read(&mut self, t: &TensorExtent) -> Result<usize, TrunkError> {
        let path = &self.cat.shard_paths()[t.shard as usize];
        let f = match &mut self.files[t.shard as usize] {
            Some(f) => f,
            slot => slot.insert(DiskFile::open(path)?),
        };
        let need = span_len(t.off, t.nbytes).ok_or_else(|| {
            TrunkError::refused(
                path,
                Refusal::NotContiguous(format!("{}: too large", t.name)),
            )
        })?;
        if (self.buf.as_slice().len() as u64) < need {
            self.buf = AlignedBuf::zeroed(0)?;
            self.buf = AlignedBuf::zeroed(need as usize)?;
        }
        Ok(f.read_span(t.off, t.nbytes, self.buf.as_mut_slice())?)
    }
}

/// How tensor `t` of layer `l` (its checkpoint bytes `raw`) is stored under `opts`, and its
/// encoded bytes (`None`: `raw` as it is).
fn encode(
    cat: &Catalog,
    index: &CheckpointIndex,
    opts: &PackOptions,
    l: usize,
    t: &TensorExtent,
    raw: &[u8],
) -> Result<(Storage, Option<Vec<u8>>), TrunkError> {
    if opts.codec == TrunkCodec::Raw {
        return Ok((Storage::Raw, None));
    }
    let model_dir = PathBuf::from(crate::runtime::identity::model_dir_of(cat));
    let shape = index
        .get(&t.name)
        .map(|i| i.shape().to_vec())
        .ok_or_else(|| TrunkError::refused(&model_dir, Refusal::NotIndexed(t.name.clone())))?;
    let failed = |source: EncodeError| {
        TrunkError::refused(
            &model_dir,
            Refusal::Encode {
                layer: l,
                name: t.name.clone(),
                source,
            },
        )
    };
    if let Some(kind) = opts.codec.quant() {
        if quantizable(&t.name, t.dtype, &shape) {
            let (rows, cols) = (shape[0] as usize, shape[1] as usize);
            let q = encode_matrix(kind, raw, rows, cols).map_err(|e| failed(e.into()))?;
            let storage = match kind {
                QuantKind::Int8 => Storage::Int8,
                QuantKind::Int4 => Storage::Int4,
            };
            return Ok((storage, Some(q)));
        }
    }
    if !codable(&t.name, t.dtype, &shape) {
        return Ok((Storage::Raw, None));
    }
    let (rows, cols) = (shape[0] as usize, shape[1] as usize);
    let h = HighBytes::of(raw);
    match choose_codec(&h, rows, cols, &opts.widths, opts.max_escape) {
        (TensorCodec::Coded(w), _) => {
            let c = encode_with_palette(raw, rows, cols, w, &h.palette(w))
                .map_err(|e| failed(e.into()))?;
            Ok((Storage::EcBf16, Some(c)))
        }
        (TensorCodec::Raw, _) => Ok((Storage::Raw, None)),
    }
}

/// Temporary name of `name` in a directory while process `pid` writes it (what
/// [`remove_stale_temporaries`] recognises).
pub fn temp_name(name: &str, pid: u32) -> String {
    format!(".{name}.{pid}.tmp")
}

/// Remove the temporaries of `names` in `dir` that a process no longer alive left behind (a
/// writer killed by SIGKILL, or a machine that went down). A live process's are kept, whoever
/// it is. Returns the paths removed.
pub fn remove_stale_temporaries(dir: &Path, names: &[&str]) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(file) = file.to_str() else { continue };
        let pid = names.iter().find_map(|n| {
            file.strip_prefix(&format!(".{n}."))?
                .strip_suffix(".tmp")?
                .parse::<i32>()
                .ok()
        });
        let Some(pid) = pid.filter(|&p| p > 0) else {
            continue;
        };
        // Signal 0: does the process exist (EPERM: it does, another user's).
        let alive = match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
            Ok(()) => true,
            Err(nix::errno::Errno::ESRCH) => false,
            Err(_) => true,
        };
        if !alive && std::fs::remove_file(e.path()).is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

/// Write a packed pair (`bin_name` + `json_name`) into `out_dir`: `fill` writes the data file
/// (given it open and an error mapper naming it) and returns its final length and the JSON text.
/// Both are written under temporary names (`.NAME.PID.tmp`) and renamed into place, the data
/// file first (an old JSON is removed just before, so a JSON never describes another data
/// file); nothing temporary is left behind on failure or when `stop` reports a signal; the
/// temporaries a dead process left in `out_dir` are removed first ([`remove_stale_temporaries`]).
/// An existing pair is never rewritten in place (a process with the old data file open keeps its
/// bytes).
#[allow(clippy::type_complexity)]
pub(crate) fn write_packed(
    out_dir: &Path,
    bin_name: &str,
    json_name: &str,
    stop: &Interrupt,
    fill: &mut dyn FnMut(
        &std::fs::File,
        &dyn Fn(std::io::Error) -> TrunkError,
    ) -> Result<(u64, String), TrunkError>,
) -> Result<(), TrunkError> {
    let werr_dir = |source| TrunkError::Write {
        path: out_dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(out_dir).map_err(werr_dir)?;
    for p in remove_stale_temporaries(out_dir, &[bin_name, json_name]) {
        tracing::info!("removed {}, left by a writer that is gone", p.display());
    }
    let json_path = out_dir.join(json_name);
    let bin_path = out_dir.join(bin_name);
    let tag = std::process::id();
    let bin_tmp = out_dir.join(temp_name(bin_name, tag));
    let json_tmp = out_dir.join(temp_name(json_name, tag));
    let werr = |source: std::io::Error| TrunkError::Write {
        path: bin_tmp.clone(),
        source,
    };
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&bin_tmp)
        .map_err(werr)?;
    // Whatever happens below (an error, an interrupt turned into one), no temporary file is
    // left behind.
    struct Cleanup<'a>(&'a [&'a Path]);
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            for p in self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let _cleanup = Cleanup(&[bin_tmp.as_path(), json_tmp.as_path()]);
    let (len, text) = fill(&out, &werr)?;
    stop.check()?;
    // Holes at the end (an all-zero last block, padding) still count toward the length.
    out.set_len(len).map_err(werr)?;
    out.sync_all().map_err(werr)?;
    drop(out);
    let jerr = |source: std::io::Error| TrunkError::Write {
        path: json_path.clone(),
        source,
    };
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&json_tmp).map_err(jerr)?;
        f.write_all(text.as_bytes()).map_err(jerr)?;
        f.sync_all().map_err(jerr)?;
    }
    stop.check()?;
    match std::fs::remove_file(&json_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(jerr(e)),
    }
    std::fs::rename(&bin_tmp, &bin_path).map_err(|source| TrunkError::Write {
        path: bin_path.clone(),
        source,
    })?;
    std::fs::rename(&json_tmp, &json_path).map_err(jerr)?;
    // Make the renames durable (best effort: not every filesystem syncs directories).
    if let Ok(d) = std::fs::File::open(out_dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Write `data` at `off`, leaving every all-zero 4 KiB block (aligned to the file) as a hole: a
/// sparse checkpoint (or a real one with zero pages) packs into a sparse `trunk.bin` with the
/// same bytes. The caller sets the final file length.
pub(crate) fn write_sparse(out: &std::fs::File, off: u64, data: &[u8]) -> std::io::Result<()> {
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
