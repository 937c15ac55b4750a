//! The guest-state dump printed on every unexpected exit: registers, segment and
//! descriptor-table state, control registers, EFER, key MSRs, pending events, the bytes at
//! RIP decoded with iced-x86, and the top of the stack.
//!
//! It is best effort: a piece that cannot be read is reported as such, and the dump never
//! fails or panics, because it runs exactly when something has already gone wrong.

use std::fmt::Write;

use iced_x86::{Decoder, DecoderOptions, Formatter, IntelFormatter};
use kpin_abi::x86::msr;
use kvm_bindings::{kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;

use crate::diag::paging;
use crate::diag::symbols::Symbols;
use crate::vstate::memory::VmMemory;

/// MSRs worth seeing when a guest dies, with their names.
const DUMP_MSRS: &[(u32, &str)] = &[
    (msr::STAR, "STAR"),
    (msr::LSTAR, "LSTAR"),
    (msr::CSTAR, "CSTAR"),
    (msr::SFMASK, "SFMASK"),
    (msr::FS_BASE, "FS_BASE"),
    (msr::GS_BASE, "GS_BASE"),
    (msr::KERNEL_GS_BASE, "KERNEL_GS_BASE"),
    (msr::APIC_BASE, "APIC_BASE"),
    (msr::SYSENTER_CS, "SYSENTER_CS"),
    (msr::SYSENTER_ESP, "SYSENTER_ESP"),
    (msr::SYSENTER_EIP, "SYSENTER_EIP"),
    (msr::TSC, "TSC"),
];
/// Guest code bytes shown before RIP.
const BYTES_BEFORE_RIP: u64 = 16;
/// Guest code bytes decoded from RIP on.
const BYTES_FROM_RIP: usize = 48;
/// Instructions decoded from RIP.
const INSNS_SHOWN: usize = 8;
/// Stack quadwords shown.
const STACK_QWORDS: u64 = 8;

/// Produces the dump of `vcpu` as text. `reason` heads it.
/// `symbols`, if given, names RIP and the stack entries that point into kernel text.
pub fn guest_state(
    reason: &str,
    vcpu: &VcpuFd,
    mem: &VmMemory,
    symbols: Option<&Symbols>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "==== kpin guest-state dump: {reason} ====");
    let regs = match vcpu.get_regs() {
        Ok(r) => r,
        Err(e) => {
            let _ = writeln!(out, "registers unavailable: {e}");
            return out;
        }
    };
    let name = |addr: u64| {
        symbols
            .and_then(|s| s.describe(addr))
            .map(|n| format!(" <{n}>"))
            .unwrap_or_default()
    };
    dump_gprs(&mut out, &regs, &name);
    let sregs = match vcpu.get_sregs() {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(out, "system registers unavailable: {e}");
            return out;
        }
    };
    dump_system_regs(&mut out, &sregs);
    dump_msrs(&mut out, vcpu);
    dump_events(&mut out, vcpu);
    dump_memory(&mut out, mem, &regs, &sregs, &name);
    let _ = writeln!(out, "==== end of dump ====");
    out
}

fn dump_gprs(out: &mut String, regs: &kvm_regs, name: &dyn Fn(u64) -> String) {
    let _ = writeln!(
        out,
        "RIP={:016x}{} RFLAGS={:016x}\n\
         RAX={:016x} RBX={:016x} RCX={:016x} RDX={:016x}\n\
         RSI={:016x} RDI={:016x} RBP={:016x} RSP={:016x}\n\
         R8 ={:016x} R9 ={:016x} R10={:016x} R11={:016x}\n\
         R12={:016x} R13={:016x} R14={:016x} R15={:016x}",
        regs.rip,
        name(regs.rip),
        regs.rflags,
        regs.rax,
        regs.rbx,
        regs.rcx,
        regs.rdx,
        regs.rsi,
        regs.rdi,
        regs.rbp,
        regs.rsp,
        regs.r8,
        regs.r9,
        regs.r10,
        regs.r11,
        regs.r12,
        regs.r13,
        regs.r14,
        regs.r15
    );
}

fn dump_system_regs(out: &mut String, sregs: &kvm_sregs) {
    for (name, s) in [
        ("CS", &sregs.cs),
        ("SS", &sregs.ss),
        ("DS", &sregs.ds),
        ("ES", &sregs.es),
        ("FS", &sregs.fs),
        ("GS", &sregs.gs),
        ("TR", &sregs.tr),
        ("LDT", &sregs.ldt),
    ] {
        let _ = writeln!(out, "{name:<3} {}", segment(s));
    }
    let _ = writeln!(
        out,
        "GDT base={:016x} limit={:04x}  IDT base={:016x} limit={:04x}",
        sregs.gdt.base, sregs.gdt.limit, sregs.idt.base, sregs.idt.limit
    );
    let _ = writeln!(
        out,
        "CR0={:016x} CR2={:016x} CR3={:016x} CR4={:016x} CR8={:x} EFER={:x} APIC_BASE={:x}",
        sregs.cr0, sregs.cr2, sregs.cr3, sregs.cr4, sregs.cr8, sregs.efer, sregs.apic_base
    );
}

