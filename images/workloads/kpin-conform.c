/*
 * kpin-conform: a CPU-conformance corpus whose reference is the host CPU (issue #22).
 *
 * One static program, built 64-bit (`gcc -static -O2`) and 32-bit (`gcc -m32 -static
 * -O2`) by kpin-images (images/src/programs.rs) and packed as /bin/kpin-conform and
 * /bin/kpin-conform32. Each case runs in a forked child with handlers for the fault
 * signals and prints exactly one line:
 *
 *   KPIN-CONFORM <64|32> <uid> <case> <outcome>
 *
 * where the outcome is `ok <values>`, `sig SIGX code=<si_code> addr=<si_addr> at=<ip>
 * trap=<trapno> err=<error code>` (addresses named by fmt_addr: `insn` is the case's
 * labelled instruction), prefixed by the CPUID bits a feature-dependent case depends on;
 * or, printed by the parent when the child died without a line, `exit <n>` / `killed
 * <SIG>`. Only values that are the same on every correct x86 CPU running Linux are
 * printed, so that the lines of the same binary run natively on the host and inside a
 * guest under kpin must match (tests/linux_cpu_conformance.rs).
 *
 *   kpin-conform [--uid N] [--skip PATTERN]... [PATTERN...]   run the (matching) cases
 *   kpin-conform --list                                       print the case names
 *
 * --uid N drops to uid/gid N (from root) before running anything: the guest's /init and
 * the test run every case as root and as 65534. PATTERNs are fnmatch(3) patterns on case
 * names. The process pins itself to CPU 0, so that TSC_AUX (rdtscp, rdpid: Linux stores
 * (node << 12) | cpu) is the same on the host and on kpin's one-vCPU guest.
 *
 * The cases are in conform-priv.c (system and sensitive instructions at CPL 3),
 * conform-seg.c (selectors, segment loads, far transfers, LDT, FS/GS bases),
 * conform-fault.c (exceptions, undefined opcodes), conform-io.c (flags across system
 * calls, I/O permission) and conform-debug.c (single-step, ptrace, hardware breakpoints).
 */
#include "conform.h"

#include <cpuid.h>
#include <errno.h>
#include <fnmatch.h>
#include <grp.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

volatile uintptr_t g_insn __attribute__((used));
volatile uintptr_t g_probe;
volatile int g_probe_set;
volatile uintptr_t g_resume __attribute__((used));
sigjmp_buf g_env;
volatile struct fault_info g_fault;
char lowstack[4096] __attribute__((aligned(64)));
char conform_buf[16384] __attribute__((aligned(4096)));

static char altstack[65536] __attribute__((aligned(64)));
static const char *g_case_name = "?";
static int g_outfd = 1;
static int g_printed;
static uintptr_t g_stack_hint;

extern char __executable_start[], _end[];

/* ---- output ---------------------------------------------------------------------- */

void out(const char *fmt, ...) {
    char line[768];
    if (g_printed)
        return;
    g_printed = 1;
    int n = snprintf(line, sizeof line, "KPIN-CONFORM %d %u %s ", CONFORM_BITS,
                     (unsigned)getuid(), g_case_name);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    while (n > 0 && line[n - 1] == ' ') /* an outcome that is only a prefix */
        n--;
    line[n++] = '\n';
    if (write(g_outfd, line, (size_t)n) != n)
        _exit(120);
}

const char *signame(int s) {
    switch (s) {
    case SIGSEGV: return "SIGSEGV";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGALRM: return "SIGALRM";
    case SIGABRT: return "SIGABRT";
    case SIGSYS: return "SIGSYS";
    case SIGSTOP: return "SIGSTOP";
    case SIGCHLD: return "SIGCHLD";
    default: {
        static char buf[16];
        snprintf(buf, sizeof buf, "SIG%d", s);
        return buf;
    }
    }
}

const char *errname(int e) {
    switch (e) {
    case 0: return "0";
    case EPERM: return "EPERM";
    case EINVAL: return "EINVAL";
    case ENOSYS: return "ENOSYS";
    case EFAULT: return "EFAULT";
    case ENODEV: return "ENODEV";
    case EACCES: return "EACCES";
    case EIO: return "EIO";
    case ESRCH: return "ESRCH";
    case EBUSY: return "EBUSY";
    case ENOMEM: return "ENOMEM";
    case ENOSPC: return "ENOSPC";
    case EOPNOTSUPP: return "EOPNOTSUPP";
    case EAGAIN: return "EAGAIN";
    default: {
        static char buf[16];
        snprintf(buf, sizeof buf, "E%d", e);
        return buf;
    }
    }
}

void set_probe(uintptr_t a) {
    g_probe = a;
    g_probe_set = 1;
}

static int near(uintptr_t a, uintptr_t base, uintptr_t len) { return a >= base && a - base < len; }

