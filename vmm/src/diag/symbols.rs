//! Kernel symbols, to name code addresses (`int3_selftest+0x1c`) in dumps and reports:
//! from a `System.map`, or from an ELF kernel's own `.symtab` (the mini-kernel, any
//! `--kernel x.elf` that was not stripped).
//!
//! Only code symbols are kept. An address resolves to the nearest symbol at or below it
//! if it lies inside that symbol: within its size when the ELF gives one, else within
//! [`MAX_SYMBOL_BYTES`]. Rust's legacy mangling (`_ZN10minikernel5kmain17h…E`) is shown
//! demangled (`minikernel::kmain`).

use std::path::Path;

/// An address further than this past the nearest symbol of unknown size is not
/// attributed to it.
const MAX_SYMBOL_BYTES: u64 = 1 << 20;

/// One code symbol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    /// Its address.
    pub address: u64,
    /// Its size in bytes, when known (ELF functions; System.map has no sizes).
    pub size: Option<u64>,
    /// Its name (demangled).
    pub name: String,
}

impl Symbol {
    fn covers(&self, addr: u64) -> bool {
        addr.checked_sub(self.address)
            .is_some_and(|off| off < self.size.unwrap_or(MAX_SYMBOL_BYTES))
    }
}

/// A sorted symbol table.
#[derive(Debug, Default)]
pub struct Symbols {
    by_addr: Vec<Symbol>,
}

impl Symbols {
    /// Sorts by address; at one address a sized symbol (an ELF function) sorts last, so
    /// lookups prefer it to an untyped label there.
    fn new(mut by_addr: Vec<Symbol>) -> Self {
        by_addr.sort_by_key(|s| (s.address, s.size.is_some()));
        Symbols { by_addr }
    }

    /// Parses System.map text (text symbols: `t`, `T`, `w`, `W`).
    pub fn parse(text: &str) -> Self {
        Self::new(
            text.lines()
                .filter_map(|line| {
                    let mut f = line.split_whitespace();
                    let address = u64::from_str_radix(f.next()?, 16).ok()?;
                    let kind = f.next()?;
                    let name = f.next()?;
                    matches!(kind, "t" | "T" | "w" | "W").then(|| Symbol {
                        address,
                        size: None,
                        name: demangle(name),
                    })
                })
                .collect(),
        )
    }

    /// Reads and parses a System.map file.
    pub fn load(path: &Path) -> std::io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string(path)?))
    }

    /// The code symbols of a little-endian ELF64 file's `.symtab`: functions, and untyped
    /// labels (assembly entry points) in executable sections. `None` if `elf` is not such
    /// a file or has no such symbol (stripped); malformed tables are cut short, never
    /// read out of bounds.
    pub fn from_elf(elf: &[u8]) -> Option<Self> {
        const SHT_SYMTAB: u32 = 2;
        const SHF_EXECINSTR: u64 = 4;
        const STT_NOTYPE: u8 = 0;
        const STT_FUNC: u8 = 2;
        const SHN_LORESERVE: u16 = 0xff00;
        const SYM_BYTES: usize = 24;
        let bytes = |o: usize, n: usize| elf.get(o..o.checked_add(n)?);
        let u16_at = |o| Some(u16::from_le_bytes(bytes(o, 2)?.try_into().ok()?));
        let u32_at = |o| Some(u32::from_le_bytes(bytes(o, 4)?.try_into().ok()?));
        let u64_at = |o| Some(u64::from_le_bytes(bytes(o, 8)?.try_into().ok()?));
        let usize_at = |o| usize::try_from(u64_at(o)?).ok();
        // ELFCLASS64, ELFDATA2LSB.
        if bytes(0, 6)? != b"\x7fELF\x02\x01" {
            return None;
        }
        let shoff = usize_at(0x28)?;
        let shentsize = usize::from(u16_at(0x3a)?);
        let shnum = usize::from(u16_at(0x3c)?);
        let section = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
        let executable = |i: u16| {
            section(usize::from(i))
                .and_then(|sh| u64_at(sh + 8))
                .is_some_and(|flags| flags & SHF_EXECINSTR != 0)
        };
        let mut syms = Vec::new();
        for i in 0..shnum {
            let Some(sh) = section(i) else { break };
            if u32_at(sh + 4) != Some(SHT_SYMTAB) {
                continue;
            }
            let (Some(off), Some(size), Some(link)) =
                (usize_at(sh + 0x18), usize_at(sh + 0x20), u32_at(sh + 0x28))
            else {
                continue;
            };
            let Some(strtab) = section(link as usize)
                .and_then(|s| Some((usize_at(s + 0x18)?, usize_at(s + 0x20)?)))
                .and_then(|(o, n)| bytes(o, n))
            else {
                continue;
            };
            for s in (off..off.saturating_add(size)).step_by(SYM_BYTES) {
                let (Some(name), Some(info), Some(shndx), Some(address), Some(len)) = (
                    u32_at(s),
                    bytes(s + 4, 1),
                    u16_at(s + 6),
                    u64_at(s + 8),
                    u64_at(s + 16),
                ) else {
                    break;
                };
                let kind = info[0] & 0xf;
                let code = (kind == STT_FUNC || kind == STT_NOTYPE)
                    && shndx != 0
                    && shndx < SHN_LORESERVE
                    && executable(shndx);
                let name = strtab
                    .get(name as usize..)
                    .and_then(|n| n.split(|&b| b == 0).next())
                    .and_then(|n| std::str::from_utf8(n).ok())
                    .filter(|n| !n.is_empty());
                if let (true, Some(name)) = (code, name) {
                    syms.push(Symbol {
                        address,
                        size: (kind == STT_FUNC && len > 0).then_some(len),
                        name: demangle(name),
                    });
                }
            }
        }
        (!syms.is_empty()).then(|| Self::new(syms))
    }

    /// Number of symbols.
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// The symbols' addresses, ascending (repeats where several names share one).
    pub fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.by_addr.iter().map(|s| s.address)
    }

    /// The symbol called `name` (demangled), if any.
    pub fn find(&self, name: &str) -> Option<&Symbol> {
        self.by_addr.iter().find(|s| s.name == name)
    }

    /// `name+0xoff` for `addr`, if a symbol covers it.
    pub fn describe(&self, addr: u64) -> Option<String> {
        let i = self
            .by_addr
            .partition_point(|s| s.address <= addr)
            .checked_sub(1)?;
        let s = &self.by_addr[i];
        s.covers(addr)
            .then(|| format!("{}+{:#x}", s.name, addr - s.address))
    }
}

