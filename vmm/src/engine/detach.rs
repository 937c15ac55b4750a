//! The VMM's side of detaching to native execution: the attach control area
//! ([`kpin_abi::attach_control`]) read and written in the stolen region, and the guest's
//! handed-back state loaded into the vCPU.
//!
//! What the vCPU gets back: general registers, RIP and RFLAGS (with the guest's virtual IF
//! and IOPL), segment registers with their caches, GDTR/IDTR, CR0/CR2/CR3/CR4, EFER, the
//! MSRs the engine virtualises (the hand-back list: syscall MSRs, FS/GS/KERNEL_GS bases,
//! SYSENTER, PAT, TSC_AUX) and the interrupt shadow from the engine; XCR0 as it was at
//! attach (the engine never changes it: `xsetbv` is #UD under it). Left as KVM has them:
//! CR8/APIC_BASE and the local APIC (the engine passes APIC accesses through), the TSC
//! (it kept running), the debug registers (the engine refuses enabled breakpoints), and
//! the FPU/SSE/AVX registers, which were the guest's all along (the engine is soft-float).
//! No interrupt is in flight: the engine hands back only when its pending bitmap is empty.

use kpin_abi::attach::{Segment, SystemRegs};
use kpin_abi::attach_control::{Control, CONTROL_OFFSET, MAGIC};
use kvm_bindings::{kvm_dtable, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, kvm_xcrs, Msrs};
use kvm_ioctls::VcpuFd;

use crate::error::{Result, VmmError};
use crate::vstate::memory::VmMemory;

fn area(mem: &VmMemory) -> Result<*mut Control> {
    let host = mem.stolen_host_address(CONTROL_OFFSET)?;
    assert!(
        (host as usize).is_multiple_of(std::mem::align_of::<Control>()),
        "the stolen region's mapping is page-aligned"
    );
    Ok(host.cast())
}

/// Reads the control area.
pub fn read_control(mem: &VmMemory) -> Result<Control> {
    let p = area(mem)?;
    // SAFETY: `p` is inside the stolen region's live mapping (the abi crate asserts that
    // the area fits the attach slot), aligned (checked); the vCPU is not running (this
    // runs on the vCPU thread between two `KVM_RUN`s), so nothing writes it meanwhile.
    Ok(unsafe { std::ptr::read_volatile(p) })
}

/// Writes the control area.
pub fn write_control(mem: &VmMemory, c: &Control) -> Result<()> {
    let p = area(mem)?;
    // SAFETY: as in `read_control`.
    unsafe { std::ptr::write_volatile(p, *c) };
    Ok(())
}

/// Posts `request` (with `c`'s tool fields) and sets the engine's attention bit so that
/// guest code looping in the code cache comes back to the engine's run loop. `false`: no
/// engine has set the area up.
pub fn post(mem: &VmMemory, mut c: Control, request: u32) -> Result<bool> {
    if c.magic != MAGIC {
        return Ok(false);
    }
    c.request = request;
    write_control(mem, &c)?;
    set_attention(mem, &c)?;
    Ok(true)
}

/// Sets the engine's attention bit with no request: the engine's run loop turns once at
/// the next trace entry, which publishes the live instruction count (guest code looping
/// in linked traces, e.g. polling a port the engine emulates, never passes through it
/// otherwise). Does nothing if no engine has set the area up.
pub fn nudge(mem: &VmMemory) -> Result<()> {
    let c = read_control(mem)?;
    if c.magic == MAGIC {
        set_attention(mem, &c)?;
    }
    Ok(())
}

fn set_attention(mem: &VmMemory, c: &Control) -> Result<()> {
    if c.attention_offset != 0 && c.attention_offset < kpin_abi::stolen::LAYOUT_BYTES {
        let p = mem.stolen_host_address(c.attention_offset)?;
        // SAFETY: the attention word is an aligned u64 in the engine's code-cache context
        // inside the stolen region (offset bounded above); the vCPU is stopped; the
        // generated code only reads it and the engine ORs bits into it, as this does.
        unsafe {
            let w = p.cast::<u64>();
            std::ptr::write_volatile(w, std::ptr::read_volatile(w) | u64::from(c.attention_bit));
        }
    }
    Ok(())
}

/// Wakes a vCPU halted in the engine's `hlt` (which then sees the request).
pub fn wake(vcpu: &VcpuFd) -> Result<()> {
    let mp = vcpu
        .get_mp_state()
        .map_err(|e| VmmError::Kvm("KVM_GET_MP_STATE", e))?;
    if mp.mp_state == kvm_bindings::KVM_MP_STATE_HALTED {
        let runnable = kvm_bindings::kvm_mp_state {
            mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
        };
        vcpu.set_mp_state(runnable)
            .map_err(|e| VmmError::Kvm("KVM_SET_MP_STATE", e))?;
    }
    Ok(())
}

