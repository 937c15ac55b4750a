//! Running a tool on the host, without a VM (feature `host-run`, for tools' tests): an
//! executable mapping for hand-assembled guest code, guest memory that is that code page
//! identity-mapped, and a [`Sink`] that keeps the files a tool writes in memory. The
//! translator runs the code in the test process itself, as its own host harness does.

extern crate std;

use std::string::{String, ToString};
use std::vec::Vec;

use guest_engine::{GuestMemory, GuestPhys, GuestVirt, Mode};

use crate::host::{Error, Sink};

/// An anonymous read-write-execute mapping of `.1` bytes at `.0`, unmapped on drop.
pub struct Region(pub *mut u8, pub usize);

impl Region {
    /// Maps `len` bytes; panics if the kernel refuses (a test setup failure).
    pub fn map(len: usize) -> Region {
        // SAFETY: an anonymous private mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap failed");
        Region(p.cast(), len)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and nothing uses it any more.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}

/// Guest memory = `.1` bytes of code at host address `.0`, identity-mapped (VA = PA).
pub struct CodePage(pub u64, pub usize);

impl GuestMemory for CodePage {
    fn translate(&mut self, va: GuestVirt, _mode: Mode) -> Option<GuestPhys> {
        (va.0 >= self.0 && va.0 < self.0 + self.1 as u64).then_some(GuestPhys(va.0))
    }
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        if pa.0 < self.0 || pa.0 + out.len() as u64 > self.0 + self.1 as u64 {
            return false;
        }
        // SAFETY: inside the live code mapping (checked above).
        unsafe { core::ptr::copy_nonoverlapping(pa.0 as *const u8, out.as_mut_ptr(), out.len()) };
        true
    }
}

/// The files a tool wrote: (name, bytes, closed), in the order it opened them.
#[derive(Default)]
pub struct Files(pub Vec<(String, Vec<u8>, bool)>);

impl Sink for Files {
    fn open(&mut self, name: &str) -> Result<u16, Error> {
        self.0.push((name.to_string(), Vec::new(), false));
        Ok(self.0.len() as u16)
    }
    fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
        self.0[usize::from(file) - 1].1.extend_from_slice(data);
        Ok(())
    }
    fn close(&mut self, file: u16) -> Result<(), Error> {
        self.0[usize::from(file) - 1].2 = true;
        Ok(())
    }
}
