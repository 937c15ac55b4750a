//! Address newtypes. A `GuestVirt` and a `GuestPhys` never mix; a `CachePc` is an
//! address inside the code cache.

/// A guest virtual address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestVirt(pub u64);

/// A guest physical address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GuestPhys(pub u64);

/// An address inside the code cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct CachePc(pub u64);

/// Size of a guest page in bytes.
pub const PAGE_BYTES: u64 = 4096;

impl GuestVirt {
    /// The page containing this address.
    pub fn page(self) -> GuestVirt {
        GuestVirt(self.0 & !(PAGE_BYTES - 1))
    }
}

impl GuestPhys {
    /// The frame containing this address.
    pub fn page(self) -> GuestPhys {
        GuestPhys(self.0 & !(PAGE_BYTES - 1))
    }
}