const char *fmt_addr(uintptr_t a, char *buf, size_t n) {
    if (a == 0)
        snprintf(buf, n, "0");
    else if (g_probe_set && a == g_probe)
        snprintf(buf, n, "probe");
    else if (g_probe_set && near(a, g_probe, 65536))
        snprintf(buf, n, "probe+%lu", (unsigned long)(a - g_probe));
    else if (g_insn && a == g_insn)
        snprintf(buf, n, "insn");
    else if (g_insn && near(a, g_insn, 4096))
        snprintf(buf, n, "insn+%lu", (unsigned long)(a - g_insn));
    else if (g_insn && near(a + 64, g_insn, 64))
        snprintf(buf, n, "insn-%lu", (unsigned long)(g_insn - a));
    else if (a < 0x10000)
        snprintf(buf, n, "%#lx", (unsigned long)a);
#ifdef __x86_64__
    else if (a >= 0x0000800000000000ULL)
        snprintf(buf, n, "%#lx", (unsigned long)a);
#else
    else if (a >= 0xfffff000u)
        snprintf(buf, n, "%#lx", (unsigned long)a);
#endif
    else if (near(a, (uintptr_t)lowstack, sizeof lowstack))
        snprintf(buf, n, "lowstack+%lu", (unsigned long)(a - (uintptr_t)lowstack));
    else if (near(a, (uintptr_t)altstack, sizeof altstack))
        snprintf(buf, n, "altstack");
    else if (near(a, (uintptr_t)__executable_start, (uintptr_t)(_end - __executable_start)))
        snprintf(buf, n, "image+%#lx", (unsigned long)(a - (uintptr_t)__executable_start));
    else if (near(a + (8u << 20), g_stack_hint, 16u << 20))
        snprintf(buf, n, "stack");
    else
        snprintf(buf, n, "other");
    return buf;
}

void out_fault(const char *prefix) {
    char a[48], at[48];
    out("%ssig %s code=%d addr=%s at=%s trap=%lu err=%#lx", prefix, signame(g_fault.signo),
        g_fault.code, fmt_addr(g_fault.addr, a, sizeof a), fmt_addr(g_fault.ip, at, sizeof at),
        (unsigned long)g_fault.trapno, (unsigned long)g_fault.err);
}

/* ---- CPU ------------------------------------------------------------------------- */

int feat(uint32_t leaf, uint32_t sub, int reg, int bit) {
    uint32_t r[4];
    if (__get_cpuid_max(leaf & 0x80000000u, NULL) < leaf)
        return 0;
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
    return (int)((r[reg] >> bit) & 1);
}

const char *vendor(void) {
    static char v[13];
    uint32_t a, b, c, d;
    __cpuid(0, a, b, c, d);
    (void)a;
    memcpy(v, &b, 4);
    memcpy(v + 4, &d, 4);
    memcpy(v + 8, &c, 4);
    v[12] = 0;
    return v;
}

uintptr_t get_flags(void) {
    uintptr_t f;
    __asm__ volatile("pushf\n\tpop %0" : "=r"(f) : : "memory");
    return f;
}

void set_flags(uintptr_t f) { __asm__ volatile("push %0\n\tpopf" : : "g"(f) : "memory", "cc"); }

/* ---- signals --------------------------------------------------------------------- */

uintptr_t *uc_ip(void *ucv) {
    ucontext_t *uc = ucv;
#ifdef __x86_64__
    return (uintptr_t *)&uc->uc_mcontext.gregs[REG_RIP];
#else
    return (uintptr_t *)&uc->uc_mcontext.gregs[REG_EIP];
#endif
}

uintptr_t *uc_flags(void *ucv) {
    ucontext_t *uc = ucv;
    return (uintptr_t *)&uc->uc_mcontext.gregs[REG_EFL];
}

void record_fault(int sig, siginfo_t *si, void *ucv) {
    ucontext_t *uc = ucv;
    g_fault.signo = sig;
    g_fault.code = si->si_code;
    g_fault.addr = (uintptr_t)si->si_addr;
    g_fault.ip = *uc_ip(ucv);
    g_fault.flags = *uc_flags(ucv);
    g_fault.trapno = (uintptr_t)uc->uc_mcontext.gregs[REG_TRAPNO];
    g_fault.err = (uintptr_t)uc->uc_mcontext.gregs[REG_ERR];
}

void on_fault(int sig, siginfo_t *si, void *ucv) {
    /* The kernel clears TF and DF for a handler, not AC or NT: clear them before any
     * other code runs (AC would fault on a misaligned access in the C library). */
    set_flags(get_flags() & ~(uintptr_t)(FL_AC | FL_NT));
    record_fault(sig, si, ucv);
    if (g_resume) {
        *uc_ip(ucv) = g_resume;
        *uc_flags(ucv) &= ~(uintptr_t)(FL_AC | FL_TF | FL_NT);
        g_resume = 0;
        return;
    }
    siglongjmp(g_env, 1);
}

