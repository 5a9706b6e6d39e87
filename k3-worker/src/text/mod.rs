//! Text formats around the ids: Kimi K3's XTML chat format ([`xtml`]) and its tool grammar
//! ([`tools`]).

pub mod tools;
pub mod xtml;
