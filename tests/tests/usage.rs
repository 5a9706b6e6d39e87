//! The store's expert usage history and the hot preload (issue 48 item 3), with real processes
//! and real files: the counts survive a clean restart and a `kill -9` (at any moment: the file is
//! the previous one or the new one, never torn, and at most the counting since the last save is
//! lost); a usage file that is damaged, truncated, sealed under another key or made for another
//! model is refused like a refused session (a log line, the store starts with a new history and
//! leaves the file as it is until its first save); a restarted store fills its cache with the
//! most used experts, never more than it holds, `k3-ctl stats` says so, and the ids are those of
//! a store without it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use k3_tests::{
    cache_gb_for_slots, generated_ids, ids_arg, path_str, poll_until, reference_greedy,
    reference_prompt, tiny_model, tiny_with_seed, Run, Sandbox,
};
use serde_json::Value;

/// Expert slots of the stores here: fewer than the tiny model's 96 routed experts.
const SLOTS: u64 = 10;
/// The usage file in a state directory.
const USAGE_FILE: &str = "expert-usage.k3usage";

/// `k3-store start MODEL --state-dir STATE` with a cache of [`SLOTS`] slots, saving every 0.05 s.
fn start(sb: &mut Sandbox, model: &Path, state: &Path, extra: &[&str]) -> Run {
    let cache = cache_gb_for_slots(SLOTS);
    let mut args = vec![
        path_str(model),
        "--state-dir",
        path_str(state),
        "--trunk-gb",
        "1",
        "--cache-gb",
        &cache,
        "--usage-save-seconds",
        "0.1",
    ];
    args.extend_from_slice(extra);
    sb.start_store(&args)
}

/// An attached job of the reference prompt, `--gen 20`, no speculation and no router lookahead
/// (its demands then do not depend on timing); asserts exit 0 and the reference ids.
fn job(sb: &Sandbox) -> Value {
    let out = sb.dir.join(format!("job-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let ids = ids_arg(&reference_prompt());
    let args = [
        "--ids",
        &ids,
        "--gen",
        "20",
        "--spec",
        "off",
        "--socket",
        path_str(&sb.socket),
        "--out",
        path_str(&out),
    ];
    let mut c = sb.command("k3-worker", &args);
    c.env("K3_LOOKAHEAD", "off");
    let r = sb.run_command(c);
    assert_eq!(r.code, 0, "worker failed: {r:?}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(
        generated_ids(&v),
        reference_greedy(),
        "the ids depend on what is resident"
    );
    v
}

fn u64_of(v: &Value, path: &[&str]) -> u64 {
    let mut x = v;
    for k in path {
        x = &x[*k];
    }
    x.as_u64()
        .unwrap_or_else(|| panic!("no integer at {path:?} in {v}"))
}

/// Wait until every counted request is on disk; returns the stats then.
fn saved(sb: &Sandbox) -> Value {
    poll_until(Duration::from_secs(10), || {
        let s = sb.stats();
        (u64_of(&s, &["usage", "requests_saved"]) == u64_of(&s, &["usage", "requests_counted"]))
            .then_some(s)
    })
    .expect("the usage history was saved within 10 s")
}

fn private_dir(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700)).unwrap();
}

