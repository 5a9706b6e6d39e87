//! One block of memory carved into variable-size extents, and where the next extent goes.
//!
//! The trunk ring ([`crate::runtime::ring`]) keeps every streamed layer it holds in one arena
//! instead of fixed slots of the largest layer's size: a 3 GB arena holds layer 0 (2.34 GB) alone
//! but two KDA layers (1.27 GB each) at once, so the next layer is read while the current one is
//! computed. [`ArenaMem`] is the memory and checks every borrow of it (the only `unsafe` of the
//! ring and of the expert slots); [`place`] is the allocation rule, a pure function.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::runtime::io::{AlignedBuf, ALIGN};

/// Memory handed out as sub-slices through guards: the trunk ring's arena and the routed-expert
/// slots ([`crate::runtime::experts::Arena`]).
///
/// Who may touch which range when is the owner's state machine (the ring's extents and leases,
/// the slot table); the arena CHECKS it: [`ArenaMem::write`] gives a range only while no other
/// guard overlaps it, [`ArenaMem::read`] only while no write guard does, so a mistake of the
/// state machine is an error ([`ArenaError`]), never two aliasing slices. The check is a short
/// lock over the live guards, taken once per guard (a ring read, a slot read, a lease), not
/// per access.
pub struct ArenaMem {
    /// Owns the allocation when the arena made it; never borrowed after construction (all access
    /// goes through `base`). `None` over memory someone else owns ([`ArenaMem::over`]).
    buf: Option<AlignedBuf>,
    base: *mut u8,
    len: usize,
    live: Mutex<Live>,
}

/// The guards alive now.
#[derive(Default)]
struct Live {
    guards: Vec<Borrow>,
    next: u64,
}

#[derive(Clone, Copy)]
struct Borrow {
    id: u64,
    off: usize,
    len: usize,
    write: bool,
}

impl Borrow {
    fn overlaps(&self, off: usize, len: usize) -> bool {
        off < self.off + self.len && self.off < off + len
    }
}

/// A range of the arena refused to a guard.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    /// Past the end of the arena.
    #[error("arena range {off}+{len} is outside the {cap}-byte arena")]
    Outside {
        /// Start of the range asked for.
        off: usize,
        /// Its length.
        len: usize,
        /// Bytes in the arena.
        cap: usize,
    },
    /// Overlaps a guard that excludes it (a write and anything, or a read and a write).
    #[error("arena range {off}+{len} ({}) overlaps bytes in use ({}): the owner's bookkeeping is wrong",
        if *.write { "to write" } else { "to read" },
        if *.other_write { "being written" } else { "being read" })]
    InUse {
        /// Start of the range asked for.
        off: usize,
        /// Its length.
        len: usize,
        /// Asked for writing.
        write: bool,
        /// The guard in the way writes.
        other_write: bool,
    },
}

// SAFETY: the memory is plain bytes (owned by `buf`, or by the caller of `over` for as long as
// the arena is used); moving the owner between threads is as safe as moving an `AlignedBuf`.
// Every access goes through a guard checked against the live guards under `live`'s lock.
unsafe impl Send for ArenaMem {}
// SAFETY: see `Send`; shared access only produces guards, and the lock in `borrow` keeps a
// writing guard's range apart from every other guard's.
unsafe impl Sync for ArenaMem {}

impl ArenaMem {
    /// A zeroed arena of `len` bytes (page-aligned start).
    pub fn new(len: usize) -> Result<ArenaMem, crate::runtime::io::AllocError> {
        let mut buf = AlignedBuf::zeroed(len)?;
        let base = buf.as_mut_ptr();
        Ok(ArenaMem {
            buf: Some(buf),
            base,
            len,
            live: Mutex::default(),
        })
    }

    /// An arena over `mem`, memory the caller owns (the daemon's shared-memory segment).
    ///
    /// # Safety
    /// `mem` must stay mapped and valid for reads and writes for as long as the arena is used,
    /// and must not be accessed in this process other than through the arena.
    pub unsafe fn over(mem: &mut [u8]) -> ArenaMem {
        ArenaMem {
            buf: None,
            base: mem.as_mut_ptr(),
            len: mem.len(),
            live: Mutex::default(),
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

    /// True when the arena made its memory ([`ArenaMem::new`]): a thread writing into it may
    /// outlive its other users as long as it holds the arena.
    pub fn owns_memory(&self) -> bool {
        self.buf.is_some()
    }

    fn live(&self) -> MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a guard of `[off, off + len)`, or say why not.
    fn borrow(&self, off: usize, len: usize, write: bool) -> Result<u64, ArenaError> {
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(ArenaError::Outside {
                off,
                len,
                cap: self.len,
            });
        }
        let mut g = self.live();
        if let Some(b) = (g.guards.iter()).find(|b| (write || b.write) && b.overlaps(off, len)) {
            return Err(ArenaError::InUse {
                off,
                len,
                write,
                other_write: b.write,
            });
        }
        g.next += 1;
        let id = g.next;
        g.guards.push(Borrow {
            id,
            off,
            len,
            write,
        });
        Ok(id)
    }

    fn unborrow(&self, id: u64) {
        let mut g = self.live();
        if let Some(i) = g.guards.iter().position(|b| b.id == id) {
            g.guards.swap_remove(i);
        }
    }

    /// `len` bytes from `off`, to read, for as long as the guard lives; refused while a write
    /// guard overlaps them.
    pub fn read(self: &Arc<Self>, off: usize, len: usize) -> Result<ArenaRead, ArenaError> {
        let id = self.borrow(off, len, false)?;
        Ok(ArenaRead {
            mem: self.clone(),
            id,
            off,
            len,
        })
    }

    /// `len` bytes from `off`, to write, for as long as the guard lives; refused while any other
    /// guard overlaps them.
    pub fn write(&self, off: usize, len: usize) -> Result<ArenaWrite<'_>, ArenaError> {
        let id = self.borrow(off, len, true)?;
        Ok(ArenaWrite {
            mem: self,
            id,
            off,
            len,
        })
    }
}

