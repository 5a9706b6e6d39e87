//! The shared-memory header (proto/src/shm.rs `ShmHeader::decode`): any mapping bytes give a
//! header or an error; an accepted header re-encodes to the same bytes and its regions are
//! readable. Each input is decoded as is and with `total_bytes` patched to the input length (so
//! the fuzzer gets past that check and into the region validation).
#![no_main]

use k3_proto::shm::{RegionKind, ShmHeader, HEADER_BYTES};
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8]) {
    if let Ok(h) = ShmHeader::decode(bytes) {
        assert_eq!(
            &h.encode()[..],
            &bytes[..HEADER_BYTES],
            "decode/encode round trip"
        );
        for r in h.regions() {
            let _ = r.offset + r.len; // validate() proved this does not overflow
        }
        let _ = h.find(RegionKind::ExpertArena, 0);
        assert!(h.validate().is_ok());
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 24 {
        let mut v = data.to_vec();
        v[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
        check(&v);
    }
});
