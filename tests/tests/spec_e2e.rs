//! Speculative decoding end to end (SPEC.md §3.12): real store, real workers, the bundled tiny
//! checkpoint, every run checked against the fixture's reference greedy ids (computed by the
//! float64 reference, not by this engine).

use k3_tests::{
    cache_gb_for_slots, generated_ids as generated, ids_arg, json_u64 as u, path_str,
    reference_greedy, reference_prompt, tiny_model, Sandbox,
};
use serde_json::Value;

/// A worker on the reference prompt (20 greedy ids) with `extra` flags; asserts exit 0 and the
/// reference ids; returns the report.
fn run(sb: &Sandbox, extra: &[&str]) -> Value {
    let ids = ids_arg(&reference_prompt());
    let mut args = vec!["--ids", ids.as_str(), "--gen", "20", "--threads", "1"];
    args.extend_from_slice(extra);
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "worker failed: {r:?}");
    assert_eq!(
        generated(&j),
        reference_greedy(),
        "ids with {extra:?}: {r:?}"
    );
    j
}

#[test]
fn a_repeated_job_drafts_from_the_store_history_with_identical_ids() {
    let mut sb = Sandbox::new("spec-history");
    let trunk = sb.pack_tiny_trunk();
    let model = tiny_model();
    // Three layers pinned, the rest streamed by the worker: a budget where a pass costs reads.
    sb.start_store(&[
        path_str(&model),
        "--trunk",
        path_str(&trunk),
        "--trunk-gb",
        "0.001",
        "--cache-gb",
        "0.01",
    ]);
    let first = run(&sb, &[]);
    let n = reference_greedy().len() as u64;
    // Nothing to draft from yet on a prompt that does not repeat itself: one pass per id.
    assert_eq!(u(&first, "accepted_tokens"), 0, "{first}");
    assert_eq!(u(&first, "forward_passes"), n - 1, "{first}");
    let second = run(&sb, &[]);
    let passes = u(&second, "forward_passes");
    assert!(u(&second, "accepted_tokens") > 0, "{second}");
    assert!(passes < n - 1, "{passes} passes for {n} ids: {second}");
    assert_eq!(passes + u(&second, "accepted_tokens"), n - 1, "{second}");
    assert!(
        u(&second, "trunk_bytes_read") < u(&first, "trunk_bytes_read"),
        "fewer passes read fewer trunk bytes: {} vs {}",
        u(&second, "trunk_bytes_read"),
        u(&first, "trunk_bytes_read")
    );
    let s = sb.stats();
    let h = &s["history"];
    assert_eq!(u(h, "streams"), 2, "{s}");
    assert_eq!(
        u(h, "tokens"),
        2 * (reference_prompt().len() as u64 + n),
        "{s}"
    );
    assert!(u(h, "hits") > 0, "{s}");
    // Per-job figures in `k3-ctl stats`.
    let jobs = s["jobs"].as_array().expect("jobs");
    let last = &jobs.last().expect("a job")["progress"];
    assert_eq!(
        u(last, "accepted_tokens"),
        u(&second, "accepted_tokens"),
        "{s}"
    );
    assert_eq!(u(last, "forward_passes"), passes, "{s}");
    // The same job with speculation off, and with every fixed K: the same ids.
    for k in ["off", "1", "5", "16"] {
        run(&sb, &["--spec", k]);
    }
    sb.stop_store().expect("store running");
}

#[test]
fn a_store_that_keeps_no_history_gives_no_history_drafts() {
    let mut sb = Sandbox::new("spec-nohistory");
    let trunk = sb.pack_tiny_trunk();
    let model = tiny_model();
    sb.start_store(&[
        path_str(&model),
        "--trunk",
        path_str(&trunk),
        "--preset",
        "laptop",
        "--history-ids",
        "0",
    ]);
    run(&sb, &[]);
    let second = run(&sb, &[]);
    assert_eq!(u(&second, "accepted_tokens"), 0, "{second}");
    let h = &sb.stats()["history"];
    assert_eq!(
        (u(h, "streams"), u(h, "tokens"), u(h, "capacity_tokens")),
        (0, 0, 0),
        "{h}"
    );
    sb.stop_store().expect("store running");
}

