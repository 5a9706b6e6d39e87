//! The store's shared trunk ring with real processes (SPEC.md §6.8): concurrent attached workers
//! compute on the same reads of the streamed layers and get the ids standalone runs of the same
//! prompts get, at several budgets; a stopped worker cannot hold the ring for the others.

use std::path::Path;
use std::time::{Duration, Instant};

use k3_tests::{
    cache_gb_for_slots, gb_arg, generated_ids as generated, ids_arg, json_u64 as u, live_job,
    path_str, poll_until, printed_ids, reference_greedy, reference_prompt, send_signal, tiny_model,
    trunk_budget_pinning, trunk_layer_bufs, Sandbox,
};
use serde_json::Value;

/// Three prompts of the same length (the reference prompt and two rotations of it), so jobs of
/// the same `--gen` run the same forward passes.
fn prompts() -> Vec<String> {
    let p = reference_prompt();
    (0..3)
        .map(|k| {
            let mut q = p.clone();
            q.rotate_left(k * 5 % p.len());
            ids_arg(&q)
        })
        .collect()
}

const GEN: &str = "20";

fn job_args<'a>(ids: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--ids", ids, "--gen", GEN, "--threads", "1"];
    a.extend_from_slice(extra);
    a
}

/// `k3-worker --standalone` on `ids` at `budget`: its ids.
fn standalone(sb: &Sandbox, trunk: &Path, budget: &[&str], ids: &str) -> Vec<u32> {
    let model = tiny_model();
    let mut args = vec!["--standalone", path_str(&model), "--trunk", path_str(trunk)];
    args.extend(job_args(ids, budget));
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "standalone worker failed: {r:?}");
    generated(&j)
}

/// An attached job on `ids`; its report.
fn attached(sb: &Sandbox, ids: &str, extra: &[&str]) -> Value {
    let (r, j) = sb.worker_json(&job_args(ids, extra));
    assert_eq!(r.code, 0, "worker failed: {r:?}");
    assert_eq!(printed_ids(&r), generated(&j), "printed ids == report ids");
    j
}

/// One attached job per prompt, all started at the same moment: each worker is spawned through a
/// shell that stops itself (`SIGSTOP`) before it execs the worker; once all are stopped they are
/// continued together, so how much the jobs overlap does not depend on how fast processes start
/// on a loaded machine. Their reports, in prompt order.
fn together(sb: &Sandbox, prompts: &[String], extra: &[&str]) -> Vec<Value> {
    let sock = path_str(&sb.socket).to_string();
    let jobs: Vec<(std::path::PathBuf, k3_tests::Spawned)> = (prompts.iter().enumerate())
        .map(|(k, p)| {
            let out = sb.dir.join(format!("together-{k}.json"));
            let _ = std::fs::remove_file(&out);
            let mut c = std::process::Command::new("sh");
            c.args(["-c", "kill -STOP $$; exec \"$0\" \"$@\""])
                .arg(k3_tests::bin("k3-worker"))
                .args(job_args(p, extra))
                .args(["--socket", &sock, "--out", path_str(&out)]);
            (out, sb.spawn_command(&format!("together-{k}"), c))
        })
        .collect();
    for (_, w) in &jobs {
        let pid = w.pid();
        let stopped = poll_until(Duration::from_secs(20), || {
            let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The state follows the command name's closing parenthesis.
            let state = st.rsplit_once(") ")?.1.chars().next()?;
            (state == 'T').then_some(())
        });
        assert!(stopped.is_some(), "worker shell {pid} never stopped");
    }
    for (_, w) in &jobs {
        send_signal(w.pid(), "CONT");
    }
    jobs.into_iter()
        .map(|(out, w)| {
            let r = w.wait(Duration::from_secs(120));
            assert_eq!(r.code, 0, "worker failed: {r:?}");
            let j: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
            assert_eq!(printed_ids(&r), generated(&j), "printed ids == report ids");
            j
        })
        .collect()
}

/// A store on the tiny model with nothing pinned: every layer streams through a ring of the
/// largest one; 0.05 GB of expert cache; `extra` flags.
fn start_streamed(sb: &mut Sandbox, extra: &[&str]) {
    let trunk = sb.pack_tiny_trunk();
    let budget_gb = gb_arg(trunk_budget_pinning(&trunk_layer_bufs(&trunk), 0));
    let model = tiny_model();
    let mut args = vec![path_str(&model), "--trunk", path_str(&trunk)];
    args.extend_from_slice(&["--trunk-gb", &budget_gb, "--cache-gb", "0.05"]);
    args.extend_from_slice(extra);
    sb.start_store(&args);
}

