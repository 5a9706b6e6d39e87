//! The store's view of a checkpoint: where every tensor it serves lives on disk.
//!
//! A [`Catalog`] is built once from the checkpoint index (`k3_proto::safetensors`) and the config:
//! the model-level tensors, each layer's trunk tensors, and each routed expert's six parts, all as
//! (shard, absolute offset, length) extents that have been bounds-checked against the shard's size.
//! Everything else in this crate (packing, streaming, the expert cache, the memory plan) reads the
//! catalog only, so it can be tested with hand-written extents.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_proto::Dtype;

/// One tensor's bytes in a shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorExtent {
    /// Canonical full checkpoint name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shard number (index into [`Catalog::shard_paths`]).
    pub shard: u16,
    /// Absolute byte offset in the shard file.
    pub off: u64,
    /// Byte length.
    pub nbytes: u64,
}

/// Where one part of a routed expert lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PartExtent {
    /// Shard number.
    pub shard: u16,
    /// Absolute byte offset in the shard file.
    pub off: u64,
    /// Byte length (equals the canonical part size).
    pub nbytes: u64,
}

/// The six parts of one routed expert, in canonical order ([`ExpertPart::ALL`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertExtents {
    /// Per part, in slot order.
    pub parts: [PartExtent; 6],
}

impl ExpertExtents {
    /// `Some((shard, off))` when the six parts are one contiguous run in canonical order in one
    /// shard, so the whole expert is one read of `expert_bytes` from `off`.
    pub fn coalesced(&self) -> Option<(u16, u64)> {
        let first = self.parts[0];
        let mut end = first.off;
        for p in &self.parts {
            if p.shard != first.shard || p.off != end {
                return None;
            }
            end = p.off + p.nbytes;
        }
        Some((first.shard, first.off))
    }

    /// The smallest (shard, offset) of the expert, used to order reads by disk position.
    pub fn disk_key(&self) -> (u16, u64) {
        self.parts
            .iter()
            .map(|p| (p.shard, p.off))
            .min()
            .unwrap_or_default()
    }
}

/// A checkpoint problem found while building the catalog.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CatalogError(pub String);

/// Where every tensor the store serves lives on disk.
#[derive(Debug, Clone)]
pub struct Catalog {
    shard_paths: Vec<PathBuf>,
    shard_lens: Vec<u64>,
    model: Vec<TensorExtent>,
    layers: Vec<Vec<TensorExtent>>,
    /// `[layer][expert]`, partially filled while building.
    experts: Vec<Vec<[Option<PartExtent>; 6]>>,
    n_experts: usize,
    layout: ExpertLayout,
}

impl Catalog {
    /// An empty catalog for `n_layers` layers and `n_experts` routed experts per layer, over the
    /// given shard files (path, size in bytes).
    pub fn new(
        shards: Vec<(PathBuf, u64)>,
        n_layers: usize,
        n_experts: usize,
        layout: ExpertLayout,
    ) -> Catalog {
        let (shard_paths, shard_lens) = shards.into_iter().unzip();
        Catalog {
            shard_paths,
            shard_lens,
            model: Vec::new(),
            layers: vec![Vec::new(); n_layers],
            experts: vec![Vec::new(); n_layers],
            n_experts,
            layout,
        }
    }

    fn check_extent(
        &self,
        name: &str,
        shard: u16,
        off: u64,
        nbytes: u64,
    ) -> Result<(), CatalogError> {
        let Some(&len) = self.shard_lens.get(shard as usize) else {
            return Err(CatalogError(format!(
                "{name}: shard {shard} does not exist"
            )));
        };
        match off.checked_add(nbytes) {
            Some(end) if end <= len => Ok(()),
            _ => Err(CatalogError(format!(
                "{name}: bytes {off}..+{nbytes} lie outside {} ({len} bytes)",
                self.shard_paths[shard as usize].display()
            ))),
        }
    }

    /// Add a model-level tensor (embedding, lm_head, final norms).
    pub fn add_model(&mut self, t: TensorExtent) -> Result<(), CatalogError> {
        self.check_extent(&t.name, t.shard, t.off, t.nbytes)?;
        self.model.push(t);
        Ok(())
    }

