//! The model's dimensions, derived once from its config, and what can go wrong in binding or
//! running it. A leaf: every other file of the model reads these, and this reads none of them.

use k3_proto::config::{LayerKind, ModelConfig};
use k3_store::runtime::source::SourceError;

/// Every dimension and constant the forward pass needs, derived once from the model config.
///
/// Field names follow `config.json` (SPEC.md §1); layer indices are 0-based.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    /// E: hidden width (7168).
    pub hidden: usize,
    /// Number of decoder layers bound and run (93, or fewer with `--layers N`).
    pub n_layers: usize,
    /// Embedding / lm_head rows (163840).
    pub vocab: usize,
    /// `rms_norm_eps` (1e-5): every RMSNorm except the MLA q_a/kv_a layernorms.
    pub rms_eps: f32,
    /// eps of `q_a_layernorm` / `kv_a_layernorm` (1e-6, SPEC.md §10 C1).
    pub mla_norm_eps: f32,
    /// SiTU β1, the gate cap (4.0).
    pub situ_beta: f32,
    /// SiTU β2, the up cap (25.0).
    pub situ_linear_beta: f32,
    /// Dense MLP width (`intermediate_size`, 33792).
    pub dense_inter: usize,
    /// Layers `< first_k_dense` are dense MLP (`mlp.*`), the rest MoE.
    pub first_k_dense: usize,
    /// Routed experts per MoE layer (896).
    pub n_experts: usize,
    /// Experts selected per token (16).
    pub top_k: usize,
    /// Shared experts, fused into one MLP of width `n_shared · moe_inter` (2).
    pub n_shared: usize,
    /// Routed expert intermediate width (3072).
    pub moe_inter: usize,
    /// Routed-expert latent width (3584).
    pub latent: usize,
    /// RMSNorm on the aggregated latent (`latent_moe_use_norm`).
    pub latent_norm: bool,
    /// Renormalise the selected weights (`moe_renormalize`).
    pub renormalize: bool,
    /// `routed_scaling_factor` (1.0).
    pub routed_scale: f32,
    /// MLA heads (96).
    pub mla_heads: usize,
    /// `q_lora_rank` (1536).
    pub q_lora: usize,
    /// `kv_lora_rank` (512).
    pub kv_lora: usize,
    /// `qk_nope_head_dim` (128).
    pub nope: usize,
    /// `qk_rope_head_dim` (64; projected and scored, never rotated).
    pub rope: usize,
    /// `v_head_dim` (128).
    pub v_head: usize,
    /// `mla_use_output_gate`: MLA layers carry `g_proj`.
    pub mla_gate: bool,
    /// KDA heads (96).
    pub kda_heads: usize,
    /// KDA head dim, d_k = d_v (128); also the rank of the f_a/f_b decay bottleneck.
    pub kda_dim: usize,
    /// Short conv taps (4).
    pub conv_k: usize,
    /// KDA gate lower bound (-5).
    pub gate_lb: f32,
    /// Per layer: true = MLA, false = KDA (`mla[l]` iff `l+1 ∈ full_attn_layers`).
    pub mla: Vec<bool>,
    /// `attn_res_block_size` (12): layer L is a boundary iff `L % block == 0`.
    pub block: usize,
}

impl Dims {
    /// Derive the dims from a config read by `k3_proto::config` (already validated there).
    pub fn from_config(c: &ModelConfig) -> Result<Dims, ModelError> {
        let d = Dims {
            hidden: c.hidden_size,
            n_layers: c.num_hidden_layers,
            vocab: c.vocab_size,
            rms_eps: c.rms_norm_eps,
            mla_norm_eps: c.mla_norm_eps,
            situ_beta: c.situ_beta,
            situ_linear_beta: c.situ_linear_beta,
            dense_inter: c.intermediate_size,
            first_k_dense: c.first_k_dense_replace,
            n_experts: c.num_experts,
            top_k: c.num_experts_per_token,
            n_shared: c.num_shared_experts,
            moe_inter: c.moe_intermediate_size,
            latent: c.routed_expert_hidden_size,
            latent_norm: c.latent_moe_use_norm,
            renormalize: c.moe_renormalize,
            routed_scale: c.routed_scaling_factor,
            mla_heads: c.num_attention_heads,
            q_lora: c.q_lora_rank,
            kv_lora: c.kv_lora_rank,
            nope: c.qk_nope_head_dim,
            rope: c.qk_rope_head_dim,
            v_head: c.v_head_dim,
            mla_gate: c.mla_use_output_gate,
            kda_heads: c.kda_num_heads,
            kda_dim: c.kda_head_dim,
            conv_k: c.short_conv_kernel_size,
            gate_lb: c.gate_lower_bound,
            mla: (0..c.num_hidden_layers)
                .map(|l| c.layer_kind(l) == LayerKind::Mla)
                .collect(),
            block: c.attn_res_block_size,
        };
        d.validate()?;
        Ok(d)
    }

