/*
 * conform.h: the shared part of kpin-conform (images/workloads/kpin-conform.c and the
 * conform-*.c files it is built from, 64- and 32-bit; images/src/programs.rs).
 *
 * A case is a function that runs in a forked child with handlers for SIGSEGV, SIGILL,
 * SIGTRAP, SIGBUS and SIGFPE installed (on an alternate stack), does one thing, and calls
 * out() once with its outcome: out("ok ...") when the instruction completed, out_fault("")
 * after a signal caught by TRY. Everything printed must be the same on every correct x86
 * CPU running Linux (the host CPU is the reference): no raw time stamps, pids or
 * randomised addresses; addresses go through fmt_addr(), which names them.
 */
#ifndef KPIN_CONFORM_H
#define KPIN_CONFORM_H

#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __x86_64__
#define CONFORM_BITS 64
/* Labels the next instruction `insn` (g_insn); reserves local label 1 and r11. */
#define MARK "lea 1f(%%rip), %%r11\n\tmov %%r11, g_insn(%%rip)\n1:\t"
#define CLOB "memory", "cc", "r11"
/* Every register a case's asm may use besides its operands. */
#define CLOB_ALL CLOB, "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10"
#define AX "%%rax"
#define BX "%%rbx"
#define CX "%%rcx"
#define DX "%%rdx"
#define SI "%%rsi"
#define DI "%%rdi"
#define SP "%%rsp"
/* Loads the address of global symbol `sym` into `reg`. */
#define LEA(sym, reg) "lea " sym "(%%rip), " reg "\n\t"
#else
#define CONFORM_BITS 32
#define MARK "movl $1f, g_insn\n1:\t"
#define CLOB "memory", "cc"
#define CLOB_ALL CLOB, "eax", "ebx", "ecx", "edx", "esi", "edi"
#define AX "%%eax"
#define BX "%%ebx"
#define CX "%%ecx"
#define DX "%%edx"
#define SI "%%esi"
#define DI "%%edi"
#define SP "%%esp"
#define LEA(sym, reg) "mov $" sym ", " reg "\n\t"
#endif

/* CLOB plus the SSE registers the asm uses (the 32-bit build's compiler, without -msse,
 * neither uses nor accepts them). */
#ifdef __SSE__
#define CLOB_X CLOB, "xmm0", "xmm1"
#else
#define CLOB_X CLOB
#endif

/* A case that runs `setup`, then the labelled `text`: `ok`, or the fault, after the
 * prefix `pfx` (a printf format for the CPUID bits the outcome depends on, or ""). */
#define INSN_P(fn, setup, text, pfx, ...)                                                  \
    static void fn(void) {                                                                 \
        char p_[128];                                                                      \
        snprintf(p_, sizeof p_, pfx __VA_OPT__(, ) __VA_ARGS__);                           \
        TRY {                                                                              \
            __asm__ volatile(setup MARK text : : : CLOB_ALL);                              \
            out("%sok", p_);                                                               \
        }                                                                                  \
        else out_fault(p_);                                                                \
    }
#define INSN(fn, setup, text) INSN_P(fn, setup, text, "%s", "")

/* EFLAGS bits. */
#define FL_CF 0x1u
#define FL_PF 0x4u
#define FL_AF 0x10u
#define FL_ZF 0x40u
#define FL_SF 0x80u
#define FL_TF 0x100u
#define FL_IF 0x200u
#define FL_DF 0x400u
#define FL_OF 0x800u
#define FL_IOPL 0x3000u
#define FL_NT 0x4000u
#define FL_RF 0x10000u
#define FL_VM 0x20000u
#define FL_AC 0x40000u
#define FL_VIF 0x80000u
#define FL_VIP 0x100000u
#define FL_ID 0x200000u
#define FL_ARITH (FL_CF | FL_PF | FL_AF | FL_ZF | FL_SF | FL_OF)
/* Every architecturally defined bit (bit 1 reads as 1). */
#define FL_DEFINED 0x3f7fd7u

/* Linux's user selectors (arch/x86/include/asm/segment.h). */
#define SEL_USER32_CS 0x23
#define SEL_USER_DS 0x2b
#define SEL_USER_CS 0x33
#define SEL_KERNEL_CS 0x10
#define SEL_CPUNODE 0x7b /* GDT_ENTRY_CPUNODE: its limit is (node << 12) | cpu */
#define SEL_LDT(i) (((i) << 3) | 4 | 3)

/* A case: `run()`, or `run2(a, b)` for the table-driven ones. */
struct conform_case {
    const char *name;
    void (*run)(void);
    void (*run2)(uintptr_t a, uintptr_t b);
    uintptr_t a, b;
};

/* What the last caught signal said. */
struct fault_info {
    int signo, code;
    uintptr_t addr, ip, trapno, err, flags;
};

