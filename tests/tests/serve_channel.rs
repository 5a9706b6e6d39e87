//! `k3-worker --serve-channel`: the typed job protocol of `k3_proto::serve` (docs/SPEC.md §6.12)
//! spoken to a real worker over a socket pair on its standard input, attached to a real store on
//! the tiny checkpoint. The ids are the float64 reference's; an error is a kind with the exit
//! code the worker then ends with; a cancel ends the job at a step boundary with `Done
//! {Cancelled}` and exit 0.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k3_proto::serve::{
    ErrorKind, Finish, FromWorker, Sampling, Start, ToWorker, JOB_PROTOCOL_VERSION, MAX_JOB_FRAME,
};
use k3_tests::*;

/// A worker taking its job from `chan`'s other end.
fn spawn(sb: &Sandbox, socket: &Path) -> (Child, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    ours.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let child = Command::new(bin("k3-worker"))
        .args(k3_worker::cli::serve_channel_args(socket, Some(1), None))
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

fn start(ids: Vec<u32>, max_new: u32) -> ToWorker {
    ToWorker::Start(Start {
        req_id: 7,
        ids,
        max_new,
        sampling: Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        },
        session: None,
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

#[test]
fn a_job_over_the_channel_gives_the_reference_ids_and_a_cancel_ends_it() {
    let mut sb = Sandbox::new("chan");
    start_store(&mut sb);
    let want = reference_greedy();
    let (child, mut c) = spawn(&sb, &sb.socket);
    hello(&mut c);
    send(&mut c, &start(reference_prompt(), want.len() as u32));
    let mut got = Vec::new();
    let mut prefilled = false;
    loop {
        match recv(&mut c) {
            FromWorker::Prefilled { req_id, .. } => {
                assert_eq!(req_id, 7);
                assert!(got.is_empty(), "Prefilled comes before the ids");
                prefilled = true;
            }
            FromWorker::Token { req_id, id } => {
                assert_eq!(req_id, 7);
                got.push(id);
            }
            FromWorker::Done { finish, usage, .. } => {
                assert_eq!(usage.generated as usize, got.len());
                assert_eq!(usage.prompt_ids as usize, reference_prompt().len());
                assert!(
                    matches!(finish, Finish::Length | Finish::EndId(_)),
                    "{finish:?}"
                );
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(prefilled);
    assert_eq!(got, want, "the channel's ids are the reference's");
    assert_eq!(exit_code(child), 0);

    // A cancel after the first id: the job ends at the next step with Done {Cancelled}, exit 0.
    let (child, mut c) = spawn(&sb, &sb.socket);
    hello(&mut c);
    send(&mut c, &start(reference_prompt(), 4096));
    let mut n = 0;
    loop {
        match recv(&mut c) {
            FromWorker::Prefilled { .. } => {}
            FromWorker::Token { .. } => {
                n += 1;
                if n == 1 {
                    send(&mut c, &ToWorker::Cancel { req_id: 7 });
                }
            }
            FromWorker::Done { finish, usage, .. } => {
                assert_eq!(finish, Finish::Cancelled);
                assert_eq!(usage.generated, n);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(n < 4096, "{n} ids after the cancel");
    assert_eq!(exit_code(child), 0);
}

#[test]
fn errors_arrive_as_a_kind_with_the_exit_code() {
    let sb = Sandbox::new("chan-err");
    // No store: NoStore, exit 3.
    let (child, mut c) = spawn(&sb, &sb.socket);
    hello(&mut c);
    send(&mut c, &start(vec![1, 2, 3], 4));
    match recv(&mut c) {
        FromWorker::Error {
            req_id,
            kind,
            exit_class,
            ..
        } => {
            assert_eq!(
                (req_id, kind, exit_class),
                (Some(7), ErrorKind::NoStore, k3_proto::exit::NO_STORE)
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(exit_code(child), k3_proto::exit::NO_STORE);
    // A job the command line would refuse: Refused, exit 2, before any work.
    let (child, mut c) = spawn(&sb, &sb.socket);
    hello(&mut c);
    send(&mut c, &start(vec![1, 2, 3], 0));
    match recv(&mut c) {
        FromWorker::Error {
            kind, exit_class, ..
        } => assert_eq!((kind, exit_class), (ErrorKind::Refused, 2)),
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(exit_code(child), 2);
    // Standard input that is not a socket: refused, exit 2.
    let r = sb.run("k3-worker", &["--serve-channel"]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("not a Unix socket"), "{r:?}");
}
