/*
 * conform-priv.c: system and sensitive instructions executed at CPL 3 (kpin-conform).
 *
 * Each has the outcome a CPU gives a Linux process: most raise #GP (SIGSEGV, si_code
 * SI_KERNEL) or #UD (SIGILL); some run (rdtsc, cpuid, a same-privilege iret); some
 * depend on a CPUID feature, whose bit the line prints first, so that a CPU model
 * without the feature shows a different but explainable line; the UMIP instructions
 * show what Linux's UMIP emulation answers.
 */
#include "conform.h"

#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

/* ---- syscalls and software interrupts ------------------------------------------- */

static void c_syscall_getpid(void) {
    volatile long r = -1;
    TRY {
        long v;
#ifdef __x86_64__
        __asm__ volatile("mov $39, %%eax\n\t" MARK "syscall" : "=a"(v) : : CLOB, "rcx");
#else
        /* Compat SYSCALL returns through the vDSO's int 0x80 landing pad, which pops
         * ebp, edx, ecx and returns: the frame __kernel_vsyscall builds. */
        __asm__ volatile("push $2f\n\tpush %%ecx\n\tpush %%edx\n\tpush %%ebp\n\t"
                         "mov %%esp, %%ebp\n\tmov $20, %%eax\n\t" MARK "syscall\n2:"
                         : "=a"(v)
                         :
                         : CLOB);
#endif
        r = v;
        out("ok self=%d", r == getpid());
    }
    else out_fault("");
}

static void c_sysenter(void) {
    volatile long r = -1;
    TRY {
        long v;
#ifdef __x86_64__
        __asm__ volatile("mov $20, %%eax\n\t" MARK "sysenter" : "=a"(v) : : CLOB, "rcx", "rdx");
#else
        __asm__ volatile("push $2f\n\tpush %%ecx\n\tpush %%edx\n\tpush %%ebp\n\t"
                         "mov %%esp, %%ebp\n\tmov $20, %%eax\n\t" MARK "sysenter\n2:"
                         : "=a"(v)
                         :
                         : CLOB);
#endif
        r = v;
        out("ok self=%d", r == getpid());
    }
    else out_fault("");
}

/* int 0x80 is the 32-bit system call gate, also from a 64-bit process: eax 20 = getpid. */
static void c_int80_getpid(void) {
    volatile long r = -1;
    TRY {
        long v;
#ifdef __x86_64__
        __asm__ volatile("mov $20, %%eax\n\t" MARK "int $0x80"
                         : "=a"(v)
                         :
                         : CLOB, "r8", "r9", "r10");
#else
        __asm__ volatile("mov $20, %%eax\n\t" MARK "int $0x80" : "=a"(v) : : CLOB);
#endif
        r = v;
        out("ok self=%d", r == getpid());
    }
    else out_fault("");
}

INSN(c_int_00, "", ".byte 0xcd, 0x00")
INSN(c_int_01, "", ".byte 0xcd, 0x01")
INSN(c_int_02, "", ".byte 0xcd, 0x02")
INSN(c_int_03, "", ".byte 0xcd, 0x03")
INSN(c_int_04, "", ".byte 0xcd, 0x04")
INSN(c_int_05, "", ".byte 0xcd, 0x05")
INSN(c_int_06, "", ".byte 0xcd, 0x06")
INSN(c_int_08, "", ".byte 0xcd, 0x08")
INSN(c_int_0d, "", ".byte 0xcd, 0x0d")
INSN(c_int_0e, "", ".byte 0xcd, 0x0e")
INSN(c_int_12, "", ".byte 0xcd, 0x12")
INSN(c_int_1f, "", ".byte 0xcd, 0x1f")
INSN(c_int_20, "", ".byte 0xcd, 0x20")
INSN(c_int_81, "", ".byte 0xcd, 0x81")
INSN(c_int_ff, "", ".byte 0xcd, 0xff")
INSN(c_int3, "", "int3")
INSN(c_int1, "", ".byte 0xf1")
/* into with OF set: #OF in 32-bit code, #UD in 64-bit mode. */
INSN(c_into_of, "mov $0x7f, %%al\n\tadd $1, %%al\n\t", ".byte 0xce")
INSN(c_into_nof, "xor %%eax, %%eax\n\t", ".byte 0xce")

/* ---- interrupt flag, halt, system flags ------------------------------------------ */

INSN(c_hlt, "", "hlt")
INSN(c_cli, "", "cli")
INSN(c_sti, "", "sti")

static void c_pushf_sysflags(void) {
    out("ok flags=%#lx", (unsigned long)(get_flags() & (FL_DEFINED & ~FL_ARITH)));
}

