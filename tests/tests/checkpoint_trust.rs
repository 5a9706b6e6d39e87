//! The model's identity and shape with real processes and real files (issue 34, items 8 to 10):
//! `k3-ctl verify` reads the contents against the manifest (a scrambled expert, embedding,
//! `lm_head` or `A_log` is caught; without a manifest it says so, exit 5), `pack-trunk` records
//! every source tensor's hash (verify names the tensor that changed), the store says which
//! identity it checked; a transposed or F16 tensor and a missing index are refused by the first
//! command that reads the headers (exit 2, naming them); size flags the machine cannot hold are
//! refused at start.

use std::path::{Path, PathBuf};

use k3_tests::{path_str, tiny_model, Run, Sandbox};
use serde_json::Value;

/// A copy of the tiny checkpoint (manifest included) in `<sandbox>/<name>`.
fn copy_model(sb: &Sandbox, name: &str) -> PathBuf {
    let dst = sb.dir.join(name);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(tiny_model()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// The shard holding `tensor`, its parsed header, and where its header and data start.
fn locate(model: &Path, tensor: &str) -> (PathBuf, Value, u64) {
    for e in std::fs::read_dir(model).unwrap() {
        let p = e.unwrap().path();
        if p.extension().and_then(|x| x.to_str()) != Some("safetensors") {
            continue;
        }
        let b = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap());
        let h: Value = serde_json::from_slice(&b[8..8 + n as usize]).unwrap();
        if h.get(tensor).is_some() {
            return (p, h, 8 + n);
        }
    }
    panic!("{tensor} not found in {}", model.display());
}

/// Flip one byte in the middle of `tensor`'s data.
fn scramble(model: &Path, tensor: &str) {
    use std::os::unix::fs::FileExt;
    let (p, h, data) = locate(model, tensor);
    let offs = &h[tensor]["data_offsets"];
    let (a, b) = (offs[0].as_u64().unwrap(), offs[1].as_u64().unwrap());
    let at = data + a + (b - a) / 2;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let mut x = [0u8];
    f.read_exact_at(&mut x, at).unwrap();
    f.write_all_at(&[x[0] ^ 0x20], at).unwrap();
}

/// Replace `from` by `to` (the same length) in the header of the shard holding `tensor`, inside
/// that tensor's entry.
fn patch_header(model: &Path, tensor: &str, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let (p, _, data) = locate(model, tensor);
    let mut b = std::fs::read(&p).unwrap();
    let header = String::from_utf8(b[8..data as usize].to_vec()).unwrap();
    let key = format!("\"{tensor}\"");
    let at = header.find(&key).unwrap();
    let end = at + header[at..].find('}').unwrap();
    let entry = &header[at..end];
    let i = entry
        .find(from)
        .unwrap_or_else(|| panic!("{from} not in {entry}"));
    let start = 8 + at + i;
    b[start..start + to.len()].copy_from_slice(to.as_bytes());
    std::fs::write(&p, b).unwrap();
}

fn layer_tensor(l: usize, suffix: &str) -> String {
    format!("language_model.model.layers.{l}.{suffix}")
}

fn verify(sb: &Sandbox, model: &Path, trunk: Option<&Path>) -> Run {
    let mut args = vec!["verify", path_str(model)];
    if let Some(t) = trunk {
        args.extend(["--trunk", path_str(t)]);
    }
    sb.run("k3-ctl", &args)
}

#[test]
fn verify_reads_the_contents_against_the_manifest_and_says_when_it_cannot() {
    let sb = Sandbox::new("verify-contents");
    let good = copy_model(&sb, "good");
    let r = verify(&sb, &good, None);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(
        r.stdout.contains("verify: OK") && r.stdout.contains("(manifest"),
        "{r:?}"
    );
    // One byte of a routed expert, the embedding, lm_head, an A_log: each used to pass "OK".
    for (name, tensor) in [
        (
            "expert",
            layer_tensor(5, "block_sparse_moe.experts.3.w2.weight_packed"),
        ),
        (
            "embed",
            "language_model.model.embed_tokens.weight".to_string(),
        ),
        ("lm_head", "language_model.lm_head.weight".to_string()),
        ("a_log", layer_tensor(2, "self_attn.A_log")),
    ] {
        let m = copy_model(&sb, name);
        scramble(&m, &tensor);
        let (shard, _, _) = locate(&m, &tensor);
        let shard = shard.file_name().unwrap().to_string_lossy().into_owned();
        let r = verify(&sb, &m, None);
        assert_eq!(r.code, 2, "{name}: {r:?}");
        let bad = r
            .stdout
            .lines()
            .find(|l| l.contains("BAD"))
            .unwrap_or_else(|| panic!("{name}: {r:?}"));
        assert!(
            bad.contains(&shard) && bad.contains("sha256"),
            "{name}: {bad}"
        );
        assert!(r.stdout.contains("verify: BAD"), "{name}: {r:?}");
    }
    // Without a manifest: every byte read, but no reference: a distinct exit code, said plainly.
    let bare = copy_model(&sb, "bare");
    std::fs::remove_file(bare.join("k3-manifest.json")).unwrap();
    let r = verify(&sb, &bare, None);
    assert_eq!(r.code, 5, "{r:?}");
    assert!(
        r.stdout.contains("NOT checked against a reference") && r.stdout.contains("sampled"),
        "{r:?}"
    );
    // A manifest of other sizes: refused before reading.
    let m = copy_model(&sb, "other-manifest");
    let text = std::fs::read_to_string(m.join("k3-manifest.json")).unwrap();
    std::fs::write(
        m.join("k3-manifest.json"),
        text.replacen("\"size\": 1329648", "\"size\": 1329649", 1),
    )
    .unwrap();
    let r = verify(&sb, &m, None);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("does not describe"), "{r:?}");
}

