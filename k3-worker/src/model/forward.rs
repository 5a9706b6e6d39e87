//! The top-level loop with Block Attention Residuals (SPEC.md §3.3), one code path for prefill
//! (n prompt tokens as matrix products), decode (n = 1) and a speculative verify pass (n = 1 + K,
//! journaled).
//!
//! ```text
//! bank = []; pend = embed[id]
//! for L:
//!     x = bank empty ? pend : AttnRes(bank ++ [pend]; w_selfres_L)   # guard: layer 0 only
//!     if L % block == 0: bank.push(pend); pend = NONE                 # raw snapshot, reset
//!     a = Attn_L(RMSNorm(x; input_layernorm_L));   pend = pend? pend + a : a
//!     x = AttnRes(bank ++ [pend]; w_mlpres_L)                         # no guard
//!     pend += MLP_L(RMSNorm(x; post_attention_layernorm_L))
//! logits = lm_head · RMSNorm(AttnRes(bank ++ [pend]; w_outres); norm)
//! ```
//! The weights come from the weights feed (`feed.rs`): a layer's typed weights, a layer's
//! experts group by group; when and how they are read is the feed's business, never this file's.
//! The rows (`n` positions) are an explicit dimension of every buffer and call.

use k3_store::runtime::source::WeightSource;

use super::attn_res::AttnResQuery;
use super::bind::{Attn, BoundLayer, Globals, LayerWeights, Mlp, TensorShapes};
use super::dims::{Dims, ModelError};
pub use super::feed::Tap;
use super::feed::TraceRecord;
use super::feed::{ExpertStream, Feed, FeedOptions, FeedStore, Layer, Point, RunCounters};
use super::kda::KdaSeq;
use super::mats::{copy_into, linear, rms_norm_rows_into, zeroed, Mat};
use super::moe::{MoeWeights, UpSide};
use super::state::{Journal, LayerState, Scratch, SeqState, Work};

/// Which positions to compute logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position of the call (generation).
    Last,
    /// Every position of the call (teacher forcing).
    All,
    /// None: a prompt chunk that is not the prompt's last, in a batched pass.
    None,
}

impl Logits {
    /// Rows of logits for a sequence with `rows` positions in the pass (the last ones).
    pub fn rows(self, rows: usize) -> usize {
        match self {
            Logits::Last => 1,
            Logits::All => rows,
            Logits::None => 0,
        }
    }
}

/// One sequence's part of a batched pass ([`Model::forward_batch`]): its new ids, its state,
/// which of its positions want logits.
#[derive(Debug)]
pub struct SeqRows<'a> {
    /// The ids to append after the `state.pos` already consumed.
    pub ids: &'a [u32],
    /// The sequence's state, advanced by the pass.
    pub state: &'a mut SeqState,
    /// Its logits to return.
    pub logits: Logits,
}

/// What a pass needs of each sequence in it: the number of rows, the per-layer state and the
/// journal (split borrows of a [`SeqState`], whose buffers the pass may not use).
struct Part<'a> {
    rows: usize,
    layers: &'a mut [LayerState],
    journal: &'a mut Journal,
    logits: Logits,
}

/// The model: dimensions, the weight source, the resident model-level tensors.
pub struct Model<'s> {
    /// Dimensions.
    pub dims: Dims,
    source: &'s dyn WeightSource,
    shapes: Option<&'s dyn TensorShapes>,
    globals: Globals,
    /// What the weights feed keeps across passes (the bound layers, the lookahead's buffers).
    store: FeedStore,
    /// Failure/request counters.
    pub counters: RunCounters,
    /// When `Some`, every expert request is appended here.
    pub trace: Option<Vec<TraceRecord>>,
    /// The step number recorded in trace records (the caller advances it).
    pub step: u64,
    /// How the feed reads ahead (router lookahead, overlapped expert groups, early release);
    /// never changes the output.
    pub options: FeedOptions,
    /// Optional per-layer intermediate tap, named like `scripts/k3_reference.py --dump-trace`
    /// (`attn_in`, `attn_out`, `mlp_in`, `mlp_out` per layer; `final_in` = the output
    /// aggregator's result before the final norm, reported with layer = n_layers), for locating
    /// divergences from the reference.
    pub tap: Option<Tap<'s>>,
    /// Bind a draft trunk's quantized matrices (a draft model, [`Model::draft`]).
    quant: bool,
    /// Run the routed experts. A draft model may run its MoE layers on the shared experts
    /// alone (`false`): it then never asks its source for an expert.
    pub routed_experts: bool,
}

