//! Where user code came from: per guest-physical code page, the file (or `[anon]`,
//! `[vdso]`) and the file offset the guest had mapped there when the engine translated
//! code on it (issue #27; `processes.json`'s `objects` and `code_pages`,
//! `docs/processes.md`). The host names user code by physical address from these.
//!
//! The engine asks at every translation of a user trace ([`CodeOrigins::known`]: one
//! lookup); only a page not known as mapped at that virtual address in that address space
//! costs a walk: the VMA that maps it (`super::vmas`), then for a file its dentry, whose
//! path is read once per dentry ([`super::exe::read_path`]). A page whose origin changes
//! (a frame reused for other code) gets the later origin.
//!
//! Invariants: at most [`MAX_CODE_PAGES`] pages and [`MAX_OBJECTS`] objects are kept; a
//! page or object past that is dropped and counted by the caller; a failed walk changes
//! nothing.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use kpin_abi::attach::KernelTypes;

use super::exe::{file_dentry, kernel, read_path, word, ExePath};
use super::json_string;
use super::vmas::{find_vma, Vma, VmaMiss};

/// Code pages whose origin is kept (~25 bytes each in `processes.json`).
pub const MAX_CODE_PAGES: usize = 16384;
/// Distinct objects (files, `[anon]`, `[vdso]`) kept.
pub const MAX_OBJECTS: usize = 256;
/// The object of executable memory no file backs.
pub const ANON: &[u8] = b"[anon]";
/// The object of the vDSO's code.
pub const VDSO: &[u8] = b"[vdso]";

/// Where one physical code page came from, and where it was seen mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeOrigin {
    /// Index in [`CodeOrigins::objects`].
    pub object: u16,
    /// The page's offset in the object: `(va_page - vm_start) + vm_pgoff * 4096` (for
    /// private anonymous memory, whose `vm_pgoff` is `vm_start >> 12`, the page's virtual
    /// address; for the vDSO, its offset in the vDSO).
    pub offset: u64,
    /// The address space ([`super::address_space`]) it was seen mapped in.
    space: u64,
    /// The virtual page it was seen mapped at.
    va_page: u64,
}

/// What [`CodeOrigins::note`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Noted {
    /// The page was known as mapped there: nothing read.
    Known,
    /// Walked: the page's origin is recorded (or confirmed).
    Recorded,
    /// Walked, but the table (or the objects) is full: not recorded.
    Dropped,
    /// The walk failed: nothing changed.
    Failed(VmaMiss),
}

/// The code pages' origins and their objects.
#[derive(Debug, Default)]
pub struct CodeOrigins {
    /// Each distinct object once, in the order first seen.
    objects: Vec<ExePath>,
    /// The object read from a dentry (a file's path is read once).
    by_dentry: BTreeMap<u64, u16>,
    /// By page frame number (physical address >> 12).
    pages: BTreeMap<u64, CodeOrigin>,
}

impl CodeOrigins {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the frame `pfn` is known as mapped at `va_page` in `space`.
    pub fn known(&self, pfn: u64, space: u64, va_page: u64) -> bool {
        self.pages
            .get(&pfn)
            .is_some_and(|o| o.space == space && o.va_page == va_page)
    }

    /// User code at `va` (physical `pa`) was translated in address space `space`, whose
    /// `struct mm_struct` is at `mm`: records the page's origin unless it is
    /// [`CodeOrigins::known`].
    pub fn note(
        &mut self,
        t: &KernelTypes,
        va: u64,
        pa: u64,
        space: u64,
        mm: u64,
        read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
    ) -> Noted {
        let (pfn, va_page) = (pa >> 12, va & !0xfff);
        if self.known(pfn, space, va_page) {
            return Noted::Known;
        }
        let vma = match find_vma(t, mm, va, read) {
            Ok(v) => v,
            Err(miss) => return Noted::Failed(miss),
        };
        let object = match self.object_of(t, &vma, mm, read) {
            Ok(Some(o)) => o,
            Ok(None) => return Noted::Dropped,
            Err(miss) => return Noted::Failed(miss),
        };
        if self.pages.len() >= MAX_CODE_PAGES && !self.pages.contains_key(&pfn) {
            return Noted::Dropped;
        }
        let offset = va_page
            .wrapping_sub(vma.start)
            .wrapping_add(vma.pgoff << 12);
        self.pages.insert(
            pfn,
            CodeOrigin {
                object,
                offset,
                space,
                va_page,
            },
        );
        Noted::Recorded
    }

