//! Checkpoint index: every malformed input is an error naming the problem (never a panic).

use crate::common;

use common::{header_json, t, write_index_json, write_raw, write_shard, TempDir};
use k3_proto::names;
use k3_proto::safetensors::{CheckpointIndex, IndexError};

/// Opens `dir`, expecting an error; returns its message.
fn open_err(dir: &TempDir) -> String {
    match CheckpointIndex::open(dir.path()) {
        Ok(i) => panic!("index accepted with {} tensors", i.len()),
        Err(e) => e.to_string(),
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "expected `{p}` in: {msg}");
    }
}

const Q: &str = "language_model.model.layers.0.self_attn.q_proj.weight";

/// A single-tensor header with custom fields.
fn one(dtype: &str, shape: &str, offsets: &str) -> String {
    format!(r#"{{"{Q}":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}}}"#)
}

#[test]
fn file_shorter_than_the_length_field() {
    let dir = TempDir::new("short");
    std::fs::write(dir.join("a.safetensors"), [1u8, 2, 3]).unwrap();
    assert_has(
        &open_err(&dir),
        &["a.safetensors", "shorter than the 8-byte"],
    );
}

#[test]
fn truncated_file() {
    let dir = TempDir::new("trunc");
    let p = dir.join("a.safetensors");
    write_shard(
        &p,
        &[
            t(Q, "BF16", &[16, 16]),
            t(names::LM_HEAD, "BF16", &[16, 16]),
        ],
    );
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    assert_has(
        &open_err(&dir),
        &["a.safetensors", "past the end of the data", names::LM_HEAD],
    );
}

#[test]
fn truncated_inside_the_header() {
    let dir = TempDir::new("trunchdr");
    let h = one("BF16", "[2]", "[0,4]");
    write_raw(
        &dir.join("a.safetensors"),
        h.len() as u64,
        &h.as_bytes()[..h.len() / 2],
        0,
    );
    assert_has(&open_err(&dir), &["a.safetensors", "header length"]);
}

#[test]
fn header_length_larger_than_file() {
    let dir = TempDir::new("hdrlen");
    let h = one("BF16", "[2]", "[0,4]");
    write_raw(
        &dir.join("a.safetensors"),
        h.len() as u64 + 100,
        h.as_bytes(),
        4,
    );
    assert_has(&open_err(&dir), &["a.safetensors", "exceeds"]);
}

#[test]
fn header_length_u64_max_does_not_allocate() {
    let dir = TempDir::new("hdrmax");
    write_raw(&dir.join("a.safetensors"), u64::MAX, b"{}", 0);
    assert_has(&open_err(&dir), &["a.safetensors", &u64::MAX.to_string()]);
}

#[test]
fn header_length_over_the_cap_on_a_large_sparse_file() {
    let dir = TempDir::new("hdrcap");
    // The file really is large enough (sparse), so only the cap can refuse it.
    write_raw(&dir.join("a.safetensors"), 300 << 20, b"{}", 400 << 20);
    assert_has(&open_err(&dir), &["a.safetensors", "limit"]);
}

#[test]
fn offsets_past_end() {
    let dir = TempDir::new("past");
    let h = one("BF16", "[2]", "[4,8]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 6);
    assert_has(&open_err(&dir), &[Q, "past the end"]);
}

#[test]
fn data_offsets_inverted() {
    let dir = TempDir::new("inv");
    let h = one("BF16", "[2]", "[8,4]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 16);
    assert_has(&open_err(&dir), &[Q, "inverted"]);
}

#[test]
fn shape_product_mismatch() {
    let dir = TempDir::new("mismatch");
    let h = one("BF16", "[3,2]", "[0,8]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 8);
    assert_has(&open_err(&dir), &[Q, "12 bytes", "span 8"]);
}

#[test]
fn shape_overflow() {
    let dir = TempDir::new("overflow");
    let h = one("BF16", "[4294967296,4294967296]", "[0,8]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 8);
    assert_has(&open_err(&dir), &[Q, "overflow"]);
    // numel fits but × dtype size does not
    let dir = TempDir::new("overflow2");
    let h = one("F32", "[4611686018427387904,2]", "[0,8]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 8);
    assert_has(&open_err(&dir), &[Q, "overflow"]);
}

#[test]
fn unknown_dtype_in_a_needed_tensor_names_it() {
    let dir = TempDir::new("dtype");
    let h = one("F8_E4M3", "[4]", "[0,4]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 4);
    assert_has(&open_err(&dir), &[Q, "F8_E4M3"]);
    // Same dtype under a vision name is skipped, not an error.
    let dir = TempDir::new("dtype2");
    let h = r#"{"vision_tower.x":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}}"#;
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 4);
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(idx.len(), 0);
    assert_eq!(idx.skipped(), ["vision_tower.x".to_string()]);
    // A totally unknown dtype in a model-level tensor.
    let dir = TempDir::new("dtype3");
    let h = format!(
        r#"{{"{}":{{"dtype":"Q4_K","shape":[4],"data_offsets":[0,4]}}}}"#,
        names::FINAL_NORM
    );
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 4);
    assert_has(&open_err(&dir), &[names::FINAL_NORM, "Q4_K"]);
}

#[test]
fn skipped_tensors_are_still_bounds_checked() {
    let dir = TempDir::new("skipbounds");
    let h = r#"{"vision_tower.x":{"dtype":"I64","shape":[4],"data_offsets":[0,64]}}"#;
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 16);
    assert_has(&open_err(&dir), &["vision_tower.x", "past the end"]);
    let dir = TempDir::new("skipspan");
    let h = r#"{"vision_tower.x":{"dtype":"I64","shape":[4],"data_offsets":[0,16]}}"#;
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 16);
    assert_has(&open_err(&dir), &["vision_tower.x", "32 bytes"]);
}

#[test]
fn too_many_dims_in_a_needed_tensor() {
    let dir = TempDir::new("ndim");
    let h = one("BF16", "[1,1,1,1,2]", "[0,4]");
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 4);
    assert_has(&open_err(&dir), &[Q, "5 dimensions"]);
}

#[test]
fn malformed_json() {
    let cases: &[&str] = &[
        "{",
        "[]",
        "not json at all",
        r#"{"a":{"dtype":"BF16","shape":[2]}}"#,
        r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0]}}"#,
        r#"{"a":{"dtype":"BF16","shape":[-2],"data_offsets":[0,4]}}"#,
        r#"{"a":{"dtype":"BF16","shape":"2","data_offsets":[0,4]}}"#,
        r#"{"a":{"dtype":7,"shape":[2],"data_offsets":[0,4]}}"#,
        r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}} trailing"#,
        "{\"a\":\u{0}}",
    ];
    for (i, h) in cases.iter().enumerate() {
        let dir = TempDir::new("badjson");
        write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 4);
        let msg = open_err(&dir);
        assert!(msg.contains("a.safetensors"), "case {i}: {msg}");
        assert!(
            msg.contains("malformed") || msg.contains("`a`"),
            "case {i}: {msg}"
        );
    }
    // Invalid UTF-8 in the header.
    let dir = TempDir::new("badutf8");
    let h = b"{\"\xff\xfe\":{}}";
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h, 0);
    assert_has(&open_err(&dir), &["a.safetensors", "malformed"]);
}

