//! Multi-process end-to-end tests: a real `k3-store` daemon, real `k3-worker` jobs and `k3-ctl`,
//! each test in its own [`Sandbox`] (own directory, socket and store) on the bundled tiny
//! checkpoint. Every generation is checked against the fixture's reference greedy ids.

use std::path::Path;
use std::time::Duration;

use k3_tests::{
    cache_gb_for_slots, gb_arg, generated_ids as generated, ids_arg, json_u64 as u, live_job,
    path_str, pid_gone, poll_until, printed_ids, reference_greedy, reference_prompt, tiny_model,
    trunk_budget_pinning, trunk_layer_bufs, Run, Sandbox, TINY_EXPERT_BYTES as EXPERT_BYTES,
};
use serde_json::Value;

/// Experts per token in the tiny model.
const TOP_K: u64 = 2;

/// Attached worker on the reference prompt, 20 greedy tokens; asserts exit 0 and the reference
/// ids (in the report and on stdout). Returns the report.
fn reference_run(sb: &Sandbox, extra: &[&str]) -> Value {
    let ids = ids_arg(&reference_prompt());
    let mut args = vec!["--ids", ids.as_str(), "--gen", "20", "--threads", "1"];
    args.extend_from_slice(extra);
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "worker failed: {r:?}");
    assert_eq!(generated(&j), reference_greedy(), "report ids: {r:?}");
    assert_eq!(printed_ids(&r), reference_greedy(), "printed ids");
    j
}

/// `k3-worker --standalone` with the given budget flags on the reference prompt; returns its ids.
fn standalone_ids(sb: &Sandbox, trunk: &Path, budget: &[&str]) -> (Vec<u32>, Value) {
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
        "1",
    ];
    args.extend_from_slice(budget);
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "standalone worker failed: {r:?}");
    (generated(&j), j)
}

/// Stats once every worker job has disconnected and `n` jobs are listed (the disconnect is
/// processed asynchronously by the store's connection thread).
fn stats_after_jobs(sb: &Sandbox, n: usize) -> Value {
    poll_until(Duration::from_secs(10), || {
        let s = sb.stats();
        let jobs = s["jobs"].as_array().expect("jobs").clone();
        (jobs.len() == n && jobs.iter().all(|j| j["live"] == false)).then_some(s)
    })
    .unwrap_or_else(|| panic!("store never showed {n} finished jobs: {}", sb.stats()))
}

fn start_tiny(sb: &mut Sandbox, trunk: &Path, budget: &[&str]) -> Run {
    let model = tiny_model();
    let mut args = vec![path_str(&model), "--trunk", path_str(trunk)];
    args.extend_from_slice(budget);
    sb.start_store(&args)
}

// ---------------------------------------------------------------------------------------------

#[test]
fn second_worker_finds_everything_resident_and_stats_add_up() {
    let mut sb = Sandbox::new("seq");
    let trunk = sb.pack_tiny_trunk();
    // Without a preload the first job reads its experts and leaves them for the second
    // (`a_store_whose_arena_holds_every_expert_reads_them_before_serving` has the preload).
    start_tiny(&mut sb, &trunk, &["--preset", "laptop", "--preload", "off"]);
    let s0 = sb.stats();
    assert_eq!(
        u(&s0, "pinned_layers"),
        13,
        "laptop pins every tiny layer: {s0}"
    );

    // Plain decoding: the second job would otherwise draft from the first one's token stream
    // (tests/tests/spec_e2e.rs) and request a different union of experts per pass.
    let a = reference_run(&sb, &["--spec", "off"]);
    let b = reference_run(&sb, &["--spec", "off"]);
    // Every trunk layer is pinned in shared memory: neither worker reads trunk bytes.
    assert_eq!(u(&a, "trunk_bytes_read"), 0, "{a}");
    assert_eq!(u(&b, "trunk_bytes_read"), 0, "{b}");
    // The first job loaded experts; the second found every one resident.
    assert!(u(&a, "expert_bytes_read") > 0, "{a}");
    assert!(u(&a, "resident_hits") < u(&a, "expert_requests"), "{a}");
    // (The router lookahead may still read ahead an expert that no request has needed yet —
    // its prefetch in the first job can be superseded and dropped — but no request reads.)
    assert_eq!(
        u(&b, "expert_bytes_read") - u(&b["lookahead"], "prefetched_bytes"),
        0,
        "{b}"
    );
    assert_eq!(u(&b, "resident_hits"), u(&b, "expert_requests"), "{b}");
    assert_eq!(b["true_resident_hit_rate"].as_f64(), Some(1.0), "{b}");
    assert_eq!(u(&a, "expert_requests"), u(&b, "expert_requests"));

    let s = stats_after_jobs(&sb, 2);
    let jobs = s["jobs"].as_array().unwrap();
    for (job, rep) in jobs.iter().zip([&a, &b]) {
        let c = &job["counters"];
        assert_eq!(
            u(c, "requests"),
            u(rep, "expert_requests"),
            "{job} vs {rep}"
        );
        assert_eq!(
            u(c, "resident_hits"),
            u(rep, "resident_hits"),
            "{job} vs {rep}"
        );
        assert_eq!(
            u(c, "misses"),
            u(rep, "expert_requests") - u(rep, "resident_hits")
        );
        assert_eq!(
            u(c, "expert_bytes_read"),
            u(rep, "expert_bytes_read"),
            "{job}"
        );
        assert_eq!(
            u(c, "trunk_bytes_read"),
            u(rep, "trunk_bytes_read"),
            "{job}"
        );
        assert_eq!(u(c, "failed_loads"), 0);
    }
    assert_eq!(u(&jobs[1]["counters"], "misses"), 0);
    let l = &s["lifetime"];
    let sum = |k: &str| jobs.iter().map(|j| u(&j["counters"], k)).sum::<u64>();
    for k in ["requests", "resident_hits", "misses", "expert_bytes_read"] {
        assert_eq!(u(l, k), sum(k), "lifetime {k} = sum of jobs: {s}");
    }
    // A read the ring made ahead that no job used is the store's, not a job's.
    assert!(u(l, "trunk_bytes_read") >= sum("trunk_bytes_read"), "{s}");
    assert_eq!(
        u(l, "evictions"),
        0,
        "the laptop cache holds every tiny expert"
    );
    assert_eq!(
        u(&s, "slots_leased"),
        0,
        "finished jobs hold no leases: {s}"
    );
    assert_eq!(u(&s, "workers"), 0);
    let r = sb.stop_store().expect("store was running");
    assert_eq!(r.code, 0, "{r:?}");
}