#[test]
fn history_drafts_give_the_reference_ids_at_every_budget() {
    let mut sb = Sandbox::new("spec-budgets");
    let trunk = sb.pack_tiny_trunk();
    let model = tiny_model();
    // Three tiny-model experts' slots (top-k is 2): a verify pass's union of experts exceeds the
    // cache and is fetched in groups.
    let tiny_cache = cache_gb_for_slots(3);
    let budgets: Vec<Vec<&str>> = vec![
        vec!["--preset", "laptop"],
        vec!["--trunk-gb", "0.001", "--cache-gb", &tiny_cache],
    ];
    for budget in budgets {
        let mut args = vec![path_str(&model), "--trunk", path_str(&trunk)];
        args.extend_from_slice(&budget);
        sb.start_store(&args);
        run(&sb, &["--spec", "off"]);
        for spec in ["auto", "2", "8"] {
            let j = run(&sb, &["--spec", spec]);
            assert!(
                u(&j, "accepted_tokens") > 0,
                "{budget:?} --spec {spec}: {j}"
            );
        }
        let r = sb.stop_store().expect("store running");
        assert_eq!(r.code, 0, "{budget:?}: {r:?}");
    }
}

#[test]
fn standalone_replay_drafts_at_any_miss_rate_give_the_reference_ids() {
    let sb = Sandbox::new("spec-replay");
    let model = tiny_model();
    let cont = sb_file(&sb, "cont.json", &format!("{:?}", reference_greedy()));
    for (miss, k) in [("0", "4"), ("0.5", "auto"), ("1", "2")] {
        let j = run(
            &sb,
            &[
                "--standalone",
                path_str(&model),
                "--draft",
                "replay",
                "--draft-replay",
                &cont,
                "--draft-miss-rate",
                miss,
                "--spec",
                k,
            ],
        );
        if miss == "0" {
            assert!(u(&j, "accepted_tokens") > 0, "{j}");
        }
        if miss == "1" {
            assert_eq!(u(&j, "accepted_tokens"), 0, "{j}");
            assert!(u(&j, "drafted_tokens") > 0, "{j}");
        }
    }
}

fn sb_file(sb: &Sandbox, name: &str, text: &str) -> String {
    let p = sb.dir.join(name);
    std::fs::write(&p, text).expect("write");
    p.to_str().expect("utf-8").to_string()
}

#[test]
fn bad_speculation_flags_are_refused_with_exit_2() {
    let sb = Sandbox::new("spec-flags");
    let model = tiny_model();
    let m = path_str(&model);
    let bad = sb_file(&sb, "bad.txt", "1, 2, x");
    let good = sb_file(&sb, "good.txt", "1 2 3");
    let cases: Vec<Vec<&str>> = vec![
        vec!["--spec", "17"],
        vec!["--spec", "sometimes"],
        vec!["--spec", "2", "--full-recompute"],
        vec!["--draft", "replay"],
        vec!["--draft-replay", &good],
        vec!["--draft", "replay", "--draft-replay", &bad],
        vec!["--draft", "replay", "--draft-replay", "/nonexistent/ids"],
        vec![
            "--draft",
            "replay",
            "--draft-replay",
            &good,
            "--draft-miss-rate",
            "1.5",
        ],
        vec!["--draft", "psychic"],
    ];
    for extra in cases {
        let mut args = vec!["--standalone", m, "--ids", "1,2,3", "--gen", "2"];
        args.extend_from_slice(&extra);
        let r = sb.run("k3-worker", &args);
        assert_eq!(r.code, 2, "{extra:?}: {r:?}");
        assert!(!r.stderr.contains("panicked"), "{extra:?}: {r:?}");
    }
}

/// Pack the tiny model's draft trunk of `kind` into the sandbox (`k3-ctl pack-trunk --draft`).
fn pack_draft(sb: &Sandbox, kind: &str) -> String {
    let out = sb.dir.join(format!("draft-{kind}"));
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            "--draft",
            kind,
            path_str(&tiny_model()),
            path_str(&out),
        ],
    );
    assert_eq!(r.code, 0, "pack-trunk --draft {kind}: {r:?}");
    path_str(&out).to_string()
}

