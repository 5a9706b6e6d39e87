//! Checkpoint tensor names (SPEC.md §2) and their classification.
//!
//! Canonical decoder names start with `language_model.model.layers.{l}.`; the legacy prefix
//! `language_model.layers.` (SPEC.md §10 C6) is rewritten by [`canonical`].

use std::borrow::Cow;

use crate::expert::ExpertPart;

/// Token embedding `[vocab, hidden]`.
pub const EMBED: &str = "language_model.model.embed_tokens.weight";
/// Final RMSNorm gain `[hidden]`.
pub const FINAL_NORM: &str = "language_model.model.norm.weight";
/// Output Block-AttnRes aggregator norm `[hidden]`.
pub const OUT_RES_NORM: &str = "language_model.model.output_attn_res_norm.weight";
/// Output Block-AttnRes aggregator projection `[1, hidden]`.
pub const OUT_RES_PROJ: &str = "language_model.model.output_attn_res_proj.weight";
/// Untied output head `[vocab, hidden]`.
pub const LM_HEAD: &str = "language_model.lm_head.weight";

/// The five model-level tensors.
pub const MODEL_TENSORS: [&str; 5] = [EMBED, FINAL_NORM, OUT_RES_NORM, OUT_RES_PROJ, LM_HEAD];

/// Prefix of every decoder-layer tensor.
pub const LAYER_PREFIX: &str = "language_model.model.layers.";
/// Legacy decoder prefix accepted on input.
pub const LEGACY_LAYER_PREFIX: &str = "language_model.layers.";
/// Routed experts live under `layers.{l}.` + this + `{e}.`.
const EXPERTS_INFIX: &str = "block_sparse_moe.experts.";

/// `"language_model.model.layers.{l}.{suffix}"`.
pub fn layer_tensor(l: usize, suffix: &str) -> String {
    format!("{LAYER_PREFIX}{l}.{suffix}")
}

/// `"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{part.suffix()}"`.
pub fn expert_tensor(l: usize, e: usize, part: ExpertPart) -> String {
    format!("{LAYER_PREFIX}{l}.{EXPERTS_INFIX}{e}.{}", part.suffix())
}

/// Legacy prefix `language_model.layers.` is rewritten to `language_model.model.layers.`; every
/// other name is returned unchanged (borrowed).
pub fn canonical(name: &str) -> Cow<'_, str> {
    match name.strip_prefix(LEGACY_LAYER_PREFIX) {
        Some(rest) => Cow::Owned(format!("{LAYER_PREFIX}{rest}")),
        None => Cow::Borrowed(name),
    }
}

/// What a tensor is, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorClass {
    /// One of the five model-level tensors ([`MODEL_TENSORS`]).
    Model,
    /// Any other tensor under `layers.{layer}.` that is not a routed-expert part (attention,
    /// norms, router, latent projections, shared experts, dense MLP, …).
    Trunk { layer: usize },
    /// One of the six MXFP4 tensors of routed expert `expert` of `layer`.
    Expert {
        layer: usize,
        expert: usize,
        part: ExpertPart,
    },
    /// Vision tower, projector, or anything else the text model does not use.
    Other,
}

/// Parses a decimal index at the start of `s` up to the next `.`: no sign, no leading zeros
/// (except `"0"`), at most 9 digits. Returns the index and the rest after the dot.
fn index_then_dot(s: &str) -> Option<(usize, &str)> {
    let dot = s.find('.')?;
    let digits = &s[..dot];
    if digits.is_empty()
        || digits.len() > 9
        || !digits.bytes().all(|b| b.is_ascii_digit())
        || (digits.len() > 1 && digits.starts_with('0'))
    {
        return None;
    }
    Some((digits.parse().ok()?, &s[dot + 1..]))
}

fn expert_part(suffix: &str) -> Option<ExpertPart> {
    ExpertPart::ALL.into_iter().find(|p| p.suffix() == suffix)
}

/// Classifies a tensor name (canonical or legacy).
pub fn classify(name: &str) -> TensorClass {
    let rest = name
        .strip_prefix(LAYER_PREFIX)
        .or_else(|| name.strip_prefix(LEGACY_LAYER_PREFIX));
    let Some(rest) = rest else {
        return if MODEL_TENSORS.contains(&name) {
            TensorClass::Model
        } else {
            TensorClass::Other
        };
    };
    let Some((layer, suffix)) = index_then_dot(rest) else {
        return TensorClass::Other;
    };
    if suffix.is_empty() {
        return TensorClass::Other;
    }
    if let Some(after) = suffix.strip_prefix(EXPERTS_INFIX) {
        if let Some((expert, part)) = index_then_dot(after) {
            if let Some(part) = expert_part(part) {
                return TensorClass::Expert {
                    layer,
                    expert,
                    part,
                };
            }
        }
    }
    TensorClass::Trunk { layer }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_parsing_is_strict() {
        assert_eq!(index_then_dot("12.x"), Some((12, "x")));
        assert_eq!(index_then_dot("0.x"), Some((0, "x")));
        assert_eq!(index_then_dot("012.x"), None);
        assert_eq!(index_then_dot("+1.x"), None);
        assert_eq!(index_then_dot("1234567890.x"), None);
        assert_eq!(index_then_dot("12"), None);
    }
}