/* popf of `img` at CPL 3, read back with pushf: IOPL and IF do not change, AC, ID and
 * NT do; the image's arithmetic flags show it was loaded. Flags restored afterwards. */
static void popf_case(uintptr_t img) {
    uintptr_t saved = get_flags(), got;
    __asm__ volatile("push %1\n\tpopf\n\tpushf\n\tpop %0\n\tpush %2\n\tpopf"
                     : "=&r"(got)
                     : "r"(img), "r"(saved)
                     : "memory", "cc");
    out("ok flags=%#lx", (unsigned long)(got & FL_DEFINED));
}
static void c_popf_iopl3(void) { popf_case(0x202 | FL_IOPL); }
static void c_popf_if0(void) { popf_case(0x002); }
static void c_popf_ac(void) { popf_case(0x202 | FL_AC | FL_CF); }
static void c_popf_id(void) { popf_case(0x202 | FL_ID | FL_ZF); }
static void c_popf_nt(void) { popf_case(0x202 | FL_NT | FL_SF); }
static void c_popf_vm_rf_vif_vip(void) { popf_case(0x202 | FL_VM | FL_RF | FL_VIF | FL_VIP); }
static void c_popf_arith(void) { popf_case(0x202 | FL_ARITH | FL_DF); }

static void c_lahf(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.lahf-lm=%d ", feat(F_LAHF));
    TRY {
        unsigned long v;
        __asm__ volatile("xor %%eax, %%eax\n\tstc\n\t" MARK "lahf" : "=a"(v) : : CLOB);
        out("%sok ah=%#lx", p, (v >> 8) & 0xff);
    }
    else out_fault(p);
}

/* ---- port I/O without permission (port 0x80 only) -------------------------------- */

INSN(c_in_imm, "", "inb $0x80, %%al")
INSN(c_out_imm, "xor %%eax, %%eax\n\t", "outb %%al, $0x80")
INSN(c_in_dx, "mov $0x80, %%edx\n\t", "inb %%dx, %%al")
INSN(c_out_dx_w, "mov $0x80, %%edx\n\txor %%eax, %%eax\n\t", "outw %%ax, %%dx")
INSN(c_in_dx_l, "mov $0x80, %%edx\n\t", "inl %%dx, %%eax")
INSN(c_insb, "mov $0x80, %%edx\n\tmov $1, %%ecx\n\t" LEA("conform_buf", DI), "rep insb")
INSN(c_outsb, "mov $0x80, %%edx\n\tmov $1, %%ecx\n\t" LEA("conform_buf", SI), "rep outsb")
INSN(c_outsl, "mov $0x80, %%edx\n\tmov $1, %%ecx\n\t" LEA("conform_buf", SI), "rep outsl")

/* ---- MSRs, control and debug registers ------------------------------------------ */

INSN(c_rdmsr, "mov $0x10, %%ecx\n\t", "rdmsr")
INSN(c_wrmsr, "mov $0xc0000103, %%ecx\n\txor %%eax, %%eax\n\txor %%edx, %%edx\n\t", "wrmsr")
INSN(c_mov_from_cr0, "", "mov %%cr0, " AX)
INSN(c_mov_to_cr0, "mov $0x80050033, %%eax\n\t", "mov " AX ", %%cr0")
INSN(c_mov_from_cr2, "", "mov %%cr2, " AX)
INSN(c_mov_from_cr3, "", "mov %%cr3, " AX)
INSN(c_mov_to_cr3, "xor %%eax, %%eax\n\t", "mov " AX ", %%cr3")
INSN(c_mov_from_cr4, "", "mov %%cr4, " AX)
INSN(c_mov_to_cr4, "mov $0x3406f0, %%eax\n\t", "mov " AX ", %%cr4")
#ifdef __x86_64__
INSN(c_mov_from_cr8, "", "mov %%cr8, %%rax")
INSN(c_mov_to_cr8, "xor %%eax, %%eax\n\t", "mov %%rax, %%cr8")
#endif
/* lock mov from cr0: AMD's alternative encoding of cr8 (cr8_legacy). */
INSN(c_lock_mov_cr0, "", ".byte 0xf0, 0x0f, 0x20, 0xc0")
INSN(c_mov_from_dr7, "", "mov %%db7, " AX)
INSN(c_mov_to_dr7, "xor %%eax, %%eax\n\t", "mov " AX ", %%db7")
INSN(c_mov_from_dr6, "", "mov %%db6, " AX)
INSN(c_mov_from_dr0, "", "mov %%db0, " AX)
INSN(c_mov_to_dr0, "xor %%eax, %%eax\n\t", "mov " AX ", %%db0")

/* ---- descriptor tables (UMIP) ---------------------------------------------------- */

