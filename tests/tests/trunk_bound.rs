//! Issue 47, item 1, with real processes and real files: every `trunk.json` descriptor (tensor
//! offsets, stored sizes, codecs, the layer order) and every byte of `trunk.bin` (coded
//! headers, palettes, escapes, header hashes, raw norms) is covered by what is checked when a
//! layer is read, so an edited descriptor, a byte flipped with its layer checksum recomputed,
//! or a byte changed under `K3_TRUNK_VERIFY=first` after the layer's first read ends in a
//! refusal (exit 2), a failed attach (exit 3) or a read error (exit 1) — never in an id the
//! exact model would not give. Each case runs standalone and attached, with every layer pinned
//! and with every layer streamed, on an EC-BF16 trunk and on a raw one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k3_store::runtime::trunk::{bound_checksum, layer_digest, seal_json, TrunkJson};
use k3_tests::{
    gb_arg, ids_arg, path_str, poll_until, printed_ids, reference_greedy, reference_prompt,
    tiny_model, Run, Sandbox, ALIGN,
};
use serde_json::Value;

fn read_json(trunk: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap()).unwrap()
}

fn write_json(trunk: &Path, v: &Value) {
    std::fs::write(trunk.join("trunk.json"), serde_json::to_string(v).unwrap()).unwrap();
}

/// `v` with its trunk identity and seal recomputed (what a careful editor would also do).
fn resealed(v: &Value) -> Value {
    let mut j: TrunkJson = serde_json::from_value(v.clone()).unwrap();
    seal_json(&mut j).unwrap();
    serde_json::to_value(j).unwrap()
}

/// Layer `l`'s checksum recomputed over `trunk.bin` as it is now.
fn recompute_layer(trunk: &Path, v: &mut Value, l: usize) {
    use std::os::unix::fs::FileExt;
    let j: TrunkJson = serde_json::from_value(v.clone()).unwrap();
    let jl = &j.layers[l];
    let mut run = vec![0u8; jl.nbytes as usize];
    std::fs::File::open(trunk.join("trunk.bin"))
        .unwrap()
        .read_exact_at(&mut run, jl.file_off)
        .unwrap();
    let sum = bound_checksum(layer_digest(l, jl), &run);
    v["layers"][l]["xxh3"] = format!("{sum:016x}").into();
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

/// Budget flags that pin no layer (everything streams through a ring of the largest run).
fn stream_everything(trunk: &Path) -> Vec<String> {
    let ring = read_json(trunk)["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let off = l["file_off"].as_u64().unwrap();
            (off % ALIGN + l["nbytes"].as_u64().unwrap()).div_ceil(ALIGN) * ALIGN
        })
        .max()
        .unwrap();
    vec![
        "--trunk-gb".into(),
        gb_arg(ring),
        "--cache-gb".into(),
        "0.001".into(),
    ]
}

/// Budget flags that pin every layer.
fn pin_everything() -> Vec<String> {
    vec!["--preset".into(), "laptop".into()]
}

/// `k3-worker --standalone` on the reference prompt.
fn standalone(sb: &Sandbox, trunk: &Path, budget: &[String], gen: u32) -> Run {
    let model = tiny_model();
    let ids = ids_arg(&reference_prompt());
    let gen = gen.to_string();
    let mut args = vec![
        "--standalone",
        path_str(&model),
        "--trunk",
        path_str(trunk),
        "--ids",
        &ids,
        "--gen",
        &gen,
        "--threads",
        "1",
    ];
    args.extend(budget.iter().map(String::as_str));
    sb.run("k3-worker", &args)
}

/// `k3-store start --detach` on `trunk` (the run, whatever its outcome).
fn try_store(sb: &Sandbox, trunk: &Path, budget: &[String]) -> Run {
    let model = tiny_model();
    let sock = path_str(&sb.socket).to_string();
    let mut args = vec!["start", path_str(&model), "--trunk", path_str(trunk)];
    args.extend(budget.iter().map(String::as_str));
    args.extend_from_slice(&["--socket", &sock, "--detach"]);
    sb.run("k3-store", &args)
}

/// An attached worker on the reference prompt.
fn attached(sb: &Sandbox, gen: u32) -> Run {
    let ids = ids_arg(&reference_prompt());
    let gen = gen.to_string();
    sb.worker(&["--ids", &ids, "--gen", &gen, "--threads", "1"])
}

