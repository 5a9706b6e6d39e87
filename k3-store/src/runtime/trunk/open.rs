//! Opening a packed trunk ([`TrunkLayout::from_packed`]): every check `trunk.json` must pass
//! before a byte of `trunk.bin` is used (SPEC.md §6.1, "Validation on open").

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k3_proto::quant::QuantKind;
use k3_proto::Dtype;

use super::format::{
    layer_digest, parse_hash, seal, trunk_id, JsonLayer, JsonTensor, Refusal, StoredProblem,
    TrunkCodec, TrunkError, TrunkJson, MAX_JSON_BYTES, TRUNK_BIN, TRUNK_FORMAT, TRUNK_JSON,
};
use super::layout::{LayerPlan, RunCheck, RunSource, TrunkLayout};
use crate::runtime::catalog::{Catalog, TensorExtent};
use crate::runtime::identity::{model_dir_of, IdentityKind, ModelIdentity};
use crate::runtime::io::DiskFile;
use crate::runtime::source::{LayerLayout, Storage, TensorLoc};

/// The checks of one `trunk.json`: where it is and the command that re-packs it.
struct Opening<'a> {
    cat: &'a Catalog,
    json_path: PathBuf,
    repack: String,
}

impl Opening<'_> {
    fn refuse(&self, problem: Refusal) -> TrunkError {
        TrunkError::Refused {
            path: self.json_path.clone(),
            problem: Box::new(problem),
            repack: Some(self.repack.clone()),
        }
    }

    /// `trunk.json`, bounded in size and parsed.
    fn read(&self) -> Result<TrunkJson, TrunkError> {
        let meta =
            std::fs::metadata(&self.json_path).map_err(|e| self.refuse(Refusal::Unreadable(e)))?;
        if meta.len() > MAX_JSON_BYTES {
            return Err(self.refuse(Refusal::TooLarge(meta.len())));
        }
        let text = std::fs::read_to_string(&self.json_path)
            .map_err(|e| self.refuse(Refusal::Unreadable(e)))?;
        serde_json::from_str(&text).map_err(|e| self.refuse(Refusal::NotJson(e)))
    }

    /// The format, the header's hashes, the trunk identity and the seal (every descriptor and
    /// layer checksum under it); the layers' descriptor digests and the trunk identity.
    fn header(&self, json: &TrunkJson) -> Result<(TrunkCodec, Vec<u64>, u128, u128), TrunkError> {
        if json.format != TRUNK_FORMAT {
            return Err(self.refuse(Refusal::Format(json.format)));
        }
        let codec = json
            .codec
            .ok_or_else(|| self.refuse(Refusal::Missing("codec")))?;
        let m = (json.model.as_ref()).ok_or_else(|| self.refuse(Refusal::Missing("model")))?;
        let hash = |what: &str, value: &str, digits| {
            parse_hash(value, digits).ok_or_else(|| {
                self.refuse(Refusal::BadHash {
                    what: what.into(),
                    value: value.into(),
                })
            })
        };
        hash("model.model_id", &m.model_id, 32)?;
        if IdentityKind::parse(&m.id_kind).is_none() {
            return Err(self.refuse(Refusal::IdKind(m.id_kind.clone())));
        }
        let recorded_tid = hash("model.trunk_id", &m.trunk_id, 32)?;
        let recorded_seal = hash("model.seal", &m.seal, 32)?;
        for (l, jl) in json.layers.iter().enumerate() {
            hash(&format!("layer {l}: checksum xxh3"), &jl.xxh3, 16)?;
        }
        let tid = trunk_id(&json.layers).map_err(|p| self.refuse(p))?;
        if tid != recorded_tid {
            return Err(self.refuse(Refusal::TrunkId {
                recorded: recorded_tid,
                computed: tid,
            }));
        }
        let digests: Vec<u64> = (json.layers.iter().enumerate())
            .map(|(l, jl)| layer_digest(l, jl))
            .collect();
        let computed = seal(json, &digests);
        if computed != recorded_seal {
            return Err(self.refuse(Refusal::Seal {
                recorded: recorded_seal,
                computed,
            }));
        }
        if m.n_layers != json.layers.len() {
            return Err(self.refuse(Refusal::LayerCount {
                n_layers: m.n_layers,
                entries: json.layers.len(),
            }));
        }
        Ok((codec, digests, tid, computed))
    }

    /// Every run aligned, non-empty, inside `trunk.bin` and disjoint from the others.
    fn runs(&self, json: &TrunkJson, bin_len: u64) -> Result<(), TrunkError> {
        if json.align == 0 {
            return Err(self.refuse(Refusal::ZeroAlign));
        }
        let mut spans = Vec::with_capacity(json.layers.len());
        for (l, jl) in json.layers.iter().enumerate() {
            if !jl.file_off.is_multiple_of(json.align) {
                return Err(self.refuse(Refusal::Unaligned {
                    layer: l,
                    file_off: jl.file_off,
                    align: json.align,
                }));
            }
            match jl.file_off.checked_add(jl.nbytes) {
                Some(end) if end <= bin_len && jl.nbytes > 0 => spans.push((jl.file_off, end, l)),
                _ => {
                    return Err(self.refuse(Refusal::OutsideFile {
                        layer: l,
                        file_off: jl.file_off,
                        nbytes: jl.nbytes,
                        file_len: bin_len,
                    }))
                }
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            let ((a0, a1, a), (b0, b1, b)) = (w[0], w[1]);
            if b0 < a1 {
                return Err(self.refuse(Refusal::Overlap {
                    a,
                    a0,
                    a1,
                    b,
                    b0,
                    b1,
                }));
            }
        }
        if json.layers.len() < self.cat.n_layers() {
            return Err(self.refuse(Refusal::TooFewLayers {
                has: json.layers.len(),
                needs: self.cat.n_layers(),
            }));
        }
        Ok(())
    }

    /// Is this the checkpoint the trunk was packed from? (Last: it may read the shards.)
    fn identity(&self, json: &TrunkJson) -> Result<(), TrunkError> {
        let m = (json.model.as_ref()).ok_or_else(|| self.refuse(Refusal::Missing("model")))?;
        let packed = parse_hash(&m.model_id, 32).unwrap_or_default();
        let packed_kind = IdentityKind::parse(&m.id_kind);
        let opened = ModelIdentity::of(self.cat)?;
        if Some(opened.kind) != packed_kind || opened.id != packed {
            return Err(self.refuse(Refusal::ForeignModel {
                packed,
                packed_kind: packed_kind.map_or("?", IdentityKind::name),
                model_dir: model_dir_of(self.cat),
                opened: opened.to_string(),
            }));
        }
        Ok(())
    }

    /// Layer `l`'s plan: exactly the checkpoint's trunk tensors, each with its dtype and length,
    /// a storage its dtype, length and the trunk's codec allow, inside the run and disjoint.
    fn layer(
        &self,
        l: usize,
        jl: &JsonLayer,
        codec: TrunkCodec,
        check: RunCheck,
    ) -> Result<LayerPlan, TrunkError> {
        let ts = self.cat.trunk(l);
        let extra: Vec<&str> = (jl.tensors.keys())
            .filter(|k| ts.iter().all(|t| &t.name != *k))
            .map(String::as_str)
            .collect();
        if !extra.is_empty() {
            return Err(self.refuse(Refusal::ExtraTensors {
                layer: l,
                names: extra.join(", "),
            }));
        }
        let mut locs = Vec::with_capacity(ts.len());
        let mut sums = BTreeMap::new();
        for t in ts {
            let (loc, sum) = self.tensor(l, jl, t, codec)?;
            locs.push(loc);
            sums.insert(t.name.clone(), sum);
        }
        locs.sort_by_key(|t| t.off);
        for w in locs.windows(2) {
            if w[0].off + w[0].nbytes > w[1].off {
                return Err(self.refuse(Refusal::OutsideRun {
                    layer: l,
                    name: w[1].name.clone(),
                    off: w[1].off,
                    stored: w[1].nbytes,
                    run: jl.nbytes,
                }));
            }
        }
        Ok(LayerPlan {
            run_len: jl.nbytes,
            layout: Arc::new(LayerLayout::new(locs)),
            check: Some(check),
            tensor_xxh3: Some(Arc::new(sums)),
            source: RunSource::Packed {
                file_off: jl.file_off,
            },
        })
    }

    /// The checkpoint tensor `t`'s entry in layer `l`: its place in the run and recorded hash.
    fn tensor(
        &self,
        l: usize,
        jl: &JsonLayer,
        t: &TensorExtent,
        codec: TrunkCodec,
    ) -> Result<(TensorLoc, u64), TrunkError> {
        let jt = jl.tensors.get(&t.name).ok_or_else(|| {
            self.refuse(Refusal::MissingTensor {
                layer: l,
                name: t.name.clone(),
            })
        })?;
        if jt.nbytes != t.nbytes || jt.dtype != t.dtype {
            return Err(self.refuse(Refusal::TensorMismatch {
                layer: l,
                name: t.name.clone(),
                dtype: jt.dtype,
                nbytes: jt.nbytes,
                ck_dtype: t.dtype,
                ck_nbytes: t.nbytes,
            }));
        }
        let (storage, stored) = stored_as(codec, jt).map_err(|problem| {
            self.refuse(Refusal::Stored {
                layer: l,
                name: t.name.clone(),
                problem,
            })
        })?;
        let aligned = jt.off.is_multiple_of(super::format::TENSOR_ALIGN);
        if !aligned || jt.off.checked_add(stored).is_none_or(|end| end > jl.nbytes) {
            return Err(self.refuse(Refusal::OutsideRun {
                layer: l,
                name: t.name.clone(),
                off: jt.off,
                stored,
                run: jl.nbytes,
            }));
        }
        // Parsed by `trunk_id` in `header`.
        let sum = parse_hash(&jt.xxh3, 16).unwrap_or_default() as u64;
        let loc = TensorLoc {
            name: t.name.clone(),
            off: jt.off,
            nbytes: stored,
            dtype: jt.dtype,
            storage,
            source_xxh3: Some(sum),
        };
        Ok((loc, sum))
    }
}