    /// Structural checks the forward pass relies on; lists every problem at once.
    pub fn validate(&self) -> Result<(), ModelError> {
        let mut p = Vec::new();
        let nz = |name: &str, v: usize, p: &mut Vec<String>| {
            if v == 0 {
                p.push(format!("{name} must be > 0"));
            }
        };
        nz("hidden_size", self.hidden, &mut p);
        nz("num_hidden_layers", self.n_layers, &mut p);
        nz("vocab_size", self.vocab, &mut p);
        nz("attn_res_block_size", self.block, &mut p);
        nz("short_conv_kernel_size", self.conv_k, &mut p);
        nz("kda head_dim", self.kda_dim, &mut p);
        if self.mla.len() != self.n_layers {
            p.push(format!(
                "layer map has {} entries for {} layers",
                self.mla.len(),
                self.n_layers
            ));
        }
        if self.mla.iter().any(|&m| !m) {
            nz("kda num_heads", self.kda_heads, &mut p);
        }
        if self.mla.iter().any(|&m| m) {
            for (n, v) in [
                ("num_attention_heads", self.mla_heads),
                ("q_lora_rank", self.q_lora),
                ("kv_lora_rank", self.kv_lora),
                ("qk_nope_head_dim", self.nope),
                ("v_head_dim", self.v_head),
            ] {
                nz(n, v, &mut p);
            }
        }
        if self.n_layers > self.first_k_dense {
            nz("num_experts", self.n_experts, &mut p);
            nz("num_experts_per_token", self.top_k, &mut p);
            if self.top_k > self.n_experts {
                p.push(format!(
                    "num_experts_per_token {} > num_experts {}",
                    self.top_k, self.n_experts
                ));
            }
            for (n, v) in [
                ("routed_expert_hidden_size", self.latent),
                ("moe_intermediate_size", self.moe_inter),
            ] {
                if v == 0 || v % 32 != 0 {
                    p.push(format!(
                        "{n} = {v} is not a positive multiple of 32 (MXFP4 groups)"
                    ));
                }
            }
            if self.n_experts > u32::MAX as usize {
                p.push("num_experts does not fit u32".into());
            }
        }
        if self.first_k_dense > 0 {
            nz("intermediate_size", self.dense_inter, &mut p);
        }
        if p.is_empty() {
            Ok(())
        } else {
            Err(ModelError::Config(p.join("; ")))
        }
    }

    /// Layer `l` is Gated MLA (else KDA).
    pub fn is_mla(&self, l: usize) -> bool {
        self.mla[l]
    }

    /// Layer `l` is MoE (else dense MLP).
    pub fn is_moe(&self, l: usize) -> bool {
        l >= self.first_k_dense
    }

    /// Floats cached per position per MLA layer: `[c (kv_lora) | kr (rope)]` (576).
    pub fn latent_width(&self) -> usize {
        self.kv_lora + self.rope
    }

    /// Number of MLA layers bound.
    pub fn n_mla(&self) -> usize {
        self.mla.iter().filter(|&&m| m).count()
    }

    /// Number of KDA layers bound.
    pub fn n_kda(&self) -> usize {
        self.n_layers - self.n_mla()
    }

    /// Map like `KKKMKKKMKKKMM`.
    pub fn layer_map(&self) -> String {
        self.mla
            .iter()
            .map(|&m| if m { 'M' } else { 'K' })
            .collect()
    }

    /// The first `n` layers only (`--layers N`); `n` must be in `1..=n_layers`.
    pub fn truncated(&self, n: usize) -> Result<Dims, ModelError> {
        if n == 0 || n > self.n_layers {
            return Err(ModelError::Config(format!(
                "--layers {n} outside 1..={}",
                self.n_layers
            )));
        }
        let mut d = self.clone();
        d.n_layers = n;
        d.mla.truncate(n);
        Ok(d)
    }

    /// Bytes of KDA recurrent state + conv histories for one sequence (independent of length).
    pub fn kda_state_bytes(&self) -> u64 {
        let p = (self.kda_heads * self.kda_dim) as u64;
        let per = (self.kda_heads * self.kda_dim * self.kda_dim) as u64
            + 3 * p * (self.conv_k.saturating_sub(1)) as u64;
        per * 4 * self.n_kda() as u64
    }

    /// Bytes of the MLA latent cache for `positions` positions.
    pub fn mla_cache_bytes(&self, positions: u64) -> u64 {
        positions
            .saturating_mul(self.latent_width() as u64)
            .saturating_mul(4)
            .saturating_mul(self.n_mla() as u64)
    }
}

/// Passes of at most this many positions (a decode step, a verify pass of up to `spec::MAX_K`
/// drafts: spec.rs checks at compile time that they fit)
/// keep their buffers for the next pass. A larger pass (a prefill chunk) frees each stage's
/// buffers when the stage is done and the rest when the pass ends, so its peak is one stage's
/// temporaries at the chunk's size, as `state::Work::bytes_for` states, and the run
/// does not keep a chunk's worth of buffers through its decode.
pub const KEEP_BUFFERS_MAX_POSITIONS: usize = 17;

/// What can go wrong in binding or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor is missing or has the wrong shape, size or dtype.
    #[error("bind: tensor {name}: {problem}")]
    Bind {
        /// Full checkpoint name.
        name: String,
        /// Expected vs found.
        problem: String,
    },
    /// Dimensions that cannot describe a runnable model.
    #[error("config: {0}")]
    Config(String),
    /// The weight source failed.
    #[error("weight source: {0}")]
    Source(#[from] SourceError),
    /// Bad input (token id out of range, empty prompt, …).
    #[error("input: {0}")]
    Input(String),
    /// The thread fetching a layer's experts panicked (a bug in the source, not a config
    /// problem).
    #[error("the expert fetch of layer {layer} panicked: {message}")]
    FetchPanicked {
        /// Layer being fetched.
        layer: usize,
        /// The panic's message.
        message: String,
    },
}

impl ModelError {
    /// The exit code a job ends with for this error (`k3_proto::exit`): 3 when the store the
    /// job is attached to is gone or stopping (no retry on this attachment can succeed; serve
    /// answers 503), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            ModelError::Source(SourceError::StoreGone(_)) => k3_proto::exit::NO_STORE,
            _ => k3_proto::exit::FAILURE,
        }
    }
}