INSN(c_lgdt, LEA("conform_buf", DI), "lgdt (" DI ")")
INSN(c_lidt, LEA("conform_buf", DI), "lidt (" DI ")")
INSN(c_ltr, "mov $0x40, %%eax\n\t", "ltr %%ax")
INSN(c_lldt, "xor %%eax, %%eax\n\t", "lldt %%ax")

/* sgdt/sidt: Linux's UMIP emulation stores fixed dummy values; print the base only when
 * it is one (a real table's base is a kernel address). */
static void store_table(int idt) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.umip=%d ", feat(F_UMIP));
    memset(conform_buf, 0xa5, 16);
    TRY {
        if (idt)
            __asm__ volatile(LEA("conform_buf", DI) MARK "sidt (" DI ")" : : : CLOB_ALL);
        else
            __asm__ volatile(LEA("conform_buf", DI) MARK "sgdt (" DI ")" : : : CLOB_ALL);
        uint16_t limit;
        uintptr_t base;
        memcpy(&limit, conform_buf, 2);
        memcpy(&base, conform_buf + 2, sizeof base);
        char b[32];
        if (base >= (uintptr_t)-0x20000)
            snprintf(b, sizeof b, "%#lx", (unsigned long)base);
        else
            snprintf(b, sizeof b, "kernel");
        out("%sok limit=%#x base=%s", p, limit, b);
    }
    else out_fault(p);
}
static void c_sgdt(void) { store_table(0); }
static void c_sidt(void) { store_table(1); }

static void store_sel(int which) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.umip=%d ", feat(F_UMIP));
    TRY {
        unsigned long v = 0xa5a5;
        if (which == 0)
            __asm__ volatile("mov $0xa5a5, %%eax\n\t" MARK "sldt %%eax" : "=a"(v) : : CLOB);
        else if (which == 1)
            __asm__ volatile("mov $0xa5a5, %%eax\n\t" MARK "str %%eax" : "=a"(v) : : CLOB);
        else if (which == 2)
            __asm__ volatile(MARK "smsw " AX : "=a"(v) : : CLOB);
        else {
            uint16_t m = 0xa5a5;
            __asm__ volatile(MARK "smsw %0" : "=m"(m) : : CLOB);
            v = m;
        }
        out("%sok value=%#lx", p, v);
    }
    else out_fault(p);
}
static void c_sldt(void) { store_sel(0); }
static void c_str(void) { store_sel(1); }
static void c_smsw_reg(void) { store_sel(2); }
static void c_smsw_mem(void) { store_sel(3); }

/* ---- caches, TLB, counters -------------------------------------------------------- */

INSN(c_clts, "", "clts")
INSN(c_invd, "", "invd")
INSN(c_wbinvd, "", "wbinvd")
INSN(c_invlpg, LEA("conform_buf", DI), "invlpg (" DI ")")
INSN_P(c_invpcid, LEA("conform_buf", DI) "xor %%eax, %%eax\n\t", "invpcid (" DI "), " AX,
       "cpuid.invpcid=%d ", feat(F_INVPCID))
INSN(c_rdpmc, "xor %%ecx, %%ecx\n\t", "rdpmc")

static void c_rdtsc(void) {
    TRY {
        uint32_t lo1, hi1, lo2, hi2;
        __asm__ volatile(MARK "rdtsc" : "=a"(lo1), "=d"(hi1) : : CLOB);
        __asm__ volatile("rdtsc" : "=a"(lo2), "=d"(hi2));
        uint64_t a = ((uint64_t)hi1 << 32) | lo1, b = ((uint64_t)hi2 << 32) | lo2;
        out("ok increasing=%d", b > a);
    }
    else out_fault("");
}

/* PR_SET_TSC PR_TSC_SIGSEGV sets CR4.TSD for the process: rdtsc and rdtscp #GP. */
static void tsd_case(int rdtscp) {
    char p[48];
    int r = prctl(PR_SET_TSC, PR_TSC_SIGSEGV, 0, 0, 0);
    if (rdtscp)
        snprintf(p, sizeof p, "cpuid.rdtscp=%d prctl=%d ", feat(F_RDTSCP), r);
    else
        snprintf(p, sizeof p, "prctl=%d ", r);
    TRY {
        if (rdtscp)
            __asm__ volatile(MARK "rdtscp" : : : CLOB_ALL);
        else
            __asm__ volatile(MARK "rdtsc" : : : CLOB_ALL);
        out("%sok", p);
    }
    else out_fault(p);
}
static void c_rdtsc_tsd(void) { tsd_case(0); }
static void c_rdtscp_tsd(void) { tsd_case(1); }

static void c_rdtscp(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.rdtscp=%d ", feat(F_RDTSCP));
    TRY {
        uint32_t aux;
        __asm__ volatile(MARK "rdtscp" : "=c"(aux) : : CLOB, "eax", "edx");
        out("%sok aux=%#x", p, aux);
    }
    else out_fault(p);
}