/// Loads the handed-back guest state into the vCPU (see the module header); `xcrs` are
/// the guest's XCRs read at attach.
pub fn restore(vcpu: &VcpuFd, c: &Control, xcrs: Option<&kvm_xcrs>) -> Result<()> {
    let live = vcpu
        .get_sregs()
        .map_err(|e| VmmError::Kvm("KVM_GET_SREGS", e))?;
    vcpu.set_sregs(&native_sregs(live, &c.sregs))
        .map_err(|e| VmmError::Kvm("KVM_SET_SREGS", e))?;
    vcpu.set_regs(&native_regs(c))
        .map_err(|e| VmmError::Kvm("KVM_SET_REGS", e))?;
    let entries: Vec<kvm_msr_entry> = c
        .handback_msrs()
        .iter()
        .map(|m| kvm_msr_entry {
            index: m.index,
            data: m.value,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).expect("the hand-back list is below KVM's limit");
    let n = vcpu
        .set_msrs(&msrs)
        .map_err(|e| VmmError::Kvm("KVM_SET_MSRS", e))?;
    if n != entries.len() {
        return Err(VmmError::Kvm(
            "KVM_SET_MSRS (hand-back)",
            kvm_ioctls::Error::new(libc::EINVAL),
        ));
    }
    let mut events = vcpu
        .get_vcpu_events()
        .map_err(|e| VmmError::Kvm("KVM_GET_VCPU_EVENTS", e))?;
    events.interrupt.shadow = c.events.interrupt_shadow;
    events.flags |= kvm_bindings::KVM_VCPUEVENT_VALID_SHADOW;
    vcpu.set_vcpu_events(&events)
        .map_err(|e| VmmError::Kvm("KVM_SET_VCPU_EVENTS", e))?;
    if let Some(x) = xcrs {
        vcpu.set_xcrs(x)
            .map_err(|e| VmmError::Kvm("KVM_SET_XCRS", e))?;
    }
    Ok(())
}

/// General registers from the hand-back.
pub fn native_regs(c: &Control) -> kvm_regs {
    let r = &c.regs;
    kvm_regs {
        rax: r.rax,
        rbx: r.rbx,
        rcx: r.rcx,
        rdx: r.rdx,
        rsi: r.rsi,
        rdi: r.rdi,
        rsp: r.rsp,
        rbp: r.rbp,
        r8: r.r8,
        r9: r.r9,
        r10: r.r10,
        r11: r.r11,
        r12: r.r12,
        r13: r.r13,
        r14: r.r14,
        r15: r.r15,
        rip: r.rip,
        rflags: r.rflags,
    }
}

/// `live` (KVM's current system registers: the engine's) with everything the guest
/// owns replaced from the hand-back; CR8 and APIC_BASE stay KVM's.
pub fn native_sregs(mut live: kvm_sregs, s: &SystemRegs) -> kvm_sregs {
    live.cs = segment(&s.cs);
    live.ds = segment(&s.ds);
    live.es = segment(&s.es);
    live.fs = segment(&s.fs);
    live.gs = segment(&s.gs);
    live.ss = segment(&s.ss);
    live.tr = segment(&s.tr);
    live.ldt = segment(&s.ldt);
    live.gdt = kvm_dtable {
        base: s.gdt.base,
        limit: s.gdt.limit,
        ..Default::default()
    };
    live.idt = kvm_dtable {
        base: s.idt.base,
        limit: s.idt.limit,
        ..Default::default()
    };
    live.cr0 = s.cr0;
    live.cr2 = s.cr2;
    live.cr3 = s.cr3;
    live.cr4 = s.cr4;
    live.efer = s.efer;
    live
}

fn segment(s: &Segment) -> kvm_segment {
    kvm_segment {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present,
        dpl: s.dpl,
        db: s.db,
        s: s.s,
        l: s.l,
        g: s.g,
        avl: s.avl,
        unusable: s.unusable,
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_native_sregs_take_the_guest_fields_and_keep_the_apic() {
        let live = kvm_sregs {
            cr8: 5,
            apic_base: 0xfee0_0900,
            cr3: 0x1234_8000,
            ..Default::default()
        };
        let mut s = SystemRegs {
            cr3: 0x9000,
            cr4: 0x6a0,
            efer: 0xd01,
            ..Default::default()
        };
        s.cs.selector = 0x8;
        s.cs.l = 1;
        s.gdt.base = 0x1000;
        s.gdt.limit = 0x3f;
        let n = native_sregs(live, &s);
        assert_eq!((n.cr3, n.cr4, n.efer), (0x9000, 0x6a0, 0xd01));
        assert_eq!((n.cs.selector, n.cs.l), (0x8, 1));
        assert_eq!((n.gdt.base, n.gdt.limit), (0x1000, 0x3f));
        assert_eq!((n.cr8, n.apic_base), (5, 0xfee0_0900));
    }

    #[test]
    fn test_native_regs_copy_every_register() {
        let mut c = Control::new();
        c.regs.rax = 1;
        c.regs.r15 = 15;
        c.regs.rip = 0xffff_ffff_8100_0000;
        c.regs.rflags = 0x202;
        let r = native_regs(&c);
        assert_eq!((r.rax, r.r15, r.rip, r.rflags), (1, 15, c.regs.rip, 0x202));
    }
}
