//! Trunk identity and integrity with real processes and real files (issue 13, item 1): a trunk
//! packed from another checkpoint of the same shape, flipped bytes in pinned and streamed layers,
//! a malformed `trunk.json`, `k3-ctl verify`, and `k3-ctl pack-trunk` re-run into the directory
//! of a live store. No case may end with exit 0 and other weights.

use std::path::Path;
use std::time::Duration;

use k3_tests::{
    gb_arg, ids_arg, path_str, pid_gone, poll_until, printed_ids, reference_greedy,
    reference_prompt, tiny_model, tiny_with_seed, Run, Sandbox, Spawned, ALIGN,
};
use serde_json::Value;

fn trunk_json(trunk: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap()).unwrap()
}

/// `v` with its trunk identity and seal recomputed (its layer checksums as they are): an edit
/// that only a structural check can refuse.
fn resealed(v: &Value) -> Value {
    let mut j: k3_store::runtime::trunk::TrunkJson = serde_json::from_value(v.clone()).unwrap();
    k3_store::runtime::trunk::seal_json(&mut j).unwrap();
    serde_json::to_value(j).unwrap()
}

fn write_trunk_json(trunk: &Path, v: &Value) {
    std::fs::write(trunk.join("trunk.json"), serde_json::to_string(v).unwrap()).unwrap();
}

/// Each layer's trunk read-buffer size (the plan's unit).
fn layer_bufs(trunk: &Path) -> Vec<u64> {
    trunk_json(trunk)["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let off = l["file_off"].as_u64().unwrap();
            (off % ALIGN + l["nbytes"].as_u64().unwrap()).div_ceil(ALIGN) * ALIGN
        })
        .collect()
}

/// Budget flags that pin no trunk layer (everything streams through a ring of the largest one).
fn stream_everything(trunk: &Path) -> Vec<String> {
    let ring = layer_bufs(trunk).into_iter().max().unwrap();
    vec![
        "--trunk-gb".into(),
        gb_arg(ring),
        "--cache-gb".into(),
        "0.001".into(),
    ]
}

/// Budget flags that pin every trunk layer.
fn pin_everything() -> Vec<String> {
    vec!["--preset".into(), "laptop".into()]
}

/// Copy the tiny checkpoint into `dst`.
fn copy_model(dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(tiny_model()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// Flip one byte of layer `l`'s run in `trunk.bin`, in place.
fn flip_layer_byte(trunk: &Path, l: usize) {
    use std::os::unix::fs::FileExt;
    let j = trunk_json(trunk);
    let at = j["layers"][l]["file_off"].as_u64().unwrap()
        + j["layers"][l]["nbytes"].as_u64().unwrap() / 3;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(trunk.join("trunk.bin"))
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x01], at).unwrap();
}

/// `k3-worker --standalone MODEL --trunk TRUNK` on the reference prompt.
fn standalone(
    sb: &Sandbox,
    model: &Path,
    trunk: Option<&Path>,
    budget: &[String],
    gen: u32,
) -> Run {
    let ids = ids_arg(&reference_prompt());
    let gen = gen.to_string();
    let mut args = vec!["--standalone", path_str(model)];
    if let Some(t) = trunk {
        args.extend_from_slice(&["--trunk", path_str(t)]);
    }
    args.extend_from_slice(&["--ids", &ids, "--gen", &gen, "--threads", "1"]);
    args.extend(budget.iter().map(String::as_str));
    sb.run("k3-worker", &args)
}

/// `k3-store start MODEL --trunk TRUNK --socket … --detach` (the run, whatever its outcome).
fn try_start_store(sb: &Sandbox, model: &Path, trunk: &Path, budget: &[String]) -> Run {
    let sock = path_str(&sb.socket).to_string();
    let mut args = vec!["start", path_str(model), "--trunk", path_str(trunk)];
    args.extend(budget.iter().map(String::as_str));
    args.extend_from_slice(&["--socket", &sock, "--detach"]);
    sb.run("k3-store", &args)
}

fn start_store(sb: &mut Sandbox, model: &Path, trunk: &Path, budget: &[String]) {
    let mut args = vec![path_str(model), "--trunk", path_str(trunk)];
    args.extend(budget.iter().map(String::as_str));
    sb.start_store(&args);
}

/// An attached worker on the reference prompt.
fn attached(sb: &Sandbox, gen: u32) -> Run {
    let ids = ids_arg(&reference_prompt());
    let gen = gen.to_string();
    sb.worker(&["--ids", &ids, "--gen", &gen, "--threads", "1"])
}