static void c_rdpid(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.rdpid=%d ", feat(F_RDPID));
    TRY {
        uintptr_t v;
#ifdef __x86_64__
        __asm__ volatile(MARK "rdpid %%rax" : "=a"(v) : : CLOB);
#else
        __asm__ volatile(MARK "rdpid %%eax" : "=a"(v) : : CLOB);
#endif
        out("%sok value=%#lx", p, (unsigned long)v);
    }
    else out_fault(p);
}

static void c_rdpkru(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.pku=%d cpuid.ospke=%d ", feat(F_PKU), feat(F_OSPKE));
    TRY {
        uint32_t v;
        __asm__ volatile("xor %%ecx, %%ecx\n\t" MARK "rdpkru" : "=a"(v) : : CLOB, "ecx", "edx");
        out("%sok pkru=%#x", p, v);
    }
    else out_fault(p);
}
INSN_P(c_wrpkru, "xor %%ecx, %%ecx\n\txor %%edx, %%edx\n\txor %%eax, %%eax\n\t", "wrpkru",
       "cpuid.pku=%d cpuid.ospke=%d ", feat(F_PKU), feat(F_OSPKE))

/* ---- XCRs, XSAVE -------------------------------------------------------------------- */

static void c_xgetbv0(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.osxsave=%d ", feat(F_OSXSAVE));
    TRY {
        uint32_t lo;
        __asm__ volatile("xor %%ecx, %%ecx\n\t" MARK "xgetbv" : "=a"(lo) : : CLOB, "ecx", "edx");
        /* x87, SSE, AVX: the rest is the host's (AVX-512, PKRU, AMX). */
        out("%sok xcr0&7=%#x", p, lo & 7);
    }
    else out_fault(p);
}
INSN_P(c_xgetbv1, "mov $1, %%ecx\n\t", "xgetbv", "cpuid.osxsave=%d cpuid.xgetbv1=%d ", feat(F_OSXSAVE),
       feat(F_XGETBV1))
INSN_P(c_xsetbv, "xor %%ecx, %%ecx\n\tmov $3, %%eax\n\txor %%edx, %%edx\n\t", "xsetbv",
       "cpuid.osxsave=%d ", feat(F_OSXSAVE))
INSN_P(c_xsave, LEA("conform_buf", DI) "mov $3, %%eax\n\txor %%edx, %%edx\n\t",
       "xsave (" DI ")", "cpuid.osxsave=%d ", feat(F_OSXSAVE))
INSN_P(c_xsaves, LEA("conform_buf", DI) "mov $3, %%eax\n\txor %%edx, %%edx\n\t",
       "xsaves (" DI ")", "cpuid.osxsave=%d cpuid.xsaves=%d ", feat(F_OSXSAVE), feat(F_XSAVES))
INSN_P(c_xrstors, LEA("conform_buf", DI) "mov $3, %%eax\n\txor %%edx, %%edx\n\t",
       "xrstors (" DI ")", "cpuid.osxsave=%d cpuid.xsaves=%d ", feat(F_OSXSAVE), feat(F_XSAVES))
INSN(c_fxsave_fxrstor, LEA("conform_buf", DI) "fxsave (" DI ")\n\t", "fxrstor (" DI ")")
INSN_P(c_avx, "", "vaddps %%xmm0, %%xmm0, %%xmm0", "cpuid.avx=%d cpuid.osxsave=%d ", feat(F_AVX),
       feat(F_OSXSAVE))

/* ---- monitor/mwait and friends ------------------------------------------------------ */

INSN_P(c_monitor, LEA("conform_buf", AX) "xor %%ecx, %%ecx\n\txor %%edx, %%edx\n\t", "monitor",
       "cpuid.monitor=%d ", feat(F_MONITOR))
INSN_P(c_mwait, "xor %%eax, %%eax\n\txor %%ecx, %%ecx\n\t", "mwait", "cpuid.monitor=%d ",
       feat(F_MONITOR))
INSN_P(c_monitorx, LEA("conform_buf", AX) "xor %%ecx, %%ecx\n\txor %%edx, %%edx\n\t",
       ".byte 0x0f, 0x01, 0xfa", "cpuid.monitorx=%d ", feat(F_MONITORX))
/* mwaitx with its timer (ecx bit 1) bounded to 100000 TSC cycles. */
INSN_P(c_mwaitx, "xor %%eax, %%eax\n\tmov $2, %%ecx\n\tmov $100000, %%ebx\n\t",
       ".byte 0x0f, 0x01, 0xfb", "cpuid.monitorx=%d ", feat(F_MONITORX))
