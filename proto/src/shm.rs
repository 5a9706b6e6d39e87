//! The store's shared-memory layout.
//!
//! One memfd holds everything: a header page (this module's [`ShmHeader`]), then 4 KiB-aligned
//! regions named by the header's region table — the model-level resident tensors, the pinned
//! trunk layers, the routed-expert arena (fixed whole-expert slots) and the slot table. Only the
//! store writes; workers map the memfd read-only and read a slot only under a lease granted on
//! the socket.
//!
//! The header and the slot-table entries are `#[repr(C)]` types without padding, read and
//! written as bytes through `zerocopy` (its derives prove at compile time that every byte is a
//! field and any bytes are a valid value), so no code spells a field's offset. Fields are in the
//! host's byte order: the segment is shared between processes of one machine, never stored or
//! sent (on the little-endian targets the bytes are those of layout v1's field-by-field
//! little-endian encoding). A worker never trusts the mapping blindly: [`ShmHeader::decode`]
//! copies the header out and checks magic, layout version, sizes and that every region lies
//! inside the mapping without overlapping another.

use serde::{Deserialize, Serialize};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Magic bytes at offset 0.
pub const SHM_MAGIC: [u8; 8] = *b"K3STORE\0";
/// Bumped on any change to the layout.
pub const SHM_LAYOUT_VERSION: u32 = 3;
/// Region table capacity: 5 model tensors + up to 93 pinned layers + arena + slot table, with room.
pub const MAX_REGIONS: usize = 256;
/// Alignment of every region (O_DIRECT reads land in place).
pub const REGION_ALIGN: u64 = 4096;

/// What a region holds.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionKind {
    /// A model-level tensor; `index` = position in [`crate::names::MODEL_TENSORS`].
    ModelTensor = 1,
    /// A pinned trunk layer run; `index` = 0-based layer.
    PinnedLayer = 2,
    /// The routed-expert arena; `index` = 0.
    ExpertArena = 3,
    /// The slot table ([`SlotEntry`] per slot); `index` = 0.
    SlotTable = 4,
    /// The ring the store streams the unpinned trunk layers through; `index` = 0. Workers read
    /// a layer there only under a lease (`Request::TrunkLayer`).
    TrunkRing = 5,
    /// A draft-trunk layer run (SPEC.md §6.10); `index` = 0-based layer.
    DraftLayer = 6,
}

impl RegionKind {
    fn from_u32(v: u32) -> Option<RegionKind> {
        Some(match v {
            1 => RegionKind::ModelTensor,
            2 => RegionKind::PinnedLayer,
            3 => RegionKind::ExpertArena,
            4 => RegionKind::SlotTable,
            5 => RegionKind::TrunkRing,
            6 => RegionKind::DraftLayer,
            _ => return None,
        })
    }
}

/// One entry of the region table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct RegionEntry {
    /// [`RegionKind`] as u32.
    pub kind: u32,
    /// Kind-specific index (layer, tensor position).
    pub index: u32,
    /// Byte offset from the start of the mapping (multiple of [`REGION_ALIGN`]).
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}
const _: () = assert!(std::mem::size_of::<RegionEntry>() == 24);

/// One entry of the slot table (written by the store; workers may read it for diagnostics only —
/// leases, not this table, make a slot safe to read).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct SlotEntry {
    /// [`SlotEntry::EMPTY`], [`SlotEntry::INFLIGHT`] or [`SlotEntry::RESIDENT`].
    pub state: u32,
    /// Layer of the resident expert.
    pub layer: u32,
    /// Expert id of the resident expert.
    pub expert: u32,
    /// Number of live leases.
    pub leases: u32,
}
const _: () = assert!(std::mem::size_of::<SlotEntry>() == 16);

impl SlotEntry {
    /// `state` of a slot holding nothing.
    pub const EMPTY: u32 = 0;
    /// `state` of a slot whose expert is being read.
    pub const INFLIGHT: u32 = 1;
    /// `state` of a slot holding a whole expert.
    pub const RESIDENT: u32 = 2;

    /// Bytes of a slot table with `slots` entries.
    pub const fn table_bytes(slots: u64) -> u64 {
        slots * std::mem::size_of::<SlotEntry>() as u64
    }
}