    /// Add a trunk (non-expert) tensor of layer `layer`.
    pub fn add_trunk(&mut self, layer: usize, t: TensorExtent) -> Result<(), CatalogError> {
        self.check_extent(&t.name, t.shard, t.off, t.nbytes)?;
        let n = self.layers.len();
        let l = self.layers.get_mut(layer).ok_or_else(|| {
            CatalogError(format!(
                "{}: layer {layer} out of range (model has {n})",
                t.name
            ))
        })?;
        l.push(t);
        Ok(())
    }

    /// Add one part of routed expert `expert` of layer `layer`.
    pub fn add_expert_part(
        &mut self,
        layer: usize,
        expert: usize,
        part: ExpertPart,
        dtype: Dtype,
        ext: PartExtent,
    ) -> Result<(), CatalogError> {
        let what = format!("layer {layer} expert {expert} {}", part.suffix());
        self.check_extent(&what, ext.shard, ext.off, ext.nbytes)?;
        if dtype != Dtype::U8 {
            return Err(CatalogError(format!(
                "{what}: dtype {dtype}, expected U8 (MXFP4)"
            )));
        }
        let want = self.layout.part_bytes(part) as u64;
        if ext.nbytes != want {
            return Err(CatalogError(format!(
                "{what}: {} bytes, expected {want} for the configured expert shape",
                ext.nbytes
            )));
        }
        if layer >= self.layers.len() || expert >= self.n_experts {
            return Err(CatalogError(format!(
                "{what}: out of range ({} layers, {} experts)",
                self.layers.len(),
                self.n_experts
            )));
        }
        let row = &mut self.experts[layer];
        if row.is_empty() {
            row.resize(self.n_experts, [None; 6]);
        }
        let slot = &mut row[expert][part.index()];
        if slot.is_some() {
            return Err(CatalogError(format!("{what}: listed twice")));
        }
        *slot = Some(ext);
        Ok(())
    }

    /// Finish building: sorts, rejects duplicate names and half-present experts.
    pub fn finish(mut self) -> Result<Catalog, CatalogError> {
        let mut seen = HashSet::new();
        for t in self.model.iter().chain(self.layers.iter().flatten()) {
            if !seen.insert(t.name.as_str()) {
                return Err(CatalogError(format!("{}: listed twice", t.name)));
            }
        }
        self.model.sort_by(|a, b| a.name.cmp(&b.name));
        for l in &mut self.layers {
            l.sort_by(|a, b| a.name.cmp(&b.name));
        }
        for (l, row) in self.experts.iter().enumerate() {
            for (e, parts) in row.iter().enumerate() {
                let n = parts.iter().filter(|p| p.is_some()).count();
                if n != 0 && n != 6 {
                    let missing: Vec<&str> = ExpertPart::ALL
                        .iter()
                        .zip(parts)
                        .filter(|(_, p)| p.is_none())
                        .map(|(q, _)| q.suffix())
                        .collect();
                    return Err(CatalogError(format!(
                        "layer {l} expert {e}: missing {}",
                        missing.join(", ")
                    )));
                }
            }
        }
        Ok(self)
    }

