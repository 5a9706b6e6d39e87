//! The exponent-coded trunk (issue 30; SPEC.md §6.1, §6.13) with real processes and
//! real files: `k3-ctl pack-trunk --codec ecbf16` on the bundled tiny checkpoint gives exactly
//! the raw trunk's ids standalone and through the store at several budgets (pinned layers held
//! coded, streamed layers read coded), and `k3-ctl verify --trunk` names the layer of one flipped
//! bit in a coded tensor's plane, palette or escape list and exits non-zero.

use std::path::Path;

use k3_tests::{
    cache_gb_for_slots, gb_arg, generated_ids as generated, ids_arg, json_u64 as u, path_str,
    printed_ids, reference_greedy, reference_prompt, tiny_model, trunk_budget_pinning,
    trunk_layer_bufs, Sandbox,
};
use serde_json::Value;

/// Experts per token in the tiny model.
const TOP_K: u64 = 2;

fn trunk_json(trunk: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap()).unwrap()
}

/// `k3-worker --standalone` on the reference prompt, 20 greedy tokens: its ids and report.
fn standalone(sb: &Sandbox, trunk: &Path, budget: &[&str], threads: &str) -> (Vec<u32>, Value) {
    let model = tiny_model();
    let ids = ids_arg(&reference_prompt());
    let mut args = vec![
        "--standalone",
        path_str(&model),
        "--trunk",
        path_str(trunk),
        "--ids",
        ids.as_str(),
        "--gen",
        "20",
        "--threads",
        threads,
    ];
    args.extend_from_slice(budget);
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "standalone worker failed: {r:?}");
    assert_eq!(printed_ids(&r), generated(&j), "printed ids");
    (generated(&j), j)
}

