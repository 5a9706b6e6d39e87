//! `k3-ctl inspect <model_dir> [--json]`: config summary, layer map and tensor census of a
//! checkpoint directory. Exits 2 with every problem listed when the config or the index cannot
//! be read with confidence, or when the census finds the routed experts incomplete or a tensor
//! the engine reads of another dtype or shape than the config says (`k3_proto::tensors`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use k3_proto::config::ModelConfig;
use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_proto::names::{self, TensorClass};
use k3_proto::safetensors::CheckpointIndex;

use crate::fail::Failed;

/// Arguments of `k3-ctl inspect`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (holds `config.json` and the safetensors shards).
    pub model_dir: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Problems listed one by one before the rest are only counted.
const MAX_LISTED: usize = 20;

/// What the tensors of a checkpoint add up to.
#[derive(Debug, Default)]
pub struct Census {
    pub n_tensors: usize,
    pub n_model: usize,
    pub n_trunk: usize,
    pub n_expert_tensors: usize,
    pub n_other: usize,
    pub n_skipped: usize,
    /// Distinct (layer, expert) pairs with at least one part.
    pub n_routed_experts: usize,
    /// Bytes of one routed expert implied by the config.
    pub expert_bytes: u64,
    /// Sum of all routed-expert tensors.
    pub expert_total_bytes: u64,
    /// Sum of all non-expert per-layer tensors.
    pub trunk_bytes: u64,
    /// Trunk bytes per layer.
    pub layer_bytes: Vec<u64>,
    pub largest_layer: usize,
    pub largest_layer_bytes: u64,
    pub embed_head_bytes: u64,
    /// The model-level tensors (embedding, lm_head, final norm, output aggregator).
    pub resident_bytes: u64,
    pub other_bytes: u64,
    pub problems: Vec<String>,
}

/// The problems found, listing at most [`MAX_LISTED`] and counting the rest.
#[derive(Default)]
struct Problems {
    list: Vec<String>,
    overflow: usize,
}

impl Problems {
    /// Pushes a problem, counting (not listing) those past the limit.
    fn note(&mut self, p: String) {
        if self.list.len() < MAX_LISTED {
            self.list.push(p);
        } else {
            self.overflow += 1;
        }
    }

    fn into_list(mut self) -> Vec<String> {
        if self.overflow > 0 {
            self.list
                .push(format!("… and {} more problems", self.overflow));
        }
        self.list
    }
}

/// Counts every tensor and checks routed experts and model-level tensors against the config.
pub fn census(cfg: &ModelConfig, idx: &CheckpointIndex) -> Census {
    let n_layers = cfg.num_hidden_layers;
    let layout: ExpertLayout = cfg.expert_layout();
    let mut c = Census {
        n_tensors: idx.len(),
        n_skipped: idx.skipped().len(),
        expert_bytes: layout.expert_bytes() as u64,
        layer_bytes: vec![0; n_layers],
        ..Census::default()
    };
    let mut problems = Problems::default();
    // (layer, expert) → bitmask of parts seen.
    let mut experts: HashMap<(u32, u32), u8> = HashMap::new();
    for t in idx.iter() {
        count(cfg, &mut c, &mut problems, &mut experts, t.name, t.nbytes);
    }
    c.n_routed_experts = experts.len();
    missing_experts(cfg, &experts, &mut problems);
    // Every tensor the engine reads against the config's dtype and shape: the check every
    // command that reads the headers runs (`k3_proto::tensors::check`).
    if let Err(e) = k3_proto::tensors::check(cfg, idx) {
        for line in e.lines() {
            problems.note(line);
        }
    }
    for (l, &b) in c.layer_bytes.iter().enumerate() {
        if b == 0 {
            problems.note(format!("layer {l} has no trunk tensors"));
        }
        if b > c.largest_layer_bytes {
            c.largest_layer_bytes = b;
            c.largest_layer = l;
        }
    }
    c.problems = problems.into_list();
    c
}