#[test]
fn pack_trunk_records_every_source_tensor_and_verify_names_the_one_that_changed() {
    let mut sb = Sandbox::new("tensor-hashes");
    let m = copy_model(&sb, "model");
    let trunk = sb.pack_trunk(&m, "trunk");
    let j: Value =
        serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap()).unwrap();
    assert_eq!(j["model"]["id_kind"], "manifest", "{}", j["model"]);
    for l in j["layers"].as_array().unwrap() {
        for (name, t) in l["tensors"].as_object().unwrap() {
            assert_eq!(t["xxh3"].as_str().map(str::len), Some(16), "{name}");
        }
    }
    let r = verify(&sb, &m, Some(&trunk));
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains("trunk identity"), "{r:?}");
    // The store says which identity it checked at start.
    sb.start_store(&[path_str(&m), "--trunk", path_str(&trunk)]);
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert!(
        log.contains("model identity") && log.contains("(manifest:"),
        "{log}"
    );
    sb.stop_store();
    // A_log of layer 2 changed in the checkpoint after packing: verify names it.
    let a_log = layer_tensor(2, "self_attn.A_log");
    scramble(&m, &a_log);
    let r = verify(&sb, &m, Some(&trunk));
    assert_eq!(r.code, 2, "{r:?}");
    let layer2 = r
        .stdout
        .lines()
        .find(|l| l.contains("layer 2: BAD"))
        .unwrap_or_else(|| panic!("{r:?}"));
    assert!(
        layer2.contains(&format!("{a_log} in the checkpoint hashes to")),
        "{layer2}"
    );
    // Without a manifest the store says its identity is the weaker, sampled one.
    let bare = copy_model(&sb, "bare");
    std::fs::remove_file(bare.join("k3-manifest.json")).unwrap();
    sb.start_store(&[path_str(&bare)]);
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert!(log.contains("(sampled, weaker"), "{log}");
}

#[test]
fn a_transposed_or_f16_tensor_or_a_missing_index_is_refused_by_the_first_command_that_reads_the_headers(
) {
    let sb = Sandbox::new("shapes");
    // KDA q_proj of layer 0 is [64, 128] (heads × head_dim, hidden): stored [128, 64], the same
    // bytes; the dense gate projection of layer 0 stored as F16 (the same width as BF16).
    let q = layer_tensor(0, "self_attn.q_proj.weight");
    let transposed = copy_model(&sb, "transposed");
    patch_header(&transposed, &q, "[64,128]", "[128,64]");
    let norm = layer_tensor(0, "mlp.gate_proj.weight");
    let f16 = copy_model(&sb, "f16");
    patch_header(&f16, &norm, "\"BF16\"", "\"F16\" ");
    let no_index = copy_model(&sb, "no-index");
    std::fs::remove_file(no_index.join("model.safetensors.index.json")).unwrap();
    for (model, needle) in [
        (&transposed, format!("`{q}`: BF16 [128, 64]")),
        (&f16, format!("`{norm}`: F16")),
        (&no_index, "model.safetensors.index.json".to_string()),
    ] {
        for (what, r) in sb.every_header_command(model) {
            assert_eq!(r.code, 2, "{what} on {}: {r:?}", model.display());
            let said = format!("{}{}", r.stdout, r.stderr);
            assert!(said.contains(&needle), "{what}: {needle} not in {r:?}");
            assert!(!said.contains("panicked"), "{what}: {r:?}");
        }
        assert!(!sb.socket.exists());
        assert!(!sb.dir.join("packed-never").join("trunk.json").exists());
    }
    let r = sb.every_header_command(&transposed).remove(0).1;
    assert!(r.stderr.contains("(transposed)"), "{r:?}");
}

#[test]
fn size_flags_the_machine_cannot_hold_are_refused_at_start() {
    let mut sb = Sandbox::new("sizes");
    let m = tiny_model();
    let sock = path_str(&sb.socket).to_string();
    let start = |extra: &[&str], limit: Option<&str>| {
        let mut c = match limit {
            Some(l) => {
                let mut c = std::process::Command::new("prlimit");
                c.arg(format!("--as={l}")).arg(k3_tests::bin("k3-store"));
                c
            }
            None => std::process::Command::new(k3_tests::bin("k3-store")),
        };
        c.args(["start", path_str(&m), "--socket", &sock, "--detach"])
            .args(extra)
            .env("XDG_RUNTIME_DIR", sb.xdg_dir());
        sb.run_command(c)
    };
    // A petabyte of kept conversations: refused (it used to be accepted).
    let r = start(&["--session-mb", "1e9"], None);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("--session-mb") && r.stderr.contains("shortfall"),
        "{r:?}"
    );
    assert!(!sb.socket.exists());
    // Under a 1 GB address-space limit: the default 2048 MB of sessions shrinks to what is
    // left (said in the plan); an explicit 2048 and a 1 GB history are refused, naming the flag.
    let r = start(&["--history-ids", "268435456"], Some("1000000000"));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--history-ids 268435456"), "{r:?}");
    let r = start(&["--session-mb", "2048"], Some("1000000000"));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--session-mb 2048"), "{r:?}");
    let r = start(&[], Some("1000000000"));
    let r = sb.adopt_store(r);
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert!(
        log.contains("the default 2048 MB does not fit beside the plan"),
        "{r:?}\n{log}"
    );
}