INSN_P(c_umonitor, LEA("conform_buf", AX), "umonitor " AX, "cpuid.waitpkg=%d ", feat(F_WAITPKG))
/* umwait/tpause with a deadline 100000 cycles ahead. */
INSN_P(c_umwait, "rdtsc\n\tadd $100000, %%eax\n\tadc $0, %%edx\n\txor %%ecx, %%ecx\n\t",
       "umwait %%ecx", "cpuid.waitpkg=%d ", feat(F_WAITPKG))
INSN_P(c_tpause, "rdtsc\n\tadd $100000, %%eax\n\tadc $0, %%edx\n\txor %%ecx, %%ecx\n\t",
       "tpause %%ecx", "cpuid.waitpkg=%d ", feat(F_WAITPKG))

/* ---- transactional memory ----------------------------------------------------------- */

INSN_P(c_xbegin, "", "xbegin 2f\n\txend\n2:", "cpuid.rtm=%d ", feat(F_RTM))
INSN_P(c_xend, "", "xend", "cpuid.rtm=%d ", feat(F_RTM))
INSN_P(c_xabort, "", "xabort $1", "cpuid.rtm=%d ", feat(F_RTM))
INSN_P(c_xtest, "", "xtest", "cpuid.rtm=%d cpuid.hle=%d ", feat(F_RTM), feat(F_HLE))

/* ---- SMAP, swapgs, sysret/sysexit, iret --------------------------------------------- */

INSN(c_clac, "", "clac")
INSN(c_stac, "", "stac")
INSN(c_swapgs, "", ".byte 0x0f, 0x01, 0xf8")
INSN(c_sysret, "", ".byte 0x0f, 0x07")
INSN(c_sysexit, "", ".byte 0x0f, 0x35")

/* A same-privilege iret to the next label: runs; the stack pointer comes back. */
static void c_iret_same(void) {
    TRY {
        uintptr_t before, after;
#ifdef __x86_64__
        __asm__ volatile("mov %%rsp, %0\n\t"
                         "mov %%ss, %%eax\n\tpush %%rax\n\tpush %0\n\tpushfq\n\t"
                         "mov %%cs, %%eax\n\tpush %%rax\n\tlea 2f(%%rip), %%rax\n\tpush %%rax\n\t" MARK
                         "iretq\n2:\tmov %%rsp, %1"
                         : "=&r"(before), "=r"(after)
                         :
                         : CLOB, "rax");
#else
        __asm__ volatile("mov %%esp, %0\n\tpushf\n\tpush %%cs\n\tpush $2f\n\t" MARK
                         "iret\n2:\tmov %%esp, %1"
                         : "=&r"(before), "=r"(after)
                         :
                         : CLOB);
#endif
        out("ok sp-kept=%d", before == after);
    }
    else out_fault("");
}

/* ---- virtualization, SMM, enclaves -------------------------------------------------- */

/* vmcall/vmmcall: KVM answers a hypercall from CPL 3 with -KVM_EPERM in rax. */
static void hypercall(int amd) {
    TRY {
        long v;
        if (amd)
            __asm__ volatile("xor %%eax, %%eax\n\t" MARK ".byte 0x0f, 0x01, 0xd9"
                             : "=a"(v)
                             :
                             : CLOB, "ebx", "ecx", "edx", "esi");
        else
            __asm__ volatile("xor %%eax, %%eax\n\t" MARK ".byte 0x0f, 0x01, 0xc1"
                             : "=a"(v)
                             :
                             : CLOB, "ebx", "ecx", "edx", "esi");
        out("ok rax=%ld", v);
    }
    else out_fault("");
}
static void c_vmcall(void) { hypercall(0); }
static void c_vmmcall(void) { hypercall(1); }
INSN(c_vmfunc, "xor %%eax, %%eax\n\txor %%ecx, %%ecx\n\t", ".byte 0x0f, 0x01, 0xd4")
INSN_P(c_vmxon, LEA("conform_buf", DI), "vmxon (" DI ")", "cpuid.vmx=%d ", feat(F_VMX))
INSN_P(c_vmlaunch, "", ".byte 0x0f, 0x01, 0xc2", "cpuid.vmx=%d ", feat(F_VMX))
INSN_P(c_vmresume, "", ".byte 0x0f, 0x01, 0xc3", "cpuid.vmx=%d ", feat(F_VMX))
INSN_P(c_vmxoff, "", ".byte 0x0f, 0x01, 0xc4", "cpuid.vmx=%d ", feat(F_VMX))
INSN_P(c_vmptrld, LEA("conform_buf", DI), "vmptrld (" DI ")", "cpuid.vmx=%d ", feat(F_VMX))
INSN_P(c_vmread, "xor %%eax, %%eax\n\t", "vmread " AX ", " DX, "cpuid.vmx=%d ", feat(F_VMX))
INSN_P(c_vmrun, LEA("conform_buf", AX), ".byte 0x0f, 0x01, 0xd8", "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_vmload, LEA("conform_buf", AX), ".byte 0x0f, 0x01, 0xda", "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_vmsave, LEA("conform_buf", AX), ".byte 0x0f, 0x01, 0xdb", "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_stgi, "", ".byte 0x0f, 0x01, 0xdc", "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_clgi, "", ".byte 0x0f, 0x01, 0xdd", "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_skinit, "xor %%eax, %%eax\n\t", ".byte 0x0f, 0x01, 0xde", "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_invlpga, LEA("conform_buf", AX) "xor %%ecx, %%ecx\n\t", ".byte 0x0f, 0x01, 0xdf",
       "cpuid.svm=%d ", feat(F_SVM))