/// `a::b::c` for Rust's legacy mangling `_ZN1a1b1c17h<16 hex digits>E` (the hash
/// dropped, the common `$..$` escapes undone); any other name unchanged.
fn demangle(name: &str) -> String {
    let parts = (|| {
        let mut rest = name.strip_prefix("_ZN")?;
        let mut parts = Vec::new();
        while !rest.starts_with('E') {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            let len: usize = rest[..digits].parse().ok()?;
            let part = rest.get(digits..digits + len)?;
            rest = &rest[digits + len..];
            // A part that starts with an escape gets a `_` in front.
            parts.push(
                part.strip_prefix('_')
                    .filter(|p| p.starts_with('$'))
                    .unwrap_or(part),
            );
        }
        (rest == "E").then_some(parts)
    })();
    let Some(mut parts) = parts else {
        return name.to_string();
    };
    if parts
        .last()
        .is_some_and(|h| h.len() == 17 && h.starts_with('h'))
    {
        parts.pop();
    }
    let mut out = parts.join("::");
    for (from, to) in [
        ("$LT$", "<"),
        ("$GT$", ">"),
        ("$RF$", "&"),
        ("$BP$", "*"),
        ("$C$", ","),
        ("$u20$", " "),
        ("$u7b$", "{"),
        ("$u7d$", "}"),
        ("$u5b$", "["),
        ("$u5d$", "]"),
        ("..", "::"),
    ] {
        out = out.replace(from, to);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_resolves_nearest_text_symbol_below() {
        let s = Symbols::parse(
            "ffffffff81000000 T _text\n\
             ffffffff81000100 t helper\n\
             ffffffff82000000 D some_data\n\
             garbage line\n\
             ffffffff8305e250 t int3_selftest\n",
        );
        assert_eq!(s.len(), 3);
        assert_eq!(
            s.describe(0xffff_ffff_8305_e26c).as_deref(),
            Some("int3_selftest+0x1c")
        );
        assert_eq!(
            s.describe(0xffff_ffff_8100_0100).as_deref(),
            Some("helper+0x0")
        );
        assert_eq!(s.describe(0x1000), None, "below every symbol");
        assert_eq!(
            s.describe(0xffff_ffff_9000_0000),
            None,
            "too far past the last symbol"
        );
    }

    #[test]
    fn test_demangles_rust_legacy_names_only() {
        assert_eq!(
            demangle("_ZN10minikernel5kmain17h2c2c96aa7c11ca26E"),
            "minikernel::kmain"
        );
        assert_eq!(
            demangle("_ZN4core3fmt5write17h0123456789abcdefE"),
            "core::fmt::write"
        );
        assert_eq!(
            demangle(
                "_ZN50_$LT$T$u20$as$u20$core..convert..Into$LT$U$GT$$GT$4into17h0123456789abcdefE"
            ),
            "<T as core::convert::Into<U>>::into"
        );
        for plain in ["do_syscall_64", "_ZN3foo", "_ZN99xE", "_Z3foov"] {
            assert_eq!(demangle(plain), plain);
        }
    }

    /// A minimal ELF64: sections NULL, .text (executable), .data, .symtab, .strtab.
    fn elf_with_symbols(syms: &[(&str, u8, u16, u64, u64)]) -> Vec<u8> {
        let mut strtab = vec![0u8];
        let mut symtab = vec![0u8; 24]; // the null symbol
        for &(name, kind, shndx, value, size) in syms {
            let at = strtab.len() as u32;
            strtab.extend_from_slice(name.as_bytes());
            strtab.push(0);
            symtab.extend_from_slice(&at.to_le_bytes());
            symtab.push(kind); // STB_LOCAL
            symtab.push(0);
            symtab.extend_from_slice(&shndx.to_le_bytes());
            symtab.extend_from_slice(&value.to_le_bytes());
            symtab.extend_from_slice(&size.to_le_bytes());
        }
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let symtab_off = elf.len();
        elf.extend_from_slice(&symtab);
        let strtab_off = elf.len();
        elf.extend_from_slice(&strtab);
        let shoff = elf.len();
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&5u16.to_le_bytes());
        // (type, flags, offset, size, link)
        let headers: [(u32, u64, usize, usize, u32); 5] = [
            (0, 0, 0, 0, 0),
            (1, 6, 0, 0, 0), // PROGBITS, ALLOC | EXECINSTR
            (1, 3, 0, 0, 0), // PROGBITS, WRITE | ALLOC
            (2, 0, symtab_off, symtab.len(), 4),
            (3, 0, strtab_off, strtab.len(), 0),
        ];
        for (ty, flags, off, size, link) in headers {
            let mut sh = [0u8; 64];
            sh[4..8].copy_from_slice(&ty.to_le_bytes());
            sh[8..16].copy_from_slice(&flags.to_le_bytes());
            sh[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            sh[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            sh[0x28..0x2c].copy_from_slice(&link.to_le_bytes());
            elf.extend_from_slice(&sh);
        }
        elf
    }

    #[test]
    fn test_elf_symtab_gives_code_symbols_with_sizes() {
        const FUNC: u8 = 2;
        const NOTYPE: u8 = 0;
        const OBJECT: u8 = 1;
        const FILE: u8 = 4;
        let elf = elf_with_symbols(&[
            ("entry_stub", NOTYPE, 1, 0x10_0000, 0),
            ("known_loop_1000", FUNC, 1, 0x10_1000, 0x40),
            (
                "_ZN10minikernel5kmain17h2c2c96aa7c11ca26E",
                FUNC,
                1,
                0x10_2000,
                0x100,
            ),
            ("alias_label", NOTYPE, 1, 0x10_2000, 0),
            ("a_counter", OBJECT, 2, 0x10_3000, 8),
            ("__bss_start", NOTYPE, 2, 0x10_4000, 0),
            ("minikernel.c", FILE, 0xfff1, 0, 0),
            ("undefined", FUNC, 0, 0x10_5000, 0),
        ]);
        let s = Symbols::from_elf(&elf).expect("symbols");
        assert_eq!(s.len(), 4, "{s:?}");
        assert_eq!(
            s.find("known_loop_1000"),
            Some(&Symbol {
                address: 0x10_1000,
                size: Some(0x40),
                name: "known_loop_1000".into()
            })
        );
        assert_eq!(
            s.describe(0x10_1012).as_deref(),
            Some("known_loop_1000+0x12")
        );
        assert_eq!(s.describe(0x10_1040), None, "past the function's end");
        assert_eq!(
            s.describe(0x10_0030).as_deref(),
            Some("entry_stub+0x30"),
            "an untyped label covers what follows it"
        );
        assert_eq!(
            s.describe(0x10_2008).as_deref(),
            Some("minikernel::kmain+0x8"),
            "the function wins over a label at its address"
        );
        assert_eq!(s.describe(0x10_4000), None, "data symbols are not code");

        assert!(Symbols::from_elf(b"not an elf").is_none());
        assert!(
            Symbols::from_elf(&elf_with_symbols(&[])).is_none(),
            "stripped"
        );
        for cut in [70, elf.len() - 100, elf.len() - 1] {
            let _ = Symbols::from_elf(&elf[..cut]); // never panics
        }
    }
}
