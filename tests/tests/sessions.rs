//! Conversations kept in the store (docs/SPEC.md §6.6), end to end: real `k3-store`, real
//! `k3-worker` jobs resuming a session in a NEW process, checked against a full re-prefill and
//! the tiny fixture's reference ids; the store's limits (LRU by count and by bytes), its state
//! directory (survives a restart; damaged files refused with a clear log line; a store of
//! another model refused). The hostile cases of the state directory are in `state_trust.rs`.
//!
//! The chat test needs the real vocabulary (the XTML markers are ids ≥ 163584): it generates the
//! `small` checkpoint (~190 MB, ~5 s) with `scripts/make-checkpoint.py` once.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use k3_tests::{
    ids_arg, path_str, reference_greedy, reference_prompt, small_model, tiny_model, workspace_root,
    Run, Sandbox,
};
use serde_json::Value;

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// A one-shot attached run of `prompt` with `--gen n` (and `--session name`); its report.
fn one_shot(sb: &Sandbox, prompt: &[u32], n: u32, session: Option<&str>) -> (Run, Value) {
    let ids = ids_arg(prompt);
    let gen = n.to_string();
    let mut args = vec!["--ids", &ids, "--gen", &gen];
    if let Some(s) = session {
        args.extend(["--session", s]);
    }
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "worker failed: {r:?}");
    (r, j)
}

