//! The virtual CPU (`guest_engine::vcpu`) on this machine: [`Ring0`] is its
//! [`Hardware`] — port I/O, pass-through MSRs, CR4's SSE bits and `hlt` through the
//! ring-0 gate, the FS/GS bases with `wrfsbase`/`wrgsbase` at CPL 3, the pending-vector
//! bitmap of the interrupt stubs (`events/irq.rs`), the TSC, the engine log — and
//! [`ShadowPort`] its [`GuestMmu`]: guest memory and the shadow MMU (`mm/shadow.rs`,
//! `mm/guest_memory.rs`), shared with the run loop.

use core::cell::RefCell;
use core::fmt;

use guest_engine::shadow_mmu::{PagingControl, ShadowError, View};
use guest_engine::vcpu::uart_status::{COM1, IER};
use guest_engine::vcpu::{
    GuestFault, GuestMmu, Hardware, LineStatusCache, OutRoute, PciConfigCache, PciOut,
    PicMaskCache, PortExitTable,
};
use kpin_abi::pci::ADDRESS_PORT as PCI_ADDRESS;
use kpin_abi::x86::msr;

use crate::events::{irq, timer};
use crate::log;
use crate::mm::guest_memory::{ShadowedMemory, MODE_KERNEL, MODE_USER};
use crate::mm::shadow::Shadow;
use crate::ring0::{gate, log};

/// The virtual CPU of the engine image.
pub type Vcpu<'a> = guest_engine::vcpu::Vcpu<'a, Ring0, ShadowPort<'a>>;

/// The hardware behind the ring-0 gate, and what it knows of the devices behind it.
#[derive(Default)]
pub struct Ring0 {
    /// COM1's line status: a constant once learned, answered without the gate (Linux's
    /// console polls it before every character); its IER, read and written around every
    /// console message.
    pub com1: LineStatusCache,
    /// The PICs' masks (Linux reads the IMR before acknowledging every interrupt).
    pub pic: PicMaskCache,
    /// PCI configuration mechanism 1: the address register kept here, configuration
    /// reads answered from the VMM's model (`kpin_abi::pci`) — Linux's early quirks
    /// and PCI probe read it a few hundred times during boot.
    pub pci: PciConfigCache,
    /// [`probe_null_selector_clears_base`]'s answer.
    pub null_clears_base: bool,
    /// The guest's port accesses that went through the gate, by port and guest RIP.
    pub port_exits: PortExitTable,
    /// The guest RIP of the port instruction being emulated.
    pub site: u64,
    /// The guest RIP of the THR write whose byte `com1` holds.
    pub held_site: u64,
}

impl Ring0 {
    /// A guest `out` through the gate, counted at the current site.
    fn gate_out(&mut self, port: u16, size: u8, value: u32) {
        self.port_exits.record(port, true, self.site);
        gate::out(port, size, value);
    }

    /// Hands the console's batched bytes to the VMM, then the held THR byte, if any, to
    /// the UART (`LineStatusCache::take_held`): before any other device access, a
    /// `hlt`, an interrupt, a detach or the run's last port write.
    pub fn flush_console(&mut self) {
        log::console_flush();
        if let Some(b) = self.com1.take_held() {
            self.send_held(b);
        }
    }

    /// The held THR byte `b` through the gate, counted at its own site.
    fn send_held(&mut self, b: u8) {
        self.port_exits.record(COM1, true, self.held_site);
        gate::out(COM1, 1, u32::from(b));
    }

    /// A guest `in` through the gate, counted at the current site.
    fn gate_in(&mut self, port: u16, size: u8) -> u32 {
        self.port_exits.record(port, false, self.site);
        gate::input(port, size)
    }
}