/// The header at offset 0 of the mapping.
#[repr(C)]
#[derive(Clone, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ShmHeader {
    /// [`SHM_MAGIC`].
    pub magic: [u8; 8],
    /// [`SHM_LAYOUT_VERSION`].
    pub layout_version: u32,
    /// `size_of::<ShmHeader>()` of the writer.
    pub header_bytes: u32,
    /// Total bytes of the mapping.
    pub total_bytes: u64,
    /// Low 64 bits of the content identity of the checkpoint the store serves (SPEC.md §6.11;
    /// [`ShmHeader::model_identity`]).
    pub model_identity_lo: u64,
    /// Entries used in `regions`.
    pub n_regions: u32,
    /// Slots in the expert arena.
    pub slot_count: u32,
    /// Distance between consecutive slots in the arena (≥ expert_bytes, multiple of 4096).
    pub slot_stride: u64,
    /// Bytes of one expert in canonical layout.
    pub expert_bytes: u64,
    /// High 64 bits of the model's content identity (layout v3; reserved and zero before).
    pub model_identity_hi: u64,
    /// The region table; entries past `n_regions` are zero.
    pub regions: [RegionEntry; MAX_REGIONS],
}

/// Bytes of the encoded header.
pub const HEADER_BYTES: usize = std::mem::size_of::<ShmHeader>();
// Layout v1: a 64-byte fixed part, then the region table. A change here changes the bytes: bump
// SHM_LAYOUT_VERSION.
const _: () = assert!(HEADER_BYTES == 64 + std::mem::size_of::<RegionEntry>() * MAX_REGIONS);

/// Where the first region may start.
pub const FIRST_REGION_OFFSET: u64 =
    HEADER_BYTES.div_ceil(REGION_ALIGN as usize) as u64 * REGION_ALIGN;

/// Layout errors found when decoding a header.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShmError {
    /// Mapping shorter than a header.
    #[error("shared memory is {0} bytes, shorter than its header")]
    TooShort(usize),
    /// Wrong magic.
    #[error("not a k3 store segment (bad magic)")]
    BadMagic,
    /// Layout version mismatch.
    #[error("shared-memory layout v{found}, this build reads v{expected}")]
    Version {
        /// Found in the segment.
        found: u32,
        /// This build's.
        expected: u32,
    },
    /// Anything else inconsistent.
    #[error("inconsistent shared-memory header: {0}")]
    Inconsistent(String),
}

impl ShmHeader {
    /// An empty header for a mapping of `total_bytes`.
    pub fn new(total_bytes: u64, model_identity: u128) -> ShmHeader {
        ShmHeader {
            magic: SHM_MAGIC,
            layout_version: SHM_LAYOUT_VERSION,
            header_bytes: HEADER_BYTES as u32,
            total_bytes,
            model_identity_lo: model_identity as u64,
            n_regions: 0,
            slot_count: 0,
            slot_stride: 0,
            expert_bytes: 0,
            model_identity_hi: (model_identity >> 64) as u64,
            regions: [RegionEntry {
                kind: 0,
                index: 0,
                offset: 0,
                len: 0,
            }; MAX_REGIONS],
        }
    }

    /// The content identity of the checkpoint the store serves (SPEC.md §6.11).
    pub fn model_identity(&self) -> u128 {
        (u128::from(self.model_identity_hi) << 64) | u128::from(self.model_identity_lo)
    }

    /// Append a region; errors when the table is full.
    pub fn push_region(
        &mut self,
        kind: RegionKind,
        index: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), ShmError> {
        let n = self.n_regions as usize;
        if n >= MAX_REGIONS {
            return Err(ShmError::Inconsistent("region table full".into()));
        }
        self.regions[n] = RegionEntry {
            kind: kind as u32,
            index,
            offset,
            len,
        };
        self.n_regions += 1;
        Ok(())
    }

    /// The used regions.
    pub fn regions(&self) -> &[RegionEntry] {
        &self.regions[..self.n_regions as usize]
    }

    /// Find a region by kind and index.
    pub fn find(&self, kind: RegionKind, index: u32) -> Option<RegionEntry> {
        self.regions()
            .iter()
            .copied()
            .find(|r| r.kind == kind as u32 && r.index == index)
    }