/// Bytes of an [`ArenaMem`] being read: no write guard overlaps them while this lives.
pub struct ArenaRead {
    mem: Arc<ArenaMem>,
    id: u64,
    off: usize,
    len: usize,
}

impl std::ops::Deref for ArenaRead {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `off + len <= mem.len()` (checked in `borrow`), the memory is valid while the
        // arena lives (this guard holds it) and initialised (zeroed at creation, then only
        // written through write guards); no write guard overlapping it can exist while this
        // guard is registered (`borrow`), and the borrow cannot outlive the guard.
        unsafe { std::slice::from_raw_parts(self.mem.base.wrapping_add(self.off), self.len) }
    }
}

impl Drop for ArenaRead {
    fn drop(&mut self) {
        self.mem.unborrow(self.id);
    }
}

/// Bytes of an [`ArenaMem`] being written: no other guard overlaps them while this lives.
pub struct ArenaWrite<'a> {
    mem: &'a ArenaMem,
    id: u64,
    off: usize,
    len: usize,
}

impl std::ops::Deref for ArenaWrite<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: as in `deref_mut`; `&self` gives no `&mut` at the same time.
        unsafe { std::slice::from_raw_parts(self.mem.base.wrapping_add(self.off), self.len) }
    }
}

impl std::ops::DerefMut for ArenaWrite<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `off + len <= mem.len()` (checked in `borrow`), valid for as long as the
        // arena (which this guard borrows) lives; no other guard overlaps the range while this
        // one is registered (`borrow`), and `&mut self` makes this the only slice of it.
        unsafe { std::slice::from_raw_parts_mut(self.mem.base.wrapping_add(self.off), self.len) }
    }
}

impl Drop for ArenaWrite<'_> {
    fn drop(&mut self) {
        self.mem.unborrow(self.id);
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
        let m = Arc::new(ArenaMem::new(4 * ALIGN).unwrap());
        assert_eq!(m.len(), 4 * ALIGN);
        assert!(m.owns_memory());
        {
            let mut a = m.write(0, ALIGN).unwrap();
            let mut b = m.write(ALIGN, 2 * ALIGN).unwrap();
            a.fill(1);
            b.fill(2);
        }
        let all = m.read(0, 4 * ALIGN).unwrap();
        assert!(all[..ALIGN].iter().all(|&x| x == 1));
        assert!(all[ALIGN..3 * ALIGN].iter().all(|&x| x == 2));
        assert!(all[3 * ALIGN..].iter().all(|&x| x == 0));
    }

    /// What a wrong state machine would do is refused: a write over bytes being read or
    /// written, a read of bytes being written, a range past the end. Reads share; a dropped
    /// guard frees its range.
    #[test]
    fn overlapping_guards_are_refused() {
        let m = Arc::new(ArenaMem::new(4 * ALIGN).unwrap());
        let r = m.read(ALIGN, ALIGN).unwrap();
        let r2 = m.read(ALIGN + 8, 8).unwrap();
        assert_eq!(r2.len(), 8);
        let e = m.write(ALIGN + ALIGN / 2, ALIGN).err().unwrap();
        assert!(
            matches!(
                e,
                ArenaError::InUse {
                    write: true,
                    other_write: false,
                    ..
                }
            ),
            "{e}"
        );
        let w = m.write(2 * ALIGN, ALIGN).unwrap();
        assert!(m.read(2 * ALIGN + 1, 1).is_err());
        assert!(m.write(3 * ALIGN - 1, 2).is_err());
        // Touching ends do not overlap.
        assert!(m.write(0, ALIGN).is_ok());
        assert!(m.write(3 * ALIGN, ALIGN).is_ok());
        assert!(matches!(
            m.write(3 * ALIGN, ALIGN + 1),
            Err(ArenaError::Outside { .. })
        ));
        assert!(m.read(usize::MAX, 2).is_err());
        drop((r, r2, w));
        assert!(m.write(0, 4 * ALIGN).is_ok());
        // Over borrowed memory: the same checks, and the memory outside is not touched.
        let mut mem = vec![7u8; 3 * ALIGN];
        // SAFETY: `mem` outlives `over` (dropped below) and is not touched while it is used.
        let over = Arc::new(unsafe { ArenaMem::over(&mut mem[ALIGN..2 * ALIGN]) });
        assert!(!over.owns_memory());
        over.write(0, ALIGN).unwrap().fill(9);
        let g = over.read(0, 1).unwrap();
        assert!(over.write(0, 1).is_err());
        drop(g);
        drop(over);
        assert!(mem[..ALIGN]
            .iter()
            .chain(&mem[2 * ALIGN..])
            .all(|&b| b == 7));
        assert!(mem[ALIGN..2 * ALIGN].iter().all(|&b| b == 9));
    }
}
