//! Sessions and saved state bound to the model's content identity, and a `--state-dir` trusted
//! only as far as it can be (issue 34, items 6 and 7), with real processes and real files: a
//! session made on one checkpoint never resumes on another of the same shape; the state
//! directory's owner and mode are checked, its files are written 0600 without following a
//! planted link, a FIFO in a file's place does not hang the start, and a forged file (its
//! checksum recomputed) is refused by the MAC.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use k3_tests::{
    ids_arg, is_root, path_str, poll_until, reference_greedy, reference_prompt, tiny_model,
    tiny_with_seed, Run, Sandbox,
};
use serde_json::Value;

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// An attached run of `prompt` with `--gen n` (and `--session name`): the run and its report.
fn run(sb: &Sandbox, prompt: &[u32], n: u32, session: Option<&str>) -> (Run, Value) {
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

/// `k3-store start MODEL --state-dir DIR --detach` on the sandbox's socket, whatever its outcome.
fn try_start(sb: &Sandbox, model: &Path, state: &Path) -> Run {
    let sock = path_str(&sb.socket).to_string();
    sb.run(
        "k3-store",
        &[
            "start",
            path_str(model),
            "--state-dir",
            path_str(state),
            "--socket",
            &sock,
            "--detach",
        ],
    )
}

fn set_mode(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn a_session_made_on_another_checkpoint_of_the_same_shape_never_resumes() {
    let mut sb = Sandbox::new("state-other");
    let other = tiny_with_seed(&sb.dir, 2);
    let state = sb.dir.join("state");
    let prompt = reference_prompt();
    let want = reference_greedy();
    // On the tiny checkpoint: a session of the prompt and 4 ids.
    sb.adopt_store(try_start(&sb, &tiny_model(), &state));
    let (_, j) = run(&sb, &prompt, 4, Some("conv"));
    assert_eq!(ids_of(&j["generated_ids"]), want[..4]);
    sb.stop_store();

    // The seed-2 checkpoint: same config, tensors and shard sizes, other weights. Its own
    // continuation, without any session:
    let other_state = sb.dir.join("other-state");
    sb.adopt_store(try_start(&sb, &other, &other_state));
    let prompt2: Vec<u32> = prompt.iter().chain(&want[..4]).copied().collect();
    let (_, own) = run(&sb, &prompt2, 4, None);
    let own_ids = ids_of(&own["generated_ids"]);
    sb.stop_store();

    // Before: both checkpoints had the same identity (config + shard sizes), so the tiny
    // session resumed on seed 2 and gave the continuation of the wrong state with exit 0.
    // Now its state directory is bound to the tiny model: refused, both identities named.
    let r = try_start(&sb, &other, &state);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("holds the sessions of model") && r.stderr.contains("this store serves"),
        "{r:?}"
    );
    let ids: Vec<&str> = r
        .stderr
        .split(|c: char| !c.is_ascii_hexdigit())
        .filter(|w| w.len() == 32)
        .collect();
    assert!(
        ids.len() >= 2 && ids[0] != ids[1],
        "both identities named: {r:?}"
    );
    assert!(!sb.socket.exists());

    // The tiny session's file copied into the seed-2 store's own directory (a file made
    // elsewhere): refused by its MAC; the worker prefills the whole prompt and gets seed 2's
    // own ids.
    std::fs::copy(
        state.join("conv.k3session"),
        other_state.join("conv.k3session"),
    )
    .unwrap();
    sb.adopt_store(try_start(&sb, &other, &other_state));
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert!(
        log.contains("conv.k3session") && log.contains("MAC mismatch"),
        "{log}"
    );
    let (r, j) = run(&sb, &prompt2, 4, Some("conv"));
    assert!(r.stderr.contains("session conv: new"), "{}", r.stderr);
    assert_eq!(ids_of(&j["generated_ids"]), own_ids);
}

#[test]
fn a_state_dir_writable_by_others_or_owned_by_another_user_is_refused() {
    let sb = Sandbox::new("state-mode");
    let state = sb.dir.join("state");
    std::fs::create_dir(&state).unwrap();
    set_mode(&state, 0o777);
    let r = try_start(&sb, &tiny_model(), &state);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains(path_str(&state)) && r.stderr.contains("0777"),
        "{r:?}"
    );
    assert!(!sb.socket.exists());
    // A parent writable by its group (no sticky bit) could swap the directory: refused too.
    let parent = sb.dir.join("shared");
    std::fs::create_dir(&parent).unwrap();
    set_mode(&parent, 0o770);
    let inner = parent.join("state");
    let r = try_start(&sb, &tiny_model(), &inner);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains(path_str(&parent)), "{r:?}");
    if !is_root() {
        eprintln!("skipping the foreign-owner case: it needs root to chown");
        return;
    }
    set_mode(&state, 0o700);
    std::os::unix::fs::chown(&state, Some(65534), Some(65534)).unwrap();
    let r = try_start(&sb, &tiny_model(), &state);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains(path_str(&state)) && r.stderr.contains("uid 65534"),
        "{r:?}"
    );
}

