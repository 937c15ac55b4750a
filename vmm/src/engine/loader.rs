//! Loading the engine image (an ELF64 executable linked at
//! `kpin_abi::stolen::WINDOW_VA + ENGINE_OFFSET`) into the stolen region: each `PT_LOAD`
//! goes to stolen offset `p_vaddr - WINDOW_VA`, its `[p_filesz, p_memsz)` tail zeroed.
//!
//! Invariants: [`plan`] trusts nothing in the file — every segment must lie inside the
//! stolen region above `ENGINE_OFFSET`, inside the file, and not overlap another, and the
//! entry point must be inside an executable segment — so a bad image is an error, never a
//! write outside the engine's part of the stolen region. No relocations are applied (the
//! image is linked at its final address).

use kpin_abi::stolen::{ENGINE_OFFSET, WINDOW_VA};

/// Why an engine image is refused.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum EngineLoadError {
    /// Not a little-endian ELF64 x86-64 executable, or its headers are cut short.
    #[error("not an x86-64 ELF64 executable ({0})")]
    NotElf(&'static str),
    /// A program header is outside the file.
    #[error("program header table is outside the file")]
    Headers,
    /// A segment's bytes are outside the file, or `p_filesz > p_memsz`.
    #[error("segment at {vaddr:#x} has bad sizes or file bytes outside the file")]
    SegmentBytes {
        /// The segment's virtual address.
        vaddr: u64,
    },
    /// A segment is outside the engine's part of the stolen region.
    #[error(
        "segment {vaddr:#x}+{memsz:#x} is outside the engine window \
         [{start:#x}, {end:#x})"
    )]
    SegmentPlacement {
        /// The segment's virtual address.
        vaddr: u64,
        /// Its size in memory.
        memsz: u64,
        /// First allowed address.
        start: u64,
        /// End of the allowed range.
        end: u64,
    },
    /// Two segments overlap.
    #[error("segments at {0:#x} and {1:#x} overlap")]
    Overlap(u64, u64),
    /// The image has no loadable segment.
    #[error("no loadable segment")]
    Empty,
    /// The entry point is not inside an executable segment.
    #[error("entry point {0:#x} is not inside an executable segment")]
    Entry(u64),
}

/// One segment to copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadSegment {
    /// Offset in the stolen region.
    pub stolen_offset: u64,
    /// Range of the file copied there.
    pub file_start: usize,
    /// Bytes copied from the file.
    pub file_bytes: usize,
    /// Bytes the segment occupies (the rest is zeroed).
    pub mem_bytes: u64,
}

/// What loading an image does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    /// The entry point (a virtual address in the window).
    pub entry: u64,
    /// The segments, in file order.
    pub segments: Vec<LoadSegment>,
    /// End of the highest segment, as a stolen-region offset (the engine's heap may
    /// start above it).
    pub end_offset: u64,
}

