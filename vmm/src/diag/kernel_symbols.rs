//! A guest kernel's symbols for naming code addresses in tool reports: its `System.map`
//! or its own ELF symbol table, plus the physical aliases of its segments (code that runs
//! before paging is on executes at the physical address). Tools' host-side reports take
//! them as the tool API's [`BlockNames`] (bbcount's hottest blocks, cachesim's top
//! instructions).

use std::path::Path;

use anyhow::Context;
use kpin_tool::host_side::BlockNames;

use crate::diag::symbols::Symbols;

/// A kernel's symbols and where they came from.
pub struct KernelSymbols {
    /// The table.
    pub symbols: Symbols,
    /// Where it came from, for the report (`System.map …`, `ELF symbol table of …`).
    pub source: String,
    /// The kernel ELF's segments linked at a virtual address other than their physical
    /// one: code that runs before paging is on (Linux's `startup_64` at 0x1000000 for
    /// 0xffffffff81000000) executes at the physical address.
    aliases: Vec<PhysAlias>,
    /// The KASLR slide found by [`KernelSymbols::find_slide`] (0: none).
    slide: u64,
}

/// A `PT_LOAD` segment whose physical range `[pa, pa + len)` is also its virtual range
/// at `va`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PhysAlias {
    pa: u64,
    va: u64,
    len: u64,
}

/// The `PT_LOAD` segments of a little-endian ELF64 `kernel` with `p_paddr != p_vaddr`
/// (nothing for a bzImage or an unreadable file: names are a convenience). Reads only
/// the headers: a vmlinux is tens of MiB.
fn phys_aliases(kernel: &Path) -> Vec<PhysAlias> {
    use std::os::unix::fs::FileExt;
    const PT_LOAD: u32 = 1;
    let Ok(f) = std::fs::File::open(kernel) else {
        return Vec::new();
    };
    let read = |off: u64, len: usize| {
        let mut b = vec![0; len];
        f.read_exact_at(&mut b, off).ok().map(|()| b)
    };
    let le = |b: &[u8], o: usize, n: usize| {
        b[o..o + n]
            .iter()
            .rev()
            .fold(0u64, |v, &x| v << 8 | u64::from(x))
    };
    let Some(h) = read(0, 64).filter(|h| h.starts_with(b"\x7fELF\x02\x01")) else {
        return Vec::new();
    };
    let (phoff, phentsize, phnum) = (le(&h, 0x20, 8), le(&h, 0x36, 2), le(&h, 0x38, 2));
    // A real kernel has a handful of program headers; more is a corrupt file.
    if phentsize < 56 || phentsize * phnum > 1 << 16 {
        return Vec::new();
    }
    let Some(ph) = read(phoff, (phentsize * phnum) as usize) else {
        return Vec::new();
    };
    ph.chunks_exact(phentsize as usize)
        .filter(|p| le(p, 0, 4) == u64::from(PT_LOAD))
        .map(|p| PhysAlias {
            va: le(p, 0x10, 8),
            pa: le(p, 0x18, 8),
            len: le(p, 0x28, 8),
        })
        .filter(|a| a.va != a.pa)
        .collect()
}

impl KernelSymbols {
    /// The System.map if there is one, else the kernel's own ELF symbol table; `None` if
    /// neither gives symbols (a bzImage, a stripped ELF).
    pub fn load(kernel: &Path, system_map: Option<&Path>) -> anyhow::Result<Option<Self>> {
        if let Some(map) = system_map {
            let symbols =
                Symbols::load(map).with_context(|| format!("cannot read {}", map.display()))?;
            return Ok(Some(KernelSymbols {
                symbols,
                source: format!("System.map {}", map.display()),
                aliases: phys_aliases(kernel),
                slide: 0,
            }));
        }
        let elf =
            std::fs::read(kernel).with_context(|| format!("cannot read {}", kernel.display()))?;
        Ok(Symbols::from_elf(&elf).map(|symbols| KernelSymbols {
            symbols,
            source: format!("ELF symbol table of {}", kernel.display()),
            aliases: phys_aliases(kernel),
            slide: 0,
        }))
    }

    /// Finds where the kernel image ran from the addresses it `executed` (see
    /// [`crate::diag::kaslr`]) and names addresses with that slide from now on; the source
    /// says so. Returns the slide found, if any (none: names stay as linked).
    pub fn find_slide(
        &mut self,
        executed: impl IntoIterator<Item = u64>,
    ) -> Option<crate::diag::kaslr::Slide> {
        let found = crate::diag::kaslr::find_slide(self.symbols.addresses(), executed)?;
        self.slide = found.slide;
        if found.slide != 0 {
            let s = found.signed();
            self.source.push_str(&format!(
                ", KASLR slide {}{:#x} (from {} of {} executed kernel addresses on symbol starts)",
                if s < 0 { "-" } else { "+" },
                s.unsigned_abs(),
                found.matches,
                found.executed
            ));
        }
        Some(found)
    }

