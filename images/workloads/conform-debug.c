/*
 * conform-debug.c: the debug architecture as a process sees it (kpin-conform).
 *
 * EFLAGS.TF set with popf over known sequences (a SIGTRAP after each instruction, with
 * the MOV SS / POP SS shadow, across system calls and emulated instructions, and the popf
 * that clears TF); PTRACE_SINGLESTEP over a known sequence; hardware breakpoints and
 * watchpoints set with PTRACE_POKEUSER into u_debugreg (execute; write 1/2/4/8 bytes;
 * read/write), with the SIGTRAP si_code and DR6 read back with PTRACE_PEEKUSER (B0-B3,
 * BS).
 */
#include "conform.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- TF single-step ---------------------------------------------------------------------- */

#define MAX_TRAPS 48
static volatile uintptr_t trap_ip[MAX_TRAPS];
static volatile int trap_n, trap_code, trap_codes_differ, other_sig;

/* SIGTRAP: record and return (sigreturn restores TF); other signals: on_fault. */
static void on_trap(int sig, siginfo_t *si, void *ucv) {
    if (sig != SIGTRAP) {
        on_fault(sig, si, ucv);
        return;
    }
    if (trap_n == 0)
        trap_code = si->si_code;
    else if (si->si_code != trap_code)
        trap_codes_differ = 1;
    if (trap_n < MAX_TRAPS)
        trap_ip[trap_n] = *uc_ip(ucv);
    trap_n++;
}

/* "+a,+b,..." offsets from the labelled instruction (x: elsewhere, e.g. the vDSO). */
static void fmt_traps(char *buf, size_t n) {
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < trap_n && i < MAX_TRAPS && len + 8 < n; i++) {
        uintptr_t ip = trap_ip[i];
        if (ip >= g_insn && ip - g_insn < 4096)
            len += (size_t)snprintf(buf + len, n - len, "%s+%lu", i ? "," : "",
                                    (unsigned long)(ip - g_insn));
        else
            len += (size_t)snprintf(buf + len, n - len, "%sx", i ? "," : "");
    }
}

#define TF_ON "pushf\n\torl $0x100, (" SP ")\n\t"
#define TF_OFF "pushf\n\tandl $~0x100, (" SP ")\n\tpopf\n\t"

