//! Which port accesses left the engine, by port, direction and guest instruction.
//!
//! A port access the engine cannot answer itself costs a gate round trip and a VM exit
//! (~50 µs under nested KVM), so which guest code makes them is what a profile needs to
//! say. [`PortExitTable`] counts them per (port, direction, RIP) in a fixed table (no
//! allocation: it is updated on the port path of the engine image); accesses that find
//! the table full are counted apart, so the sum is always the total.

/// How many distinct (port, direction, RIP) sites the table keeps.
pub const SITES: usize = 128;

/// One guest instruction's port accesses that left the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortSite {
    /// The port.
    pub port: u16,
    /// An `out` (else an `in`).
    pub out: bool,
    /// The guest RIP of the instruction.
    pub rip: u64,
    /// How many times.
    pub count: u64,
}

/// Port accesses that left the engine, per site.
#[derive(Clone, Copy, Debug)]
pub struct PortExitTable {
    sites: [PortSite; SITES],
    len: usize,
    /// Accesses at sites that found the table full.
    pub unlisted: u64,
    /// All accesses that left the engine.
    pub total: u64,
}

impl Default for PortExitTable {
    fn default() -> Self {
        Self {
            sites: [PortSite::default(); SITES],
            len: 0,
            unlisted: 0,
            total: 0,
        }
    }
}

impl PortExitTable {
    /// Counts one access to `port` (an `out` if `out`) made by the instruction at `rip`.
    pub fn record(&mut self, port: u16, out: bool, rip: u64) {
        self.total += 1;
        let listed = &mut self.sites[..self.len];
        if let Some(s) = listed
            .iter_mut()
            .find(|s| s.port == port && s.out == out && s.rip == rip)
        {
            s.count += 1;
            return;
        }
        match self.sites.get_mut(self.len) {
            Some(s) => {
                *s = PortSite {
                    port,
                    out,
                    rip,
                    count: 1,
                };
                self.len += 1;
            }
            None => self.unlisted += 1,
        }
    }

    /// The sites, in the order first seen.
    pub fn sites(&self) -> &[PortSite] {
        &self.sites[..self.len]
    }

    /// The accesses to ports `ports` (both directions).
    pub fn count_ports(&self, ports: core::ops::RangeInclusive<u16>) -> u64 {
        self.sites()
            .iter()
            .filter(|s| ports.contains(&s.port))
            .map(|s| s.count)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_counts_per_site_and_overflow_apart() {
        let mut t = PortExitTable::default();
        t.record(0x20, true, 0x1000);
        t.record(0x20, true, 0x1000);
        t.record(0x20, false, 0x1000);
        t.record(0x21, true, 0x1000);
        assert_eq!(
            t.sites()[0],
            PortSite {
                port: 0x20,
                out: true,
                rip: 0x1000,
                count: 2
            }
        );
        assert_eq!(t.sites().len(), 3);
        for rip in 0..SITES as u64 {
            t.record(0x61, false, 0x2000 + rip);
        }
        assert_eq!(t.sites().len(), SITES);
        assert_eq!(t.unlisted, 3);
        assert_eq!(t.total, 4 + SITES as u64);
        assert_eq!(t.count_ports(0x20..=0x21), 4);
        t.record(0x61, false, 0x2000);
        assert_eq!(t.count_ports(0x61..=0x61), SITES as u64 - 3 + 1);
    }
}
