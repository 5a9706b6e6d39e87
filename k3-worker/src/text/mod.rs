//! Text formats around the model: K3's tool grammar in XTML ([`tools`]).

pub mod tools;