    /// The object `vma` maps (`Ok(None)`: a new one, but [`MAX_OBJECTS`] are kept).
    fn object_of(
        &mut self,
        t: &KernelTypes,
        vma: &Vma,
        mm: u64,
        read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
    ) -> Result<Option<u16>, VmaMiss> {
        if vma.file == 0 {
            // The vDSO is a special mapping without a file: its start is `mm->context.vdso`.
            let vdso = t.mm_vdso != 0
                && word(read, kernel(mm)?.wrapping_add(u64::from(t.mm_vdso)))? == vma.start;
            return Ok(self.intern(ExePath::named(if vdso { VDSO } else { ANON })));
        }
        let dentry = file_dentry(t, vma.file, read)?;
        if let Some(&o) = self.by_dentry.get(&dentry) {
            return Ok(Some(o));
        }
        let path = read_path(t, dentry, read)?;
        let object = self.intern(path);
        if let Some(o) = object {
            self.by_dentry.insert(dentry, o);
        }
        Ok(object)
    }

    /// The index of `path` among the objects, added if new (`None`: full).
    fn intern(&mut self, path: ExePath) -> Option<u16> {
        if let Some(i) = self.objects.iter().position(|o| *o == path) {
            return Some(i as u16);
        }
        if self.objects.len() >= MAX_OBJECTS {
            return None;
        }
        self.objects.push(path);
        Some((self.objects.len() - 1) as u16)
    }

    /// The objects, each once, in the order first seen.
    pub fn objects(&self) -> &[ExePath] {
        &self.objects
    }

    /// Code pages whose origin is recorded.
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// The origin of frame `pfn`.
    pub fn page(&self, pfn: u64) -> Option<&CodeOrigin> {
        self.pages.get(&pfn)
    }