fn dump_events(out: &mut String, vcpu: &VcpuFd) {
    if let Ok(ev) = vcpu.get_vcpu_events() {
        let _ = writeln!(
            out,
            "events: exception injected={} pending={} nr={} err={:#x}(valid={}) | \
             interrupt injected={} nr={} shadow={} | nmi pending={} masked={} | triple_fault={}",
            ev.exception.injected,
            ev.exception.pending,
            ev.exception.nr,
            ev.exception.error_code,
            ev.exception.has_error_code,
            ev.interrupt.injected,
            ev.interrupt.nr,
            ev.interrupt.shadow,
            ev.nmi.pending,
            ev.nmi.masked,
            ev.triple_fault.pending
        );
    }
}

/// The bytes around RIP (disassembled) and the top of the stack, read through the guest's
/// page tables.
fn dump_memory(
    out: &mut String,
    mem: &VmMemory,
    regs: &kvm_regs,
    sregs: &kvm_sregs,
    name: &dyn Fn(u64) -> String,
) {
    let paging_on = sregs.cr0 & (1 << 31) != 0;
    let mut read_u64 = |gpa: u64| {
        let mut b = [0u8; 8];
        mem.read(gpa, &mut b).ok().map(|()| u64::from_le_bytes(b))
    };
    let mut va_to_pa = |va: u64| {
        if paging_on {
            paging::translate(sregs.cr3, va, &mut read_u64)
        } else {
            Some(va)
        }
    };
    let mut read_va = |va: u64, buf: &mut [u8]| -> usize {
        // Byte by byte across page boundaries: slow but only ever a few dozen bytes.
        for (i, b) in buf.iter_mut().enumerate() {
            let Some(pa) = va_to_pa(va.wrapping_add(i as u64)) else {
                return i;
            };
            let mut one = [0u8];
            if mem.read(pa, &mut one).is_err() {
                return i;
            }
            *b = one[0];
        }
        buf.len()
    };

    let rip_linear = sregs.cs.base.wrapping_add(regs.rip);
    let mut before = [0u8; BYTES_BEFORE_RIP as usize];
    let n = read_va(rip_linear.wrapping_sub(BYTES_BEFORE_RIP), &mut before);
    let _ = writeln!(out, "bytes before RIP: {}", hex(&before[..n]));
    let mut code = [0u8; BYTES_FROM_RIP];
    let n = read_va(rip_linear, &mut code);
    if n == 0 {
        let _ = writeln!(out, "code at RIP: unmapped or outside guest memory");
    } else {
        let _ = writeln!(out, "code at RIP ({n} bytes readable): {}", hex(&code[..n]));
        let bitness = if sregs.cs.l == 1 {
            64
        } else if sregs.cs.db == 1 {
            32
        } else {
            16
        };
        let _ = write!(out, "{}", disassemble(&code[..n], bitness, regs.rip));
    }
    let mut stack = [0u8; (STACK_QWORDS * 8) as usize];
    let n = read_va(sregs.ss.base.wrapping_add(regs.rsp), &mut stack);
    let _ = writeln!(out, "stack:");
    for (i, q) in stack[..n - n % 8].chunks(8).enumerate() {
        let v = u64::from_le_bytes(q.try_into().expect("8-byte chunk"));
        let _ = writeln!(out, "  [rsp+{:#04x}] {v:016x}{}", i * 8, name(v));
    }
}

fn dump_msrs(out: &mut String, vcpu: &VcpuFd) {
    let entries: Vec<kvm_msr_entry> = DUMP_MSRS
        .iter()
        .map(|(index, _)| kvm_msr_entry {
            index: *index,
            ..Default::default()
        })
        .collect();
    let Ok(mut msrs) = Msrs::from_entries(&entries) else {
        return;
    };
    match vcpu.get_msrs(&mut msrs) {
        Ok(read) => {
            for (e, (_, name)) in msrs.as_slice().iter().take(read).zip(DUMP_MSRS) {
                let _ = write!(out, "{name}={:x} ", e.data);
            }
            let _ = writeln!(out);
        }
        Err(e) => {
            let _ = writeln!(out, "MSRs unavailable: {e}");
        }
    }
}

fn segment(s: &kvm_segment) -> String {
    format!(
        "sel={:04x} base={:016x} limit={:08x} type={:x} dpl={} p={} s={} l={} db={} g={}{}",
        s.selector,
        s.base,
        s.limit,
        s.type_,
        s.dpl,
        s.present,
        s.s,
        s.l,
        s.db,
        s.g,
        if s.unusable != 0 { " unusable" } else { "" }
    )
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Decodes up to [`INSNS_SHOWN`] instructions of `code` at `ip`, one per line.
pub fn disassemble(code: &[u8], bitness: u32, ip: u64) -> String {
    let mut out = String::new();
    let mut decoder = Decoder::with_ip(bitness, code, ip, DecoderOptions::NONE);
    let mut formatter = IntelFormatter::new();
    let mut text = String::new();
    for insn in decoder.iter().take(INSNS_SHOWN) {
        text.clear();
        formatter.format(&insn, &mut text);
        let start = (insn.ip() - ip) as usize;
        let bytes = &code[start..start + insn.len()];
        let _ = writeln!(
            out,
            "  {:016x}  {:<30} {}",
            insn.ip(),
            hex(bytes),
            if insn.is_invalid() {
                "(invalid)"
            } else {
                &text
            }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_disassembles_at_guest_ip() {
        // mov eax, 1; out 0x80, al; hlt
        let text = disassemble(&[0xb8, 1, 0, 0, 0, 0xe6, 0x80, 0xf4], 64, 0x10_0000);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].contains("0000000000100000") && lines[0].contains("mov eax,1"));
        assert!(lines[1].contains("out 80h,al"), "{}", lines[1]);
        assert!(lines[2].contains("hlt"));
    }
}
