//! The seam through which sensitive instructions are emulated.
//!
//! A *sensitive* instruction is privileged or observably mode-dependent: its verbatim
//! execution at hardware CPL 3 inside the code cache would not mean what it means to the
//! guest. The translator never copies one; it ends the trace before it with a
//! `SENSITIVE` exit, and the dispatcher hands it to the [`Platform`].

use crate::addr::{GuestPhys, GuestVirt};
use crate::context::GuestRegs;
use crate::guest_memory::Mode;
use crate::instrument::SegBase;
use crate::layout::MAX_INSN_BYTES;

/// Which sensitive construct an instruction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SensitiveKind {
    /// `cli` / `sti`.
    InterruptFlag,
    /// `pushf` / `popf`.
    Flags,
    /// `iret*`, far `ret`, far `jmp`/`call`.
    FarTransfer,
    /// `syscall` / `sysret` / `sysenter` / `sysexit`.
    SystemCall,
    /// `swapgs`, `rd/wr{fs,gs}base`.
    SegmentBase,
    /// `mov` to/from CR, `smsw`, `lmsw`, `clts`.
    ControlRegister,
    /// `mov` to/from DR.
    DebugRegister,
    /// `mov` to/from a segment register, `push`/`pop` of one, `lss`/`lfs`/`lgs`.
    SegmentRegister,
    /// `lgdt lidt ltr lldt sgdt sidt sldt str`.
    DescriptorTable,
    /// `lar lsl verr verw`.
    SegmentQuery,
    /// `rdmsr` / `wrmsr`.
    Msr,
    /// `in out ins outs`.
    PortIo,
    /// `hlt`, `mwait`, `monitor`.
    Halt,
    /// `invlpg`, `invpcid`, `invd`, `wbinvd`.
    TlbOrCache,
    /// `cpuid`.
    Cpuid,
    /// `int n`, `int3`, `into`, `int1`.
    SoftwareInterrupt,
    /// `ud0 ud1 ud2`, or bytes that do not decode.
    Undefined,
    /// `xgetbv` / `xsetbv`.
    ExtendedControl,
    /// `rdpkru` / `wrpkru`.
    ProtectionKeys,
    /// `rdtscp`, `rdpid`, `rdpmc` (read guest-visible per-CPU values).
    Timestamp,
    /// Anything else the translator refuses to run verbatim (e.g. TSX, VMX).
    Other,
}

impl SensitiveKind {
    /// How many kinds there are (per-kind counters index by `kind as usize`).
    pub const COUNT: usize = SensitiveKind::Other as usize + 1;
}

/// A sensitive instruction reached by the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SensitiveInsn {
    /// Guest address of the instruction.
    pub pc: GuestVirt,
    /// Length in bytes (0 if the bytes do not decode).
    pub len: u8,
    /// The instruction bytes (first `len` valid).
    pub bytes: [u8; MAX_INSN_BYTES],
    /// Classification.
    pub kind: SensitiveKind,
}

/// What the platform did with a sensitive instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emulation {
    /// Emulated; continue at `next` with the (possibly updated) registers.
    Continue(GuestVirt),
    /// Emulated, and it changed what translations assume (`syscall`/`sysret`/`iretq`
    /// changing the virtual CPL, a CR3 write): continue at `next` in `mode` (as
    /// `Engine::set_mode`), after dropping every VA → PA assumption if
    /// `invalidate_mappings` (as `Engine::invalidate_all_mappings`). An unknown mode stops
    /// the run with `EngineError::UnknownMode`.
    Switch {
        /// Where the guest continues.
        next: GuestVirt,
        /// The translation mode from now on.
        mode: Mode,
        /// The guest's VA → PA mappings changed (CR3 write).
        invalidate_mappings: bool,
    },
    /// Not emulated: stop running and report the instruction.
    Stop,
}

/// Emulation of sensitive instructions (host harness: host emulation or a clear stop;
/// engine: its virtual CPU).
pub trait Platform {
    /// Emulates `insn` against `regs`.
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation;

    /// The guest's current FS or GS base (for effective addresses of analysis-call
    /// arguments); 0 for flat segments.
    fn segment_base(&mut self, seg: SegBase) -> u64 {
        let _ = seg;
        0
    }

    /// With `Config::inline_virtual_flags`: the virtual IF and IOPL as translated code
    /// left them, handed over before every emulation.
    fn set_virtual_flags(&mut self, vif: bool, iopl: u8) {
        let _ = (vif, iopl);
    }

    /// With `Config::inline_virtual_flags`: the virtual IF and IOPL after an emulation,
    /// for translated code (`None`: unchanged).
    fn virtual_flags(&self) -> Option<(bool, u8)> {
        None
    }

    /// With `Config::inline_virtual_flags`: the guest's segment selectors (ES, CS, SS, DS,
    /// FS, GS) after an emulation, for translated code (`None`: unchanged).
    fn selectors(&self) -> Option<[u16; 6]> {
        None
    }

    /// The engine translated a trace of user-mode (CPL 3) code at `va`, physical `pa`
    /// (the task watch records where that code came from: `crate::tasks`).
    fn user_code(&mut self, va: GuestVirt, pa: GuestPhys) {
        let _ = (va, pa);
    }

    /// After an emulation: the row of the task that runs from now on, if the running task
    /// changed (the task watch's `take_switch`), for the tool's `access::TASK` record.
    fn take_task_switch(&mut self) -> Option<u64> {
        None
    }
}

/// A platform that emulates nothing: every sensitive instruction stops the run.
#[derive(Debug, Default)]
pub struct StopPlatform;

impl Platform for StopPlatform {
    fn emulate(&mut self, _insn: &SensitiveInsn, _regs: &mut GuestRegs) -> Emulation {
        Emulation::Stop
    }
}
