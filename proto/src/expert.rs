//! The canonical byte layout of one routed expert in a cache slot.
//!
//! A slot holds the six MXFP4 tensors of one expert back to back in checkpoint (lexicographic)
//! order: `w1.weight_packed, w1.weight_scale, w2.weight_packed, w2.weight_scale,
//! w3.weight_packed, w3.weight_scale`. w1 (gate) and w3 (up) are `[inter, latent]`, w2 (down) is
//! `[latent, inter]`; packed is `[out, in/2]`, scale `[out, in/32]`. At full scale one expert is
//! 17,547,264 bytes.

use serde::{Deserialize, Serialize};

/// The six tensors of a routed expert, in slot order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExpertPart {
    W1Packed,
    W1Scale,
    W2Packed,
    W2Scale,
    W3Packed,
    W3Scale,
}

impl ExpertPart {
    /// All parts in slot order.
    pub const ALL: [ExpertPart; 6] = [
        ExpertPart::W1Packed,
        ExpertPart::W1Scale,
        ExpertPart::W2Packed,
        ExpertPart::W2Scale,
        ExpertPart::W3Packed,
        ExpertPart::W3Scale,
    ];

    /// Name suffix after `experts.{e}.`.
    pub const fn suffix(self) -> &'static str {
        match self {
            ExpertPart::W1Packed => "w1.weight_packed",
            ExpertPart::W1Scale => "w1.weight_scale",
            ExpertPart::W2Packed => "w2.weight_packed",
            ExpertPart::W2Scale => "w2.weight_scale",
            ExpertPart::W3Packed => "w3.weight_packed",
            ExpertPart::W3Scale => "w3.weight_scale",
        }
    }

    /// Position in [`ExpertPart::ALL`].
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Offsets and logical shapes of the six parts for given dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertLayout {
    /// Expert intermediate width (`moe_intermediate_size`, 3072 at full scale).
    pub inter: usize,
    /// Latent width (`routed_expert_hidden_size`, 3584 at full scale).
    pub latent: usize,
}

impl ExpertLayout {
    /// Shape `[rows, cols]` of the stored U8 tensor of `part`.
    pub const fn stored_shape(&self, part: ExpertPart) -> [usize; 2] {
        let (out, inp) = match part {
            ExpertPart::W2Packed | ExpertPart::W2Scale => (self.latent, self.inter),
            _ => (self.inter, self.latent),
        };
        match part {
            ExpertPart::W1Packed | ExpertPart::W2Packed | ExpertPart::W3Packed => [out, inp / 2],
            _ => [out, inp / 32],
        }
    }

    /// Bytes of `part`.
    pub const fn part_bytes(&self, part: ExpertPart) -> usize {
        let s = self.stored_shape(part);
        s[0] * s[1]
    }

    /// Byte offset of `part` inside a slot.
    pub fn part_offset(&self, part: ExpertPart) -> usize {
        ExpertPart::ALL[..part.index()]
            .iter()
            .map(|&p| self.part_bytes(p))
            .sum()
    }

    /// Bytes of one whole expert.
    pub fn expert_bytes(&self) -> usize {
        ExpertPart::ALL.iter().map(|&p| self.part_bytes(p)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_scale_expert_matches_published_figures() {
        let l = ExpertLayout {
            inter: 3072,
            latent: 3584,
        };
        assert_eq!(l.expert_bytes(), 17_547_264);
        // Offsets of a real expert's six tensors (third-party bundle manifest of the release).
        let offs: Vec<usize> = ExpertPart::ALL.iter().map(|&p| l.part_offset(p)).collect();
        assert_eq!(
            offs,
            [0, 5_505_024, 5_849_088, 11_354_112, 11_698_176, 17_203_200]
        );
        assert_eq!(l.stored_shape(ExpertPart::W2Scale), [3584, 96]);
    }
}
