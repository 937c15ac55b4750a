//! Guest memory as the engine reaches it, through the shadow MMU (`mm/shadow.rs`):
//!
//! * `guest_engine::GuestMemory` for the translator: instruction-fetch translation by the
//!   shadow MMU's walk (A bits set as hardware would), and code bytes read from the
//!   physmap — every frame read is write-protected, so a later write to it (through any
//!   alias) invalidates its traces;
//! * guest virtual reads and writes for emulated instructions (`try_read_virt`/
//!   `try_write_virt`, which say which fault the guest would take; the virtual CPU's
//!   `GuestMmu` in `run/vcpu.rs` goes through them), walked for the virtual CPL's view
//!   with A/D bits and permissions as hardware would; a write into a code frame lists the
//!   frame for trace invalidation first.
//!
//! [`ShadowedMemory`] reads the bytes through the physmap, but every address goes through
//! the shadow MMU's walk of the guest's page tables first. Only guest memory the e820 map
//! lists (RAM or reserved) is reached; anything else (the stolen region, MMIO) is refused
//! by the shadow MMU as an engine failure, never read.

use core::cell::RefCell;

use guest_engine::shadow_mmu::{Access, GuestFault, View};
use guest_engine::{GuestMemory, GuestPhys, GuestVirt, Mode};

use crate::mm::shadow::Shadow;

const PAGE: u64 = 4096;

pub use guest_engine::vcpu::{MODE_KERNEL, MODE_USER};

/// The shadow view of translation mode `mode`.
pub fn view_of(mode: Mode) -> View {
    if mode.cpl() == 3 {
        View::User
    } else {
        View::Kernel
    }
}

/// Guest memory through the shadow MMU (shared with the virtual CPU and the run loop;
/// every method borrows it only for its own duration).
pub struct ShadowedMemory<'a> {
    shadow: &'a RefCell<Shadow>,
}

impl<'a> ShadowedMemory<'a> {
    /// Guest memory through `shadow`.
    pub fn new(shadow: &'a RefCell<Shadow>) -> Self {
        Self { shadow }
    }

    /// Reads guest virtual memory as a data read in `mode`; `false` if the guest would
    /// fault (see [`ShadowedMemory::try_read_virt`]).
    pub fn read_virt(&self, va: u64, mode: Mode, out: &mut [u8]) -> bool {
        self.try_read_virt(va, mode, out).is_ok()
    }

    /// Reads guest virtual memory as a data read in `mode` (`MODE_KERNEL` also for the
    /// CPU's implicit supervisor accesses, e.g. descriptor-table reads), or the fault the
    /// guest would take: a #PF with its error code and CR2, or #GP(0) for a non-canonical
    /// address (SS-relative callers make that #SS(0)). On an engine failure (recorded in
    /// the shadow) the answer is a #PF the run never delivers: it stops first.
    pub fn try_read_virt(&self, va: u64, mode: Mode, out: &mut [u8]) -> Result<(), GuestFault> {
        self.read_pages(va, mode, out, true)
    }

    /// Reads guest virtual memory for an observer (the task watch, `guest_engine::tasks`)
    /// as [`ShadowedMemory::try_read_virt`] does, except that a frame the engine cannot
    /// read (a device page the guest mapped) is only `false`, not an engine failure: what
    /// the engine merely looks at never ends the run.
    pub fn observe_virt(&self, va: u64, mode: Mode, out: &mut [u8]) -> bool {
        self.read_pages(va, mode, out, false).is_ok()
    }

    /// The reads of both: `forbidden_fails` records a frame outside guest RAM as an engine
    /// failure.
    fn read_pages(
        &self,
        va: u64,
        mode: Mode,
        out: &mut [u8],
        forbidden_fails: bool,
    ) -> Result<(), GuestFault> {
        let mut sh = self.shadow.borrow_mut();
        let mut done = 0;
        while done < out.len() {
            let at = va.wrapping_add(done as u64);
            let n = (out.len() - done).min((PAGE - (at & (PAGE - 1))) as usize);
            let pa = sh.access(at, Access::Read, view_of(mode))?;
            let Some(src) = sh.mem().guest_ptr(pa.0, n) else {
                if forbidden_fails {
                    sh.record(guest_engine::shadow_mmu::ShadowError::ForbiddenFrame {
                        va: GuestVirt(at),
                        frame: pa.page(),
                    });
                }
                return Err(GuestFault::page_fault(GuestVirt(at), 0));
            };
            // SAFETY: `src..src+n` is guest RAM in the physmap (checked just above).
            let bytes = unsafe { core::slice::from_raw_parts(src, n) };
            out[done..done + n].copy_from_slice(bytes);
            done += n;
        }
        Ok(())
    }

