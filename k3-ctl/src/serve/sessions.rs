//! Which kept conversation a request continues (docs/SPEC.md §6.6).
//!
//! The store lists its sessions with the XXH3-128 of the ids each holds; a request continues the
//! longest one whose ids are a strict prefix of the request's rendered ids (matched on ids, not
//! text). Its worker gets `--session NAME`: it checks the ids again, prefills only what is new
//! and stores the extended state under the same name. A request that continues none gets a new
//! name (from the hash of its ids), so the next turn of its conversation can continue it.

use k3_proto::wire::SessionInfo;
use k3_store::session::ids_hash;

/// The session a request with these `prompt` ids runs under, and the ids it already holds
/// (0 for a new one).
pub fn choose(list: &[SessionInfo], prompt: &[u32]) -> (String, usize) {
    let best = list
        .iter()
        .filter(|s| s.ids > 0 && (s.ids as usize) < prompt.len())
        .filter(|s| s.ids_hash == ids_hash(&prompt[..s.ids as usize]))
        .max_by_key(|s| s.ids);
    match best {
        Some(s) => (s.name.clone(), s.ids as usize),
        None => (new_name(prompt), 0),
    }
}

/// A new session's name: `http-` and 16 hex digits of the prompt's ids hash.
pub fn new_name(prompt: &[u32]) -> String {
    format!("http-{:016x}", ids_hash(prompt) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, ids: &[u32]) -> SessionInfo {
        SessionInfo {
            name: name.into(),
            ids: ids.len() as u64,
            ids_hash: ids_hash(ids),
            bytes: 1,
            idle_seconds: 0.0,
        }
    }

    #[test]
    fn the_longest_strict_prefix_wins() {
        let list = [
            info("short", &[1, 2]),
            info("long", &[1, 2, 3]),
            info("other", &[1, 9, 3, 4]),
            info("whole", &[1, 2, 3, 4]),
        ];
        assert_eq!(choose(&list, &[1, 2, 3, 4]), ("long".into(), 3));
        assert_eq!(choose(&list, &[1, 2, 7]), ("short".into(), 2));
        let (name, held) = choose(&list, &[5, 6]);
        assert_eq!((name.as_str(), held), (new_name(&[5, 6]).as_str(), 0));
        assert!(name.starts_with("http-") && name.len() == 21);
        k3_store::session::check_name(&name).unwrap();
        assert_ne!(new_name(&[5, 6]), new_name(&[5, 7]));
    }
}