#[test]
fn a_draft_model_gives_the_reference_ids_standalone_and_attached() {
    let mut sb = Sandbox::new("spec-draft");
    let model = tiny_model();
    let m = path_str(&model);
    let int8 = pack_draft(&sb, "int8");
    let int4 = pack_draft(&sb, "int4");
    // The draft runs the experts the cache holds (all of them with the default budget) or the
    // shared experts alone; fixed K and auto. Every run must give the reference
    // ids; with every expert resident, the int8 draft of this model agrees with it often enough
    // that some drafts are accepted (a broken draft model — wrong bytes, a wrong kernel, a state
    // that is not put back — agrees with it about 1 time in 256, the vocabulary).
    let mut accepted = 0;
    for (draft, experts, spec) in [
        (&int8, "resident", "4"),
        (&int8, "resident", "auto"),
        (&int8, "shared", "2"),
        (&int4, "resident", "8"),
        (&int4, "shared", "auto"),
    ] {
        let j = run(
            &sb,
            &[
                "--standalone",
                m,
                "--draft",
                "model",
                "--draft-trunk",
                draft,
                "--draft-experts",
                experts,
                "--spec",
                spec,
            ],
        );
        assert_eq!(
            u(&j, "forward_passes") + u(&j, "accepted_tokens"),
            reference_greedy().len() as u64 - 1,
            "{j}"
        );
        if spec != "auto" {
            assert!(u(&j, "drafted_tokens") > 0, "{draft} {experts}: {j}");
            // Its cost is reported: at least one forward call per drafted id.
            let calls = u(&j["draft_model"], "forward_calls");
            assert!(calls >= u(&j, "drafted_tokens"), "{j}");
        }
        if draft == &int8 && experts == "resident" && spec == "4" {
            accepted = u(&j, "accepted_tokens");
        }
    }
    assert!(
        accepted >= 3,
        "int8 draft with every expert accepted {accepted}"
    );
    // Attached: a draft the worker loads itself, and the store's own (its runs in shared
    // memory: this worker allocates no trunk for it). The draft leases the experts resident in
    // the store (`ResidentExperts`).
    let trunk = sb.pack_tiny_trunk();
    let t = path_str(&trunk);
    let budget = ["--trunk-gb", "0.001", "--cache-gb", "0.01"];
    let mut args = vec![m, "--trunk", t];
    args.extend_from_slice(&budget);
    sb.start_store(&args);
    for spec in ["off", "4"] {
        run(
            &sb,
            &["--draft", "model", "--draft-trunk", &int8, "--spec", spec],
        );
    }
    // Without --draft-trunk the job needs the store's, and this store holds none.
    let ids = ids_arg(&reference_prompt());
    let r = sb.worker(&[
        "--ids", &ids, "--gen", "3", "--draft", "model", "--spec", "2",
    ]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("holds no draft trunk"), "{r:?}");
    sb.stop_store().expect("store running");
    args.extend_from_slice(&["--draft-trunk", &int8]);
    sb.start_store(&args);
    let status = sb.ctl(&["status"]);
    assert!(status.stdout.contains("int8 draft trunk"), "{status:?}");
    // The first job fills the cache; then the draft runs every routed expert from it, and
    // its leases are not requests: the store counts only the job's own.
    run(&sb, &["--spec", "off"]);
    let requests = |sb: &Sandbox| {
        let s = sb.stats();
        (u(&s["lifetime"], "requests"), u(&s["lifetime"], "misses"))
    };
    for spec in ["4", "auto"] {
        let before = requests(&sb);
        let j = run(&sb, &["--draft", "model", "--spec", spec]);
        let after = requests(&sb);
        assert_eq!(after.0 - before.0, u(&j, "expert_requests"), "{j}");
        assert_eq!(
            after.1 - before.1,
            u(&j, "expert_requests") - u(&j, "resident_hits")
        );
        if spec == "4" {
            // As standalone with every expert resident (above).
            assert!(u(&j, "accepted_tokens") >= 3, "{j}");
        }
    }
    sb.stop_store().expect("store running");
}

