//! The lists `tests/linux_cpu_conformance.rs` judges the corpus with: where the reference
//! is not the host ([`QEMU_REFERENCE`], [`ARCHITECTURAL`]) and every difference it
//! accepts ([`ALLOWED`]), each with its reason. Patterns are `<bits> <case>[|<case>...]`
//! (bits `64`, `32` or `*`; `*` and `?` wildcards in case names), for every uid.
//!
//! Keep this honest: an engine gap whose cases all match the reference again fails the
//! test until its entry is removed here.

/// Cases whose reference is QEMU TCG booting the guest's kernel and initramfs: the host's
/// kernel differs from the guest's. CPUID fields are not compared for them.
pub const QEMU_REFERENCE: &[(&str, &str)] = &[
    (
        "* iopl*",
        "this host's kernel is built without CONFIG_X86_IOPL_IOPERM (iopl fails with \
         ENOSYS); the guest's Debian kernel has it, and fakes cli/sti for iopl(3)",
    ),
    (
        "* ioperm*",
        "as iopl: no CONFIG_X86_IOPL_IOPERM on this host",
    ),
    (
        "64 exec-vsyscall",
        "the host kernel emulates the vsyscall page (LEGACY_VSYSCALL_XONLY); the guest's \
         has vsyscall=none",
    ),
    (
        "* ldt-*16*",
        "16-bit segments: the host kernel has CONFIG_X86_16BIT, the guest's cloud kernel \
         does not (modify_ldt refuses them)",
    ),
    (
        "* vmrun|vmload|vmsave|stgi|clgi|skinit|invlpga",
        "the host kernel runs KVM (EFER.SVME=1: SVM instructions #GP at CPL 3); the \
         guest's kernel does not enable SVM (#UD)",
    ),
];

/// Cases whose reference is the architecture: (pattern, outcome, why).
pub const ARCHITECTURAL: &[(&str, &str, &str)] = &[(
    "* int1-icebp",
    "sig SIGTRAP code=1 addr=insn+1 at=insn+1 trap=1 err=0",
    "INT1 is a trap (SDM, APM: RIP after the instruction); this host's hypervisor \
     reports it at the instruction, and QEMU 7.2 TCG raises #UD",
)];

/// What an allowed difference is.
#[derive(Debug)]
pub enum Kind {
    /// The guest's CPU model lacks a feature the host has (or has neither, yet the host
    /// CPU behaves otherwise): the guest's outcome, without its CPUID fields or from its
    /// verdict on, starts with `guest`; with `feature`, the `cpuid.<feature>=` field
    /// differs.
    CpuModel {
        /// The `cpuid.<feature>=` field whose value must differ, if any.
        feature: Option<&'static str>,
        /// How the guest's outcome, without CPUID fields, starts.
        guest: &'static str,
    },
    /// The engine does not give the CPU's outcome yet. `stops_run`: the case ends or
    /// hangs the whole run, so the main runs skip it.
    EngineGap {
        /// The case ends or hangs the run.
        stops_run: bool,
    },
}

/// An allowed difference: the cases (`<bits> <case>[|<case>...]`, `*` and `?`
/// wildcards), why, and its kind.
#[derive(Debug)]
pub struct Allowed {
    /// The cases it covers.
    pub cases: &'static str,
    /// What kind of difference.
    pub kind: Kind,
    /// Why the difference exists.
    pub why: &'static str,
}

const fn model(
    cases: &'static str,
    feature: &'static str,
    guest: &'static str,
    why: &'static str,
) -> Allowed {
    Allowed {
        cases,
        kind: Kind::CpuModel {
            feature: Some(feature),
            guest,
        },
        why,
    }
}

const fn gap(cases: &'static str, why: &'static str) -> Allowed {
    Allowed {
        cases,
        kind: Kind::EngineGap { stops_run: false },
        why,
    }
}

/// A gap that ends or hangs the run (none listed at the moment).
#[allow(dead_code)]
const fn stops(cases: &'static str, why: &'static str) -> Allowed {
    Allowed {
        cases,
        kind: Kind::EngineGap { stops_run: true },
        why,
    }
}

