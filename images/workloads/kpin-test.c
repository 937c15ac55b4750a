/*
 * kpin-test: the initramfs' native test programs, one static x86-64 binary with a
 * subcommand per test (kpin-images builds it with `gcc -static` at image-build time and
 * packs it as /bin/kpin-test; images/src/programs.rs).
 *
 *   kpin-test jit        code written at run time: mmap RW, mprotect RX, call, rewrite;
 *                        and a memfd page mapped twice, written through the writable
 *                        view while executed through the executable one
 *   kpin-test sigsegv    faults on PROT_NONE pages, recovered by siglongjmp, and faults
 *                        the handler fixes (mprotect) so that the access restarts
 *   kpin-test timer      SIGALRM from setitimer(ITIMER_REAL) interrupting a busy loop,
 *                        whose state must survive every signal delivery
 *   kpin-test forkpipe   fork, exec of /proc/self/exe, data both ways through pipes,
 *                        waitpid exit statuses
 *   kpin-test fpu        two processes doing different SSE (double, float) and x87 work,
 *                        yielding the CPU after every step, results bit-exact
 *   kpin-test probe      the isolation probe (issue #11, not one of the checksummed
 *                        tests): as uid 65534, every access outside its own memory must
 *                        fault as on a real CPU; prints `KPIN-PROBE ok <n> accesses faulted`
 *                        (`kpin-test probe FILE`: every line also goes to FILE)
 *
 * Each test prints exactly one line, `KPIN-TEST <name> ok <checksum>` (16 hex digits,
 * deterministic: images/src/workload.rs computes every checksum independently on the
 * host) and exits 0, or `KPIN-TEST <name> FAIL <reason>` and exits 1. Checksums are
 * FNV-1a 64 over the little-endian bytes of a sequence of 64-bit values.
 *
 * Build: gcc -static -O2 -ffp-contract=off (no FMA contraction: the floating-point
 * results must be the IEEE results of each written operation).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

#define PAGE 4096

static const char *test_name = "?";

static void fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

#include <stdarg.h>
static void fail(const char *fmt, ...) {
    va_list ap;
    printf("KPIN-TEST %s FAIL ", test_name);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf(" (errno %d)\n", errno);
    fflush(stdout);
    exit(1);
}

static int ok(uint64_t checksum) {
    printf("KPIN-TEST %s ok %016llx\n", test_name, (unsigned long long)checksum);
    fflush(stdout);
    return 0;
}

/* FNV-1a 64 over the eight little-endian bytes of each value. */
#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL
static uint64_t fnv(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xff;
        h *= FNV_PRIME;
    }
    return h;
}

/* ---- jit ------------------------------------------------------------------------- */

/* mov rax, imm64; add rax, rdi; ret: f(x) = x + imm. */
static void emit_add_imm(uint8_t *p, uint64_t imm) {
    p[0] = 0x48;
    p[1] = 0xb8;
    memcpy(p + 2, &imm, 8);
    p[10] = 0x48; /* add rax, rdi */
    p[11] = 0x01;
    p[12] = 0xf8;
    p[13] = 0xc3; /* ret */
}

/* The immediate of round r (same formula on the host). */
static uint64_t jit_imm(uint64_t r) { return 0x0123456789abcdefULL * (r + 1) + 0x1111 * r; }

#define JIT_ROUNDS 4
#define JIT_CALLS 256

typedef uint64_t (*fn_t)(uint64_t);

/* Calls f for the round's inputs, checks every result, folds them into h. */
static uint64_t jit_calls(fn_t f, uint64_t r, uint64_t h) {
    for (uint64_t k = 0; k < JIT_CALLS; k++) {
        uint64_t x = r * 1000 + k;
        uint64_t got = f(x);
        if (got != x + jit_imm(r))
            fail("round %llu: f(%llu) = %#llx, expected %#llx", (unsigned long long)r,
                 (unsigned long long)x, (unsigned long long)got,
                 (unsigned long long)(x + jit_imm(r)));
        h = fnv(h, got);
    }
    return h;
}

