/*
 * conform-io.c: flags across system calls, and user-mode port I/O with permission
 * (kpin-conform).
 *
 * A system call entered with AC, NT, DF, ID or the arithmetic flags set returns with the
 * flags the kernel restores (SYSRET from R11, IRET from the frame). iopl(3) and
 * ioperm() need root (as another uid they fail with EPERM and the port access faults);
 * modern Linux emulates iopl(3) with an all-ones I/O bitmap, so cli/sti still fault.
 * Only port 0x80 (the POST delay port, harmless on any PC or VM) is ever reached.
 */
#include "conform.h"

#include <errno.h>
#include <sys/io.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- flags across system calls ---------------------------------------------------------- */

enum sc_via { VIA_SYSCALL, VIA_INT80 };

/* popf `set`, getpid (64-bit: syscall; 32-bit: glibc's vDSO entry through %gs:0x10), or
 * int 0x80, then pushf: the flags after the call; the old flags restored. */
static void sc_flags(uintptr_t set, uintptr_t via) {
    TRY {
        uintptr_t after;
        long r;
#ifdef __x86_64__
        if (via == VIA_SYSCALL)
            __asm__ volatile("pushf\n\tpop %%r12\n\tpush %[set]\n\tpopf\n\tmov $39, %%eax\n\t" MARK
                             "syscall\n\tpushf\n\tpop %[after]\n\tpush %%r12\n\tpopf"
                             : [after] "=&r"(after), "=a"(r)
                             : [set] "r"(set)
                             : CLOB, "rcx", "r12");
        else
            __asm__ volatile("pushf\n\tpop %%r12\n\tpush %[set]\n\tpopf\n\tmov $20, %%eax\n\t" MARK
                             "int $0x80\n\tpushf\n\tpop %[after]\n\tpush %%r12\n\tpopf"
                             : [after] "=&r"(after), "=a"(r)
                             : [set] "r"(set)
                             : CLOB, "r8", "r9", "r10", "r12");
#else
        if (via == VIA_SYSCALL)
            __asm__ volatile("pushf\n\tpop %%esi\n\tpush %[set]\n\tpopf\n\tmov $20, %%eax\n\t" MARK
                             "call *%%gs:0x10\n\tpushf\n\tpop %[after]\n\tpush %%esi\n\tpopf"
                             : [after] "=&r"(after), "=a"(r)
                             : [set] "r"(set)
                             : CLOB, "esi");
        else
            __asm__ volatile("pushf\n\tpop %%esi\n\tpush %[set]\n\tpopf\n\tmov $20, %%eax\n\t" MARK
                             "int $0x80\n\tpushf\n\tpop %[after]\n\tpush %%esi\n\tpopf"
                             : [after] "=&r"(after), "=a"(r)
                             : [set] "r"(set)
                             : CLOB, "esi");
#endif
        out("ok self=%d flags=%#lx", r == getpid(), (unsigned long)(after & FL_DEFINED));
    }
    else out_fault("");
}

/* glibc's syscall(SYS_getpid): the 32-bit build's __kernel_vsyscall path, as a program
 * uses it. */
#ifndef __x86_64__
#include <sys/syscall.h>
static void c_glibc_syscall(void) {
    long a = syscall(SYS_getpid), b;
    __asm__ volatile("int $0x80" : "=a"(b) : "a"(20) : "memory");
    out("ok same=%d", a == b);
}
#endif

/* ---- port I/O with permission ---------------------------------------------------------- */

enum io_how { IO_IOPL3, IO_IOPERM, IO_IOPERM_REVOKED, IO_IOPERM_FORK, IO_IOPL3_THEN_0 };
enum io_what { W_OUTB, W_INB, W_OUTB_81, W_OUTW, W_INSB, W_OUTSB, W_CLI, W_STI, W_PUSHF };

/* Only the fault or success is printed: the value a read returns is the machine's. */
static void io_access(enum io_what what, const char *p) {
    TRY {
        switch (what) {
        case W_OUTB:
            __asm__ volatile("xor %%eax, %%eax\n\t" MARK "outb %%al, $0x80" : : : CLOB, "eax");
            break;
        case W_INB:
            __asm__ volatile(MARK "inb $0x80, %%al" : : : CLOB, "eax");
            break;
        case W_OUTB_81:
            __asm__ volatile("xor %%eax, %%eax\n\t" MARK "outb %%al, $0x81" : : : CLOB, "eax");
            break;
        case W_OUTW:
            __asm__ volatile("xor %%eax, %%eax\n\tmov $0x80, %%edx\n\t" MARK "outw %%ax, %%dx"
                             :
                             :
                             : CLOB, "eax", "edx");
            break;
        case W_INSB:
            __asm__ volatile("mov $0x80, %%edx\n\tmov $1, %%ecx\n\t" LEA("conform_buf", DI) MARK
                             "rep insb"
                             :
                             :
                             : CLOB_ALL);
            break;
        case W_OUTSB:
            __asm__ volatile("mov $0x80, %%edx\n\tmov $1, %%ecx\n\t" LEA("conform_buf", SI) MARK
                             "rep outsb"
                             :
                             :
                             : CLOB_ALL);
            break;
        case W_CLI:
            __asm__ volatile(MARK "cli" : : : CLOB);
            break;
        case W_STI:
            __asm__ volatile(MARK "sti" : : : CLOB);
            break;
        case W_PUSHF:
            out("%sok iopl=%lu", p, (unsigned long)((get_flags() & FL_IOPL) >> 12));
            return;
        }
        out("%sok", p);
    }
    else out_fault(p);
}