/// Routed experts of the tiny model: 12 MoE layers (layer 0 is dense) of 8.
const TINY_ROUTED: u64 = 12 * 8;

#[test]
fn a_store_whose_arena_holds_every_expert_reads_them_before_serving() {
    let mut sb = Sandbox::new("preload");
    let trunk = sb.pack_tiny_trunk();
    // The laptop preset's cache holds every tiny expert: `--preload auto` (the default) reads
    // them all before the store is ready.
    start_tiny(&mut sb, &trunk, &["--preset", "laptop"]);
    let s0 = sb.stats();
    let l0 = &s0["lifetime"];
    assert_eq!(u(l0, "preloaded_experts"), TINY_ROUTED, "{s0}");
    assert_eq!(u(l0, "preload_bytes"), TINY_ROUTED * EXPERT_BYTES, "{s0}");
    assert_eq!(u(&s0, "slots_used"), TINY_ROUTED, "{s0}");
    // Start-up reads are not requests: nothing requested, nothing read for a request yet.
    for k in ["requests", "misses", "expert_bytes_read", "prefetch_loads"] {
        assert_eq!(u(l0, k), 0, "{k}: {s0}");
    }
    let text = sb.ctl(&["stats"]);
    assert!(
        text.stdout.contains("preload:  96 experts"),
        "k3-ctl stats shows the preload: {text:?}"
    );

    // The first job already finds every expert resident, with the reference ids.
    let a = reference_run(&sb, &["--spec", "off"]);
    assert_eq!(u(&a, "expert_bytes_read"), 0, "{a}");
    assert!(u(&a, "expert_requests") > 0, "{a}");
    assert_eq!(u(&a, "resident_hits"), u(&a, "expert_requests"), "{a}");
    assert_eq!(u(&a["lookahead"], "prefetched_experts"), 0, "{a}");
    let s = stats_after_jobs(&sb, 1);
    assert_eq!(u(&s["lifetime"], "evictions"), 0, "{s}");
    assert_eq!(
        u(&s["lifetime"], "resident_hits"),
        u(&s["lifetime"], "requests"),
        "TRUE hits are every request: {s}"
    );
    let r = sb.stop_store().expect("store was running");
    assert_eq!(r.code, 0, "{r:?}");

    // Standalone: the same ids with the preload on and off; only the preloaded run reads
    // nothing while generating.
    let (ids_auto, auto) = standalone_ids(&sb, &trunk, &["--preset", "laptop"]);
    let (ids_off, off) = standalone_ids(&sb, &trunk, &["--preset", "laptop", "--preload", "off"]);
    assert_eq!(ids_auto, reference_greedy());
    assert_eq!(ids_off, reference_greedy());
    assert_eq!(u(&auto["preload"], "experts"), TINY_ROUTED, "{auto}");
    assert_eq!(u(&auto, "expert_bytes_read"), 0, "{auto}");
    assert_eq!(auto["true_resident_hit_rate"].as_f64(), Some(1.0), "{auto}");
    assert_eq!(u(&off["preload"], "experts"), 0, "{off}");
    assert!(u(&off, "expert_bytes_read") > 0, "{off}");

    // `--preload on` with a cache that cannot hold every expert is refused before any work,
    // by the store and by a standalone worker; `auto` then reads on demand as before.
    let small = cache_gb_for_slots(TOP_K + 1);
    let budget = ["--preset", "laptop", "--cache-gb", small.as_str()];
    let model = tiny_model();
    let mut args = vec!["start", path_str(&model), "--trunk", path_str(&trunk)];
    args.extend_from_slice(&budget);
    args.extend_from_slice(&[
        "--preload",
        "on",
        "--socket",
        path_str(&sb.socket),
        "--detach",
    ]);
    let r = sb.run("k3-store", &args);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.stderr.contains("--preload on") && r.stderr.contains("96 routed experts"),
        "{r:?}"
    );
    assert!(!sb.socket.exists(), "a refused start leaves no socket");
    let ids = ids_arg(&reference_prompt());
    let mut w = vec![
        "--standalone",
        path_str(&model),
        "--trunk",
        path_str(&trunk),
    ];
    w.extend_from_slice(&budget);
    w.extend_from_slice(&["--ids", &ids, "--gen", "2", "--preload", "on"]);
    let (r, _) = sb.worker_json(&w);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--preload on"), "{r:?}");
    let (ids_small, small_run) = standalone_ids(&sb, &trunk, &budget);
    assert_eq!(ids_small, reference_greedy());
    assert_eq!(u(&small_run["preload"], "experts"), 0, "{small_run}");
}

#[test]
fn attached_ids_equal_standalone_ids_at_every_budget() {
    let mut sb = Sandbox::new("budgets");
    let trunk = sb.pack_tiny_trunk();
    let bufs = trunk_layer_bufs(&trunk);
    assert_eq!(bufs.len(), 13);
    let prefix = 3;
    let prefix_budget = gb_arg(trunk_budget_pinning(&bufs, prefix));
    let none_budget = gb_arg(trunk_budget_pinning(&bufs, 0));
    let tiny_cache = cache_gb_for_slots(TOP_K + 1);
    let cases: Vec<(&str, Vec<&str>, u64, Option<u64>)> = vec![
        ("everything pinned", vec!["--preset", "laptop"], 13, None),
        (
            "prefix pinned",
            vec!["--trunk-gb", &prefix_budget, "--cache-gb", "0.01"],
            prefix as u64,
            None,
        ),
        (
            "nothing pinned, tiny cache",
            vec!["--trunk-gb", &none_budget, "--cache-gb", &tiny_cache],
            0,
            Some(TOP_K + 1),
        ),
    ];
    let reference = reference_greedy();
    for (what, budget, pinned, slots) in cases {
        let (solo, solo_rep) = standalone_ids(&sb, &trunk, &budget);
        assert_eq!(solo, reference, "{what}: standalone ids");
        start_tiny(&mut sb, &trunk, &budget);
        let s = sb.stats();
        assert_eq!(u(&s, "pinned_layers"), pinned, "{what}: {s}");
        if let Some(n) = slots {
            assert_eq!(u(&s, "slots_total"), n, "{what}: {s}");
        }
        let rep = reference_run(&sb, &[]);
        assert_eq!(
            generated(&rep),
            solo,
            "{what}: attached ids == standalone ids"
        );
        let streamed = u(&rep, "trunk_bytes_read");
        if pinned == 13 {
            assert_eq!(streamed, 0, "{what}: {rep}");
        } else {
            // The unpinned layers are streamed by the worker itself, once per forward pass.
            let unpinned: u64 = bufs[pinned as usize..].iter().sum();
            assert!(
                streamed >= unpinned,
                "{what}: streamed {streamed} < {unpinned}"
            );
            assert!(u(&solo_rep, "trunk_bytes_read") > 0, "{what}: {solo_rep}");
        }
        if slots.is_some() {
            let st = stats_after_jobs(&sb, 1);
            assert!(
                u(&st["lifetime"], "evictions") > 0,
                "{what}: a {}-slot cache must evict: {st}",
                TOP_K + 1
            );
            assert!(u(&rep, "expert_bytes_read") > 0);
        }
        let r = sb.stop_store().expect("store running");
        assert_eq!(r.code, 0, "{what}: {r:?}");
    }
}

