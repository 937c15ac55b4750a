//! A software walk of the guest's x86-64 4-level page tables, for the VMM's diagnostics
//! (reading the bytes at a faulting RIP, the stack). It never writes guest memory: unlike
//! a hardware walk it sets no accessed/dirty bits.

use kpin_abi::x86::pte;

/// Translates `va` with root `cr3`, reading 8-byte entries with `read_u64(gpa)`.
/// Returns the guest-physical address, or `None` if a level is not present or unreadable.
pub fn translate(cr3: u64, va: u64, read_u64: &mut dyn FnMut(u64) -> Option<u64>) -> Option<u64> {
    let mut table = cr3 & pte::ADDR_MASK;
    // Levels: PML4 (bits 39..47), PDPT (30..38), PD (21..29), PT (12..20).
    for (level, shift) in [39u32, 30, 21, 12].into_iter().enumerate() {
        let index = (va >> shift) & 0x1ff;
        let entry = read_u64(table + index * 8)?;
        if entry & pte::PRESENT == 0 {
            return None;
        }
        let is_leaf = shift == 12 || (level > 0 && entry & pte::PAGE_SIZE != 0);
        if is_leaf {
            let page_mask = (1u64 << shift) - 1;
            return Some((entry & pte::ADDR_MASK & !page_mask) | (va & page_mask));
        }
        table = entry & pte::ADDR_MASK;
    }
    None
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn reader(m: &HashMap<u64, u64>) -> impl FnMut(u64) -> Option<u64> + '_ {
        move |a| Some(*m.get(&a).unwrap_or(&0))
    }

    #[test]
    fn test_walks_4k_2m_and_1g_pages() {
        let mut m = HashMap::new();
        let va4k: u64 = 0xffff_8000_0020_3abc;
        // PML4[256] -> 0x2000; PDPT[0] -> 0x3000; PD[1] -> 0x4000; PT[3] -> 0x7000_0000.
        m.insert(0x1000 + 256 * 8, 0x2000 | pte::PRESENT);
        m.insert(0x2000, 0x3000 | pte::PRESENT);
        m.insert(0x3000 + 8, 0x4000 | pte::PRESENT);
        m.insert(0x4000 + 3 * 8, 0x7000_0000 | pte::PRESENT);
        assert_eq!(translate(0x1000, va4k, &mut reader(&m)), Some(0x7000_0abc));
        // PD[2] is a 2 MiB page at 0x4060_0000.
        m.insert(0x3000 + 16, 0x4060_0000 | pte::PRESENT | pte::PAGE_SIZE);
        assert_eq!(
            translate(0x1000, 0xffff_8000_0041_2345, &mut reader(&m)),
            Some(0x4061_2345)
        );
        // PDPT[1] is a 1 GiB page at 0x8000_0000.
        m.insert(0x2000 + 8, 0x8000_0000 | pte::PRESENT | pte::PAGE_SIZE);
        assert_eq!(
            translate(0x1000, 0xffff_8000_4123_4567, &mut reader(&m)),
            Some(0x8123_4567)
        );
    }

    #[test]
    fn test_not_present_level_gives_none() {
        let m = HashMap::new();
        assert_eq!(translate(0x1000, 0x1234, &mut reader(&m)), None);
    }
}