const EHDR_BYTES: usize = 64;
const PHDR_BYTES: usize = 56;
const ET_EXEC: u16 = 2;
const EM_X86_64: u16 = 0x3e;
const PT_LOAD: u32 = 1;
const PF_X: u32 = 1;

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// Checks `elf` and works out where its segments go in a stolen region of
/// `stolen_bytes`.
pub fn plan(elf: &[u8], stolen_bytes: u64) -> Result<LoadPlan, EngineLoadError> {
    if elf.len() < EHDR_BYTES || elf[..4] != *b"\x7fELF" {
        return Err(EngineLoadError::NotElf("bad magic or short header"));
    }
    if elf[4] != 2 || elf[5] != 1 {
        return Err(EngineLoadError::NotElf("not ELF64 little-endian"));
    }
    let short = EngineLoadError::NotElf("short header");
    let e_type = u16_at(elf, 16).ok_or(short.clone())?;
    let machine = u16_at(elf, 18).ok_or(short.clone())?;
    if e_type != ET_EXEC || machine != EM_X86_64 {
        return Err(EngineLoadError::NotElf(
            "not an x86-64 ET_EXEC (link with --no-pie)",
        ));
    }
    let entry = u64_at(elf, 24).ok_or(short.clone())?;
    let phoff = usize::try_from(u64_at(elf, 32).ok_or(short.clone())?)
        .map_err(|_| EngineLoadError::Headers)?;
    let phentsize = usize::from(u16_at(elf, 54).ok_or(short.clone())?);
    let phnum = usize::from(u16_at(elf, 56).ok_or(short)?);
    if phentsize < PHDR_BYTES {
        return Err(EngineLoadError::Headers);
    }
    let table_end = phentsize
        .checked_mul(phnum)
        .and_then(|n| n.checked_add(phoff))
        .ok_or(EngineLoadError::Headers)?;
    if table_end > elf.len() {
        return Err(EngineLoadError::Headers);
    }
    let window_start = WINDOW_VA + ENGINE_OFFSET;
    let window_end = WINDOW_VA + stolen_bytes;
    let mut segments = Vec::new();
    let mut ranges: Vec<(u64, u64, bool)> = Vec::new();
    for i in 0..phnum {
        let ph = &elf[phoff + i * phentsize..phoff + (i + 1) * phentsize];
        let field = |off| u64_at(ph, off).ok_or(EngineLoadError::Headers);
        if u32_at(ph, 0) != Some(PT_LOAD) {
            continue;
        }
        let flags = u32_at(ph, 4).ok_or(EngineLoadError::Headers)?;
        let (offset, vaddr, filesz, memsz) = (field(8)?, field(16)?, field(32)?, field(40)?);
        if memsz == 0 {
            continue;
        }
        let file_end = offset.checked_add(filesz);
        if filesz > memsz || file_end.is_none_or(|e| e > elf.len() as u64) {
            return Err(EngineLoadError::SegmentBytes { vaddr });
        }
        let end = vaddr.checked_add(memsz);
        if vaddr < window_start || end.is_none_or(|e| e > window_end) {
            return Err(EngineLoadError::SegmentPlacement {
                vaddr,
                memsz,
                start: window_start,
                end: window_end,
            });
        }
        let end = vaddr + memsz;
        if let Some(&(other, _, _)) = ranges.iter().find(|(s, e, _)| vaddr < *e && *s < end) {
            return Err(EngineLoadError::Overlap(other, vaddr));
        }
        ranges.push((vaddr, end, flags & PF_X != 0));
        segments.push(LoadSegment {
            stolen_offset: vaddr - WINDOW_VA,
            file_start: usize::try_from(offset).map_err(|_| EngineLoadError::Headers)?,
            file_bytes: usize::try_from(filesz).map_err(|_| EngineLoadError::Headers)?,
            mem_bytes: memsz,
        });
    }
    if segments.is_empty() {
        return Err(EngineLoadError::Empty);
    }
    if !ranges.iter().any(|&(s, e, x)| x && (s..e).contains(&entry)) {
        return Err(EngineLoadError::Entry(entry));
    }
    let end_offset = ranges.iter().map(|r| r.1).max().unwrap_or(window_start) - WINDOW_VA;
    Ok(LoadPlan {
        entry,
        segments,
        end_offset,
    })
}