static int test_jit(void) {
    uint64_t h = FNV_OFFSET;

    /* Rounds 0..3: one mapping, flipped between RW (write the code) and RX (run it). */
    uint8_t *code = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (code == MAP_FAILED)
        fail("mmap");
    for (uint64_t r = 0; r < JIT_ROUNDS; r++) {
        if (mprotect(code, PAGE, PROT_READ | PROT_WRITE))
            fail("mprotect RW");
        emit_add_imm(code, jit_imm(r));
        if (mprotect(code, PAGE, PROT_READ | PROT_EXEC))
            fail("mprotect RX");
        h = jit_calls((fn_t)(void *)code, r, h);
    }
    munmap(code, PAGE);

    /* Rounds 4..7: a memfd page mapped twice; written through the RW view while the RX
     * view, already executed, stays mapped (cross-modifying code through an alias). */
    int fd = (int)syscall(SYS_memfd_create, "kpin-jit", 0);
    if (fd < 0)
        fail("memfd_create");
    if (ftruncate(fd, PAGE))
        fail("ftruncate");
    uint8_t *rw = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    uint8_t *rx = mmap(NULL, PAGE, PROT_READ | PROT_EXEC, MAP_SHARED, fd, 0);
    if (rw == MAP_FAILED || rx == MAP_FAILED)
        fail("mmap memfd");
    for (uint64_t r = JIT_ROUNDS; r < 2 * JIT_ROUNDS; r++) {
        emit_add_imm(rw, jit_imm(r));
        /* The compiler must not move the stores past the call through the other view. */
        __asm__ volatile("" ::: "memory");
        h = jit_calls((fn_t)(void *)rx, r, h);
    }
    munmap(rw, PAGE);
    munmap(rx, PAGE);
    close(fd);
    return ok(h);
}

/* ---- sigsegv --------------------------------------------------------------------- */

#define SEGV_PAGES 16

static sigjmp_buf segv_env;
static volatile uintptr_t segv_addr;
static uint8_t *segv_base;
static volatile int segv_fixups;

static void on_segv_jump(int sig, siginfo_t *info, void *uctx) {
    (void)sig;
    (void)uctx;
    segv_addr = (uintptr_t)info->si_addr;
    siglongjmp(segv_env, 1);
}

static void on_segv_fixup(int sig, siginfo_t *info, void *uctx) {
    (void)sig;
    (void)uctx;
    uintptr_t page = (uintptr_t)info->si_addr & ~(uintptr_t)(PAGE - 1);
    if (page < (uintptr_t)segv_base || page >= (uintptr_t)segv_base + SEGV_PAGES * PAGE)
        _exit(3); /* a fault we did not cause: no printf in a handler */
    if (mprotect((void *)page, PAGE, PROT_READ | PROT_WRITE))
        _exit(4);
    segv_fixups++;
}

static void install(void (*handler)(int, siginfo_t *, void *)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL))
        fail("sigaction");
}