#[test]
fn a_foreign_or_damaged_draft_trunk_is_refused_with_exit_2() {
    let sb = Sandbox::new("spec-draft-bad");
    let model = tiny_model();
    let m = path_str(&model);
    let good = pack_draft(&sb, "int8");
    let worker = |draft: &str| {
        sb.run(
            "k3-worker",
            &[
                "--standalone",
                m,
                "--ids",
                "1,2,3",
                "--gen",
                "4",
                "--spec",
                "2",
                "--draft",
                "model",
                "--draft-trunk",
                draft,
            ],
        )
    };
    // Flags without their partner.
    for extra in [
        vec!["--draft", "model"],
        vec!["--draft-trunk", good.as_str()],
    ] {
        let mut args = vec!["--standalone", m, "--ids", "1,2,3", "--gen", "2"];
        args.extend_from_slice(&extra);
        let r = sb.run("k3-worker", &args);
        assert_eq!(r.code, 2, "{extra:?}: {r:?}");
    }
    // Not a draft trunk at all.
    let r = worker("/nonexistent/draft");
    assert_eq!(r.code, 2, "{r:?}");
    // One flipped byte in a run: the layer's checksum refuses it.
    let copy = |name: &str| {
        let dir = sb.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["draft.bin", "draft.json"] {
            std::fs::copy(std::path::Path::new(&good).join(f), dir.join(f)).unwrap();
        }
        dir
    };
    let damaged = copy("damaged");
    let mut bin = std::fs::read(damaged.join("draft.bin")).unwrap();
    bin[300] ^= 0x40;
    std::fs::write(damaged.join("draft.bin"), bin).unwrap();
    let r = worker(path_str(&damaged));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("checksum"), "{r:?}");
    // Another checkpoint's draft (its identity differs).
    let foreign = copy("foreign");
    let json = std::fs::read_to_string(foreign.join("draft.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let id = v["model"]["model_id"].as_str().unwrap().to_string();
    let other = format!(
        "{}{}",
        if id.starts_with('1') { "2" } else { "1" },
        &id[1..]
    );
    std::fs::write(foreign.join("draft.json"), json.replace(&id, &other)).unwrap();
    let r = worker(path_str(&foreign));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains(&id) && r.stderr.contains(&other), "{r:?}");
    assert!(!r.stderr.contains("panicked"), "{r:?}");
    // The store refuses the same drafts at start (exit 2), before it serves anything.
    let socket = sb.dir.join("refuse.sock");
    for (draft, says) in [
        (path_str(&damaged), "checksum"),
        (path_str(&foreign), id.as_str()),
        ("/nonexistent/draft", "draft.json"),
    ] {
        let r = sb.run(
            "k3-store",
            &[
                "start",
                m,
                "--draft-trunk",
                draft,
                "--socket",
                path_str(&socket),
            ],
        );
        assert_eq!(r.code, 2, "{draft}: {r:?}");
        assert!(r.stderr.contains(says), "{draft}: {r:?}");
        assert!(!socket.exists(), "{draft}: the socket was left behind");
    }
}

#[test]
fn a_long_auto_run_with_a_draft_model_gives_the_plain_ids() {
    // 300 ids: auto mode probes the (costly) draft model ever more rarely, so it falls more
    // than MAX_CATCH_UP ids behind and restarts on the last ones. Whatever the draft does, the
    // ids are those of plain decoding.
    let sb = Sandbox::new("spec-draft-long");
    let model = tiny_model();
    let m = path_str(&model);
    let int8 = pack_draft(&sb, "int8");
    let ids = ids_arg(&reference_prompt());
    let job = |extra: &[&str]| {
        let mut args = vec!["--standalone", m, "--ids", ids.as_str(), "--gen", "300"];
        args.extend_from_slice(extra);
        let (r, j) = sb.worker_json(&args);
        assert_eq!(r.code, 0, "{r:?}");
        j
    };
    let plain = job(&["--spec", "off"]);
    let spec = job(&["--spec", "auto", "--draft", "model", "--draft-trunk", &int8]);
    assert_eq!(generated(&spec), generated(&plain));
    assert_eq!(generated(&plain).len(), 300);
    assert!(u(&spec, "drafted_tokens") > 0, "{spec}");
}