    /// Shard file paths.
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.shard_paths
    }

    /// Shard file sizes recorded by the index.
    pub fn shard_lens(&self) -> &[u64] {
        &self.shard_lens
    }

    /// Number of decoder layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Routed experts per layer.
    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    /// The canonical expert slot layout.
    pub fn expert_layout(&self) -> ExpertLayout {
        self.layout
    }

    /// Model-level tensors, sorted by name.
    pub fn model_tensors(&self) -> &[TensorExtent] {
        &self.model
    }

    /// Trunk tensors of layer `l`, sorted by name (empty when the layer is absent).
    pub fn trunk(&self, l: usize) -> &[TensorExtent] {
        self.layers.get(l).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The six parts of expert `e` of layer `l`, or `None` if the checkpoint lacks it.
    pub fn expert(&self, l: usize, e: usize) -> Option<ExpertExtents> {
        let parts = self.experts.get(l)?.get(e)?;
        let mut out = [PartExtent::default(); 6];
        for (o, p) in out.iter_mut().zip(parts) {
            *o = (*p)?;
        }
        Some(ExpertExtents { parts: out })
    }

    /// Every routed expert the checkpoint holds, as `(layer, expert)` in layer order.
    pub fn routed_experts(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        (0..self.n_layers()).flat_map(move |l| {
            (0..self.n_experts())
                .filter(move |&e| self.expert(l, e).is_some())
                .map(move |e| (l, e as u32))
        })
    }

    /// Sum of trunk bytes of layer `l`.
    pub fn trunk_bytes(&self, l: usize) -> u64 {
        self.trunk(l).iter().map(|t| t.nbytes).sum()
    }

    /// Open the checkpoint in `dir` through the proto index and config (see `from_index`),
    /// holding every tensor the engine reads to the config's dtype and shape
    /// ([`k3_proto::tensors::check`]): the first command that reads the headers refuses a
    /// transposed or wrongly typed tensor, a missing one or a missing index, naming it.
    pub fn open_dir(dir: &Path) -> Result<(Catalog, k3_proto::config::ModelConfig), CatalogError> {
        Catalog::open(dir, true)
    }

    /// [`Catalog::open_dir`] without the engine's shape check: for tensor sets that are not a
    /// model's (the store library's own test checkpoints).
    pub fn open_dir_unchecked(
        dir: &Path,
    ) -> Result<(Catalog, k3_proto::config::ModelConfig), CatalogError> {
        Catalog::open(dir, false)
    }

    fn open(
        dir: &Path,
        check_shapes: bool,
    ) -> Result<(Catalog, k3_proto::config::ModelConfig), CatalogError> {
        let cfg = k3_proto::config::ModelConfig::load(&dir.join("config.json")).map_err(|e| {
            CatalogError(format!("config {}: {e}", dir.join("config.json").display()))
        })?;
        let index = k3_proto::safetensors::CheckpointIndex::open(dir)
            .map_err(|e| CatalogError(format!("checkpoint index {}: {e}", dir.display())))?;
        if check_shapes {
            k3_proto::tensors::check(&cfg, &index)
                .map_err(|e| CatalogError(format!("{}: {e}", dir.display())))?;
        }
        let cat = Catalog::from_index(&index, &cfg)?;
        Ok((cat, cfg))
    }

    /// Build from the proto checkpoint index and config. Tensors of layers at or past
    /// `cfg.num_hidden_layers` are ignored (so a `with_layers(n)` config gives a partial view).
    /// Any tensor set is taken (the store library serves bytes); [`Catalog::open_dir`] and the
    /// standalone source also hold it to the engine's dtypes and shapes.
    pub fn from_index(
        index: &k3_proto::safetensors::CheckpointIndex,
        cfg: &k3_proto::config::ModelConfig,
    ) -> Result<Catalog, CatalogError> {
        use k3_proto::names::{classify, TensorClass};
        let shards = (0..index.n_shards())
            .map(|s| {
                let s = s as u16;
                (index.shard_path(s).to_path_buf(), index.shard_len(s))
            })
            .collect();
        let mut cat = Catalog::new(
            shards,
            cfg.num_hidden_layers,
            cfg.num_experts,
            cfg.expert_layout(),
        );
        for t in index.iter() {
            let ext = TensorExtent {
                name: t.name.to_string(),
                dtype: t.dtype,
                shard: t.shard,
                off: t.offset,
                nbytes: t.nbytes,
            };
            match classify(t.name) {
                TensorClass::Model => cat.add_model(ext)?,
                TensorClass::Trunk { layer } if layer < cfg.num_hidden_layers => {
                    cat.add_trunk(layer, ext)?
                }
                TensorClass::Expert {
                    layer,
                    expert,
                    part,
                } if layer < cfg.num_hidden_layers => cat.add_expert_part(
                    layer,
                    expert,
                    part,
                    t.dtype,
                    PartExtent {
                        shard: t.shard,
                        off: t.offset,
                        nbytes: t.nbytes,
                    },
                )?,
                _ => {}
            }
        }
        cat.finish()
    }
}