static int test_sigsegv(void) {
    /* Static: a local would not survive siglongjmp reliably. */
    static uint64_t h;
    h = FNV_OFFSET;
    segv_base = mmap(NULL, SEGV_PAGES * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (segv_base == MAP_FAILED)
        fail("mmap");

    /* Recovery by siglongjmp: each read faults, the handler jumps back. */
    install(on_segv_jump);
    for (uint64_t i = 0; i < SEGV_PAGES; i++) {
        volatile uint64_t *p = (volatile uint64_t *)(segv_base + i * PAGE + i * 8);
        segv_addr = 0;
        if (sigsetjmp(segv_env, 1) == 0) {
            (void)*p;
            fail("read of PROT_NONE page %llu did not fault", (unsigned long long)i);
        }
        if (segv_addr != (uintptr_t)p)
            fail("fault address %#lx, expected %p", (unsigned long)segv_addr, (void *)p);
        h = fnv(h, (uint64_t)(segv_addr - (uintptr_t)segv_base));
    }

    /* Recovery by fixing the cause: the handler makes the page writable and returns;
     * the faulting store restarts and lands. */
    install(on_segv_fixup);
    for (uint64_t i = 0; i < SEGV_PAGES; i++)
        *(volatile uint64_t *)(segv_base + i * PAGE + 8) = i * i + 7;
    for (uint64_t i = 0; i < SEGV_PAGES; i++) {
        uint64_t v = *(volatile uint64_t *)(segv_base + i * PAGE + 8);
        if (v != i * i + 7)
            fail("page %llu holds %llu after the fixed-up store", (unsigned long long)i,
                 (unsigned long long)v);
        h = fnv(h, v);
    }
    h = fnv(h, (uint64_t)segv_fixups);
    if (segv_fixups != SEGV_PAGES)
        fail("%d fix-ups, expected %d", segv_fixups, SEGV_PAGES);
    signal(SIGSEGV, SIG_DFL);
    munmap(segv_base, SEGV_PAGES * PAGE);
    return ok(h);
}

/* ---- timer ----------------------------------------------------------------------- */

#define TIMER_TICKS 5
#define LCG_MUL 6364136223846793005ULL
#define LCG_ADD 1442695040888963407ULL

static volatile sig_atomic_t ticks;

static void on_alarm(int sig) {
    (void)sig;
    ticks++;
}

static int test_timer(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, NULL))
        fail("sigaction");
    struct itimerval it = {.it_interval = {0, 10000}, .it_value = {0, 10000}};
    if (setitimer(ITIMER_REAL, &it, NULL))
        fail("setitimer");

    /* A busy loop interrupted by the signals; its state lives in registers. */
    uint64_t x = 1, n = 0;
    while (ticks < TIMER_TICKS) {
        x = x * LCG_MUL + LCG_ADD;
        n++;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    if (setitimer(ITIMER_REAL, &off, NULL))
        fail("setitimer off");
    int seen = ticks;
    if (seen < TIMER_TICKS || seen > TIMER_TICKS + 1)
        fail("%d ticks", seen);

    /* The same n steps without signals must give the same state. */
    uint64_t y = 1;
    for (uint64_t i = 0; i < n; i++)
        y = y * LCG_MUL + LCG_ADD;
    if (x != y)
        fail("loop state %#llx after %llu steps under SIGALRM, %#llx without",
             (unsigned long long)x, (unsigned long long)n, (unsigned long long)y);
    return ok(fnv(FNV_OFFSET, TIMER_TICKS));
}

/* ---- forkpipe -------------------------------------------------------------------- */

#define CHILDREN 8
#define CHILD_INPUT 8192

/* Byte j of child c's input (same formula on the host). */
static uint8_t child_byte(uint64_t c, uint64_t j) { return (uint8_t)(j * 31 + c * 7 + (j >> 8)); }

/* The exec'd child: reads its input from stdin, writes its FNV as 16 hex digits to
 * stdout, exits with status 10 + c. */
static int forkpipe_child(const char *arg) {
    uint64_t c = strtoull(arg, NULL, 10);
    uint64_t h = FNV_OFFSET;
    uint8_t buf[1000];
    uint64_t total = 0;
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return 2;
        if (n == 0)
            break;
        for (ssize_t i = 0; i < n; i++)
            h = fnv(h, buf[i]);
        total += (uint64_t)n;
    }
    h = fnv(h, total);
    char out[17];
    snprintf(out, sizeof out, "%016llx", (unsigned long long)h);
    if (write(1, out, 16) != 16)
        return 2;
    return (int)(10 + c);
}