fn sessions(sb: &Sandbox) -> Vec<(String, u64, u64)> {
    let r = sb.ctl(&["sessions", "--json"]);
    assert_eq!(r.code, 0, "k3-ctl sessions: {r:?}");
    let v: Value = serde_json::from_str(r.stdout.trim()).expect("sessions JSON");
    v.as_array()
        .expect("list")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_string(),
                s["ids"].as_u64().unwrap(),
                s["bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn names(sb: &Sandbox) -> Vec<String> {
    sessions(sb).into_iter().map(|s| s.0).collect()
}

#[test]
fn a_resumed_prompt_prefills_only_its_new_ids_and_matches_a_full_prefill() {
    let mut sb = Sandbox::new("sess-resume");
    sb.start_store(&[path_str(&tiny_model())]);
    let prompt = reference_prompt();
    let want = reference_greedy();
    // Turn 1: a new session.
    let (r1, j1) = one_shot(&sb, &prompt, 4, Some("conv"));
    assert!(r1.stderr.contains("session conv: new"), "{}", r1.stderr);
    assert!(r1.stderr.contains("session conv: kept"), "{}", r1.stderr);
    assert_eq!(ids_of(&j1["generated_ids"]), want[..4]);
    assert_eq!(j1["session"]["reused"], 0);
    let held = prompt.len() + 3; // the prompt and every generated id but the last (never fed)
    assert_eq!(sessions(&sb)[0].1, held as u64);
    let st = sb.stats();
    assert_eq!(st["sessions"]["count"], 1, "{st}");
    assert!(st["sessions"]["bytes"].as_u64().unwrap() > 0, "{st}");

    // Turn 2 in a NEW worker: the prompt extends what the session holds.
    let prompt2: Vec<u32> = prompt.iter().chain(&want[..4]).copied().collect();
    let (r2, j2) = one_shot(&sb, &prompt2, 4, Some("conv"));
    assert!(r2.stderr.contains("session conv: resumed"), "{}", r2.stderr);
    assert_eq!(j2["session"]["reused"], held, "{}", j2["session"]);
    assert_eq!(j2["session"]["prefilled"], prompt2.len() - held);
    assert_eq!(j2["prompt_ids"], serde_json::json!(prompt2));
    // The same ids as the reference's continuation and as a full re-prefill without the session.
    assert_eq!(ids_of(&j2["generated_ids"]), want[4..8]);
    let (_, full) = one_shot(&sb, &prompt2, 4, None);
    assert_eq!(full["generated_ids"], j2["generated_ids"]);
    assert_eq!(
        sessions(&sb)[0].1,
        (prompt2.len() + 3) as u64,
        "the session grew"
    );

    // A prompt that does not extend the session is prefilled whole (and replaces it).
    let other = [5u32, 6, 7];
    let (r3, j3) = one_shot(&sb, &other, 2, Some("conv"));
    assert!(
        r3.stderr.contains("are not a prefix of this prompt"),
        "{}",
        r3.stderr
    );
    assert_eq!(j3["session"]["reused"], 0);
    assert_eq!(sessions(&sb)[0].1, 4);

    // Standalone has no store to keep a session in: refused by the command line (exit 2).
    let r = sb.run(
        "k3-worker",
        &[
            "--standalone",
            path_str(&tiny_model()),
            "--ids",
            "1,2",
            "--session",
            "s",
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--session"), "{}", r.stderr);
}

#[test]
fn sessions_are_evicted_least_recently_used_by_count_and_by_bytes() {
    let prompt = reference_prompt();
    // Count: at most two.
    let mut sb = Sandbox::new("sess-lru");
    sb.start_store(&[path_str(&tiny_model()), "--max-sessions", "2"]);
    one_shot(&sb, &prompt, 2, Some("a"));
    one_shot(&sb, &prompt, 2, Some("b"));
    // Resuming a makes b the least recently used.
    let longer: Vec<u32> = prompt.iter().chain(&[1, 2, 3]).copied().collect();
    one_shot(&sb, &longer, 2, Some("a"));
    let (r, _) = one_shot(&sb, &prompt, 2, Some("c"));
    assert!(r.stderr.contains("the store evicted b"), "{}", r.stderr);
    assert_eq!(names(&sb), ["c", "a"]);
    let st = sb.stats();
    assert_eq!(
        (
            st["sessions"]["count"].as_u64(),
            st["sessions"]["evicted"].as_u64()
        ),
        (Some(2), Some(1)),
        "{st}"
    );
    let one = sessions(&sb)[0].2;
    drop(sb);

    // Bytes: room for one session of this size, not two.
    let mut sb = Sandbox::new("sess-bytes");
    let mb = format!("{:.6}", 1.5 * one as f64 / 1e6);
    sb.start_store(&[path_str(&tiny_model()), "--session-mb", &mb]);
    one_shot(&sb, &prompt, 2, Some("x"));
    let (r, _) = one_shot(&sb, &prompt, 2, Some("y"));
    assert!(r.stderr.contains("the store evicted x"), "{}", r.stderr);
    assert_eq!(names(&sb), ["y"]);
    drop(sb);

    // A session larger than the whole budget is refused; the run itself still succeeds.
    let mut sb = Sandbox::new("sess-toobig");
    let mb = format!("{:.6}", 0.5 * one as f64 / 1e6);
    sb.start_store(&[path_str(&tiny_model()), "--session-mb", &mb]);
    let (r, j) = one_shot(&sb, &prompt, 2, Some("x"));
    assert!(
        r.stderr.contains("session x: NOT kept") && r.stderr.contains("--session-mb"),
        "{}",
        r.stderr
    );
    assert_eq!(j["session"]["kept_bytes"], Value::Null);
    assert!(names(&sb).is_empty());
}

/// Copy the tiny checkpoint to `dst` with one more byte in config.json: same tensors, another
/// model identity.
fn foreign_model(dst: &Path) -> PathBuf {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(tiny_model()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let cfg = dst.join("config.json");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push('\n');
    std::fs::write(&cfg, text).unwrap();
    dst.to_path_buf()
}

#[test]
fn the_state_dir_survives_a_restart_and_refuses_damaged_or_foreign_sessions() {
    let mut sb = Sandbox::new("sess-dir");
    let dir = sb.dir.join("state");
    let d = path_str(&dir).to_string();
    let model = tiny_model();
    sb.start_store(&[path_str(&model), "--state-dir", &d]);
    let prompt = reference_prompt();
    let want = reference_greedy();
    one_shot(&sb, &prompt, 4, Some("kept"));
    let file = dir.join("kept.k3session");
    assert!(file.is_file(), "written to the state dir");
    sb.stop_store();

    // A restart reloads it, and a new worker resumes it with the reference's ids.
    sb.start_store(&[path_str(&model), "--state-dir", &d]);
    assert_eq!(names(&sb), ["kept"]);
    let prompt2: Vec<u32> = prompt.iter().chain(&want[..4]).copied().collect();
    let (r, j) = one_shot(&sb, &prompt2, 4, Some("kept"));
    assert!(r.stderr.contains("session kept: resumed"), "{}", r.stderr);
    assert_eq!(ids_of(&j["generated_ids"]), want[4..8]);
    sb.stop_store();

    // A damaged copy (0600, as the store writes) is refused with a clear log line (its MAC);
    // the good one still loads.
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    let damaged = dir.join("damaged.k3session");
    std::fs::write(&damaged, &bytes).unwrap();
    std::fs::set_permissions(
        &damaged,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    sb.start_store(&[path_str(&model), "--state-dir", &d]);
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert!(
        log.contains("damaged.k3session") && log.contains("MAC mismatch"),
        "{log}"
    );
    assert_eq!(names(&sb), ["kept"]);
    sb.stop_store();

    // Another checkpoint (another identity): the state directory belongs to this one, so the
    // start is refused (exit 2), naming both identities.
    let other = foreign_model(&sb.dir.join("other-model"));
    let sock = path_str(&sb.socket).to_string();
    let r = sb.run(
        "k3-store",
        &[
            "start",
            path_str(&other),
            "--state-dir",
            &d,
            "--socket",
            &sock,
            "--detach",
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("holds the sessions of model") && r.stderr.contains("this store serves"),
        "{r:?}"
    );
    assert!(!sb.socket.exists());
    // The refused files are left alone.
    assert!(file.is_file() && damaged.is_file());
}

/// `k3-worker --chat` attached, fed `input` on stdin; its run and `--out` report.
fn chat(sb: &Sandbox, input: &str, extra: &[&str]) -> (Run, Value) {
    let out = sb.dir.join(format!("chat-{}.json", rand_tag()));
    let tok = workspace_root().join("fixtures/tokenizer");
    let mut args = vec![
        "--chat",
        "--tok",
        path_str(&tok),
        "--gen",
        "6",
        // A budget the reply cannot spend: its ids are the model's own, as a full re-prefill's.
        "--think-budget",
        "6",
        "--ctx",
        "512",
        "--socket",
        path_str(&sb.socket),
        "--out",
        path_str(&out),
    ];
    args.extend_from_slice(extra);
    let mut c = sb.command("k3-worker", &args);
    let mut child = c
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn k3-worker");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let r = Run {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    assert_eq!(r.code, 0, "chat failed: {r:?}");
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    (r, j)
}

fn rand_tag() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

#[test]
fn a_second_chat_worker_resumes_the_session_with_the_ids_of_a_full_reprefill() {
    let model = small_model();
    let mut sb = Sandbox::new("sess-chat");
    sb.start_store(&[path_str(model)]);
    // Turn 1 in worker A.
    let (ra, a) = chat(&sb, "Hello there, who are you?\n", &["--session", "talk"]);
    assert!(ra.stderr.contains("session talk: new"), "{}", ra.stderr);
    assert!(ra.stderr.contains("session talk: kept"), "{}", ra.stderr);
    let a1 = &a["turns"][0];
    assert_eq!(a1["reused"], 0);
    // Turn 2 in a NEW worker B: resumed, only the new turn prefilled.
    let (rb, b) = chat(&sb, "Tell me more.\n", &["--session", "talk"]);
    assert!(
        rb.stderr.contains("session talk: resumed") && rb.stderr.contains("2 messages"),
        "{}",
        rb.stderr
    );
    let b2 = &b["turns"][0];
    assert_eq!(b2["restarted"], false, "{b2}");
    let reused = b2["reused"].as_u64().unwrap();
    let conv2 = ids_of(&b2["conversation_ids"]);
    let conv1 = ids_of(&a1["conversation_ids"]);
    let gen1 = ids_of(&a1["generated_ids"]);
    // The state held turn 1's conversation and every reply id but the last.
    assert_eq!(reused as usize, conv1.len() + gen1.len() - 1, "{b2}");
    assert_eq!(
        b2["prefilled"].as_u64().unwrap() as usize,
        conv2.len() - reused as usize
    );
    assert!(conv2.starts_with(&conv1));
    // One worker running both turns gives the same conversation and reply ids...
    let (_, c) = chat(&sb, "Hello there, who are you?\nTell me more.\n", &[]);
    assert_eq!(c["turns"][0]["generated_ids"], a1["generated_ids"]);
    assert_eq!(c["turns"][1]["conversation_ids"], b2["conversation_ids"]);
    assert_eq!(c["turns"][1]["generated_ids"], b2["generated_ids"]);
    // ... and so does a full re-prefill of turn 2's conversation in one forward.
    let ids = ids_arg(&conv2);
    let (r, full) = sb.worker_json(&["--ids", &ids, "--gen", "6", "--prefill-chunk", "0"]);
    assert_eq!(r.code, 0, "{r:?}");
    let reply = ids_of(&b2["generated_ids"]);
    let full_ids = ids_of(&full["generated_ids"]);
    assert_eq!(
        full_ids[..reply.len()],
        reply[..],
        "resumed ≠ full re-prefill"
    );
}