/// Lifetime counters once no worker is connected.
fn idle_lifetime(sb: &Sandbox) -> Value {
    let s = poll_until(Duration::from_secs(10), || {
        let s = sb.stats();
        (u(&s, "workers") == 0).then_some(s)
    })
    .expect("the workers disconnect");
    s["lifetime"].clone()
}

/// Three concurrent jobs of the same length cost about one job's trunk reads, and every job
/// gets the ids a standalone run of its prompt gets — with nothing pinned and with a pinned
/// prefix, with speculation off (the same passes in every job) and on (each job its own).
#[test]
fn concurrent_jobs_share_one_trunk_stream_and_match_standalone() {
    let mut sb = Sandbox::new("ring-share");
    let trunk = sb.pack_tiny_trunk();
    let bufs = trunk_layer_bufs(&trunk);
    let prompts = prompts();
    // The last case: a ring of one layer and a cache of 3 slots (top-2): three workers contend
    // for both — a worker waiting for the ring must not hold slots the ring's holder waits for.
    let tiny_cache = cache_gb_for_slots(3);
    for (pinned, cache) in [(0usize, "0.05"), (3, "0.05"), (0, tiny_cache.as_str())] {
        let budget_gb = gb_arg(trunk_budget_pinning(&bufs, pinned));
        let budget = ["--trunk-gb", budget_gb.as_str(), "--cache-gb", cache];
        let solo: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| standalone(&sb, &trunk, &budget, p))
            .collect();
        assert_eq!(solo[0], reference_greedy(), "{pinned} pinned");
        assert_ne!(
            solo[0], solo[1],
            "the prompts differ in their continuations"
        );

        let model = tiny_model();
        let mut store = vec![path_str(&model), "--trunk", path_str(&trunk)];
        store.extend_from_slice(&budget);
        sb.start_store(&store);
        assert_eq!(u(&sb.stats(), "pinned_layers"), pinned as u64);

        // One job alone: its trunk bytes are what one pass per token costs.
        let l0 = idle_lifetime(&sb);
        let alone = attached(&sb, &prompts[0], &["--spec", "off"]);
        assert_eq!(generated(&alone), solo[0]);
        let l1 = idle_lifetime(&sb);
        let one = u(&l1, "trunk_bytes_read") - u(&l0, "trunk_bytes_read");
        let streamed: u64 = bufs[pinned..].iter().sum();
        assert!(
            one >= streamed,
            "{pinned} pinned: one job read {one} < {streamed}"
        );
        assert_eq!(u(&alone, "trunk_shared_layers"), 0, "{alone}");
        let served = u(&alone, "trunk_layers_served");
        assert_eq!(served % (13 - pinned as u64), 0, "whole passes: {alone}");

        // Three at once, started together (see `together`).
        let reps = together(&sb, &prompts, &["--spec", "off"]);
        let l2 = idle_lifetime(&sb);
        for (k, r) in reps.iter().enumerate() {
            assert_eq!(
                generated(r),
                solo[k],
                "{pinned} pinned, prompt {k}: concurrent == standalone"
            );
            assert_eq!(u(r, "trunk_layers_served"), served, "{r}");
        }
        let three = u(&l2, "trunk_bytes_read") - u(&l1, "trunk_bytes_read");
        assert!(
            three as f64 <= 1.5 * one as f64,
            "{pinned} pinned: three concurrent jobs read {three} trunk bytes, one job {one}"
        );
        let shared = u(&l2, "trunk_shared_layers") - u(&l1, "trunk_shared_layers");
        assert!(
            shared >= served,
            "{pinned} pinned: {shared} shared hand-outs: {l2}"
        );
        // What the jobs report adds up to what the store counted: each read is charged to the
        // job that used it first (a read made ahead, before these jobs started, included), and
        // reads nobody used are charged to nobody.
        let charged: u64 = reps.iter().map(|r| u(r, "trunk_bytes_read")).sum();
        let all = u(&l2, "trunk_bytes_read");
        assert!(
            u(&alone, "trunk_bytes_read") + charged <= all,
            "jobs charged {} + {charged} > {all} read in all",
            u(&alone, "trunk_bytes_read")
        );
        assert_eq!(u(&l2, "broken_leases"), 0, "{l2}");

        // With speculation on (drafts from the store's history), the same ids.
        let reps = together(&sb, &prompts, &[]);
        for (k, r) in reps.iter().enumerate() {
            assert_eq!(
                generated(r),
                solo[k],
                "{pinned} pinned, spec on, prompt {k}"
            );
        }
        let r = sb.stop_store().expect("store running");
        assert_eq!(r.code, 0, "{r:?}");
    }
}