static int test_forkpipe(void) {
    uint64_t h = FNV_OFFSET;
    for (uint64_t c = 0; c < CHILDREN; c++) {
        int in[2], out[2];
        if (pipe(in) || pipe(out))
            fail("pipe");
        pid_t pid = fork();
        if (pid < 0)
            fail("fork");
        if (pid == 0) {
            dup2(in[0], 0);
            dup2(out[1], 1);
            close(in[0]);
            close(in[1]);
            close(out[0]);
            close(out[1]);
            char arg[24];
            snprintf(arg, sizeof arg, "%llu", (unsigned long long)c);
            char *argv[] = {"kpin-test", "forkpipe-child", arg, NULL};
            execv("/proc/self/exe", argv);
            _exit(127);
        }
        close(in[0]);
        close(out[1]);
        uint8_t data[CHILD_INPUT];
        uint64_t expect = FNV_OFFSET;
        for (uint64_t j = 0; j < CHILD_INPUT; j++) {
            data[j] = child_byte(c, j);
            expect = fnv(expect, data[j]);
        }
        expect = fnv(expect, CHILD_INPUT);
        /* More than a pipe buffer's worth in a few writes: the child runs in between. */
        for (size_t done = 0; done < CHILD_INPUT;) {
            ssize_t n = write(in[1], data + done, CHILD_INPUT - done);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                fail("write to child %llu", (unsigned long long)c);
            done += (size_t)n;
        }
        close(in[1]);
        char reply[17] = {0};
        size_t got = 0;
        while (got < 16) {
            ssize_t n = read(out[0], reply + got, 16 - got);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                break;
            got += (size_t)n;
        }
        close(out[0]);
        int status;
        if (waitpid(pid, &status, 0) != pid)
            fail("waitpid");
        if (!WIFEXITED(status) || WEXITSTATUS(status) != (int)(10 + c))
            fail("child %llu: wait status %#x", (unsigned long long)c, status);
        uint64_t value = strtoull(reply, NULL, 16);
        if (got != 16 || value != expect)
            fail("child %llu replied %s, expected %016llx", (unsigned long long)c, reply,
                 (unsigned long long)expect);
        h = fnv(h, value);
        h = fnv(h, (uint64_t)WEXITSTATUS(status));
    }
    return ok(h);
}

/* ---- fpu ------------------------------------------------------------------------- */

#define FPU_STEPS 400

/* sched_yield through a raw syscall: unlike a libc call, the compiler may keep the
 * floating-point values in XMM and x87 registers across it, so the kernel (and whatever
 * runs it) must save and restore them across the switch to the other process. */
static void yield_raw(void) {
    long nr = SYS_sched_yield;
    __asm__ volatile("syscall" : "+a"(nr) : : "rcx", "r11", "memory");
}

/* The IEEE square root (SQRTSD), without libm's errno path. */
static double sqrt_sd(double v) {
    double r;
    __asm__("sqrtsd %1, %0" : "=x"(r) : "x"(v));
    return r;
}

/* SSE double: x <- sqrt(x * 1.0000001 + 0.5) / 1.25 + step * 1e-3. */
static uint64_t fpu_double(int yield) {
    double x = 1.0;
    for (int i = 0; i < FPU_STEPS; i++) {
        x = sqrt_sd(x * 1.0000001 + 0.5) / 1.25 + (double)i * 1e-3;
        if (yield)
            yield_raw();
    }
    uint64_t bits;
    memcpy(&bits, &x, 8);
    return bits;
}

/* SSE float and x87 together: y <- y * 0.999 + 0.25 / (step + 1) in single precision;
 * z <- (z * 3 + step) mod 1e15 in x87 extended precision, exact (below 2^63). */
static uint64_t fpu_float_x87(int yield) {
    float y = 2.0f;
    long double z = 1.0L;
    for (int i = 0; i < FPU_STEPS; i++) {
        y = y * 0.999f + 0.25f / (float)(i + 1);
        long double t = z * 3.0L + (long double)i;
        __asm__ volatile("" : "+t"(t)); /* keep the x87 value in the FPU stack */
        z = t - 1e15L * (long double)(long long)(t / 1e15L);
        if (yield)
            yield_raw();
    }
    uint32_t ybits;
    memcpy(&ybits, &y, 4);
    return ((uint64_t)ybits << 32) ^ (uint64_t)(long long)z;
}

