//! Checkpoint index at scale: memory per tensor (asserted) and build time (printed, not
//! asserted). Default 100k tensors in 10 shards; set `K3_INDEX_SCALE_TENSORS=497052` and
//! `K3_INDEX_SCALE_SHARDS=96` (with `--release -- --nocapture`) to measure the release's size.

use crate::common;

use std::time::Instant;

use common::{t, write_index_json, write_shard, TempDir, T};
use k3_proto::expert::{ExpertLayout, ExpertPart};
use k3_proto::names;
use k3_proto::safetensors::CheckpointIndex;

/// Per-layer non-expert suffixes of a KDA + MoE layer (SPEC.md §2.3, §2.4, §2.7): 28 tensors.
const KDA_MOE: &[(&str, &str, &[u64])] = &[
    ("input_layernorm.weight", "BF16", &[7168]),
    ("post_attention_layernorm.weight", "BF16", &[7168]),
    ("self_attention_res_norm.weight", "BF16", &[7168]),
    ("self_attention_res_proj.weight", "BF16", &[1, 7168]),
    ("mlp_res_norm.weight", "BF16", &[7168]),
    ("mlp_res_proj.weight", "BF16", &[1, 7168]),
    ("self_attn.q_proj.weight", "BF16", &[12288, 7168]),
    ("self_attn.k_proj.weight", "BF16", &[12288, 7168]),
    ("self_attn.v_proj.weight", "BF16", &[12288, 7168]),
    ("self_attn.q_conv1d.weight", "F32", &[12288, 1, 4]),
    ("self_attn.k_conv1d.weight", "F32", &[12288, 1, 4]),
    ("self_attn.v_conv1d.weight", "F32", &[12288, 1, 4]),
    ("self_attn.f_a_proj.weight", "BF16", &[128, 7168]),
    ("self_attn.f_b_proj.weight", "BF16", &[12288, 128]),
    ("self_attn.A_log", "F32", &[128]),
    ("self_attn.dt_bias", "F32", &[12288]),
    ("self_attn.b_proj.weight", "BF16", &[96, 7168]),
    ("self_attn.g_proj.weight", "BF16", &[12288, 7168]),
    ("self_attn.o_norm.weight", "F32", &[128]),
    ("self_attn.o_proj.weight", "BF16", &[7168, 12288]),
    ("block_sparse_moe.gate.weight", "BF16", &[896, 7168]),
    (
        "block_sparse_moe.gate.e_score_correction_bias",
        "F32",
        &[896],
    ),
    (
        "block_sparse_moe.routed_expert_down_proj.weight",
        "BF16",
        &[3584, 7168],
    ),
    (
        "block_sparse_moe.routed_expert_norm.weight",
        "BF16",
        &[3584],
    ),
    (
        "block_sparse_moe.routed_expert_up_proj.weight",
        "BF16",
        &[7168, 3584],
    ),
    (
        "block_sparse_moe.shared_experts.gate_proj.weight",
        "BF16",
        &[6144, 7168],
    ),
    (
        "block_sparse_moe.shared_experts.up_proj.weight",
        "BF16",
        &[6144, 7168],
    ),
    (
        "block_sparse_moe.shared_experts.down_proj.weight",
        "BF16",
        &[7168, 6144],
    ),
];

/// CPU seconds (user + system, all threads) of this process so far, where /proc is available.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn env_usize(k: &str, default: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Release-like tensor list: model-level, 93 layers of non-expert tensors, then experts, cut at
/// `n` tensors.
fn tensors(n: usize) -> Vec<T> {
    let layout = ExpertLayout {
        inter: 3072,
        latent: 3584,
    };
    let mut v = Vec::with_capacity(n);
    v.push(t(names::EMBED, "BF16", &[163840, 7168]));
    v.push(t(names::FINAL_NORM, "BF16", &[7168]));
    v.push(t(names::OUT_RES_NORM, "BF16", &[7168]));
    v.push(t(names::OUT_RES_PROJ, "BF16", &[1, 7168]));
    v.push(t(names::LM_HEAD, "BF16", &[163840, 7168]));
    'outer: for l in 0..93 {
        for (suffix, dtype, shape) in KDA_MOE {
            if v.len() == n {
                break 'outer;
            }
            v.push(t(&names::layer_tensor(l, suffix), dtype, shape));
        }
    }
    'experts: for l in 1..93 {
        for e in 0..896 {
            for part in ExpertPart::ALL {
                if v.len() >= n {
                    break 'experts;
                }
                let s = layout.stored_shape(part);
                v.push(t(
                    &names::expert_tensor(l, e, part),
                    "U8",
                    &[s[0] as u64, s[1] as u64],
                ));
            }
        }
    }
    v.truncate(n);
    v
}

#[test]
fn index_of_many_tensors_stays_under_200_bytes_each() {
    let n = env_usize("K3_INDEX_SCALE_TENSORS", 100_000);
    let n_shards = env_usize("K3_INDEX_SCALE_SHARDS", 10).max(1);
    let dir = TempDir::new("scale");
    let all = tensors(n);
    let per = all.len().div_ceil(n_shards);
    let mut placed = Vec::with_capacity(all.len());
    let mut files = Vec::new();
    let w0 = Instant::now();
    for (i, chunk) in all.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{:06}.safetensors", i + 1, n_shards);
        let p = write_shard(&dir.join(&file), chunk);
        placed.extend(p.into_iter().map(|p| (p, i as u16)));
        files.push(file);
    }
    let entries: Vec<(&str, &str)> = placed
        .iter()
        .map(|(p, s)| (p.name.as_str(), files[usize::from(*s)].as_str()))
        .collect();
    write_index_json(dir.path(), &entries);
    let written = w0.elapsed();

    // Best of three opens (wall clock), plus the CPU time of the last one.
    let mut secs = f64::INFINITY;
    let mut cpu = None;
    let mut idx = None;
    for _ in 0..3 {
        drop(idx.take());
        let c0 = cpu_seconds();
        let t0 = Instant::now();
        idx = Some(CheckpointIndex::open(dir.path()).unwrap());
        secs = secs.min(t0.elapsed().as_secs_f64());
        cpu = c0.zip(cpu_seconds()).map(|(a, b)| b - a);
    }
    let idx = idx.unwrap();

    assert_eq!(idx.len(), all.len());
    assert_eq!(idx.n_shards(), files.len());
    let per_tensor = idx.heap_bytes() as f64 / idx.len() as f64;
    let name_bytes: usize = all.iter().map(|t| t.name.len()).sum();
    eprintln!(
        "index_scale: {} tensors in {} shards: open {:.3} s wall (best of 3), {} CPU; heap {} bytes = {:.1} bytes/tensor \
         (names avg {:.1}); writing the synthetic shards took {:.2} s",
        idx.len(),
        idx.n_shards(),
        secs,
        cpu.map(|c| format!("{c:.2} s")).unwrap_or_else(|| "?".into()),
        idx.heap_bytes(),
        per_tensor,
        name_bytes as f64 / all.len() as f64,
        written.as_secs_f64()
    );
    assert!(per_tensor <= 200.0, "{per_tensor} bytes per tensor");

    let t1 = Instant::now();
    for (p, shard) in &placed {
        let ti = idx.get(&p.name).unwrap();
        assert_eq!(
            (ti.shard, ti.offset, ti.nbytes),
            (*shard, p.offset, p.nbytes)
        );
    }
    eprintln!(
        "index_scale: {} lookups in {:.3} s",
        placed.len(),
        t1.elapsed().as_secs_f64()
    );
}