fn write_private(p: &Path, bytes: &[u8]) {
    std::fs::write(p, bytes).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[test]
fn usage_survives_a_restart_and_a_kill_9_and_the_restarted_store_preloads_the_most_used() {
    let mut sb = Sandbox::new("usage-restart");
    let state = sb.dir.join("state");
    let tiny = tiny_model();
    start(&mut sb, &tiny, &state, &[]);
    let s = sb.stats();
    assert_eq!(s["usage"]["preload"], "none", "no history yet: {s}");
    assert_eq!(u64_of(&s, &["lifetime", "preloaded_experts"]), 0);
    let cold = job(&sb);
    let s = sb.stats();
    let first = u64_of(&s, &["usage", "requests_counted"]);
    // What counts is the demands: every expert the job's requests named.
    assert_eq!(first, u64_of(&s, &["lifetime", "requests"]));
    assert!(first > 0);
    let used = u64_of(&s, &["usage", "experts_used"]);
    assert!(
        used > SLOTS,
        "the job uses more experts than the cache holds: {s}"
    );
    sb.stop_store();

    // A clean restart: everything counted is loaded; the cache is filled with the most used
    // experts, as many as it holds.
    start(&mut sb, &tiny, &state, &[]);
    let s = sb.stats();
    assert_eq!(u64_of(&s, &["usage", "requests_at_start"]), first, "{s}");
    assert_eq!(s["usage"]["preload"], "hot");
    assert_eq!(u64_of(&s, &["usage", "hot_preloaded"]), SLOTS);
    assert_eq!(u64_of(&s, &["lifetime", "preloaded_experts"]), SLOTS);
    assert_eq!(
        (u64_of(&s, &["slots_used"]), u64_of(&s, &["slots_total"])),
        (SLOTS, SLOTS),
        "never more than the cache holds"
    );
    assert_eq!(
        u64_of(&s, &["lifetime", "requests"]),
        0,
        "a preload is not a demand"
    );
    // The same job: the same ids (it changes what is resident, never an answer), and the hits
    // the preload gave are counted, for the job and for the store.
    let hot = job(&sb);
    let s = sb.stats();
    let preload_hits = u64_of(&s, &["lifetime", "preload_hits"]);
    assert!(
        preload_hits > 0,
        "the most used experts were asked for again: {s}"
    );
    assert!(preload_hits <= u64_of(&s, &["lifetime", "resident_hits"]));
    let jobs = s["jobs"].as_array().unwrap();
    assert_eq!(
        u64_of(&jobs[0], &["counters", "preload_hits"]),
        preload_hits
    );
    assert!(
        hot["true_resident_hit_rate"].as_f64() >= cold["true_resident_hit_rate"].as_f64(),
        "the first job after a restart hits at least as often with the history: cold {} hot {}",
        cold["true_resident_hit_rate"],
        hot["true_resident_hit_rate"]
    );
    let text = sb.ctl(&["stats"]);
    assert_eq!(text.code, 0, "{text:?}");
    assert!(
        text.stdout.contains(&format!(
            "preload:  {SLOTS} experts (0.07 MB) read at start-up in"
        )) && text.stdout.contains("the most used of the usage history")
            && text
                .stdout
                .contains(&format!("{preload_hits} TRUE hits on them so far")),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .contains(&format!("{first} in the history at start")),
        "{}",
        text.stdout
    );

    // kill -9 once everything is saved: nothing is lost.
    let s = saved(&sb);
    let both = first + u64_of(&s, &["usage", "requests_counted"]);
    sb.signal_store("KILL");
    start(&mut sb, &tiny, &state, &[]);
    assert_eq!(u64_of(&sb.stats(), &["usage", "requests_at_start"]), both);
    sb.stop_store();

    // kill -9 at arbitrary moments of a long job (saves every 0.1 s): every restart loads the
    // file (never torn), and the history only grows.
    let mut last = both;
    for wait_ms in [120, 260, 410, 590, 730] {
        start(&mut sb, &tiny, &state, &[]);
        let s = sb.stats();
        assert_eq!(s["usage"]["refused"], "", "{s}");
        let at_start = u64_of(&s, &["usage", "requests_at_start"]);
        assert!(at_start >= last, "{at_start} < {last}");
        last = at_start;
        let w = sb.spawn_long_worker_env(&[("K3_LOOKAHEAD", "off")]);
        std::thread::sleep(Duration::from_millis(wait_ms));
        sb.signal_store("KILL");
        w.kill9();
    }
    start(&mut sb, &tiny, &state, &[]);
    let s = sb.stats();
    assert_eq!(s["usage"]["refused"], "", "{s}");
    assert!(
        u64_of(&s, &["usage", "requests_at_start"]) > both,
        "the long jobs' counting was saved: {s}"
    );
    let leftovers: Vec<String> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "interrupted saves cleaned up: {leftovers:?}"
    );
    sb.stop_store();

    // Without the preload the ids are the same (job() checks them), and the store says so.
    start(&mut sb, &tiny, &state, &["--preload", "off"]);
    let s = sb.stats();
    assert_eq!(
        (s["usage"]["preload"].as_str(), u64_of(&s, &["slots_used"])),
        (Some("none"), 0)
    );
    job(&sb);
}

