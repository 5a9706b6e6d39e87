//! Layer-level invariants (SPEC.md §8) against straightforward f64 re-implementations written
//! here from the spec: expanded MLA (I15–I19), sequential KDA (I6–I14, I10 T=1 formula), router
//! (I20), aggregate norm (I22), shared experts (I23), the Block-AttnRes schedule (I28–I30).

// The f64 references index like the formulas they transcribe.
#![allow(clippy::needless_range_loop)]

use crate::common;

use common::{layer_name, tiny_dims, MemSource, Rng};
use k3_store::runtime::source::WeightSource;
use k3_worker::kernels;
use k3_worker::model::bind::{Attn, BoundLayer, Mlp};
use k3_worker::model::moe::{select_top_k, Routing};
use k3_worker::model::state::{KdaState, MlaCache};
use k3_worker::model::{Dims, Logits, Model, TensorShapes};

// ---------------------------------------------------------------- f64 helpers

fn mv(w: &[f32], rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
    assert_eq!(w.len(), rows * cols);
    (0..rows)
        .map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c]).sum())
        .collect()
}

fn rms(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &g)| g as f64 * v * inv).collect()
}

fn sig(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

fn situ(g: f64, u: f64, d: &Dims) -> f64 {
    let (b1, b2) = (d.situ_beta as f64, d.situ_linear_beta as f64);
    b1 * (g / b1).tanh() * sig(g) * b2 * (u / b2).tanh()
}

/// max |a − b| / max |b|.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max);
    let den = b.iter().map(|y| y.abs()).fold(0.0, f64::max);
    assert!(den > 0.0, "reference is all zero");
    num / den
}

fn rand_x(n: usize, e: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed);
    (0..n * e).map(|_| r.sym()).collect()
}

fn g(src: &MemSource, l: usize, s: &str) -> Vec<f32> {
    src.get(&layer_name(l, s))
}

// ---------------------------------------------------------------- MLA (I15–I19)

