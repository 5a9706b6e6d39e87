//! Eviction policies and trace replay (`k3_store::runtime::policy`).

use k3_store::runtime::experts::Lru;
use k3_store::runtime::policy::{
    policy_by_name, replay_offline, replay_store, Counts, Offline, ReplayError, Trace, TraceBatch,
    MAX_LINE, POLICY_NAMES,
};

/// xorshift64*: a fixed-seed generator for reproducible random traces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn trace(batches: &[(u64, u32, &[u32])]) -> Trace {
    Trace {
        batches: batches
            .iter()
            .map(|&(step, layer, e)| TraceBatch {
                step,
                layer,
                experts: e.to_vec(),
            })
            .collect(),
        jobs: 1,
    }
}

/// A random trace: `n` batches over `layers` layers (cyclic or random order) of up to
/// `max_k` distinct experts among `experts`, with a skew towards low ids.
fn random_trace(rng: &mut Rng, n: usize, layers: u32, experts: u32, max_k: usize) -> Trace {
    let cyclic = rng.below(2) == 0;
    let mut t = Trace {
        batches: Vec::new(),
        jobs: 1,
    };
    for i in 0..n {
        let layer = if cyclic {
            i as u32 % layers
        } else {
            rng.below(layers as u64) as u32
        };
        let k = 1 + rng.below(max_k as u64) as usize;
        let mut ids = Vec::new();
        while ids.len() < k {
            let a = rng.below(experts as u64);
            let e = if rng.below(3) == 0 {
                a
            } else {
                a.min(rng.below(experts as u64))
            } as u32;
            if !ids.contains(&e) {
                ids.push(e);
            }
        }
        t.batches.push(TraceBatch {
            step: (i as u64) / layers as u64,
            layer,
            experts: ids,
        });
    }
    t
}

fn online(t: &Trace, name: &str, cap: usize) -> Counts {
    replay_store(t, cap, policy_by_name(name, cap).unwrap()).unwrap()
}

fn consistent(c: &Counts) {
    assert_eq!(c.resident_hits + c.misses, c.requests, "{c:?}");
    assert!(c.evictions <= c.misses, "{c:?}");
    assert!(c.decode_hits <= c.decode_requests && c.decode_requests <= c.requests);
}

#[test]
fn belady_is_never_worse_than_any_online_policy() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut strictly_better = 0;
    for round in 0..60 {
        let layers = 1 + rng.below(5) as u32;
        let experts = 2 + rng.below(14) as u32;
        let max_k = 1 + rng.below(experts.min(4) as u64) as usize;
        let t = random_trace(&mut rng, 300, layers, experts, max_k);
        for cap in [max_k, max_k + 1, max_k + 3, 2 * max_k + 5, 20] {
            let b = replay_offline(&t, cap, Offline::Belady).unwrap();
            consistent(&b);
            for name in POLICY_NAMES
                .iter()
                .copied()
                .chain(["lfu:0.5", "layer-lfu:16"])
            {
                let o = online(&t, name, cap);
                consistent(&o);
                assert_eq!(o.requests, b.requests);
                assert!(
                    b.resident_hits >= o.resident_hits,
                    "round {round} cap {cap}: belady {} < {name} {}",
                    b.resident_hits,
                    o.resident_hits
                );
                if b.resident_hits > o.resident_hits {
                    strictly_better += 1;
                }
            }
        }
    }
    // The property is not vacuous: the future often helps.
    assert!(strictly_better > 100, "{strictly_better}");
}

#[test]
fn cyclic_scan_larger_than_the_cache_defeats_lru_not_belady() {
    // 10 layers, one expert each, visited 0..9 in a cycle, 50 times; 5 slots.
    let mut b = Vec::new();
    for step in 0..50u64 {
        for l in 0..10u32 {
            b.push((step, l, &[3u32][..]));
        }
    }
    let t = trace(&b);
    let lru = online(&t, "lru", 5);
    assert_eq!(lru.resident_hits, 0, "{lru:?}");
    assert_eq!(lru.evictions, 495);
    let opt = replay_offline(&t, 5, Offline::Belady).unwrap();
    assert!(opt.resident_hits > 0);
    // OPT on a cycle of n = 10 with k = 5 slots: after the 5 cold misses, it misses
    // (n - k) / (n - 1) = 5/9 of the remaining 495 requests (275), and hits the other 220.
    assert_eq!((opt.evictions, opt.resident_hits), (275, 220), "{opt:?}");
    // Evicting the layer needed farthest ahead is exactly OPT on a pure cyclic scan (this also
    // fails if the table does not tell the policy the current layer).
    for name in ["layer", "layer-lfu", "layer-lrfu", "layer-age"] {
        let c = online(&t, name, 5);
        assert_eq!(c.resident_hits, opt.resident_hits, "{name}: {c:?}");
    }
}