INSN_P(c_getsec, "xor %%eax, %%eax\n\t", ".byte 0x0f, 0x37", "cpuid.smx=%d ", feat(F_SMX))
INSN_P(c_encls, "mov $0xff, %%eax\n\t", ".byte 0x0f, 0x01, 0xcf", "cpuid.sgx=%d ", feat(F_SGX))
INSN_P(c_enclu, "mov $0xff, %%eax\n\t", ".byte 0x0f, 0x01, 0xd7", "cpuid.sgx=%d ", feat(F_SGX))
INSN(c_rsm, "", ".byte 0x0f, 0xaa")

/* ---- unprivileged instructions that depend on a CPUID feature ---------------------- */

INSN(c_cpuid, "xor %%eax, %%eax\n\txor %%ecx, %%ecx\n\t", "cpuid")

static void c_clzero(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.clzero=%d ", feat(F_CLZERO));
    memset(conform_buf, 0xa5, 64);
    TRY {
        __asm__ volatile(LEA("conform_buf", AX) MARK ".byte 0x0f, 0x01, 0xfc" : : : CLOB_ALL);
        int zero = 1;
        for (int i = 0; i < 64; i++)
            zero &= conform_buf[i] == 0;
        out("%sok zeroed=%d", p, zero);
    }
    else out_fault(p);
}
INSN_P(c_rdpru, "xor %%ecx, %%ecx\n\t", ".byte 0x0f, 0x01, 0xfd", "cpuid.rdpru=%d ", feat(F_RDPRU))
INSN_P(c_serialize, "", ".byte 0x0f, 0x01, 0xe8", "cpuid.serialize=%d ", feat(F_SERIALIZE))
INSN_P(c_rdrand, "", "rdrand " AX, "cpuid.rdrand=%d ", feat(F_RDRAND))

static void c_popcnt(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.popcnt=%d ", feat(F_POPCNT));
    TRY {
        unsigned long v;
        __asm__ volatile("mov $0xf0f0, %%ecx\n\t" MARK "popcnt %%ecx, %%eax"
                         : "=a"(v)
                         :
                         : CLOB, "ecx");
        out("%sok value=%lu", p, v);
    }
    else out_fault(p);
}

/* cmpxchg16b (64-bit; cmpxchg8b in the 32-bit build) on a matching 16-byte slot. */
static void c_cmpxchg_wide(void) {
    char p[64];
#ifdef __x86_64__
    snprintf(p, sizeof p, "cpuid.cx16=%d ", feat(F_CX16));
#else
    p[0] = 0;
#endif
    memset(conform_buf, 0, 16);
    TRY {
        volatile unsigned char zf;
#ifdef __x86_64__
        __asm__ volatile("xor %%eax, %%eax\n\txor %%edx, %%edx\n\tmov $7, %%ebx\n\tmov $9, %%ecx\n\t"
                         LEA("conform_buf", DI) MARK "lock cmpxchg16b (%%rdi)\n\tsetz %0"
                         : "=m"(zf)
                         :
                         : CLOB, "rax", "rbx", "rcx", "rdx", "rdi");
#else
        __asm__ volatile("xor %%eax, %%eax\n\txor %%edx, %%edx\n\tmov $7, %%ebx\n\tmov $9, %%ecx\n\t"
                         LEA("conform_buf", DI) MARK "lock cmpxchg8b (%%edi)\n\tsetz %0"
                         : "=m"(zf)
                         :
                         : CLOB, "eax", "ebx", "ecx", "edx", "edi");
#endif
        uint32_t w[4];
        memcpy(w, conform_buf, sizeof w);
        out("%sok zf=%d mem=%x,%x,%x,%x", p, zf, w[0], w[1], w[2], w[3]);
    }
    else out_fault(p);
}

