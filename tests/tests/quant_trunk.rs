//! The quantized trunk (issue 48, item 1) with real processes: `k3-ctl pack-trunk --codec
//! int8|int4` on the bundled tiny checkpoint runs standalone and through the store, every layer
//! pinned and every layer streamed, at 1 and 2 threads, with one set of ids; and every output of
//! such a run says it is lossy — the worker's log, report and `--out`, the store's log,
//! `k3-ctl status` and `stats`, and serve's `/v1/models` — while an exact trunk's say it is not.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use k3_tests::{
    generated_ids, ids_arg, path_str, poll_until, printed_ids, reference_prompt, tiny_model,
    trunk_layer_bufs, Run, Sandbox, Spawned,
};
use serde_json::Value;

/// Budget flags: every layer pinned, or none (a ring of the largest run, a tiny expert cache).
fn budget(trunk: &Path, pinned: bool) -> Vec<String> {
    if pinned {
        return vec!["--preset".into(), "laptop".into()];
    }
    let ring = trunk_layer_bufs(trunk).into_iter().max().unwrap();
    vec![
        "--trunk-gb".into(),
        k3_tests::gb_arg(ring),
        "--cache-gb".into(),
        "0.001".into(),
    ]
}

/// `k3-worker --standalone` on the reference prompt, 16 greedy tokens: the run and its report.
fn standalone(sb: &Sandbox, trunk: &Path, budget: &[String], threads: &str) -> (Run, Value) {
    let model = tiny_model();
    let ids = ids_arg(&reference_prompt());
    let mut args = vec![
        "--standalone",
        path_str(&model),
        "--trunk",
        path_str(trunk),
        "--ids",
        &ids,
        "--gen",
        "16",
        "--threads",
        threads,
    ];
    args.extend(budget.iter().map(String::as_str));
    let (r, j) = sb.worker_json(&args);
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(printed_ids(&r), generated_ids(&j));
    (r, j)
}

/// The worker says what its trunk is: lossy (with the label) or exact, in its log, its report
/// lines and `--out`.
fn assert_labelled(r: &Run, j: &Value, codec: &str, lossy: bool, what: &str) {
    assert_eq!(j["trunk"]["codec"], codec, "{what}: {j}");
    assert_eq!(j["trunk"]["lossy"], lossy, "{what}: {j}");
    let label = format!("LOSSY: {codec} trunk");
    if lossy {
        let l = j["trunk"]["label"].as_str().unwrap_or_default();
        assert!(
            l.starts_with(&label) && l.contains("docs/BENCHMARKS.md"),
            "{what}: {l}"
        );
        // The log's warning and the report's line.
        assert!(
            r.stderr.matches(&label).count() >= 2,
            "{what}: the log and the report name it: {}",
            r.stderr
        );
    } else {
        assert!(j["trunk"]["label"].is_null(), "{what}: {j}");
        assert!(!r.stderr.contains("LOSSY"), "{what}: {}", r.stderr);
    }
}

