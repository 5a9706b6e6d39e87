//! The model config reader (SPEC.md §1). It refuses to guess.
//!
//! Two shapes are accepted:
//! * **nested** (the released `config.json`): the language model lives in `text_config`; each key
//!   is searched in `text_config` → `text_config.linear_attn_config` → root, except the KDA
//!   `num_heads` / `head_dim`, which come from `linear_attn_config` first (a re-saved config can
//!   carry a computed `text_config.head_dim = 74`, SPEC.md §8 I2);
//! * **flat** (kimi-k3-in-c fixtures): every key at the root, KDA and SiTU keys renamed
//!   (`kda_num_heads`, `kda_head_dim`, `situ_beta`, `situ_linear_beta`), no `kda_layers`.
//!
//! Every required field is required: a missing or ill-typed one is collected, and all problems
//! are reported at once in a [`ConfigError`]. Only three booleans have defaults
//! (`mla_use_output_gate`, `moe_renormalize`, `latent_moe_use_norm`, all true).

use std::path::Path;

use serde_json::{Map, Value};

use crate::expert::ExpertLayout;

/// Which of the two config shapes was read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigShape {
    /// Released file: `text_config` (+ `linear_attn_config`) inside a multimodal wrapper.
    Nested,
    /// kimi-k3-in-c fixture: all keys at the root.
    Flat,
}

impl ConfigShape {
    /// `"nested"` / `"flat"`.
    pub const fn name(self) -> &'static str {
        match self {
            ConfigShape::Nested => "nested",
            ConfigShape::Flat => "flat",
        }
    }
}

/// Attention kind of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Kimi Delta Attention (linear attention).
    Kda,
    /// Gated MLA (global attention, NoPE).
    Mla,
}

impl LayerKind {
    /// `'K'` or `'M'`, as in the layer-map string.
    pub const fn letter(self) -> char {
        match self {
            LayerKind::Kda => 'K',
            LayerKind::Mla => 'M',
        }
    }
}

/// Upper bound on any size field: keeps every product of two sizes far inside `u64`.
const MAX_DIM: u64 = 1 << 24;
/// Upper bound on `num_hidden_layers` (93 in the release).
const MAX_LAYERS: usize = 4096;

/// Everything the forward pass needs from `config.json`. Field meanings: SPEC.md §1.1.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub shape: ConfigShape,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    /// eps of q_a_layernorm / kv_a_layernorm: 1e-6 (HF upstream; SPEC.md §10 C1). Not read from
    /// the file; settable by callers that reproduce kimi-k3-in-c (1e-5).
    pub mla_norm_eps: f32,
    /// SiTU β1 (gate cap), `activation_situ_beta` / `situ_beta`.
    pub situ_beta: f32,
    /// SiTU β2 (up cap), `activation_situ_linear_beta` / `situ_linear_beta`.
    pub situ_linear_beta: f32,
    /// Width of the dense MLP of layers `< first_k_dense_replace`.
    pub intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    /// Latent width of the routed experts.
    pub routed_expert_hidden_size: usize,
    pub latent_moe_use_norm: bool,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f32,
    /// MLA heads.
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub mla_use_output_gate: bool,
    pub kda_num_heads: usize,
    pub kda_head_dim: usize,
    pub short_conv_kernel_size: usize,
    pub gate_lower_bound: f32,
    /// 1-based, as in the file.
    pub full_attn_layers: Vec<usize>,
    /// 1-based (derived as the complement in the flat shape or when absent).
    pub kda_layers: Vec<usize>,
    pub attn_res_block_size: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (an int or a list in the file); empty when absent.
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

/// Every problem found in a config, reported at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub problems: Vec<String>,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "config rejected ({} problem", self.problems.len())?;
        if self.problems.len() != 1 {
            f.write_str("s")?;
        }
        f.write_str("):")?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    fn one(p: String) -> ConfigError {
        ConfigError { problems: vec![p] }
    }
}