/// Count one tensor (`name`, `nbytes`) in its class, noting what does not fit the config.
fn count(
    cfg: &ModelConfig,
    c: &mut Census,
    problems: &mut Problems,
    experts: &mut HashMap<(u32, u32), u8>,
    name: &str,
    nbytes: u64,
) {
    let n_layers = cfg.num_hidden_layers;
    match names::classify(name) {
        TensorClass::Model => {
            c.n_model += 1;
            c.resident_bytes += nbytes;
            if name == names::EMBED || name == names::LM_HEAD {
                c.embed_head_bytes += nbytes;
            }
        }
        TensorClass::Trunk { layer } => {
            c.n_trunk += 1;
            c.trunk_bytes += nbytes;
            if layer >= n_layers {
                problems.note(format!(
                    "`{name}`: layer {layer} does not exist ({n_layers} layers)"
                ));
            } else {
                c.layer_bytes[layer] += nbytes;
            }
            if name.contains(".block_sparse_moe.experts.") {
                problems.note(format!(
                    "`{name}` is not one of the six MXFP4 routed-expert tensors"
                ));
            }
        }
        TensorClass::Expert {
            layer,
            expert,
            part,
        } => {
            c.n_expert_tensors += 1;
            c.expert_total_bytes += nbytes;
            if layer >= n_layers || !cfg.is_moe(layer) {
                problems.note(format!("`{name}`: layer {layer} is not a MoE layer"));
            } else if expert >= cfg.num_experts {
                problems.note(format!(
                    "`{name}`: expert {expert} does not exist ({} experts)",
                    cfg.num_experts
                ));
            } else {
                *experts.entry((layer as u32, expert as u32)).or_default() |= 1 << part.index();
            }
        }
        TensorClass::Other => {
            c.n_other += 1;
            c.other_bytes += nbytes;
        }
    }
}

/// Every MoE layer must hold every expert with all six parts: note how many do not, and list a
/// few (the scan stops after them, so it visits at most `complete + examples` pairs however
/// large the config claims the model is).
fn missing_experts(cfg: &ModelConfig, experts: &HashMap<(u32, u32), u8>, problems: &mut Problems) {
    let complete = experts.values().filter(|&&m| m == 0x3f).count() as u64;
    let expected = (cfg.n_moe() as u64) * (cfg.num_experts as u64);
    let missing_total = expected.saturating_sub(complete);
    if missing_total == 0 {
        return;
    }
    problems.note(format!(
        "{missing_total} of {expected} routed experts ({} MoE layers × {}) are missing or \
         incomplete",
        cfg.n_moe(),
        cfg.num_experts
    ));
    let mut listed = 0;
    for l in cfg.first_k_dense_replace..cfg.num_hidden_layers {
        for e in 0..cfg.num_experts {
            let mask = experts.get(&(l as u32, e as u32)).copied().unwrap_or(0);
            if mask == 0x3f {
                continue;
            }
            let absent: Vec<ExpertPart> = ExpertPart::ALL
                .into_iter()
                .filter(|p| mask & (1 << p.index()) == 0)
                .collect();
            let what = if mask == 0 {
                "all six parts".to_string()
            } else {
                let parts: Vec<&str> = absent.iter().map(|p| p.suffix()).collect();
                parts.join(", ")
            };
            problems.note(format!(
                "routed expert {e} of layer {l} lacks {what} (e.g. `{}`)",
                names::expert_tensor(l, e, absent[0])
            ));
            listed += 1;
            if listed == MAX_LISTED / 2 || listed as u64 == missing_total {
                return;
            }
        }
    }
}

/// A size in human decimal units (GB from 1 GB up, else MB).
fn gb(b: u64) -> String {
    k3_store::runtime::plan::fmt_bytes(b)
}