/// `GET /v1/models` of a `k3-ctl serve` in front of the sandbox's store: its one model object.
fn served_model(sb: &Sandbox) -> Value {
    let sock = path_str(&sb.socket).to_string();
    let serve: Spawned = sb.spawn(
        "k3-ctl",
        &["serve", "--socket", &sock, "--listen", "127.0.0.1:0"],
    );
    let port = poll_until(Duration::from_secs(30), || {
        let out = std::fs::read_to_string(&serve.stdout_path).ok()?;
        let at = out.find("listening on http://127.0.0.1:")? + 30;
        out[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse::<u16>()
            .ok()
    })
    .expect("serve printed its port");
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    drop(serve);
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {resp}"));
    v["data"][0].clone()
}

/// Every mode of one trunk: the ids (one set for all) and each output's label.
fn run_everywhere(sb: &mut Sandbox, trunk: &Path, codec: &str, lossy: bool) -> Vec<u32> {
    let (r, j) = standalone(sb, trunk, &budget(trunk, true), "1");
    assert_labelled(&r, &j, codec, lossy, "standalone pinned");
    let ids = generated_ids(&j);
    for (pinned, threads) in [(true, "2"), (false, "1"), (false, "2")] {
        let (r, j) = standalone(sb, trunk, &budget(trunk, pinned), threads);
        let what = format!("standalone pinned={pinned} threads={threads}");
        assert_labelled(&r, &j, codec, lossy, &what);
        assert_eq!(generated_ids(&j), ids, "{what}");
    }
    for pinned in [true, false] {
        let model = tiny_model();
        let mut args = vec![path_str(&model).to_string(), "--trunk".into()];
        args.push(path_str(trunk).into());
        args.extend(budget(trunk, pinned));
        sb.start_store(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let p = ids_arg(&reference_prompt());
        let (r, j) = sb.worker_json(&["--ids", &p, "--gen", "16", "--threads", "1"]);
        let what = format!("attached pinned={pinned}");
        assert_eq!(r.code, 0, "{what}: {r:?}");
        assert_labelled(&r, &j, codec, lossy, &what);
        assert_eq!(generated_ids(&j), ids, "{what}");
        // The store's own outputs.
        let st = sb.ctl(&["status"]);
        assert_eq!(st.code, 0, "{st:?}");
        let kind = if lossy { "LOSSY" } else { "exact" };
        assert!(
            st.stdout.contains(&format!("({codec}, {kind})")),
            "{what}: status {}",
            st.stdout
        );
        let stats = sb.stats();
        assert_eq!(stats["trunk"]["codec"], codec, "{stats}");
        assert_eq!(stats["trunk"]["lossy"].as_str().unwrap().is_empty(), !lossy);
        let text = sb.ctl(&["stats"]);
        assert_eq!(text.stdout.contains("LOSSY"), lossy, "{}", text.stdout);
        assert_eq!(st.stdout.contains("LOSSY:"), lossy, "{}", st.stdout);
        let log = std::fs::read_to_string(sb.store_log()).unwrap_or_default();
        assert_eq!(
            log.contains(&format!("LOSSY: {codec} trunk")),
            lossy,
            "{what}: store log {log}"
        );
        if pinned {
            let m = served_model(sb);
            assert_eq!(m["k3_trunk"]["codec"], codec, "{m}");
            assert_eq!(m["k3_trunk"]["lossy"], lossy, "{m}");
            assert_eq!(m["k3_trunk"]["label"].is_string(), lossy, "{m}");
        }
        sb.stop_store();
    }
    ids
}

#[test]
fn a_quantized_trunk_runs_everywhere_with_one_set_of_ids_and_says_it_is_lossy() {
    let mut sb = Sandbox::new("quant");
    let model = tiny_model();
    let exact = sb.pack_trunk_with(&model, "ecbf16", &["--codec", "ecbf16"]);
    let exact_ids = run_everywhere(&mut sb, &exact, "ecbf16", false);
    assert_eq!(&exact_ids[..], &k3_tests::reference_greedy()[..16]);
    let mut sizes = Vec::new();
    for kind in ["int8", "int4"] {
        let trunk = sb.pack_trunk_with(&model, kind, &["--codec", kind]);
        let j: Value =
            serde_json::from_str(&std::fs::read_to_string(trunk.join("trunk.json")).unwrap())
                .unwrap();
        assert_eq!(j["codec"], kind);
        sizes.push(trunk_layer_bufs(&trunk).iter().sum::<u64>());
        run_everywhere(&mut sb, &trunk, kind, true);
    }
    // int4 is smaller than int8, which is smaller than the exact coded trunk.
    let exact_size: u64 = trunk_layer_bufs(&exact).iter().sum();
    assert!(
        sizes[1] < sizes[0] && sizes[0] < exact_size,
        "{sizes:?} vs {exact_size}"
    );
}
