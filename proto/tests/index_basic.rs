//! Checkpoint index: happy paths.

use crate::common;

use common::{t, write_index_json, write_shard, TempDir};
use k3_proto::dtype::Dtype;
use k3_proto::expert::ExpertPart;
use k3_proto::names;
use k3_proto::safetensors::CheckpointIndex;

fn two_shards(dir: &TempDir) -> (Vec<common::Placed>, Vec<common::Placed>) {
    let a = write_shard(
        &dir.join("model-00001-of-000002.safetensors"),
        &[
            t(names::EMBED, "BF16", &[256, 128]),
            t(&names::layer_tensor(0, "self_attn.A_log"), "F32", &[16]),
            t(
                &names::layer_tensor(0, "self_attn.q_conv1d.weight"),
                "F32",
                &[64, 1, 4],
            ),
        ],
    );
    let b = write_shard(
        &dir.join("model-00002-of-000002.safetensors"),
        &[
            t(
                &names::expert_tensor(1, 3, ExpertPart::W1Packed),
                "U8",
                &[64, 32],
            ),
            t(
                &names::expert_tensor(1, 3, ExpertPart::W1Scale),
                "U8",
                &[64, 2],
            ),
            t(names::LM_HEAD, "BF16", &[256, 128]),
        ],
    );
    (a, b)
}

#[test]
fn lookups_give_absolute_offsets_shapes_and_dtypes() {
    let dir = TempDir::new("basic");
    let (a, b) = two_shards(&dir);
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(idx.len(), 6);
    assert!(!idx.is_empty());
    assert_eq!(idx.n_shards(), 2);
    for (shard, placed) in [(0u16, &a), (1u16, &b)] {
        for p in placed {
            let ti = idx
                .get(&p.name)
                .unwrap_or_else(|| panic!("{} missing", p.name));
            assert_eq!(ti.shard, shard, "{}", p.name);
            assert_eq!(ti.offset, p.offset, "{}", p.name);
            assert_eq!(ti.nbytes, p.nbytes, "{}", p.name);
            assert_eq!(ti.name, p.name);
        }
    }
    let e = idx.get(names::EMBED).unwrap();
    assert_eq!(e.dtype, Dtype::BF16);
    assert_eq!(e.shape(), &[256, 128]);
    assert_eq!(e.numel(), 256 * 128);
    let conv = idx
        .get(&names::layer_tensor(0, "self_attn.q_conv1d.weight"))
        .unwrap();
    assert_eq!(conv.dtype, Dtype::F32);
    assert_eq!(conv.shape(), &[64, 1, 4]);
    assert_eq!(conv.nbytes, 64 * 4 * 4);
    // First tensor of a shard sits right after the (padded) header.
    assert_eq!(e.offset, idx.shard_data_start(0));
    let sp = idx
        .get(&names::expert_tensor(1, 3, ExpertPart::W1Scale))
        .unwrap();
    assert_eq!(sp.dtype, Dtype::U8);
    assert_eq!(sp.shape(), &[64, 2]);
    assert!(idx.get("language_model.model.layers.0.nothing").is_none());
    assert!(idx
        .shard_path(1)
        .ends_with("model-00002-of-000002.safetensors"));
    let len1 = std::fs::metadata(idx.shard_path(1)).unwrap().len();
    assert_eq!(idx.shard_len(1), len1);
    // The last tensor ends exactly at the end of the file.
    let head = idx.get(names::LM_HEAD).unwrap();
    assert_eq!(head.offset + head.nbytes, len1);
}

#[test]
fn iteration_is_physical_order() {
    let dir = TempDir::new("order");
    let (a, b) = two_shards(&dir);
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    let got: Vec<(u16, u64)> = idx.iter().map(|t| (t.shard, t.offset)).collect();
    let mut want: Vec<(u16, u64)> = a.iter().map(|p| (0, p.offset)).collect();
    want.extend(b.iter().map(|p| (1, p.offset)));
    assert_eq!(got, want);
}