    /// `symbol+0xoff` for `addr`; an address only a physical alias covers is named by
    /// its link address with ` (physical)` after it. Kernel-image addresses are moved
    /// back by the KASLR slide first, if one was found.
    pub fn describe(&self, addr: u64) -> Option<String> {
        let addr = if addr >= crate::diag::kaslr::IMAGE_START {
            addr.wrapping_sub(self.slide)
        } else {
            addr
        };
        self.symbols.describe(addr).or_else(|| {
            let a = self
                .aliases
                .iter()
                .find(|a| addr.wrapping_sub(a.pa) < a.len)?;
            let name = self.symbols.describe(a.va + (addr - a.pa))?;
            Some(format!("{name} (physical)"))
        })
    }
}

impl BlockNames for KernelSymbols {
    fn source(&self) -> String {
        self.source.clone()
    }

    fn name(&self, addr: u64) -> Option<String> {
        self.describe(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel_symbols() -> KernelSymbols {
        KernelSymbols {
            symbols: Symbols::parse(
                "ffffffff81000000 T do_syscall_64\n\
                 ffffffff81000100 T entry_SYSCALL_64\n",
            ),
            source: "System.map test".into(),
            aliases: vec![PhysAlias {
                pa: 0x100_0000,
                va: 0xffff_ffff_8100_0000,
                len: 0x1000,
            }],
            slide: 0,
        }
    }

    #[test]
    fn test_code_run_at_its_physical_address_is_named_by_its_link_address() {
        let s = kernel_symbols();
        assert_eq!(
            s.describe(0x100_0045).as_deref(),
            Some("do_syscall_64+0x45 (physical)")
        );
        assert_eq!(s.describe(0x100_1000), None, "past the segment");
        assert_eq!(
            s.describe(0xffff_ffff_8100_0045).as_deref(),
            Some("do_syscall_64+0x45")
        );
    }

    #[test]
    fn test_phys_aliases_come_from_the_elf_program_headers() {
        // ELF header, then two PT_LOADs: one linked high and loaded low, one identity.
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        for (va, pa, len) in [
            (0xffff_ffff_8100_0000u64, 0x100_0000u64, 0x2000u64),
            (0x10_0000, 0x10_0000, 0x1000),
        ] {
            let mut ph = [0u8; 56];
            ph[..4].copy_from_slice(&1u32.to_le_bytes());
            ph[0x10..0x18].copy_from_slice(&va.to_le_bytes());
            ph[0x18..0x20].copy_from_slice(&pa.to_le_bytes());
            ph[0x28..0x30].copy_from_slice(&len.to_le_bytes());
            elf.extend_from_slice(&ph);
        }
        let path = std::env::temp_dir().join(format!("kpin-report-phdrs-{}", std::process::id()));
        std::fs::write(&path, &elf).unwrap();
        assert_eq!(
            phys_aliases(&path),
            [PhysAlias {
                pa: 0x100_0000,
                va: 0xffff_ffff_8100_0000,
                len: 0x2000
            }]
        );
        std::fs::write(&path, &elf[..100]).unwrap();
        assert!(phys_aliases(&path).is_empty(), "truncated headers");
        std::fs::remove_file(&path).unwrap();
        assert!(phys_aliases(Path::new("/nonexistent")).is_empty());
    }

    #[test]
    fn test_a_found_kaslr_slide_moves_names_back_to_their_link_addresses() {
        let mut text = String::new();
        for k in 0..64u64 {
            text.push_str(&format!(
                "{:x} T f{k}\n",
                0xffff_ffff_8100_0000u64 + k * 0x230
            ));
        }
        let mut s = KernelSymbols {
            symbols: Symbols::parse(&text),
            source: "System.map test".into(),
            aliases: Vec::new(),
            slide: 0,
        };
        let slide = 0x3460_0000u64;
        let ran: Vec<u64> = (0..64u64)
            .map(|k| 0xffff_ffff_8100_0000 + k * 0x230 + slide)
            .chain([0x40_1000])
            .collect();
        assert_eq!(s.describe(ran[3] + 4), None, "off the map before");
        let found = s.find_slide(ran.iter().copied()).expect("a clear slide");
        assert_eq!((found.slide, found.matches), (slide, 64));
        assert_eq!(s.describe(ran[3] + 4).as_deref(), Some("f3+0x4"));
        assert!(
            s.source.contains("KASLR slide +0x34600000 (from 64 of 64"),
            "{}",
            s.source
        );
        // Not moved: found as 0, nothing said.
        let mut t = KernelSymbols {
            slide: 0,
            source: "m".into(),
            ..s
        };
        let at_link: Vec<u64> = ran.iter().map(|a| a.wrapping_sub(slide)).collect();
        assert_eq!(t.find_slide(at_link).map(|f| f.slide), Some(0));
        assert_eq!(t.source, "m");
        assert_eq!(t.describe(0xffff_ffff_8100_0004).as_deref(), Some("f0+0x4"));
    }
}
