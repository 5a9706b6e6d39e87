//! `k3-worker --batch` end to end (continuous batching in one worker): real processes, the
//! bundled tiny checkpoint. The reference prompt's ids must be the float64 reference's; every
//! other request's ids must be the ones the same worker gives it alone — standalone at a
//! streaming budget and attached to a store, greedy and seeded sampling, with sequences joining
//! as others end and prompts fed in chunks beside decoding rows, and with speculation on
//! (history and n-gram drafts attached, a draft model standalone) as draft rows of the batch's
//! passes.

use k3_tests::{
    generated_ids as generated, ids_arg, path_str, reference_greedy, reference_prompt, tiny_model,
    Run, Sandbox,
};
use serde_json::Value;

/// The requests: the reference prompt (20 ids) and four others of mixed lengths.
fn requests() -> Vec<(Vec<u32>, usize)> {
    vec![
        (vec![5, 17, 3, 88, 42], 9),
        (reference_prompt(), 20),
        (vec![9], 12),
        ((0..23).map(|i| (i * 37 + 5) % 250).collect(), 6),
        (vec![61, 2, 8, 100, 200], 10),
    ]
}

fn batch_file(sb: &Sandbox, reqs: &[(Vec<u32>, usize)]) -> String {
    let text: String = reqs
        .iter()
        .map(|(ids, n)| format!("{}\n", serde_json::json!({"ids": ids, "max_tokens": n})))
        .collect();
    let path = sb.dir.join("batch.jsonl");
    std::fs::write(&path, text).unwrap();
    path_str(&path).to_string()
}

/// The result lines, by request index.
fn results(r: &Run, n: usize) -> Vec<Vec<u32>> {
    assert_eq!(r.code, 0, "batch failed: {r:?}");
    let mut out = vec![None; n];
    for line in r.stdout.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let i = v["index"].as_u64().unwrap() as usize;
        assert!(out[i].is_none(), "request {i} answered twice: {r:?}");
        out[i] = Some(generated(&serde_json::json!({"generated_ids": v["ids"]})));
    }
    out.into_iter()
        .enumerate()
        .map(|(i, o)| o.unwrap_or_else(|| panic!("no result for request {i}: {r:?}")))
        .collect()
}

/// Each request alone through the same worker mode (`mode` = its flags).
fn solo(sb: &Sandbox, mode: &[&str], reqs: &[(Vec<u32>, usize)]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|(ids, n)| {
            let ids = ids_arg(ids);
            let n = n.to_string();
            let mut args = vec!["--ids", ids.as_str(), "--gen", n.as_str(), "--spec", "off"];
            args.extend_from_slice(mode);
            let (r, j) = sb.worker_json(&args);
            assert_eq!(r.code, 0, "solo failed: {r:?}");
            generated(&j)
        })
        .collect()
}

fn check(sb: &Sandbox, mode: &[&str], batch_run: impl Fn(&[&str]) -> Run) {
    let reqs = requests();
    let file = batch_file(sb, &reqs);
    let want = solo(sb, mode, &reqs);
    // Greedy: the reference prompt's ids are the float64 reference's.
    assert_eq!(want[1], reference_greedy(), "solo {mode:?}");
    for (parallel, chunk) in [("2", "4"), ("5", "0"), ("3", "1")] {
        let mut args = vec!["--batch", file.as_str(), "--parallel", parallel];
        args.extend_from_slice(&["--prefill-chunk", chunk]);
        args.extend_from_slice(mode);
        let got = results(&batch_run(&args), reqs.len());
        assert_eq!(
            got, want,
            "{mode:?} --parallel {parallel} --prefill-chunk {chunk}"
        );
    }
}

#[test]
fn batched_ids_equal_solo_ids_standalone_at_a_streaming_budget() {
    let sb = Sandbox::new("batch-standalone");
    let model = tiny_model();
    let trunk = sb.pack_tiny_trunk();
    let mode = [
        "--standalone",
        path_str(&model),
        "--trunk",
        path_str(&trunk),
        "--trunk-gb",
        "0.001",
        "--cache-gb",
        "0.0002",
    ];
    check(&sb, &mode, |args| sb.run("k3-worker", args));
    // Seeded sampling: each sequence draws as it does alone.
    let sampled = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"];
    let reqs = requests();
    let file = batch_file(&sb, &reqs);
    let mut m = mode.to_vec();
    m.extend_from_slice(&sampled);
    let want = solo(&sb, &m, &reqs);
    let mut args = vec!["--batch", file.as_str(), "--parallel", "3"];
    args.extend_from_slice(&m);
    assert_eq!(results(&sb.run("k3-worker", &args), reqs.len()), want);
}

#[test]
fn batched_ids_equal_solo_ids_attached_to_a_store() {
    let mut sb = Sandbox::new("batch-attached");
    let model = tiny_model();
    let trunk = sb.pack_tiny_trunk();
    sb.start_store(&[
        path_str(&model),
        "--trunk",
        path_str(&trunk),
        "--trunk-gb",
        "0.001",
        "--cache-gb",
        "0.01",
    ]);
    check(&sb, &[], |args| sb.worker(args));
}

