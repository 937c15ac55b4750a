//! Host harness shared by the integration tests: mmap'ed regions, a `GuestMemory` over
//! the test process's own address space, and a platform that emulates `cpuid`.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use guest_engine::native::NativeRunner;
use guest_engine::{
    Config, Emulation, Engine, Gpr, GuestMemory, GuestPhys, GuestRegs, GuestVirt, Mode, Platform,
    SensitiveInsn, SensitiveKind,
};

pub mod corpus;
pub mod diff;
pub mod fault_redirect;
pub mod gen;
pub mod ptrace;
pub mod tools;

/// An anonymous RWX mapping.
pub struct Region {
    pub ptr: *mut u8,
    pub len: usize,
}

static NEXT_CACHE_HINT: AtomicU64 = AtomicU64::new(0x3000_0000_0000);

impl Region {
    pub fn map(len: usize, hint: u64) -> Region {
        // SAFETY: anonymous private mapping; the hint is only a hint.
        let p = unsafe {
            libc::mmap(
                hint as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap failed");
        Region { ptr: p.cast(), len }
    }

    /// A code-cache region placed far (> 2 GiB) from everything else.
    pub fn map_cache(len: usize) -> Region {
        let hint = NEXT_CACHE_HINT.fetch_add(0x1_0000_0000, Ordering::Relaxed);
        let r = Region::map(len, hint);
        let text = map_far_check as *const () as u64;
        assert!(
            (r.ptr as u64).abs_diff(text) > (4u64 << 30),
            "cache too close to code"
        );
        r
    }

    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The mapping as bytes (a raw mapping shared with generated code, hence `&self`).
    #[allow(clippy::mut_from_ref)]
    pub fn slice(&self) -> &mut [u8] {
        // SAFETY: the mapping is owned and live.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

fn map_far_check() {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: we own the mapping.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Guest memory = the host's own address space, identity VA → PA, restricted to ranges.
pub struct HostMemory {
    pub ranges: Vec<(u64, u64)>,
}

impl HostMemory {
    pub fn new(ranges: Vec<(u64, u64)>) -> Self {
        Self { ranges }
    }

    /// Every executable mapping of this process (from /proc/self/maps).
    pub fn executable_mappings() -> Self {
        let maps = std::fs::read_to_string("/proc/self/maps").expect("read maps");
        let mut ranges = Vec::new();
        for l in maps.lines() {
            let mut it = l.split_whitespace();
            let (Some(r), Some(p)) = (it.next(), it.next()) else {
                continue;
            };
            if p != "r-xp" {
                continue;
            }
            let (a, b) = r.split_once('-').expect("range");
            ranges.push((
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            ));
        }
        Self { ranges }
    }

    fn contains(&self, a: u64) -> bool {
        self.ranges.iter().any(|&(s, e)| a >= s && a < e)
    }
}

impl GuestMemory for HostMemory {
    fn translate(&mut self, va: GuestVirt, _mode: Mode) -> Option<GuestPhys> {
        self.contains(va.0).then_some(GuestPhys(va.0))
    }
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        if out.is_empty() {
            return true;
        }
        if !self.contains(pa.0) || !self.contains(pa.0 + out.len() as u64 - 1) {
            return false;
        }
        // SAFETY: the range is mapped (checked against the allowed ranges).
        unsafe { std::ptr::copy_nonoverlapping(pa.0 as *const u8, out.as_mut_ptr(), out.len()) };
        true
    }
}

/// [`HostMemory`] except one page, `page`, mapped to another frame of this process,
/// `frame` (0: none): the guest remapped it.
pub struct Remapped {
    pub inner: HostMemory,
    pub page: u64,
    pub frame: u64,
}

impl GuestMemory for Remapped {
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        if self.frame != 0 && va.page().0 == self.page {
            return Some(GuestPhys(self.frame + (va.0 - self.page)));
        }
        self.inner.translate(va, mode)
    }
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        if self.frame != 0 && pa.page().0 == self.frame {
            // SAFETY: the frame is a live page of this process (a `Region`).
            unsafe {
                std::ptr::copy_nonoverlapping(pa.0 as *const u8, out.as_mut_ptr(), out.len())
            };
            return true;
        }
        self.inner.read(pa, out)
    }
}

/// Emulates `cpuid` on the host; everything else stops.
#[derive(Default)]
pub struct HostPlatform {
    pub emulated: u64,
}

impl Platform for HostPlatform {
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
        match insn.kind {
            SensitiveKind::Cpuid => {
                let r = std::arch::x86_64::__cpuid_count(
                    regs.get(Gpr::Rax) as u32,
                    regs.get(Gpr::Rcx) as u32,
                );
                regs.set(Gpr::Rax, u64::from(r.eax));
                regs.set(Gpr::Rbx, u64::from(r.ebx));
                regs.set(Gpr::Rcx, u64::from(r.ecx));
                regs.set(Gpr::Rdx, u64::from(r.edx));
                self.emulated += 1;
                Emulation::Continue(GuestVirt(insn.pc.0 + u64::from(insn.len)))
            }
            _ => Emulation::Stop,
        }
    }

    fn segment_base(&mut self, seg: guest_engine::instrument::SegBase) -> u64 {
        use guest_engine::instrument::SegBase;
        let v: u64;
        // SAFETY: rdfsbase/rdgsbase only read the base; the kernel enables FSGSBASE.
        unsafe {
            match seg {
                SegBase::Flat => return 0,
                SegBase::Fs => std::arch::asm!("rdfsbase {}", out(reg) v),
                SegBase::Gs => std::arch::asm!("rdgsbase {}", out(reg) v),
            }
        }
        v
    }
}

pub const CACHE_BYTES: usize = 32 << 20;

/// Status flags + DF.
pub const FLAGS_MASK: u64 = 0xCD5;

/// An engine over a fresh far-away cache region.
pub struct Rig {
    pub cache: Region,
    pub engine: Engine,
    pub native_region: Region,
    pub native: NativeRunner,
}

pub fn now_ns() -> u64 {
    use std::time::Instant;
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

impl Rig {
    pub fn new(config: Config) -> Rig {
        Self::with_cache_bytes(config, CACHE_BYTES)
    }

    pub fn with_cache_bytes(config: Config, bytes: usize) -> Rig {
        let cache = Region::map_cache(bytes);
        let config = Config {
            save_extended_state: true,
            clock_ns: Some(now_ns),
            ..config
        };
        // SAFETY: the region is a fresh RWX mapping owned by the rig.
        let engine = unsafe { Engine::new(cache.ptr, cache.len, config) }.expect("engine");
        let native_region = Region::map(NativeRunner::REGION_BYTES, 0);
        // SAFETY: fresh RWX mapping owned by the rig.
        let native = unsafe { NativeRunner::new(native_region.ptr, native_region.len, true) }
            .expect("native");
        Rig {
            cache,
            engine,
            native_region,
            native,
        }
    }
}

/// Prints a line that shows in `cargo test` output even when the test passes (libtest
/// captures `print!`; this writes to file descriptor 2 directly).
pub fn report(line: &str) {
    let s = format!("{line}\n");
    // SAFETY: writing a valid buffer to stderr.
    unsafe { libc::write(2, s.as_ptr().cast(), s.len()) };
}
