//! `k3-worker --serve-channel`: the typed job protocol of `k3_proto::serve` (docs/SPEC.md §6.12)
//! spoken to a real worker over a socket pair on its standard input, attached to a real store on
//! the tiny checkpoint. One worker takes jobs for as long as the channel is open: each job's ids
//! are the float64 reference's or the ones the same worker gives it alone, whatever runs beside
//! it (a prompt longer than a slot beside short ones included: the same engine, as its report
//! shows); a cancel ends one job at a step boundary with `Done {Cancelled}`, the others go on; a
//! bad job is refused alone (a value outside serve's shared validation as `Invalid`); a worker-level error is a kind with the exit code it then ends with;
//! the end of the channel ends the worker with exit 0.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k3_proto::serve::{
    ErrorKind, Finish, FromWorker, Sampling, Start, ToWorker, JOB_PROTOCOL_VERSION, MAX_JOB_FRAME,
};
use k3_tests::*;

/// A worker taking its jobs from `chan`'s other end: `slots` at once, `positions` a slot, and
/// `extra` flags.
fn spawn(
    sb: &Sandbox,
    socket: &Path,
    slots: usize,
    positions: usize,
    extra: &[&str],
) -> (Child, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    ours.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let child = Command::new(bin("k3-worker"))
        .args(k3_worker::front::cli::serve_channel_args(
            socket,
            Some(1),
            slots,
            positions,
            None,
        ))
        .args(extra)
        .env("XDG_RUNTIME_DIR", sb.xdg_dir())
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (child, ours)
}

fn recv(c: &mut UnixStream) -> FromWorker {
    k3_proto::wire::read_frame_limited(c, MAX_JOB_FRAME).expect("a message from the worker")
}

fn send(c: &mut UnixStream, m: &ToWorker) {
    k3_proto::wire::write_frame(c, m).unwrap();
}

fn start(req_id: u64, ids: Vec<u32>, max_new: u32) -> ToWorker {
    ToWorker::Start(Start {
        req_id,
        ids,
        max_new,
        sampling: Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        },
        session: None,
        resume: None,
        keep_at: Vec::new(),
        name_key: Vec::new(),
        shape: Default::default(),
        n: 1,
    })
}

fn hello(c: &mut UnixStream) {
    match recv(c) {
        FromWorker::Hello {
            protocol_version, ..
        } => assert_eq!(protocol_version, JOB_PROTOCOL_VERSION),
        other => panic!("expected Hello, got {other:?}"),
    }
}