/// How a `trunk.json` tensor entry says it is stored, checked against the trunk's codec and the
/// checkpoint tensor: raw at its own length; EC-BF16 a BF16 tensor, at least the header; int8 or
/// int4 a BF16 matrix at the exact length some `[rows, cols]` with `rows·cols` elements gives
/// (the binder checks the shape itself).
fn stored_as(codec: TrunkCodec, jt: &JsonTensor) -> Result<(Storage, u64), StoredProblem> {
    let (Some(s), Some(n)) = (jt.codec, jt.stored) else {
        return Err(StoredProblem::Missing);
    };
    if !codec.allows(s) {
        return Err(StoredProblem::Codec {
            tensor: s.name(),
            trunk: codec.name(),
        });
    }
    let plausible = match s {
        Storage::Raw if n == jt.nbytes => return Ok((s, n)),
        Storage::Raw => {
            return Err(StoredProblem::RawLength {
                stored: n,
                nbytes: jt.nbytes,
            })
        }
        Storage::EcBf16 => n >= k3_proto::ecbf16::HEADER_BYTES as u64,
        Storage::Int8 => quant_len_fits(QuantKind::Int8, jt.nbytes / 2, n),
        Storage::Int4 => quant_len_fits(QuantKind::Int4, jt.nbytes / 2, n),
    };
    if jt.dtype == Dtype::BF16 && jt.nbytes.is_multiple_of(2) && plausible {
        Ok((s, n))
    } else {
        Err(StoredProblem::Length {
            codec: s.name(),
            stored: n,
            dtype: jt.dtype,
            nbytes: jt.nbytes,
        })
    }
}

