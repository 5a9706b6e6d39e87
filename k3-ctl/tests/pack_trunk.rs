//! End-to-end: `k3-ctl pack-trunk` and `k3-ctl presets` (the real binary) on synthetic
//! checkpoints written by k3-store's test fixture: exit 0 with a usable packed trunk, exit 2 on
//! a non-contiguous layer, exit 1 on an output that cannot be written.

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
    let spec = Spec::small(4, 3);
    let w = fixture::write(&spec, "ctl-pack");
    let out = w.dir.join("packed");
    let o = ctl(&["pack-trunk", w.dir.to_str().unwrap(), out.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("packed 4 layers"), "{stdout}");
    let total: u64 = (0..4).map(|l| w.catalog.trunk_bytes(l)).sum();
    assert!(stdout.contains(&format!("{total} bytes")), "{stdout}");
    TrunkLayout::from_packed(&w.catalog, open_shards(&w.catalog).unwrap(), &out).unwrap();

    // The output directory is a file: an I/O failure, exit 1.
    let file = w.dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let o = ctl(&[
        "pack-trunk",
        w.dir.to_str().unwrap(),
        file.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // A layer whose trunk tensors are interleaved with an expert tensor: refused, exit 2.
    let mut spec = Spec::small(4, 3);
    spec.scattered_layers = vec![3];
    let w = fixture::write(&spec, "ctl-scatter");
    let out = w.dir.join("packed");
    let o = ctl(&["pack-trunk", w.dir.to_str().unwrap(), out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("layer 3") && stderr.contains("contiguous"),
        "{stderr}"
    );
    assert!(!out.join("trunk.json").exists());
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
