//! A whole-checkpoint-in-memory `WeightSource` over a safetensors directory, for tests on the
//! small fixtures (the product uses `k3_store`'s sources). Each layer's trunk tensors are copied
//! into one run with a layout; each expert's six parts into the canonical slot layout.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use k3_proto::config::ModelConfig;
use k3_proto::expert::ExpertLayout;
use k3_proto::names::{classify, TensorClass};
use k3_proto::safetensors::CheckpointIndex;
use k3_store::runtime::source::{
    ExpertBatch, ExpertError, LayerLayout, LayerRun, Region, SourceError, SourceStats, TensorLoc,
    WeightSource,
};

pub struct CkptSource {
    pub index: CheckpointIndex,
    pub config: ModelConfig,
    model: BTreeMap<String, Region>,
    layers: Vec<(Region, Arc<LayerLayout>)>,
    experts: BTreeMap<(usize, usize), Region>,
}

fn whole(v: Vec<u8>) -> Region {
    Region::whole(Arc::new(v))
}

impl CkptSource {
    pub fn open(dir: &Path) -> CkptSource {
        let config = ModelConfig::load(&dir.join("config.json")).expect("config");
        let index = CheckpointIndex::open(dir).expect("index");
        let shards: Vec<Vec<u8>> = (0..index.n_shards() as u16)
            .map(|s| std::fs::read(index.shard_path(s)).expect("shard"))
            .collect();
        let bytes = |t: &k3_proto::safetensors::TensorInfo| {
            shards[t.shard as usize][t.offset as usize..(t.offset + t.nbytes) as usize].to_vec()
        };
        let layout = config.expert_layout();
        let mut model = BTreeMap::new();
        let mut runs: Vec<(Vec<u8>, Vec<TensorLoc>)> =
            vec![(Vec::new(), Vec::new()); config.num_hidden_layers];
        let mut parts: BTreeMap<(usize, usize), Vec<Option<Vec<u8>>>> = BTreeMap::new();
        for t in index.iter() {
            match classify(t.name) {
                TensorClass::Model => {
                    model.insert(t.name.to_string(), whole(bytes(&t)));
                }
                TensorClass::Trunk { layer } => {
                    let (run, locs) = &mut runs[layer];
                    locs.push(TensorLoc {
                        name: t.name.to_string(),
                        off: run.len() as u64,
                        nbytes: t.nbytes,
                        dtype: t.dtype,
                        storage: Default::default(),
                        source_xxh3: None,
                    });
                    run.extend(bytes(&t));
                }
                TensorClass::Expert {
                    layer,
                    expert,
                    part,
                } => {
                    parts
                        .entry((layer, expert))
                        .or_insert_with(|| vec![None; 6])[part.index()] = Some(bytes(&t));
                }
                TensorClass::Other => {}
            }
        }
        let experts = parts
            .into_iter()
            .map(|(k, p)| {
                let slot: Vec<u8> = p
                    .into_iter()
                    .flat_map(|b| b.expect("all six parts"))
                    .collect();
                assert_eq!(slot.len(), ExpertLayout::expert_bytes(&layout));
                (k, whole(slot))
            })
            .collect();
        let layers = runs
            .into_iter()
            .map(|(b, l)| (whole(b), Arc::new(LayerLayout::new(l))))
            .collect();
        CkptSource {
            index,
            config,
            model,
            layers,
            experts,
        }
    }
}

impl WeightSource for CkptSource {
    fn model_tensor(&self, name: &str) -> Result<Region, SourceError> {
        self.model
            .get(name)
            .cloned()
            .ok_or_else(|| SourceError::Missing(name.into()))
    }

    fn layer(&self, l: usize) -> Result<LayerRun, SourceError> {
        let (region, layout) = self
            .layers
            .get(l)
            .ok_or_else(|| SourceError::Invalid(format!("layer {l}")))?;
        Ok(LayerRun {
            layer: l,
            region: region.clone(),
            layout: layout.clone(),
        })
    }

    fn experts(&self, l: usize, ids: &[u32]) -> Result<ExpertBatch, SourceError> {
        Ok(ExpertBatch {
            experts: ids
                .iter()
                .map(|&e| {
                    self.experts.get(&(l, e as usize)).cloned().ok_or(
                        ExpertError::NotInCheckpoint {
                            layer: l,
                            expert: e,
                        },
                    )
                })
                .collect(),
        })
    }

    /// Every expert is in memory here.
    fn resident_experts(&self, l: usize, ids: &[u32]) -> ExpertBatch {
        self.experts(l, ids).unwrap_or_else(|e| ExpertBatch {
            experts: ids
                .iter()
                .map(|_| Err(ExpertError::Request(e.to_string())))
                .collect(),
        })
    }

    fn stats(&self) -> SourceStats {
        SourceStats::default()
    }
}
