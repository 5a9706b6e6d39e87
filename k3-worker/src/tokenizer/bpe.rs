//! Byte-level BPE by rank (tiktoken's `byte_pair_merge`): start from single bytes and repeatedly
//! merge the adjacent pair whose concatenated bytes have the lowest rank, the leftmost such pair
//! on ties, until no adjacent pair has a rank.
//!
//! Two implementations with the same result: a quadratic scan for short pieces (what tiktoken
//! does, fast for the usual few-byte pieces) and a heap ordered by `(rank, start)` for long ones,
//! where the quadratic scan would take seconds. A test compares them.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Pieces at most this long use the quadratic scan.
const SMALL_PIECE: usize = 96;

/// Rank used for "no rank" (no token has it: ranks are < 2^24 by construction).
pub const NONE: u32 = u32::MAX;

/// The Fx hash (rustc's): fast on short byte strings; the keys are the fixed vocabulary.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn write_u128(&mut self, n: u128) {
        self.add(n as u64);
        self.add((n >> 64) as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// Hash map keyed by token bytes.
pub type RankMap = HashMap<Box<[u8]>, u32, BuildHasherDefault<FxHasher>>;

/// Longest token kept in the packed 64-bit-key map.
const SHORT_MAX: usize = 7;
/// Longest token kept in the packed 128-bit-key map.
const MID_MAX: usize = 15;

/// Packs 3..=7 bytes and their length into one integer key (no allocation, no memcmp).
#[inline]
fn pack_short(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(w) | ((b.len() as u64) << 56)
}

/// Packs 8..=15 bytes and their length into one 128-bit key.
#[inline]
fn pack_mid(b: &[u8]) -> u128 {
    let mut w = [0u8; 16];
    w[..b.len()].copy_from_slice(b);
    u128::from_le_bytes(w) | ((b.len() as u128) << 120)
}

/// Rank tables used by the merge.
#[derive(Debug)]
pub struct Ranks {
    /// Token bytes → rank, for every token.
    pub map: RankMap,
    /// Rank of each single byte (all 256 are required at load).
    pub byte: [u32; 256],
    /// Rank of each two-byte string, `NONE` if absent (`pair[(a << 8) | b]`).
    pub pair: Vec<u32>,
    /// Ranks of the tokens of 3..=7 bytes, keyed by [`pack_short`] (most lookups of a merge).
    short: HashMap<u64, u32, BuildHasherDefault<FxHasher>>,
    /// Ranks of the tokens of 8..=15 bytes, keyed by [`pack_mid`]; longer ones use `map`.
    mid: HashMap<u128, u32, BuildHasherDefault<FxHasher>>,
}

impl Ranks {
    /// Builds the byte and pair tables from `map`; `Err(byte)` if a single byte has no rank.
    pub fn new(map: RankMap) -> Result<Self, u8> {
        let mut byte = [NONE; 256];
        for (b, slot) in byte.iter_mut().enumerate() {
            let key = [b as u8];
            *slot = *map.get(&key[..]).ok_or(b as u8)?;
        }
        let mut pair = vec![NONE; 1 << 16];
        let mut short = HashMap::default();
        let mut mid = HashMap::default();
        for (k, &r) in &map {
            match **k {
                [a, b] => pair[(usize::from(a) << 8) | usize::from(b)] = r,
                _ if (3..=SHORT_MAX).contains(&k.len()) => {
                    short.insert(pack_short(k), r);
                }
                _ if (SHORT_MAX + 1..=MID_MAX).contains(&k.len()) => {
                    mid.insert(pack_mid(k), r);
                }
                _ => {}
            }
        }
        Ok(Ranks {
            map,
            byte,
            pair,
            short,
            mid,
        })
    }

    /// Rank of `bytes`, `NONE` if it is not a token.
    #[inline]
    pub fn rank(&self, bytes: &[u8]) -> u32 {
        match bytes.len() {
            0 => NONE,
            1 => self.byte[usize::from(bytes[0])],
            2 => self.pair[(usize::from(bytes[0]) << 8) | usize::from(bytes[1])],
            3..=SHORT_MAX => self.short.get(&pack_short(bytes)).copied().unwrap_or(NONE),
            8..=MID_MAX => self.mid.get(&pack_mid(bytes)).copied().unwrap_or(NONE),
            _ => self.map.get(bytes).copied().unwrap_or(NONE),
        }
    }
}

/// Reusable buffers of the merge (one per encode call, not per piece).
#[derive(Debug, Default)]
pub struct Scratch {
    /// `(start, rank of the pair starting here)` per part, as in tiktoken.
    parts: Vec<(usize, u32)>,
    /// Heap merge: next/prev part indices, token rank per part.
    next: Vec<usize>,
    prev: Vec<usize>,
    pair_rank: Vec<u32>,
    alive: Vec<bool>,
    heap: BinaryHeap<std::cmp::Reverse<(u32, usize)>>,
}

/// Appends the tokens of one pre-tokenizer piece to `out`.
pub fn encode_piece(ranks: &Ranks, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
    match piece.len() {
        0 => {}
        1 => out.push(ranks.byte[usize::from(piece[0])]),
        _ => {
            let r = ranks.rank(piece);
            if r != NONE {
                out.push(r);
            } else if piece.len() <= SMALL_PIECE {
                merge_scan(ranks, piece, out, scratch);
            } else {
                merge_heap(ranks, piece, out, scratch);
            }
        }
    }
}

/// Pushes the token of `bytes`, which the merge guarantees has a rank (a single byte or a
/// ranked merge result).
#[inline]
fn push_part(ranks: &Ranks, bytes: &[u8], out: &mut Vec<u32>) {
    let r = ranks.rank(bytes);
    debug_assert_ne!(r, NONE, "merged part without a rank");
    out.push(r);
}

/// Quadratic merge (tiktoken's algorithm): after each merge, rescan for the leftmost lowest rank.
pub fn merge_scan(ranks: &Ranks, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
    let parts = &mut scratch.parts;
    parts.clear();
    let n = piece.len();
    for i in 0..n - 1 {
        parts.push((i, ranks.rank(&piece[i..i + 2])));
    }
    parts.push((n - 1, NONE));
    parts.push((n, NONE));
    // Rank of the bytes covered by parts i and i+1 once they are merged (part i+2 must exist).
    let merged_rank = |parts: &[(usize, u32)], i: usize| -> u32 {
        if i + 3 < parts.len() {
            ranks.rank(&piece[parts[i].0..parts[i + 3].0])
        } else {
            NONE
        }
    };
    loop {
        let mut best = (NONE, usize::MAX);
        for (i, &(_, r)) in parts[..parts.len() - 1].iter().enumerate() {
            if r < best.0 {
                best = (r, i);
            }
        }
        if best.0 == NONE {
            break;
        }
        let i = best.1;
        if i > 0 {
            parts[i - 1].1 = merged_rank(parts, i - 1);
        }
        parts[i].1 = merged_rank(parts, i);
        parts.remove(i + 1);
    }
    for w in parts.windows(2) {
        push_part(ranks, &piece[w[0].0..w[1].0], out);
    }
}

/// Heap merge: the same sequence of merges, found with a min-heap of `(rank, start)` and lazy
/// invalidation (an entry is current iff its part is alive and still has that pair rank; equal
/// rank means equal bytes from the same start, i.e. the same pair).
pub fn merge_heap(ranks: &Ranks, piece: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
    let n = piece.len();
    let Scratch {
        next,
        prev,
        pair_rank,
        alive,
        heap,
        ..
    } = scratch;
    // Parts are indexed by their start byte; part i covers piece[i..next[i]].
    next.clear();
    next.extend(1..=n);
    prev.clear();
    prev.extend((0..n).map(|i| i.wrapping_sub(1)));
    alive.clear();
    alive.resize(n, true);
    pair_rank.clear();
    heap.clear();
    for i in 0..n {
        let r = if i + 1 < n {
            ranks.rank(&piece[i..i + 2])
        } else {
            NONE
        };
        pair_rank.push(r);
        if r != NONE {
            heap.push(std::cmp::Reverse((r, i)));
        }
    }
    // Rank of part i merged with its successor.
    let pair_of = |next: &[usize], i: usize| -> u32 {
        let j = next[i];
        if j >= n {
            return NONE;
        }
        ranks.rank(&piece[i..next[j]])
    };
    while let Some(std::cmp::Reverse((r, i))) = heap.pop() {
        if !alive[i] || pair_rank[i] != r {
            continue;
        }
        // Merge part i with its successor j.
        let j = next[i];
        alive[j] = false;
        next[i] = next[j];
        if next[i] < n {
            prev[next[i]] = i;
        }
        pair_rank[i] = pair_of(next, i);
        if pair_rank[i] != NONE {
            heap.push(std::cmp::Reverse((pair_rank[i], i)));
        }
        let p = prev[i];
        if p < n {
            pair_rank[p] = pair_of(next, p);
            if pair_rank[p] != NONE {
                heap.push(std::cmp::Reverse((pair_rank[p], p)));
            }
        }
    }
    let mut i = 0;
    while i < n {
        push_part(ranks, &piece[i..next[i]], out);
        i = next[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: all bytes, plus merges that create ties and chains.
    fn toy() -> Ranks {
        let mut map = RankMap::default();
        for b in 0..=255u8 {
            map.insert(vec![b].into_boxed_slice(), u32::from(b));
        }
        let merges: &[&[u8]] = &[
            b"aa", b"ab", b"bc", b"aaa", b"aaaa", b"abc", b"ca", b"cab", b"bca", b"aabc", b"ba",
            b"bb", b"bbb", b"cc", b"ccc", b"abab", b"baba",
        ];
        for (k, m) in merges.iter().enumerate() {
            map.insert(m.to_vec().into_boxed_slice(), 256 + k as u32);
        }
        Ranks::new(map).unwrap()
    }

    #[test]
    fn scan_and_heap_agree() {
        let ranks = toy();
        let mut scratch = Scratch::default();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for case in 0..3000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = 2 + (state % 150) as usize;
            let piece: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    b"abcx"[(state % 4) as usize]
                })
                .collect();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            merge_scan(&ranks, &piece, &mut a, &mut scratch);
            merge_heap(&ranks, &piece, &mut b, &mut scratch);
            assert_eq!(
                a,
                b,
                "case {case}: piece {:?}",
                String::from_utf8_lossy(&piece)
            );
        }
    }

    #[test]
    fn ties_merge_leftmost_first() {
        // "aaaaa": every pair is "aa" (256); leftmost first gives aa|a|a|a, then aa|aa|a; now
        // "aaa" (259) at the second part beats "aaaa" (260) at the first -> [aa, aaa]. A
        // rightmost-first merge would give [aaa, aa].
        let ranks = toy();
        let mut scratch = Scratch::default();
        for f in [merge_scan, merge_heap] {
            let mut out = Vec::new();
            f(&ranks, b"aaaaa", &mut out, &mut scratch);
            assert_eq!(out, vec![256, 259]);
            out.clear();
            f(&ranks, b"bbb", &mut out, &mut scratch);
            // "bb" (267) leftmost, then "bbb" (268).
            assert_eq!(out, vec![268]);
        }
    }
}
