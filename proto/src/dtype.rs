//! Tensor element types found in the checkpoint.

use serde::{Deserialize, Serialize};

/// A safetensors dtype the engine understands. Other dtypes (I64, F64, …) in tensors the engine
/// does not need are skipped by the index; in a needed tensor they are a clear error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    BF16,
    F16,
    F32,
    U8,
    I8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::U8 | Dtype::I8 => 1,
        }
    }

    /// The safetensors spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::BF16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
        }
    }

    /// Parse the safetensors spelling; `None` for dtypes k3 does not read.
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "BF16" => Dtype::BF16,
            "F16" => Dtype::F16,
            "F32" => Dtype::F32,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