static int test_fpu(void) {
    /* References, computed alone before any other process runs. */
    uint64_t want_a = fpu_double(0), want_b = fpu_float_x87(0);
    int res[2];
    if (pipe(res))
        fail("pipe");
    pid_t pid = fork();
    if (pid < 0)
        fail("fork");
    if (pid == 0) {
        uint64_t got = fpu_float_x87(1);
        _exit(write(res[1], &got, 8) == 8 ? 0 : 1);
    }
    uint64_t got_a = fpu_double(1);
    uint64_t got_b = 0;
    if (read(res[0], &got_b, 8) != 8)
        fail("read the child's result");
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("child status %#x", status);
    if (got_a != want_a)
        fail("double result %016llx, alone %016llx", (unsigned long long)got_a,
             (unsigned long long)want_a);
    if (got_b != want_b)
        fail("float/x87 result %016llx, alone %016llx", (unsigned long long)got_b,
             (unsigned long long)want_b);
    return ok(fnv(fnv(FNV_OFFSET, got_a), got_b));
}

/* ---- probe ----------------------------------------------------------------------- */

/* The isolation probe (issue #11): as uid 65534 (dropped from root), reads, writes and
 * jumps to addresses across the whole address space, pushes a forged host I/O ring record
 * and rings the doorbell, and expects each access to fault exactly as the guest's own page
 * tables and privilege rules say on a real CPU: SIGSEGV, SEGV_MAPERR at the address for a
 * kernel-half or unmapped address, SI_KERNEL with address 0 for a non-canonical address
 * (#GP) and for port I/O at CPL 3 (#GP). Prints one line per named target and per
 * half-space scan, then `KPIN-PROBE ok <n> accesses faulted`, or `KPIN-PROBE FAIL ...`
 * naming the first access that did not fault as expected. */

#define WINDOW_VA 0xffff808000000000ULL  /* kpin_abi::stolen::WINDOW_VA, PML4 slot 257 */
#define PHYSMAP_VA 0xffff810000000000ULL /* kpin_abi::stolen::PHYSMAP_VA, slot 258 */
#define RING_VA (WINDOW_VA + 0x100000)   /* IO_RING_OFFSET: header; data 4 KiB on */
#define PROBE_UID 65534
#define SI_KERNEL_CODE 0x80

/* A_READ_BELOW reads `addr` as `[addr + 4096 - 4096]`: a base register 4 KiB above it and
 * a negative displacement (from a base of 0 the access wraps to the top of the address
 * space, which the engine's checks of user operands must cover too). */
enum access { A_READ, A_WRITE, A_EXEC, A_OUT, A_IN, A_READ_BELOW };
static const char *const ACCESS_NAME[] = {"read", "write", "exec", "out", "in", "read-below"};

static sigjmp_buf probe_env;
static volatile int probe_signo, probe_code;
static volatile uint64_t probe_addr;

static void probe_handler(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    probe_signo = sig;
    probe_code = si->si_code;
    probe_addr = (uint64_t)(uintptr_t)si->si_addr;
    siglongjmp(probe_env, 1);
}

static uint64_t probe_total, probe_bad;
static const char *probe_log_path;
static FILE *probe_log; /* `kpin-test probe FILE`: every line also goes to FILE */