impl ModelConfig {
    /// Parse and validate a config from its JSON text.
    pub fn from_json_str(s: &str) -> Result<ModelConfig, ConfigError> {
        let root: Value = serde_json::from_str(s)
            .map_err(|e| ConfigError::one(format!("config is not valid JSON: {e}")))?;
        let Value::Object(root) = root else {
            return Err(ConfigError::one(
                "config must be a JSON object at the top level".into(),
            ));
        };
        Reader::new(&root)?.read()
    }

    /// Read and validate `path` (normally `<model_dir>/config.json`).
    pub fn load(path: &Path) -> Result<ModelConfig, ConfigError> {
        // A config is a few KB; refuse absurd files before reading them into memory.
        const MAX_CONFIG_BYTES: u64 = 16 << 20;
        let meta = std::fs::metadata(path)
            .map_err(|e| ConfigError::one(format!("cannot read {}: {e}", path.display())))?;
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(ConfigError::one(format!(
                "{} is {} bytes, larger than any config ({} bytes max)",
                path.display(),
                meta.len(),
                MAX_CONFIG_BYTES
            )));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::one(format!("cannot read {}: {e}", path.display())))?;
        ModelConfig::from_json_str(&text)
    }

    /// Attention kind of 0-based layer `l`: MLA iff `l + 1` is in `full_attn_layers`.
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        if self.full_attn_layers.contains(&(l + 1)) {
            LayerKind::Mla
        } else {
            LayerKind::Kda
        }
    }

    /// Whether 0-based layer `l` has a MoE block (otherwise a dense MLP named `mlp.`).
    pub fn is_moe(&self, l: usize) -> bool {
        l >= self.first_k_dense_replace
    }

    /// One letter per layer, `K` (KDA) or `M` (MLA), e.g. `"KKKMKKKMKKKMM"`.
    pub fn layer_map(&self) -> String {
        (0..self.num_hidden_layers)
            .map(|l| self.layer_kind(l).letter())
            .collect()
    }

    /// Number of MLA layers.
    pub fn n_mla(&self) -> usize {
        (0..self.num_hidden_layers)
            .filter(|&l| self.layer_kind(l) == LayerKind::Mla)
            .count()
    }

    /// Number of KDA layers.
    pub fn n_kda(&self) -> usize {
        self.num_hidden_layers - self.n_mla()
    }

    /// Number of MoE layers.
    pub fn n_moe(&self) -> usize {
        self.num_hidden_layers
            .saturating_sub(self.first_k_dense_replace)
    }

    /// Byte layout of one routed MXFP4 expert.
    pub fn expert_layout(&self) -> ExpertLayout {
        ExpertLayout {
            inter: self.moe_intermediate_size,
            latent: self.routed_expert_hidden_size,
        }
    }

    /// The first `n` layers only (for `--layers N`); `n` is clamped to `num_hidden_layers`.
    pub fn with_layers(&self, n: usize) -> ModelConfig {
        let n = n.min(self.num_hidden_layers);
        let mut c = self.clone();
        c.num_hidden_layers = n;
        c.full_attn_layers.retain(|&x| x <= n);
        c.kda_layers.retain(|&x| x <= n);
        c.first_k_dense_replace = c.first_k_dense_replace.min(n);
        c
    }
}

/// Looks keys up in the scopes of one shape and collects every problem.
struct Reader<'a> {
    shape: ConfigShape,
    text: Option<&'a Map<String, Value>>,
    linear: Option<&'a Map<String, Value>>,
    root: &'a Map<String, Value>,
    problems: Vec<String>,
}

/// Where a value was found, for messages.
struct Found<'a> {
    value: &'a Value,
    at: String,
}

