//! A checkpoint whose MoE routers `block_sparse_moe.gate.weight` are stored as F32 (as the C
//! engine and checkpoint writers take them; issue 35 item 8, SPEC.md §2.7 and §3.11): every
//! command that reads the headers takes it, `pack-trunk` keeps the router F32, and with the same
//! values as the BF16 fixture it gives the BF16 fixture's ids and the same logits bit for bit,
//! standalone and from a store serving a packed trunk. An F32 router of the wrong shape is still
//! refused (exit 2, naming it).

use std::path::{Path, PathBuf};

use k3_tests::Sandbox;
use k3_tests::{ids_arg, path_str, printed_ids, reference_greedy, reference_prompt, tiny_model};
use k3_worker::kernels::Tier;
use serde_json::{json, Map, Value};

const ROUTER: &str = "block_sparse_moe.gate.weight";

/// Copy the tiny checkpoint to `dst` with every router widened exactly to F32 (the same values;
/// each shard rewritten with its new header and offsets, the index's `total_size` updated; the
/// manifest, whose shard hashes no longer hold, left out). `transpose`: the F32 routers are
/// stored with their two dimensions swapped (the same bytes, a wrong shape). Returns the routers
/// rewritten.
fn with_f32_routers(dst: &Path, transpose: bool) -> Vec<String> {
    std::fs::create_dir_all(dst).unwrap();
    let mut rewritten = Vec::new();
    let mut total = 0u64;
    for entry in std::fs::read_dir(tiny_model()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name == "k3-manifest.json" || name == "model.safetensors.index.json" {
            continue;
        }
        if !name.ends_with(".safetensors") {
            std::fs::copy(&path, dst.join(&name)).unwrap();
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let hl = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + hl]).unwrap();
        let data = &bytes[8 + hl..];
        let mut entries: Vec<(String, Value)> = header.into_iter().collect();
        entries.sort_by_key(|(_, v)| v["data_offsets"][0].as_u64().unwrap_or(0));
        let (mut out_header, mut out_data) = (Map::new(), Vec::new());
        for (k, mut v) in entries {
            if k == "__metadata__" {
                out_header.insert(k, v);
                continue;
            }
            let (a, b) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let mut t = data[a..b].to_vec();
            if k.ends_with(ROUTER) {
                assert_eq!(v["dtype"], "BF16", "{k}");
                t = t
                    .chunks_exact(2)
                    .flat_map(|p| ((u16::from_le_bytes([p[0], p[1]]) as u32) << 16).to_le_bytes())
                    .collect();
                v["dtype"] = "F32".into();
                if transpose {
                    let s = v["shape"].as_array().unwrap().clone();
                    v["shape"] = json!([s[1], s[0]]);
                }
                rewritten.push(k.clone());
            }
            let start = out_data.len();
            out_data.extend_from_slice(&t);
            v["data_offsets"] = json!([start, out_data.len()]);
            out_header.insert(k, v);
        }
        total += out_data.len() as u64;
        let h = serde_json::to_vec(&out_header).unwrap();
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&h);
        file.extend_from_slice(&out_data);
        std::fs::write(dst.join(&name), file).unwrap();
    }
    let index = tiny_model().join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(index).unwrap()).unwrap();
    index["metadata"]["total_size"] = json!(total);
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
    rewritten.sort();
    rewritten
}

/// The standalone worker's greedy ids of the reference prompt on `model` (`--gen 20`), and the
/// step-0 logits it dumps (little-endian f32), on the kernel tier `simd` (`K3_SIMD`; `None`: the
/// best this CPU has).
fn standalone(
    sb: &Sandbox,
    model: &Path,
    tag: &str,
    extra: &[&str],
    simd: Option<&str>,
) -> (Vec<u32>, Vec<u8>) {
    let dump = sb.dir.join(format!("logits-{tag}.f32"));
    let ids = ids_arg(&reference_prompt());
    let mut args = vec![
        "--standalone",
        path_str(model),
        "--ids",
        &ids,
        "--gen",
        "20",
        "--dump-logits",
        path_str(&dump),
    ];
    args.extend_from_slice(extra);
    let mut c = sb.command("k3-worker", &args);
    if let Some(t) = simd {
        c.env("K3_SIMD", t);
    }
    let r = sb.run_command(c);
    assert_eq!(r.code, 0, "{tag}: {r:?}");
    (printed_ids(&r), std::fs::read(&dump).unwrap())
}

fn f32_model(sb: &Sandbox, name: &str, transpose: bool) -> (PathBuf, Vec<String>) {
    let dir = sb.dir.join(name);
    let routers = with_f32_routers(&dir, transpose);
    (dir, routers)
}

/// The routers a `trunk.json` or `draft.json` lists, each checked to be F32.
fn f32_routers_in(json: &Path) -> Vec<String> {
    let j: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let mut found = Vec::new();
    for l in j["layers"].as_array().unwrap() {
        for (name, t) in l["tensors"].as_object().unwrap() {
            if name.ends_with(ROUTER) {
                assert_eq!(t["dtype"], "F32", "{}: {name}: {t}", json.display());
                found.push(name.clone());
            }
        }
    }
    found.sort();
    found
}