#[test]
fn two_concurrent_workers_get_identical_ids() {
    let mut sb = Sandbox::new("concurrent");
    let trunk = sb.pack_tiny_trunk();
    // A small cache so the two jobs contend for slots (evictions, waits on leased slots).
    let cache = cache_gb_for_slots(4);
    start_tiny(
        &mut sb,
        &trunk,
        &["--preset", "laptop", "--cache-gb", &cache],
    );
    let (a, b) = std::thread::scope(|s| {
        let ta = s.spawn(|| reference_run(&sb, &[]));
        let tb = s.spawn(|| reference_run(&sb, &[]));
        (ta.join().expect("worker a"), tb.join().expect("worker b"))
    });
    assert_eq!(generated(&a), generated(&b));
    let s = stats_after_jobs(&sb, 2);
    let total: u64 = s["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| u(&j["counters"], "requests"))
        .sum();
    assert_eq!(total, u(&a, "expert_requests") + u(&b, "expert_requests"));
    assert_eq!(u(&s["lifetime"], "requests"), total);
    assert_eq!(u(&s, "slots_leased"), 0, "{s}");
}

#[test]
fn workers_killed_mid_generation_release_their_leases() {
    let mut sb = Sandbox::new("kill");
    let trunk = sb.pack_tiny_trunk();
    // Nothing pinned and a 3-slot cache: every layer leases and evicts.
    let bufs = trunk_layer_bufs(&trunk);
    let none_budget = gb_arg(trunk_budget_pinning(&bufs, 0));
    let cache = cache_gb_for_slots(TOP_K + 1);
    start_tiny(
        &mut sb,
        &trunk,
        &["--trunk-gb", &none_budget, "--cache-gb", &cache],
    );
    for round in 0..4 {
        let w = sb.spawn_long_worker();
        let pid = w.pid();
        // Wait until it is mid-generation and holding leases.
        let seen = poll_until(Duration::from_secs(15), || {
            let s = sb.stats();
            let j = live_job(&s, pid)?;
            (j["live"] == true && u(&j["counters"], "requests") > 0 && u(&s, "slots_leased") > 0)
                .then_some(s)
        });
        assert!(
            seen.is_some(),
            "round {round}: worker {pid} never leased anything: {}",
            sb.stats()
        );
        let r = w.kill9();
        assert_eq!(r.code, -1, "round {round}: killed by a signal: {r:?}");
        // The store notices the closed socket and releases everything the worker held.
        let after = poll_until(Duration::from_secs(10), || {
            let s = sb.stats();
            let j = live_job(&s, pid)?;
            (j["live"] == false && u(&s, "slots_leased") == 0 && u(&s, "workers") == 0).then_some(s)
        });
        assert!(
            after.is_some(),
            "round {round}: leases of killed worker {pid} not released: {}",
            sb.stats()
        );
        // The store still serves, with the right answer.
        reference_run(&sb, &[]);
    }
    let s = sb.stats();
    assert_eq!(u(&s, "slots_leased"), 0);
    assert_eq!(u(&s["lifetime"], "failed_loads"), 0, "{s}");
    let r = sb.stop_store().expect("running");
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn stop_refuse_second_start_and_socket_modes() {
    use std::os::unix::fs::PermissionsExt;
    let mut sb = Sandbox::new("life");
    let trunk = sb.pack_tiny_trunk();
    start_tiny(&mut sb, &trunk, &["--preset", "laptop"]);
    let dir_mode = std::fs::metadata(sb.socket.parent().unwrap())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    let sock_mode = std::fs::metadata(&sb.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!((dir_mode, sock_mode), (0o700, 0o600));

    // A second store on the same socket is refused before any work, naming the live one.
    let model = tiny_model();
    let r = sb.run(
        "k3-store",
        &[
            "start",
            path_str(&model),
            "--trunk",
            path_str(&trunk),
            "--preset",
            "laptop",
            "--socket",
            path_str(&sb.socket),
            "--detach",
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("already running"), "{r:?}");
    // Said before any work: no checkpoint read, no memory plan printed (issue 49).
    assert!(!r.stderr.contains("memory plan"), "{r:?}");
    // … and the first one is untouched.
    assert!(sb.socket.exists());
    reference_run(&sb, &[]);

    let pid = sb.store_pid().unwrap();
    let r = sb.stop_store().expect("running"); // checks: socket gone, process gone
    assert_eq!(r.code, 0, "{r:?}");
    assert!(pid_gone(pid));
}

#[test]
fn sigterm_stops_the_store_cleanly() {
    let mut sb = Sandbox::new("term");
    let trunk = sb.pack_tiny_trunk();
    start_tiny(&mut sb, &trunk, &["--preset", "laptop"]);
    reference_run(&sb, &[]);
    sb.signal_store("TERM");
    assert!(!sb.socket.exists(), "SIGTERM must unlink the socket");
    let log = std::fs::read_to_string(sb.socket.with_file_name("store.log")).unwrap();
    assert!(log.lines().any(|l| l.ends_with(" stopped")), "{log}");
    let r = sb.ctl(&["stats"]);
    assert_eq!(r.code, 3, "{r:?}");
}

#[test]
fn stale_socket_of_a_killed_store_is_replaced() {
    let mut sb = Sandbox::new("stale");
    let trunk = sb.pack_tiny_trunk();
    start_tiny(&mut sb, &trunk, &["--preset", "laptop"]);
    let old = sb.signal_store("KILL");
    assert!(
        sb.socket.exists(),
        "a SIGKILLed store leaves its socket file"
    );
    let r = sb.ctl(&["status"]);
    assert_eq!(r.code, 3, "nothing answers on a stale socket: {r:?}");
    let r = start_tiny(&mut sb, &trunk, &["--preset", "laptop"]);
    assert_ne!(sb.store_pid(), Some(old), "{r:?}");
    let s = sb.stats();
    assert_eq!(u(&s["lifetime"], "requests"), 0, "a fresh store: {s}");
    reference_run(&sb, &[]);
    let r = sb.stop_store().expect("running");
    assert_eq!(r.code, 0, "{r:?}");
}

#[test]
fn protocol_version_mismatch_and_unreachable_store() {
    use k3_proto::wire::{ClientKind, PROTOCOL_VERSION};
    use k3_store::attach::client::{Client, ClientError};
    let mut sb = Sandbox::new("proto");
    let trunk = sb.pack_tiny_trunk();
    let ids = ids_arg(&reference_prompt());

    // No store yet: worker and ctl exit 3 naming the socket.
    let r = sb.worker(&["--ids", &ids, "--gen", "2"]);
    assert_eq!(r.code, 3, "{r:?}");
    assert!(r.stderr.contains(path_str(&sb.socket)), "{r:?}");
    for cmd in [&["stats"][..], &["status"], &["stop"]] {
        let r = sb.ctl(cmd);
        assert_eq!(r.code, 3, "k3-ctl {cmd:?}: {r:?}");
        assert!(r.stderr.contains("no store answers"), "{r:?}");
    }

    start_tiny(&mut sb, &trunk, &["--preset", "laptop"]);
    for (kind, version) in [
        (ClientKind::Worker, PROTOCOL_VERSION + 1),
        (ClientKind::Control, PROTOCOL_VERSION.wrapping_sub(1)),
    ] {
        match Client::connect_with_version(&sb.socket, kind, "old client", version) {
            Err(ClientError::Refused(reason)) => {
                assert!(
                    reason.contains(&format!("v{PROTOCOL_VERSION}"))
                        && reason.contains(&format!("v{version}")),
                    "both versions named: {reason}"
                );
            }
            Err(e) => panic!("expected a refusal, got {e}"),
            Ok(_) => panic!("a v{version} client was accepted by a v{PROTOCOL_VERSION} store"),
        }
    }
    // The right version is accepted, and the refused clients left no job behind.
    assert!(Client::connect(&sb.socket, ClientKind::Control, "test").is_ok());
    let s = sb.stats();
    assert_eq!(s["jobs"].as_array().map(Vec::len), Some(0), "{s}");

    // Standalone-only flags in attached mode: refused before any work.
    for flags in [
        &["--preset", "laptop"][..],
        &["--cache-gb", "1"],
        &["--trunk", path_str(&trunk)],
    ] {
        let mut args = vec!["--ids", ids.as_str(), "--gen", "2"];
        args.extend_from_slice(flags);
        let r = sb.worker(&args);
        assert_eq!(r.code, 2, "{flags:?}: {r:?}");
        assert!(r.stderr.contains("--standalone"), "{r:?}");
    }
    let s = sb.stats();
    assert_eq!(
        u(&s["lifetime"], "requests"),
        0,
        "refused workers did no work"
    );
}

#[test]
fn impossible_budget_refuses_detached_start_and_leaves_no_socket() {
    let sb = Sandbox::new("refuse");
    let trunk = sb.pack_tiny_trunk();
    let model = tiny_model();
    let r = sb.run(
        "k3-store",
        &[
            "start",
            path_str(&model),
            "--trunk",
            path_str(&trunk),
            "--preset",
            "laptop",
            "--cache-gb",
            "0.000001",
            "--socket",
            path_str(&sb.socket),
            "--detach",
        ],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("REFUSING TO START"), "{r:?}");
    assert!(r.stderr.contains("top_k = 2"), "the plan's problem: {r:?}");
    assert!(r.stderr.contains("TOTAL"), "the plan is printed: {r:?}");
    assert!(!sb.socket.exists(), "a refused start leaves no socket");
}

/// `start --detach` says what is happening (issue 35 item 2): the plan, once, on stdout before
/// the readiness line; the load's progress in human units on stderr (here not a terminal: plain
/// lines, the last at 100%); and the store's own log holds the plan's header once.
#[test]
fn detached_start_prints_the_plan_once_and_the_load_progress() {
    let mut sb = Sandbox::new("detach-plan");
    let model = tiny_model();
    let r = sb.start_store(&[path_str(&model), "--preset", "laptop"]);
    let plan_at = r
        .stdout
        .find("memory plan (laptop")
        .unwrap_or_else(|| panic!("{r:?}"));
    let ready_at = r
        .stdout
        .find("k3-store ready")
        .unwrap_or_else(|| panic!("{r:?}"));
    assert!(plan_at < ready_at, "the plan comes first: {r:?}");
    assert_eq!(r.stdout.matches("memory plan").count(), 1, "{r:?}");
    for row in ["TOTAL", "expert cache", "store shared memory:"] {
        assert!(r.stdout.contains(row), "{row}: {r:?}");
    }
    // Human units (a small model's sizes in MB, not `0.00 GB`).
    assert!(!r.stdout.contains(" 0.00 GB"), "{r:?}");
    let last = r
        .stderr
        .lines()
        .rfind(|l| l.contains("loading shared memory: "))
        .unwrap_or_else(|| panic!("no progress line: {r:?}"));
    assert!(
        last.contains(" MB of ") && last.contains("(100%)") && last.contains("MB/s"),
        "{last}"
    );
    assert!(
        !r.stderr.contains('\r'),
        "no bar frames off a terminal: {r:?}"
    );
    let log = std::fs::read_to_string(sb.store_log()).unwrap();
    assert_eq!(log.matches("memory plan").count(), 1, "{log}");
    // `k3-ctl status` of a store without a packed trunk: no empty `trunk:` line; sizes in MB.
    let st = sb.ctl(&["status"]);
    assert_eq!(st.code, 0, "{st:?}");
    assert!(
        st.stdout
            .lines()
            .any(|l| l.starts_with("trunk: none packed")),
        "{st:?}"
    );
    assert!(
        st.stdout
            .lines()
            .any(|l| l.starts_with("shared memory: ") && l.ends_with(" MB")),
        "{st:?}"
    );
}

/// The standalone worker's start (issue 35 item 7): the plan's header once, the expert preload's
/// progress and the report in human units (MB for this small model, not raw byte counts or
/// `0.000 GB`).
#[test]
fn standalone_worker_prints_the_plan_header_once_and_sizes_in_human_units() {
    let sb = Sandbox::new("standalone-units");
    let model = tiny_model();
    let r = sb.run(
        "k3-worker",
        &[
            "--standalone",
            path_str(&model),
            "--ids",
            "1,2,3",
            "--gen",
            "2",
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(r.stderr.matches("memory plan").count(), 1, "{}", r.stderr);
    let preload = r
        .stderr
        .lines()
        .rfind(|l| l.contains("expert cache: "))
        .unwrap_or_else(|| panic!("{}", r.stderr));
    assert!(
        preload.contains(" MB of ") && preload.contains("(100%)"),
        "{preload}"
    );
    assert!(!r.stderr.contains("0.000 GB"), "{}", r.stderr);
}

/// Copy the tiny checkpoint into `dst`.
fn copy_model(dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(tiny_model()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// File offset of the first routed-expert tensor stored in `shard` (from its safetensors header).
fn first_expert_offset(shard: &Path) -> u64 {
    let bytes = std::fs::read(shard).unwrap();
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    assert!(hlen < bytes.len() as u64);
    let header: Value = serde_json::from_slice(&bytes[8..8 + hlen as usize]).unwrap();
    let start = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(name, _)| name.contains(".experts."))
        .map(|(_, t)| t["data_offsets"][0].as_u64().unwrap())
        .min()
        .expect("the shard holds experts");
    8 + hlen + start
}

#[test]
fn expert_that_cannot_be_read_gives_exit_4() {
    let mut sb = Sandbox::new("exit4");
    let model = sb.dir.join("model");
    copy_model(&model);
    let trunk = sb.pack_trunk(&model, "trunk");
    start_tiny_on(&mut sb, &model, &trunk);
    // After the store opened its shards, the middle shard loses every expert it stores (layers
    // 4–8): the store's reads of those experts come up short. A fresh file with the original
    // bytes takes the path, so the worker (which checks the checkpoint's identity: config and
    // shard sizes) still attaches — only the store's open descriptor sees the damage.
    let name = "model-00002-of-000003.safetensors";
    let shard = model.join(name);
    let cut = first_expert_offset(&shard);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    f.set_len(cut).unwrap();
    drop(f);
    std::fs::rename(&shard, model.join("damaged.bin")).unwrap();
    std::fs::copy(tiny_model().join(name), &shard).unwrap();

    let ids = ids_arg(&reference_prompt());
    let (r, j) = sb.worker_json(&["--ids", &ids, "--gen", "4", "--threads", "1"]);
    assert_eq!(r.code, 4, "a routed expert failed to load: {r:?}");
    assert!(u(&j, "failed_expert_loads") > 0, "{j}");
    assert_eq!(generated(&j).len(), 4, "the run finished: {j}");
    assert!(
        r.stderr.contains("expert load failed: layer ") && r.stderr.contains(" expert "),
        "the failed expert is named: {}",
        r.stderr
    );
    assert!(r.stderr.contains("unsound"), "{}", r.stderr);
    let s = stats_after_jobs(&sb, 1);
    assert!(u(&s["lifetime"], "failed_loads") > 0, "{s}");
    assert_eq!(u(&s, "slots_leased"), 0, "{s}");

    // A standalone run on a checkpoint whose shard is short is refused up front (exit 2),
    // naming the shard: it never starts a generation whose experts it cannot read.
    std::fs::rename(model.join("damaged.bin"), &shard).unwrap();
    let (r, _) = {
        let bs = ["--preset", "laptop"];
        let mut args = vec![
            "--standalone",
            path_str(&model),
            "--trunk",
            path_str(&trunk),
            "--ids",
            ids.as_str(),
            "--gen",
            "4",
        ];
        args.extend_from_slice(&bs);
        sb.worker_json(&args)
    };
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains(name), "{r:?}");
}

fn start_tiny_on(sb: &mut Sandbox, model: &Path, trunk: &Path) {
    sb.start_store(&[
        path_str(model),
        "--trunk",
        path_str(trunk),
        "--preset",
        "laptop",
        // The experts are read on demand, after the test damages the shard.
        "--preload",
        "off",
    ]);
}

/// Start a long worker on `sb`'s store and wait until it is mid-generation (has made expert
/// requests). Returns it.
fn long_worker_mid_generation(sb: &Sandbox) -> k3_tests::Spawned {
    let w = sb.spawn_long_worker();
    let pid = w.pid();
    let seen = poll_until(Duration::from_secs(15), || {
        let s = sb.stats();
        let j = live_job(&s, pid)?;
        (j["live"] == true && u(&j["counters"], "requests") > 0).then_some(())
    });
    assert!(seen.is_some(), "worker {pid} never started: {}", sb.stats());
    w
}

#[test]
fn store_going_away_mid_generation_ends_the_worker_promptly() {
    let mut sb = Sandbox::new("away");
    let trunk = sb.pack_tiny_trunk();
    let bufs = trunk_layer_bufs(&trunk);
    let budget = [
        "--trunk-gb".to_string(),
        gb_arg(trunk_budget_pinning(&bufs, 0)),
        "--cache-gb".to_string(),
        cache_gb_for_slots(TOP_K + 1),
    ];
    let budget: Vec<&str> = budget.iter().map(String::as_str).collect();

    // `k3-ctl stop` while a worker runs: the store drains and exits; the worker's next request
    // is refused ("the store is stopping") or, when it comes after the drain (the store had
    // nothing in flight and is gone; seen on a loaded CI machine), finds the socket closed —
    // either way it fails with a clear message instead of hanging, and exit 3 (the store is
    // gone: serve answers such a job 503).
    start_tiny(&mut sb, &trunk, &budget);
    let w = long_worker_mid_generation(&sb);
    let r = sb.stop_store().expect("running");
    assert_eq!(r.code, 0, "{r:?}");
    let wr = w.wait(Duration::from_secs(20));
    assert_eq!(wr.code, 3, "{wr:?}");
    assert!(
        wr.stderr.contains("the store is stopping") || wr.stderr.contains("store connection lost"),
        "{}",
        wr.stderr
    );

    // The store is SIGKILLed under a running worker: the worker notices the closed socket.
    start_tiny(&mut sb, &trunk, &budget);
    let w = long_worker_mid_generation(&sb);
    sb.signal_store("KILL");
    let wr = w.wait(Duration::from_secs(20));
    assert_eq!(wr.code, 3, "{wr:?}");
    assert!(wr.stderr.contains("store connection lost"), "{}", wr.stderr);
    // A new store replaces the stale socket and serves.
    start_tiny(&mut sb, &trunk, &budget);
    reference_run(&sb, &[]);
}

#[test]
fn hostile_and_confused_clients_get_errors_and_the_store_keeps_serving() {
    use k3_proto::wire::{ClientKind, Request, Response, SlotAnswer, PROTOCOL_VERSION};
    use k3_store::attach::client::Client;
    use std::io::{Read, Write};
    let mut sb = Sandbox::new("hostile");
    let trunk = sb.pack_tiny_trunk();
    let cache = cache_gb_for_slots(4);
    start_tiny(
        &mut sb,
        &trunk,
        &["--preset", "laptop", "--cache-gb", &cache],
    );

    // A first frame whose length prefix is far beyond the frame limit: the store closes the
    // connection at once (nothing allocated, no thread left waiting for 4 GB).
    let mut raw = std::os::unix::net::UnixStream::connect(&sb.socket).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let mut reply = Vec::new();
    let t0 = std::time::Instant::now();
    raw.read_to_end(&mut reply)
        .expect("the store closes the connection (no read timeout)");
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(raw);

    // An idle connection that never says Hello must not block anything (kept open below).
    let idle = std::os::unix::net::UnixStream::connect(&sb.socket).unwrap();

    let bad = |req: Request, kind: ClientKind| {
        let mut c = Client::connect(&sb.socket, kind, "confused").expect("handshake");
        match c.call(&req).expect("an answer") {
            Response::Error { message, .. } => message,
            other => panic!("{req:?} as {kind:?} was answered {other:?}"),
        }
    };
    let m = bad(
        Request::Experts {
            layer: 1,
            ids: vec![0, 1],
        },
        ClientKind::Control,
    );
    assert!(m.contains("only workers"), "{m}");
    let m = bad(
        Request::Experts {
            layer: 13,
            ids: vec![0],
        },
        ClientKind::Worker,
    );
    assert!(m.contains("layer 13 out of range"), "{m}");
    let m = bad(
        Request::Experts {
            layer: 1,
            ids: vec![0, 8],
        },
        ClientKind::Worker,
    );
    assert!(m.contains("expert 8 out of range"), "{m}");
    let m = bad(
        Request::Experts {
            layer: 1,
            ids: vec![0, 1, 2, 3, 4],
        },
        ClientKind::Worker,
    );
    assert!(m.contains("too small"), "5 experts in a 4-slot cache: {m}");
    let m = bad(
        Request::Hello {
            protocol_version: PROTOCOL_VERSION,
            kind: ClientKind::Worker,
            label: "again".into(),
        },
        ClientKind::Control,
    );
    assert!(m.contains("already"), "{m}");
    // History drafting's requests are bounded and workers-only where they write.
    let m = bad(
        Request::Draft {
            context: vec![1; k3_proto::wire::MAX_DRAFT_CONTEXT + 1],
            max: 4,
        },
        ClientKind::Worker,
    );
    assert!(m.contains("at most"), "{m}");
    let m = bad(
        Request::Draft {
            context: vec![1, 2, 3],
            max: k3_proto::wire::MAX_DRAFT_IDS + 1,
        },
        ClientKind::Worker,
    );
    assert!(m.contains("at most"), "{m}");
    let m = bad(
        Request::Record {
            ids: vec![1, 2, 3, 4, 5],
        },
        ClientKind::Control,
    );
    assert!(m.contains("only workers"), "{m}");
    let m = bad(
        Request::Record {
            ids: vec![1; k3_proto::wire::MAX_RECORD_IDS + 1],
        },
        ClientKind::Worker,
    );
    assert!(m.contains("at most"), "{m}");

    // A well-formed lease: the same expert twice is one slot, answered twice; the lease shows
    // in stats while the connection lives and is gone once it closes.
    {
        let mut c = Client::connect(&sb.socket, ClientKind::Worker, "lessee").unwrap();
        match c
            .call(&Request::Experts {
                layer: 2,
                ids: vec![5, 5, 6],
            })
            .unwrap()
        {
            Response::Experts { answers, .. } => {
                let slots: Vec<u32> = answers
                    .iter()
                    .map(|a| match a {
                        SlotAnswer::Leased { slot, .. } => *slot,
                        other => panic!("{other:?}"),
                    })
                    .collect();
                assert_eq!(slots.len(), 3);
                assert_eq!(slots[0], slots[1]);
                assert_ne!(slots[0], slots[2]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(u(&sb.stats(), "slots_leased"), 2);
    }
    let released = poll_until(Duration::from_secs(10), || {
        (u(&sb.stats(), "slots_leased") == 0).then_some(())
    });
    assert!(released.is_some(), "{}", sb.stats());

    // The store still serves a real job, and stops promptly with the idle connection open.
    reference_run(&sb, &[]);
    let r = sb.stop_store().expect("running");
    assert_eq!(r.code, 0, "{r:?}");
    drop(idle);
}

#[test]
fn a_store_started_with_only_the_model_reads_the_shards_and_picks_its_budget() {
    // `k3-store start MODEL`: no --trunk (layers read from the checkpoint's shards), no memory
    // flag (`--preset auto`, sized from what the store may allocate).
    let mut sb = Sandbox::new("bare");
    let model = tiny_model();
    sb.start_store(&[path_str(&model)]);
    let log = std::fs::read_to_string(sb.store_log()).unwrap_or_default();
    assert!(log.contains("memory plan (auto ("), "{log}");
    let s = sb.stats();
    assert_eq!(
        u(&s, "pinned_layers"),
        13,
        "auto pins the whole tiny trunk: {s}"
    );
    for _ in 0..2 {
        let r = reference_run(&sb, &[]);
        assert_eq!(u(&r, "trunk_bytes_read"), 0, "{r}");
    }
    sb.stop_store();
    // A trunk budget below the model: attached workers stream the unpinned layers straight
    // from the shards, with the reference ids.
    sb.start_store(&[path_str(&model), "--trunk-gb", "0.0006", "--cache-gb", "1"]);
    let s = sb.stats();
    assert!(u(&s, "pinned_layers") < 13, "{s}");
    let r = reference_run(&sb, &[]);
    assert!(u(&r, "trunk_bytes_read") > 0, "{r}");
}

#[test]
fn ps_shows_a_live_jobs_tokens_seconds_per_token_and_bytes() {
    let mut sb = Sandbox::new("ps");
    let trunk = sb.pack_tiny_trunk();
    // Nothing pinned: the worker streams the trunk itself, so its trunk bytes grow.
    let bufs = trunk_layer_bufs(&trunk);
    let none_budget = gb_arg(trunk_budget_pinning(&bufs, 0));
    start_tiny(
        &mut sb,
        &trunk,
        &["--trunk-gb", &none_budget, "--cache-gb", "1"],
    );
    let ids = ids_arg(&reference_prompt());
    let w = sb.spawn_worker(&["--ids", &ids, "--gen", "4000", "--threads", "1"]);
    let pid = w.pid();
    let row = poll_until(Duration::from_secs(20), || {
        let r = sb.ctl(&["ps", "--json"]);
        assert_eq!(r.code, 0, "{r:?}");
        let v: Value = serde_json::from_str(r.stdout.trim()).ok()?;
        v["jobs"]
            .as_array()?
            .iter()
            .find(|j| {
                j["label"]
                    .as_str()
                    .is_some_and(|l| l.ends_with(&pid.to_string()))
                    && u(&j["progress"], "tokens") >= 3
            })
            .cloned()
    })
    .unwrap_or_else(|| panic!("ps never showed worker {pid} with 3 tokens: {}", sb.stats()));
    let p = &row["progress"];
    assert!(p["decode_seconds"].as_f64().unwrap() > 0.0, "{row}");
    assert!(u(p, "trunk_bytes_read") > 0, "{row}");
    assert_eq!(row["live"], true);
    // The table names the job too.
    let t = sb.ctl(&["ps"]);
    assert!(t.stdout.contains(&pid.to_string()), "{t:?}");
    w.kill9();
    let gone = poll_until(Duration::from_secs(10), || {
        let r = sb.ctl(&["ps", "--json"]);
        let v: Value = serde_json::from_str(r.stdout.trim()).ok()?;
        (v["jobs"].as_array()?.is_empty() && v["servers"].as_array()?.is_empty()).then_some(())
    });
    assert!(gone.is_some(), "a killed job is no longer listed");
}

/// A worker run with `K3_LOOKAHEAD=<mode>` (attached to our store unless `args` has
/// `--standalone`); asserts exit 0 and returns its report.
fn lookahead_run(sb: &Sandbox, mode: &str, args: &[&str]) -> Value {
    let out = sb
        .dir
        .join(format!("lookahead-{mode}-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let mut full: Vec<&str> = args.to_vec();
    full.extend_from_slice(&["--out", path_str(&out)]);
    if !args.contains(&"--standalone") {
        full.extend_from_slice(&["--socket", path_str(&sb.socket)]);
    }
    let mut c = sb.command("k3-worker", &full);
    c.env("K3_LOOKAHEAD", mode);
    let r = sb.run_command(c);
    assert_eq!(r.code, 0, "K3_LOOKAHEAD={mode} {args:?}: {r:?}");
    serde_json::from_str(&std::fs::read_to_string(&out).expect("report")).expect("report JSON")
}

#[test]
fn lookahead_prefetch_never_changes_the_ids_standalone_or_attached() {
    let mut sb = Sandbox::new("lookahead");
    let trunk = sb.pack_tiny_trunk();
    let bufs = trunk_layer_bufs(&trunk);
    let all = gb_arg(trunk_budget_pinning(&bufs, bufs.len()));
    let prefix = gb_arg(trunk_budget_pinning(&bufs, 3));
    let tiny_cache = cache_gb_for_slots(TOP_K + 1);
    let ids = ids_arg(&reference_prompt());
    let cases: Vec<(&str, Vec<&str>, bool)> = vec![
        // (what, budget, every layer pinned: the next layer's router is always resident)
        (
            // Not preloaded: a cache that holds every expert would leave nothing to predict.
            "all pinned, large cache",
            vec!["--trunk-gb", &all, "--cache-gb", "0.01", "--preload", "off"],
            true,
        ),
        (
            "all pinned, top_k+1 slots",
            vec!["--trunk-gb", &all, "--cache-gb", &tiny_cache],
            true,
        ),
        (
            "prefix pinned, top_k+1 slots",
            vec!["--trunk-gb", &prefix, "--cache-gb", &tiny_cache],
            false,
        ),
    ];
    let reference = reference_greedy();
    let model = tiny_model();
    let run_args = |budget: &[&str], standalone: bool| -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        if standalone {
            a.extend(["--standalone".into(), path_str(&model).into()]);
            a.extend(["--trunk".into(), path_str(&trunk).into()]);
            a.extend(budget.iter().map(|s| s.to_string()));
        }
        a.extend(["--ids".into(), ids.clone(), "--gen".into(), "20".into()]);
        a
    };
    for (what, budget, all_pinned) in &cases {
        for standalone in [true, false] {
            if !standalone {
                start_tiny(&mut sb, &trunk, budget);
            }
            let a = run_args(budget, standalone);
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            let where_ = if standalone { "standalone" } else { "attached" };
            let off = lookahead_run(&sb, "off", &a);
            assert_eq!(
                generated(&off),
                reference,
                "{what} {where_}: ids with lookahead off"
            );
            assert_eq!(u(&off["lookahead"], "layers"), 0, "{what} {where_}: {off}");
            assert_eq!(
                u(&off["lookahead"]["next_pass"], "layers"),
                0,
                "{what} {where_}: {off}"
            );
            for key in ["prefetched_experts", "dropped_experts"] {
                assert_eq!(u(&off["lookahead"], key), 0, "{what} {key}: {off}");
            }
            let modes: &[&str] = if standalone {
                &["mlp-in", "attn-in"]
            } else {
                &["mlp-in"]
            };
            // Attached with every layer pinned, the store's prefetch is checked below: it gets a
            // fresh store, or the lookahead-off job before it has made every expert resident
            // and left only mispredictions to prefetch (none, on a run where they all came late).
            let fresh = !standalone && *all_pinned;
            if fresh {
                let r = sb.stop_store().expect("store running");
                assert_eq!(r.code, 0, "{what}: {r:?}");
                start_tiny(&mut sb, &trunk, budget);
            }
            for &mode in modes {
                let on = lookahead_run(&sb, mode, &a);
                assert_eq!(
                    generated(&on),
                    reference,
                    "{what} {where_}: ids with K3_LOOKAHEAD={mode}"
                );
                let la = &on["lookahead"];
                let (used, loads) = (u(la, "used_experts"), u(la, "prefetched_experts"));
                assert!(used <= loads, "{what} {where_} {mode}: {la}");
                // A dropped prediction was never loaded: at most what was predicted (for the
                // next layer, and for the next call's first MoE layer), less what was loaded.
                let np = &la["next_pass"];
                assert!(
                    u(la, "dropped_experts") + loads
                        <= u(la, "predicted_experts") + u(np, "predicted_experts") + TOP_K,
                    "{what} {where_} {mode}: {la}"
                );
                assert!(
                    u(la, "correct_experts") <= u(la, "requested_experts"),
                    "{what} {where_} {mode}: {la}"
                );
                // Forward calls: the prefill and every decode pass (19 without speculation;
                // fewer when an attached job drafts from the earlier jobs' history).
                let calls = 1 + u(&on, "forward_passes");
                // Each call predicts the next one's first MoE layer (its last position's
                // choices, top_k of them), checked by every call but the first.
                assert_eq!(u(np, "layers"), calls - 1, "{what} {where_} {mode}: {la}");
                assert_eq!(u(np, "predicted_experts"), TOP_K * (calls - 1), "{la}");
                assert!(
                    u(np, "correct_experts") <= u(np, "requested_experts"),
                    "{la}"
                );
                if *all_pinned {
                    // Every MoE layer (1..=12) is predicted from the layer before it, in each
                    // forward call.
                    assert_eq!(u(la, "layers"), 12 * calls, "{what} {where_} {mode}: {la}");
                    assert!(u(la, "correct_experts") > 0, "{what} {where_} {mode}: {la}");
                    if standalone {
                        // A fresh cache has free slots: predictions are read ahead and some
                        // are used.
                        assert!(loads > 0 && used > 0, "{what} {where_} {mode}: {la}");
                        assert_eq!(
                            u(la, "prefetched_bytes"),
                            loads * EXPERT_BYTES,
                            "{what} {where_} {mode}: {la}"
                        );
                    }
                } else {
                    // Layers 3.. stream: their routers are not resident (and are never read
                    // early for a prediction), so only layers 1 and 2 are predicted.
                    assert_eq!(u(la, "layers"), 2 * calls, "{what} {where_} {mode}: {la}");
                }
            }
            if !standalone {
                let st = stats_after_jobs(&sb, if fresh { 1 } else { 2 });
                if *all_pinned {
                    assert!(
                        u(&st["lifetime"], "prefetch_loads") > 0,
                        "{what}: the store prefetched nothing: {st}"
                    );
                }
                let r = sb.stop_store().expect("store running");
                assert_eq!(r.code, 0, "{what}: {r:?}");
            }
        }
    }
}

#[test]
fn overlapped_expert_groups_never_change_the_ids_prefill_or_verify() {
    // Standalone, where a pass's union of experts exceeds the cache (the whole prompt in one
    // prefill chunk; verify passes of K = 4 replayed drafts): with K3_EXPERT_OVERLAP on (the
    // default) the next group is read while the current one computes. Same ids as the
    // reference, on and off; a bad value is refused.
    let sb = Sandbox::new("overlap");
    let trunk = sb.pack_tiny_trunk();
    let bufs = trunk_layer_bufs(&trunk);
    let prefix = gb_arg(trunk_budget_pinning(&bufs, 3));
    let reference = reference_greedy();
    let replay = sb.dir.join("overlap-replay.json");
    std::fs::write(&replay, serde_json::to_string(&reference).unwrap()).unwrap();
    let model = tiny_model();
    let ids = ids_arg(&reference_prompt());
    for slots in [TOP_K + 1, 2 * TOP_K + 1] {
        let cache = cache_gb_for_slots(slots);
        for spec in [
            vec!["--spec", "off"],
            vec![
                "--spec",
                "4",
                "--draft",
                "replay",
                "--draft-replay",
                path_str(&replay),
                "--draft-miss-rate",
                "0.3",
            ],
        ] {
            for mode in ["on", "off"] {
                let out = sb.dir.join(format!("overlap-{mode}.json"));
                let mut a = vec![
                    "--standalone",
                    path_str(&model),
                    "--trunk",
                    path_str(&trunk),
                    "--trunk-gb",
                    &prefix,
                    "--cache-gb",
                    &cache,
                    "--ids",
                    &ids,
                    "--gen",
                    "20",
                    "--prefill-chunk",
                    "0",
                    "--out",
                    path_str(&out),
                ];
                a.extend_from_slice(&spec);
                let mut c = sb.command("k3-worker", &a);
                c.env("K3_EXPERT_OVERLAP", mode);
                let r = sb.run_command(c);
                assert_eq!(r.code, 0, "{slots} slots {spec:?} overlap {mode}: {r:?}");
                let v: Value =
                    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
                assert_eq!(
                    generated(&v),
                    reference,
                    "{slots} slots {spec:?}: ids with K3_EXPERT_OVERLAP={mode}"
                );
            }
        }
    }
    // A switch set to anything but on/off is refused before any work (exit 2, named); on and off
    // give the same ids.
    let run = |var: &str, v: &str| {
        let args = [
            "--standalone",
            path_str(&model),
            "--ids",
            &ids,
            "--gen",
            "2",
        ];
        let mut c = sb.command("k3-worker", &args);
        c.env(var, v);
        sb.run_command(c)
    };
    let r = run("K3_EXPERT_OVERLAP", "sometimes");
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("K3_EXPERT_OVERLAP"), "{}", r.stderr);
    let run = |v: &str| run("K3_EARLY_RELEASE", v);
    let r = run("maybe");
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("K3_EARLY_RELEASE"), "{}", r.stderr);
    let (on, off) = (run("on"), run("off"));
    assert_eq!((on.code, off.code), (0, 0), "{on:?} {off:?}");
    assert_eq!(on.stdout, off.stdout);
}