/// Whether a quantized matrix of `elems` elements can take `stored` bytes: int4's length
/// depends on `elems` alone; int8's on its rows, which must then divide `elems`.
fn quant_len_fits(kind: QuantKind, elems: u64, stored: u64) -> bool {
    match kind {
        QuantKind::Int4 => {
            elems.is_multiple_of(32) && stored.checked_sub(64) == Some(elems / 2 + elems / 32 * 4)
        }
        QuantKind::Int8 => {
            let Some(scales) = stored.checked_sub(64 + elems) else {
                return false;
            };
            let rows = scales / 4;
            scales.is_multiple_of(4) && rows > 0 && elems.is_multiple_of(rows)
        }
    }
}

impl TrunkLayout {
    /// Read layers from a packed trunk in `dir`, validated against the catalog (SPEC.md §6.1,
    /// "Validation on open"): format [`TRUNK_FORMAT`] with a codec; the model identity, trunk
    /// identity, seal and every layer checksum present and well-formed; the trunk identity and
    /// the seal equal to what the tensor hashes and the descriptors give; every run aligned,
    /// non-empty, inside `trunk.bin` and disjoint; at least the checkpoint's layers; the model
    /// identity the checkpoint's; per layer exactly the checkpoint's trunk tensors, each with its
    /// dtype and length, a storage the trunk's codec allows at a plausible length, inside the
    /// run and disjoint. Any failure is a refusal naming the file, the layer and the tensor.
    pub fn from_packed(
        cat: &Catalog,
        shards: Vec<Arc<DiskFile>>,
        dir: &Path,
    ) -> Result<TrunkLayout, TrunkError> {
        let o = Opening {
            cat,
            json_path: dir.join(TRUNK_JSON),
            repack: format!("k3-ctl pack-trunk {} {}", model_dir_of(cat), dir.display()),
        };
        let json = o.read()?;
        let (codec, digests, tid, sealed) = o.header(&json)?;
        let bin = DiskFile::open(&dir.join(TRUNK_BIN)).map_err(|e| o.refuse(Refusal::Bin(e)))?;
        o.runs(&json, bin.len())?;
        o.identity(&json)?;
        let mut layers = Vec::with_capacity(cat.n_layers());
        for (l, jl) in json.layers.iter().enumerate().take(cat.n_layers()) {
            if cat.trunk(l).is_empty() {
                layers.push(None);
                continue;
            }
            let check = RunCheck {
                digest: digests[l],
                // Parsed by `header`.
                want: parse_hash(&jl.xxh3, 16).unwrap_or_default() as u64,
            };
            layers.push(Some(o.layer(l, jl, codec, check)?));
        }
        Ok(TrunkLayout {
            layers,
            shards,
            packed: Some(Arc::new(bin)),
            packed_dir: Some(dir.to_path_buf()),
            trunk_id: Some(tid),
            seal: Some(sealed),
            codec: Some(codec),
        })
    }
}
