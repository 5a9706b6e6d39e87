//! The `k3-worker` binary on the bundled tiny checkpoint: greedy ids against the float64
//! reference, the JSON report, the logits dump, the cache trace, and refusals (exit 2).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A private output directory per test (removed on drop).
struct Sandbox(tempfile::TempDir);

impl Sandbox {
    fn new(tag: &str) -> Sandbox {
        Sandbox(
            tempfile::Builder::new()
                .prefix(&format!("k3-worker-cli-{tag}-"))
                .tempdir()
                .unwrap(),
        )
    }
    fn model(&self) -> PathBuf {
        root().join("fixtures/tiny/model")
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

fn worker(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3-worker"))
        .args(args)
        .output()
        .expect("run k3-worker")
}

fn ref_ids(name: &str) -> Vec<u32> {
    let p = root().join("fixtures/tiny/reference").join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn csv(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn stdout_ids(o: &Output) -> Vec<u32> {
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn greedy_run_matches_the_reference_and_writes_every_artifact() {
    let sb = Sandbox::new("greedy");
    let (out, logits, trace) = (sb.path("run.json"), sb.path("logits.f32"), sb.path("trace"));
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--preset",
        "laptop",
        "--ids",
        &prompt,
        "--gen",
        "20",
        "--out",
        s(&out),
        "--dump-logits",
        s(&logits),
        "--dump-cache-trace",
        s(&trace),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let want = ref_ids("greedy_ids.json");
    assert_eq!(stdout_ids(&o), want);
    assert!(
        err.contains("<- quote this") && err.contains("TRUE resident hit rate"),
        "{err}"
    );

    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(j["generated_ids"], serde_json::json!(want));
    assert_eq!(
        j["prompt_ids"],
        serde_json::json!(ref_ids("prompt_ids.json"))
    );
    assert_eq!(j["failed_expert_loads"], 0);
    assert!(j["peak_rss_bytes"].as_u64().unwrap() > 0);
    for k in [
        "seconds_per_token",
        "prefill_seconds",
        "bytes_read",
        "true_resident_hit_rate",
    ] {
        assert!(j[k].is_number(), "{k}: {}", j[k]);
    }
    // Per step: the time blocked on weights is part of the step, and all steps' waits are part
    // of the run's total.
    let steps = j["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 20);
    let mut waited = 0.0;
    for st in steps {
        let (w, r, t) = (
            st["io_wait_seconds"].as_f64().unwrap(),
            st["io_read_seconds"].as_f64().unwrap(),
            st["seconds"].as_f64().unwrap(),
        );
        assert!((0.0..=t).contains(&w) && r >= 0.0, "{st}");
        waited += w;
        // The phases of the step's forward pass are parts of the step; its expert wait is part
        // of its I/O wait.
        let ph = &st["phases"];
        let part = |k: &str| ph[k].as_f64().unwrap_or_else(|| panic!("{k}: {st}"));
        let parts = ["layer_wait", "attention", "mlp", "expert_wait", "lm_head"].map(part);
        assert!(parts.iter().all(|&v| v >= 0.0), "{st}");
        assert!(parts.iter().sum::<f64>() <= t + 1e-6, "{st}");
        assert!(part("expert_wait") <= w + 1e-6, "{st}");
        assert!(part("attention") > 0.0 && part("lm_head") > 0.0, "{st}");
    }
    assert!(
        waited <= j["io_wait_seconds"].as_f64().unwrap() + 1e-6,
        "{j}"
    );
    // time_breakdown: the decode steps' mean phases plus `other` make up s/token.
    let tb = &j["time_breakdown"];
    let keys = [
        "layer_wait_s",
        "attention_s",
        "mlp_s",
        "expert_wait_s",
        "lm_head_s",
        "other_s",
    ];
    let sum: f64 = keys
        .iter()
        .map(|k| tb[*k].as_f64().unwrap_or_else(|| panic!("{k}: {tb}")))
        .sum();
    let spt = j["seconds_per_token"].as_f64().unwrap();
    assert!((sum - spt).abs() <= 1e-6 * spt.max(1.0), "{tb} vs {spt}");
    assert!(tb["attention_s"].as_f64().unwrap() > 0.0, "{tb}");
    assert!(err.contains("per decoded token: attention"), "{err}");

    let got: Vec<f32> = std::fs::read(&logits)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let refl: Vec<f32> = std::fs::read(root().join("fixtures/tiny/reference/logits_step0.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(got.len(), 256);
    let num = got
        .iter()
        .zip(&refl)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let den = refl.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    assert!(num / den <= 1e-4, "{}", num / den);

    let lines = std::fs::read_to_string(trace.join("expert_trace.jsonl")).unwrap();
    let recs: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // 12 MoE layers (1..12) per step, 20 steps.
    assert_eq!(recs.len(), 12 * 20);
    assert_eq!(recs[0]["step"], 0);
    assert_eq!(recs[0]["layer"], 1);
    assert_eq!(recs[12]["step"], 1);
}

#[test]
fn full_recompute_and_chunked_prefill_give_the_same_ids() {
    let sb = Sandbox::new("full");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let m = sb.model();
    for extra in [
        &["--full-recompute", "--threads", "1"][..],
        &["--prefill-chunk", "5"][..],
    ] {
        let mut args = vec![
            "--standalone",
            s(&m),
            "--preset",
            "laptop",
            "--ids",
            &prompt,
            "--gen",
            "20",
        ];
        args.extend_from_slice(extra);
        let o = worker(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(stdout_ids(&o), ref_ids("greedy_ids.json"), "{extra:?}");
    }
}

/// A prompt longer than the old fixed chunk (600 ids, the reference prompt repeated) gives one
/// set of ids at chunks 1, 7, 512, 0 (whole) and `auto` — the default, which under a preset
/// whose prefill allowance holds the whole prompt runs it as one chunk (the report says which
/// chunk ran) — and an unknown value is a usage error.
#[test]
fn the_prefill_chunk_changes_no_id_and_auto_is_sized_from_the_plan() {
    let sb = Sandbox::new("chunks");
    let base = ref_ids("prompt_ids.json");
    let long: Vec<u32> = base.iter().cycle().take(600).copied().collect();
    let prompt = csv(&long);
    let m = sb.model();
    let mut first: Option<Vec<u32>> = None;
    for (chunk, ran) in [
        (Some("1"), 1),
        (Some("7"), 7),
        (Some("512"), 512),
        (Some("0"), 603),
        (Some("auto"), 603),
        (None, 603),
    ] {
        let out = sb.path("out.json");
        let mut args = vec![
            "--standalone",
            s(&m),
            "--preset",
            "laptop",
            "--ids",
            &prompt,
            "--gen",
            "4",
            "--spec",
            "off",
            "--out",
            s(&out),
        ];
        if let Some(c) = chunk {
            args.extend_from_slice(&["--prefill-chunk", c]);
        }
        let o = worker(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{chunk:?}: {err}");
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(j["prefill_chunk"], ran, "{chunk:?}: {j}");
        let ids = stdout_ids(&o);
        assert_eq!(ids.len(), 4, "{chunk:?}");
        match &first {
            None => first = Some(ids),
            Some(f) => assert_eq!(&ids, f, "--prefill-chunk {chunk:?} changed the ids"),
        }
    }
    let o = worker(&["--ids", "1", "--prefill-chunk", "big"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn usage_and_plan_problems_exit_2_before_any_work() {
    let sb = Sandbox::new("refuse");
    let m = sb.model();
    let tok = root().join("fixtures/tokenizer");
    let text = root().join("fixtures/trained/heldout.txt");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--standalone", s(&m), "--preset", "laptop"],
            "the following required arguments were not provided",
        ),
        // --perplexity: a text input (needs --tok), scoring ids, never generating them.
        (
            vec!["--standalone", s(&m), "--perplexity", s(&text)],
            "--tok",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--tok",
                s(&tok),
                "--perplexity",
                s(&text),
                "--gen",
                "4",
            ],
            "cannot be used with",
        ),
        (
            vec!["--standalone", s(&m), "--ids", "1", "--kl-base", "x.k3lp"],
            "--perplexity",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--tok",
                s(&tok),
                "--perplexity",
                s(&text),
                "--ppl-window",
                "0",
            ],
            "--ppl-window",
        ),
        // The tiny model's 256-id vocabulary cannot score the real tokenizer's ids.
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--tok",
                s(&tok),
                "--perplexity",
                s(&text),
            ],
            "outside the vocabulary",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--ids",
                "1",
                "--prompt",
                "x",
            ],
            "cannot be used with",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--ids",
                "1,256",
            ],
            "outside the vocabulary",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--ids",
                "1",
                "--gen",
                "0",
            ],
            "--gen",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--ids",
                "1",
                "--layers",
                "14",
            ],
            "--layers",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--prompt",
                "hi",
            ],
            "--tok",
        ),
        (
            vec!["--standalone", s(&m), "--preset", "nope", "--ids", "1"],
            "invalid value 'nope'",
        ),
        (
            vec![
                "--standalone",
                s(&m),
                "--preset",
                "laptop",
                "--ids",
                "1",
                "--top-p",
                "0",
            ],
            "--top-p",
        ),
        (
            vec!["--standalone", s(&m), "--preset", "laptop", "--ids", "x"],
            "invalid value",
        ),
    ];
    for (args, needle) in cases {
        let o = worker(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?} produced output");
    }
}

#[test]
fn layers_flag_runs_a_prefix_of_the_model() {
    let sb = Sandbox::new("layers");
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--preset",
        "laptop",
        "--ids",
        "5,6,7",
        "--gen",
        "3",
        "--layers",
        "5",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("layers=5") && err.contains("KKKMK"), "{err}");
    assert_eq!(stdout_ids(&o).len(), 3);
}

#[test]
fn seeded_sampling_is_reproducible_and_mode_independent() {
    let sb = Sandbox::new("sample");
    let m = sb.model();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--standalone",
            s(&m),
            "--preset",
            "laptop",
            "--ids",
            "5,6,7,8",
            "--gen",
            "12",
            "--temperature",
            "1.5",
            "--top-p",
            "0.95",
        ];
        args.extend_from_slice(extra);
        let o = worker(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        stdout_ids(&o)
    };
    let a = run(&["--seed", "7"]);
    assert_eq!(a.len(), 12);
    assert_eq!(a, run(&["--seed", "7", "--full-recompute"]));
    assert_ne!(a, run(&["--seed", "8"]));
}