/// A worker stopped (SIGSTOP) while it holds a layer of the ring: after `--lease-timeout` the
/// store breaks its lease, another job runs to the end with the right ids, and the stopped
/// worker, once continued, fails with a clear error (exit 1) instead of emitting a token
/// computed on bytes that may have been overwritten.
#[test]
fn a_stopped_worker_loses_its_lease_and_the_others_go_on() {
    let mut sb = Sandbox::new("ring-lease");
    start_streamed(&mut sb, &["--lease-timeout", "1"]);
    let ids = ids_arg(&reference_prompt());
    // A worker between two passes holds no lease (its read-ahead is protected for at most the
    // lease limit, and then it simply waits): stop it again until it is caught holding one.
    // `K3_EARLY_RELEASE=off`: the stopped worker holds each layer to its end, as it would
    // without early release; with it, a worker stopped during an expert wait holds no trunk
    // lease either, and the attempts would mostly catch it lease-free.
    for attempt in 0..5 {
        let w = sb.spawn_long_worker_env(&[("K3_EARLY_RELEASE", "off")]);
        let pid = w.pid();
        let live = poll_until(Duration::from_secs(15), || {
            let job = live_job(&sb.stats(), pid)?;
            (job["live"] == true && u(&job["counters"], "trunk_layers_served") > 0).then_some(())
        });
        assert!(
            live.is_some(),
            "worker {pid} never streamed: {}",
            sb.stats()
        );
        send_signal(pid, "STOP");
        let before = u(&sb.stats()["lifetime"], "broken_leases");

        let t0 = Instant::now();
        let (r, j) = sb.worker_json(&job_args(&ids, &["--spec", "off"]));
        let took = t0.elapsed();
        assert_eq!(r.code, 0, "the other job must not be held up: {r:?}");
        assert_eq!(generated(&j), reference_greedy());
        assert!(took < Duration::from_secs(30), "took {took:?}");
        let broken = u(&sb.stats()["lifetime"], "broken_leases") - before;

        send_signal(pid, "CONT");
        if broken == 0 {
            // Caught between two passes: nothing to break; try again.
            let _ = w.kill9();
            continue;
        }
        assert_eq!(broken, 1);
        let wr = w.wait(Duration::from_secs(30));
        assert_eq!(wr.code, 1, "attempt {attempt}: {wr:?}");
        assert!(
            wr.stderr.contains("broke its lease"),
            "a clear message: {}",
            wr.stderr
        );
        // What it printed before the break is the greedy continuation (nothing after it).
        let printed: Vec<u32> = wr
            .stdout
            .split_whitespace()
            .filter_map(|t| t.parse().ok())
            .collect();
        let n = printed.len().min(20);
        assert_eq!(printed[..n], reference_greedy()[..n], "{wr:?}");
        let r = sb.stop_store().expect("store running");
        assert_eq!(r.code, 0, "{r:?}");
        return;
    }
    panic!("never caught the worker holding a lease in 5 attempts");
}

/// An attached worker allocates no ring: its up-front check counts the sequence state, the
/// activations and logits of one forward call at its prefill chunk and the verify buffers, and
/// refuses with exit 2 before any work when they exceed what it may allocate (here an
/// address-space limit, `prlimit --as`); a shorter prompt under the same limit fits.
#[test]
fn an_attached_worker_that_cannot_fit_its_buffers_is_refused_before_any_work() {
    let mut sb = Sandbox::new("ring-mem");
    start_streamed(&mut sb, &[]);
    // 8000 prompt ids in one forward call: ~0.22 GB of activations on the tiny model.
    let ids: Vec<u32> = (0..8000u32).map(|i| i * 7 % 250 + 1).collect();
    let sock = path_str(&sb.socket).to_string();
    let run = |n: usize| {
        let mut c = std::process::Command::new("prlimit");
        c.arg("--as=300000000")
            .arg(k3_tests::bin("k3-worker"))
            .args(["--ids", &ids_arg(&ids[..n]), "--gen", "1", "--threads", "1"])
            .args(["--prefill-chunk", "0", "--spec", "off", "--socket", &sock]);
        sb.run_command(c)
    };
    let r = run(8000);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("REFUSING TO START"), "{}", r.stderr);
    // Refused for the memory (`may allocate only`) or the address space (`ulimit -v`) the
    // limit leaves; either way with the shortfall.
    assert!(
        r.stderr.contains("may allocate only") || r.stderr.contains("ulimit -v"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("shortfall"), "{}", r.stderr);
    let l = idle_lifetime(&sb);
    assert_eq!(
        (u(&l, "trunk_layers_served"), u(&l, "requests")),
        (0, 0),
        "no work before the refusal: {l}"
    );
    let r = run(200);
    assert_eq!(r.code, 0, "200 positions fit: {r:?}");
    assert_eq!(printed_ids(&r).len(), 1, "{r:?}");
}