impl LoadPlan {
    /// Copies the segments of `elf` (the file [`plan`] checked) with `write(offset, bytes)`,
    /// writing zeros for each segment's tail.
    pub fn apply<E>(
        &self,
        elf: &[u8],
        mut write: impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        for s in &self.segments {
            write(
                s.stolen_offset,
                &elf[s.file_start..s.file_start + s.file_bytes],
            )?;
            let zeros =
                usize::try_from(s.mem_bytes).expect("bounded by the stolen region") - s.file_bytes;
            if zeros > 0 {
                write(s.stolen_offset + s.file_bytes as u64, &vec![0; zeros])?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = WINDOW_VA + ENGINE_OFFSET;
    const STOLEN: u64 = 64 << 20;

    /// (vaddr, flags, file bytes, memsz)
    fn elf(entry: u64, segs: &[(u64, u32, &[u8], u64)]) -> Vec<u8> {
        let mut e = Vec::new();
        e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
        e.extend_from_slice(&[0; 8]);
        e.extend_from_slice(&ET_EXEC.to_le_bytes());
        e.extend_from_slice(&EM_X86_64.to_le_bytes());
        e.extend_from_slice(&1u32.to_le_bytes());
        e.extend_from_slice(&entry.to_le_bytes());
        e.extend_from_slice(&(EHDR_BYTES as u64).to_le_bytes());
        e.extend_from_slice(&0u64.to_le_bytes());
        e.extend_from_slice(&0u32.to_le_bytes());
        e.extend_from_slice(&(EHDR_BYTES as u16).to_le_bytes());
        e.extend_from_slice(&(PHDR_BYTES as u16).to_le_bytes());
        e.extend_from_slice(&(segs.len() as u16).to_le_bytes());
        e.extend_from_slice(&[0; 6]);
        let mut data_off = (EHDR_BYTES + PHDR_BYTES * segs.len()) as u64;
        for (vaddr, flags, bytes, memsz) in segs {
            e.extend_from_slice(&PT_LOAD.to_le_bytes());
            e.extend_from_slice(&flags.to_le_bytes());
            e.extend_from_slice(&data_off.to_le_bytes());
            e.extend_from_slice(&vaddr.to_le_bytes());
            e.extend_from_slice(&vaddr.to_le_bytes());
            e.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            e.extend_from_slice(&memsz.to_le_bytes());
            e.extend_from_slice(&0x1000u64.to_le_bytes());
            data_off += bytes.len() as u64;
        }
        for (_, _, bytes, _) in segs {
            e.extend_from_slice(bytes);
        }
        e
    }

    #[test]
    fn test_segments_land_at_their_window_offsets_with_zeroed_tails() {
        let image = elf(
            BASE + 1,
            &[
                (BASE, 5, &[0x90, 0xc3], 2),
                (BASE + 0x1000, 6, &[7; 3], 0x10),
            ],
        );
        let p = plan(&image, STOLEN).unwrap();
        assert_eq!(p.entry, BASE + 1);
        assert_eq!(p.segments.len(), 2);
        assert_eq!(p.end_offset, ENGINE_OFFSET + 0x1010);
        let mut mem = vec![0xaa_u8; (ENGINE_OFFSET + 0x2000) as usize];
        p.apply::<()>(&image, |off, bytes| {
            mem[off as usize..off as usize + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        let at = |o: u64| mem[(ENGINE_OFFSET + o) as usize];
        assert_eq!((at(0), at(1), at(2)), (0x90, 0xc3, 0xaa));
        assert_eq!(at(0x1000), 7);
        assert_eq!(at(0x1003), 0, "bss tail zeroed");
        assert_eq!(at(0x100f), 0);
        assert_eq!(at(0x1010), 0xaa);
    }

    #[test]
    fn test_bad_images_are_refused_not_written() {
        let code: &[u8] = &[0xc3];
        assert!(matches!(
            plan(b"garbage", STOLEN),
            Err(EngineLoadError::NotElf(_))
        ));
        let mut truncated = elf(BASE, &[(BASE, 5, code, 1)]);
        truncated.truncate(EHDR_BYTES + 10);
        assert_eq!(plan(&truncated, STOLEN), Err(EngineLoadError::Headers));
        // Below the engine's part of the window (over the attach block): refused.
        let low = elf(WINDOW_VA, &[(WINDOW_VA, 5, code, 1)]);
        assert!(matches!(
            plan(&low, STOLEN),
            Err(EngineLoadError::SegmentPlacement { .. })
        ));
        // Past the end of the stolen region, and wrapping around: refused.
        let high = elf(BASE, &[(BASE, 5, code, STOLEN)]);
        assert!(matches!(
            plan(&high, STOLEN),
            Err(EngineLoadError::SegmentPlacement { .. })
        ));
        let wrap = elf(BASE, &[(BASE, 5, code, u64::MAX)]);
        assert!(matches!(
            plan(&wrap, STOLEN),
            Err(EngineLoadError::SegmentPlacement { .. })
        ));
        let sizes = elf(BASE, &[(BASE, 5, &[1, 2, 3], 1)]);
        assert!(matches!(
            plan(&sizes, STOLEN),
            Err(EngineLoadError::SegmentBytes { .. })
        ));
        let overlap = elf(BASE, &[(BASE, 5, code, 0x100), (BASE + 0x80, 6, code, 1)]);
        assert_eq!(
            plan(&overlap, STOLEN),
            Err(EngineLoadError::Overlap(BASE, BASE + 0x80))
        );
        let data_entry = elf(
            BASE + 0x1000,
            &[(BASE, 5, code, 1), (BASE + 0x1000, 6, code, 1)],
        );
        assert_eq!(
            plan(&data_entry, STOLEN),
            Err(EngineLoadError::Entry(BASE + 0x1000))
        );
        assert_eq!(plan(&elf(BASE, &[]), STOLEN), Err(EngineLoadError::Empty));
    }
}