/// What a model binds once and keeps: the model-level tensors and every layer bound so far.
/// [`Model::into_bound`] and [`Model::from_bound`] move it between models over sources that
/// live for different spans (a drafter's model is rebuilt around each call's source).
#[derive(Debug)]
pub struct Bound {
    globals: Globals,
    bound: Vec<Option<std::sync::Arc<BoundLayer>>>,
    binds: u64,
}

impl std::fmt::Debug for Model<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("dims", &self.dims)
            .field("counters", &self.counters)
            .finish()
    }
}

impl<'s> Model<'s> {
    /// Validate `dims` and bind the model-level tensors. Layers are bound at their first pass.
    pub fn new(
        dims: Dims,
        source: &'s dyn WeightSource,
        shapes: Option<&'s dyn TensorShapes>,
    ) -> Result<Model<'s>, ModelError> {
        dims.validate()?;
        let globals = Globals::bind(&dims, source, shapes)?;
        let bound = (0..dims.n_layers).map(|_| None).collect();
        let b = Bound {
            globals,
            bound,
            binds: 0,
        };
        Ok(Model::from_bound(dims, source, shapes, b))
    }

    /// A model over what an earlier model bound (same dims; see [`Bound`]).
    pub fn from_bound(
        dims: Dims,
        source: &'s dyn WeightSource,
        shapes: Option<&'s dyn TensorShapes>,
        b: Bound,
    ) -> Model<'s> {
        Model {
            dims,
            source,
            shapes,
            globals: b.globals,
            store: FeedStore::from_bound(b.bound, b.binds),
            counters: RunCounters::default(),
            trace: None,
            step: 0,
            options: FeedOptions::default(),
            tap: None,
            quant: false,
            routed_experts: true,
        }
    }

    /// A draft model (over what an earlier one bound, when given): binds a draft trunk's
    /// quantized matrices (`k3_proto::quant`) as well as bf16 ones, runs no router lookahead and
    /// runs the routed experts only when `routed_experts` (those its source cannot give are
    /// skipped, their weight left out of the mix).
    pub fn draft(
        dims: Dims,
        source: &'s dyn WeightSource,
        bound: Option<Bound>,
        routed_experts: bool,
    ) -> Result<Model<'s>, ModelError> {
        let mut m = match bound {
            Some(b) => Model::from_bound(dims, source, None, b),
            None => Model::new(dims, source, None)?,
        };
        m.quant = true;
        m.routed_experts = routed_experts;
        m.options.lookahead = super::feed::Lookahead::Off;
        Ok(m)
    }

    /// What this model bound, to build the next one with [`Model::from_bound`].
    pub fn into_bound(self) -> Bound {
        Bound {
            globals: self.globals,
            bound: self.store.bound,
            binds: self.store.binds,
        }
    }

    /// Fresh per-sequence state for at most `capacity` positions.
    pub fn new_state(&self, capacity: usize) -> SeqState {
        SeqState::new(&self.dims, capacity)
    }

    /// The weight source.
    pub fn source(&self) -> &'s dyn WeightSource {
        self.source
    }

    /// Layers bound so far (each is bound once, at its first pass).
    pub fn bound_layers(&self) -> usize {
        self.store.bound.iter().filter(|b| b.is_some()).count()
    }

    /// Times a layer was bound over this engine's life (= the layers run, if binding happens
    /// once per layer as it must).
    pub fn bind_count(&self) -> u64 {
        self.store.binds
    }

    /// The dims, the model-level tensors and the feed of one pass (split borrows of `self`).
    fn parts(&mut self) -> (&Dims, &Globals, Feed<'_, 's>) {
        let feed = Feed::new(
            &self.dims,
            self.source,
            self.shapes,
            self.quant,
            self.options,
            &mut self.store,
            &mut self.counters,
            self.trace.as_mut(),
            self.step,
            self.tap.as_mut(),
        );
        (&self.dims, &self.globals, feed)
    }

    /// Run `ids` (appended after the `st.pos` tokens already consumed) and return logits
    /// `[rows, vocab]` for the positions chosen by `which`. On error the state is unusable.
    pub fn forward(
        &mut self,
        ids: &[u32],
        st: &mut SeqState,
        which: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        check_input(&self.dims, ids, st)?;
        let SeqState {
            layers,
            journal,
            scratch,
            pos,
            ..
        } = st;
        let mut one = [Part {
            rows: ids.len(),
            layers,
            journal,
            logits: which,
        }];
        let logits = self.pass(ids, &mut one, scratch)?;
        *pos += ids.len();
        Ok(logits)
    }

    /// One pass over the rows of several sequences: each trunk weight and each routed expert
    /// is read once for every row that needs it; each sequence's attention runs on its own
    /// state. Returns the logits of every sequence in turn (`[rows, vocab]` for the rows each
    /// one's [`Logits`] asks for), bit for bit what [`Model::forward`] gives each sequence
    /// alone. The pass's temporaries live in `scratch` (reused across passes; the states' own
    /// buffers are not touched). On error every state in the pass is unusable.
    pub fn forward_batch(
        &mut self,
        seqs: &mut [SeqRows<'_>],
        scratch: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        if seqs.is_empty() {
            return Err(ModelError::Input("a pass of no sequences".into()));
        }
        for s in seqs.iter() {
            check_input(&self.dims, s.ids, s.state)?;
        }
        let mut ids = std::mem::take(&mut scratch.ids);
        ids.clear();
        ids.extend(seqs.iter().flat_map(|s| s.ids.iter().copied()));
        let mut parts: Vec<Part<'_>> = seqs
            .iter_mut()
            .map(|s| Part {
                rows: s.ids.len(),
                layers: &mut s.state.layers,
                journal: &mut s.state.journal,
                logits: s.logits,
            })
            .collect();
        let logits = self.pass(&ids, &mut parts, scratch);
        scratch.ids = ids;
        let logits = logits?;
        drop(parts);
        for s in seqs.iter_mut() {
            s.state.pos += s.ids.len();
        }
        Ok(logits)
    }

    /// The pass itself: `ids` are the parts' rows in turn.
    fn pass(
        &mut self,
        ids: &[u32],
        parts: &mut [Part<'_>],
        scratch: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let routed_experts = self.routed_experts;
        let (d, globals, mut feed) = self.parts();
        let n = ids.len();
        let Scratch {
            bank, pend, work, ..
        } = scratch;
        let w = &mut **work;
        let rows = feed.embed(ids)?;
        let mut res = Residuals::embed(d, rows, bank, pend);
        for l in 0..d.n_layers {
            let layer = feed.layer(l)?;
            let lw = layer.weights()?;
            res.aggregate_before_attention(l, lw.self_res, w);
            feed.seen(l, Point::AttnIn, &w.x);
            attention(d, l, &lw, parts, w)?;
            feed.seen(l, Point::AttnOut, &w.a);
            res.add(&w.a);
            res.aggregate(lw.mlp_res, w);
            feed.seen(l, Point::MlpIn, &w.x);
            mlp(d, l, layer, routed_experts, &mut feed, w)?;
            feed.seen(l, Point::MlpOut, &w.m);
            res.add(&w.m);
        }
        feed.end_pass()?;
        res.aggregate(&globals.out_res, w);
        feed.seen(d.n_layers, Point::FinalIn, &w.x);
        let logits = lm_head(d, globals, parts, n, w);
        feed.head_done(n);
        Ok(logits)
    }
}

/// The pass's ids against the vocabulary, the state against the model and its capacity.
fn check_input(d: &Dims, ids: &[u32], st: &SeqState) -> Result<(), ModelError> {
    if ids.is_empty() {
        return Err(ModelError::Input("no tokens to run".into()));
    }
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= d.vocab) {
        return Err(ModelError::Input(format!(
            "token id {bad} outside the vocabulary of {}",
            d.vocab
        )));
    }
    if st.layers.len() != d.n_layers {
        return Err(ModelError::Input(format!(
            "state for {} layers, model has {}",
            st.layers.len(),
            d.n_layers
        )));
    }
    st.reserve(ids.len())
}

