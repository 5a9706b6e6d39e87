//! One block of memory carved into variable-size extents, and where the next extent goes.
//!
//! The trunk ring ([`crate::runtime::stream`]) keeps every streamed layer it holds in one arena instead of
//! fixed slots of the largest layer's size: a 3 GB arena holds layer 0 (2.34 GB) alone but two
//! KDA layers (1.27 GB each) at once, so the next layer is read while the current one is
//! computed. [`ArenaMem`] is the memory (the only `unsafe` of the ring); [`place`] is the
//! allocation rule, a pure function.

use crate::runtime::io::{AlignedBuf, ALIGN};

/// Memory handed out as raw sub-slices: the trunk ring's arena and the routed-expert slots
/// ([`crate::runtime::experts::Arena`]). Who may touch which range when is the owner's state machine (see
/// the safety contracts of [`ArenaMem::range`] and [`ArenaMem::range_mut`]).
pub struct ArenaMem {
    /// Owns the allocation when the arena made it; never borrowed after construction (all access
    /// goes through `base`). `None` over memory someone else owns ([`ArenaMem::over`]).
    _buf: Option<AlignedBuf>,
    base: *mut u8,
    len: usize,
}

// SAFETY: the memory is plain bytes (owned by `_buf`, or by the caller of `over` for as long as
// the arena is used); moving the owner between threads is as safe as moving an `AlignedBuf`. Every access goes through `range`/`range_mut`, whose callers
// guarantee that no range is written while any overlapping range is borrowed.
unsafe impl Send for ArenaMem {}
// SAFETY: see `Send`; shared access only produces the raw-pointer slices whose exclusivity the
// callers of `range`/`range_mut` guarantee.
unsafe impl Sync for ArenaMem {}

impl ArenaMem {
    /// A zeroed arena of `len` bytes (page-aligned start).
    pub fn new(len: usize) -> Result<ArenaMem, String> {
        let mut buf = AlignedBuf::zeroed(len)?;
        let base = buf.as_mut_ptr();
        Ok(ArenaMem {
            _buf: Some(buf),
            base,
            len,
        })
    }

    /// An arena over `mem`, memory the caller owns (the daemon's shared-memory segment).
    ///
    /// # Safety
    /// `mem` must stay mapped and valid for reads and writes for as long as the arena is used,
    /// and must not be accessed in this process other than through the arena.
    pub unsafe fn over(mem: &mut [u8]) -> ArenaMem {
        ArenaMem {
            _buf: None,
            base: mem.as_mut_ptr(),
            len: mem.len(),
        }
    }