#[test]
fn a_damaged_truncated_wrong_key_or_foreign_usage_file_is_refused_like_a_foreign_session() {
    let mut sb = Sandbox::new("usage-refused");
    let tiny = tiny_model();
    let state = sb.dir.join("state");
    start(&mut sb, &tiny, &state, &[]);
    job(&sb);
    sb.stop_store();
    let file = state.join(USAGE_FILE);
    let good = std::fs::read(&file).unwrap();

    // The same model's history in another state directory: another key.
    let other_key = sb.dir.join("other-key");
    start(&mut sb, &tiny, &other_key, &[]);
    job(&sb);
    sb.stop_store();
    // Another model (same shape, other weights) whose directory holds this one's key: its
    // file's MAC is made with the right key, over its own identity.
    let seed2 = tiny_with_seed(&sb.dir, 2);
    let other_model = sb.dir.join("other-model");
    private_dir(&other_model);
    write_private(
        &other_model.join(".k3-state-key"),
        &std::fs::read(state.join(".k3-state-key")).unwrap(),
    );
    // One job there, so that it saves a file (the reference ids are tiny's, not seed 2's: any
    // prompt makes demands).
    start(&mut sb, &seed2, &other_model, &[]);
    let ids = ids_arg(&reference_prompt());
    let r = sb.worker(&["--ids", &ids, "--gen", "4"]);
    assert_eq!(r.code, 0, "{r:?}");
    sb.stop_store();
    let seed2_identity = std::fs::read_to_string(other_model.join(".k3-state-model")).unwrap();

    let mut flipped = good.clone();
    flipped[64 + 4 * 9] ^= 1;
    let cases: Vec<(&str, Vec<u8>, String)> = vec![
        ("flipped byte", flipped, "MAC mismatch".into()),
        (
            "truncated",
            good[..good.len() - 1].to_vec(),
            "truncated".into(),
        ),
        (
            "another key",
            std::fs::read(other_key.join(USAGE_FILE)).unwrap(),
            "MAC mismatch".into(),
        ),
        (
            "another model",
            std::fs::read(other_model.join(USAGE_FILE)).unwrap(),
            format!("made for model {}", seed2_identity.trim()),
        ),
    ];
    for (what, bytes, why) in cases {
        write_private(&file, &bytes);
        start(&mut sb, &tiny, &state, &[]);
        let log = std::fs::read_to_string(sb.store_log()).unwrap();
        assert!(
            log.lines().any(|l| l.contains("expert usage: refusing")
                && l.contains(path_str(&file))
                && l.contains(&why)),
            "{what}: {log}"
        );
        let s = sb.stats();
        assert!(
            s["usage"]["refused"].as_str().unwrap().contains(&why),
            "{what}: {s}"
        );
        // The store started without it: no history, nothing preloaded.
        assert_eq!(u64_of(&s, &["usage", "requests_at_start"]), 0, "{what}");
        assert_eq!(s["usage"]["preload"], "none", "{what}");
        assert_eq!(u64_of(&s, &["lifetime", "preloaded_experts"]), 0, "{what}");
        sb.stop_store();
        assert_eq!(
            std::fs::read(&file).unwrap(),
            bytes,
            "{what}: left as it is while nothing was counted"
        );
    }
    // A job after a refusal: the new history replaces the file, and the next start loads it.
    start(&mut sb, &tiny, &state, &[]);
    job(&sb);
    let counted = u64_of(&sb.stats(), &["usage", "requests_counted"]);
    sb.stop_store();
    start(&mut sb, &tiny, &state, &[]);
    let s = sb.stats();
    assert_eq!(s["usage"]["refused"], "", "{s}");
    assert_eq!(u64_of(&s, &["usage", "requests_at_start"]), counted);
}

#[test]
fn preload_hot_without_a_history_to_keep_is_refused() {
    let sb = Sandbox::new("usage-hot-refused");
    let sock = path_str(&sb.socket).to_string();
    let tiny = tiny_model();
    let r = sb.run(
        "k3-store",
        &[
            "start",
            path_str(&tiny),
            "--preload",
            "hot",
            "--socket",
            &sock,
            "--detach",
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("--preload hot") && r.stderr.contains("--state-dir"),
        "{r:?}"
    );
    assert!(!sb.socket.exists());
    let ids = ids_arg(&reference_prompt());
    let r = sb.run(
        "k3-worker",
        &[
            "--standalone",
            path_str(&tiny),
            "--preload",
            "hot",
            "--ids",
            &ids,
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("standalone"), "{r:?}");
}