/// Block Attention Residuals across one pass (SPEC.md §3.3): the bank of block snapshots and
/// the pending sum, in the sequence's buffers (reused every pass).
struct Residuals<'b> {
    bank: &'b mut Vec<Vec<f32>>,
    /// Entries of `bank` filled in this pass.
    banked: usize,
    pend: &'b mut Vec<f32>,
    /// The pending sum was just banked: the next output replaces it instead of adding to it.
    fresh: bool,
    block: usize,
    eps: f32,
    n: usize,
}

impl<'b> Residuals<'b> {
    /// The embedding rows `rows` (bf16 `[n, E]`), unscaled, as the pending sum.
    fn embed(
        d: &Dims,
        rows: &[u8],
        bank: &'b mut Vec<Vec<f32>>,
        pend: &'b mut Vec<f32>,
    ) -> Residuals<'b> {
        bank.resize_with(d.n_layers.div_ceil(d.block), Vec::new);
        crate::kernels::grow_exact(pend, rows.len() / 2);
        pend.extend(
            rows.chunks_exact(2)
                .map(|b| crate::kernels::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        );
        let n = rows.len() / (2 * d.hidden);
        Residuals {
            bank,
            banked: 0,
            pend,
            fresh: false,
            block: d.block,
            eps: d.rms_eps,
            n,
        }
    }

