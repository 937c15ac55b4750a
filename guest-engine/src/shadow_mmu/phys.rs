//! The platform seam of the shadow MMU: guest-physical memory and the frames for shadow
//! tables. The host tests implement it over a map of frames; the in-guest engine over the
//! physmap window (`kpin_abi::stolen::PHYSMAP_VA`) and a frame allocator in the stolen
//! region.
//!
//! Invariant: shadow tables live in guest-physical memory too (the stolen region), so the
//! same `read_u64` / `write_u64` reach guest tables and shadow tables.

use crate::addr::GuestPhys;

/// What the shadow MMU needs from its embedder.
pub trait PhysMem {
    /// Reads the naturally aligned `u64` at `pa`; `None` if `pa` is not backed.
    fn read_u64(&mut self, pa: GuestPhys) -> Option<u64>;
    /// Writes the naturally aligned `u64` at `pa`; `false` if `pa` is not backed.
    ///
    /// Used for shadow entries and for the guest's A/D bits. With one vCPU a plain
    /// store is what hardware does; with several, the embedder must make A/D updates
    /// atomic (override [`PhysMem::or_u64`]).
    fn write_u64(&mut self, pa: GuestPhys, value: u64) -> bool;
    /// Sets `bits` in the `u64` at `pa` (the guest's A/D bits); `false` if not backed.
    fn or_u64(&mut self, pa: GuestPhys, bits: u64) -> bool {
        match self.read_u64(pa) {
            Some(v) => self.write_u64(pa, v | bits),
            None => false,
        }
    }
    /// The first entry of the 512-entry table at `table`, at an index in `from..end`,
    /// whose present bit is set: its index and value; `Ok(None)` if none is; `Err(pa)` if
    /// the entry at `pa` is not backed. For the shadow MMU's own tables (its scans of
    /// mostly empty tables); override where a slice beats one `read_u64` an entry.
    fn next_present(
        &mut self,
        table: GuestPhys,
        from: usize,
        end: usize,
    ) -> Result<Option<(usize, u64)>, GuestPhys> {
        for i in from..end {
            let pa = GuestPhys(table.0 + i as u64 * 8);
            let e = self.read_u64(pa).ok_or(pa)?;
            if e & 1 != 0 {
                return Ok(Some((i, e)));
            }
        }
        Ok(None)
    }
    /// Allocates a zeroed 4 KiB frame for a shadow table; `None` when none is left.
    fn alloc_table(&mut self) -> Option<GuestPhys>;
    /// Returns a frame obtained from [`PhysMem::alloc_table`].
    fn free_table(&mut self, frame: GuestPhys);
    /// Whether the guest may map `frame` (false for the stolen region and anything else
    /// the engine owns). A guest mapping of such a frame is refused, never installed.
    fn guest_may_map(&self, frame: GuestPhys) -> bool {
        let _ = frame;
        true
    }
    /// Whether `frame` is a device (MMIO) frame the guest may map: its shadow leaf then
    /// points at it so that the hardware access reaches the device model beneath (for
    /// the engine: KVM's in-kernel local APIC and IOAPIC, and the VMM's virtio-mmio window
    /// `kpin_abi::mmio`, whose accesses KVM turns into MMIO exits). The engine never reads such a
    /// frame itself, never prefetches it, and never maps it with a large page.
    fn guest_may_map_device(&self, frame: GuestPhys) -> bool {
        let _ = frame;
        false
    }
    /// Whether the guest may map every frame of `[base, base + bytes)` (page aligned);
    /// override with a range check when the default frame-by-frame loop is slow.
    fn guest_may_map_range(&self, base: GuestPhys, bytes: u64) -> bool {
        (0..bytes / 4096).all(|k| self.guest_may_map(GuestPhys(base.0 + k * 4096)))
    }
}