const struct conform_case priv_cases[] = {
    {"syscall-getpid", c_syscall_getpid, NULL, 0, 0},
    {"sysenter", c_sysenter, NULL, 0, 0},
    {"int80-getpid", c_int80_getpid, NULL, 0, 0},
    {"int-0x00", c_int_00, NULL, 0, 0},
    {"int-0x01", c_int_01, NULL, 0, 0},
    {"int-0x02", c_int_02, NULL, 0, 0},
    {"int-0x03", c_int_03, NULL, 0, 0},
    {"int-0x04", c_int_04, NULL, 0, 0},
    {"int-0x05", c_int_05, NULL, 0, 0},
    {"int-0x06", c_int_06, NULL, 0, 0},
    {"int-0x08", c_int_08, NULL, 0, 0},
    {"int-0x0d", c_int_0d, NULL, 0, 0},
    {"int-0x0e", c_int_0e, NULL, 0, 0},
    {"int-0x12", c_int_12, NULL, 0, 0},
    {"int-0x1f", c_int_1f, NULL, 0, 0},
    {"int-0x20", c_int_20, NULL, 0, 0},
    {"int-0x81", c_int_81, NULL, 0, 0},
    {"int-0xff", c_int_ff, NULL, 0, 0},
    {"int3", c_int3, NULL, 0, 0},
    {"int1-icebp", c_int1, NULL, 0, 0},
    {"into-of", c_into_of, NULL, 0, 0},
    {"into-no-of", c_into_nof, NULL, 0, 0},
    {"hlt", c_hlt, NULL, 0, 0},
    {"cli", c_cli, NULL, 0, 0},
    {"sti", c_sti, NULL, 0, 0},
    {"pushf-sysflags", c_pushf_sysflags, NULL, 0, 0},
    {"popf-iopl3", c_popf_iopl3, NULL, 0, 0},
    {"popf-if0", c_popf_if0, NULL, 0, 0},
    {"popf-ac", c_popf_ac, NULL, 0, 0},
    {"popf-id", c_popf_id, NULL, 0, 0},
    {"popf-nt", c_popf_nt, NULL, 0, 0},
    {"popf-vm-rf-vif-vip", c_popf_vm_rf_vif_vip, NULL, 0, 0},
    {"popf-arith-df", c_popf_arith, NULL, 0, 0},
    {"lahf", c_lahf, NULL, 0, 0},
    {"in-imm", c_in_imm, NULL, 0, 0},
    {"out-imm", c_out_imm, NULL, 0, 0},
    {"in-dx", c_in_dx, NULL, 0, 0},
    {"out-dx-word", c_out_dx_w, NULL, 0, 0},
    {"in-dx-dword", c_in_dx_l, NULL, 0, 0},
    {"rep-insb", c_insb, NULL, 0, 0},
    {"rep-outsb", c_outsb, NULL, 0, 0},
    {"rep-outsl", c_outsl, NULL, 0, 0},
    {"rdmsr", c_rdmsr, NULL, 0, 0},
    {"wrmsr", c_wrmsr, NULL, 0, 0},
    {"mov-from-cr0", c_mov_from_cr0, NULL, 0, 0},
    {"mov-to-cr0", c_mov_to_cr0, NULL, 0, 0},
    {"mov-from-cr2", c_mov_from_cr2, NULL, 0, 0},
    {"mov-from-cr3", c_mov_from_cr3, NULL, 0, 0},
    {"mov-to-cr3", c_mov_to_cr3, NULL, 0, 0},
    {"mov-from-cr4", c_mov_from_cr4, NULL, 0, 0},
    {"mov-to-cr4", c_mov_to_cr4, NULL, 0, 0},
#ifdef __x86_64__
    {"mov-from-cr8", c_mov_from_cr8, NULL, 0, 0},
    {"mov-to-cr8", c_mov_to_cr8, NULL, 0, 0},
#endif
    {"lock-mov-from-cr0", c_lock_mov_cr0, NULL, 0, 0},
    {"mov-from-dr7", c_mov_from_dr7, NULL, 0, 0},
    {"mov-to-dr7", c_mov_to_dr7, NULL, 0, 0},
    {"mov-from-dr6", c_mov_from_dr6, NULL, 0, 0},
    {"mov-from-dr0", c_mov_from_dr0, NULL, 0, 0},
    {"mov-to-dr0", c_mov_to_dr0, NULL, 0, 0},
    {"lgdt", c_lgdt, NULL, 0, 0},
    {"lidt", c_lidt, NULL, 0, 0},
    {"ltr", c_ltr, NULL, 0, 0},
    {"lldt", c_lldt, NULL, 0, 0},
    {"sgdt", c_sgdt, NULL, 0, 0},
    {"sidt", c_sidt, NULL, 0, 0},
    {"sldt", c_sldt, NULL, 0, 0},
    {"str", c_str, NULL, 0, 0},
    {"smsw-reg", c_smsw_reg, NULL, 0, 0},
    {"smsw-mem", c_smsw_mem, NULL, 0, 0},
    {"clts", c_clts, NULL, 0, 0},
    {"invd", c_invd, NULL, 0, 0},
    {"wbinvd", c_wbinvd, NULL, 0, 0},
    {"invlpg", c_invlpg, NULL, 0, 0},
    {"invpcid", c_invpcid, NULL, 0, 0},
    {"rdpmc", c_rdpmc, NULL, 0, 0},
    {"rdtsc", c_rdtsc, NULL, 0, 0},
    {"rdtsc-tsd", c_rdtsc_tsd, NULL, 0, 0},
    {"rdtscp", c_rdtscp, NULL, 0, 0},
    {"rdtscp-tsd", c_rdtscp_tsd, NULL, 0, 0},
    {"rdpid", c_rdpid, NULL, 0, 0},
    {"rdpkru", c_rdpkru, NULL, 0, 0},
    {"wrpkru", c_wrpkru, NULL, 0, 0},
    {"xgetbv-0", c_xgetbv0, NULL, 0, 0},
    {"xgetbv-1", c_xgetbv1, NULL, 0, 0},
    {"xsetbv", c_xsetbv, NULL, 0, 0},
    {"xsave", c_xsave, NULL, 0, 0},
    {"xsaves", c_xsaves, NULL, 0, 0},
    {"xrstors", c_xrstors, NULL, 0, 0},
    {"fxsave-fxrstor", c_fxsave_fxrstor, NULL, 0, 0},
    {"avx-vaddps", c_avx, NULL, 0, 0},
    {"monitor", c_monitor, NULL, 0, 0},
    {"mwait", c_mwait, NULL, 0, 0},
    {"monitorx", c_monitorx, NULL, 0, 0},
    {"mwaitx", c_mwaitx, NULL, 0, 0},
    {"umonitor", c_umonitor, NULL, 0, 0},
    {"umwait", c_umwait, NULL, 0, 0},
    {"tpause", c_tpause, NULL, 0, 0},
    {"xbegin", c_xbegin, NULL, 0, 0},
    {"xend", c_xend, NULL, 0, 0},
    {"xabort", c_xabort, NULL, 0, 0},
    {"xtest", c_xtest, NULL, 0, 0},
    {"clac", c_clac, NULL, 0, 0},
    {"stac", c_stac, NULL, 0, 0},
    {"swapgs", c_swapgs, NULL, 0, 0},
    {"sysret", c_sysret, NULL, 0, 0},
    {"sysexit", c_sysexit, NULL, 0, 0},
    {"iret-same-privilege", c_iret_same, NULL, 0, 0},
    {"vmcall", c_vmcall, NULL, 0, 0},
    {"vmmcall", c_vmmcall, NULL, 0, 0},
    {"vmfunc", c_vmfunc, NULL, 0, 0},
    {"vmxon", c_vmxon, NULL, 0, 0},
    {"vmlaunch", c_vmlaunch, NULL, 0, 0},
    {"vmresume", c_vmresume, NULL, 0, 0},
    {"vmxoff", c_vmxoff, NULL, 0, 0},
    {"vmptrld", c_vmptrld, NULL, 0, 0},
    {"vmread", c_vmread, NULL, 0, 0},
    {"vmrun", c_vmrun, NULL, 0, 0},
    {"vmload", c_vmload, NULL, 0, 0},
    {"vmsave", c_vmsave, NULL, 0, 0},
    {"stgi", c_stgi, NULL, 0, 0},
    {"clgi", c_clgi, NULL, 0, 0},
    {"skinit", c_skinit, NULL, 0, 0},
    {"invlpga", c_invlpga, NULL, 0, 0},
    {"getsec", c_getsec, NULL, 0, 0},
    {"encls", c_encls, NULL, 0, 0},
    {"enclu", c_enclu, NULL, 0, 0},
    {"rsm", c_rsm, NULL, 0, 0},
    {"cpuid", c_cpuid, NULL, 0, 0},
    {"clzero", c_clzero, NULL, 0, 0},
    {"rdpru", c_rdpru, NULL, 0, 0},
    {"serialize", c_serialize, NULL, 0, 0},
    {"rdrand", c_rdrand, NULL, 0, 0},
    {"popcnt", c_popcnt, NULL, 0, 0},
#ifdef __x86_64__
    {"cmpxchg16b", c_cmpxchg_wide, NULL, 0, 0},
#else
    {"cmpxchg8b", c_cmpxchg_wide, NULL, 0, 0},
#endif
};
const size_t priv_ncases = sizeof priv_cases / sizeof priv_cases[0];