/// Expanded-form MLA of SPEC.md §3.5 over all `n` positions, in f64.
fn mla_expanded(src: &MemSource, l: usize, x: &[f32], n: usize) -> Vec<f64> {
    let d = &src.dims;
    let (e, h, no, ro, vh, kl, ql) = (
        d.hidden,
        d.mla_heads,
        d.nope,
        d.rope,
        d.v_head,
        d.kv_lora,
        d.q_lora,
    );
    let at = |s: &str| g(src, l, &format!("self_attn.{s}"));
    let (wqa, wqb, wkva, wkvb, wo, wg) = (
        at("q_a_proj.weight"),
        at("q_b_proj.weight"),
        at("kv_a_proj_with_mqa.weight"),
        at("kv_b_proj.weight"),
        at("o_proj.weight"),
        at("g_proj.weight"),
    );
    let (qan, kvan) = (at("q_a_layernorm.weight"), at("kv_a_layernorm.weight"));
    let mut qs = Vec::new();
    let mut ks = Vec::new(); // per position: per head [k_nope | kr]
    let mut vs = Vec::new();
    for t in 0..n {
        let xt: Vec<f64> = x[t * e..(t + 1) * e].iter().map(|&v| v as f64).collect();
        let qa = rms(&mv(&wqa, ql, e, &xt), &qan, 1e-6);
        qs.push(mv(&wqb, h * (no + ro), ql, &qa));
        let ckv = mv(&wkva, kl + ro, e, &xt);
        let c = rms(&ckv[..kl], &kvan, 1e-6);
        let kv = mv(&wkvb, h * (no + vh), kl, &c);
        let mut k = Vec::new();
        let mut v = Vec::new();
        for hh in 0..h {
            k.extend_from_slice(&kv[hh * (no + vh)..hh * (no + vh) + no]);
            k.extend_from_slice(&ckv[kl..]); // shared, unnormalised, unrotated
            v.extend_from_slice(&kv[hh * (no + vh) + no..(hh + 1) * (no + vh)]);
        }
        ks.push(k);
        vs.push(v);
    }
    let mut out = Vec::new();
    for t in 0..n {
        let xt: Vec<f64> = x[t * e..(t + 1) * e].iter().map(|&v| v as f64).collect();
        let gate = mv(&wg, h * vh, e, &xt);
        let mut o = vec![0.0; h * vh];
        for hh in 0..h {
            let q = &qs[t][hh * (no + ro)..(hh + 1) * (no + ro)];
            let sc: Vec<f64> = (0..=t)
                .map(|s| {
                    let k = &ks[s][hh * (no + ro)..(hh + 1) * (no + ro)];
                    q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / ((no + ro) as f64).sqrt()
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
            for (s, scv) in sc.iter().enumerate() {
                let p = (scv - m).exp() / z;
                for j in 0..vh {
                    o[hh * vh + j] += p * vs[s][hh * vh + j];
                }
            }
        }
        for j in 0..h * vh {
            o[j] *= sig(gate[j]);
        }
        out.extend(mv(&wo, e, h * vh, &o));
    }
    out
}

#[test]
fn latent_mla_equals_expanded_mla_with_causal_mask_across_calls() {
    let src = MemSource::random(&tiny_dims(), 21);
    let d = &src.dims;
    let l = 3;
    let run = src.layer(l).unwrap();
    let bound = BoundLayer::bind(d, &run, Some(&src as &dyn TensorShapes), false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Attn::Mla(w) = &lw.attn else {
        panic!("layer 3 is MLA")
    };
    let n = 6;
    let x = rand_x(n, d.hidden, 5);
    let mut cache = MlaCache {
        rows: Vec::new(),
        width: d.latent_width(),
    };
    let mut got = w.forward(d, &x[..4 * d.hidden], 4, &mut cache);
    got.extend(w.forward(d, &x[4 * d.hidden..], 2, &mut cache));
    assert_eq!(cache.len(), n);
    assert_eq!(cache.width, d.kv_lora + d.rope);
    let want = mla_expanded(&src, l, &x, n);
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "latent vs expanded MLA: rel err {err}");
}

// ---------------------------------------------------------------- KDA (I6–I14)

/// Sequential KDA of SPEC.md §3.4 (fla naive_recurrent_kda order), f64, from zero state.
fn kda_reference(src: &MemSource, l: usize, x: &[f32], n: usize) -> Vec<f64> {
    let d = &src.dims;
    let (e, h, dh, k) = (d.hidden, d.kda_heads, d.kda_dim, d.conv_k);
    let p = h * dh;
    let at = |s: &str| g(src, l, &format!("self_attn.{s}"));
    let (wq, wk, wv) = (
        at("q_proj.weight"),
        at("k_proj.weight"),
        at("v_proj.weight"),
    );
    let convs = [
        at("q_conv1d.weight"),
        at("k_conv1d.weight"),
        at("v_conv1d.weight"),
    ];
    let (fa, fb, alog, dtb) = (
        at("f_a_proj.weight"),
        at("f_b_proj.weight"),
        at("A_log"),
        at("dt_bias"),
    );
    let (wb, wg, on, wo) = (
        at("b_proj.weight"),
        at("g_proj.weight"),
        at("o_norm.weight"),
        at("o_proj.weight"),
    );
    let xs: Vec<Vec<f64>> = (0..n)
        .map(|t| x[t * e..(t + 1) * e].iter().map(|&v| v as f64).collect())
        .collect();
    let raw: Vec<[Vec<f64>; 3]> = xs
        .iter()
        .map(|xt| [mv(&wq, p, e, xt), mv(&wk, p, e, xt), mv(&wv, p, e, xt)])
        .collect();
    let mut s = vec![vec![0.0f64; dh * dh]; h];
    let mut out = Vec::new();
    for t in 0..n {
        // conv: y[c] = silu(Σ_j w[c,j] · in_{t-(k-1)+j}[c]), zero before the start.
        let mut qkv = [vec![0.0; p], vec![0.0; p], vec![0.0; p]];
        for i in 0..3 {
            for c in 0..p {
                let mut acc = 0.0;
                for j in 0..k {
                    let src_t = t as isize - (k as isize - 1) + j as isize;
                    if src_t >= 0 {
                        acc += convs[i][c * k + j] as f64 * raw[src_t as usize][i][c];
                    }
                }
                qkv[i][c] = acc * sig(acc);
            }
        }
        let beta = mv(&wb, h, e, &xs[t]);
        let z = mv(&fb, p, dh, &mv(&fa, dh, e, &xs[t]));
        let gate = mv(&wg, p, e, &xs[t]);
        let mut y = vec![0.0; p];
        for hh in 0..h {
            let l2 = |v: &[f64]| {
                let n2 = (v.iter().map(|a| a * a).sum::<f64>() + 1e-6).sqrt();
                v.iter().map(|a| a / n2).collect::<Vec<f64>>()
            };
            let q = l2(&qkv[0][hh * dh..(hh + 1) * dh]);
            let kk = l2(&qkv[1][hh * dh..(hh + 1) * dh]);
            let v = &qkv[2][hh * dh..(hh + 1) * dh];
            let b = sig(beta[hh]);
            let st = &mut s[hh];
            for a in 0..dh {
                let c = hh * dh + a;
                let gg = d.gate_lb as f64 * sig((alog[hh] as f64).exp() * (z[c] + dtb[c] as f64));
                for bb in 0..dh {
                    st[a * dh + bb] *= gg.exp();
                }
            }
            let u: Vec<f64> = (0..dh)
                .map(|j| (0..dh).map(|i| kk[i] * st[i * dh + j]).sum())
                .collect();
            for i in 0..dh {
                for j in 0..dh {
                    st[i * dh + j] += kk[i] * b * (v[j] - u[j]);
                }
            }
            let o: Vec<f64> = (0..dh)
                .map(|j| {
                    (0..dh)
                        .map(|i| q[i] / (dh as f64).sqrt() * st[i * dh + j])
                        .sum()
                })
                .collect();
            let on_ = rms(&o, &on, d.rms_eps as f64);
            for j in 0..dh {
                y[hh * dh + j] = on_[j] * sig(gate[hh * dh + j]);
            }
        }
        out.extend(mv(&wo, e, p, &y));
    }
    out
}

fn kda_layer(src: &MemSource, l: usize) -> (k3_store::runtime::source::LayerRun, KdaState) {
    let d = &src.dims;
    let p = d.kda_heads * d.kda_dim;
    let st = KdaState {
        s: vec![0.0; d.kda_heads * d.kda_dim * d.kda_dim],
        conv: [vec![0.0; p * 3], vec![0.0; p * 3], vec![0.0; p * 3]],
    };
    (src.layer(l).unwrap(), st)
}

#[test]
fn kda_matches_the_sequential_reference_over_several_tokens_and_calls() {
    let src = MemSource::random(&tiny_dims(), 22);
    let d = &src.dims;
    let (run, mut st) = kda_layer(&src, 2);
    let bound = BoundLayer::bind(d, &run, None, false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Attn::Kda(w) = &lw.attn else {
        panic!("layer 2 is KDA")
    };
    let n = 6;
    let x = rand_x(n, d.hidden, 6);
    let mut got = w.forward(d, &x[..3 * d.hidden], 3, &mut st, None);
    got.extend(w.forward(d, &x[3 * d.hidden..], 3, &mut st, None));
    let want = kda_reference(&src, 2, &x, n);
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "KDA vs sequential reference: rel err {err}");
}

#[test]
fn kda_single_token_from_zero_state_is_beta_qk_v_over_sqrt_d() {
    // I10/I11: at T=1 from S=0, o_h = β_h (q̂_h·k̂_h)/sqrt(D) v_h (non-zero: read after write).
    let src = MemSource::random(&tiny_dims(), 23);
    let d = &src.dims;
    let (e, h, dh, k) = (d.hidden, d.kda_heads, d.kda_dim, d.conv_k);
    let p = h * dh;
    let (run, mut st) = kda_layer(&src, 1);
    let bound = BoundLayer::bind(d, &run, None, false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Attn::Kda(w) = &lw.attn else { panic!() };
    let x = rand_x(1, e, 7);
    let got = w.forward(d, &x, 1, &mut st, None);

    let at = |s: &str| g(&src, 1, &format!("self_attn.{s}"));
    let xt: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let conv1 = |wp: &str, wc: &str| {
        let raw = mv(&at(wp), p, e, &xt);
        let c = at(wc);
        // Only tap K-1 sees the token at T=1.
        (0..p)
            .map(|i| {
                let a = c[i * k + k - 1] as f64 * raw[i];
                a * sig(a)
            })
            .collect::<Vec<f64>>()
    };
    let q = conv1("q_proj.weight", "q_conv1d.weight");
    let kk = conv1("k_proj.weight", "k_conv1d.weight");
    let v = conv1("v_proj.weight", "v_conv1d.weight");
    let beta = mv(&at("b_proj.weight"), h, e, &xt);
    let gate = mv(&at("g_proj.weight"), p, e, &xt);
    let on = at("o_norm.weight");
    let mut y = vec![0.0; p];
    for hh in 0..h {
        let r = hh * dh..(hh + 1) * dh;
        let nq = q[r.clone()].iter().map(|a| a * a).sum::<f64>();
        let nk = kk[r.clone()].iter().map(|a| a * a).sum::<f64>();
        let qk = q[r.clone()]
            .iter()
            .zip(&kk[r.clone()])
            .map(|(a, b)| a * b)
            .sum::<f64>()
            / ((nq + 1e-6).sqrt() * (nk + 1e-6).sqrt());
        let coef = sig(beta[hh]) * qk / (dh as f64).sqrt();
        let o: Vec<f64> = v[r.clone()].iter().map(|vv| coef * vv).collect();
        let on_ = rms(&o, &on, 1e-5);
        for j in 0..dh {
            y[hh * dh + j] = on_[j] * sig(gate[hh * dh + j]);
        }
    }
    let want = mv(&at("o_proj.weight"), e, p, &y);
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "T=1 KDA formula: rel err {err}");
    assert!(st.s.iter().any(|&s| s != 0.0));
}

// ---------------------------------------------------------------- router (I20)

#[test]
fn router_bias_steers_selection_only() {
    let mut d = tiny_dims();
    d.top_k = 3;
    let src = MemSource::random(&d, 24);
    let run = src.layer(1).unwrap();
    let bound = BoundLayer::bind(&d, &run, None, false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Mlp::Moe(mut moe) = lw.mlp else {
        panic!("layer 1 is MoE")
    };
    // x = e_0, so the router logits are column 0 of the gate (bf16-exact values).
    let logits = [2.0f32, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.25];
    let e = d.hidden;
    let mut gate = vec![0u8; d.n_experts * e * 2];
    for (i, &v) in logits.iter().enumerate() {
        gate[i * e * 2..i * e * 2 + 2].copy_from_slice(&common::bf16_bits(v));
    }
    moe.router = k3_worker::model::Mat::Bf16(&gate);
    // Bias lifts experts 6 and 5 to the top; 3 and 7 tie on biased score (0.5+σ … see below).
    let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 5.0, 0.0];
    moe.bias = &bias;
    let mut x = vec![0.0f32; e];
    x[0] = 1.0;
    let r = moe.route(&d, &x, 1);
    assert_eq!(r.sel, vec![6, 5, 0], "selection by score + bias");
    let s: Vec<f64> = r
        .sel
        .iter()
        .map(|&i| sig(logits[i as usize] as f64))
        .collect();
    let sum: f64 = s.iter().sum();
    for (j, &w) in r.w.iter().enumerate() {
        assert!(
            (w as f64 - s[j] / sum).abs() < 1e-6,
            "weight {j}: {w} vs {}",
            s[j] / sum
        );
    }
    // Ties: equal biased score → lower index first.
    assert_eq!(
        select_top_k(&[0.5, 0.7, 0.7, 0.1], &[0.2, 0.0, 0.0, 0.0], 3),
        vec![0, 1, 2]
    );
    assert_eq!(
        select_top_k(&[0.1, 0.7, 0.7, 0.1], &[0.0; 4], 2),
        vec![1, 2]
    );
}

// ---------------------------------------------------------------- MoE aggregate (I22, I23)

fn expert_out(src: &MemSource, l: usize, id: u32, z: &[f32]) -> Vec<f32> {
    let d = &src.dims;
    let b = src.expert_bytes(l, id);
    let lay = k3_proto::expert::ExpertLayout {
        inter: d.moe_inter,
        latent: d.latent,
    };
    use k3_proto::expert::ExpertPart as P;
    let part = |p: P| &b[lay.part_offset(p)..lay.part_offset(p) + lay.part_bytes(p)];
    let (i, la) = (d.moe_inter, d.latent);
    let (mut g1, mut u, mut y) = (vec![0.0; i], vec![0.0; i], vec![0.0; la]);
    kernels::matvec_mxfp4(part(P::W1Packed), part(P::W1Scale), i, la, z, &mut g1);
    kernels::matvec_mxfp4(part(P::W3Packed), part(P::W3Scale), i, la, z, &mut u);
    let a: Vec<f32> = g1
        .iter()
        .zip(&u)
        .map(|(&gv, &uv)| situ(gv as f64, uv as f64, d) as f32)
        .collect();
    kernels::matvec_mxfp4(part(P::W2Packed), part(P::W2Scale), la, i, &a, &mut y);
    y
}

fn shared_ref(src: &MemSource, l: usize, x: &[f64]) -> Vec<f64> {
    let d = &src.dims;
    let sw = d.n_shared * d.moe_inter;
    let m = "block_sparse_moe.shared_experts";
    let gg = mv(
        &g(src, l, &format!("{m}.gate_proj.weight")),
        sw,
        d.hidden,
        x,
    );
    let uu = mv(&g(src, l, &format!("{m}.up_proj.weight")), sw, d.hidden, x);
    let a: Vec<f64> = gg.iter().zip(&uu).map(|(&a, &b)| situ(a, b, d)).collect();
    mv(
        &g(src, l, &format!("{m}.down_proj.weight")),
        d.hidden,
        sw,
        &a,
    )
}

#[test]
fn routed_norm_applies_once_to_the_weighted_aggregate() {
    let d = tiny_dims();
    let mut src = MemSource::random(&d, 25);
    // Expert 5 ~2^8 larger than expert 2: per-expert norms would weigh them equally.
    let mut big = src.expert_bytes(1, 5);
    let lay = k3_proto::expert::ExpertLayout {
        inter: d.moe_inter,
        latent: d.latent,
    };
    let p = k3_proto::expert::ExpertPart::W2Scale;
    let o = lay.part_offset(p);
    big[o..o + lay.part_bytes(p)]
        .iter_mut()
        .for_each(|s| *s += 8);
    src.set_expert(1, 5, big);
    let run = src.layer(1).unwrap();
    let bound = BoundLayer::bind(&d, &run, None, false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Mlp::Moe(moe) = &lw.mlp else { panic!() };
    let x = rand_x(1, d.hidden, 8);
    let routing = Routing {
        sel: vec![2, 5],
        w: vec![0.7, 0.3],
        k: 2,
    };
    let ids = vec![2u32, 5];
    let batch = src.experts(1, &ids).unwrap();
    let (got, failed) = moe.forward(&d, &x, 1, &routing, &ids, &batch);
    assert!(failed.is_empty());

    let z = {
        let mut z = vec![0.0f32; d.latent];
        kernels::matvec_bf16(
            &src.raw(&layer_name(
                1,
                "block_sparse_moe.routed_expert_down_proj.weight",
            )),
            d.latent,
            d.hidden,
            &x,
            &mut z,
        );
        z
    };
    let (y2, y5) = (expert_out(&src, 1, 2, &z), expert_out(&src, 1, 5, &z));
    let norm = g(&src, 1, "block_sparse_moe.routed_expert_norm.weight");
    let up = g(&src, 1, "block_sparse_moe.routed_expert_up_proj.weight");
    let xt: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let sh = shared_ref(&src, 1, &xt);
    let finish = |acc: Vec<f64>| -> Vec<f64> {
        let r = mv(&up, d.hidden, d.latent, &acc);
        r.iter().zip(&sh).map(|(a, b)| a + b).collect()
    };
    let agg: Vec<f64> = (0..d.latent)
        .map(|i| 0.7 * y2[i] as f64 + 0.3 * y5[i] as f64)
        .collect();
    let want = finish(rms(&agg, &norm, 1e-5));
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "norm on the aggregate: rel err {err}");
    // The alternative (norm per expert, then weight) is far away: the fixture discriminates.
    let n2 = rms(
        &y2.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &norm,
        1e-5,
    );
    let n5 = rms(
        &y5.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &norm,
        1e-5,
    );
    let alt = finish((0..d.latent).map(|i| 0.7 * n2[i] + 0.3 * n5[i]).collect());
    assert!(rel_err(&got, &alt) > 1e-2);
}

#[test]
fn shared_experts_are_added_unweighted_on_the_full_width_input() {
    let d = tiny_dims();
    let mut src = MemSource::random(&d, 26);
    // Zero routed contribution: the output is exactly the shared SiTU MLP of x.
    src.set(
        &layer_name(1, "block_sparse_moe.routed_expert_up_proj.weight"),
        &vec![0.0; d.hidden * d.latent],
    );
    let run = src.layer(1).unwrap();
    let bound = BoundLayer::bind(&d, &run, None, false).unwrap();
    let lw = bound.weights(&run).unwrap();
    let Mlp::Moe(moe) = &lw.mlp else { panic!() };
    let x = rand_x(2, d.hidden, 9);
    let routing = moe.route(&d, &x, 2);
    let ids = routing.unique();
    let batch = src.experts(1, &ids).unwrap();
    let (got, _) = moe.forward(&d, &x, 2, &routing, &ids, &batch);
    let mut want = Vec::new();
    for t in 0..2 {
        let xt: Vec<f64> = x[t * d.hidden..(t + 1) * d.hidden]
            .iter()
            .map(|&v| v as f64)
            .collect();
        want.extend(shared_ref(&src, 1, &xt));
    }
    let err = rel_err(&got, &want);
    assert!(err <= 1e-5, "shared experts: rel err {err}");
}

// ---------------------------------------------------------------- AttnRes schedule (I27–I30)

fn attn_res_ref(sources: &[Vec<f64>], w: &[f64], eps: f64) -> Vec<f64> {
    let sc: Vec<f64> = sources
        .iter()
        .map(|s| {
            let ms = s.iter().map(|v| v * v).sum::<f64>() / s.len() as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            s.iter().zip(w).map(|(a, b)| a * inv * b).sum()
        })
        .collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
    let mut out = vec![0.0; w.len()];
    for (s, scv) in sources.iter().zip(&sc) {
        let p = (scv - m).exp() / z;
        for (o, v) in out.iter_mut().zip(s) {
            *o += p * v;
        }
    }
    out
}

#[test]
fn block_attn_res_schedule_on_13_layers_with_block_3() {
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    let src = MemSource::random(&tiny_dims(), 27);
    let d = src.dims.clone();
    let e = d.hidden;
    let taps: RefCell<BTreeMap<(usize, String), Vec<f32>>> = RefCell::new(BTreeMap::new());
    let ids = [4u32, 8, 15, 16];
    let logits = {
        let mut m = Model::new(d.clone(), &src, None).unwrap();
        m.tap = Some(Box::new(|l, name, v| {
            taps.borrow_mut().insert((l, name.to_string()), v.to_vec());
        }));
        let mut st = m.new_state(8);
        m.forward(&ids, &mut st, Logits::All).unwrap()
    };
    let taps = taps.into_inner();
    let tap = |l: usize, n: &str| taps[&(l, n.to_string())].clone();
    let fold = |n: &str, p: &str| -> Vec<f64> {
        src.get(n)
            .iter()
            .zip(src.get(p))
            .map(|(a, b)| *a as f64 * b as f64)
            .collect()
    };
    let emb = src.get("language_model.model.embed_tokens.weight");
    for (t, &id) in ids.iter().enumerate() {
        let row =
            |v: &[f32]| -> Vec<f64> { v[t * e..(t + 1) * e].iter().map(|&x| x as f64).collect() };
        let check = |what: &str, got: &[f32], want: &[f64]| {
            let err = rel_err(&got[t * e..(t + 1) * e], want);
            assert!(err <= 1e-5, "token {t} {what}: rel err {err}");
        };
        let mut bank: Vec<Vec<f64>> = Vec::new();
        let mut pend: Option<Vec<f64>> = Some(
            emb[id as usize * e..(id as usize + 1) * e]
                .iter()
                .map(|&x| x as f64)
                .collect(),
        );
        for l in 0..d.n_layers {
            let p = pend.take().unwrap();
            let x = if bank.is_empty() {
                p.clone()
            } else {
                let mut s = bank.clone();
                s.push(p.clone());
                attn_res_ref(
                    &s,
                    &fold(
                        &layer_name(l, "self_attention_res_norm.weight"),
                        &layer_name(l, "self_attention_res_proj.weight"),
                    ),
                    1e-5,
                )
            };
            check(&format!("layer {l} attn_in"), &tap(l, "attn_in"), &x);
            let boundary = l % d.block == 0;
            if boundary {
                bank.push(p.clone());
            }
            let a = row(&tap(l, "attn_out"));
            let p = if boundary {
                a
            } else {
                p.iter().zip(&a).map(|(x, y)| x + y).collect()
            };
            let mut s = bank.clone();
            s.push(p.clone());
            let wm = fold(
                &layer_name(l, "mlp_res_norm.weight"),
                &layer_name(l, "mlp_res_proj.weight"),
            );
            let x = attn_res_ref(&s, &wm, 1e-5);
            check(&format!("layer {l} mlp_in"), &tap(l, "mlp_in"), &x);
            if l == 3 {
                // A boundary variant that forgets to reset pend would see a different input.
                let mut s2 = bank[..1].to_vec();
                s2.push(p.iter().zip(&bank[1]).map(|(a, b)| a + b).collect());
                let alt = attn_res_ref(&s2, &wm, 1e-5);
                assert!(rel_err(&tap(l, "mlp_in")[t * e..(t + 1) * e], &alt) > 1e-3);
            }
            let m = row(&tap(l, "mlp_out"));
            pend = Some(p.iter().zip(&m).map(|(x, y)| x + y).collect());
        }
        assert_eq!(bank.len(), 5, "snapshots at 0,3,6,9,12 = ceil(13/3)");
        let mut s = bank.clone();
        s.push(pend.unwrap());
        let x = attn_res_ref(
            &s,
            &fold(
                "language_model.model.output_attn_res_norm.weight",
                "language_model.model.output_attn_res_proj.weight",
            ),
            1e-5,
        );
        check("final aggregate", &tap(d.n_layers, "final_in"), &x);
        // I30: aggregator, then the final norm, then lm_head.
        let xn = rms(&x, &src.get("language_model.model.norm.weight"), 1e-5);
        let want = mv(&src.get("language_model.lm_head.weight"), d.vocab, e, &xn);
        let err = rel_err(&logits[t * d.vocab..(t + 1) * d.vocab], &want);
        assert!(err <= 1e-5, "token {t} logits: rel err {err}");
    }
}