#[test]
fn a_coded_trunk_gives_the_raw_trunks_ids_standalone_and_attached_at_every_budget() {
    let mut sb = Sandbox::new("coded");
    let model = tiny_model();
    let raw = sb.pack_trunk(&model, "raw");
    let coded = sb.pack_trunk_with(&model, "coded", &["--codec", "ecbf16"]);

    // Format 5; every trunk tensor says how it is stored; the weight matrices are coded
    // (kv_b_proj and vectors stay raw), the identity is the raw pack's.
    let (jr, jc) = (trunk_json(&raw), trunk_json(&coded));
    assert_eq!((&jr["format"], &jr["codec"]), (&5.into(), &"raw".into()));
    assert_eq!((&jc["format"], &jc["codec"]), (&5.into(), &"ecbf16".into()));
    assert_eq!(jc["model"]["trunk_id"], jr["model"]["trunk_id"]);
    assert_eq!(jc["model"]["model_id"], jr["model"]["model_id"]);
    let mut n_coded = 0;
    for layer in jc["layers"].as_array().unwrap() {
        for (name, t) in layer["tensors"].as_object().unwrap() {
            let codec = t["codec"].as_str().unwrap();
            if name.ends_with("o_proj.weight") || name.ends_with("q_proj.weight") {
                assert_eq!(codec, "ecbf16", "{name}: {t}");
            }
            if name.ends_with("kv_b_proj.weight") || name.ends_with("norm.weight") {
                assert_eq!(codec, "raw", "{name}: {t}");
            }
            if codec == "ecbf16" {
                n_coded += 1;
                assert!(t["stored"].as_u64().unwrap() < t["nbytes"].as_u64().unwrap());
            }
        }
    }
    assert!(n_coded > 13, "{n_coded} coded tensors");
    let (br, bc) = (trunk_layer_bufs(&raw), trunk_layer_bufs(&coded));
    assert_eq!(bc.len(), 13);
    let (sr, sc) = (br.iter().sum::<u64>(), bc.iter().sum::<u64>());
    assert!(sc * 100 < sr * 85, "coded {sc} vs raw {sr} bytes");

    // Budgets in each trunk's own layer sizes: everything pinned, a 3-layer prefix pinned,
    // nothing pinned with a tiny expert cache.
    let prefix = 3;
    let tiny_cache = cache_gb_for_slots(TOP_K + 1);
    let budget = |bufs: &[u64], pinned: usize| -> Vec<String> {
        if pinned == 13 {
            return vec!["--preset".into(), "laptop".into()];
        }
        let cache = if pinned == 0 {
            tiny_cache.clone()
        } else {
            "0.01".into()
        };
        let trunk = gb_arg(trunk_budget_pinning(bufs, pinned));
        vec!["--trunk-gb".into(), trunk, "--cache-gb".into(), cache]
    };
    let cases = [
        ("everything pinned", 13),
        ("prefix pinned", prefix),
        ("nothing pinned", 0),
    ];
    let reference = reference_greedy();
    for (what, pinned) in cases {
        let raw_budget = budget(&br, pinned);
        let raw_budget: Vec<&str> = raw_budget.iter().map(String::as_str).collect();
        let coded_budget = budget(&bc, pinned);
        let budget: Vec<&str> = coded_budget.iter().map(String::as_str).collect();
        let pinned = pinned as u64;
        let (raw_ids, _) = standalone(&sb, &raw, &raw_budget, "1");
        assert_eq!(raw_ids, reference, "{what}: raw standalone");
        for threads in ["1", "2"] {
            let (ids, rep) = standalone(&sb, &coded, &budget, threads);
            assert_eq!(ids, raw_ids, "{what}: coded standalone, {threads} threads");
            let streamed = u(&rep, "trunk_bytes_read");
            if pinned == 13 {
                assert_eq!(streamed, 0, "{what}: {rep}");
            } else {
                // Streamed layers are read as stored: coded bytes, once per forward pass.
                let unpinned: u64 = bc[pinned as usize..].iter().sum();
                assert!(streamed >= unpinned, "{what}: {streamed} < {unpinned}");
            }
        }
        // Through the store: its pinned layers (shared memory) and shared ring hold the coded
        // runs; the attached worker binds them.
        let mut args = vec![path_str(&model), "--trunk", path_str(&coded)];
        args.extend_from_slice(&budget);
        sb.start_store(&args);
        let s = sb.stats();
        assert_eq!(u(&s, "pinned_layers"), pinned, "{what}: {s}");
        let ids = ids_arg(&reference_prompt());
        let (r, j) = sb.worker_json(&["--ids", &ids, "--gen", "20", "--threads", "1"]);
        assert_eq!(r.code, 0, "{what}: attached worker failed: {r:?}");
        assert_eq!(generated(&j), raw_ids, "{what}: coded attached");
        assert_eq!(printed_ids(&r), raw_ids, "{what}: coded attached, printed");
        let r = sb.stop_store().expect("store running");
        assert_eq!(r.code, 0, "{what}: {r:?}");
    }

    // The plan counts coded sizes: a budget that pins all 13 coded layers holds no more than
    // 10 raw ones plus a ring.
    let all_coded = gb_arg(trunk_budget_pinning(&bc, 13));
    let (ids, rep) = standalone(
        &sb,
        &coded,
        &["--trunk-gb", &all_coded, "--cache-gb", "0.01"],
        "1",
    );
    assert_eq!(ids, reference);
    assert_eq!(
        u(&rep, "trunk_bytes_read"),
        0,
        "every coded layer pinned: {rep}"
    );
    let (ids, rep) = standalone(
        &sb,
        &raw,
        &["--trunk-gb", &all_coded, "--cache-gb", "0.01"],
        "1",
    );
    assert_eq!(ids, reference);
    assert!(
        u(&rep, "trunk_bytes_read") > 0,
        "the raw trunk does not fit: {rep}"
    );
}

/// The coded tensors of layer `l` with at least one escape: (name, file offset of the coded
/// matrix, rows, escapes).
fn coded_tensors(trunk: &Path, l: usize) -> Vec<(String, u64, u64, u64)> {
    use std::os::unix::fs::FileExt;
    let j = trunk_json(trunk);
    let layer = &j["layers"][l];
    let f = std::fs::File::open(trunk.join("trunk.bin")).unwrap();
    let mut out = Vec::new();
    for (name, t) in layer["tensors"].as_object().unwrap() {
        if t["codec"] != "ecbf16" {
            continue;
        }
        let at = layer["file_off"].as_u64().unwrap() + t["off"].as_u64().unwrap();
        let mut h = [0u8; 64];
        f.read_exact_at(&mut h, at).unwrap();
        assert_eq!(&h[0..4], b"K3EC", "{name}");
        let rows = u32::from_le_bytes(h[8..12].try_into().unwrap()) as u64;
        let escapes = u32::from_le_bytes(h[16..20].try_into().unwrap()) as u64;
        out.push((name.clone(), at, rows, escapes));
    }
    out
}