static void probe_print(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void probe_print(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
    if (probe_log) {
        va_start(ap, fmt);
        vfprintf(probe_log, fmt, ap);
        va_end(ap);
        fflush(probe_log);
    }
}
static char probe_first_bad[160];

static int canonical(uint64_t a) { return (uint64_t)((int64_t)(a << 16) >> 16) == a; }

/* One access; returns 1 if it faulted as expected. `value` is what a write stores (the
 * value a read just returned, so that a write that wrongly succeeds changes nothing). */
static int probe_one(enum access kind, uint64_t addr, uint64_t value, uint64_t *read_out,
                     const char *what, int print) {
    volatile int faulted = 0;
    volatile uint64_t got = 0;
    probe_signo = probe_code = 0;
    probe_addr = 0;
    if (sigsetjmp(probe_env, 1) == 0) {
        switch (kind) {
        case A_READ:
        {
            uint64_t v;
            __asm__ volatile("movq (%1), %0" : "=r"(v) : "r"(addr) : "memory");
            got = v;
            break;
        }
        case A_WRITE:
            __asm__ volatile("movq %1, (%0)" : : "r"(addr), "r"(value) : "memory");
            break;
        case A_READ_BELOW:
        {
            uint64_t v;
            __asm__ volatile("movq -4096(%1), %0" : "=r"(v) : "r"(addr + 4096) : "memory");
            got = v;
            break;
        }
        case A_EXEC:
            ((void (*)(void))(uintptr_t)addr)();
            break;
        case A_OUT:
            __asm__ volatile("outb %b0, %w1" : : "a"((uint8_t)value), "d"((uint16_t)addr));
            break;
        case A_IN: {
            uint8_t b;
            __asm__ volatile("inb %w1, %b0" : "=a"(b) : "d"((uint16_t)addr));
            got = b;
            break;
        }
        }
    } else {
        faulted = 1;
    }
    if (read_out && !faulted)
        *read_out = got;
    int port = kind == A_OUT || kind == A_IN;
    int gp = port || !canonical(addr);
    int want_code = gp ? SI_KERNEL_CODE : SEGV_MAPERR;
    uint64_t want_addr = gp ? 0 : addr;
    int good = faulted && probe_signo == SIGSEGV && probe_code == want_code &&
               probe_addr == want_addr;
    char line[160];
    if (faulted)
        snprintf(line, sizeof line, "%s %016llx %s: signal %d code %d addr %016llx",
                 ACCESS_NAME[kind], (unsigned long long)addr, what, probe_signo, probe_code,
                 (unsigned long long)probe_addr);
    else
        snprintf(line, sizeof line, "%s %016llx %s: no fault, value %016llx",
                 ACCESS_NAME[kind], (unsigned long long)addr, what,
                 (unsigned long long)(kind == A_WRITE || kind == A_OUT ? value : got));
    probe_total++;
    if (!good && probe_bad++ == 0)
        snprintf(probe_first_bad, sizeof probe_first_bad, "%s", line);
    if (print || (!good && probe_bad <= 16))
        probe_print("KPIN-PROBE %s%s\n", good ? "" : "UNEXPECTED ", line);
    return good;
}

/* Read, then write back what was read (or a marker if the read faulted). */
static void probe_rw(uint64_t addr, const char *what, int print) {
    uint64_t v = 0x6b70696e2d70726fULL; /* "orp-nipk" */
    probe_one(A_READ, addr, 0, &v, what, print);
    probe_one(A_WRITE, addr, v, NULL, what, print);
}

static const struct {
    uint64_t addr;
    const char *what;
} PROBE_TARGETS[] = {
    {0, "null"},
    {0x00007ffffffff000ULL, "above-task-size"},
    {0x0000800000000000ULL, "non-canonical-low"},
    {0x8000000000000000ULL, "non-canonical-mid"},
    {0xffff7ffffffff000ULL, "non-canonical-high"},
    {0xffff800000000000ULL, "slot256"},
    {WINDOW_VA, "window-attach-block"},
    {WINDOW_VA + 0x8000, "window-boot-tables"},
    {RING_VA, "window-ring-header"},
    {WINDOW_VA + 0x200000, "window-engine-image"},
    {WINDOW_VA + 0x800000, "window-engine-heap"},
    {WINDOW_VA + 0x4800000, "window-code-cache"},
    {WINDOW_VA + 0x6800000, "window-shadow-tables"},
    {WINDOW_VA + (112 << 20) - 8, "window-last"},
    {PHYSMAP_VA, "physmap-pa0"},
    {PHYSMAP_VA + 0x7000 + 0x200, "physmap-zero-page-hdrs"},
    {PHYSMAP_VA + 0x1000000, "physmap-kernel-text"},
    {PHYSMAP_VA + 0x40000000, "physmap-1gib"},
    {PHYSMAP_VA + 0x100000000ULL, "physmap-4gib-stolen-region"},
    {0xffff818000000000ULL, "slot259"},
    {0xffff888000000000ULL + 0x1000000, "linux-direct-map"},
    {0xffffc90000000000ULL, "linux-vmalloc"},
    {0xffffea0000000000ULL, "linux-vmemmap"},
    {0xfffffe0000000000ULL, "linux-cpu-entry-area"},
    {0xffffffff81000000ULL, "linux-kernel-text"},
    {0xffffffffa0000000ULL, "linux-modules"},
    {0xfffffffffffff000ULL, "top-page"},
};

/* A lower-half address in PML4 slot `slot` that this process has not mapped. */
static uint64_t unmapped_in_slot(unsigned slot) {
    unsigned char vec;
    for (uint64_t off = 0; off < (1ULL << 39); off += 1ULL << 30) {
        uint64_t a = ((uint64_t)slot << 39) + off;
        if (a + PAGE > 0x00007ffffffff000ULL)
            break;
        if (mincore((void *)(uintptr_t)a, PAGE, &vec) != 0 && errno == ENOMEM)
            return a;
    }
    return 0x00007ffffffff000ULL; /* beyond the last user page */
}

static int test_probe(void) {
    if (probe_log_path && !(probe_log = fopen(probe_log_path, "w")))
        fail("open %s", probe_log_path);
    if (geteuid() == 0 &&
        (setgroups(0, NULL) || setgid(PROBE_UID) || setuid(PROBE_UID)))
        fail("drop to uid %d", PROBE_UID);
    if (getuid() == 0 || geteuid() == 0 || setuid(0) == 0)
        fail("still root");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = probe_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) || sigaction(SIGBUS, &sa, NULL))
        fail("sigaction");
    probe_print("KPIN-PROBE uid %d\n", (int)getuid());

    /* Named targets: read, then write back what was read. */
    for (size_t i = 0; i < sizeof PROBE_TARGETS / sizeof PROBE_TARGETS[0]; i++)
        probe_rw(PROBE_TARGETS[i].addr, PROBE_TARGETS[i].what, 1);

    /* Reads through a base register above the target: a base of 0 (the access wraps to
     * the top page), one in the kernel's text, one in the engine's window. */
    static const uint64_t BELOW[] = {0xfffffffffffff000ULL, 0xffffffff81000000ULL, WINDOW_VA};
    for (size_t i = 0; i < sizeof BELOW / sizeof BELOW[0]; i++)
        probe_one(A_READ_BELOW, BELOW[i], 0, NULL, "read-below", 1);

    /* Every PML4 slot: the first unmapped address of each lower-half slot, the start of
     * each upper-half one. */
    uint64_t before = probe_bad, n = probe_total;
    for (unsigned slot = 0; slot < 256; slot++)
        probe_rw(unmapped_in_slot(slot), "lower-slot", 0);
    probe_print("KPIN-PROBE slots 0-255: %llu accesses, %llu unexpected\n",
           (unsigned long long)(probe_total - n), (unsigned long long)(probe_bad - before));
    before = probe_bad;
    n = probe_total;
    for (unsigned slot = 256; slot < 512; slot++)
        probe_rw(0xffff000000000000ULL | ((uint64_t)slot << 39), "upper-slot", 0);
    probe_print("KPIN-PROBE slots 256-511: %llu accesses, %llu unexpected\n",
           (unsigned long long)(probe_total - n), (unsigned long long)(probe_bad - before));

    /* A forged host I/O ring record: read the producer's head, write an Open record for
     * "probe-was-here.txt" (kind 1, file 77) where it would go, publish it, ring the
     * doorbell (port 0x0f10). */
    uint64_t head = 0;
    probe_one(A_READ, RING_VA + 64, 0, &head, "ring-head", 1);
    static const char name[] = "probe-was-here.txt";
    uint64_t rec = 1 | (77ULL << 16) | ((uint64_t)(sizeof name - 1) << 32);
    uint64_t slot_va = RING_VA + 0x1000 + (head % 0x80000);
    probe_one(A_WRITE, slot_va, rec, NULL, "ring-record", 1);
    for (size_t off = 0; off < sizeof name - 1; off += 8) {
        uint64_t w = 0;
        memcpy(&w, name + off, sizeof name - 1 - off < 8 ? sizeof name - 1 - off : 8);
        probe_one(A_WRITE, slot_va + 8 + off, w, NULL, "ring-record-name", 1);
    }
    probe_one(A_WRITE, RING_VA + 64, head + 8 + ((sizeof name - 1 + 7) & ~7ULL), NULL,
              "ring-head", 1);
    /* Port I/O at CPL 3 with IOPL 0: #GP. The doorbell, the engine's failure and attach
     * ports, COM1, the i8042 reset and the ACPI reset port. */
    static const uint16_t PORTS[] = {0x0f10, 0x0f11, 0x0f12, 0x03f8, 0x0064, 0x0cf9};
    for (size_t i = 0; i < sizeof PORTS / sizeof PORTS[0]; i++) {
        probe_one(A_IN, PORTS[i], 0, NULL, "port", 1);
        probe_one(A_OUT, PORTS[i], PORTS[i] == 0x0064 ? 0xfe : 6, NULL, "port", 1);
    }

    /* Last, a jump to each canonical named target (not the non-canonical ones: a jump
     * there faults on the jump on one vendor and at the target on the other). */
    for (size_t i = 0; i < sizeof PROBE_TARGETS / sizeof PROBE_TARGETS[0]; i++)
        if (canonical(PROBE_TARGETS[i].addr))
            probe_one(A_EXEC, PROBE_TARGETS[i].addr, 0, NULL, PROBE_TARGETS[i].what, 1);

    if (probe_bad) {
        probe_print("KPIN-PROBE FAIL %llu of %llu accesses did not fault as expected; first: %s\n",
                    (unsigned long long)probe_bad, (unsigned long long)probe_total,
                    probe_first_bad);
        return 1;
    }
    probe_print("KPIN-PROBE ok %llu accesses faulted\n", (unsigned long long)probe_total);
    return 0;
}