#[test]
fn f32_routers_of_bf16_values_give_the_bf16_ids_and_logits_standalone_and_from_a_packed_trunk() {
    let mut sb = Sandbox::new("f32-router");
    let (model, routers) = f32_model(&sb, "f32-router", false);
    // Every MoE layer of the tiny model has its router rewritten.
    assert!(routers.len() >= 8, "{routers:?}");
    let r = sb.run("k3-ctl", &["inspect", path_str(&model)]);
    assert_eq!(r.code, 0, "inspect: {r:?}");
    // Standalone: the BF16 fixture's ids (the float64 reference's) and its step-0 logits, bit for
    // bit, at the auto plan and at the laptop preset (streamed layers), on one and two threads,
    // and on every kernel tier this CPU has (each against the BF16 run on the same tier).
    let (want_ids, want_logits) = standalone(&sb, &tiny_model(), "bf16", &[], None);
    assert_eq!(want_ids, reference_greedy());
    for (tag, extra) in [
        ("auto", &[][..]),
        ("laptop", &["--preset", "laptop"][..]),
        ("threads-1", &["--threads", "1"][..]),
    ] {
        let (ids, logits) = standalone(&sb, &model, tag, extra, None);
        assert_eq!(ids, want_ids, "{tag}");
        assert!(
            logits == want_logits,
            "{tag}: step-0 logits differ in their bits"
        );
    }
    for tier in Tier::ALL.into_iter().filter(|t| t.is_available()) {
        let t = Some(tier.name());
        let (bf16_ids, bf16_logits) = standalone(&sb, &tiny_model(), "bf16-tier", &[], t);
        let (ids, logits) = standalone(&sb, &model, "f32-tier", &[], t);
        assert_eq!(bf16_ids, want_ids, "{tier}");
        assert_eq!(ids, want_ids, "{tier}");
        assert!(
            logits == bf16_logits,
            "{tier}: step-0 logits differ in their bits"
        );
    }
    // The packed trunk keeps each router raw, as F32, and a store serving it gives the same ids.
    let trunk = sb.pack_trunk(&model, "trunk");
    assert_eq!(f32_routers_in(&trunk.join("trunk.json")), routers);
    sb.start_store(&[path_str(&model), "--trunk", path_str(&trunk)]);
    let dump = sb.dir.join("logits-attached.f32");
    let ids = ids_arg(&reference_prompt());
    let r = sb.worker(&[
        "--ids",
        &ids,
        "--gen",
        "20",
        "--dump-logits",
        path_str(&dump),
    ]);
    assert_eq!(r.code, 0, "attached: {r:?}");
    assert_eq!(printed_ids(&r), want_ids);
    assert!(
        std::fs::read(&dump).unwrap() == want_logits,
        "attached: step-0 logits differ in their bits"
    );
    sb.stop_store();
}

/// An int8 draft trunk of `model` in `<sandbox>/<name>` (`k3-ctl pack-trunk --draft int8`).
fn pack_draft(sb: &Sandbox, model: &Path, name: &str) -> PathBuf {
    let out = sb.dir.join(name);
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            "--draft",
            "int8",
            path_str(model),
            path_str(&out),
        ],
    );
    assert_eq!(r.code, 0, "pack-trunk --draft int8: {r:?}");
    out
}

#[test]
fn a_draft_of_f32_routers_keeps_them_f32_and_drafts_as_the_bf16_draft_does() {
    let sb = Sandbox::new("f32-router-draft");
    let (model, routers) = f32_model(&sb, "f32-router", false);
    let ids = ids_arg(&reference_prompt());
    // (ids, drafted, accepted) of a speculative run whose draft model reads this draft trunk.
    let spec = |model: &Path, draft: &Path| {
        let (r, j) = sb.worker_json(&[
            "--standalone",
            path_str(model),
            "--ids",
            &ids,
            "--gen",
            "20",
            "--threads",
            "1",
            "--draft",
            "model",
            "--draft-trunk",
            path_str(draft),
            "--spec",
            "4",
        ]);
        assert_eq!(r.code, 0, "{r:?}");
        let n = |k: &str| j[k].as_u64().unwrap_or_else(|| panic!("{k}: {j}"));
        (printed_ids(&r), n("drafted_tokens"), n("accepted_tokens"))
    };
    let bf16_draft = pack_draft(&sb, &tiny_model(), "draft-bf16");
    let f32_draft = pack_draft(&sb, &model, "draft-f32");
    assert_eq!(f32_routers_in(&f32_draft.join("draft.json")), routers);
    let want = spec(&tiny_model(), &bf16_draft);
    assert_eq!(want.0, reference_greedy());
    assert!(want.1 > 0, "no drafts: {want:?}");
    // The same drafts, accepted as often: the draft model's router is the same function.
    assert_eq!(spec(&model, &f32_draft), want);
}

#[test]
fn an_f32_router_of_the_wrong_shape_is_refused_by_every_command_that_reads_the_headers() {
    let sb = Sandbox::new("f32-router-shape");
    let (model, routers) = f32_model(&sb, "f32-router-transposed", true);
    for (what, r) in sb.every_header_command(&model) {
        assert_eq!(r.code, 2, "{what}: {r:?}");
        let said = format!("{}{}", r.stdout, r.stderr);
        assert!(
            said.contains(&format!("`{}`: F32 [", routers[0])),
            "{what}: {said}"
        );
        assert!(said.contains("BF16 or F32"), "{what}: {said}");
        assert!(!said.contains("panicked"), "{what}: {r:?}");
    }
    assert!(!sb.socket.exists());
    assert!(!sb.dir.join("packed-never").join("trunk.json").exists());
}
