//! The store's side of the trunk ring: the ring itself is the runtime's
//! ([`crate::runtime::ring`], one implementation for a standalone worker and for the store);
//! here are only its answers on the socket (SPEC.md §6.8): a lease or a ring failure as a
//! [`Response`], and the ring's counters in the wire's [`Counters`].

use k3_proto::wire::{Counters, ErrorCode, Response};

use crate::runtime::ring::{RingCounters, RingError};

/// The answer for a ring failure.
pub fn ring_error(e: RingError) -> Response {
    let code = match e {
        RingError::BadLayer(_) => ErrorCode::BadRequest,
        RingError::Broken(_) => ErrorCode::LeaseBroken,
        RingError::Read(_) | RingError::Stuck(_) | RingError::Setup(_) => ErrorCode::Internal,
        RingError::Stopping => ErrorCode::Stopping,
    };
    Response::Error {
        code,
        message: e.to_string(),
    }
}

/// The answer for a lease given back (`EndPass`, `ReleaseTrunk`): `None` when nothing streams.
pub fn released(r: Option<Result<(), RingError>>) -> Response {
    match r {
        None | Some(Ok(())) => Response::Released,
        Some(Err(e)) => ring_error(e),
    }
}

/// Add ring counters to a job's or the lifetime counters.
pub fn add_ring(c: &mut Counters, r: &RingCounters) {
    c.trunk_bytes_read += r.bytes_read;
    c.trunk_layer_reads += r.layer_reads;
    c.trunk_layers_served += r.served;
    c.trunk_shared_layers += r.shared;
    c.trunk_wait_seconds += r.wait_seconds;
    c.broken_leases += r.broken;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_failures_answer_with_their_codes() {
        let code = |e| match ring_error(e) {
            Response::Error { code, .. } => code,
            other => panic!("{other:?}"),
        };
        assert_eq!(code(RingError::Broken("b".into())), ErrorCode::LeaseBroken);
        assert_eq!(code(RingError::BadLayer("l".into())), ErrorCode::BadRequest);
        assert_eq!(code(RingError::Read("r".into())), ErrorCode::Internal);
        assert_eq!(code(RingError::Stopping), ErrorCode::Stopping);
        assert!(matches!(released(None), Response::Released));
        assert!(matches!(released(Some(Ok(()))), Response::Released));
        let mut c = Counters::default();
        let r = RingCounters {
            bytes_read: 5,
            layer_reads: 1,
            served: 3,
            shared: 2,
            wait_seconds: 0.5,
            broken: 1,
            ..Default::default()
        };
        add_ring(&mut c, &r);
        add_ring(&mut c, &r);
        assert_eq!(
            (
                c.trunk_bytes_read,
                c.trunk_layer_reads,
                c.trunk_layers_served
            ),
            (10, 2, 6)
        );
        assert_eq!((c.trunk_shared_layers, c.broken_leases), (4, 2));
        assert_eq!(c.trunk_wait_seconds, 1.0);
    }
}
