//! Which kept conversation a request continues (docs/SPEC.md §6.6).
//!
//! The store lists its sessions with the XXH3-128 of the ids each holds; a request continues the
//! longest one whose ids are a strict prefix of the request's rendered ids (matched on ids, not
//! text). Its worker gets `--session NAME`: it checks the ids again, prefills only what is new
//! and stores the extended state under the same name. A request that continues none gets a new
//! name, so the next turn of its conversation can continue it: `http-` and 16 hex digits of an
//! HMAC-SHA256 of its ids under a key drawn when serve starts ([`Namer`]). The name appears in
//! logs and `k3-ctl sessions`; keyed, it cannot be used to confirm a guessed prompt (an unkeyed
//! hash could: hash the guess, compare).

use k3_proto::wire::SessionInfo;
use k3_store::session::ids_hash;

/// Names new sessions under this server's secret key.
pub struct Namer {
    key: [u8; 32],
}

impl std::fmt::Debug for Namer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Namer { key: <secret> }")
    }
}

impl Namer {
    /// A namer with a fresh random key.
    pub fn new() -> Result<Namer, getrandom::Error> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key)?;
        Ok(Namer { key })
    }

    /// The key (sent to the worker, which names the prefix sessions it keeps under it).
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// A new session's name for `prompt`: `http-` and 16 hex digits of its ids' MAC.
    pub fn name(&self, prompt: &[u32]) -> String {
        format!(
            "http-{:016x}",
            k3_store::session::ids_mac(&self.key, prompt)
        )
    }
}

/// The session a request with these `prompt` ids runs under, and the ids it already holds
/// (0 for a new one, named by `namer`).
pub fn choose(list: &[SessionInfo], prompt: &[u32], namer: &Namer) -> (String, usize) {
    let best = list
        .iter()
        .filter(|s| s.ids > 0 && (s.ids as usize) < prompt.len())
        .filter(|s| s.ids_hash == ids_hash(&prompt[..s.ids as usize]))
        .max_by_key(|s| s.ids);
    match best {
        Some(s) => (s.name.clone(), s.ids as usize),
        None => (namer.name(prompt), 0),
    }
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
        let namer = Namer::new().unwrap();
        let list = [
            info("short", &[1, 2]),
            info("long", &[1, 2, 3]),
            info("other", &[1, 9, 3, 4]),
            info("whole", &[1, 2, 3, 4]),
        ];
        assert_eq!(choose(&list, &[1, 2, 3, 4], &namer), ("long".into(), 3));
        assert_eq!(choose(&list, &[1, 2, 7], &namer), ("short".into(), 2));
        let (name, held) = choose(&list, &[5, 6], &namer);
        assert_eq!((name.as_str(), held), (namer.name(&[5, 6]).as_str(), 0));
        assert!(name.starts_with("http-") && name.len() == 21);
        k3_store::session::check_name(&name).unwrap();
        assert_ne!(namer.name(&[5, 6]), namer.name(&[5, 7]));
    }

    #[test]
    fn names_are_keyed_so_they_confirm_no_prompt() {
        let (a, b) = (Namer::new().unwrap(), Namer::new().unwrap());
        let prompt = [163_584, 9_906, 1_111];
        // The same prompt, the same name under one key (the next turn finds it by its ids'
        // hash in the store's list anyway); another key gives another name.
        assert_eq!(a.name(&prompt), a.name(&prompt));
        assert_ne!(a.name(&prompt), b.name(&prompt));
        // Not the unkeyed hash of the ids a guesser could compute.
        let unkeyed = format!("http-{:016x}", ids_hash(&prompt) as u64);
        assert_ne!(a.name(&prompt), unkeyed);
    }
}
