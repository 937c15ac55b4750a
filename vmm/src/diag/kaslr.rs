//! A kernel's KASLR slide, found from where its code actually ran.
//!
//! A bzImage's decompressor moves the x86-64 kernel image by a random multiple of 2 MiB
//! (`CONFIG_PHYSICAL_ALIGN`) within the 1 GiB window at 0xffffffff80000000, as one piece:
//! every text symbol runs at its System.map address plus the same slide. Tool reports
//! see executed addresses (bbcount's block starts, memtrace's instruction addresses);
//! many of them are function entries. So each executed kernel address `e` votes for
//! every slide `e - s` with `s` a symbol start whose offset within 2 MiB equals `e`'s
//! (the slide keeps those low 21 bits), and the slide with the most votes wins, if it is
//! clear: at least [`MIN_MATCHES`] votes and twice the runner-up's. An unmoved kernel
//! (an ELF boot, `nokaslr`) finds slide 0 the same way. Robust against any one hot
//! address: the whole run votes, and a wrong slide only collects chance coincidences.

use std::collections::HashMap;

/// The slide's granularity: the kernel's default and minimum `CONFIG_PHYSICAL_ALIGN`.
pub const SLIDE_ALIGN: u64 = 2 << 20;
/// Start of the kernel image's virtual window.
pub const IMAGE_START: u64 = 0xffff_ffff_8000_0000;
/// Fewest executed addresses that must land on symbol starts for a slide to count.
pub const MIN_MATCHES: usize = 8;

/// A slide found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slide {
    /// Added to a link address gives the run address (wrapping; 0: not moved).
    pub slide: u64,
    /// Distinct executed addresses that landed on symbol starts with it.
    pub matches: usize,
    /// Distinct executed kernel-image addresses considered.
    pub executed: usize,
}

impl Slide {
    /// The slide as a signed byte count.
    pub fn signed(&self) -> i64 {
        self.slide as i64
    }
}

/// Finds the slide from `symbols` (link addresses of the kernel's text symbols) and
/// `executed` (addresses the kernel ran code at); `None` if no slide is clear.
pub fn find_slide(
    symbols: impl IntoIterator<Item = u64>,
    executed: impl IntoIterator<Item = u64>,
) -> Option<Slide> {
    let in_image = |a: &u64| *a >= IMAGE_START;
    let mask = SLIDE_ALIGN - 1;
    let mut by_low: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut syms: Vec<u64> = symbols.into_iter().filter(in_image).collect();
    syms.sort_unstable();
    syms.dedup();
    for s in syms {
        by_low.entry(s & mask).or_default().push(s);
    }
    let mut exec: Vec<u64> = executed.into_iter().filter(in_image).collect();
    exec.sort_unstable();
    exec.dedup();
    let mut votes: HashMap<u64, usize> = HashMap::new();
    for &e in &exec {
        for &s in by_low.get(&(e & mask)).map_or(&[][..], Vec::as_slice) {
            let slide = e.wrapping_sub(s);
            // Within the window's reach either way.
            if (slide as i64).unsigned_abs() < 1 << 30 {
                *votes.entry(slide).or_default() += 1;
            }
        }
    }
    let mut ranked: Vec<(u64, usize)> = votes.into_iter().collect();
    ranked.sort_by_key(|&(slide, n)| (std::cmp::Reverse(n), slide));
    let (slide, matches) = *ranked.first()?;
    let runner_up = ranked.get(1).map_or(0, |r| r.1);
    (matches >= MIN_MATCHES && matches >= 2 * runner_up).then_some(Slide {
        slide,
        matches,
        executed: exec.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel-like table: ~6000 functions over 12 MiB of text at 0xffffffff81000000,
    /// at 16-byte-aligned pseudo-random spacing.
    fn table() -> Vec<u64> {
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut a = 0xffff_ffff_8100_0000u64;
        let mut v = Vec::new();
        while a < 0xffff_ffff_81c0_0000 {
            v.push(a);
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            a += 16 * (1 + x % 256);
        }
        v
    }

    /// What a run executes: the entries of every 7th function, and the instructions
    /// inside them (mostly not symbol starts), moved by `slide`.
    fn run_at(t: &[u64], slide: u64) -> Vec<u64> {
        let mut v = Vec::new();
        for (i, &f) in t.iter().enumerate().step_by(7) {
            v.push(f.wrapping_add(slide));
            for k in 1..6 {
                v.push(f.wrapping_add(slide) + 3 * k + (i as u64 % 5));
            }
        }
        // User space and the direct map are not the image.
        v.extend([0x40_1000, 0xffff_8880_0100_0000]);
        v
    }

    #[test]
    fn test_a_2mib_aligned_slide_is_found_from_executed_function_entries() {
        let t = table();
        for slide in [0u64, 0x3400_0000, 0x0c20_0000, 0x3fe0_0000] {
            let s = find_slide(t.iter().copied(), run_at(&t, slide)).expect("clear");
            assert_eq!(s.slide, slide, "{s:?}");
            assert!(s.matches >= t.len() / 7, "{s:?}");
        }
    }

    #[test]
    fn test_too_little_evidence_finds_nothing() {
        let t = table();
        // Three entries only.
        let few: Vec<u64> = t[..3].iter().map(|a| a + 0x3400_0000).collect();
        assert_eq!(find_slide(t.iter().copied(), few), None);
        // Addresses that are never function entries.
        let odd: Vec<u64> = t.iter().map(|a| a + 0x3400_0001).collect();
        assert_eq!(find_slide(t.iter().copied(), odd), None);
        assert_eq!(find_slide(t.iter().copied(), []), None);
    }
}