static void tf_case(uintptr_t kind, uintptr_t unused) {
    (void)unused;
    install_handler(on_trap);
    TRY {
        switch (kind) {
        case 0: /* plain instructions; the popf that clears TF */
            __asm__ volatile(TF_ON MARK "popf\n\tnop\n\tmov $1, %%eax\n\tadd %%eax, %%eax\n\t"
                             "jmp 2f\n2:\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
        case 1: /* emulated or trapping instructions: cpuid, rdtsc */
            __asm__ volatile(TF_ON MARK "popf\n\txor %%eax, %%eax\n\txor %%ecx, %%ecx\n\tcpuid\n\t"
                             "rdtsc\n\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
        case 2: /* mov ss: no trap after it, one after the next instruction */
            __asm__ volatile(TF_ON MARK "popf\n\tnop\n\tmov %%ss, %%eax\n\tmov %%eax, %%ss\n\t"
                             "nop\n\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
        case 3: /* int 0x80 getpid */
            __asm__ volatile(TF_ON MARK "popf\n\tnop\n\tmov $20, %%eax\n\tint $0x80\n\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
        case 4: /* TF set and cleared at once */
            __asm__ volatile(TF_ON MARK "popf\n\t" TF_OFF : : : CLOB_ALL);
            break;
        case 5: /* int3 under TF */
            __asm__ volatile(TF_ON MARK "popf\n\tnop\n\tint3\n\tnop\n\t" TF_OFF : : : CLOB_ALL);
            break;
#ifdef __x86_64__
        case 6: /* syscall getpid */
            __asm__ volatile(TF_ON MARK "popf\n\tnop\n\tmov $39, %%eax\n\tsyscall\n\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
#else
        case 6: /* pop ss shadow */
            __asm__ volatile(TF_ON MARK "popf\n\tnop\n\tpush %%ss\n\tpop %%ss\n\tnop\n\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
        case 7: /* the vDSO's system call entry */
            __asm__ volatile(TF_ON MARK "popf\n\tmov $20, %%eax\n\tcall *%%gs:0x10\n\tnop\n\t" TF_OFF
                             :
                             :
                             : CLOB_ALL);
            break;
#endif
        }
        char list[400];
        fmt_traps(list, sizeof list);
        out("ok traps=%d code=%d same=%d at=%s", trap_n, trap_code, !trap_codes_differ, list);
    }
    else out_fault("");
}

/* ---- ptrace ------------------------------------------------------------------------------------ */

/* The sequence PTRACE_SINGLESTEP walks, entered after an int3; and the hardware
 * breakpoint targets, each labelled at the instruction the breakpoint is about. */
#ifdef __x86_64__
#define SYSCALL_GETPID "mov $39, %eax\n\tsyscall\n\t"
#define WATCH(x) x "(%rip)"
#define STORE8 "movq $1, conform_watch(%rip)"
#else
#define SYSCALL_GETPID "mov $20, %eax\n\tint $0x80\n\t"
#define WATCH(x) x
#define STORE8 "movq %xmm0, conform_watch"
#endif
__asm__(".pushsection .text\n"
        ".globl conform_step_seq\nconform_step_seq:\n\tint3\n"
        ".globl conform_step_start\nconform_step_start:\n\t"
        "nop\n\tmov $1, %eax\n\tadd %eax, %eax\n\tjmp 1f\n1:\t" SYSCALL_GETPID
        "pushf\n\tpopf\n\trdtsc\n"
        ".globl conform_step_end\nconform_step_end:\n\tret\n"
        ".globl conform_hw_exec\nconform_hw_exec:\n\tnop\n"
        ".globl conform_hw_exec_at\nconform_hw_exec_at:\n\tnop\n\tret\n"
        ".globl conform_hw_store1\nconform_hw_store1:\n\tmovb $1, " WATCH("conform_watch") "\n\tret\n"
        ".globl conform_hw_store2\nconform_hw_store2:\n\tmovw $1, " WATCH("conform_watch") "\n\tret\n"
        ".globl conform_hw_store4\nconform_hw_store4:\n\tmovl $1, " WATCH("conform_watch") "\n\tret\n"
        ".globl conform_hw_store8\nconform_hw_store8:\n\t" STORE8 "\n\tret\n"
        ".globl conform_hw_store1_off1\nconform_hw_store1_off1:\n\tmovb $1, " WATCH("conform_watch+1") "\n\tret\n"
        ".globl conform_hw_store4_off6\nconform_hw_store4_off6:\n\tmovl $1, " WATCH("conform_watch+6") "\n\tret\n"
        ".globl conform_hw_load4\nconform_hw_load4:\n\tmovl " WATCH("conform_watch") ", %eax\n\tret\n"
        ".popsection");
extern char conform_step_seq[], conform_step_start[], conform_step_end[], conform_hw_exec[],
    conform_hw_exec_at[], conform_hw_store1[], conform_hw_store2[], conform_hw_store4[],
    conform_hw_store8[], conform_hw_store1_off1[], conform_hw_store4_off6[], conform_hw_load4[];
char conform_watch[16] __attribute__((aligned(16), used));

static uintptr_t regs_ip(pid_t pid) {
    struct user_regs_struct r;
    if (ptrace(PTRACE_GETREGS, pid, 0, &r))
        return 0;
#ifdef __x86_64__
    return (uintptr_t)r.rip;
#else
    return (uintptr_t)r.eip;
#endif
}

static long dr_offset(int i) { return (long)offsetof(struct user, u_debugreg[i]); }

/* Forks a tracee that stops itself with SIGSTOP and then calls `fn`; returns its pid,
 * stopped, with PTRACE_O_EXITKILL set (it dies with this process). */
static pid_t start_tracee(void (*fn)(void)) {
    pid_t pid = fork();
    if (pid == 0) {
        if (ptrace(PTRACE_TRACEME, 0, 0, 0))
            _exit(90);
        raise(SIGSTOP);
        fn();
        _exit(7);
    }
    int st;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFSTOPPED(st))
        return -1;
    ptrace(PTRACE_SETOPTIONS, pid, 0, PTRACE_O_EXITKILL);
    return pid;
}

/* Why the tracee is no longer running, for an unexpected stop. */
static const char *status_text(int st, char *buf, size_t n) {
    if (WIFEXITED(st))
        snprintf(buf, n, "exit-%d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(buf, n, "killed-%s", signame(WTERMSIG(st)));
    else if (WIFSTOPPED(st))
        snprintf(buf, n, "stopped-%s", signame(WSTOPSIG(st)));
    else
        snprintf(buf, n, "status-%#x", st);
    return buf;
}

static void step_seq(void) { ((void (*)(void))conform_step_seq)(); }

/* PTRACE_CONT to the int3, then PTRACE_SINGLESTEP to the end label: the number of
 * steps, each stop's offset from the start label, the si_code of a step and DR6. */
static void c_ptrace_singlestep(void) {
    pid_t pid = start_tracee(step_seq);
    if (pid < 0) {
        out("tracee failed");
        return;
    }
    int st;
    char s[32];
    ptrace(PTRACE_CONT, pid, 0, 0);
    waitpid(pid, &st, 0);
    if (!WIFSTOPPED(st) || WSTOPSIG(st) != SIGTRAP) {
        out("no int3 stop: %s", status_text(st, s, sizeof s));
        return;
    }
    siginfo_t si;
    memset(&si, 0, sizeof si);
    ptrace(PTRACE_GETSIGINFO, pid, 0, &si);
    int int3_code = si.si_code;
    uintptr_t start = (uintptr_t)conform_step_start, end = (uintptr_t)conform_step_end;
    char list[400];
    size_t len = (size_t)snprintf(list, sizeof list, "+%ld", (long)(regs_ip(pid) - start));
    int steps = 0, step_code = -1;
    unsigned long dr6 = 0;
    while (steps < 40) {
        if (ptrace(PTRACE_SINGLESTEP, pid, 0, 0))
            break;
        waitpid(pid, &st, 0);
        if (!WIFSTOPPED(st)) {
            out("tracee ended after %d steps: %s", steps, status_text(st, s, sizeof s));
            return;
        }
        steps++;
        if (steps == 1) {
            memset(&si, 0, sizeof si);
            ptrace(PTRACE_GETSIGINFO, pid, 0, &si);
            step_code = si.si_code;
            dr6 = (unsigned long)ptrace(PTRACE_PEEKUSER, pid, dr_offset(6), 0) & 0x400fUL;
        }
        uintptr_t ip = regs_ip(pid);
        if (len + 12 < sizeof list) {
            if (ip - start < 4096)
                len += (size_t)snprintf(list + len, sizeof list - len, ",+%lu",
                                        (unsigned long)(ip - start));
            else
                len += (size_t)snprintf(list + len, sizeof list - len, ",x");
        }
        if (ip == end)
            break;
    }
    ptrace(PTRACE_CONT, pid, 0, 0);
    waitpid(pid, &st, 0);
    out("ok int3-code=%d steps=%d step-code=%d dr6=%#lx at=%s end=%s", int3_code, steps,
        step_code, dr6, list, status_text(st, s, sizeof s));
}

/* Hardware breakpoint cases: DR<idx> = target, DR7 = L<idx> | rw | len, in the stopped
 * tracee, which then calls `fn`. */
struct hw_bp {
    void (*fn)(void);
    char *target; /* the breakpoint address */
    char *access; /* the instruction `at` is relative to */
    int idx;      /* DR0..DR3 */
    int rw;       /* 0 execute, 1 write, 2 I/O, 3 read/write */
    int len;      /* 1, 2, 4, 8 bytes */
};

static void hw_exec(void) { ((void (*)(void))conform_hw_exec)(); }
static void hw_store1(void) { ((void (*)(void))conform_hw_store1)(); }
static void hw_store2(void) { ((void (*)(void))conform_hw_store2)(); }
static void hw_store4(void) { ((void (*)(void))conform_hw_store4)(); }
static void hw_store8(void) { ((void (*)(void))conform_hw_store8)(); }
static void hw_store1_off1(void) { ((void (*)(void))conform_hw_store1_off1)(); }
static void hw_store4_off6(void) { ((void (*)(void))conform_hw_store4_off6)(); }
static void hw_load4(void) { ((void (*)(void))conform_hw_load4)(); }

static const struct hw_bp HW_BPS[] = {
    {hw_exec, conform_hw_exec_at, conform_hw_exec_at, 0, 0, 1},     /* 0 exec DR0 */
    {hw_exec, conform_hw_exec_at, conform_hw_exec_at, 1, 0, 1},     /* 1 exec DR1 */
    {hw_store1, conform_watch, conform_hw_store1, 0, 1, 1},         /* 2 write 1 */
    {hw_store2, conform_watch, conform_hw_store2, 0, 1, 2},         /* 3 write 2 */
    {hw_store4, conform_watch, conform_hw_store4, 0, 1, 4},         /* 4 write 4 */
    {hw_store8, conform_watch, conform_hw_store8, 3, 1, 8},         /* 5 write 8, DR3 */
    {hw_store1_off1, conform_watch, conform_hw_store1_off1, 0, 1, 1}, /* 6 miss */
    {hw_store1_off1, conform_watch, conform_hw_store1_off1, 0, 1, 2}, /* 7 inside */
    {hw_store4_off6, conform_watch, conform_hw_store4_off6, 2, 1, 8}, /* 8 straddle */
    {hw_load4, conform_watch, conform_hw_load4, 0, 3, 4},           /* 9 rw, read */
    {hw_store4, conform_watch, conform_hw_store4, 0, 3, 4},         /* 10 rw, write */
    {hw_load4, conform_watch, conform_hw_load4, 0, 1, 4},           /* 11 write, read */
    {hw_load4, conform_watch, conform_hw_load4, 0, 2, 4},           /* 12 I/O */
};

static void hw_case(uintptr_t which, uintptr_t unused) {
    (void)unused;
    const struct hw_bp *b = &HW_BPS[which];
    static const unsigned LEN_BITS[9] = {0, 0, 1, 0, 3, 0, 0, 0, 2};
    pid_t pid = start_tracee(b->fn);
    if (pid < 0) {
        out("tracee failed");
        return;
    }
    unsigned long dr7 = (1UL << (2 * b->idx)) | ((unsigned long)b->rw << (16 + 4 * b->idx)) |
                        ((unsigned long)LEN_BITS[b->len] << (18 + 4 * b->idx));
    errno = 0;
    int r0 = ptrace(PTRACE_POKEUSER, pid, dr_offset(b->idx), b->target) ? errno : 0;
    int r7 = ptrace(PTRACE_POKEUSER, pid, dr_offset(7), dr7) ? errno : 0;
    char p[48], s[32], a[48], at[48];
    snprintf(p, sizeof p, "dr%d=%s dr7=%s ", b->idx, errname(r0), errname(r7));
    int st;
    ptrace(PTRACE_CONT, pid, 0, 0);
    waitpid(pid, &st, 0);
    if (!WIFSTOPPED(st)) {
        out("%sok no-trap end=%s", p, status_text(st, s, sizeof s));
        return;
    }
    if (WSTOPSIG(st) != SIGTRAP) {
        out("%s%s", p, status_text(st, s, sizeof s));
        return;
    }
    siginfo_t si;
    memset(&si, 0, sizeof si);
    ptrace(PTRACE_GETSIGINFO, pid, 0, &si);
    unsigned long dr6 = (unsigned long)ptrace(PTRACE_PEEKUSER, pid, dr_offset(6), 0) & 0x400fUL;
    uintptr_t ip = regs_ip(pid);
    g_insn = (uintptr_t)b->access;
    set_probe((uintptr_t)b->target);
    fmt_addr((uintptr_t)si.si_addr, a, sizeof a);
    if (ip == g_insn)
        snprintf(at, sizeof at, "insn");
    else if (ip - g_insn < 64)
        snprintf(at, sizeof at, "insn+%lu", (unsigned long)(ip - g_insn));
    else
        fmt_addr(ip, at, sizeof at);
    /* Disarm, let it finish. */
    ptrace(PTRACE_POKEUSER, pid, dr_offset(7), 0);
    ptrace(PTRACE_CONT, pid, 0, 0);
    waitpid(pid, &st, 0);
    out("%sok trap code=%d dr6=%#lx at=%s addr=%s end=%s", p, si.si_code, dr6, at, a,
        status_text(st, s, sizeof s));
}

#define TF(name, kind) {name, NULL, tf_case, kind, 0}
#define HW(name, which) {name, NULL, hw_case, which, 0}

const struct conform_case debug_cases[] = {
    TF("tf-step", 0),
    TF("tf-step-cpuid-rdtsc", 1),
    TF("tf-mov-ss-shadow", 2),
    TF("tf-int80", 3),
    TF("tf-popf-sets-and-clears", 4),
    TF("tf-int3", 5),
#ifdef __x86_64__
    TF("tf-syscall", 6),
#else
    TF("tf-pop-ss-shadow", 6),
    TF("tf-vdso-syscall", 7),
#endif
    {"ptrace-singlestep", c_ptrace_singlestep, NULL, 0, 0},
    HW("hw-exec-dr0", 0),
    HW("hw-exec-dr1", 1),
    HW("hw-write-1", 2),
    HW("hw-write-2", 3),
    HW("hw-write-4", 4),
    HW("hw-write-8-dr3", 5),
    HW("hw-write-1-miss-next-byte", 6),
    HW("hw-write-2-hit-second-byte", 7),
    HW("hw-write-8-straddle-dr2", 8),
    HW("hw-rw-4-read", 9),
    HW("hw-rw-4-write", 10),
    HW("hw-write-4-on-read", 11),
    HW("hw-io-4", 12),
};
const size_t debug_ncases = sizeof debug_cases / sizeof debug_cases[0];
