//! The packed trunk (`trunk.bin` + `trunk.json`, SPEC.md §6.1) and the per-layer read plan.
//!
//! A layer's *trunk* is every non-expert tensor of the layer (attention, norms, router, shared
//! experts). Packing ([`pack_trunk`], `k3-ctl pack-trunk`) writes each layer's trunk as one run
//! of `trunk.bin`, each run starting at a 4096-aligned offset and padded to a multiple of 4096,
//! so a layer is one `O_DIRECT` read; inside a run each tensor starts at a 64-byte offset, stored
//! as the trunk's codec says ([`TrunkCodec`]: the checkpoint's bytes, EC-BF16 coded, or — lossy,
//! opt-in — int8/int4 quantized).
//!
//! **Contiguity rule** (the packer's precondition): sorted by offset, a layer's trunk tensors lie
//! in one shard and each starts exactly where the previous one ends. Safetensors has no padding
//! between tensor data, so a gap means some other tensor sits between two trunk tensors; the
//! packer refuses rather than guess what it is.
//!
//! Without a packed trunk a [`TrunkLayout`] reads layers straight from the shards: a contiguous
//! layer is still one read; otherwise each tensor is read into its own place in a buffer laid out
//! by this module (64-byte aligned, checkpoint order).
//!
//! **Identity and integrity** (trunk format [`TRUNK_FORMAT`]; `format.rs` says what each hash
//! covers). `trunk.json` records the model identity it was packed from (`model.model_id`,
//! `model.id_kind`: [`crate::runtime::identity::ModelIdentity`]), every checkpoint tensor's
//! XXH3-64 and the trunk identity over them, each run's **bound checksum** (its bytes AND its
//! layer's descriptors: tensor offsets, stored sizes, codecs, dtypes, the layer's index) and the
//! **seal** over every descriptor and layer checksum. Opening ([`TrunkLayout::from_packed`],
//! `open.rs`) refuses (exit 2) another format, another checkpoint, an edited descriptor (the
//! seal), a forged layer checksum (the seal), runs that overlap, are unaligned or lie outside
//! `trunk.bin`, and tensors that are missing, extra, of another dtype or length, stored in a way
//! their dtype or the trunk's codec does not allow, off a 64-byte offset, outside their run or
//! over each other. Run bytes are checked against their bound checksum with
//! [`TrunkLayout::verify_run`]: pinned layers always when loaded, streamed layers on their
//! first read in a process, and again after the file changed (`K3_TRUNK_VERIFY=first`, the
//! default), or on every read (`every`); see `crate::runtime::ring`. `k3-ctl verify --trunk`
//! re-derives every stored tensor from the checkpoint.
//!
//! **Sampled checkpoint id** ([`checkpoint_id`]): XXH3-128 over, for every shard in file-name
//! order, its file name, its length, its safetensors JSON header and [`ID_SAMPLES`] blocks of up
//! to 4 KiB sampled at evenly spaced positions of its data region: the model identity of a
//! checkpoint without a manifest rests on it (and draft trunks record it).
//!
//! **Writing** ([`pack_trunk`], `pack.rs`): `trunk.bin` and `trunk.json` are written under
//! temporary names in the output directory and renamed into place, so a trunk is never rewritten
//! in place (a process that has the old `trunk.bin` open keeps reading the old bytes, its inode);
//! an error, SIGINT or SIGTERM removes the temporaries, and the next run removes those a killed
//! packer left.

mod format;
mod layout;
mod open;
mod pack;

pub use crate::runtime::identity::{checkpoint_id, model_dir_of, ID_SAMPLES};
pub(crate) use format::parse_hash;
pub use format::{
    bound_checksum, bound_checksum_of, layer_digest, run_checksum, seal, seal_json, trunk_id,
    EncodeError, JsonLayer, JsonModel, JsonTensor, Refusal, StoredProblem, TensorHashes,
    TrunkCodec, TrunkError, TrunkJson, MAX_JSON_BYTES, TENSOR_ALIGN, TRUNK_BIN, TRUNK_FORMAT,
    TRUNK_JSON,
};
pub use layout::{open_shards, LayerPlan, RunCheck, TrunkLayout};
pub use pack::{
    codable, contiguous_run, pack_trunk, remove_stale_temporaries, temp_name, Interrupt,
    PackOptions, PackProgress, PackSummary, AUTO_WIDTHS, DEFAULT_MAX_ESCAPE, DEFAULT_WIDTH,
};
pub(crate) use pack::{write_packed, write_sparse};

#[cfg(test)]
mod tests;