extern volatile uintptr_t g_insn;  /* the case's labelled instruction (MARK) */
extern volatile uintptr_t g_probe; /* the address the case probes, named `probe` */
extern volatile int g_probe_set;
extern sigjmp_buf g_env;
extern volatile struct fault_info g_fault;
/* When nonzero, the fault handler resumes here (with AC, TF, NT cleared in the saved
 * flags) instead of jumping to g_env: for faults whose flags must not leak into the
 * handler's caller, e.g. #AC. */
extern volatile uintptr_t g_resume;

/* Catches the case's signals: the body runs once; after a signal, the else branch. */
#define TRY if (sigsetjmp(g_env, 1) == 0)

void out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "<prefix>sig SIGX code=<si_code> addr=<si_addr> at=<ip> trap=<n> err=<e>" */
void out_fault(const char *prefix);
/* Names an address: 0, probe[+n], insn[+-n] (the labelled instruction), a small or
 * kernel-half constant in hex, lowstack+n, altstack, image+<offset> (the same binary
 * runs on the host and in the guest), stack, or other. */
const char *fmt_addr(uintptr_t a, char *buf, size_t n);
const char *errname(int e);
const char *signame(int s);
/* CPUID bit: leaf, subleaf, register (0 eax .. 3 edx), bit; 0 above the highest leaf. */
int feat(uint32_t leaf, uint32_t sub, int reg, int bit);
/* The vendor string of CPUID leaf 0 (12 characters). */
const char *vendor(void);
void set_probe(uintptr_t a);
uintptr_t get_flags(void);
void set_flags(uintptr_t f);
/* Installs h for the five fault signals (SA_SIGINFO | SA_ONSTACK | SA_NODEFER). */
void install_handler(void (*h)(int, siginfo_t *, void *));
/* The default handler: records g_fault, then resumes or jumps (see g_resume). */
void on_fault(int sig, siginfo_t *si, void *ucv);
/* Records g_fault from a signal's siginfo and ucontext. */
void record_fault(int sig, siginfo_t *si, void *ucv);
/* The saved instruction pointer and flags of a signal's ucontext. */
uintptr_t *uc_ip(void *ucv);
uintptr_t *uc_flags(void *ucv);

/* A 4 KiB stack below 4 GiB for code running in a 32-bit segment of the 64-bit build
 * (compatibility mode uses only ESP). */
extern char lowstack[4096];
/* Page-aligned scratch memory the cases' asm refers to by name. */
extern char conform_buf[16384];
#define LOWSTACK_TOP (lowstack + sizeof lowstack - 64)

/* Feature bits the cases print (leaf, subleaf, register, bit). */
#define F_MONITOR 1, 0, 2, 3
#define F_VMX 1, 0, 2, 5
#define F_SMX 1, 0, 2, 6
#define F_CX16 1, 0, 2, 13
#define F_POPCNT 1, 0, 2, 23
#define F_XSAVE 1, 0, 2, 26
#define F_OSXSAVE 1, 0, 2, 27
#define F_AVX 1, 0, 2, 28
#define F_RDRAND 1, 0, 2, 30
#define F_FSGSBASE 7, 0, 1, 0
#define F_SGX 7, 0, 1, 2
#define F_HLE 7, 0, 1, 4
#define F_INVPCID 7, 0, 1, 10
#define F_RTM 7, 0, 1, 11
#define F_SMAP 7, 0, 1, 20
#define F_UMIP 7, 0, 2, 2
#define F_PKU 7, 0, 2, 3
#define F_OSPKE 7, 0, 2, 4
#define F_WAITPKG 7, 0, 2, 5
#define F_RDPID 7, 0, 2, 22
#define F_SERIALIZE 7, 0, 3, 14
#define F_XGETBV1 0xd, 1, 0, 2
#define F_XSAVES 0xd, 1, 0, 3
#define F_LAHF 0x80000001, 0, 2, 0
/* AMD: loading a null selector clears the segment base. */
#define F_NSCB 0x80000021, 0, 0, 6
#define F_SVM 0x80000001, 0, 2, 2
#define F_MONITORX 0x80000001, 0, 2, 29
#define F_RDTSCP 0x80000001, 0, 3, 27
#define F_CLZERO 0x80000008, 0, 1, 0
#define F_RDPRU 0x80000008, 0, 1, 4

/* The case tables of each file, in the order the program runs them. */
extern const struct conform_case priv_cases[];
extern const size_t priv_ncases;
extern const struct conform_case seg_cases[];
extern const size_t seg_ncases;
extern const struct conform_case fault_cases[];
extern const size_t fault_ncases;
extern const struct conform_case debug_cases[];
extern const size_t debug_ncases;
extern const struct conform_case io_cases[];
extern const size_t io_ncases;

#endif