    /// Writes guest virtual memory as a data write in `mode`, or answers the fault the
    /// guest would take (as [`ShadowedMemory::try_read_virt`]); every page is checked
    /// (and its A/D bits set) before any byte is written. A code frame written is
    /// unprotected and listed for trace invalidation (`Shadow::take_work`): the caller's
    /// run loop invalidates before guest code runs again.
    pub fn try_write_virt(&self, va: u64, mode: Mode, data: &[u8]) -> Result<(), GuestFault> {
        let mut sh = self.shadow.borrow_mut();
        let mut pages: alloc::vec::Vec<(*mut u8, usize)> = alloc::vec::Vec::new();
        let mut done = 0;
        while done < data.len() {
            let at = va.wrapping_add(done as u64);
            let n = (data.len() - done).min((PAGE - (at & (PAGE - 1))) as usize);
            let pa = sh.access(at, Access::Write, view_of(mode))?;
            let Some(dst) = sh.mem().guest_ptr(pa.0, n) else {
                sh.record(guest_engine::shadow_mmu::ShadowError::ForbiddenFrame {
                    va: GuestVirt(at),
                    frame: pa.page(),
                });
                return Err(GuestFault::page_fault(GuestVirt(at), 0));
            };
            if sh.is_code_frame(pa) {
                if let Err(e) = sh.code_frame_written(pa) {
                    sh.record(e);
                    return Err(GuestFault::page_fault(GuestVirt(at), 0));
                }
            }
            pages.push((dst, n));
            done += n;
        }
        let mut from = 0;
        for (dst, n) in pages {
            // SAFETY: `dst..dst+n` is guest RAM in the physmap (checked above).
            unsafe { core::ptr::copy_nonoverlapping(data[from..].as_ptr(), dst, n) };
            from += n;
        }
        Ok(())
    }

    /// Reads up to `out.len()` guest code bytes at `va` for `mode` without protecting
    /// them (for decoding one instruction outside the translator); returns how many
    /// bytes could be fetched.
    pub fn peek_code(&self, va: u64, mode: Mode, out: &mut [u8]) -> usize {
        let mut sh = self.shadow.borrow_mut();
        let mut done = 0;
        while done < out.len() {
            let at = va.wrapping_add(done as u64);
            let n = (out.len() - done).min((PAGE - (at & (PAGE - 1))) as usize);
            let Ok(pa) = sh.access(at, Access::Fetch, view_of(mode)) else {
                break;
            };
            let Some(src) = sh.mem().guest_ptr(pa.0, n) else {
                break;
            };
            // SAFETY: guest RAM in the physmap (checked just above).
            out[done..done + n].copy_from_slice(unsafe { core::slice::from_raw_parts(src, n) });
            done += n;
        }
        done
    }
}

impl GuestMemory for ShadowedMemory<'_> {
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        self.shadow
            .borrow_mut()
            .access(va.0, Access::Fetch, view_of(mode))
            .ok()
    }

    fn translate_global(&mut self, va: GuestVirt, mode: Mode) -> Option<(GuestPhys, bool)> {
        let mut sh = self.shadow.borrow_mut();
        let pa = sh.access(va.0, Access::Fetch, view_of(mode)).ok()?;
        Some((pa, sh.is_global(va.0, view_of(mode))))
    }

    fn translate_data(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        self.shadow
            .borrow_mut()
            .access(va.0, Access::Read, view_of(mode))
            .ok()
    }

    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        let mut sh = self.shadow.borrow_mut();
        let Some(src) = sh.mem().guest_ptr(pa.0, out.len()) else {
            return false;
        };
        // The translator reads guest memory only to translate it: protect it first, so
        // that no write can slip in between.
        if let Err(e) = sh.protect_code(pa, out.len()) {
            sh.record(e);
            return false;
        }
        // SAFETY: the whole range is guest RAM in the physmap (checked above).
        out.copy_from_slice(unsafe { core::slice::from_raw_parts(src, out.len()) });
        true
    }
}