#[test]
fn below_the_per_token_footprint_lru_gets_nothing_and_layer_age_does() {
    // 8 layers, uniformly random top-2 of 32 experts per layer, 200 tokens; 12 slots < the 16
    // experts a token touches, so LRU has evicted a layer's experts before it comes back.
    let mut rng = Rng(4242);
    let mut t = Trace {
        batches: Vec::new(),
        jobs: 1,
    };
    for step in 0..200u64 {
        for layer in 0..8u32 {
            let a = rng.below(32) as u32;
            let b = (a + 1 + rng.below(31) as u32) % 32;
            t.batches.push(TraceBatch {
                step,
                layer,
                experts: vec![a, b],
            });
        }
    }
    assert_eq!(online(&t, "lru", 12).resident_hits, 0);
    let age = online(&t, "layer-age", 12);
    let opt = replay_offline(&t, 12, Offline::Belady).unwrap();
    // Uniform routing: about (12 - 2) / 256 of requests can be kept for the next token.
    assert!(age.resident_hits > age.requests / 50, "{age:?}");
    assert!(opt.resident_hits >= age.resident_hits);
}

#[test]
fn simulator_counts_equal_a_real_slot_table_for_lru() {
    let mut rng = Rng(77);
    for _ in 0..40 {
        let layers = 1 + rng.below(6) as u32;
        let experts = 3 + rng.below(20) as u32;
        let max_k = 1 + rng.below(3) as usize;
        let t = random_trace(&mut rng, 400, layers, experts, max_k);
        for cap in [max_k, max_k + 2, 9, 31] {
            let sim = replay_offline(&t, cap, Offline::Lru).unwrap();
            let table = replay_store(&t, cap, Box::new(Lru::new(cap))).unwrap();
            assert_eq!(sim, table, "capacity {cap}");
            consistent(&sim);
        }
    }
}

#[test]
fn a_batch_never_evicts_its_own_members() {
    let t = trace(&[
        (0, 0, &[1, 2, 3]),
        // Hit 1, load 4 and 5: the victims must be 2 and 3, never the leased 1.
        (1, 0, &[1, 4, 5]),
        (2, 0, &[1]),
        // Three loads into three slots: none may evict another one of the same batch.
        (3, 1, &[7, 8, 9]),
        (4, 1, &[9, 8, 7]),
    ]);
    let expect = |c: &Counts, who: &str| {
        assert_eq!(
            (c.requests, c.resident_hits, c.misses, c.evictions),
            (13, 5, 8, 5),
            "{who}: {c:?}"
        );
    };
    expect(&replay_offline(&t, 3, Offline::Belady).unwrap(), "belady");
    expect(&replay_offline(&t, 3, Offline::Lru).unwrap(), "sim lru");
    for name in POLICY_NAMES {
        expect(&online(&t, name, 3), name);
    }
}

#[test]
fn capacity_below_the_batch_size_is_an_error() {
    let t = trace(&[(0, 0, &[1]), (0, 2, &[1, 2, 3]), (1, 0, &[5])]);
    let want = ReplayError::TooSmall {
        capacity: 2,
        batch: 3,
        step: 0,
        layer: 2,
    };
    assert_eq!(replay_offline(&t, 2, Offline::Belady), Err(want.clone()));
    assert_eq!(
        replay_store(&t, 2, policy_by_name("layer", 2).unwrap()),
        Err(want.clone())
    );
    assert!(want.to_string().contains("capacity 2 slots < batch of 3"));
    assert!(replay_offline(&t, 3, Offline::Belady).is_ok());
}

fn parse(text: &[u8]) -> Result<Trace, k3_store::runtime::policy::TraceError> {
    let mut t = Trace::default();
    t.push_job("t.jsonl", text)?;
    Ok(t)
}