    /// Layer `l`'s attention input into `w.x` (the pending sum itself before the first block
    /// boundary); at a boundary the pending sum then becomes a bank entry.
    fn aggregate_before_attention(&mut self, l: usize, q: &AttnResQuery, w: &mut Work) {
        if self.banked == 0 {
            copy_into(&mut w.x, self.pend);
        } else {
            self.aggregate(q, w);
        }
        if l.is_multiple_of(self.block) {
            std::mem::swap(&mut self.bank[self.banked], self.pend);
            self.banked += 1;
            self.fresh = true;
        }
    }

    /// `AttnRes(bank ++ [pend]; q)` into `w.x`.
    fn aggregate(&self, q: &AttnResQuery, w: &mut Work) {
        let bank = &self.bank[..self.banked];
        q.aggregate(bank, self.pend, self.n, self.eps, &mut w.res, &mut w.x);
    }

    /// A sub-layer's output `v` joins the pending sum.
    fn add(&mut self, v: &[f32]) {
        if std::mem::take(&mut self.fresh) {
            copy_into(self.pend, v);
        } else {
            self.pend.iter_mut().zip(v).for_each(|(p, x)| *p += x);
        }
    }
}

/// Layer `l`'s attention (KDA, SPEC.md §3.4, or MLA, §3.5) on its input `w.x` into `w.a`,
/// each part's rows on its own state (journaled when its pass is).
fn attention(
    d: &Dims,
    l: usize,
    lw: &LayerWeights<'_>,
    parts: &mut [Part<'_>],
    w: &mut Work,
) -> Result<(), ModelError> {
    let n = w.x.len() / d.hidden;
    rms_norm_rows_into(&w.x, lw.input_norm, d.rms_eps, &mut w.xn);
    let kda = matches!(lw.attn, Attn::Kda(_));
    if parts
        .iter()
        .any(|p| matches!(p.layers[l], LayerState::Kda(_)) != kda)
    {
        return Err(ModelError::Input(format!(
            "state of layer {l} does not match its kind"
        )));
    }
    match &lw.attn {
        Attn::Kda(a) => {
            let seqs = parts.iter_mut().filter_map(|p| match &mut p.layers[l] {
                LayerState::Kda(s) => Some(KdaSeq {
                    rows: p.rows,
                    state: s,
                    journal: p.journal.layer(l),
                }),
                LayerState::Mla(_) => None,
            });
            a.forward_seqs(d, &w.xn, n, seqs, &mut w.attn.kda, &mut w.a);
        }
        Attn::Mla(a) => {
            let seqs = parts.iter_mut().filter_map(|p| match &mut p.layers[l] {
                LayerState::Mla(c) => Some((p.rows, c)),
                LayerState::Kda(_) => None,
            });
            a.forward_seqs(d, &w.xn, n, seqs, &mut w.attn.mla, &mut w.a);
        }
    }
    w.attention_done(n);
    Ok(())
}

/// Layer `l`'s MLP side (SPEC.md §3.7, §3.8) on its input `w.x` into `w.m`: the dense SiTU MLP,
/// the MoE, or (a draft model without routed experts) the shared experts alone.
fn mlp(
    d: &Dims,
    l: usize,
    layer: Layer,
    routed_experts: bool,
    feed: &mut Feed<'_, '_>,
    w: &mut Work,
) -> Result<(), ModelError> {
    let n = w.x.len() / d.hidden;
    if d.is_moe(l) && routed_experts {
        moe(d, l, layer, feed, w)?;
    } else {
        let lw = layer.weights()?;
        rms_norm_rows_into(&w.x, lw.post_norm, d.rms_eps, &mut w.xn);
        match &lw.mlp {
            Mlp::Dense(mlp) => {
                feed.no_experts(l, &w.x)?;
                mlp.forward(d, &w.xn, n, &mut w.ffn.mlp, &mut w.m);
            }
            Mlp::Moe(moe) => {
                if !moe.shared_out(d, &w.xn, n, &mut w.ffn.mlp, &mut w.m) {
                    zeroed(&mut w.m, n * d.hidden);
                }
            }
        }
    }
    w.mlp_done(n);
    Ok(())
}

/// Stable LatentMoE (SPEC.md §3.7): route the rows, request the union of their experts, compute
/// the latent input and the shared experts while the first group is read, then run the routed
/// experts group by group and combine. A layer the source streams goes back to it before the
/// expert wait; what the layer reads afterwards (the up side) is copied first.
fn moe(
    d: &Dims,
    l: usize,
    layer: Layer,
    feed: &mut Feed<'_, '_>,
    w: &mut Work,
) -> Result<(), ModelError> {
    let n = w.x.len() / d.hidden;
    let lw = layer.weights()?;
    let Mlp::Moe(moe) = &lw.mlp else {
        return Err(ModelError::Config(format!("layer {l} is not a MoE layer")));
    };
    rms_norm_rows_into(&w.x, lw.post_norm, d.rms_eps, &mut w.xn);
    let f = &mut w.ffn;
    moe.route_into(d, &w.xn, n, &mut f.route, &mut f.routing);
    f.routing.unique_into(&mut f.uniq);
    let stream = feed.request_experts(l, &f.routing, &f.uniq);
    moe.latent_in(d, &w.xn, n, &mut f.z);
    let shared = moe.shared_out(d, &w.xn, n, &mut f.mlp, &mut f.shared);
    f.slots.reset(f.routing.sel.len(), d.latent);
    if feed.releases_early(l) {
        f.up.hold(&moe.up_side());
        feed.release(layer)?;
        let up = std::mem::take(&mut w.ffn.up);
        let done = match up.side() {
            Ok(side) => routed_experts(d, l, side, shared, stream, feed, w),
            Err(e) => Err(e),
        };
        w.ffn.up = up;
        done
    } else {
        routed_experts(d, l, moe.up_side(), shared, stream, feed, w)
    }
}

/// Layer `l`'s routed experts, group by group as the feed hands them over, over the latent rows
/// of the tokens routed to each; then their outputs are combined in selection order, normalised,
/// projected up by `up` and added to the shared experts' output (when `shared`) into `w.m`.
fn routed_experts(
    d: &Dims,
    l: usize,
    up: UpSide<'_>,
    shared: bool,
    mut stream: ExpertStream,
    feed: &mut Feed<'_, '_>,
    w: &mut Work,
) -> Result<(), ModelError> {
    let n = w.x.len() / d.hidden;
    let f = &mut w.ffn;
    while let Some(g) = feed.next_experts(&mut stream, &f.uniq, &w.x)? {
        let ids = &f.uniq[g.range.clone()];
        let (z, routing) = (&f.z, &f.routing);
        let experts = g.experts();
        let failed =
            MoeWeights::run_experts(d, z, routing, ids, &experts, &mut f.experts, &mut f.slots);
        feed.failed(l, failed);
    }
    let shared = shared.then_some(&f.shared[..]);
    up.combine(d, n, &f.routing, &f.slots, shared, &mut f.combine, &mut w.m);
    Ok(())
}

/// The logits of the rows each part asks for (its last ones), in the parts' order: final norm
/// of the output aggregate `w.x`, lm_head.
fn lm_head(d: &Dims, globals: &Globals, parts: &[Part<'_>], n: usize, w: &mut Work) -> Vec<f32> {
    let e = d.hidden;
    let picks: usize = parts.iter().map(|p| p.logits.rows(p.rows)).sum();
    if picks == 0 {
        w.pass_done(n);
        return Vec::new();
    }
    if let [one] = parts {
        let first = one.rows - picks;
        rms_norm_rows_into(&w.x[first * e..], &globals.final_norm, d.rms_eps, &mut w.xn);
    } else {
        let mut chosen = Vec::with_capacity(picks * e);
        let mut r0 = 0;
        for p in parts {
            let k = p.logits.rows(p.rows);
            chosen.extend_from_slice(&w.x[(r0 + p.rows - k) * e..(r0 + p.rows) * e]);
            r0 += p.rows;
        }
        rms_norm_rows_into(&chosen, &globals.final_norm, d.rms_eps, &mut w.xn);
    }
    let logits = linear(Mat::Bf16(globals.lm_head.bytes()), d.vocab, e, &w.xn, picks);
    w.pass_done(n);
    logits
}
