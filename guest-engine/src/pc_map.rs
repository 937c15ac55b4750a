//! A fragment's cache-PC → guest-state map (`recover.rs`), kept compact.
//!
//! The translator marks every guest instruction, glue sequence and exit stub: ~34 marks a
//! trace on a Debian boot. As 16-byte structs in a vector (and the heap's buddy blocks
//! round that up to a power of two) they were ~900 heap bytes a trace, most of the
//! translator's heap growth, which decides when the code cache is flushed: a Debian boot
//! flushed it 95 times with the cache a third full. Stored here as a byte stream of
//! deltas, a mark takes ~3 bytes (3.3 on the `translate_cost` corpus, most marks 2).
//!
//! Encoding, per mark in offset order: a LEB128 varint of `offset delta << 1 | spill
//! changed`, a zigzag LEB128 varint of the guest-PC delta (from the trace's start for
//! the first mark), and the new spill mask (u16, little-endian) if it changed (it starts
//! at 0).
//! Invariant: marks are encoded in strictly increasing offset order, so a lookup stops
//! at the first mark past the offset.
//!
//! The same allocation holds, after the marks, the trace's block counts for the fault
//! path (`insn_count::encode_block_counts`, empty without `Config::count_insns`); the
//! marks' length comes first, as a varint.

use alloc::boxed::Box;
use alloc::vec::Vec;

use crate::arch::MapMark;

/// A fragment's marks and block counts, encoded.
#[derive(Debug, Default)]
pub(crate) struct PcMap(Box<[u8]>);

/// Most bytes one mark takes: a 33-bit and a 64-bit varint and the spill mask.
const MAX_MARK_BYTES: usize = 5 + 10 + 2;

/// Appends `v` as a LEB128 varint.
#[inline]
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Bytes `put_varint` takes for `v`.
fn varint_len(v: u64) -> usize {
    ((64 - (v | 1).leading_zeros()) as usize).div_ceil(7)
}

pub(crate) fn get_varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

impl PcMap {
    /// Encodes `marks` (strictly increasing offsets, as the translator records them) of
    /// the trace that starts at guest PC `start`, and its `block_counts` (kept as
    /// given), through `scratch` (kept by the caller across traces, so that only the
    /// result is allocated, at its exact size).
    pub(crate) fn encode(
        marks: &[MapMark],
        start: u64,
        block_counts: &[u8],
        scratch: &mut Vec<u8>,
    ) -> Self {
        scratch.clear();
        scratch.reserve(marks.len() * MAX_MARK_BYTES);
        let (mut offset, mut pc, mut spilled) = (0u32, start, 0u16);
        for m in marks {
            debug_assert!(m.offset > offset || (m.offset == 0 && offset == 0));
            let changed = m.spilled != spilled;
            let head = u64::from(m.offset - offset) << 1 | u64::from(changed);
            let d = m.guest_pc.wrapping_sub(pc) as i64;
            let zz = ((d << 1) ^ (d >> 63)) as u64;
            (offset, pc, spilled) = (m.offset, m.guest_pc, m.spilled);
            // Most marks: a short step in the code and the guest, the spills unchanged.
            if !changed && (head | zz) < 0x80 {
                scratch.push(head as u8);
                scratch.push(zz as u8);
                continue;
            }
            put_varint(scratch, head);
            put_varint(scratch, zz);
            if changed {
                scratch.extend_from_slice(&m.spilled.to_le_bytes());
            }
        }
        // At its exact size: `into_boxed_slice` then keeps the allocation.
        let head = varint_len(scratch.len() as u64);
        let mut out = Vec::with_capacity(head + scratch.len() + block_counts.len());
        put_varint(&mut out, scratch.len() as u64);
        out.extend_from_slice(scratch);
        out.extend_from_slice(block_counts);
        Self(out.into_boxed_slice())
    }

    /// The marks' bytes and the block counts' bytes.
    fn parts(&self) -> (&[u8], &[u8]) {
        let mut at = 0;
        let marks = get_varint(&self.0, &mut at).unwrap_or(0) as usize;
        let rest = self.0.get(at..).unwrap_or(&[]);
        rest.split_at(marks.min(rest.len()))
    }

    /// The block counts given to [`PcMap::encode`].
    pub(crate) fn block_counts(&self) -> &[u8] {
        self.parts().1
    }