/// Writes the hardware FS (`fs` true) or GS base: `wrfsbase`/`wrgsbase` when `_start`
/// enabled CR4.FSGSBASE (CPUID 7.EBX[0]), else the gate's WRMSR. Measured at bring-up
/// here: 8 ns per switch against ~64 µs through the gate (a guest kernel `swapgs`es on
/// every entry from user mode).
pub fn set_hw_base(fs: bool, base: u64) {
    // SAFETY: written once by `_start` at ring 0 before any CPL-3 code ran.
    if unsafe { core::ptr::read_volatile(&raw const crate::ring0::entry::kpin_fsgsbase) } != 0 {
        // SAFETY: CR4.FSGSBASE is set, so these are allowed at CPL 3; the engine uses
        // neither FS nor GS (no TLS, the ring-0 stubs never `swapgs`); `base` is
        // canonical (checked by every caller), so they cannot fault.
        unsafe {
            if fs {
                core::arch::asm!("wrfsbase {}", in(reg) base, options(nostack, preserves_flags));
            } else {
                core::arch::asm!("wrgsbase {}", in(reg) base, options(nostack, preserves_flags));
            }
        }
        return;
    }
    let i = if fs { msr::FS_BASE } else { msr::GS_BASE };
    // SAFETY: as above, the bases belong to the guest; a canonical value cannot fault
    // the ring-0 WRMSR.
    unsafe { gate::wrmsr(i, base) };
}

/// Reads the hardware FS base (`rdfsbase`, else the gate's RDMSR).
fn hw_fs_base() -> u64 {
    // SAFETY: written once by `_start` at ring 0 before any CPL-3 code ran.
    if unsafe { core::ptr::read_volatile(&raw const crate::ring0::entry::kpin_fsgsbase) } != 0 {
        let v: u64;
        // SAFETY: CR4.FSGSBASE is set, so `rdfsbase` is allowed at CPL 3; it only reads.
        unsafe { core::arch::asm!("rdfsbase {}", out(reg) v, options(nostack, preserves_flags)) };
        return v;
    }
    gate::rdmsr(msr::FS_BASE)
}

/// Whether this CPU zeroes FS's base when a null selector is loaded, measured: an AMD
/// CPU may do it without saying so in CPUID (the AMD host here does, with
/// NullSelectClearsBase hidden). The FS base is the guest's afterwards (the caller
/// sets it); the engine itself uses neither FS nor GS.
pub fn probe_null_selector_clears_base() -> bool {
    set_hw_base(true, 0x1000);
    // SAFETY: loading the null selector into FS is allowed at any CPL and cannot fault;
    // the engine has no TLS, so FS's selector and base are free to change.
    unsafe { core::arch::asm!("mov fs, {0:x}", in(reg) 0u16, options(nostack, preserves_flags)) };
    hw_fs_base() == 0
}

impl Hardware for Ring0 {
    fn port_out(&mut self, port: u16, size: u8, value: u32) {
        let pci_latch = match self.pci.out(port, size, value) {
            PciOut::Absorb => return,
            PciOut::Device { latch_first } => latch_first,
        };
        self.pic.write(port, size, value);
        match self.com1.out(port, size, value) {
            OutRoute::BatchThr => log::console_byte(value as u8),
            OutRoute::Hold { release } => {
                if let Some(b) = release {
                    log::console_byte(b);
                }
                self.held_site = self.site;
            }
            OutRoute::Absorb => {}
            OutRoute::Device {
                thr_first,
                ier_first,
            } => {
                // The UART sees the batched bytes, the held one and the guest's IER
                // before anything the guest does next.
                log::console_flush();
                if let Some(b) = thr_first {
                    self.send_held(b);
                }
                if let Some(ier) = ier_first {
                    self.gate_out(IER, 1, u32::from(ier));
                }
                // The PCI model holds the guest's address before a data write.
                if let Some(latch) = pci_latch {
                    self.gate_out(PCI_ADDRESS, 4, latch);
                }
                self.gate_out(port, size, value);
            }
        }
    }

    fn port_in(&mut self, port: u16, size: u8) -> u32 {
        if let Some(v) = self.com1.answer(port, size) {
            return v;
        }
        if let Some(v) = self.pic.answer(port, size) {
            return v;
        }
        // A PCI read the cache cannot answer finds the latch unknown, so nothing to write
        // back (`pci_config.rs`).
        if let Some(v) = self.pci.answer(port, size) {
            return v;
        }
        log::console_flush();
        let (thr, ier) = self.com1.before_device_read(port, size);
        if let Some(b) = thr {
            self.send_held(b);
        }
        if let Some(ier) = ier {
            self.gate_out(IER, 1, u32::from(ier));
        }
        let v = self.gate_in(port, size);
        self.com1.read_done(port, size, v);
        self.pic.read_done(port, size, v);
        self.pci.read_done(port, size, v);
        v
    }