fn flip_bit(trunk: &Path, at: u64, bit: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(trunk.join("trunk.bin"))
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ (1 << bit)], at).unwrap();
}

#[test]
fn verify_decodes_a_coded_trunk_and_names_the_layer_of_a_flipped_bit() {
    let sb = Sandbox::new("coded-verify");
    let model = tiny_model();
    let trunk = sb.pack_trunk_with(&model, "coded", &["--codec", "ecbf16"]);
    let verify = || {
        sb.run(
            "k3-ctl",
            &["verify", path_str(&model), "--trunk", path_str(&trunk)],
        )
    };
    let r = verify();
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout
            .contains("coded or quantized re-derived from the checkpoint"),
        "{}",
        r.stdout
    );
    let l = 5;
    let tensors = coded_tensors(&trunk, l);
    let (name, at, rows, escapes) = tensors
        .iter()
        .find(|t| t.3 > 0)
        .cloned()
        .expect("a coded tensor of layer 5 with escapes (Gaussian weights at 12 bits)");
    // Escape entries are the last 4·e bytes; one entry's high byte is its lowest byte.
    let stored = trunk_json(&trunk)["layers"][l]["tensors"][&name]["stored"]
        .as_u64()
        .unwrap();
    let entry_high_byte = at + stored - 4 * escapes;
    let _ = rows;
    for (what, off, bit) in [
        ("a plane (a low byte of row 0)", at + 64, 0u8),
        ("the palette", at + 32, 1),
        ("the escape list", entry_high_byte, 2),
    ] {
        flip_bit(&trunk, off, bit);
        let r = verify();
        assert_eq!(r.code, 2, "{what}: {r:?}");
        assert!(
            r.stdout.contains(&format!("layer {l}: BAD")),
            "{what}: {}",
            r.stdout
        );
        assert!(
            r.stdout.contains(&format!("{name} (ecbf16) in trunk.bin")),
            "{what}: the tensor is named: {}",
            r.stdout
        );
        assert_eq!(
            r.stdout.matches(": BAD:").count(),
            1,
            "{what}: {}",
            r.stdout
        );
        flip_bit(&trunk, off, bit);
        assert_eq!(verify().code, 0, "{what}: restored");
    }
}

#[test]
fn a_draft_model_speculates_over_a_coded_trunk_with_the_reference_ids() {
    let mut sb = Sandbox::new("coded-draft");
    let model = tiny_model();
    let coded = sb.pack_trunk_with(&model, "coded", &["--codec", "ecbf16"]);
    let draft = sb.dir.join("draft-int8");
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            "--draft",
            "int8",
            path_str(&model),
            path_str(&draft),
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    // --codec is the packed trunk's, not a draft's.
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            "--draft",
            "int8",
            "--codec",
            "ecbf16",
            path_str(&model),
            path_str(&sb.dir.join("never")),
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    let draft_args = [
        "--draft",
        "model",
        "--draft-trunk",
        path_str(&draft),
        "--spec",
        "4",
    ];
    let (ids, j) = standalone(&sb, &coded, &draft_args, "1");
    assert_eq!(ids, reference_greedy(), "{j}");
    assert!(u(&j, "drafted_tokens") > 0, "{j}");
    // Attached: the store streams the coded trunk, the worker drafts with its own draft trunk.
    sb.start_store(&[
        path_str(&model),
        "--trunk",
        path_str(&coded),
        "--trunk-gb",
        "0.001",
        "--cache-gb",
        "0.01",
    ]);
    let p = ids_arg(&reference_prompt());
    let mut args = vec!["--ids", p.as_str(), "--gen", "20", "--threads", "1"];
    args.extend_from_slice(&draft_args);
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(generated(&j), reference_greedy(), "{j}");
    assert!(u(&j, "drafted_tokens") > 0, "{j}");
    // A bad --codec value is a usage error.
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            path_str(&model),
            path_str(&sb.dir.join("x")),
            "--codec",
            "ecbf16:5",
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("not a codec"), "{r:?}");
}
