//! Kept conversations, the worker's side (docs/SPEC.md §6.6): a sequence state, the ids it holds
//! and the chat history, packed as a session ([`k3_store::session`]) and handed to the store, or
//! fetched from it and restored.
//!
//! What is restored is checked three times: the container (checksum, by the store and again
//! here), the model identity (the store's checkpoint), and the state's layout against this run's
//! dims ([`crate::model::snapshot`]). A session that fails any check is not used: the run starts
//! afresh and says why on stderr.

use k3_store::attach::AttachedSource;
use k3_store::session::{self as container, Blob, SessionWriter};

use crate::engine::request::{reusable, Held};
use crate::model::snapshot;
use crate::model::{Dims, SeqState};
use crate::text::xtml::Message;

/// Why a session was not packed, fetched or restored (never fatal: the run starts afresh, or
/// ends without keeping it, and says why).
#[derive(Debug, thiserror::Error)]
pub enum KeptError {
    /// The state and the ids disagree (a bug of the caller).
    #[error("the state is at position {pos} but holds {held} ids")]
    Position {
        /// The state's position.
        pos: usize,
        /// Ids held.
        held: usize,
    },
    /// The history does not serialise.
    #[error("{0}")]
    Meta(#[source] serde_json::Error),
    /// Writing the session's memfd failed.
    #[error("cannot pack the session: {0}")]
    Pack(#[source] std::io::Error),
    /// The container is not a session of this model.
    #[error(transparent)]
    Container(#[from] container::SessionError),
    /// An id the vocabulary does not have.
    #[error("id {id} outside the vocabulary of {vocab}")]
    Vocab {
        /// The id.
        id: u32,
        /// Size of the vocabulary.
        vocab: usize,
    },
    /// The state does not fit this model.
    #[error(transparent)]
    State(#[from] snapshot::StateError),
    /// The history does not parse.
    #[error("the session's history: {0}")]
    History(#[source] serde_json::Error),
    /// The store could not be asked, or refused.
    #[error(transparent)]
    Store(#[from] k3_store::attach::SessionCallError),
}

/// What a session carries besides the state: the chat history (empty for a one-shot run).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    /// The conversation's messages, assistant replies with the model's own ids.
    #[serde(default)]
    pub history: Vec<Message>,
}

/// A session restored for this run.
#[derive(Debug)]
pub struct Restored {
    /// The ids the state holds.
    pub held: Vec<u32>,
    /// The state, with room for this run's capacity.
    pub state: SeqState,
    /// The history.
    pub meta: Meta,
    /// Bytes of the session.
    pub bytes: u64,
}

/// Pack `state` (holding `held`) and `meta` as a session for the checkpoint of `identity`.
pub fn encode(
    identity: u128,
    held: &[u32],
    state: &SeqState,
    meta: &Meta,
) -> Result<Blob, KeptError> {
    if state.pos != held.len() {
        return Err(KeptError::Position {
            pos: state.pos,
            held: held.len(),
        });
    }
    let meta = serde_json::to_vec(meta).map_err(KeptError::Meta)?;
    Blob::create("k3-session", |w| {
        let mut s = SessionWriter::begin(w, identity, held, &meta, snapshot::state_bytes(state))?;
        snapshot::write_state(state, &mut s)?;
        s.finish()?;
        Ok(())
    })
    .map_err(KeptError::Pack)
}

/// Check and restore a session's bytes for this model (`identity`, `dims`) with room for
/// `capacity` positions.
pub fn decode(
    bytes: &[u8],
    identity: u128,
    dims: &Dims,
    capacity: usize,
) -> Result<Restored, KeptError> {
    let view = container::parse(bytes)?;
    container::check_identity(&view, identity)?;
    let held = view.ids();
    if let Some(&id) = held.iter().find(|&&id| id as usize >= dims.vocab) {
        return Err(KeptError::Vocab {
            id,
            vocab: dims.vocab,
        });
    }
    let state = snapshot::read_state(dims, view.state, held.len(), capacity)?;
    let meta: Meta = if view.meta.is_empty() {
        Meta::default()
    } else {
        serde_json::from_slice(view.meta).map_err(KeptError::History)?
    };
    Ok(Restored {
        held,
        state,
        meta,
        bytes: bytes.len() as u64,
    })
}

/// Fetch session `name` from the store and restore it (`Ok(None)`: the store has none).
pub fn fetch(
    src: &AttachedSource,
    name: &str,
    dims: &Dims,
    capacity: usize,
) -> Result<Option<Restored>, KeptError> {
    let Some(blob) = src.get_session(name)? else {
        return Ok(None);
    };
    decode(blob.bytes(), src.model_identity(), dims, capacity).map(Some)
}

impl Restored {
    /// The restored state as a request's starting point.
    pub fn into_held(self) -> Held {
        Held {
            state: self.state,
            ids: self.held,
        }
    }
}

/// What [`fetch_for_prompt`] found.
#[derive(Debug)]
pub enum ForPrompt {
    /// The store has no session of that name.
    Missing,
    /// The session's ids (this many) are not a strict prefix of the prompt.
    NotPrefix(usize),
    /// Restored; it holds the prompt's first `held.len()` ids.
    Restored(Box<Restored>),
}

/// Fetch session `name` for `prompt`: restored only when the ids it holds are a strict prefix
/// of the prompt (checked before the state is decoded).
pub fn fetch_for_prompt(
    src: &AttachedSource,
    name: &str,
    dims: &Dims,
    capacity: usize,
    prompt: &[u32],
) -> Result<ForPrompt, KeptError> {
    let Some(blob) = src.get_session(name)? else {
        return Ok(ForPrompt::Missing);
    };
    let view = container::parse(blob.bytes())?;
    let held = view.ids();
    if reusable(&held, prompt).is_none() {
        return Ok(ForPrompt::NotPrefix(held.len()));
    }
    decode(blob.bytes(), src.model_identity(), dims, capacity)
        .map(|r| ForPrompt::Restored(Box::new(r)))
}

/// What [`keep`] did.
#[derive(Clone, Debug)]
pub struct Kept {
    /// Bytes handed over.
    pub bytes: u64,
    /// Sessions the store evicted to make room.
    pub evicted: Vec<String>,
    /// Seconds to pack and hand over.
    pub seconds: f64,
}

impl Kept {
    /// The line that says session `name` was kept holding `positions`.
    pub fn line(&self, name: &str, positions: usize) -> String {
        let evicted = if self.evicted.is_empty() {
            String::new()
        } else {
            format!("; the store evicted {}", self.evicted.join(", "))
        };
        format!(
            "session {name}: kept {positions} positions ({:.3} MB) in {:.3} s{evicted}",
            self.bytes as f64 / 1e6,
            self.seconds
        )
    }
}

/// Hand the state (holding `held`) and `meta` to the store as session `name`.
pub fn keep(
    src: &AttachedSource,
    name: &str,
    held: &[u32],
    state: &SeqState,
    meta: &Meta,
) -> Result<Kept, KeptError> {
    let t0 = std::time::Instant::now();
    let blob = encode(src.model_identity(), held, state, meta)?;
    let evicted = src.put_session(name, &blob)?;
    Ok(Kept {
        bytes: blob.len(),
        evicted,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::xtml::{Message, ReplyIds};

    fn dims() -> Dims {
        let cfg = k3_proto::config::ModelConfig::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures/tiny/model/config.json"),
        )
        .unwrap();
        Dims::from_config(&cfg).unwrap()
    }

    #[test]
    fn a_session_round_trips_with_its_history_and_is_checked() {
        let d = dims();
        let mut st = SeqState::new(&d, 3);
        st.pos = 3;
        for l in &mut st.layers {
            if let crate::model::state::LayerState::Mla(m) = l {
                m.rows = (0..3 * m.width).map(|i| i as f32 * 0.5).collect();
            }
        }
        let mut reply = Message::assistant("hi", Some("hm".into()));
        reply.ids = Some(ReplyIds {
            think: vec![7],
            response: vec![8, 9],
        });
        let meta = Meta {
            history: vec![Message::user("a \"q\""), reply],
        };
        let blob = encode(42, &[1, 2, 3], &st, &meta).unwrap();
        let r = decode(blob.bytes(), 42, &d, 10).unwrap();
        assert_eq!(r.held, [1, 2, 3]);
        assert_eq!(r.state.layers, st.layers);
        assert_eq!((r.state.pos, r.state.capacity), (3, 10));
        assert_eq!(r.meta, meta);
        let e = decode(blob.bytes(), 43, &d, 10).unwrap_err().to_string();
        assert!(e.contains("model identity"), "{e}");
        let mut bad = blob.bytes().to_vec();
        let n = bad.len();
        bad[n - 20] ^= 4;
        assert!(decode(&bad, 42, &d, 10)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
        assert!(encode(42, &[1, 2], &st, &meta).is_err(), "ids ≠ position");
    }

    #[test]
    fn only_a_strict_prefix_is_reused() {
        use crate::engine::request::reusable;
        assert_eq!(reusable(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(reusable(&[1, 2], &[1, 2]), None);
        assert_eq!(reusable(&[1, 3], &[1, 2, 3]), None);
        assert_eq!(reusable(&[], &[1]), None);
    }
}