fn exit_code(mut child: Child) -> i32 {
    for _ in 0..600 {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code().unwrap_or(-1);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    panic!("the worker did not exit");
}

fn start_store(sb: &mut Sandbox) {
    let trunk = sb.pack_tiny_trunk();
    let model = tiny_model();
    sb.start_store(&[model.to_str().unwrap(), "--trunk", trunk.to_str().unwrap()]);
}

/// What the channel said of each job until every one in `jobs` ended: its ids and its end.
fn collect(c: &mut UnixStream, jobs: &[u64]) -> BTreeMap<u64, (Vec<u32>, Option<Finish>)> {
    let mut out: BTreeMap<u64, (Vec<u32>, Option<Finish>)> = BTreeMap::new();
    let mut prefilled = Vec::new();
    while jobs
        .iter()
        .any(|j| out.get(j).is_none_or(|o| o.1.is_none()))
    {
        match recv(c) {
            FromWorker::Prefilled { req_id, .. } => {
                assert!(
                    out.get(&req_id).is_none_or(|o| o.0.is_empty()),
                    "Prefilled comes before the ids"
                );
                prefilled.push(req_id);
            }
            FromWorker::Token { req_id, id, .. } => out.entry(req_id).or_default().0.push(id),
            FromWorker::Done {
                req_id,
                finish,
                usage,
                ..
            } => {
                let o = out.entry(req_id).or_default();
                assert_eq!(usage.generated as usize, o.0.len());
                o.1 = Some(finish);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    for j in jobs {
        assert!(prefilled.contains(j), "job {j} said Prefilled");
    }
    out
}

#[test]
fn one_worker_takes_jobs_with_their_solo_ids_and_a_cancel_ends_one_of_them() {
    let mut sb = Sandbox::new("chan");
    start_store(&mut sb);
    let want = reference_greedy();
    let (child, mut c) = spawn(&sb, &sb.socket, 2, 64, &[]);
    hello(&mut c);
    send(&mut c, &start(7, reference_prompt(), want.len() as u32));
    let got = collect(&mut c, &[7]);
    assert_eq!(got[&7].0, want, "the channel's ids are the reference's");
    assert!(matches!(got[&7].1, Some(Finish::Length | Finish::EndId(_))));

    // The same worker, two jobs at once: a long one cancelled after its first id, and the
    // reference again beside it; the cancel ends only the first.
    send(&mut c, &start(8, reference_prompt(), 40));
    send(&mut c, &start(9, reference_prompt(), want.len() as u32));
    let mut got: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut ends = BTreeMap::new();
    while ends.len() < 2 {
        match recv(&mut c) {
            FromWorker::Prefilled { .. } => {}
            FromWorker::Token { req_id, id, .. } => {
                let ids = got.entry(req_id).or_default();
                ids.push(id);
                if req_id == 8 && ids.len() == 1 {
                    send(&mut c, &ToWorker::Cancel { req_id: 8 });
                }
            }
            FromWorker::Done { req_id, finish, .. } => {
                ends.insert(req_id, finish);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(ends[&8], Finish::Cancelled);
    assert!(got[&8].len() < 40, "{} ids after the cancel", got[&8].len());
    assert_eq!(got[&9], want, "the other job is unchanged by the cancel");
    // The end of the channel ends the worker, exit 0.
    drop(c);
    assert_eq!(exit_code(child), 0);
}

/// A prompt longer than a slot runs in the same worker beside short ones (it takes the room of
/// several slots), every job with the ids the worker gives it alone; the worker's report lists
/// them all.
#[test]
fn a_long_prompt_runs_beside_short_ones_in_the_same_engine() {
    let mut sb = Sandbox::new("chan-long");
    start_store(&mut sb);
    let long: Vec<u32> = (0..50).map(|i| (i * 37 + 11) % 250).collect();
    let jobs: Vec<(u64, Vec<u32>, u32)> = vec![
        (1, vec![5, 17, 3, 88, 42], 8),
        (2, long.clone(), 6),
        (3, vec![9], 10),
    ];
    let solo = |ids: &[u32], n: u32| {
        let (r, j) = sb.worker_json(&[
            "--ids",
            &ids_arg(ids),
            "--gen",
            &n.to_string(),
            "--spec",
            "off",
        ]);
        assert_eq!(r.code, 0, "{r:?}");
        generated_ids(&j)
    };
    let want: Vec<Vec<u32>> = jobs.iter().map(|(_, ids, n)| solo(ids, *n)).collect();
    let report = sb.dir.join("serve-report.json");
    // Three slots of 24 positions: the long job needs 55.
    let (child, mut c) = spawn(&sb, &sb.socket, 3, 24, &["--out", path_str(&report)]);
    hello(&mut c);
    for (id, ids, n) in &jobs {
        send(&mut c, &start(*id, ids.clone(), *n));
    }
    let got = collect(&mut c, &[1, 2, 3]);
    for ((id, _, _), w) in jobs.iter().zip(&want) {
        assert_eq!(&got[id].0, w, "job {id}");
    }
    drop(c);
    assert_eq!(exit_code(child), 0);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let ids: Vec<u64> = (v["jobs"].as_array().unwrap().iter())
        .map(|j| j["req_id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 3, "{v}");
    assert_eq!(v["slots"], 3);
    assert_eq!(v["positions"], 24);
    let long_job = (v["jobs"].as_array().unwrap().iter())
        .find(|j| j["req_id"] == 2)
        .unwrap();
    assert_eq!(long_job["usage"]["prompt_ids"], 50);
}

#[test]
fn errors_arrive_as_a_kind_with_the_exit_code() {
    let mut sb = Sandbox::new("chan-err");
    // No store: NoStore for the worker, exit 3.
    let (child, mut c) = spawn(&sb, &sb.socket, 1, 64, &[]);
    hello(&mut c);
    send(&mut c, &start(7, vec![1, 2, 3], 4));
    match recv(&mut c) {
        FromWorker::Error {
            req_id,
            kind,
            exit_class,
            ..
        } => {
            assert_eq!(
                (req_id, kind, exit_class),
                (None, ErrorKind::NoStore, k3_proto::exit::NO_STORE)
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(exit_code(child), k3_proto::exit::NO_STORE);
    // A job the worker refuses (no ids to generate): Refused for that job alone; the worker
    // takes the next one.
    start_store(&mut sb);
    let (child, mut c) = spawn(&sb, &sb.socket, 1, 64, &[]);
    hello(&mut c);
    send(&mut c, &start(7, vec![1, 2, 3], 0));
    match recv(&mut c) {
        FromWorker::Error {
            req_id,
            kind,
            exit_class,
            ..
        } => assert_eq!((req_id, kind, exit_class), (Some(7), ErrorKind::Refused, 2)),
        other => panic!("expected an error, got {other:?}"),
    }
    // Values outside the validation serve shares (a subnormal top_p, a temperature past 2):
    // Invalid, the client's fault (serve answers 400), for that job alone.
    for (req_id, temperature, top_p) in [(9, 0.5, 1e-40), (10, 2.5, 1.0)] {
        let ToWorker::Start(mut s) = start(req_id, vec![1, 2, 3], 2) else {
            unreachable!()
        };
        s.sampling = Sampling {
            temperature,
            top_p,
            seed: 1,
        };
        send(&mut c, &ToWorker::Start(s));
        match recv(&mut c) {
            FromWorker::Error {
                req_id: r,
                kind,
                message,
                ..
            } => {
                assert_eq!((r, kind), (Some(req_id), ErrorKind::Invalid), "{message}");
                assert!(message.starts_with("top_p") || message.starts_with("temperature"));
            }
            other => panic!("expected an error, got {other:?}"),
        }
    }
    send(&mut c, &start(8, reference_prompt(), 3));
    let got = collect(&mut c, &[8]);
    assert_eq!(got[&8].0, reference_greedy()[..3]);
    drop(c);
    assert_eq!(exit_code(child), 0);
    // Standard input that is not a socket: refused, exit 2.
    let r = sb.run("k3-worker", &["--serve-channel"]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("not a Unix socket"), "{r:?}");
}

/// A lone job costs what it costs in a one-slot worker whatever the slot count: the same ids,
/// the same expert requests (an idle slot adds no row to a pass and no request to the store).
/// Speculation is off: with it on, the second run of the same prompt drafts from the store's
/// history of the first and asks fewer experts (319 → 176–207 here) whichever runs second — an
/// order effect any A/B on one store must alternate, not a slot cost.
#[test]
fn a_lone_job_asks_the_same_experts_of_a_one_slot_and_a_four_slot_worker() {
    let mut sb = Sandbox::new("chan-lone");
    start_store(&mut sb);
    let prompt = vec![5, 17, 3, 88, 42, 7];
    let lone = |slots: usize| {
        let (child, mut c) = spawn(&sb, &sb.socket, slots, 64, &["--spec", "off"]);
        hello(&mut c);
        send(&mut c, &start(1, prompt.clone(), 12));
        let mut ids = Vec::new();
        let done = loop {
            match recv(&mut c) {
                FromWorker::Prefilled { .. } => {}
                FromWorker::Token { id, .. } => ids.push(id),
                FromWorker::Done {
                    finish, timings, ..
                } => break (finish, timings),
                other => panic!("unexpected {other:?}"),
            }
        };
        drop(c);
        assert_eq!(exit_code(child), 0);
        (ids, done)
    };
    let (ids1, (finish1, t1)) = lone(1);
    let (ids4, (finish4, t4)) = lone(4);
    assert_eq!(ids1, ids4);
    assert_eq!(finish1, finish4);
    assert!(t1.expert_requests > 0, "{t1:?}");
    assert_eq!(
        t1.expert_requests, t4.expert_requests,
        "1 slot {t1:?} vs 4 slots {t4:?}"
    );
}

/// A job of `n` choices: one `Prefilled`, then each choice's ids and its own `Done`, tagged with
/// its index; choice `i` of a job with seed `s` gets the ids of a job of one choice with seed
/// `s + i` (sampled, so the choices differ). A job asking more choices than the worker's slots
/// is refused alone as `Invalid` (the client's fault: serve answers 400).
#[test]
fn a_job_of_three_choices_gives_each_the_ids_of_its_seed_alone() {
    let mut sb = Sandbox::new("chan-n");
    start_store(&mut sb);
    let (child, mut c) = spawn(&sb, &sb.socket, 4, 64, &["--spec", "off"]);
    hello(&mut c);
    let job = |req_id: u64, seed: u64, n: u32| {
        let ToWorker::Start(mut s) = start(req_id, reference_prompt(), 10) else {
            unreachable!()
        };
        s.sampling = Sampling {
            temperature: 0.9,
            top_p: 1.0,
            seed,
        };
        s.n = n;
        ToWorker::Start(s)
    };
    // The choices: (choice → ids, ends), and how many `Prefilled` came.
    let run = |c: &mut UnixStream, m: ToWorker, n: usize| {
        send(c, &m);
        let mut ids: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let (mut prefilled, mut ends) = (0, 0);
        while ends < n {
            match recv(c) {
                FromWorker::Prefilled { .. } => {
                    assert!(ids.is_empty(), "Prefilled comes before the ids");
                    prefilled += 1;
                }
                FromWorker::Token { choice, id, .. } => ids.entry(choice).or_default().push(id),
                FromWorker::Done {
                    choice,
                    usage,
                    finish,
                    ..
                } => {
                    assert_ne!(finish, Finish::Cancelled);
                    assert_eq!(usage.generated as usize, ids[&choice].len());
                    assert_eq!(usage.prompt_ids as usize, reference_prompt().len());
                    ends += 1;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        (ids, prefilled)
    };
    let (three, prefilled) = run(&mut c, job(1, 100, 3), 3);
    assert_eq!(prefilled, 1, "one prefill for the job");
    assert_eq!(three.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    for i in 0..3u32 {
        let (alone, _) = run(&mut c, job(10 + u64::from(i), 100 + u64::from(i), 1), 1);
        assert_eq!(three[&i], alone[&0], "choice {i} = seed {} alone", 100 + i);
    }
    assert!(
        three[&0] != three[&1] || three[&1] != three[&2],
        "sampled choices differ"
    );
    send(&mut c, &job(20, 1, 5));
    match recv(&mut c) {
        FromWorker::Error {
            req_id: Some(20),
            kind,
            message,
            ..
        } => assert_eq!(kind, ErrorKind::Invalid, "{message}"),
        other => panic!("expected the refusal, got {other:?}"),
    }
    drop(c);
    assert_eq!(exit_code(child), 0);
}