#[test]
fn missing_shard_named_by_index_json() {
    let dir = TempDir::new("missingshard");
    write_shard(&dir.join("a.safetensors"), &[t(Q, "BF16", &[2])]);
    write_index_json(
        dir.path(),
        &[(Q, "a.safetensors"), (names::LM_HEAD, "b.safetensors")],
    );
    assert_has(&open_err(&dir), &["b.safetensors", "does not exist"]);
}

#[test]
fn index_json_names_a_tensor_the_shard_lacks() {
    let dir = TempDir::new("wmmissing");
    write_shard(&dir.join("a.safetensors"), &[t(Q, "BF16", &[2])]);
    write_index_json(
        dir.path(),
        &[(Q, "a.safetensors"), (names::LM_HEAD, "a.safetensors")],
    );
    assert_has(&open_err(&dir), &[names::LM_HEAD, "no such tensor"]);
}

#[test]
fn index_json_puts_a_tensor_in_the_wrong_shard() {
    let dir = TempDir::new("wmwrong");
    write_shard(&dir.join("a.safetensors"), &[t(Q, "BF16", &[2])]);
    write_shard(
        &dir.join("b.safetensors"),
        &[t(names::LM_HEAD, "BF16", &[2])],
    );
    write_index_json(
        dir.path(),
        &[(Q, "b.safetensors"), (names::LM_HEAD, "a.safetensors")],
    );
    let msg = open_err(&dir);
    assert_has(
        &msg,
        &[Q, "listed in b.safetensors but found in", "a.safetensors"],
    );
    assert_has(
        &msg,
        &[names::LM_HEAD, "listed in a.safetensors but found in"],
    );
}

#[test]
fn shard_tensor_not_listed_in_index_json() {
    let dir = TempDir::new("wmunlisted");
    write_shard(
        &dir.join("a.safetensors"),
        &[t(Q, "BF16", &[2]), t(names::LM_HEAD, "BF16", &[2])],
    );
    write_index_json(dir.path(), &[(Q, "a.safetensors")]);
    assert_has(&open_err(&dir), &[names::LM_HEAD, "not listed"]);
}

#[test]
fn index_json_malformed_or_escaping_the_directory() {
    let dir = TempDir::new("badindex");
    write_shard(&dir.join("a.safetensors"), &[t(Q, "BF16", &[2])]);
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": [",
    )
    .unwrap();
    assert_has(
        &open_err(&dir),
        &["model.safetensors.index.json", "malformed"],
    );
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"metadata\": {}}",
    )
    .unwrap();
    assert_has(&open_err(&dir), &["no `weight_map`"]);
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": {}}",
    )
    .unwrap();
    assert_has(&open_err(&dir), &["`weight_map` is empty"]);
    write_index_json(dir.path(), &[(Q, "../a.safetensors")]);
    assert_has(
        &open_err(&dir),
        &["../a.safetensors", "not a plain file name"],
    );
}