fn assert_refused(r: &Run, what: &str, needles: &[&str]) {
    assert_eq!(r.code, 2, "{what}: expected exit 2: {r:?}");
    for n in needles {
        assert!(
            r.stderr.contains(n),
            "{what}: stderr lacks {n:?}: {}",
            r.stderr
        );
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn a_trunk_packed_from_another_checkpoint_of_the_same_shape_is_refused() {
    let sb = Sandbox::new("foreign");
    let other = tiny_with_seed(&sb.dir, 2);
    let ours = sb.pack_tiny_trunk();
    let theirs = sb.pack_trunk(&other, "trunk-seed2");
    // Same shape: the layouts agree tensor for tensor; only the bytes differ.
    let (a, b) = (trunk_json(&ours), trunk_json(&theirs));
    for (la, lb) in a["layers"]
        .as_array()
        .unwrap()
        .iter()
        .zip(b["layers"].as_array().unwrap())
    {
        // Same places, lengths and dtypes; other source-tensor hashes.
        let place = |t: &Value| (t["off"].clone(), t["nbytes"].clone(), t["dtype"].clone());
        let (ta, tb) = (
            la["tensors"].as_object().unwrap(),
            lb["tensors"].as_object().unwrap(),
        );
        assert_eq!(ta.keys().collect::<Vec<_>>(), tb.keys().collect::<Vec<_>>());
        for (name, t) in ta {
            assert_eq!(place(t), place(&tb[name]), "{name}");
            if name.ends_with("A_log") {
                // The generator's A_log does not depend on the seed (log 1..H, then zeros).
                assert_eq!(t["xxh3"], tb[name]["xxh3"], "{name}");
                continue;
            }
            assert_ne!(t["xxh3"], tb[name]["xxh3"], "{name}");
        }
        assert_eq!(la["file_off"], lb["file_off"]);
        assert_ne!(la["xxh3"], lb["xxh3"]);
    }
    assert_ne!(a["model"]["trunk_id"], b["model"]["trunk_id"]);
    let id_ours = a["model"]["model_id"].as_str().unwrap().to_string();
    let id_theirs = b["model"]["model_id"].as_str().unwrap().to_string();
    assert_ne!(id_ours, id_theirs);
    let both = [id_ours.as_str(), id_theirs.as_str(), "another checkpoint"];

    for budget in [pin_everything(), stream_everything(&ours)] {
        let r = standalone(&sb, &tiny_model(), Some(&theirs), &budget, 4);
        assert_refused(&r, "standalone tiny + seed-2 trunk", &both);
        assert!(r.stdout.trim().is_empty(), "no ids: {r:?}");
        let r = standalone(&sb, &other, Some(&ours), &budget, 4);
        assert_refused(&r, "standalone seed-2 + tiny trunk", &both);
        let r = try_start_store(&sb, &tiny_model(), &theirs, &budget);
        assert_refused(&r, "store start tiny + seed-2 trunk", &both);
        assert!(!sb.socket.exists(), "a refused start leaves no socket");
    }
    // Each checkpoint with its own trunk is fine (the refusals above are not vacuous).
    let r = standalone(&sb, &tiny_model(), Some(&ours), &pin_everything(), 20);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(printed_ids(&r), reference_greedy());
    let r = standalone(&sb, &other, Some(&theirs), &pin_everything(), 4);
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn a_flipped_byte_in_a_pinned_layer_is_refused_and_in_a_streamed_layer_fails_the_run() {
    let mut sb = Sandbox::new("flip");
    let trunk = sb.pack_tiny_trunk();
    let stream = stream_everything(&trunk);
    flip_layer_byte(&trunk, 5);
    let named = ["trunk layer 5", "checksum"];

    // Pinned (every layer resident): refused before any work.
    let r = standalone(&sb, &tiny_model(), Some(&trunk), &pin_everything(), 4);
    assert_refused(&r, "standalone, layer 5 pinned", &named);
    assert!(r.stdout.trim().is_empty(), "no ids: {r:?}");
    let r = try_start_store(&sb, &tiny_model(), &trunk, &pin_everything());
    assert_refused(&r, "store start, layer 5 pinned", &named);
    assert!(!sb.socket.exists(), "a refused start leaves no socket");

    // Streamed (nothing pinned): the first read of layer 5 fails the run — never exit 0.
    let r = standalone(&sb, &tiny_model(), Some(&trunk), &stream, 4);
    assert_ne!(r.code, 0, "standalone, layer 5 streamed: {r:?}");
    assert!(named.iter().all(|n| r.stderr.contains(n)), "{}", r.stderr);
    start_store(&mut sb, &tiny_model(), &trunk, &stream);
    let r = attached(&sb, 4);
    assert_ne!(r.code, 0, "attached, layer 5 streamed: {r:?}");
    assert!(named.iter().all(|n| r.stderr.contains(n)), "{}", r.stderr);
    assert_ne!(printed_ids(&r).get(..4), Some(&reference_greedy()[..4]));

    // The store streams the layers and checks them (SPEC.md §6.8); the worker never sees bytes
    // that failed. Turning the store's check off is possible, and then the damage goes unnoticed
    // (which is why it is on): the same run exits 0.
    let r = sb.stop_store().expect("store running");
    assert_eq!(r.code, 0, "{r:?}");
    let sock = path_str(&sb.socket).to_string();
    let model = tiny_model();
    let mut args = vec!["start", path_str(&model), "--trunk", path_str(&trunk)];
    args.extend(stream.iter().map(String::as_str));
    args.extend_from_slice(&["--socket", &sock, "--detach"]);
    let mut c = sb.command("k3-store", &args);
    c.env("K3_TRUNK_VERIFY", "off");
    let r = sb.run_command(c);
    sb.adopt_store(r);
    let r = attached(&sb, 4);
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn malformed_and_old_trunk_json_is_refused() {
    let sb = Sandbox::new("badjson");
    let trunk = sb.pack_tiny_trunk();
    let good = trunk_json(&trunk);
    let check = |v: &Value, what: &str, needles: &[&str]| {
        write_trunk_json(&trunk, v);
        let r = standalone(&sb, &tiny_model(), Some(&trunk), &pin_everything(), 2);
        assert_refused(&r, &format!("standalone: {what}"), needles);
        let r = try_start_store(&sb, &tiny_model(), &trunk, &pin_everything());
        assert_refused(&r, &format!("store: {what}"), needles);
    };
    // Layer 4's run starts inside layer 3's: as edited, the seal refuses it; resealed (the
    // trunk identity and seal recomputed), the layout check does.
    let mut v = good.clone();
    let inside = v["layers"][3]["file_off"].as_u64().unwrap();
    v["layers"][4]["file_off"] = inside.into();
    check(&v, "overlapping runs", &["model.seal", "does not match"]);
    check(
        &resealed(&v),
        "overlapping runs",
        &["layer 3", "layer 4", "overlap"],
    );
    // A run past the end of trunk.bin.
    let mut v = good.clone();
    v["layers"][2]["file_off"] = (1u64 << 40).into();
    check(
        &resealed(&v),
        "run out of bounds",
        &["layer 2", "outside trunk.bin"],
    );
    // Zero hashes.
    let mut v = good.clone();
    v["layers"][1]["xxh3"] = "0000000000000000".into();
    check(&v, "zero layer checksum", &["layer 1", "checksum"]);
    let mut v = good.clone();
    v["model"]["model_id"] = "00000000000000000000000000000000".into();
    check(&v, "zero identity", &["model_id"]);
    // A tensor hash edited (the trunk identity no longer matches it).
    let mut v = good.clone();
    let t = v["layers"][2]["tensors"].as_object_mut().unwrap();
    let first = t.keys().next().unwrap().clone();
    t[&first]["xxh3"] = "0123456789abcdef".into();
    check(
        &v,
        "edited tensor hash",
        &["does not match its tensor hashes"],
    );
    // A trunk.json of the previous format: re-pack.
    let mut v = good.clone();
    v.as_object_mut().unwrap().remove("format");
    for l in v["layers"].as_array_mut().unwrap() {
        l.as_object_mut().unwrap().remove("xxh3");
    }
    for k in ["model_id", "id_kind", "trunk_id"] {
        v["model"].as_object_mut().unwrap().remove(k);
    }
    v["model"]["checkpoint_id"] = "0123456789abcdef0123456789abcdef".into();
    check(&v, "old format", &["re-run `k3-ctl pack-trunk"]);
    // Restored, it is accepted.
    write_trunk_json(&trunk, &good);
    let r = standalone(&sb, &tiny_model(), Some(&trunk), &pin_everything(), 20);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(printed_ids(&r), reference_greedy());
}

#[test]
fn verify_passes_a_good_trunk_and_fails_a_damaged_one() {
    let sb = Sandbox::new("verify");
    let model = sb.dir.join("model");
    copy_model(&model);
    let trunk = sb.pack_trunk(&model, "trunk");
    let verify = |extra: &[&str]| {
        let mut args = vec!["verify", path_str(&model), "--trunk", path_str(&trunk)];
        args.extend_from_slice(extra);
        sb.run("k3-ctl", &args)
    };
    let r = verify(&[]);
    assert_eq!(r.code, 0, "{r:?}");
    let n_layers = trunk_json(&trunk)["layers"].as_array().unwrap().len();
    for l in 0..n_layers {
        assert!(r.stdout.contains(&format!("layer {l}: OK")), "{}", r.stdout);
    }
    assert!(
        r.stdout.contains("verify: OK") && !r.stdout.contains("BAD"),
        "{}",
        r.stdout
    );
    let r = verify(&["--json"]);
    assert_eq!(r.code, 0, "{r:?}");
    let j: Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(j["ok"], true, "{j}");
    assert_eq!(j["trunk"]["layers"].as_array().unwrap().len(), n_layers);

    // One flipped byte in layer 7 of trunk.bin: that layer, and only it, is BAD.
    flip_layer_byte(&trunk, 7);
    let r = verify(&[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stdout.contains("layer 7: BAD"), "{}", r.stdout);
    assert_eq!(r.stdout.matches(": BAD:").count(), 1, "{}", r.stdout);
    let r = verify(&["--json"]);
    assert_eq!(r.code, 2, "{r:?}");
    let j: Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(j["ok"], false);
    assert_eq!(j["trunk"]["layers"][7]["ok"], false, "{j}");
    assert_eq!(j["trunk"]["layers"][6]["ok"], true, "{j}");
    flip_layer_byte(&trunk, 7);
    assert_eq!(verify(&[]).code, 0, "restored");

    // A shard cut short: refused, naming the shard (its tensors no longer fit in it).
    let shard = model.join("model-00003-of-000003.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let r = sb.run("k3-ctl", &["verify", path_str(&model)]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("model-00003-of-000003.safetensors"),
        "the shard is named: {r:?}"
    );
}

/// Start a worker generating `gen` tokens and wait until it is mid-generation.
fn worker_mid_generation(sb: &Sandbox, gen: u32) -> Spawned {
    let ids = ids_arg(&reference_prompt());
    let gen = gen.to_string();
    let w = sb.spawn_worker(&["--ids", &ids, "--gen", &gen, "--threads", "1"]);
    let pid = w.pid();
    let seen = poll_until(Duration::from_secs(30), || {
        let s = sb.stats();
        let label = format!("pid {pid}");
        let job = s["jobs"]
            .as_array()?
            .iter()
            .find(|j| j["label"].as_str().is_some_and(|l| l.ends_with(&label)))?
            .clone();
        (job["live"] == true && job["counters"]["requests"].as_u64()? > 0).then_some(())
    });
    assert!(seen.is_some(), "worker {pid} never started: {}", sb.stats());
    w
}

#[test]
fn repacking_into_a_live_stores_directory_leaves_running_workers_their_trunk() {
    let mut sb = Sandbox::new("repack");
    let model = sb.dir.join("model");
    copy_model(&model);
    let other = tiny_with_seed(&sb.dir, 3);
    let trunk = sb.pack_trunk(&model, "trunk");
    let stream = stream_everything(&trunk);
    start_store(&mut sb, &model, &trunk, &stream);
    const GEN: u32 = 600;
    let baseline = attached(&sb, GEN);
    assert_eq!(baseline.code, 0, "{baseline:?}");
    let baseline = printed_ids(&baseline);
    assert_eq!(&baseline[..20], &reference_greedy()[..]);
    let old_ino = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(trunk.join("trunk.bin")).unwrap().ino()
    };

    // The same checkpoint re-packed while a worker streams every layer from the trunk.
    let w = worker_mid_generation(&sb, GEN);
    sb.pack_trunk(&model, "trunk");
    assert!(
        !pid_gone(w.pid()),
        "the worker was still running after the re-pack"
    );
    let r = w.wait(Duration::from_secs(120));
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(printed_ids(&r), baseline, "the running worker's ids");
    let new_ino = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(trunk.join("trunk.bin")).unwrap().ino()
    };
    assert_ne!(old_ino, new_ino, "a new file took the name");
    let r = attached(&sb, 20);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        printed_ids(&r),
        reference_greedy(),
        "a new worker on the live store"
    );

    // Another checkpoint packed into the live store's directory while a worker runs: the
    // running worker keeps its open trunk.bin and finishes with the same ids; a new worker of
    // the live store refuses the foreign trunk (exit 3) instead of mixing weights.
    let w = worker_mid_generation(&sb, GEN);
    sb.pack_trunk(&other, "trunk");
    assert!(
        !pid_gone(w.pid()),
        "the worker was still running after the re-pack"
    );
    let r = w.wait(Duration::from_secs(120));
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(
        printed_ids(&r),
        baseline,
        "the running worker's ids after a foreign re-pack"
    );
    let r = attached(&sb, 4);
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stderr.contains("another checkpoint"), "{}", r.stderr);
    assert!(r.stdout.trim().is_empty(), "no ids: {r:?}");

    // A store started now uses the new trunk: its ids are the other checkpoint's.
    sb.stop_store();
    let want = standalone(&sb, &other, None, &pin_everything(), 20);
    assert_eq!(want.code, 0, "{want:?}");
    let want = printed_ids(&want);
    assert_ne!(
        want,
        reference_greedy(),
        "the seed-3 checkpoint generates other ids"
    );
    start_store(&mut sb, &other, &trunk, &stream);
    let r = attached(&sb, 20);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(printed_ids(&r), want);
}
