//! Text formats around the ids: Kimi K3's XTML chat format ([`xtml`]).

pub mod xtml;