    fn port_site(&mut self, rip: u64) {
        self.site = rip;
    }

    fn rdmsr_passthrough(&mut self, index: u32) -> u64 {
        gate::rdmsr(index)
    }

    fn rdmsr_safe(&mut self, index: u32) -> Option<u64> {
        gate::rdmsr_safe(index)
    }

    fn wrmsr_passthrough(&mut self, index: u32, value: u64) {
        // SAFETY: the virtual CPU passes through only MSRs whose effect is the guest's
        // (`MsrFile::passes_through`: microcode signature, the local APIC the engine does
        // not use — APIC_BASE cannot move —, kvm-clock pages in guest-physical memory).
        unsafe { gate::wrmsr(index, value) };
    }

    fn set_cr4_sse(&mut self, cr4: u64) {
        gate::cr4_sse(cr4);
    }

    fn set_hw_base(&mut self, fs: bool, base: u64) {
        set_hw_base(fs, base);
    }

    fn null_selector_clears_base(&self) -> Option<bool> {
        Some(self.null_clears_base)
    }

    fn halt(&mut self) {
        self.flush_console();
        gate::hlt();
    }

    fn pending_highest(&self) -> Option<u8> {
        irq::highest()
    }

    fn take_pending(&mut self, vector: u8) {
        irq::take(vector);
    }

    fn rearm_attention(&mut self) {
        irq::rearm_if_pending();
    }

    fn tsc(&mut self) -> u64 {
        timer::tsc()
    }

    fn control_requested(&self) -> bool {
        // SAFETY: a u64 `irq::hand_over` stored before the guest ran.
        let at =
            unsafe { core::ptr::read_volatile(&raw const crate::ring0::entry::kpin_attention_at) };
        crate::run::detach::wants_loop(at)
    }

    fn log(&mut self, line: fmt::Arguments<'_>) {
        log!(Info, "{line}");
    }
}

/// Guest memory and the shadow MMU, shared with the run loop (every method borrows the
/// shadow only for its own duration).
pub struct ShadowPort<'a> {
    shadow: &'a RefCell<Shadow>,
}

impl<'a> ShadowPort<'a> {
    /// The virtual CPU's view of `shadow`.
    pub fn new(shadow: &'a RefCell<Shadow>) -> Self {
        Self { shadow }
    }

    fn mem(&self) -> ShadowedMemory<'a> {
        ShadowedMemory::new(self.shadow)
    }
}

fn mode(user: bool) -> guest_engine::Mode {
    if user {
        MODE_USER
    } else {
        MODE_KERNEL
    }
}

impl GuestMmu for ShadowPort<'_> {
    fn read(&mut self, va: u64, user: bool, out: &mut [u8]) -> Result<(), GuestFault> {
        self.mem().try_read_virt(va, mode(user), out)
    }

    fn write(&mut self, va: u64, user: bool, data: &[u8]) -> Result<(), GuestFault> {
        self.mem().try_write_virt(va, mode(user), data)
    }

    fn observe(&mut self, va: u64, out: &mut [u8]) -> bool {
        self.mem().observe_virt(va, MODE_KERNEL, out)
    }

    fn cr3(&self) -> u64 {
        self.shadow.borrow().cr3()
    }

    fn write_cr3(&mut self, cr3: u64) -> Result<(), ShadowError> {
        self.shadow.borrow_mut().write_cr3(cr3)
    }

    fn invlpg(&mut self, va: u64) -> Result<(), ShadowError> {
        self.shadow.borrow_mut().invlpg(va)
    }

    fn set_paging_control(&mut self, control: PagingControl) -> Result<(), ShadowError> {
        self.shadow.borrow_mut().set_control(control)
    }

    fn enter_view(&mut self, view: View) -> Result<(), ShadowError> {
        self.shadow.borrow_mut().enter(view)
    }

    fn record_failure(&mut self, e: ShadowError) {
        self.shadow.borrow_mut().record(e);
    }

    fn failed(&self) -> bool {
        self.shadow.borrow().failure().is_some()
    }

    fn has_work(&self) -> bool {
        self.shadow.borrow().has_work()
    }
}