/// The invariant: the run did not succeed, ended with a documented refusal or failure, and
/// printed no id the exact model would not give (a prefix of the reference at most).
fn assert_no_wrong_ids(r: &Run, what: &str) {
    assert!(
        [1, 2, 3].contains(&r.code),
        "{what}: expected exit 1, 2 or 3: {r:?}"
    );
    let got = printed_ids(r);
    let want = reference_greedy();
    assert!(
        got.len() <= want.len() && got == want[..got.len()],
        "{what}: printed ids {got:?} are not the reference's {want:?}"
    );
}

/// A change made to a trunk: to `trunk.json` (the parsed file, written back after) and/or to
/// `trunk.bin` in place.
type Edit<'a> = dyn Fn(&Path, &mut Value) + 'a;

/// One damaged trunk: `damage` edits `trunk.json` (the parsed file, returned to be written)
/// and/or `trunk.bin` in place; `undo` puts `trunk.bin` back.
struct Case<'a> {
    what: &'a str,
    damage: &'a Edit<'a>,
    undo: &'a dyn Fn(&Path),
}

/// Run `case` in every mode: standalone and a store's start, pinned and streamed, on the
/// damaged trunk; and a worker attaching to a store started on the good trunk before the damage.
fn check(sb: &mut Sandbox, trunk: &Path, case: &Case<'_>) {
    let good = read_json(trunk);
    let damage = |sb: &Sandbox| {
        let _ = sb;
        let mut v = good.clone();
        (case.damage)(trunk, &mut v);
        write_json(trunk, &v);
    };
    let restore = || {
        (case.undo)(trunk);
        write_json(trunk, &good);
    };
    for (mode, budget) in [
        ("pinned", pin_everything()),
        ("streamed", stream_everything(trunk)),
    ] {
        let what = format!("{}: {mode}", case.what);
        damage(sb);
        let r = standalone(sb, trunk, &budget, 8);
        assert_no_wrong_ids(&r, &format!("{what}: standalone"));
        let r = try_store(sb, trunk, &budget);
        if r.code == 0 {
            // Opened (the damage is only seen when a layer is read): an attached worker must
            // not give a wrong id.
            sb.adopt_store(r);
            let w = attached(sb, 8);
            assert_no_wrong_ids(&w, &format!("{what}: attached"));
            sb.stop_store();
        } else {
            assert_eq!(r.code, 2, "{what}: store start: {r:?}");
            assert!(
                !sb.socket.exists(),
                "{what}: a refused start leaves no socket"
            );
        }
        restore();
        // A store started on the good trunk; the damage done while it runs: a new worker
        // reads the damaged `trunk.json` (its descriptors or seal are not the store's) and
        // the store reads the damaged `trunk.bin`.
        sb.start_store(
            &{
                let model = tiny_model();
                let mut a: Vec<String> = vec![
                    path_str(&model).into(),
                    "--trunk".into(),
                    path_str(trunk).into(),
                ];
                a.extend(budget.iter().cloned());
                a
            }
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        );
        damage(sb);
        let w = attached(sb, 8);
        assert_no_wrong_ids(&w, &format!("{what}: attached to a store started before"));
        sb.stop_store();
        restore();
    }
}