#[test]
fn state_files_are_private_never_follow_a_planted_link_and_a_fifo_does_not_hang_the_start() {
    let mut sb = Sandbox::new("state-files");
    let state = sb.dir.join("state");
    let prompt = reference_prompt();
    sb.adopt_store(try_start(&sb, &tiny_model(), &state));
    let pid = sb.store_pid().unwrap();
    // A file the store must never write: planted as the link at every temporary name the
    // store used to take (`.NAME.PID.SEQ.tmp`) and at the session's own name.
    let victim = sb.dir.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    for seq in 0..4 {
        std::os::unix::fs::symlink(&victim, state.join(format!(".conv.{pid}.{seq}.tmp"))).unwrap();
    }
    std::os::unix::fs::symlink(&victim, state.join("conv.k3session")).unwrap();
    run(&sb, &prompt, 2, Some("conv"));
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"precious",
        "a planted link was followed"
    );
    let file = state.join("conv.k3session");
    assert!(
        std::fs::symlink_metadata(&file).unwrap().is_file(),
        "the link was replaced by the file"
    );
    assert_eq!(mode(&file), 0o600, "session files are private");
    assert_eq!(mode(&state), 0o700);
    sb.stop_store();

    // A FIFO in place of a state file: the start goes on (it used to block opening it).
    let fifo = state.join("fifo.k3session");
    let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(st.success());
    let sock = path_str(&sb.socket).to_string();
    let start = sb.spawn(
        "k3-store",
        &[
            "start",
            path_str(&tiny_model()),
            "--state-dir",
            path_str(&state),
            "--socket",
            &sock,
            "--detach",
        ],
    );
    let r = start.wait(Duration::from_secs(60));
    let r = sb.adopt_store(r);
    assert!(r.code == 0, "{r:?}");
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert!(
        log.contains("fifo.k3session") && log.contains("not a regular file"),
        "{log}"
    );
    assert!(
        poll_until(Duration::from_secs(5), || sb
            .ctl(&["sessions", "--json"])
            .stdout
            .contains("conv")
            .then_some(()))
        .is_some(),
        "the good session was loaded"
    );
}

#[test]
fn a_forged_state_file_with_a_recomputed_checksum_is_refused() {
    let mut sb = Sandbox::new("state-forged");
    let state = sb.dir.join("state");
    let prompt = reference_prompt();
    let want = reference_greedy();
    sb.adopt_store(try_start(&sb, &tiny_model(), &state));
    run(&sb, &prompt, 4, Some("kept"));
    sb.stop_store();
    // Forge: change the sequence state, recompute the session's checksum (XXH3-64 of every byte
    // before it), keep the file private. A store that trusted the checksum resumed this state
    // and continued with other ids, exit 0.
    let file = state.join("kept.k3session");
    let on_disk = std::fs::read(&file).unwrap();
    let len = (0..=on_disk.len())
        .rev()
        .find(|&n| k3_store::session::parse(&on_disk[..n]).is_ok())
        .expect("the file starts with a session");
    let mut bytes = on_disk[..len].to_vec();
    let state_at = {
        let v = k3_store::session::parse(&bytes).unwrap();
        v.state.as_ptr() as usize - bytes.as_ptr() as usize
    };
    let n = (len - 8 - state_at).min(4096);
    for b in &mut bytes[state_at..state_at + n] {
        *b ^= 0x5a;
    }
    let sum = twox(&bytes[..len - 8]);
    bytes[len - 8..].copy_from_slice(&sum.to_le_bytes());
    assert!(k3_store::session::parse(&bytes).is_ok(), "a valid session");
    for (name, tail) in [("forged", &[][..]), ("kept", &on_disk[len..])] {
        let mut f = bytes.clone();
        f.extend_from_slice(tail);
        let p = state.join(format!("{name}.k3session"));
        std::fs::write(&p, &f).unwrap();
        set_mode(&p, 0o600);
    }
    sb.adopt_store(try_start(&sb, &tiny_model(), &state));
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    for name in ["forged", "kept"] {
        assert!(
            log.contains(&format!("{name}.k3session")) && log.contains("MAC mismatch"),
            "{name}: {log}"
        );
    }
    let prompt2: Vec<u32> = prompt.iter().chain(&want[..4]).copied().collect();
    let (r, j) = run(&sb, &prompt2, 4, Some("kept"));
    assert!(r.stderr.contains("session kept: new"), "{}", r.stderr);
    assert_eq!(ids_of(&j["generated_ids"]), want[4..8]);
}

/// XXH3-64, the session checksum.
fn twox(b: &[u8]) -> u64 {
    k3_store::session::checksum(b)
}