const NO_XSAVE: &str = "the VMM hides XSAVE/OSXSAVE (KVM's emulator fails on xrstor at \
                        ring 0): with CR4.OSXSAVE clear these raise #UD";
const NO_FSGSBASE: &str = "this host's KVM offers no FSGSBASE to its guests: the guest \
                           kernel leaves CR4.FSGSBASE clear, rd/wr{fs,gs}base raise #UD";

/// Every difference the test accepts, with its reason.
pub const ALLOWED: &[Allowed] = &[
    // (a) The CPU model kpin exposes (the host KVM's CPUID minus vmm's MASKED_FEATURES).
    model("* xgetbv-*", "osxsave", "sig SIGILL", NO_XSAVE),
    model("* xsetbv", "osxsave", "sig SIGILL", NO_XSAVE),
    model("* xsaves", "osxsave", "sig SIGILL", NO_XSAVE),
    model("* xrstors", "osxsave", "sig SIGILL", NO_XSAVE),
    model(
        "* rdtscp|rdtscp-tsd",
        "rdtscp",
        "sig SIGILL",
        "this host's KVM offers no RDTSCP to its guests (KVM_GET_SUPPORTED_CPUID)",
    ),
    model(
        "* rdpid",
        "rdpid",
        "sig SIGILL",
        "this host's KVM offers no RDPID to its guests",
    ),
    model(
        "* invpcid",
        "invpcid",
        "sig SIGILL",
        "this host's KVM offers no INVPCID to its guests: #UD instead of #GP",
    ),
    model("* rd?sbase", "fsgsbase", "sig SIGILL", NO_FSGSBASE),
    model("32 wr?sbase", "fsgsbase", "sig SIGILL", NO_FSGSBASE),
    model("64 *-after-wr?sbase", "fsgsbase", "sig SIGILL", NO_FSGSBASE),
    model(
        "64 gsbase-across-syscalls",
        "fsgsbase",
        "sig SIGILL",
        NO_FSGSBASE,
    ),
    model(
        "64 wrgsbase-noncanonical",
        "fsgsbase",
        "sig SIGILL",
        NO_FSGSBASE,
    ),
    model(
        "* popcnt",
        "popcnt",
        "ok value=8",
        "the VMM hides POPCNT (KVM's emulator fails on it at ring 0); CPUID masking does \
         not disable the instruction, which runs as under KVM",
    ),
    model(
        "64 cmpxchg16b",
        "cx16",
        "ok zf=1 mem=7,0,9,0",
        "the VMM hides CX16 (KVM's emulator fails on cmpxchg16b at ring 0); the \
         instruction still runs, as under KVM",
    ),
    model(
        "* rdrand",
        "rdrand",
        "ok",
        "this host's KVM offers no RDRAND to its guests; the instruction still runs",
    ),
    // (b) Known engine gaps (issue #22), as found by this test.
    gap(
        "* xsave",
        "xsave runs although the guest's CR4.OSXSAVE is clear (XSAVE hidden): #UD expected",
    ),
    gap(
        "* avx-vaddps",
        "a VEX instruction runs although the guest's CR4.OSXSAVE is clear: #UD expected",
    ),
    gap(
        "64 fxsave-upper-start",
        "fxsave to an unmapped kernel address: the CPU reports CR2 = the last byte \
         (probe+511), the engine the first",
    ),
    gap(
        "64 exec-noncanonical",
        "a call to a non-canonical address: the CPU raises #GP at the call, the engine at \
         the target",
    ),
    gap(
        "64 ss-read-noncanonical",
        "an SS-override read at a non-canonical address: this (AMD) CPU raises #GP, the \
         engine #SS",
    ),
    gap(
        "* ldmxcsr-reserved",
        "ldmxcsr of a reserved bit: #GP expected, the engine #UD",
    ),
    gap(
        "32 es-null-stos|ldt-data-base|ldt-data-limit|ss-limit-push",
        "32-bit code: segment bases and limits and null selectors are ignored (a store \
         through a null ES runs; an LDT segment's base and limit, an SS limit, do not apply)",
    ),
];