    /// Bytes in the arena.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes from `off`, shared.
    ///
    /// # Safety
    /// `off + len <= self.len()`, and for as long as the returned slice lives no slice from
    /// [`ArenaMem::range_mut`] overlapping it exists.
    pub unsafe fn range(&self, off: usize, len: usize) -> &[u8] {
        debug_assert!(off.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds of the allocation (caller's contract), initialised (zeroed at
        // creation, then only written by reads), and not written while borrowed (contract).
        unsafe { std::slice::from_raw_parts(self.base.wrapping_add(off), len) }
    }

    /// `len` bytes from `off`, exclusively.
    ///
    /// # Safety
    /// `off + len <= self.len()`, and for as long as the returned slice lives no other slice
    /// (shared or exclusive) overlapping it exists.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range_mut(&self, off: usize, len: usize) -> &mut [u8] {
        debug_assert!(off.checked_add(len).is_some_and(|e| e <= self.len));
        // SAFETY: in bounds (contract) and exclusive for the slice's lifetime (contract).
        unsafe { std::slice::from_raw_parts_mut(self.base.wrapping_add(off), len) }
    }
}

/// Where to put an extent of `len` bytes in an arena of `cap` bytes without overlapping any of
/// the `blocked` `(start, len)` ranges: the first fitting [`ALIGN`]-aligned position at or after
/// `cursor`, wrapping around (the ring fills in consumption order, so the space after the last
/// extent is the one released earliest). Candidates are `cursor`, 0 and the end of each blocked
/// range. `None` when nothing fits.
pub fn place(cap: u64, len: u64, cursor: u64, blocked: &[(u64, u64)]) -> Option<u64> {
    let a = ALIGN as u64;
    let up = |x: u64| x.div_ceil(a) * a;
    let mut cands: Vec<u64> = vec![up(cursor), 0];
    cands.extend(blocked.iter().map(|&(s, l)| up(s + l)));
    cands.retain(|&c| {
        c.checked_add(len).is_some_and(|e| e <= cap)
            && blocked.iter().all(|&(s, l)| c + len <= s || s + l <= c)
    });
    // Circular order from the cursor.
    cands.into_iter().min_by_key(|&c| (c < cursor, c))
}

/// Like [`place`], but `soft` ranges may be overlapped (memory in use now that will be released
/// soon): the position overlapping them least, then the first from `cursor`. Returns the position
/// and how many bytes of it overlap `soft`; `None` when nothing avoids `blocked`.
pub fn place_min_overlap(
    cap: u64,
    len: u64,
    cursor: u64,
    blocked: &[(u64, u64)],
    soft: &[(u64, u64)],
) -> Option<(u64, u64)> {
    let a = ALIGN as u64;
    let up = |x: u64| x.div_ceil(a) * a;
    let down = |x: u64| x / a * a;
    // The overlap is piecewise linear in the position: its minimum is at a breakpoint, where an
    // edge of the extent meets an edge of a range or of the arena.
    let mut cands: Vec<u64> = vec![up(cursor), 0];
    if let Some(last) = cap.checked_sub(len) {
        cands.push(down(last));
    }
    for &(s, l) in blocked.iter().chain(soft) {
        for edge in [s, s + l] {
            cands.push(up(edge));
            if let Some(c) = edge.checked_sub(len) {
                cands.push(down(c));
            }
        }
    }
    let overlap = |c: u64, r: &[(u64, u64)]| -> u64 {
        r.iter()
            .map(|&(s, l)| (c + len).min(s + l).saturating_sub(c.max(s)))
            .sum()
    };
    cands
        .into_iter()
        .filter(|&c| c.checked_add(len).is_some_and(|e| e <= cap) && overlap(c, blocked) == 0)
        .map(|c| (c, overlap(c, soft)))
        .min_by_key(|&(c, o)| (o, c < cursor, c))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = ALIGN as u64;

    #[test]
    fn placement_follows_the_cursor_and_wraps() {
        // Empty arena: at the cursor.
        assert_eq!(place(10 * P, 3 * P, 4 * P, &[]), Some(4 * P));
        // Does not fit before the end: wraps to 0.
        assert_eq!(place(10 * P, 3 * P, 8 * P, &[]), Some(0));
        // The cursor is rounded up to the alignment.
        assert_eq!(place(10 * P, 3 * P, 4 * P + 1, &[]), Some(5 * P));
        // A blocked range at the cursor: the first fit after it.
        assert_eq!(place(10 * P, 3 * P, 0, &[(0, 4 * P)]), Some(4 * P));
        // Between two blocked ranges when the gap is big enough, not when it is not.
        assert_eq!(
            place(10 * P, 2 * P, 0, &[(0, 2 * P), (4 * P, 6 * P)]),
            Some(2 * P)
        );
        assert_eq!(place(10 * P, 3 * P, 0, &[(0, 2 * P), (4 * P, 6 * P)]), None);
        // Larger than the arena.
        assert_eq!(place(10 * P, 11 * P, 0, &[]), None);
        // Exactly the arena.
        assert_eq!(place(10 * P, 10 * P, 3 * P, &[]), Some(0));
        // Unaligned blocked end.
        assert_eq!(place(10 * P, 2 * P, 0, &[(0, 2 * P + 5)]), Some(3 * P));
    }

    #[test]
    fn a_placement_never_overlaps_a_blocked_range() {
        // Exhaustive over small layouts.
        for cap in 1..=8u64 {
            for len in 1..=cap {
                for cursor in 0..cap {
                    for bs in 0..cap {
                        for bl in 1..=(cap - bs) {
                            let blocked = [(bs * P, bl * P)];
                            if let Some(c) = place(cap * P, len * P, cursor * P, &blocked) {
                                assert!(c % P == 0 && c + len * P <= cap * P);
                                assert!(c + len * P <= bs * P || (bs + bl) * P <= c);
                            } else {
                                // Nothing fits: neither side of the blocked range is long enough.
                                assert!(bs < len && cap - (bs + bl) < len);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_least_overlapping_position_is_found() {
        // Brute force over every aligned position of small arenas with one blocked and two soft
        // ranges.
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for _ in 0..3000 {
            let cap = 1 + next(12);
            let len = 1 + next(cap);
            let cursor = next(cap);
            let nb = next(2);
            let ns = next(3);
            let mut r = || {
                let s = next(cap);
                (s * P, (1 + next(cap - s)) * P)
            };
            let blocked: Vec<_> = (0..nb).map(|_| r()).collect();
            let soft: Vec<_> = (0..ns).map(|_| r()).collect();
            let ov = |c: u64, rs: &[(u64, u64)]| -> u64 {
                rs.iter()
                    .map(|&(s, l)| (c + len * P).min(s + l).saturating_sub(c.max(s)))
                    .sum()
            };
            let best = (0..=cap - len)
                .map(|c| c * P)
                .filter(|&c| ov(c, &blocked) == 0)
                .map(|c| ov(c, &soft))
                .min();
            let got = place_min_overlap(cap * P, len * P, cursor * P, &blocked, &soft);
            match (got, best) {
                (None, None) => {}
                (Some((c, o)), Some(b)) => {
                    assert_eq!(o, b, "cap {cap} len {len} {blocked:?} {soft:?}");
                    assert_eq!(o, ov(c, &soft));
                    assert_eq!(ov(c, &blocked), 0);
                    assert!(c % P == 0 && c + len * P <= cap * P);
                }
                (g, b) => panic!("got {g:?}, brute force {b:?}: cap {cap} len {len} {blocked:?}"),
            }
        }
        // No soft ranges: the same position as `place`.
        assert_eq!(
            place_min_overlap(10 * P, 3 * P, 8 * P, &[(0, P)], &[]),
            Some((P, 0))
        );
        assert_eq!(place(10 * P, 3 * P, 8 * P, &[(0, P)]), Some(P));
    }

    #[test]
    fn disjoint_ranges_read_back_what_was_written() {
        let m = ArenaMem::new(4 * ALIGN).unwrap();
        assert_eq!(m.len(), 4 * ALIGN);
        // SAFETY: in bounds; no other slice exists.
        let a = unsafe { m.range_mut(0, ALIGN) };
        // SAFETY: in bounds and disjoint from `a`.
        let b = unsafe { m.range_mut(ALIGN, 2 * ALIGN) };
        a.fill(1);
        b.fill(2);
        // SAFETY: the exclusive slices above are no longer used.
        let all = unsafe { m.range(0, 4 * ALIGN) };
        assert!(all[..ALIGN].iter().all(|&x| x == 1));
        assert!(all[ALIGN..3 * ALIGN].iter().all(|&x| x == 2));
        assert!(all[3 * ALIGN..].iter().all(|&x| x == 0));
    }
}