#[test]
fn duplicate_tensor_across_shards() {
    let dir = TempDir::new("dup");
    write_shard(&dir.join("a.safetensors"), &[t(Q, "BF16", &[2])]);
    write_shard(&dir.join("b.safetensors"), &[t(Q, "BF16", &[2])]);
    assert_has(
        &open_err(&dir),
        &[Q, "twice", "a.safetensors", "b.safetensors"],
    );
}

#[test]
fn duplicate_via_legacy_and_canonical_spelling() {
    let dir = TempDir::new("duplegacy");
    write_shard(&dir.join("a.safetensors"), &[t(Q, "BF16", &[2])]);
    write_shard(
        &dir.join("b.safetensors"),
        &[t(
            "language_model.layers.0.self_attn.q_proj.weight",
            "BF16",
            &[2],
        )],
    );
    assert_has(&open_err(&dir), &[Q, "twice"]);
}

#[test]
fn duplicate_key_in_one_header_and_overlapping_tensors() {
    let dir = TempDir::new("dupkey");
    let h = format!(
        r#"{{"{Q}":{{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}},"{Q}":{{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}}}"#
    );
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 8);
    assert_has(&open_err(&dir), &[Q, "twice"]);
    let dir = TempDir::new("overlap");
    let h = format!(
        r#"{{"{Q}":{{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}},"{}":{{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}}}"#,
        names::LM_HEAD
    );
    write_raw(&dir.join("a.safetensors"), h.len() as u64, h.as_bytes(), 8);
    assert_has(&open_err(&dir), &["overlap", Q, names::LM_HEAD]);
}

#[test]
fn empty_directory_and_missing_directory() {
    let dir = TempDir::new("empty");
    assert_has(&open_err(&dir), &["no *.safetensors"]);
    let gone = dir.join("does-not-exist");
    let e = CheckpointIndex::open(&gone).unwrap_err();
    assert!(e.to_string().contains("does-not-exist"), "{e}");
}

#[test]
fn problems_in_several_shards_are_all_reported() {
    let dir = TempDir::new("many");
    write_raw(&dir.join("a.safetensors"), u64::MAX, b"{}", 0);
    let h = one("BF16", "[2]", "[8,4]");
    write_raw(&dir.join("b.safetensors"), h.len() as u64, h.as_bytes(), 16);
    let (ok, _) = header_json(&[t(names::LM_HEAD, "BF16", &[2])]);
    write_raw(
        &dir.join("c.safetensors"),
        ok.len() as u64,
        ok.as_bytes(),
        4,
    );
    let e = CheckpointIndex::open(dir.path()).unwrap_err();
    assert!(matches!(e, IndexError::Many(..)), "{e:?}");
    let p = e.problems();
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(
        p[0].contains("a.safetensors") && p[1].contains("b.safetensors"),
        "{p:?}"
    );
}

#[test]
fn index_json_listing_a_name_twice() {
    let dir = TempDir::new("wmtwice");
    write_shard(
        &dir.join("a.safetensors"),
        &[t(Q, "BF16", &[2]), t(names::LM_HEAD, "BF16", &[2])],
    );
    write_index_json(
        dir.path(),
        &[
            (Q, "a.safetensors"),
            (names::LM_HEAD, "a.safetensors"),
            (Q, "a.safetensors"),
        ],
    );
    assert_has(&open_err(&dir), &[Q, "listed twice"]);
}

#[test]
fn weight_map_checks_still_allow_skipped_tensors_and_legacy_names() {
    let dir = TempDir::new("wmskip");
    write_shard(
        &dir.join("a.safetensors"),
        &[
            t("vision_tower.pos_ids", "I64", &[3]),
            t("language_model.layers.2.mlp_res_norm.weight", "BF16", &[2]),
        ],
    );
    write_index_json(
        dir.path(),
        &[
            ("vision_tower.pos_ids", "a.safetensors"),
            // listed under the canonical spelling while the header uses the legacy one
            (
                "language_model.model.layers.2.mlp_res_norm.weight",
                "a.safetensors",
            ),
        ],
    );
    let idx = CheckpointIndex::open(dir.path()).unwrap();
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.skipped().len(), 1);
}

#[test]
fn duplicate_skipped_tensor_across_shards() {
    let dir = TempDir::new("dupskip");
    write_shard(
        &dir.join("a.safetensors"),
        &[t("vision_tower.ids", "I64", &[2])],
    );
    write_shard(
        &dir.join("b.safetensors"),
        &[t("vision_tower.ids", "I64", &[2])],
    );
    assert_has(&open_err(&dir), &["vision_tower.ids", "twice"]);
}
