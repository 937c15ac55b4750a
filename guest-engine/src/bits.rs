//! A two-level bitmap: one bit per slot of a lookup table, and a summary bit per word of
//! bits that has any set, so that visiting the set bits of a large, sparse table (the IBL
//! tables, the return caches, the SoftTLB) costs the words that have any, not the table.

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

/// The bitmap.
#[derive(Debug)]
pub(crate) struct Bits {
    pub(crate) words: Vec<u64>,
    /// Bit `w` set iff `words[w] != 0`.
    summary: Vec<u64>,
}

impl Bits {
    /// `bits` bits, all clear.
    pub(crate) fn new(bits: usize) -> Self {
        let words = bits.div_ceil(64);
        Bits {
            words: vec![0; words],
            summary: vec![0; words.div_ceil(64)],
        }
    }

    pub(crate) fn set(&mut self, i: usize) {
        self.words[i / 64] |= 1 << (i % 64);
        self.summary[i / 4096] |= 1 << (i / 64 % 64);
    }

    pub(crate) fn get(&self, i: usize) -> bool {
        self.words[i / 64] & (1 << (i % 64)) != 0
    }

    /// Clears `mask` in word `w`.
    pub(crate) fn clear(&mut self, w: usize, mask: u64) {
        self.words[w] &= !mask;
        if self.words[w] == 0 {
            self.summary[w / 64] &= !(1 << (w % 64));
        }
    }

    /// The first non-zero word in `words`, if any.
    pub(crate) fn next_word(&self, words: Range<usize>) -> Option<usize> {
        let mut s = words.start / 64;
        while s * 64 < words.end {
            // The summary bits of words at or past `words.start`.
            let from = words.start.saturating_sub(s * 64).min(64);
            let bits = if from == 64 {
                0
            } else {
                self.summary[s] & (u64::MAX << from)
            };
            if bits != 0 {
                let w = s * 64 + bits.trailing_zeros() as usize;
                return (w < words.end).then_some(w);
            }
            s += 1;
        }
        None
    }

    /// Calls `f` with every set bit among `words`, clearing it first.
    pub(crate) fn drain(&mut self, words: Range<usize>, mut f: impl FnMut(usize)) {
        let mut at = words.start;
        while let Some(w) = self.next_word(at..words.end) {
            let mut bits = self.words[w];
            self.clear(w, bits);
            while bits != 0 {
                f(w * 64 + bits.trailing_zeros() as usize);
                bits &= bits - 1;
            }
            at = w + 1;
        }
    }

    /// The number of words.
    pub(crate) fn len_words(&self) -> usize {
        self.words.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_set_get_and_drain_in_ranges() {
        let mut b = Bits::new(10_000);
        for i in [0, 63, 64, 4095, 4096, 9999] {
            b.set(i);
        }
        assert!(b.get(4095) && !b.get(4094));
        assert_eq!(b.next_word(1..100), Some(1));
        assert_eq!(b.next_word(2..63), None);
        assert_eq!(b.next_word(2..64), Some(63), "bit 4095");
        assert_eq!(
            b.next_word(64..100),
            Some(64),
            "bit 4096, past a summary word"
        );
        let mut seen = Vec::new();
        b.drain(1..64, |i| seen.push(i));
        assert_eq!(seen, [64, 4095]);
        assert!(!b.get(64) && b.get(63) && b.get(4096));
        seen.clear();
        b.drain(0..b.len_words(), |i| seen.push(i));
        assert_eq!(seen, [0, 63, 4096, 9999]);
        assert_eq!(b.next_word(0..b.len_words()), None);
    }
}
