//! Wire frames client → store (proto/src/wire.rs): a body decodes to a [`Request`] or an error; a
//! stream of length-prefixed frames is read frame by frame until an error (never a panic, never
//! an allocation past `MAX_FRAME`); whatever decodes re-encodes into a frame that decodes again.
#![no_main]

use std::io::Cursor;

use k3_proto::wire::{
    decode, encode, read_frame, read_frame_bytes, Request, WireError, MAX_FRAME, MAX_REQUEST_FRAME,
};
use libfuzzer_sys::fuzz_target;

fn round_trip(msg: &Request) {
    let frame = encode(msg).expect("a decoded message encodes");
    let back: Request = read_frame(&mut Cursor::new(&frame)).expect("an encoded frame decodes");
    assert_eq!(encode(&back).expect("encodes again"), frame);
}

fuzz_target!(|data: &[u8]| {
    // The input as one frame body (a body longer than a frame is never read off the socket).
    if data.len() > MAX_FRAME as usize {
        return;
    }
    if let Ok(msg) = decode::<Request>(data) {
        round_trip(&msg);
    }
    // The input as a byte stream of frames.
    let mut r = Cursor::new(data);
    loop {
        match read_frame_bytes(&mut r, MAX_REQUEST_FRAME) {
            Ok(body) => {
                assert!(body.len() <= MAX_REQUEST_FRAME as usize);
                if let Ok(msg) = decode::<Request>(&body) {
                    round_trip(&msg);
                }
            }
            Err(WireError::Closed)
            | Err(WireError::Malformed(_))
            | Err(WireError::TooLong { .. }) => break,
            Err(e) => panic!("reading from memory cannot fail with {e}"),
        }
    }
});