static void io_case(uintptr_t how, uintptr_t what) {
    char p[48];
    int r;
    switch (how) {
    case IO_IOPL3:
        r = iopl(3) ? errno : 0;
        snprintf(p, sizeof p, "iopl=%s ", errname(r));
        break;
    case IO_IOPL3_THEN_0:
        r = iopl(3) ? errno : 0;
        snprintf(p, sizeof p, "iopl=%s iopl0=%s ", errname(r), errname(iopl(0) ? errno : 0));
        break;
    case IO_IOPERM_REVOKED:
        r = ioperm(0x80, 1, 1) ? errno : 0;
        snprintf(p, sizeof p, "ioperm=%s off=%s ", errname(r),
                 errname(ioperm(0x80, 1, 0) ? errno : 0));
        break;
    default:
        r = ioperm(0x80, 1, 1) ? errno : 0;
        snprintf(p, sizeof p, "ioperm=%s ", errname(r));
        break;
    }
    if (how != IO_IOPERM_FORK) {
        io_access((enum io_what)what, p);
        return;
    }
    /* The I/O bitmap is inherited by a forked child, which prints the line. */
    pid_t pid = fork();
    if (pid == 0) {
        io_access((enum io_what)what, p);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
}

#define IO(name, how, what) {name, NULL, io_case, how, what}
#define SCF(name, set, via) {name, NULL, sc_flags, 0x202 | (set), via}

const struct conform_case io_cases[] = {
#ifdef __x86_64__
    SCF("syscall-flags-ac", FL_AC | FL_CF, VIA_SYSCALL),
    SCF("syscall-flags-nt", FL_NT | FL_ZF, VIA_SYSCALL),
    SCF("syscall-flags-df", FL_DF | FL_SF, VIA_SYSCALL),
    SCF("syscall-flags-id", FL_ID | FL_PF, VIA_SYSCALL),
    SCF("syscall-flags-arith", FL_ARITH, VIA_SYSCALL),
#else
    SCF("vdso-syscall-flags-ac", FL_AC | FL_CF, VIA_SYSCALL),
    SCF("vdso-syscall-flags-nt", FL_NT | FL_ZF, VIA_SYSCALL),
    SCF("vdso-syscall-flags-df", FL_DF | FL_SF, VIA_SYSCALL),
    SCF("vdso-syscall-flags-id", FL_ID | FL_PF, VIA_SYSCALL),
    SCF("vdso-syscall-flags-arith", FL_ARITH, VIA_SYSCALL),
    {"glibc-syscall-getpid", c_glibc_syscall, NULL, 0, 0},
#endif
    SCF("int80-flags-ac", FL_AC | FL_CF, VIA_INT80),
    SCF("int80-flags-nt", FL_NT | FL_ZF, VIA_INT80),
    SCF("int80-flags-df", FL_DF | FL_SF, VIA_INT80),
    SCF("int80-flags-arith", FL_ARITH, VIA_INT80),
    IO("iopl3-outb-0x80", IO_IOPL3, W_OUTB),
    IO("iopl3-inb-0x80", IO_IOPL3, W_INB),
    IO("iopl3-insb-0x80", IO_IOPL3, W_INSB),
    IO("iopl3-outsb-0x80", IO_IOPL3, W_OUTSB),
    IO("iopl3-cli", IO_IOPL3, W_CLI),
    IO("iopl3-sti", IO_IOPL3, W_STI),
    IO("iopl3-pushf", IO_IOPL3, W_PUSHF),
    IO("iopl0-after-iopl3-outb-0x80", IO_IOPL3_THEN_0, W_OUTB),
    IO("ioperm-outb-0x80", IO_IOPERM, W_OUTB),
    IO("ioperm-inb-0x80", IO_IOPERM, W_INB),
    IO("ioperm-outb-0x81", IO_IOPERM, W_OUTB_81),
    IO("ioperm-outw-0x80", IO_IOPERM, W_OUTW),
    IO("ioperm-insb-0x80", IO_IOPERM, W_INSB),
    IO("ioperm-outsb-0x80", IO_IOPERM, W_OUTSB),
    IO("ioperm-cli", IO_IOPERM, W_CLI),
    IO("ioperm-revoked-outb-0x80", IO_IOPERM_REVOKED, W_OUTB),
    IO("ioperm-inherited-outb-0x80", IO_IOPERM_FORK, W_OUTB),
};
const size_t io_ncases = sizeof io_cases / sizeof io_cases[0];