#[test]
fn dump_hidden_writes_npy_per_layer_intermediate_of_the_prefill() {
    let sb = Sandbox::new("hidden");
    let dir = sb.path("hidden");
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--preset",
        "laptop",
        "--ids",
        "5,6,7",
        "--gen",
        "3",
        "--dump-hidden",
        s(&dir),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 13 * 4 + 1, "{names:?}");
    assert!(
        names.contains(&"L12.mlp_out.npy".to_string())
            && names.contains(&"final_in.npy".to_string())
    );
    let b = std::fs::read(dir.join("L3.attn_out.npy")).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hl) % 64, 0);
    let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
    assert!(header.contains("'shape': (3, 128)"), "{header}");
    assert_eq!(b.len(), 10 + hl + 3 * 128 * 4, "prefill only: 3 tokens");
}

#[test]
fn attached_mode_without_a_store_exits_3_and_refuses_standalone_flags() {
    let sb = Sandbox::new("attach");
    let sock = sb.path("none.sock");
    let o = worker(&["--socket", s(&sock), "--ids", "1,2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("none.sock"), "{err}");
    // Budget flags belong to --standalone: refused (2) before trying to connect.
    let o = worker(&["--socket", s(&sock), "--preset", "laptop", "--ids", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
    // --socket and --standalone are exclusive.
    let o = worker(&[
        "--socket",
        s(&sock),
        "--standalone",
        s(&sb.model()),
        "--ids",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn with_a_tokenizer_text_is_streamed_and_prompts_are_encoded() {
    let sb = Sandbox::new("tok");
    let tok = root().join("fixtures/tokenizer");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--preset",
        "laptop",
        "--ids",
        &prompt,
        "--gen",
        "20",
        "--tok",
        s(&tok),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let t = k3_worker::tokenizer::Tokenizer::from_dir(&tok).unwrap();
    let mut want = t.decode(&ref_ids("greedy_ids.json")).unwrap();
    want.push(b'\n');
    assert_eq!(
        o.stdout, want,
        "stdout = the decoded bytes of the greedy ids"
    );

    // "Hello world" encodes to [19180, 2695] (SPEC.md §5.2): outside the tiny vocabulary.
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--preset",
        "laptop",
        "--prompt",
        "Hello world",
        "--tok",
        s(&tok),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("prompt id 19180 outside the vocabulary of 256"),
        "{err}"
    );
}

#[test]
fn every_simd_tier_gives_the_reference_ids_and_a_bad_tier_is_refused() {
    let sb = Sandbox::new("tiers");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let want = ref_ids("greedy_ids.json");
    let run = |tier: &str, threads: &str| {
        Command::new(env!("CARGO_BIN_EXE_k3-worker"))
            .args([
                "--standalone",
                s(&sb.model()),
                "--preset",
                "laptop",
                "--ids",
                &prompt,
                "--gen",
                "20",
                "--threads",
                threads,
            ])
            .env("K3_SIMD", tier)
            .output()
            .expect("run k3-worker")
    };
    for tier in ["scalar", "avx2", "avx512"] {
        for threads in ["1", "2"] {
            let o = run(tier, threads);
            let err = String::from_utf8_lossy(&o.stderr);
            if o.status.code() == Some(2) && err.contains("lacks the instructions") {
                eprintln!("skipping {tier}: this CPU lacks it");
                continue;
            }
            assert_eq!(o.status.code(), Some(0), "{tier}/{threads}: {err}");
            assert!(err.contains(&format!("kernels: {tier} tier")), "{err}");
            assert_eq!(stdout_ids(&o), want, "{tier} tier, {threads} threads");
        }
    }
    let o = run("avx9000", "1");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("avx9000") && err.contains("not a SIMD tier"),
        "{err}"
    );
}

#[test]
fn a_cache_smaller_than_the_prefill_union_still_gives_the_reference_ids() {
    // Tiny experts are 6528 bytes; a slot is align_up(6528) + 4096 = 12288 bytes, so 40 kB of
    // cache is 3 slots, while the 12-token prompt routes up to 8 distinct experts per layer.
    let sb = Sandbox::new("small-cache");
    let trace = sb.path("trace");
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--trunk-gb",
        "1",
        "--cache-gb",
        "0.00004",
        "--ids",
        &csv(&ref_ids("prompt_ids.json")),
        "--gen",
        "20",
        "--dump-cache-trace",
        s(&trace),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(stdout_ids(&o), ref_ids("greedy_ids.json"));
    let lines = std::fs::read_to_string(trace.join("expert_trace.jsonl")).unwrap();
    let mut widest = 0;
    let mut prefill_union: std::collections::BTreeMap<u64, std::collections::BTreeSet<u64>> =
        Default::default();
    for line in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let ids = v["experts"].as_array().unwrap();
        widest = widest.max(ids.len());
        if v["step"] == 0 {
            prefill_union
                .entry(v["layer"].as_u64().unwrap())
                .or_default()
                .extend(ids.iter().map(|i| i.as_u64().unwrap()));
        }
    }
    assert!(
        widest <= 3,
        "a request of {widest} experts exceeds the 3 slots"
    );
    assert!(
        prefill_union.values().any(|u| u.len() > 3),
        "the test needs a prefill whose union exceeds the cache"
    );
}

/// The tiny checkpoint's shards (symlinked) under `dir` with `config` as its config.json.
fn checkpoint_with_config(dir: &Path, config: &serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(root().join("fixtures/tiny/model")).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name != "config.json" {
            std::os::unix::fs::symlink(e.path(), dir.join(&name)).unwrap();
        }
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

#[test]
fn flat_config_and_a_decoy_head_dim_give_the_reference_ids() {
    let sb = Sandbox::new("shapes");
    let nested: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/tiny/model/config.json")).unwrap(),
    )
    .unwrap();
    // Flat shape (SPEC.md §1.3): every text_config key at the root, the KDA keys hoisted and
    // renamed, SiTU betas renamed, no kda_layers (derived as the complement).
    let text = nested["text_config"].as_object().unwrap();
    let mut flat = serde_json::Map::new();
    for (k, v) in text {
        match k.as_str() {
            "linear_attn_config" => {}
            "activation_situ_beta" => {
                flat.insert("situ_beta".into(), v.clone());
            }
            "activation_situ_linear_beta" => {
                flat.insert("situ_linear_beta".into(), v.clone());
            }
            _ => {
                flat.insert(k.clone(), v.clone());
            }
        }
    }
    let lin = text["linear_attn_config"].as_object().unwrap();
    for (k, v) in lin {
        match k.as_str() {
            "num_heads" => flat.insert("kda_num_heads".into(), v.clone()),
            "head_dim" => flat.insert("kda_head_dim".into(), v.clone()),
            "kda_layers" => None,
            _ => flat.insert(k.clone(), v.clone()),
        };
    }
    // A re-saved config may carry text_config.head_dim = hidden / heads (32 here, while the
    // KDA head dim is 16): a reader that lets it win binds the wrong shapes.
    let mut decoy = nested.clone();
    let hd = nested["text_config"]["hidden_size"].as_u64().unwrap()
        / nested["text_config"]["num_attention_heads"]
            .as_u64()
            .unwrap();
    assert_ne!(hd, lin["head_dim"].as_u64().unwrap());
    decoy["text_config"]["head_dim"] = serde_json::json!(hd);
    let prompt = csv(&ref_ids("prompt_ids.json"));
    for (name, cfg) in [("flat", serde_json::Value::Object(flat)), ("decoy", decoy)] {
        let dir = sb.path(name);
        checkpoint_with_config(&dir, &cfg);
        let o = worker(&[
            "--standalone",
            s(&dir),
            "--preset",
            "laptop",
            "--ids",
            &prompt,
            "--gen",
            "20",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{name}: {err}");
        if name == "flat" {
            assert!(err.contains("flat shape"), "{err}");
        }
        assert_eq!(stdout_ids(&o), ref_ids("greedy_ids.json"), "{name}");
    }
}

#[test]
fn every_cache_policy_gives_the_reference_ids_and_unknown_ones_are_refused() {
    let sb = Sandbox::new("policies");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let run = |policy: &str, out: &Path| {
        worker(&[
            "--standalone",
            s(&sb.model()),
            "--trunk-gb",
            "1",
            "--cache-gb",
            "0.00005", // 4 slots: every token evicts
            "--cache-policy",
            policy,
            "--ids",
            &prompt,
            "--gen",
            "20",
            "--out",
            s(out),
        ])
    };
    let mut hits = Vec::new();
    for policy in k3_store::runtime::policy::POLICY_NAMES {
        let out = sb.path(&format!("{policy}.json"));
        let o = run(policy, &out);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{policy}: {err}");
        assert_eq!(stdout_ids(&o), ref_ids("greedy_ids.json"), "{policy}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        hits.push(v["resident_hits"].as_u64().unwrap());
    }
    assert!(
        hits.iter().any(|&h| h != hits[0]),
        "policies should differ in what they keep resident: {hits:?}"
    );
    let o = run("belady", &sb.path("x.json"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("unknown cache policy \"belady\"") && err.contains("layer-age"),
        "{err}"
    );
}

#[test]
fn step0_logits_are_bit_identical_across_budgets_threads_and_modes() {
    let sb = Sandbox::new("logits-bits");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let runs: [(&str, &[&str]); 6] = [
        ("resident-2t", &["--preset", "laptop", "--threads", "2"]),
        ("resident-1t", &["--preset", "laptop", "--threads", "1"]),
        // Nothing pinned (a ring of the largest layer, 227 KB, in 300 KB) and a 3-slot expert
        // cache: everything streams.
        (
            "streaming",
            &["--trunk-gb", "0.0003", "--cache-gb", "0.00004"],
        ),
        // 3 layers pinned and a 0.41 MB ring (two layers): the reader works ahead.
        (
            "streaming-ahead",
            &["--trunk-gb", "0.00105", "--cache-gb", "0.00004"],
        ),
        ("recompute", &["--preset", "laptop", "--full-recompute"]),
        ("chunked", &["--preset", "laptop", "--prefill-chunk", "5"]),
    ];
    let model = sb.model();
    let mut first: Option<Vec<u8>> = None;
    for (name, extra) in runs {
        let path = sb.path(&format!("{name}.f32"));
        let mut args = vec![
            "--standalone",
            s(&model),
            "--ids",
            &prompt,
            "--gen",
            "2",
            "--dump-logits",
            s(&path),
        ];
        args.extend_from_slice(extra);
        let o = worker(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{name}: {err}");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 256 * 4, "{name}");
        match &first {
            None => first = Some(bytes),
            Some(f) => assert!(f == &bytes, "{name}: step-0 logits differ in their bits"),
        }
    }
}

/// A small vector that may be stored as BF16 or F32 (SPEC.md §2).
fn is_small_vector(name: &str) -> bool {
    [
        "norm.weight",
        "_res_proj.weight",
        "attention_res_proj.weight",
        "conv1d.weight",
        "A_log",
        "dt_bias",
        "e_score_correction_bias",
    ]
    .iter()
    .any(|s| name.ends_with(s))
        || name.ends_with("output_res_proj.weight")
}

/// Copy the checkpoint `src` to `dst` with every BF16 small vector stored as F32 (widened
/// exactly, so the model is the same function).
fn widen_vectors(src: &Path, dst: &Path) -> usize {
    std::fs::create_dir_all(dst).unwrap();
    let mut widened = 0;
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if !name.ends_with(".safetensors") {
            std::fs::copy(&path, dst.join(&name)).unwrap();
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let hl = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes[8..8 + hl]).unwrap();
        let data = &bytes[8 + hl..];
        let mut entries: Vec<(String, serde_json::Value)> = header.into_iter().collect();
        entries.sort_by_key(|(_, v)| v["data_offsets"][0].as_u64().unwrap_or(0));
        let (mut out_header, mut out_data) = (serde_json::Map::new(), Vec::new());
        for (k, mut v) in entries {
            if k == "__metadata__" {
                out_header.insert(k, v);
                continue;
            }
            let (a, b) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let mut t = data[a..b].to_vec();
            if v["dtype"] == "BF16" && is_small_vector(&k) {
                t = t
                    .chunks_exact(2)
                    .flat_map(|p| ((u16::from_le_bytes([p[0], p[1]]) as u32) << 16).to_le_bytes())
                    .collect();
                v["dtype"] = "F32".into();
                widened += 1;
            }
            let start = out_data.len();
            out_data.extend_from_slice(&t);
            v["data_offsets"] = serde_json::json!([start, out_data.len()]);
            out_header.insert(k, v);
        }
        let h = serde_json::to_vec(&out_header).unwrap();
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&h);
        file.extend_from_slice(&out_data);
        std::fs::write(dst.join(&name), file).unwrap();
    }
    widened
}

#[test]
fn no_budget_flag_plans_auto_and_f32_vectors_give_the_reference_ids() {
    let sb = Sandbox::new("auto-f32");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    // No memory flag: `--preset auto` is implied and printed.
    let o = worker(&[
        "--standalone",
        s(&sb.model()),
        "--ids",
        &prompt,
        "--gen",
        "20",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("auto ("),
        "the plan names the auto budget: {err}"
    );
    assert_eq!(stdout_ids(&o), ref_ids("greedy_ids.json"));
    // The same checkpoint with every small vector stored as F32.
    let f32_model = sb.path("f32-model");
    let n = widen_vectors(&sb.model(), &f32_model);
    assert!(n > 13 * 4, "only {n} vectors widened");
    for extra in [&[][..], &["--preset", "laptop"][..]] {
        let mut args = vec![
            "--standalone",
            s(&f32_model),
            "--ids",
            &prompt,
            "--gen",
            "20",
        ];
        args.extend_from_slice(extra);
        let o = worker(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(0), "{err}");
        assert_eq!(stdout_ids(&o), ref_ids("greedy_ids.json"), "{extra:?}");
    }
}

#[test]
fn impossible_threads_and_unwritable_outputs_are_refused_before_any_work() {
    let sb = Sandbox::new("preflight");
    let prompt = csv(&ref_ids("prompt_ids.json"));
    let model = sb.model();
    let base = ["--standalone", s(&model), "--ids", &prompt, "--gen", "4"];
    let cases: &[(&[&str], &str)] = &[
        (&["--threads", "4096"], "exceeds the"),
        (&["--out", "/proc/k3-no-such-dir/run.json"], "cannot write"),
        (
            &["--dump-logits", "/proc/k3-no-such-dir/l.f32"],
            "cannot write",
        ),
        (&["--dump-hidden", "/proc/k3-no-such-dir"], "cannot write"),
    ];
    for (extra, want) in cases {
        let args: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
        let t0 = std::time::Instant::now();
        let o = worker(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert!(o.stdout.is_empty(), "{extra:?}: generated before refusing");
        assert!(
            !err.contains("STEP"),
            "{extra:?}: ran before refusing: {err}"
        );
        assert!(t0.elapsed().as_secs() < 30);
    }
}