#[test]
fn a_bad_batch_file_is_refused_naming_its_line() {
    let sb = Sandbox::new("batch-bad");
    let model = tiny_model();
    let path = sb.dir.join("bad.jsonl");
    for (text, want) in [
        (
            "{\"ids\": [1, 2]}\n{\"ids\": [1], \"max_tokens\": 0}\n",
            "bad.jsonl:2: max_tokens 0",
        ),
        (
            "{\"ids\": [1]}\n{\"ids\": [999999]}\n",
            "request 2 (line order): prompt id 999999",
        ),
        ("{\"ids\": [1]}\nnot json\n", "bad.jsonl:2:"),
        ("\n", "no requests"),
    ] {
        std::fs::write(&path, text).unwrap();
        let r = sb.run(
            "k3-worker",
            &["--standalone", path_str(&model), "--batch", path_str(&path)],
        );
        assert_eq!(r.code, 2, "{text:?}: {r:?}");
        assert!(r.stderr.contains(want), "{text:?}: {r:?}");
        assert!(r.stdout.is_empty(), "{text:?}: {r:?}");
    }
}

/// The `--batch` report (`--out`): the requests' records, by index.
fn records(sb: &Sandbox, args: &[&str]) -> (Vec<Vec<u32>>, Vec<Value>) {
    let (r, v) = sb.worker_json(args);
    assert_eq!(r.code, 0, "batch failed: {r:?}");
    let recs = v["requests"]
        .as_array()
        .expect("a record per request")
        .clone();
    let n = recs.len();
    (results(&r, n), recs)
}

fn drafted_and_accepted(recs: &[Value]) -> (u64, u64) {
    recs.iter().fold((0, 0), |(d, a), r| {
        (
            d + r["drafted_tokens"].as_u64().unwrap(),
            a + r["accepted_tokens"].as_u64().unwrap(),
        )
    })
}

/// Speculation inside a batch, attached: the solo runs record their streams in the store's
/// history, so the batch's history drafts are the solo ids themselves (accepted), its n-gram
/// drafts whatever the prompts repeat; every request's ids are still its solo ids, and the
/// `--out` record of each request counts its drafts.
#[test]
fn batched_ids_equal_solo_ids_with_history_and_ngram_drafts() {
    let mut sb = Sandbox::new("batch-spec");
    let model = tiny_model();
    let trunk = sb.pack_tiny_trunk();
    sb.start_store(&[path_str(&model), "--trunk", path_str(&trunk)]);
    let mut reqs = requests();
    // A prompt that repeats itself gives the n-gram drafter something to propose.
    let mut quoting = vec![17, 200, 3, 99, 42, 128, 7];
    quoting.extend_from_within(..);
    reqs.push((quoting, 10));
    let file = batch_file(&sb, &reqs);
    let want = solo(&sb, &[], &reqs);
    for (drafters, parallel) in [("history", "3"), ("ngram", "6"), ("history,ngram", "2")] {
        let (got, recs) = records(
            &sb,
            &[
                "--batch",
                file.as_str(),
                "--parallel",
                parallel,
                "--spec",
                "4",
                "--draft",
                drafters,
            ],
        );
        assert_eq!(got, want, "--draft {drafters} --parallel {parallel}");
        let (drafted, accepted) = drafted_and_accepted(&recs);
        assert!(accepted <= drafted);
        if drafters.contains("history") {
            // The store holds every solo stream: its drafts are right.
            assert!(
                accepted > 0,
                "--draft {drafters}: no draft accepted: {recs:?}"
            );
            let passes: u64 = recs
                .iter()
                .map(|r| r["forward_passes"].as_u64().unwrap())
                .sum();
            let ids: u64 = want.iter().map(|w| w.len() as u64 - 1).sum();
            assert!(passes < ids, "{passes} decode passes for {ids} ids");
        }
    }
}

/// A draft model inside a batch (one draft trunk, a drafter per sequence), standalone: every
/// request's ids are its solo ids.
#[test]
fn batched_ids_equal_solo_ids_with_a_draft_model() {
    let sb = Sandbox::new("batch-draft");
    let model = tiny_model();
    let draft = sb.dir.join("draft-int8");
    let r = sb.run(
        "k3-ctl",
        &[
            "pack-trunk",
            "--draft",
            "int8",
            path_str(&model),
            path_str(&draft),
        ],
    );
    assert_eq!(r.code, 0, "{r:?}");
    let reqs = requests();
    let file = batch_file(&sb, &reqs);
    let mode = ["--standalone", path_str(&model)];
    let want = solo(&sb, &mode, &reqs);
    let (got, recs) = records(
        &sb,
        &[
            "--standalone",
            path_str(&model),
            "--batch",
            file.as_str(),
            "--parallel",
            "3",
            "--spec",
            "4",
            "--draft",
            "model",
            "--draft-trunk",
            path_str(&draft),
        ],
    );
    assert_eq!(got, want);
    let (drafted, accepted) = drafted_and_accepted(&recs);
    assert!(drafted > 0, "the draft model drafted nothing: {recs:?}");
    assert!(accepted <= drafted);
}
