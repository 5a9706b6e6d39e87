//! The store library over a synthetic checkpoint opened through the real index and config
//! reader (`k3_proto::safetensors`, `k3_proto::config`): catalog, packing, standalone source.

use crate::common;

use std::sync::Arc;

use common::fixture::{self, Spec};
use k3_store::runtime::catalog::Catalog;
use k3_store::runtime::plan::{Budget, BudgetFlag};
use k3_store::runtime::source::WeightSource;
use k3_store::runtime::standalone::{StandaloneOptions, StandaloneSource};
use k3_store::runtime::trunk::{
    open_shards, pack_trunk, Interrupt, PackOptions, TrunkCodec, TrunkLayout,
};

fn spec() -> Spec {
    let mut s = Spec::small(5, 6);
    s.n_shards = 3;
    s.reversed_experts = vec![(2, 1)];
    s
}

#[test]
fn catalog_from_the_index_matches_what_was_written() {
    let spec = spec();
    let w = fixture::write(&spec, "idx");
    let (cat, cfg) = Catalog::open_dir_unchecked(&w.dir).unwrap();
    assert_eq!(cfg.num_hidden_layers, 5);
    assert_eq!(cat.n_layers(), 5);
    assert_eq!(cat.n_experts(), 6);
    assert_eq!(cat.model_tensors(), w.catalog.model_tensors());
    assert_eq!(cat.shard_lens(), w.catalog.shard_lens());
    for l in 0..5 {
        assert_eq!(cat.trunk(l), w.catalog.trunk(l), "layer {l}");
        for e in 0..6 {
            assert_eq!(
                cat.expert(l, e),
                w.catalog.expert(l, e),
                "layer {l} expert {e}"
            );
        }
    }
    assert!(cat.expert(0, 0).is_none());
    assert!(cat.expert(2, 1).unwrap().coalesced().is_none());
    assert!(cat.expert(2, 2).unwrap().coalesced().is_some());
}

#[test]
fn standalone_open_with_and_without_a_packed_trunk() {
    let spec = spec();
    let w = fixture::write(&spec, "open");
    let (cat, _) = Catalog::open_dir_unchecked(&w.dir).unwrap();
    let packed = w.dir.join("packed");
    pack_trunk(
        &cat,
        &packed,
        &PackOptions::new(TrunkCodec::Raw),
        &Interrupt::never(),
        &mut |_| {},
    )
    .unwrap();
    TrunkLayout::from_packed(&cat, open_shards(&cat).unwrap(), &packed).unwrap();
    let budget = Budget::from_flags(&[BudgetFlag::Preset("laptop".into())]).unwrap();
    for trunk in [None, Some(packed.as_path())] {
        let (src, plan) = StandaloneSource::open(
            &w.dir,
            trunk,
            &budget,
            None,
            &fixture_opts(),
            &mut |_, _, _| {},
        )
        .unwrap();
        assert_eq!(plan.pinned_layers, 5);
        // The caller stated no sequence state: the plan holds none.
        assert_eq!(plan.state.bytes, 0);
        let src: Arc<dyn WeightSource> = Arc::new(src);
        for l in 0..5 {
            let run = src.layer(l).unwrap();
            for (n, _, _) in fixture::trunk_tensors(&spec, l) {
                let t = run.layout.get(&n).unwrap();
                assert!(
                    run.region.bytes()[t.off as usize..(t.off + t.nbytes) as usize]
                        == fixture::expected_tensor(&spec, &n)[..]
                );
            }
        }
        let b = src.experts(2, &[1, 4]).unwrap();
        assert!(b.experts[0].as_ref().unwrap().bytes() == &fixture::expert_bytes(&spec, 2, 1)[..]);
        assert!(b.experts[1].as_ref().unwrap().bytes() == &fixture::expert_bytes(&spec, 2, 4)[..]);
        let emb = src
            .model_tensor("language_model.model.embed_tokens.weight")
            .unwrap();
        assert_eq!(emb.len(), spec.vocab * spec.hidden * 2);
    }
    // --layers 3: a partial view.
    let (src, plan) = StandaloneSource::open(
        &w.dir,
        None,
        &budget,
        Some(3),
        &fixture_opts(),
        &mut |_, _, _| {},
    )
    .unwrap();
    assert_eq!(plan.n_layers, 3);
    assert!(src.layer(3).is_err());
}

/// Standalone options for the library fixture: its tensor set is not a model's (its shapes vary
/// on purpose), so the engine's shape check is off.
fn fixture_opts() -> StandaloneOptions {
    StandaloneOptions {
        check_shapes: false,
        ..StandaloneOptions::default()
    }
}