    /// The last mark at or before `off`: its guest PC and spill mask (`start` as given
    /// to [`PcMap::encode`]).
    pub(crate) fn lookup(&self, off: u32, start: u64) -> Option<(u64, u16)> {
        let b = self.parts().0;
        let (mut at, mut offset, mut pc, mut spilled) = (0usize, 0u64, start, 0u16);
        let mut found = None;
        while at < b.len() {
            let head = get_varint(b, &mut at)?;
            offset += head >> 1;
            if offset > u64::from(off) {
                break;
            }
            let z = get_varint(b, &mut at)?;
            pc = pc.wrapping_add((z >> 1) ^ (z & 1).wrapping_neg());
            if head & 1 != 0 {
                spilled = u16::from_le_bytes([*b.get(at)?, *b.get(at + 1)?]);
                at += 2;
            }
            found = Some((pc, spilled));
        }
        found
    }

    /// Heap bytes the encoding takes.
    #[cfg(test)]
    pub(crate) fn encoded_len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(offset: u32, guest_pc: u64, spilled: u16) -> MapMark {
        MapMark {
            offset,
            guest_pc,
            spilled,
        }
    }

    /// What `recover` did before: the last mark with `offset <= off`.
    fn linear(marks: &[MapMark], off: u32) -> Option<(u64, u16)> {
        let i = marks.partition_point(|m| m.offset <= off);
        let m = marks.get(i.checked_sub(1)?)?;
        Some((m.guest_pc, m.spilled))
    }

    #[test]
    fn test_pc_map_answers_every_offset_as_the_mark_list_did() {
        // Kernel and user PCs, backward guest PCs (a trace's out-of-line stubs name
        // earlier instructions), spill masks that come and go, large offset gaps.
        let marks = [
            mark(0, 0xffff_ffff_8100_0000, 0),
            mark(3, 0xffff_ffff_8100_0000, 0x0001),
            mark(9, 0xffff_ffff_8100_0004, 0x0001),
            mark(10, 0xffff_ffff_8100_0007, 0),
            mark(200, 0xffff_ffff_80ff_fff0, 0x8001),
            mark(201, 0x0000_7fff_ffff_f000, 0xffff),
            mark(70_000, 0x0000_0000_0040_1000, 0),
        ];
        for start in [0xffff_ffff_8100_0000, 0, 0x0000_7fff_ffff_f000] {
            let map = PcMap::encode(&marks, start, &[], &mut Vec::new());
            for off in 0..70_010 {
                assert_eq!(map.lookup(off, start), linear(&marks, off), "offset {off}");
            }
            assert!(map.encoded_len() <= marks.len() * 16 / 2);
            // Block counts after the marks change no answer, and come back as given.
            let counts = [3u8, 0x80, 0xFF, 0];
            let both = PcMap::encode(&marks, start, &counts, &mut Vec::new());
            for off in (0..70_010).step_by(7) {
                assert_eq!(both.lookup(off, start), linear(&marks, off), "offset {off}");
            }
            assert_eq!(both.block_counts(), &counts);
            assert_eq!(map.block_counts(), &[] as &[u8]);
        }
        let first_later = PcMap::encode(&[mark(5, 0x1000, 0)], 0x1000, &[], &mut Vec::new());
        assert_eq!(first_later.lookup(4, 0x1000), None);
        assert_eq!(first_later.lookup(5, 0x1000), Some((0x1000, 0)));
        assert_eq!(
            PcMap::encode(&[], 0, &[], &mut Vec::new()).lookup(0, 0),
            None
        );
    }

    #[test]
    fn test_varint_len_is_what_put_varint_writes() {
        for v in [
            0,
            1,
            0x7f,
            0x80,
            0x3fff,
            0x4000,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(varint_len(v), out.len(), "{v:#x}");
        }
    }

    #[test]
    fn test_pc_map_takes_about_two_bytes_a_typical_mark() {
        // Marks a few bytes of code and one instruction apart, no spills.
        let marks: Vec<MapMark> = (0..34u32)
            .map(|i| mark(i * 7, 0xffff_ffff_8123_4000 + u64::from(i) * 4, 0))
            .collect();
        let start = 0xffff_ffff_8123_4000;
        let map = PcMap::encode(&marks, start, &[], &mut Vec::new());
        // (And one byte for the marks' length.)
        assert_eq!(map.encoded_len(), 1 + 34 * 2);
        assert_eq!(map.lookup(7 * 20 + 3, start), Some((start + 80, 0)));
    }
}