#[test]
fn index_json_defines_the_shard_set() {
    let dir = TempDir::new("withindex");
    let (a, b) = two_shards(&dir);
    // A stray shard not named by the index must be ignored.
    write_shard(
        &dir.join("zz-stray.safetensors"),
        &[t("language_model.model.layers.9.x.weight", "BF16", &[2])],
    );
    let mut entries: Vec<(&str, &str)> = a
        .iter()
        .map(|p| (p.name.as_str(), "model-00001-of-000002.safetensors"))
        .collect();
    entries.extend(
        b.iter()
            .map(|p| (p.name.as_str(), "model-00002-of-000002.safetensors")),
    );
    write_index_json(dir.path(), &entries);
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(idx.n_shards(), 2);
    assert_eq!(idx.len(), 6);
    assert!(idx.get("language_model.model.layers.9.x.weight").is_none());
    // Without the index the stray shard is picked up.
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(idx.n_shards(), 3);
    assert!(idx.get("language_model.model.layers.9.x.weight").is_some());
}

#[test]
fn legacy_prefix_is_canonicalised_in_headers_and_index_json() {
    let dir = TempDir::new("legacy");
    let legacy = "language_model.layers.4.self_attn.q_proj.weight";
    let canon = "language_model.model.layers.4.self_attn.q_proj.weight";
    write_shard(
        &dir.join("a.safetensors"),
        &[
            t(legacy, "BF16", &[8, 8]),
            t(names::LM_HEAD, "BF16", &[4, 8]),
        ],
    );
    write_index_json(
        dir.path(),
        &[(legacy, "a.safetensors"), (names::LM_HEAD, "a.safetensors")],
    );
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    let ti = idx.get(canon).unwrap();
    assert_eq!(ti.name, canon);
    assert_eq!(ti.nbytes, 128);
    // Looking up by the legacy spelling also works.
    assert_eq!(idx.get(legacy).unwrap().offset, ti.offset);
    assert!(idx
        .iter()
        .all(|t| !t.name.starts_with("language_model.layers.")));
}

#[test]
fn unknown_dtype_in_a_vision_tensor_is_skipped() {
    let dir = TempDir::new("vision");
    write_shard(
        &dir.join("a.safetensors"),
        &[
            t("vision_tower.pos_ids", "I64", &[16]),
            t(
                "vision_tower.patch_embed.proj.weight",
                "BF16",
                &[8, 3, 2, 2, 2],
            ),
            t("mm_projector.proj.0.weight", "BF16", &[8, 8]),
            t(names::FINAL_NORM, "BF16", &[8]),
        ],
    );
    write_index_json(
        dir.path(),
        &[
            ("vision_tower.pos_ids", "a.safetensors"),
            ("vision_tower.patch_embed.proj.weight", "a.safetensors"),
            ("mm_projector.proj.0.weight", "a.safetensors"),
            (names::FINAL_NORM, "a.safetensors"),
        ],
    );
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(idx.len(), 2);
    assert!(idx.get("vision_tower.pos_ids").is_none());
    assert!(idx.get("mm_projector.proj.0.weight").is_some());
    let mut skipped = idx.skipped().to_vec();
    skipped.sort();
    assert_eq!(
        skipped,
        vec![
            "vision_tower.patch_embed.proj.weight".to_string(),
            "vision_tower.pos_ids".to_string()
        ]
    );
}

#[test]
fn escaped_names_and_zero_sized_tensors() {
    let dir = TempDir::new("escape");
    // A JSON escape forces the owned (non-borrowed) path of the parser.
    let header = r#"{"language_model.model.layers.0.\u0061.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"language_model.model.layers.0.empty":{"dtype":"F32","shape":[0,4],"data_offsets":[8,8]}}"#;
    common::write_raw(
        &dir.join("a.safetensors"),
        header.len() as u64,
        header.as_bytes(),
        8,
    );
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(
        idx.get("language_model.model.layers.0.a.weight")
            .unwrap()
            .nbytes,
        8
    );
    assert_eq!(
        idx.get("language_model.model.layers.0.empty")
            .unwrap()
            .nbytes,
        0
    );
}

#[test]
fn heap_bytes_counts_names_and_records() {
    let dir = TempDir::new("heap");
    two_shards(&dir);
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    let names: usize = idx.iter().map(|t| t.name.len()).sum();
    assert!(idx.heap_bytes() >= names + 6 * 64, "{}", idx.heap_bytes());
}