    /// The header's bytes as they lie in the mapping, exactly [`HEADER_BYTES`] long.
    pub fn encode(&self) -> &[u8] {
        self.as_bytes()
    }

    /// Decode and validate a header from the start of a mapping of `bytes.len()` bytes.
    pub fn decode(bytes: &[u8]) -> Result<ShmHeader, ShmError> {
        let (h, _) =
            ShmHeader::read_from_prefix(bytes).map_err(|_| ShmError::TooShort(bytes.len()))?;
        if h.magic != SHM_MAGIC {
            return Err(ShmError::BadMagic);
        }
        if h.layout_version != SHM_LAYOUT_VERSION {
            return Err(ShmError::Version {
                found: h.layout_version,
                expected: SHM_LAYOUT_VERSION,
            });
        }
        if h.header_bytes as usize != HEADER_BYTES {
            return Err(ShmError::Inconsistent(format!(
                "header is {} bytes, expected {HEADER_BYTES}",
                h.header_bytes
            )));
        }
        if h.total_bytes != bytes.len() as u64 {
            return Err(ShmError::Inconsistent(format!(
                "header says {} bytes, mapping has {}",
                h.total_bytes,
                bytes.len()
            )));
        }
        if h.n_regions as usize > MAX_REGIONS {
            return Err(ShmError::Inconsistent(format!(
                "{} regions (max {MAX_REGIONS})",
                h.n_regions
            )));
        }
        h.validate()?;
        Ok(h)
    }

