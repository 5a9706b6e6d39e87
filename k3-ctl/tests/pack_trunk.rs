//! End-to-end: `k3-ctl pack-trunk` and `k3-ctl presets` (the real binary) on synthetic
//! the bundled tiny model and k3-store's test fixture: exit 0 with a usable packed trunk, exit 2 on
//! tensors whose shapes are not the config's, exit 1 on an output that cannot be written.

#[path = "../../k3-store/tests/common/fixture.rs"]
mod fixture;

use std::process::Command;

use fixture::Spec;
use k3_store::runtime::trunk::{open_shards, TrunkLayout};

fn ctl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_k3-ctl"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn pack_trunk_exit_codes_and_output() {
    // A checkpoint of a real model's shapes (the bundled tiny model).
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/model");
    let (cat, _) = k3_store::runtime::catalog::Catalog::open_dir(&model).unwrap();
    let tmp = tempfile::Builder::new()
        .prefix("k3-ctl-pack")
        .tempdir()
        .unwrap();
    let out = tmp.path().join("packed");
    let o = ctl(&[
        "pack-trunk",
        model.to_str().unwrap(),
        out.to_str().unwrap(),
        "--codec",
        "raw",
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let n = cat.n_layers();
    assert!(stdout.contains(&format!("packed {n} layers")), "{stdout}");
    let total: u64 = (0..n).map(|l| cat.trunk_bytes(l)).sum();
    let raw = TrunkLayout::from_packed(&cat, open_shards(&cat).unwrap(), &out).unwrap();
    assert_eq!(raw.quant(), None);
    // Raw runs are the checkpoint's tensors at 64-byte offsets: at most 64 bytes more each.
    let runs: u64 = (0..n).map(|l| raw.plan(l).unwrap().run_len).sum();
    let tensors: u64 = (0..n).map(|l| cat.trunk(l).len() as u64).sum();
    assert!(
        runs >= total && runs < total + 64 * tensors,
        "{runs} vs {total}"
    );
    assert!(!stdout.contains("LOSSY"), "{stdout}");

    // The default is the coded trunk, smaller than raw.
    let coded = tmp.path().join("coded");
    let o = ctl(&[
        "pack-trunk",
        model.to_str().unwrap(),
        coded.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        stdout.contains("ecbf16: ")
            && stdout.contains(&format!("of the checkpoint's {total} trunk bytes (0.7")),
        "{stdout}"
    );
    assert!(!stdout.contains("LOSSY"), "{stdout}");
    let j = std::fs::read_to_string(coded.join("trunk.json")).unwrap();
    assert!(
        j.contains("\"format\": 5") && j.contains("\"codec\": \"ecbf16\""),
        "{j}"
    );
    TrunkLayout::from_packed(&cat, open_shards(&cat).unwrap(), &coded).unwrap();

    // Quantized trunks: lossy, and they say so.
    for (kind, ratio) in [("int8", "(0.5"), ("int4", "(0.3")] {
        let q = tmp.path().join(kind);
        let o = ctl(&[
            "pack-trunk",
            model.to_str().unwrap(),
            q.to_str().unwrap(),
            "--codec",
            kind,
        ]);
        let stdout = String::from_utf8_lossy(&o.stdout);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{stderr}");
        assert!(stderr.contains("LOSSY"), "{stderr}");
        assert!(
            stdout.contains(&format!("LOSSY: {kind} trunk"))
                && stdout.contains("docs/BENCHMARKS.md")
                && stdout.contains(&format!("{kind}: "))
                && stdout.contains(ratio),
            "{stdout}"
        );
        let t = TrunkLayout::from_packed(&cat, open_shards(&cat).unwrap(), &q).unwrap();
        assert_eq!(t.quant().map(|k| k.name()), Some(kind));
    }
    let o = ctl(&[
        "pack-trunk",
        model.to_str().unwrap(),
        tmp.path().join("x").to_str().unwrap(),
        "--codec",
        "int3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!tmp.path().join("x").exists());

    // The output directory is a file: an I/O failure, exit 1.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let o = ctl(&[
        "pack-trunk",
        model.to_str().unwrap(),
        file.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // Tensors whose shapes are not the config's (the library fixture's vary on purpose):
    // refused before anything is written, exit 2, naming a tensor. (A layer that is not one
    // contiguous run is refused by the library: `trunk::tests::pack_refuses_a_non_contiguous_layer…`.)
    let w = fixture::write(&Spec::small(4, 3), "ctl-shapes");
    let out = w.dir.join("packed");
    let o = ctl(&["pack-trunk", w.dir.to_str().unwrap(), out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("do not match the config") && stderr.contains("`language_model."),
        "{stderr}"
    );
    assert!(!out.join("trunk.json").exists());
    std::fs::remove_dir_all(&w.dir).unwrap();
}

#[test]
fn presets_table() {
    let o = ctl(&["presets"]);
    assert_eq!(o.status.code(), Some(0));
    let s = String::from_utf8_lossy(&o.stdout);
    for (name, t, c) in [
        ("laptop", "3.0", "1.0"),
        ("desktop", "16.0", "10.0"),
        ("workstation", "60.0", "30.0"),
        ("server", "110.0", "13.0"),
        ("max", "110.0", "109.0"),
    ] {
        let line = s.lines().find(|l| l.starts_with(name)).unwrap();
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((cols[1], cols[2]), (t, c), "{line}");
    }
}