    /// `"objects":[…],"code_pages":[[pfn,object,offset],…]` (pages by frame number).
    pub fn write_json(&self, j: &mut String) {
        j.push_str("\"objects\":[");
        for (i, o) in self.objects.iter().enumerate() {
            if i > 0 {
                j.push(',');
            }
            json_string(j, o.path());
        }
        j.push_str("],\"code_pages\":[");
        for (i, (pfn, o)) in self.pages.iter().enumerate() {
            if i > 0 {
                j.push(',');
            }
            let _ = write!(j, "[{pfn},{},{}]", o.object, o.offset);
        }
        j.push(']');
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_guest::{root, with_vmas, Mem, LEAF, TYPES};
    use super::*;

    const T: KernelTypes = with_vmas(TYPES);
    const MM: u64 = 0xffff_8880_0100_0000;
    const LEAF_AT: u64 = 0xffff_8880_0200_0000;
    const TEXT: u64 = 0xffff_8880_0300_0000;
    const HEAP: u64 = 0xffff_8880_0300_0100;
    const VDSO_VMA: u64 = 0xffff_8880_0300_0200;
    const LIB: u64 = 0xffff_8880_0300_0300;
    const BUSYBOX: u64 = 0xffff_8880_0400_0000;
    const BUSYBOX_AGAIN: u64 = 0xffff_8880_0400_0100;
    const LIBC: u64 = 0xffff_8880_0400_0200;

    /// One leaf: /bin/busybox's text at 0x400000 (file page 0) and a second mapping of
    /// it at 0x600000 (file page 0x10, another `struct file`), anonymous code at 0x700000,
    /// /lib/libc.so at 0x7f0000000000 (page 2), the vDSO at 0x7fff00000000.
    fn space() -> Mem {
        let mut m = Mem::default();
        m.word(MM + 8, root(LEAF_AT, LEAF));
        m.node(
            LEAF_AT,
            LEAF,
            MM | 1,
            &[
                0x3f_ffff,
                0x40_ffff,
                0x5f_ffff,
                0x60_ffff,
                0x6f_ffff,
                0x70_ffff,
                0x7eff_ffff_ffff,
                0x7f00_0000_ffff,
                0x7ffe_ffff_ffff,
                0x7fff_0000_1fff,
            ],
            &[0, TEXT, 0, TEXT + 0x400, 0, HEAP, 0, LIB, 0, VDSO_VMA, 0],
            10,
        );
        m.vma(TEXT, 0x40_0000, 0x41_0000, 0, BUSYBOX);
        m.vma(TEXT + 0x400, 0x60_0000, 0x61_0000, 0x10, BUSYBOX_AGAIN);
        m.vma(HEAP, 0x70_0000, 0x71_0000, 0x700, 0);
        m.vma(LIB, 0x7f00_0000_0000, 0x7f00_0001_0000, 2, LIBC);
        m.vma(VDSO_VMA, 0x7fff_0000_0000, 0x7fff_0000_2000, 0, 0);
        m.word(MM + 0x370, 0x7fff_0000_0000);
        let d = m.file(&T, BUSYBOX, 0xffff_8880_0500_0000, &["bin", "busybox"]);
        m.word(BUSYBOX_AGAIN + 0x18, d);
        m.file(&T, LIBC, 0xffff_8880_0600_0000, &["lib", "libc.so"]);
        m
    }

    fn objects(o: &CodeOrigins) -> alloc::vec::Vec<&str> {
        o.objects()
            .iter()
            .map(|p| core::str::from_utf8(p.path()).unwrap())
            .collect()
    }

    #[test]
    fn test_pages_get_their_file_and_offset_and_a_path_is_read_once() {
        let mut m = space();
        let mut o = CodeOrigins::new();
        let mut reads = 0;
        let note = |o: &mut CodeOrigins, m: &mut Mem, va: u64, pa: u64, reads: &mut u32| {
            let mut r = m.reader();
            o.note(&T, va, pa, 0x1000, MM, &mut |at, out| {
                *reads += 1;
                r(at, out)
            })
        };
        assert_eq!(
            note(&mut o, &mut m, 0x40_1234, 0x12_3234, &mut reads),
            Noted::Recorded
        );
        // root, leaf, the VMA's 4 fields, the file's dentry, 2 components and the root.
        assert_eq!(reads, 1 + 1 + 4 + 1 + 2 * 4 + 1);
        assert_eq!(
            o.page(0x123),
            Some(&CodeOrigin {
                object: 0,
                offset: 0x1000,
                space: 0x1000,
                va_page: 0x40_1000
            })
        );
        // The same page again: known, nothing read.
        reads = 0;
        assert_eq!(
            note(&mut o, &mut m, 0x40_1800, 0x12_3800, &mut reads),
            Noted::Known
        );
        assert_eq!(reads, 0);
        // Another mapping of the same file (another `struct file`, the same dentry): the
        // path is not read again.
        assert_eq!(
            note(&mut o, &mut m, 0x60_2000, 0x200_0000, &mut reads),
            Noted::Recorded
        );
        assert_eq!(reads, 1 + 1 + 4 + 1);
        assert_eq!(o.page(0x2000).unwrap().offset, 0x12000);
        // Anonymous code, a library, the vDSO.
        note(&mut o, &mut m, 0x70_3000, 0x300_0000, &mut reads);
        note(&mut o, &mut m, 0x7f00_0000_5000, 0x400_0000, &mut reads);
        note(&mut o, &mut m, 0x7fff_0000_1000, 0x500_0000, &mut reads);
        assert_eq!(
            objects(&o),
            ["/bin/busybox", "[anon]", "/lib/libc.so", "[vdso]"]
        );
        assert_eq!(
            o.page(0x3000).map(|p| (p.object, p.offset)),
            Some((1, 0x70_3000))
        );
        assert_eq!(
            o.page(0x4000).map(|p| (p.object, p.offset)),
            Some((2, 0x7000))
        );
        assert_eq!(
            o.page(0x5000).map(|p| (p.object, p.offset)),
            Some((3, 0x1000))
        );
        // A gap: no VMA, nothing recorded.
        assert_eq!(
            note(&mut o, &mut m, 0x50_0000, 0x600_0000, &mut reads),
            Noted::Failed(VmaMiss::Gap)
        );
        assert!(o.page(0x6000).is_none());
        let mut j = String::new();
        o.write_json(&mut j);
        assert_eq!(
            j,
            "\"objects\":[\"/bin/busybox\",\"[anon]\",\"/lib/libc.so\",\"[vdso]\"],\"code_pages\":[[291,0,4096],[8192,0,73728],[12288,1,7352320],[16384,2,28672],[20480,3,4096]]"
        );
    }

    #[test]
    fn test_a_reused_frame_takes_its_later_origin_and_a_full_table_drops() {
        let mut m = space();
        let mut o = CodeOrigins::new();
        assert_eq!(
            o.note(&T, 0x40_1000, 0x9000, 1, MM, &mut m.reader()),
            Noted::Recorded
        );
        // The frame now holds libc's code, mapped in another address space.
        assert_eq!(
            o.note(&T, 0x7f00_0000_0000, 0x9000, 2, MM, &mut m.reader()),
            Noted::Recorded
        );
        assert_eq!(o.page(9).map(|p| (p.object, p.offset)), Some((1, 0x2000)));
        // A failed walk leaves the page as it was.
        assert_eq!(
            o.note(&T, 0x50_0000, 0x9000, 3, MM, &mut m.reader()),
            Noted::Failed(VmaMiss::Gap)
        );
        assert_eq!(o.page(9).unwrap().object, 1);
        // Full: a new frame is dropped, a known one still changes.
        for pfn in 0..MAX_CODE_PAGES as u64 {
            o.pages.entry(0x10_0000 + pfn).or_insert(CodeOrigin {
                object: 0,
                offset: 0,
                space: 0,
                va_page: 0,
            });
        }
        assert!(o.pages.len() >= MAX_CODE_PAGES);
        assert_eq!(
            o.note(&T, 0x40_1000, 0x8000, 1, MM, &mut m.reader()),
            Noted::Dropped
        );
        assert_eq!(
            o.note(&T, 0x40_1000, 0x9000, 1, MM, &mut m.reader()),
            Noted::Recorded
        );
        assert_eq!(o.page(9).unwrap().object, 0);
    }
}
