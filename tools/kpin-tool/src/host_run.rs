//! Running a tool on the host, without a VM (feature `host-run`, for tools' tests): an
//! executable mapping for hand-assembled guest code, guest memory that is that code page
//! identity-mapped, a [`Sink`] that keeps the files a tool writes in memory, and the
//! tools' common test program ([`run_store_reload_loop`]). The translator runs the code
//! in the test process itself, as its own host harness does.

extern crate std;

use std::string::{String, ToString};
use std::vec::Vec;

use guest_engine::instrument::Tool;
use guest_engine::{
    Config, Engine, Gpr, GuestMemory, GuestPhys, GuestVirt, Mode, Stop, StopPlatform,
};

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

/// Quadwords the store/reload loop writes and reads back.
pub const STORE_RELOAD_ITERATIONS: u64 = 100;
/// Where the loop jumps when done: not in guest memory, so the fetch there ends the run.
pub const STORE_RELOAD_EXIT: u64 = 0x1000;

/// An engine after [`run_store_reload_loop`]; the mappings it ran in live as long as the
/// value. Keep it whole: destructuring it with `..` drops (unmaps) them at once.
pub struct StoreReloadRun {
    /// The engine (counting instructions per mode), for the tool's `finish`.
    pub engine: Engine,
    /// The guest address of the loop's first instruction (its data page follows).
    pub base: u64,
    _cache: Region,
    _code: Region,
}

/// Runs `mov ecx, 100; l: mov [rdi+rcx*8], rcx; add rax, [rdi+rcx*8]; dec ecx; jnz l;
/// jmp [STORE_RELOAD_EXIT]` (RDI = the page after the code) under `tool`, first as
/// kernel code, then as user code, and checks that each run reached the exit with RAX
/// the sum of 1..=100.
pub fn run_store_reload_loop(tool: &mut dyn Tool) -> StoreReloadRun {
    let code = Region::map(8192);
    #[rustfmt::skip]
    let mut bytes = std::vec![
        0xb9, STORE_RELOAD_ITERATIONS as u8, 0, 0, 0, // mov ecx, 100
        0x48, 0x89, 0x0c, 0xcf, // l: mov [rdi + rcx*8], rcx
        0x48, 0x03, 0x04, 0xcf, // add rax, [rdi + rcx*8]
        0xff, 0xc9, // dec ecx
        0x75, 0xf4, // jnz l
        0xff, 0x25, 0, 0, 0, 0, // jmp [rip + 0]
    ];
    bytes.extend_from_slice(&STORE_RELOAD_EXIT.to_le_bytes());
    // SAFETY: the mapping is 8192 bytes, writable, and nothing runs in it yet.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), code.0, bytes.len()) };
    let cache = Region::map(32 << 20);
    let config = Config {
        save_extended_state: true,
        count_insns: true,
        ..Config::default()
    };
    // SAFETY: `cache` is an RWX, page-aligned mapping smaller than 2 GiB that the returned
    // run owns, and it drops the engine first.
    let mut engine = unsafe { Engine::new(cache.0, cache.1, config) }.expect("engine");
    let base = code.0 as u64;
    for mode in [Mode::KERNEL, Mode::USER] {
        engine.set_mode(mode).expect("mode");
        engine.set_rip(GuestVirt(base));
        engine.regs_mut().set(Gpr::Rax, 0);
        engine.regs_mut().set(Gpr::Rdi, base + 4096);
        let stop = engine.run(&mut CodePage(base, 8192), &mut StopPlatform, tool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(STORE_RELOAD_EXIT)));
        let n = STORE_RELOAD_ITERATIONS;
        assert_eq!(engine.regs().get(Gpr::Rax), n * (n + 1) / 2);
    }
    StoreReloadRun {
        engine,
        base,
        _cache: cache,
        _code: code,
    }
}