/// The refusal of a checkpoint with `problems` (each on a line of the message); with `json`,
/// the JSON answer `{"ok": false, "problems": …}` on stdout too.
fn refuse(json: bool, problems: &[String]) -> Failed {
    if json {
        println!(
            "{}",
            serde_json::json!({ "ok": false, "problems": problems })
        );
    }
    let mut what = format!(
        "refused ({} problem{}):",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems {
        what.push_str("\n  - ");
        what.push_str(p);
    }
    Failed::refused(what)
}

/// Reads config + index of `dir`; on failure, every problem of both.
fn open(dir: &Path) -> Result<(PathBuf, ModelConfig, CheckpointIndex, f64), Vec<String>> {
    let cfg_path = dir.join("config.json");
    let cfg = ModelConfig::load(&cfg_path);
    let t0 = Instant::now();
    let idx = CheckpointIndex::open(dir);
    let secs = t0.elapsed().as_secs_f64();
    match (cfg, idx) {
        (Ok(c), Ok(i)) => Ok((cfg_path, c, i, secs)),
        (c, i) => {
            let mut problems = Vec::new();
            if let Err(e) = c {
                problems.extend(
                    e.problems
                        .into_iter()
                        .map(|p| format!("{}: {p}", cfg_path.display())),
                );
            }
            if let Err(e) = i {
                problems.extend(e.problems());
            }
            Err(problems)
        }
    }
}

pub fn run(a: Args) -> Result<i32, Failed> {
    let (cfg_path, cfg, idx, secs) = open(&a.model_dir).map_err(|p| refuse(a.json, &p))?;
    let c = census(&cfg, &idx);
    let per_tensor = if idx.is_empty() {
        0.0
    } else {
        idx.heap_bytes() as f64 / idx.len() as f64
    };
    if a.json {
        let j = serde_json::json!({
            "ok": c.problems.is_empty(),
            "config": cfg_path.display().to_string(),
            "config_shape": cfg.shape.name(),
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "vocab_size": cfg.vocab_size,
            "n_mla": cfg.n_mla(),
            "n_kda": cfg.n_kda(),
            "num_experts": cfg.num_experts,
            "num_experts_per_token": cfg.num_experts_per_token,
            "num_shared_experts": cfg.num_shared_experts,
            "latent": cfg.routed_expert_hidden_size,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "layer_map": cfg.layer_map(),
            "n_shards": idx.n_shards(),
            "n_tensors": c.n_tensors,
            "n_model_tensors": c.n_model,
            "n_trunk_tensors": c.n_trunk,
            "n_expert_tensors": c.n_expert_tensors,
            "n_other_tensors": c.n_other,
            "n_skipped_tensors": c.n_skipped,
            "n_routed_experts": c.n_routed_experts,
            "expert_bytes": c.expert_bytes,
            "expert_total_bytes": c.expert_total_bytes,
            "trunk_bytes": c.trunk_bytes,
            "layer_bytes": c.layer_bytes,
            "largest_layer": c.largest_layer,
            "largest_layer_bytes": c.largest_layer_bytes,
            "embed_head_bytes": c.embed_head_bytes,
            "resident_bytes": c.resident_bytes,
            "other_bytes": c.other_bytes,
            "index_seconds": secs,
            "index_heap_bytes": idx.heap_bytes(),
            "index_bytes_per_tensor": per_tensor,
            "problems": c.problems,
        });
        println!("{j}");
    } else {
        println!(
            "config: {} ({} shape) | hidden={} layers={} vocab={} | {} MLA + {} KDA | experts {} \
             top{} shared{} | latent={}",
            cfg_path.display(),
            cfg.shape.name(),
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.vocab_size,
            cfg.n_mla(),
            cfg.n_kda(),
            cfg.num_experts,
            cfg.num_experts_per_token,
            cfg.num_shared_experts,
            cfg.routed_expert_hidden_size
        );
        println!("layer map: {}", cfg.layer_map());
        println!(
            "tensors: {} in {} shards (model {}, trunk {}, routed-expert {}, other {}, skipped {})",
            c.n_tensors,
            idx.n_shards(),
            c.n_model,
            c.n_trunk,
            c.n_expert_tensors,
            c.n_other,
            c.n_skipped
        );
        println!(
            "routed experts: {} × {} bytes = {} bytes ({})",
            c.n_routed_experts,
            c.expert_bytes,
            c.expert_total_bytes,
            gb(c.expert_total_bytes)
        );
        println!(
            "trunk: {} bytes ({}); largest layer run: layer {}, {} bytes ({})",
            c.trunk_bytes,
            gb(c.trunk_bytes),
            c.largest_layer,
            c.largest_layer_bytes,
            gb(c.largest_layer_bytes)
        );
        println!(
            "embed+lm_head: {} bytes ({}); always-resident (model-level): {} bytes ({})",
            c.embed_head_bytes,
            gb(c.embed_head_bytes),
            c.resident_bytes,
            gb(c.resident_bytes)
        );
        println!(
            "index: {secs:.3} s, {} heap bytes ({per_tensor:.1} bytes/tensor)",
            idx.heap_bytes()
        );
    }
    if c.problems.is_empty() {
        Ok(k3_proto::exit::OK)
    } else {
        Err(refuse(false, &c.problems))
    }
}