impl<'a> Reader<'a> {
    fn new(root: &'a Map<String, Value>) -> Result<Reader<'a>, ConfigError> {
        match root.get("text_config") {
            None => Ok(Reader {
                shape: ConfigShape::Flat,
                text: None,
                linear: None,
                root,
                problems: Vec::new(),
            }),
            Some(Value::Object(text)) => {
                let linear = match text.get("linear_attn_config") {
                    None => None,
                    Some(Value::Object(l)) => Some(l),
                    Some(_) => {
                        return Err(ConfigError::one(
                            "`text_config.linear_attn_config` must be an object".into(),
                        ))
                    }
                };
                Ok(Reader {
                    shape: ConfigShape::Nested,
                    text: Some(text),
                    linear,
                    root,
                    problems: Vec::new(),
                })
            }
            Some(_) => Err(ConfigError::one("`text_config` must be an object".into())),
        }
    }

    /// Scopes in search order with their display prefixes.
    fn scopes(&self) -> Vec<(&'a Map<String, Value>, &'static str)> {
        let mut v = Vec::with_capacity(3);
        if let Some(t) = self.text {
            v.push((t, "text_config."));
        }
        if let Some(l) = self.linear {
            v.push((l, "text_config.linear_attn_config."));
        }
        v.push((self.root, ""));
        v
    }

    /// First occurrence of any of `names` (each searched through every scope, names in order).
    /// Explicit `null` counts as absent.
    fn find(&self, names: &[&str]) -> Option<Found<'a>> {
        for name in names {
            for (scope, prefix) in self.scopes() {
                match scope.get(*name) {
                    None | Some(Value::Null) => {}
                    Some(v) => {
                        return Some(Found {
                            value: v,
                            at: format!("{prefix}{name}"),
                        })
                    }
                }
            }
        }
        None
    }