void install_handler(void (*h)(int, siginfo_t *, void *)) {
    static const int sigs[] = {SIGSEGV, SIGILL, SIGTRAP, SIGBUS, SIGFPE};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = h;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        if (sigaction(sigs[i], &sa, NULL))
            _exit(121);
}

/* ---- running the cases ----------------------------------------------------------- */

static void child(const struct conform_case *c, int fd) {
    g_outfd = fd;
    g_case_name = c->name;
    int here;
    g_stack_hint = (uintptr_t)&here;
    stack_t ss = {.ss_sp = altstack, .ss_size = sizeof altstack, .ss_flags = 0};
    if (sigaltstack(&ss, NULL))
        _exit(122);
    install_handler(on_fault);
    /* A case that hangs (a wait instruction that never wakes) ends as `killed SIGALRM`. */
    alarm(20);
    if (c->run)
        c->run();
    else
        c->run2(c->a, c->b);
    _exit(0);
}

static void run_case(const struct conform_case *c) {
    int fds[2];
    if (pipe(fds)) {
        perror("pipe");
        exit(2);
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(2);
    }
    if (pid == 0) {
        close(fds[0]);
        child(c, fds[1]);
    }
    close(fds[1]);
    char buf[1024];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fds[0], buf + len, sizeof buf - 1 - len);
        if (r > 0) {
            len += (size_t)r;
            if (len == sizeof buf - 1)
                break;
        } else if (r == 0 || errno != EINTR) {
            break;
        }
    }
    close(fds[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (len > 0) {
        fwrite(buf, 1, len, stdout);
    } else if (WIFSIGNALED(st)) {
        printf("KPIN-CONFORM %d %u %s killed %s\n", CONFORM_BITS, (unsigned)getuid(), c->name,
               signame(WTERMSIG(st)));
    } else {
        printf("KPIN-CONFORM %d %u %s exit %d\n", CONFORM_BITS, (unsigned)getuid(), c->name,
               WEXITSTATUS(st));
    }
    fflush(stdout);
}

static const struct {
    const struct conform_case *cases;
    const size_t *n;
} TABLES[] = {
    {priv_cases, &priv_ncases},
    {seg_cases, &seg_ncases},
    {fault_cases, &fault_ncases},
    {io_cases, &io_ncases},
    {debug_cases, &debug_ncases},
};

static int matches(const char *name, char **pats, int npats) {
    for (int i = 0; i < npats; i++)
        if (fnmatch(pats[i], name, 0) == 0)
            return 1;
    return 0;
}

static void drop_to(uid_t uid) {
    if (setgroups(0, NULL) || setresgid(uid, uid, uid) || setresuid(uid, uid, uid)) {
        perror("kpin-conform: dropping privileges");
        exit(2);
    }
    /* Changing credentials makes a process undumpable, which would keep it from
     * ptrace-ing its own children in the debug cases. */
    prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
}

static void usage(void) {
    fprintf(stderr, "usage: kpin-conform [--list] [--uid N] [--skip PATTERN]... [PATTERN...]\n");
    exit(2);
}

int main(int argc, char **argv) {
    char *pats[256], *skips[256];
    int npats = 0, nskips = 0, list = 0;
    long uid = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--list") == 0) {
            list = 1;
        } else if (strcmp(argv[i], "--uid") == 0 && i + 1 < argc) {
            char *end;
            uid = strtol(argv[++i], &end, 10);
            if (*end || uid < 0)
                usage();
        } else if (strcmp(argv[i], "--skip") == 0 && i + 1 < argc) {
            if (nskips < 256)
                skips[nskips++] = argv[++i];
        } else if (argv[i][0] == '-') {
            usage();
        } else if (npats < 256) {
            pats[npats++] = argv[i];
        }
    }
    for (size_t t = 0; t < sizeof TABLES / sizeof TABLES[0]; t++) {
        for (size_t i = 0; i < *TABLES[t].n; i++) {
            const struct conform_case *c = &TABLES[t].cases[i];
            if ((npats && !matches(c->name, pats, npats)) || matches(c->name, skips, nskips))
                continue;
            if (list) {
                printf("%s\n", c->name);
                continue;
            }
            static int ready;
            if (!ready) {
                ready = 1;
                cpu_set_t set;
                CPU_ZERO(&set);
                CPU_SET(0, &set);
                if (sched_setaffinity(0, sizeof set, &set)) {
                    perror("kpin-conform: sched_setaffinity(CPU 0)");
                    return 2;
                }
                if (uid >= 0)
                    drop_to((uid_t)uid);
            }
            run_case(c);
        }
    }
    return 0;
}