fn tensor_entry<'v>(v: &'v Value, l: usize, suffix: &str) -> (&'v String, &'v Value) {
    v["layers"][l]["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(n, _)| n.ends_with(suffix))
        .unwrap_or_else(|| panic!("layer {l} has no {suffix}"))
}

fn set(v: &mut Value, l: usize, suffix: &str, key: &str, value: Value) {
    let name = tensor_entry(v, l, suffix).0.clone();
    v["layers"][l]["tensors"][&name][key] = value;
}

fn get(v: &Value, l: usize, suffix: &str, key: &str) -> Value {
    tensor_entry(v, l, suffix).1[key].clone()
}

/// A layer that is KDA (q/k projections) and past the first few.
const L: usize = 5;

/// The descriptor edits of the issue, each as written (the seal refuses it) and resealed (a
/// structural check or the layer's bound checksum does).
fn descriptor_cases(sb: &mut Sandbox, trunk: &Path) {
    let no_undo = |_: &Path| {};
    let off_by = |delta: i64| {
        move |_: &Path, v: &mut Value| {
            let off = get(v, L, "input_layernorm.weight", "off").as_i64().unwrap();
            set(
                v,
                L,
                "input_layernorm.weight",
                "off",
                (off + delta).max(0).into(),
            );
        }
    };
    let swap_qk = |_: &Path, v: &mut Value| {
        for key in ["off", "stored", "codec"] {
            let (a, b) = (
                get(v, L, "q_proj.weight", key),
                get(v, L, "k_proj.weight", key),
            );
            set(v, L, "q_proj.weight", key, b);
            set(v, L, "k_proj.weight", key, a);
        }
    };
    let norm_at_norm = |_: &Path, v: &mut Value| {
        let off = get(v, L, "post_attention_layernorm.weight", "off");
        set(v, L, "input_layernorm.weight", "off", off);
    };
    // ecbf16 -> raw (the stored size the raw tensor's), or raw -> ecbf16 on a raw trunk.
    let recodec = |_: &Path, v: &mut Value| {
        if get(v, L, "q_proj.weight", "codec") == "raw" {
            set(v, L, "q_proj.weight", "codec", "ecbf16".into());
        } else {
            let nbytes = get(v, L, "q_proj.weight", "nbytes");
            set(v, L, "q_proj.weight", "codec", "raw".into());
            set(v, L, "q_proj.weight", "stored", nbytes);
        }
    };
    let swap_layers = |_: &Path, v: &mut Value| {
        let (a, b) = (v["layers"][L].clone(), v["layers"][L + 4].clone());
        for key in ["file_off", "nbytes", "xxh3"] {
            v["layers"][L][key] = b[key].clone();
            v["layers"][L + 4][key] = a[key].clone();
        }
    };
    let edits: [(&str, &Edit<'_>); 7] = [
        ("input_layernorm off +2", &off_by(2)),
        ("input_layernorm off -2", &off_by(-2)),
        ("input_layernorm off -64", &off_by(-64)),
        ("q_proj/k_proj descriptors swapped", &swap_qk),
        (
            "input_layernorm pointed at post_attention_layernorm",
            &norm_at_norm,
        ),
        ("q_proj codec changed", &recodec),
        ("layers 5 and 9 descriptors swapped", &swap_layers),
    ];
    for (what, edit) in edits {
        check(
            sb,
            trunk,
            &Case {
                what,
                damage: edit,
                undo: &no_undo,
            },
        );
        let resealed_edit = |t: &Path, v: &mut Value| {
            edit(t, v);
            *v = resealed(v);
        };
        check(
            sb,
            trunk,
            &Case {
                what: &format!("{what}, resealed"),
                damage: &resealed_edit,
                undo: &no_undo,
            },
        );
    }
}

/// Byte offsets in `trunk.bin` of the parts of layer `L`'s first EC-BF16 tensor with escapes:
/// (a low byte of its plane, a palette entry, an escape entry's high byte, its header hash).
fn coded_parts(trunk: &Path) -> (u64, u64, u64, u64) {
    use std::os::unix::fs::FileExt;
    let v = read_json(trunk);
    let layer = &v["layers"][L];
    let f = std::fs::File::open(trunk.join("trunk.bin")).unwrap();
    for t in layer["tensors"].as_object().unwrap().values() {
        if t["codec"] != "ecbf16" {
            continue;
        }
        let at = layer["file_off"].as_u64().unwrap() + t["off"].as_u64().unwrap();
        let mut h = [0u8; 64];
        f.read_exact_at(&mut h, at).unwrap();
        assert_eq!(&h[0..4], b"K3EC");
        let escapes = u32::from_le_bytes(h[16..20].try_into().unwrap()) as u64;
        if escapes == 0 {
            continue;
        }
        let end = at + t["stored"].as_u64().unwrap();
        return (at + 64, at + 32, end - 4 * escapes, at + 24);
    }
    panic!("layer {L} has no coded tensor with escapes");
}

/// A flipped bit in `trunk.bin` with the layer's checksum recomputed: the seal refuses the
/// file (the bound checksum alone would pass the bytes).
fn forged_checksum_cases(sb: &mut Sandbox, trunk: &Path, coded: bool) {
    let v = read_json(trunk);
    let norm = v["layers"][L]["file_off"].as_u64().unwrap()
        + get(&v, L, "input_layernorm.weight", "off")
            .as_u64()
            .unwrap()
        + 3;
    let mut spots = vec![("a raw norm byte", norm)];
    if coded {
        let (plane, palette, escape, hash) = coded_parts(trunk);
        spots.extend([
            ("a coded matrix's plane", plane),
            ("a palette entry", palette),
            ("an escape code", escape),
            ("a header hash", hash),
        ]);
    }
    for (what, at) in spots {
        let damage = move |t: &Path, v: &mut Value| {
            flip_bit(t, at, 1);
            recompute_layer(t, v, L);
        };
        let undo = move |t: &Path| flip_bit(t, at, 1);
        check(
            sb,
            trunk,
            &Case {
                what: &format!("{what} flipped, layer checksum recomputed"),
                damage: &damage,
                undo: &undo,
            },
        );
    }
}

#[test]
fn edited_descriptors_never_give_ids_coded_trunk() {
    let mut sb = Sandbox::new("bound-coded");
    let trunk = sb.pack_trunk_with(&tiny_model(), "trunk", &["--codec", "ecbf16"]);
    let r = standalone(&sb, &trunk, &pin_everything(), 20);
    assert_eq!(printed_ids(&r), reference_greedy(), "the good trunk: {r:?}");
    descriptor_cases(&mut sb, &trunk);
}

#[test]
fn edited_descriptors_never_give_ids_raw_trunk() {
    let mut sb = Sandbox::new("bound-raw");
    let trunk = sb.pack_trunk(&tiny_model(), "trunk");
    descriptor_cases(&mut sb, &trunk);
}

#[test]
fn forged_layer_checksums_never_give_ids() {
    let mut sb = Sandbox::new("bound-forged");
    let coded = sb.pack_trunk_with(&tiny_model(), "coded", &["--codec", "ecbf16"]);
    forged_checksum_cases(&mut sb, &coded, true);
    let raw = sb.pack_trunk(&tiny_model(), "raw");
    forged_checksum_cases(&mut sb, &raw, false);
    // Restored, both are good (the damage above was undone each time).
    for t in [&coded, &raw] {
        let r = standalone(&sb, t, &stream_everything(t), 20);
        assert_eq!(printed_ids(&r), reference_greedy(), "{r:?}");
    }
}

/// Wait until the spawned worker has printed step `n` of its step table.
fn wait_for_step(w: &k3_tests::Spawned, n: usize) {
    let seen = poll_until(Duration::from_secs(60), || {
        let err = std::fs::read_to_string(&w.stderr_path).ok()?;
        err.lines()
            .filter_map(|l| l.split_whitespace().next()?.parse::<usize>().ok())
            .any(|s| s >= n)
            .then_some(())
    });
    assert!(seen.is_some(), "worker {} never reached step {n}", w.pid());
}

/// `K3_TRUNK_VERIFY=first` (the default): a byte of a streamed layer changed in `trunk.bin`
/// after that layer's first, checked read. The file's change time moved, so its next read is
/// checked again and fails the run (exit 1) — never an id of other weights.
#[test]
fn a_byte_changed_after_the_first_read_fails_the_next_read() {
    let mut sb = Sandbox::new("bound-first");
    let trunk = sb.pack_trunk_with(&tiny_model(), "trunk", &["--codec", "ecbf16"]);
    let stream = stream_everything(&trunk);
    const GEN: u32 = 400;
    let want = printed_ids(&standalone(&sb, &trunk, &stream, GEN));
    assert_eq!(&want[..20], &reference_greedy()[..]);
    let v = read_json(&trunk);
    let at = v["layers"][L]["file_off"].as_u64().unwrap()
        + get(&v, L, "q_proj.weight", "off").as_u64().unwrap()
        + 100;
    let model: PathBuf = tiny_model();
    let ids = ids_arg(&reference_prompt());
    let gen = GEN.to_string();
    let check_run = |r: Run, what: &str| {
        assert_eq!(r.code, 1, "{what}: {r:?}");
        assert!(
            r.stderr.contains(&format!("trunk layer {L}")) && r.stderr.contains("checksum"),
            "{what}: {}",
            r.stderr
        );
        let got = printed_ids(&r);
        assert!(
            got.len() < want.len() && got == want[..got.len()],
            "{what}: {got:?}"
        );
    };
    // Standalone: the worker's own ring.
    let mut args = vec![
        "--standalone",
        path_str(&model),
        "--trunk",
        path_str(&trunk),
        "--ids",
        &ids,
        "--gen",
        &gen,
        "--threads",
        "1",
    ];
    args.extend(stream.iter().map(String::as_str));
    let w = sb.spawn("k3-worker", &args);
    wait_for_step(&w, 3);
    flip_bit(&trunk, at, 3);
    check_run(w.wait(Duration::from_secs(300)), "standalone");
    flip_bit(&trunk, at, 3);
    // Attached: the store's ring.
    let mut store_args = vec![path_str(&model), "--trunk", path_str(&trunk)];
    store_args.extend(stream.iter().map(String::as_str));
    sb.start_store(&store_args);
    let w = sb.spawn_worker(&["--ids", &ids, "--gen", &gen, "--threads", "1"]);
    wait_for_step(&w, 3);
    flip_bit(&trunk, at, 3);
    check_run(w.wait(Duration::from_secs(300)), "attached");
    flip_bit(&trunk, at, 3);
    // The store keeps serving: the restored file's next read is checked and passes.
    let r = attached(&sb, 20);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(printed_ids(&r), reference_greedy());
}