    /// Every region known, aligned, inside the mapping and disjoint; the arena fits its slots.
    pub fn validate(&self) -> Result<(), ShmError> {
        let bad = |m: String| Err(ShmError::Inconsistent(m));
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (i, r) in self.regions().iter().enumerate() {
            let Some(kind) = RegionKind::from_u32(r.kind) else {
                return bad(format!("region {i} has unknown kind {}", r.kind));
            };
            let Some(end) = r.offset.checked_add(r.len) else {
                return bad(format!("region {i} overflows"));
            };
            if r.offset < FIRST_REGION_OFFSET || r.offset % REGION_ALIGN != 0 {
                return bad(format!("region {i} at unaligned offset {}", r.offset));
            }
            if end > self.total_bytes {
                return bad(format!(
                    "region {i} ends at {end}, past {}",
                    self.total_bytes
                ));
            }
            if kind == RegionKind::ExpertArena {
                let need = self.slot_stride.checked_mul(self.slot_count as u64);
                if self.slot_stride < self.expert_bytes || need.is_none_or(|n| n > r.len) {
                    return bad(format!(
                        "arena of {} bytes cannot hold {} slots of stride {}",
                        r.len, self.slot_count, self.slot_stride
                    ));
                }
            }
            if kind == RegionKind::SlotTable
                && r.len < SlotEntry::table_bytes(self.slot_count.into())
            {
                return bad("slot table shorter than the slot count".into());
            }
            spans.push((r.offset, end));
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return bad(format!("regions overlap at offset {}", w[1].0));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    fn sample() -> ShmHeader {
        let total = FIRST_REGION_OFFSET + 3 * REGION_ALIGN + 2 * 8192 + 4096;
        let mut h = ShmHeader::new(total, 42 | (7 << 100));
        h.slot_count = 2;
        h.slot_stride = 8192;
        h.expert_bytes = 8000;
        let base = FIRST_REGION_OFFSET;
        h.push_region(RegionKind::ModelTensor, 0, base, 100)
            .unwrap();
        h.push_region(RegionKind::PinnedLayer, 0, base + 4096, 5000)
            .unwrap();
        h.push_region(RegionKind::ExpertArena, 0, base + 3 * 4096, 2 * 8192)
            .unwrap();
        h.push_region(RegionKind::SlotTable, 0, base + 3 * 4096 + 2 * 8192, 32)
            .unwrap();
        h
    }

    /// `h` as the store lays it in a mapping of `h.total_bytes`.
    fn full(h: &ShmHeader) -> Vec<u8> {
        let mut b = vec![0u8; h.total_bytes as usize];
        h.write_to_prefix(&mut b).unwrap();
        b
    }

    /// Overwrite the field at `offset` of an encoded header with `v`.
    fn put<T: IntoBytes + Immutable>(b: &mut [u8], offset: usize, v: T) {
        let bytes = v.as_bytes();
        b[offset..offset + bytes.len()].copy_from_slice(bytes);
    }

    /// Byte offset of region `i`'s field at `field` (an `offset_of!` within [`RegionEntry`]).
    fn region_field(i: usize, field: usize) -> usize {
        offset_of!(ShmHeader, regions) + i * size_of::<RegionEntry>() + field
    }

    #[test]
    fn header_written_into_a_mapping_round_trips_and_each_corrupted_field_is_refused() {
        let h = sample();
        let b = full(&h);
        assert_eq!(&b[..HEADER_BYTES], h.encode());
        let back = ShmHeader::decode(&b).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.regions().len(), 4);
        assert_eq!(back.slot_stride, 8192);
        assert_eq!(back.model_identity(), 42 | (7 << 100));

        let refused = |offset: usize, patch: &dyn Fn(&mut Vec<u8>, usize)| {
            let mut c = b.clone();
            patch(&mut c, offset);
            ShmHeader::decode(&c).expect_err("corrupted header accepted")
        };
        let bad_magic = refused(offset_of!(ShmHeader, magic), &|c, o| c[o + 7] = b'!');
        assert_eq!(bad_magic, ShmError::BadMagic);
        let version = refused(offset_of!(ShmHeader, layout_version), &|c, o| {
            put(c, o, SHM_LAYOUT_VERSION + 1)
        });
        assert_eq!(
            version,
            ShmError::Version {
                found: SHM_LAYOUT_VERSION + 1,
                expected: SHM_LAYOUT_VERSION
            }
        );
        let inconsistent = |e: ShmError, what: &str| match e {
            ShmError::Inconsistent(m) => assert!(m.contains(what), "{what}: got {m}"),
            other => panic!("{what}: got {other:?}"),
        };
        inconsistent(
            refused(offset_of!(ShmHeader, header_bytes), &|c, o| {
                put(c, o, HEADER_BYTES as u32 - 8)
            }),
            "header is",
        );
        inconsistent(
            refused(offset_of!(ShmHeader, total_bytes), &|c, o| {
                put(c, o, h.total_bytes + 4096)
            }),
            "mapping has",
        );
        inconsistent(
            refused(offset_of!(ShmHeader, n_regions), &|c, o| {
                put(c, o, MAX_REGIONS as u32 + 1)
            }),
            "regions (max",
        );
        // One more region in use: the zero entry after the last is not a known kind.
        inconsistent(
            refused(offset_of!(ShmHeader, n_regions), &|c, o| put(c, o, 5u32)),
            "unknown kind",
        );
        inconsistent(
            refused(offset_of!(ShmHeader, slot_stride), &|c, o| {
                put(c, o, 4096u64)
            }),
            "cannot hold",
        );
        inconsistent(
            refused(offset_of!(ShmHeader, slot_count), &|c, o| put(c, o, 3u32)),
            "cannot hold",
        );
        inconsistent(
            refused(region_field(2, offset_of!(RegionEntry, kind)), &|c, o| {
                put(c, o, 99u32)
            }),
            "unknown kind 99",
        );
        inconsistent(
            refused(region_field(1, offset_of!(RegionEntry, offset)), &|c, o| {
                put(c, o, FIRST_REGION_OFFSET + 1)
            }),
            "unaligned",
        );
        inconsistent(
            refused(region_field(1, offset_of!(RegionEntry, offset)), &|c, o| {
                put(c, o, FIRST_REGION_OFFSET)
            }),
            "overlap",
        );
        inconsistent(
            refused(region_field(3, offset_of!(RegionEntry, len)), &|c, o| {
                put(c, o, 8u64)
            }),
            "slot table shorter",
        );
        inconsistent(
            refused(region_field(3, offset_of!(RegionEntry, len)), &|c, o| {
                put(c, o, h.total_bytes)
            }),
            "past",
        );
    }

    /// The byte layout, pinned: a change here is a layout change (bump [`SHM_LAYOUT_VERSION`])
    /// that workers of the previous build must refuse. v2 kept v1's bytes and added region kind 5
    /// (the trunk ring), which a v1 worker would not know to use; v3 widened the model identity
    /// to 128 bits (the reserved word at 56 holds its high half), which a v2 worker would compare
    /// with a 64-bit identity of its own.
    #[test]
    fn layout_is_pinned() {
        let fields = [
            (offset_of!(ShmHeader, magic), 0),
            (offset_of!(ShmHeader, layout_version), 8),
            (offset_of!(ShmHeader, header_bytes), 12),
            (offset_of!(ShmHeader, total_bytes), 16),
            (offset_of!(ShmHeader, model_identity_lo), 24),
            (offset_of!(ShmHeader, n_regions), 32),
            (offset_of!(ShmHeader, slot_count), 36),
            (offset_of!(ShmHeader, slot_stride), 40),
            (offset_of!(ShmHeader, expert_bytes), 48),
            (offset_of!(ShmHeader, model_identity_hi), 56),
            (offset_of!(ShmHeader, regions), 64),
            (offset_of!(RegionEntry, kind), 0),
            (offset_of!(RegionEntry, index), 4),
            (offset_of!(RegionEntry, offset), 8),
            (offset_of!(RegionEntry, len), 16),
            (offset_of!(SlotEntry, state), 0),
            (offset_of!(SlotEntry, layer), 4),
            (offset_of!(SlotEntry, expert), 8),
            (offset_of!(SlotEntry, leases), 12),
        ];
        for (i, (got, want)) in fields.iter().enumerate() {
            assert_eq!(got, want, "field {i} moved");
        }
        assert_eq!(SHM_LAYOUT_VERSION, 3);
        assert_eq!(RegionKind::TrunkRing as u32, 5);
        assert_eq!(HEADER_BYTES, 6208);
        let e = SlotEntry {
            state: SlotEntry::RESIDENT,
            layer: 3,
            expert: 0x0102_0304,
            leases: 7,
        };
        let mut want = Vec::new();
        for v in [2u32, 3, 0x0102_0304, 7] {
            want.extend_from_slice(&v.to_ne_bytes());
        }
        assert_eq!(e.as_bytes(), &want[..]);
        assert_eq!(SlotEntry::read_from_bytes(&want).unwrap(), e);
        assert_eq!(SlotEntry::table_bytes(3), 48);
    }

    #[test]
    fn header_round_trips() {
        let h = sample();
        let mut bytes = h.encode().to_vec();
        bytes.resize(h.total_bytes as usize, 0);
        let back = ShmHeader::decode(&bytes).unwrap();
        assert_eq!(back, h);
        assert_eq!(
            back.find(RegionKind::PinnedLayer, 0).unwrap().offset,
            FIRST_REGION_OFFSET + 4096
        );
        assert!(back.find(RegionKind::PinnedLayer, 1).is_none());
    }

    #[test]
    fn corrupt_headers_are_refused() {
        let h = sample();
        let mut b = full(&h);
        b[offset_of!(ShmHeader, magic)] = b'X';
        assert_eq!(ShmHeader::decode(&b), Err(ShmError::BadMagic));
        let mut b = full(&h);
        put(&mut b, offset_of!(ShmHeader, layout_version), 9u32);
        assert!(matches!(
            ShmHeader::decode(&b),
            Err(ShmError::Version { found: 9, .. })
        ));
        assert!(matches!(
            ShmHeader::decode(&full(&h)[..100]),
            Err(ShmError::TooShort(100))
        ));
        let mut overlap = h.clone();
        overlap.regions[1].offset = FIRST_REGION_OFFSET;
        assert!(ShmHeader::decode(&full(&overlap)).is_err());
        let mut past = h.clone();
        past.regions[3].len = u64::MAX;
        assert!(ShmHeader::decode(&full(&past)).is_err());
        let mut small_arena = h.clone();
        small_arena.slot_count = 3;
        assert!(ShmHeader::decode(&full(&small_arena)).is_err());
        let mut wrong_len = full(&h);
        wrong_len.push(0);
        assert!(ShmHeader::decode(&wrong_len).is_err());
    }
}