/* ---- count: a known number of user instructions ------------------------------------ */

/* `kpin-test count N`: renames itself `kpin-count` (prctl), then runs a loop of exactly
 * 2 * N user instructions (`dec; jnz`), prints `KPIN-COUNT <N>` and exits. The row of
 * `kpin-count` in kpin's per-process table must hold those instructions (issue #27,
 * tests/linux_processes.rs). */
__attribute__((noinline)) static int count_loop(const char *arg) {
    char *end;
    unsigned long n = strtoul(arg, &end, 10);
    if (*arg == 0 || *end != 0 || n == 0) {
        fprintf(stderr, "kpin-test count: N must be a positive number\n");
        return 2;
    }
    if (prctl(PR_SET_NAME, "kpin-count", 0, 0, 0) != 0)
        return 1;
    unsigned long left = n;
    __asm__ volatile("1: dec %0\n\tjnz 1b" : "+r"(left) : : "cc");
    printf("KPIN-COUNT %lu\n", n);
    return 0;
}

/* ---- main ------------------------------------------------------------------------ */

static const struct {
    const char *name;
    int (*run)(void);
} TESTS[] = {
    {"jit", test_jit},         {"sigsegv", test_sigsegv}, {"timer", test_timer},
    {"forkpipe", test_forkpipe}, {"fpu", test_fpu},     {"probe", test_probe},
};

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "forkpipe-child") == 0)
        return forkpipe_child(argv[2]);
    if (argc == 3 && strcmp(argv[1], "count") == 0)
        return count_loop(argv[2]);
    if (argc == 3 && strcmp(argv[1], "probe") == 0) {
        /* The log is opened before the probe drops root. */
        probe_log_path = argv[2];
        test_name = "probe";
        return test_probe();
    }
    if (argc == 2) {
        for (size_t i = 0; i < sizeof TESTS / sizeof TESTS[0]; i++) {
            if (strcmp(argv[1], TESTS[i].name) == 0) {
                test_name = TESTS[i].name;
                return TESTS[i].run();
            }
        }
    }
    fprintf(stderr, "usage: kpin-test jit|sigsegv|timer|forkpipe|fpu|probe | count N\n");
    return 2;
}