#[test]
fn malformed_trace_lines_are_errors_with_line_numbers() {
    let good = "{\"step\":0,\"layer\":1,\"experts\":[4,5]}\n";
    let cases: &[(&str, &str)] = &[
        ("{\"step\":0,\"layer\":1}", "expected"),
        ("{\"step\":0,\"layer\":-1,\"experts\":[1]}", "expected"),
        ("{\"step\":0,\"layer\":1,\"experts\":[\"a\"]}", "expected"),
        ("{\"step\":0,\"layer\":1,\"experts\":[1]", "expected"),
        ("[1,2,3]", "expected"),
        (
            "{\"step\":0,\"layer\":1,\"experts\":[]}",
            "empty expert list",
        ),
        (
            "{\"step\":0,\"layer\":70000,\"experts\":[1]}",
            "layer 70000",
        ),
        (
            "{\"step\":0,\"layer\":1,\"experts\":[16777216]}",
            "expert id 16777216",
        ),
        (
            "{\"step\":0,\"layer\":1,\"experts\":[4294967296]}",
            "expected",
        ),
    ];
    for (bad, why) in cases {
        let text = format!("{good}\n{good}{bad}\n{good}");
        let e = parse(text.as_bytes()).unwrap_err();
        assert_eq!(e.line, 4, "{bad}: {e}");
        assert!(e.message.contains(why), "{bad}: {e}");
        assert!(e.to_string().starts_with("t.jsonl:4: "), "{e}");
    }
    let mut bin = good.as_bytes().to_vec();
    bin.extend_from_slice(b"{\"step\":0,\xff}\n");
    let e = parse(&bin).unwrap_err();
    assert_eq!((e.line, e.message.as_str()), (2, "not UTF-8"));
    // A line longer than the bound is refused without reading it whole.
    let mut long = good.as_bytes().to_vec();
    long.extend(std::iter::repeat_n(b' ', MAX_LINE + 10));
    let e = parse(&long).unwrap_err();
    assert_eq!(e.line, 2);
    assert!(e.message.contains("longer than"), "{e}");
}

#[test]
fn traces_concatenate_as_jobs_and_duplicates_are_one_request() {
    let mut t = parse(b"{\"step\":0,\"layer\":1,\"experts\":[4,5,4]}\n\n").unwrap();
    t.push_job(
        "u.jsonl",
        &b"{\"step\":0,\"layer\":1,\"experts\":[5],\"extra\":true}\n"[..],
    )
    .unwrap();
    assert_eq!(t.jobs, 2);
    assert_eq!(t.batches[0].experts, vec![4, 5]);
    assert_eq!((t.requests(), t.working_set(), t.max_batch().0), (3, 2, 2));
    // The cache persists between jobs: the second job's request is a hit.
    let c = replay_store(&t, 2, Box::new(Lru::new(2))).unwrap();
    assert_eq!((c.resident_hits, c.misses), (1, 2));
    assert!(Trace::read_files(&["/nonexistent/trace.jsonl"])
        .unwrap_err()
        .to_string()
        .contains("cannot open"));
}

#[test]
fn policies_are_constructed_by_name() {
    for name in POLICY_NAMES {
        assert_eq!(policy_by_name(name, 8).unwrap().name(), *name);
    }
    assert_eq!(policy_by_name("lfu:2.5", 8).unwrap().name(), "lfu");
    assert_eq!(
        policy_by_name("layer-lfu:1", 8).unwrap().name(),
        "layer-lfu"
    );
    assert_eq!(
        policy_by_name("layer-age:0.1", 8).unwrap().name(),
        "layer-age"
    );
    for bad in [
        "mru", "lfu:", "lfu:0", "lfu:-3", "lfu:nan", "lru:2", "layer:3", "lfu:1e9", "",
    ] {
        assert!(policy_by_name(bad, 8).is_none(), "{bad}");
    }
}

#[test]
fn decode_counts_exclude_the_prefill() {
    let t = trace(&[(0, 0, &[1, 2]), (1, 0, &[1, 3]), (2, 0, &[3])]);
    let c = replay_offline(&t, 4, Offline::Belady).unwrap();
    assert_eq!((c.decode_requests, c.decode_hits), (3, 2));
    assert_eq!(online(&t, "lru", 4), c);
}