    /// The KDA keys that must not be shadowed by `text_config` (§8 I2).
    fn find_kda(&self, nested_key: &str, flat_key: &str) -> Option<Found<'a>> {
        if let Some(l) = self.linear {
            if let Some(v) = l.get(nested_key).filter(|v| !v.is_null()) {
                return Some(Found {
                    value: v,
                    at: format!("text_config.linear_attn_config.{nested_key}"),
                });
            }
        }
        self.find(&[flat_key])
    }

    /// The name to print for a missing field.
    fn describe(&self, names: &[&str]) -> String {
        let main = match self.shape {
            ConfigShape::Nested => names[0],
            ConfigShape::Flat => names[names.len() - 1],
        };
        let mut s = format!("`{main}`");
        let others: Vec<String> = names
            .iter()
            .filter(|n| **n != main)
            .map(|n| format!("`{n}`"))
            .collect();
        if !others.is_empty() {
            s.push_str(&format!(" (or {})", others.join(", ")));
        }
        s
    }

    fn missing(&mut self, names: &[&str]) {
        let d = self.describe(names);
        self.problems.push(format!(
            "missing required field {d} ({} shape)",
            self.shape.name()
        ));
    }

    fn usize_of(&mut self, f: Found<'_>) -> Option<usize> {
        match f.value.as_u64() {
            Some(x) if x <= MAX_DIM => Some(x as usize),
            Some(x) => {
                self.problems.push(format!(
                    "`{}` = {x} is larger than any plausible size ({MAX_DIM})",
                    f.at
                ));
                None
            }
            None => {
                self.problems.push(format!(
                    "`{}` must be a non-negative integer, found {}",
                    f.at, f.value
                ));
                None
            }
        }
    }

    fn req_usize(&mut self, names: &[&str]) -> usize {
        match self.find(names) {
            Some(f) => self.usize_of(f).unwrap_or(0),
            None => {
                self.missing(names);
                0
            }
        }
    }

    fn req_kda_usize(&mut self, nested_key: &str, flat_key: &str) -> usize {
        if let Some(l) = self.linear {
            let a = l.get(nested_key).filter(|v| !v.is_null()).map(|v| Found {
                value: v,
                at: format!("text_config.linear_attn_config.{nested_key}"),
            });
            let b = self.find(&[flat_key]);
            self.check_alias(a, b);
        }
        match self.find_kda(nested_key, flat_key) {
            Some(f) => self.usize_of(f).unwrap_or(0),
            None => {
                let d = match self.shape {
                    ConfigShape::Nested => {
                        format!("`linear_attn_config.{nested_key}` (or `{flat_key}`)")
                    }
                    ConfigShape::Flat => format!("`{flat_key}`"),
                };
                self.problems.push(format!(
                    "missing required field {d} ({} shape)",
                    self.shape.name()
                ));
                0
            }
        }
    }

    /// Reports two spellings of one field (`names[0]` and `names[1]`, e.g. the nested and flat
    /// SiTU names) that are both present with different values.
    fn check_alias(&mut self, a: Option<Found<'_>>, b: Option<Found<'_>>) {
        if let (Some(a), Some(b)) = (a, b) {
            let same = match (a.value.as_f64(), b.value.as_f64()) {
                (Some(x), Some(y)) => x == y,
                _ => a.value == b.value,
            };
            if !same {
                self.problems.push(format!(
                    "`{}` = {} conflicts with `{}` = {}",
                    a.at, a.value, b.at, b.value
                ));
            }
        }
    }

    fn req_f32(&mut self, names: &[&str]) -> f32 {
        if names.len() == 2 {
            let (a, b) = (self.find(&names[..1]), self.find(&names[1..]));
            self.check_alias(a, b);
        }
        let Some(f) = self.find(names) else {
            self.missing(names);
            return 0.0;
        };
        match f.value.as_f64() {
            Some(x) if x.is_finite() && (x as f32).is_finite() => x as f32,
            _ => {
                self.problems.push(format!(
                    "`{}` must be a finite number, found {}",
                    f.at, f.value
                ));
                0.0
            }
        }
    }

    fn bool_of(&mut self, f: &Found<'_>) -> Option<bool> {
        match f.value {
            Value::Bool(b) => Some(*b),
            v => {
                self.problems
                    .push(format!("`{}` must be true or false, found {v}", f.at));
                None
            }
        }
    }

    fn req_bool(&mut self, names: &[&str]) -> bool {
        match self.find(names) {
            Some(f) => self.bool_of(&f).unwrap_or(false),
            None => {
                self.missing(names);
                false
            }
        }
    }

    fn opt_bool(&mut self, names: &[&str], default: bool) -> bool {
        match self.find(names) {
            Some(f) => self.bool_of(&f).unwrap_or(default),
            None => default,
        }
    }

    /// A 1-based layer list; `None` if absent. Ill-typed entries are reported.
    fn layer_list(&mut self, f: Found<'_>) -> Vec<usize> {
        let Value::Array(items) = f.value else {
            self.problems.push(format!(
                "`{}` must be a list of 1-based layer numbers, found {}",
                f.at, f.value
            ));
            return Vec::new();
        };
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            match it.as_u64() {
                Some(x) if x <= MAX_DIM => out.push(x as usize),
                _ => {
                    self.problems.push(format!(
                        "`{}` must contain only non-negative integers, found {it}",
                        f.at
                    ));
                    return Vec::new();
                }
            }
        }
        out
    }

    fn token_id(&mut self, f: &Found<'_>, v: &Value) -> Option<u32> {
        match v.as_u64() {
            Some(x) if x <= u64::from(u32::MAX) => Some(x as u32),
            _ => {
                self.problems
                    .push(format!("`{}` must be a token id, found {v}", f.at));
                None
            }
        }
    }

    fn opt_token(&mut self, name: &str) -> Option<u32> {
        let f = self.find(&[name])?;
        let v = f.value;
        self.token_id(&f, v)
    }

    fn eos_tokens(&mut self) -> Vec<u32> {
        let Some(f) = self.find(&["eos_token_id"]) else {
            return Vec::new();
        };
        match f.value {
            Value::Array(items) => items.iter().filter_map(|v| self.token_id(&f, v)).collect(),
            v => self.token_id(&f, v).into_iter().collect(),
        }
    }

    /// A string field that, if present, must have one value (a different value is a different
    /// model).
    fn expect_str(&mut self, name: &str, want: &str) {
        if let Some(f) = self.find(&[name]) {
            if f.value.as_str() != Some(want) {
                self.problems.push(format!(
                    "`{}` = {} is not supported (k3 implements only \"{want}\")",
                    f.at, f.value
                ));
            }
        }
    }

    /// An integer field that, if present, must equal `want`.
    fn expect_u64(&mut self, name: &str, want: u64, why: &str) {
        if let Some(f) = self.find(&[name]) {
            if f.value.as_u64() != Some(want) {
                self.problems
                    .push(format!("`{}` = {} is not supported ({why})", f.at, f.value));
            }
        }
    }

    /// A boolean field that, if present, must be `want`.
    fn expect_bool(&mut self, name: &str, want: bool, why: &str) {
        if let Some(f) = self.find(&[name]) {
            if f.value.as_bool() != Some(want) {
                self.problems
                    .push(format!("`{}` = {} is not supported ({why})", f.at, f.value));
            }
        }
    }

    fn read(mut self) -> Result<ModelConfig, ConfigError> {
        let mut c = self.scalars();
        let full_attn_layers = match self.find(&["full_attn_layers"]) {
            Some(f) => Some(self.layer_list(f)),
            None => {
                self.missing(&["full_attn_layers"]);
                None
            }
        };
        // The flat shape has no kda_layers (derived); the nested one may omit it too.
        let kda_given = match self.shape {
            ConfigShape::Nested => self.find(&["kda_layers"]).map(|f| self.layer_list(f)),
            ConfigShape::Flat => None,
        };
        self.expect_supported();
        if let Some(full) = &full_attn_layers {
            c.kda_layers = self.layer_maps(c.num_hidden_layers, full, kda_given.as_deref());
        }
        c.full_attn_layers = full_attn_layers.unwrap_or_default();
        self.check_sizes(&c);
        // bos/eos/pad ids may lie outside a small model's vocabulary (a tiny test model keeps
        // the real tokenizer's special ids): such an id can never be generated, so stopping on it
        // is a no-op, not a reason to refuse the config.
        if !self.problems.is_empty() {
            return Err(ConfigError {
                problems: self.problems,
            });
        }
        Ok(c)
    }

    /// Every scalar field, read in the order the problems are listed (a missing or ill-typed
    /// one is a problem and reads as 0); the layer lists are left empty.
    fn scalars(&mut self) -> ModelConfig {
        ModelConfig {
            shape: self.shape,
            hidden_size: self.req_usize(&["hidden_size"]),
            num_hidden_layers: self.req_usize(&["num_hidden_layers"]),
            vocab_size: self.req_usize(&["vocab_size"]),
            rms_norm_eps: self.req_f32(&["rms_norm_eps"]),
            mla_norm_eps: 1e-6,
            situ_beta: self.req_f32(&["activation_situ_beta", "situ_beta"]),
            situ_linear_beta: self.req_f32(&["activation_situ_linear_beta", "situ_linear_beta"]),
            intermediate_size: self.req_usize(&["intermediate_size"]),
            first_k_dense_replace: self.req_usize(&["first_k_dense_replace"]),
            num_experts: self.req_usize(&["num_experts"]),
            num_experts_per_token: self.req_usize(&["num_experts_per_token"]),
            num_shared_experts: self.req_usize(&["num_shared_experts"]),
            moe_intermediate_size: self.req_usize(&["moe_intermediate_size"]),
            routed_expert_hidden_size: self.req_usize(&["routed_expert_hidden_size"]),
            latent_moe_use_norm: self.opt_bool(&["latent_moe_use_norm"], true),
            moe_renormalize: self.opt_bool(&["moe_renormalize"], true),
            routed_scaling_factor: self.req_f32(&["routed_scaling_factor"]),
            num_attention_heads: self.req_usize(&["num_attention_heads"]),
            q_lora_rank: self.req_usize(&["q_lora_rank"]),
            kv_lora_rank: self.req_usize(&["kv_lora_rank"]),
            qk_nope_head_dim: self.req_usize(&["qk_nope_head_dim"]),
            qk_rope_head_dim: self.req_usize(&["qk_rope_head_dim"]),
            v_head_dim: self.req_usize(&["v_head_dim"]),
            mla_use_output_gate: self.opt_bool(&["mla_use_output_gate"], true),
            kda_num_heads: self.req_kda_usize("num_heads", "kda_num_heads"),
            kda_head_dim: self.req_kda_usize("head_dim", "kda_head_dim"),
            short_conv_kernel_size: self.req_usize(&["short_conv_kernel_size"]),
            gate_lower_bound: self.req_f32(&["gate_lower_bound"]),
            attn_res_block_size: self.req_usize(&["attn_res_block_size"]),
            tie_word_embeddings: self.req_bool(&["tie_word_embeddings"]),
            bos_token_id: self.opt_token("bos_token_id"),
            eos_token_ids: self.eos_tokens(),
            pad_token_id: self.opt_token("pad_token_id"),
            full_attn_layers: Vec::new(),
            kda_layers: Vec::new(),
        }
    }

    /// Fields whose other values would silently make a different model.
    fn expect_supported(&mut self) {
        self.expect_bool(
            "mla_use_nope",
            true,
            "MLA without NoPE rotates q/k: a different model",
        );
        self.expect_str("hidden_act", "situ");
        self.expect_str("moe_router_activation_func", "sigmoid");
        self.expect_bool(
            "use_full_rank_gate",
            true,
            "a low-rank KDA output gate (g_a/g_b) is not implemented",
        );
        self.expect_u64("moe_layer_freq", 1, "every non-dense layer must be MoE");
        self.expect_u64(
            "num_expert_group",
            1,
            "grouped top-k routing is not implemented",
        );
        self.expect_u64("topk_group", 1, "grouped top-k routing is not implemented");
    }

    /// The KDA layers (1-based) of an `n`-layer model whose MLA layers are `full`: `kda_given`
    /// when it is the complement of `full`, else derived (SPEC.md §1.2). Problems are recorded;
    /// those whose inputs were already reported are skipped.
    fn layer_maps(&mut self, n: usize, full: &[usize], kda_given: Option<&[usize]>) -> Vec<usize> {
        if n == 0 || n > MAX_LAYERS {
            if self.find(&["num_hidden_layers"]).is_some() {
                self.problems.push(format!(
                    "`num_hidden_layers` = {n} must be in 1..={MAX_LAYERS}"
                ));
            }
            return Vec::new();
        }
        let full_ok = self.check_layer_list("full_attn_layers", full, n);
        let kda_ok = match kda_given {
            Some(k) => self.check_layer_list("kda_layers", k, n),
            None => true,
        };
        if !(full_ok && kda_ok) {
            return Vec::new();
        }
        if full.len() == n {
            self.problems.push(
                "every layer is in `full_attn_layers`: the config has no KDA layer \
                 (at least one is required)"
                    .into(),
            );
        }
        let complement: Vec<usize> = (1..=n).filter(|x| !full.contains(x)).collect();
        let Some(k) = kda_given else {
            return complement;
        };
        if let Some(x) = k.iter().find(|x| full.contains(x)) {
            self.problems.push(format!(
                "layer {x} (1-based) is in both `kda_layers` and `full_attn_layers`"
            ));
            return Vec::new();
        }
        if k.len() != complement.len() {
            let missing: Vec<usize> = (complement.iter().copied())
                .filter(|x| !k.contains(x))
                .collect();
            self.problems.push(format!(
                "`kda_layers` ∪ `full_attn_layers` must be 1..={n}; missing (1-based) {missing:?}"
            ));
            return Vec::new();
        }
        let mut k = k.to_vec();
        k.sort_unstable();
        k
    }

    /// The sizes' own rules (positive where they must be, expert widths whole MXFP4 groups, …).
    fn check_sizes(&mut self, c: &ModelConfig) {
        self.positive("hidden_size", c.hidden_size);
        self.positive("vocab_size", c.vocab_size);
        self.positive("num_experts", c.num_experts);
        self.positive("num_experts_per_token", c.num_experts_per_token);
        self.positive("num_attention_heads", c.num_attention_heads);
        self.positive("q_lora_rank", c.q_lora_rank);
        self.positive("kv_lora_rank", c.kv_lora_rank);
        self.positive("qk_nope_head_dim", c.qk_nope_head_dim);
        self.positive("v_head_dim", c.v_head_dim);
        self.positive("moe_intermediate_size", c.moe_intermediate_size);
        self.positive("routed_expert_hidden_size", c.routed_expert_hidden_size);
        self.positive("attn_res_block_size", c.attn_res_block_size);
        self.positive("short_conv_kernel_size", c.short_conv_kernel_size);
        self.positive_kda("num_heads", "kda_num_heads", c.kda_num_heads);
        self.positive_kda("head_dim", "kda_head_dim", c.kda_head_dim);
        let (experts, per_token) = (c.num_experts, c.num_experts_per_token);
        if experts > 0 && per_token > experts {
            self.problems.push(format!(
                "`num_experts_per_token` = {per_token} exceeds `num_experts` = {experts}"
            ));
        }
        for (name, v) in [
            ("routed_expert_hidden_size", c.routed_expert_hidden_size),
            ("moe_intermediate_size", c.moe_intermediate_size),
        ] {
            if v % 32 != 0 {
                self.problems.push(format!(
                    "`{name}` = {v} is not a multiple of 32 (MXFP4 groups of 32 along every \
                     expert input width)"
                ));
            }
        }
        let (n, k) = (c.num_hidden_layers, c.first_k_dense_replace);
        if n > 0 && k > n {
            self.problems.push(format!(
                "`first_k_dense_replace` = {k} exceeds `num_hidden_layers` = {n}"
            ));
        }
        if k > 0 && self.find(&["intermediate_size"]).is_some() {
            self.positive("intermediate_size", c.intermediate_size);
        }
        let eps = c.rms_norm_eps;
        if self.find(&["rms_norm_eps"]).is_some()
            && eps.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        {
            self.problems
                .push(format!("`rms_norm_eps` = {eps} must be positive"));
        }
    }

    /// Reports `name = 0` if the field was present (absent ones are already reported).
    fn positive(&mut self, name: &str, v: usize) {
        if v == 0 && self.find(&[name]).is_some() {
            self.problems.push(format!("`{name}` must be at least 1"));
        }
    }

    fn positive_kda(&mut self, nested_key: &str, flat_key: &str, v: usize) {
        if v == 0 {
            if let Some(f) = self.find_kda(nested_key, flat_key) {
                if f.value.as_u64() == Some(0) {
                    self.problems.push(format!("`{}` must be at least 1", f.at));
                }
            }
        }
    }

    /// Indices in `1..=n`, no duplicates. Returns whether the list is usable.
    fn check_layer_list(&mut self, name: &str, list: &[usize], n: usize) -> bool {
        let mut ok = true;
        let mut seen = vec![false; n + 1];
        for &x in list {
            if x == 0 || x > n {
                let hint = if x == 0 {
                    " (layer lists are 1-based: 0 is not a layer)"
                } else {
                    ""
                };
                self.problems
                    .push(format!("`{name}` contains {x}, outside 1..={n}{hint}"));
                ok = false;
            } else if seen[x] {
                self.problems
                    .push(format!("`{name}` lists layer {x} twice"));
                ok = false;
            } else {
                seen[x] = true;
            }
        }
        ok
    }
}
