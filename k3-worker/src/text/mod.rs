//! Text formats around the ids: Kimi K3's XTML chat format ([`xtml`]) and its tool grammar
//! ([`tools`]), and which ids are shown as text at all ([`visible`]).

pub mod tools;
pub mod visible;
pub mod xtml;
