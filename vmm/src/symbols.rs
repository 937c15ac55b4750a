//! Kernel symbols from a `System.map`, to name addresses in dumps (`int3_selftest+0x1c`).
//!
//! Only text symbols (`t`, `T`, `w`, `W`) are kept; an address resolves to the nearest
//! symbol at or below it, if that symbol is within [`MAX_SYMBOL_BYTES`].

use std::path::Path;

/// An address further than this past the nearest symbol is not attributed to it.
const MAX_SYMBOL_BYTES: u64 = 1 << 20;

/// A sorted symbol table.
#[derive(Debug, Default)]
pub struct Symbols {
    by_addr: Vec<(u64, String)>,
}

impl Symbols {
    /// Parses System.map text.
    pub fn parse(text: &str) -> Self {
        let mut by_addr: Vec<(u64, String)> = text
            .lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let addr = u64::from_str_radix(f.next()?, 16).ok()?;
                let kind = f.next()?;
                let name = f.next()?;
                matches!(kind, "t" | "T" | "w" | "W").then(|| (addr, name.to_string()))
            })
            .collect();
        by_addr.sort_unstable_by_key(|(a, _)| *a);
        Symbols { by_addr }
    }

    /// Reads and parses a System.map file.
    pub fn load(path: &Path) -> std::io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string(path)?))
    }

    /// Number of symbols.
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }

    /// `name+0xoff` for `addr`, if a symbol covers it.
    pub fn describe(&self, addr: u64) -> Option<String> {
        let i = self
            .by_addr
            .partition_point(|(a, _)| *a <= addr)
            .checked_sub(1)?;
        let (base, name) = &self.by_addr[i];
        let off = addr - base;
        (off < MAX_SYMBOL_BYTES).then(|| format!("{name}+{off:#x}"))
    }
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
}
