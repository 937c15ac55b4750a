/*
 * conform-fault.c: exceptions raised by user code (kpin-conform): #DE, #PF at null, at
 * kernel (upper-half) and non-canonical addresses through many instruction forms (a
 * read-modify-write of a kernel address must be SIGSEGV, not SIGILL), #GP, #SS, #AC,
 * SSE #XM, x87 #MF, #BR; undefined and invalid opcodes; the 32-bit build's legacy
 * instructions.
 */
#include "conform.h"

#include <asm/ldt.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

uintptr_t conform_fault_sp __attribute__((used));

/* ---- #DE -------------------------------------------------------------------------------- */

INSN(c_div_zero, "mov $1, %%eax\n\txor %%edx, %%edx\n\txor %%ecx, %%ecx\n\t", "div %%ecx")
INSN(c_div8_zero, "mov $1, %%eax\n\txor %%ecx, %%ecx\n\t", "div %%cl")
INSN(c_div_overflow, "xor %%eax, %%eax\n\tmov $1, %%edx\n\tmov $1, %%ecx\n\t", "div %%ecx")
INSN(c_idiv_int_min, "mov $0x80000000, %%eax\n\tcltd\n\tmov $-1, %%ecx\n\t", "idiv %%ecx")
#ifdef __x86_64__
INSN(c_idiv64_int_min, "movabs $0x8000000000000000, %%rax\n\tcqto\n\tmov $-1, %%rcx\n\t",
     "idiv %%rcx")
#endif
/* aam 0: #DE in 32-bit code, #UD in 64-bit mode. */
INSN(c_aam_0, "mov $10, %%eax\n\t", ".byte 0xd4, 0x00")

/* ---- memory accesses ------------------------------------------------------------------ */

enum acc {
    A_READ,
    A_WRITE,
    A_EXEC,
    A_RMW, /* v = *p; *p = v: one load and one store through the same base register */
    A_LOCK_ADD,
    A_PUSH_MEM,
    A_POP_MEM,
    A_MOVS_FROM,
    A_MOVS_TO,
    A_XCHG,
    A_CMPXCHG,
    A_FXSAVE,
    A_READ8,   /* an 8-byte read (straddling the canonical boundary) */
    A_SS_READ, /* a read through an SS override */
};

#ifdef __x86_64__
#define PUSHM "pushq"
#define POPM "popq"
#else
#define PUSHM "pushl"
#define POPM "popl"
#endif

/* One access of kind `k` at `addr` (named `probe`). */
static void access_case(uintptr_t k, uintptr_t addr) {
    set_probe(addr);
    TRY {
        uintptr_t v = 0;
        switch (k) {
        case A_READ:
            __asm__ volatile(MARK "movzbl (%1), %k0" : "=r"(v) : "r"(addr) : CLOB);
            break;
        case A_WRITE:
            __asm__ volatile(MARK "movb $0, (%0)" : : "r"(addr) : CLOB);
            break;
        case A_EXEC:
            /* rdi = rsi = 0: the vsyscall page's gettimeofday(NULL, NULL), emulated
             * where the kernel has vsyscall emulation. */
            __asm__ volatile("xor %%edi, %%edi\n\txor %%esi, %%esi\n\t" MARK "call *%0"
                             :
                             : "m"(addr)
                             : CLOB_ALL);
            break;
        case A_RMW:
            __asm__ volatile(MARK "mov (%1), %0\n\tmov %0, (%1)" : "=&r"(v) : "r"(addr) : CLOB);
            break;
        case A_LOCK_ADD:
            __asm__ volatile(MARK "lock addl $0, (%0)" : : "r"(addr) : CLOB);
            break;
        case A_PUSH_MEM:
            __asm__ volatile(MARK PUSHM " (%1)\n\tpop %0" : "=r"(v) : "r"(addr) : CLOB);
            break;
        case A_POP_MEM:
            __asm__ volatile("push %1\n\t" MARK POPM " (%0)" : : "r"(addr), "r"(v) : CLOB);
            break;
        case A_MOVS_FROM:
            __asm__ volatile(LEA("conform_buf", DI) "mov %0, " SI "\n\tmov $8, %%ecx\n\t" MARK
                             "rep movsb"
                             :
                             : "m"(addr)
                             : CLOB_ALL);
            break;
        case A_MOVS_TO:
            __asm__ volatile(LEA("conform_buf", SI) "mov %0, " DI "\n\tmov $8, %%ecx\n\t" MARK
                             "rep movsb"
                             :
                             : "m"(addr)
                             : CLOB_ALL);
            break;
        case A_XCHG:
            __asm__ volatile(MARK "xchg %0, (%1)" : "+r"(v) : "r"(addr) : CLOB);
            break;
        case A_CMPXCHG:
            __asm__ volatile(MARK "lock cmpxchg %2, (%1)" : "+a"(v) : "r"(addr), "r"(v) : CLOB);
            break;
        case A_FXSAVE:
            __asm__ volatile(MARK "fxsave (%0)" : : "r"(addr) : CLOB);
            break;
        case A_READ8: {
            uint32_t lo, hi;
            __asm__ volatile(MARK "movq (%2), %%xmm0\n\tmovd %%xmm0, %0\n\tpsrlq $32, %%xmm0\n\t"
                             "movd %%xmm0, %1"
                             : "=r"(lo), "=r"(hi)
                             : "r"(addr)
                             : CLOB_X);
            v = lo ^ hi;
            break;
        }
        case A_SS_READ:
            __asm__ volatile(MARK "movzbl %%ss:(%1), %k0" : "=r"(v) : "r"(addr) : CLOB);
            break;
        }
        (void)v;
        out("ok");
    }
    else out_fault("");
}

/* Accesses to a page of our own with the given protection: SEGV_ACCERR. */
static void own_page_case(uintptr_t k, uintptr_t prot) {
    void *p = mmap(NULL, 4096, (int)prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        out("mmap failed");
        return;
    }
    access_case(k, (uintptr_t)p + (k == A_EXEC ? 0 : 8));
}

/* A store into the program's own text. */
static void c_write_text(void) { access_case(A_WRITE, (uintptr_t)c_write_text); }

/* ---- #SS ------------------------------------------------------------------------------------ */

#ifdef __x86_64__
/* A push with a non-canonical stack pointer: #SS(0). */
INSN(c_ss_push_noncanonical,
     "mov %%rsp, %%r8\n\tmovabs $0x8000000000001000, %%rax\n\tmov %%rax, %%rsp\n\t",
     "push %%rax\n\tmov %%r8, %%rsp")
INSN(c_ss_read_noncanonical,
     "mov %%rsp, %%r8\n\tmovabs $0x8000000000001000, %%rax\n\tmov %%rax, %%rsp\n\t",
     "mov (%%rsp), %%rax\n\tmov %%r8, %%rsp")
#endif

/* SS loaded with an LDT data segment (base conform_buf, limit 0xff) and a stack pointer
 * beyond the limit: #SS(0) in 32-bit code; 64-bit mode has no limit (the push writes
 * at 0x1fc). */
static void c_ss_limit_push(void) {
    struct user_desc d;
    memset(&d, 0, sizeof d);
    d.entry_number = 5;
    d.base_addr = (unsigned)(uintptr_t)conform_buf;
    d.limit = 0xff;
    d.seg_32bit = 1;
    d.useable = 1;
    char p[64];
    snprintf(p, sizeof p, "modify_ldt=%s ",
             syscall(SYS_modify_ldt, 1, &d, sizeof d) ? errname(errno) : "0");
    TRY {
#ifdef __x86_64__
        __asm__ volatile("mov %%rsp, %%r8\n\tmov %%ss, %%ecx\n\tmov $0x2f, %%eax\n\t"
                         "mov %%eax, %%ss\n\tmov $0x200, %%esp\n\t" MARK
                         "push %%rax\n\tmov %%ecx, %%ss\n\tmov %%r8, %%rsp"
                         :
                         :
                         : CLOB, "rax", "rcx", "r8");
#else
        __asm__ volatile("mov %%esp, conform_fault_sp\n\tmov %%ss, %%ecx\n\tmov $0x2f, %%eax\n\t"
                         "mov %%eax, %%ss\n\tmov $0x200, %%esp\n\t" MARK
                         "push %%eax\n\tmov %%ecx, %%ss\n\tmov conform_fault_sp, %%esp"
                         :
                         :
                         : CLOB, "eax", "ecx");
#endif
        out("%sok", p);
    }
    else out_fault(p);
}

/* ---- #AC --------------------------------------------------------------------------------- */

#ifdef __x86_64__
#define SET_RESUME "lea 2f(%%rip), %%rax\n\tmov %%rax, g_resume(%%rip)\n\t"
#else
#define SET_RESUME "movl $2f, g_resume\n\t"
#endif
#define AC_ON "pushf\n\torl $0x40000, (" SP ")\n\tpopf\n\t"
#define AC_OFF "pushf\n\tandl $~0x40000, (" SP ")\n\tpopf\n\t"

/* Alignment checks (CR0.AM is set by Linux; EFLAGS.AC by the case): the handler
 * resumes after the access with AC cleared (g_resume). */
static void ac_case(uintptr_t kind, uintptr_t unused) {
    (void)unused;
    g_fault.signo = 0;
    if (kind == 0) /* misaligned 4-byte load */
        __asm__ volatile(SET_RESUME AC_ON LEA("conform_buf", DI) MARK "mov 1(" DI "), %%eax\n2:\t" AC_OFF
                         : : : CLOB_ALL);
    else if (kind == 1) /* aligned load */
        __asm__ volatile(SET_RESUME AC_ON LEA("conform_buf", DI) MARK "mov 4(" DI "), %%eax\n2:\t" AC_OFF
                         : : : CLOB_ALL);
    else if (kind == 2) /* misaligned store */
        __asm__ volatile(SET_RESUME AC_ON LEA("conform_buf", DI) MARK "movw %%ax, 3(" DI ")\n2:\t" AC_OFF
                         : : : CLOB_ALL);
    else if (kind == 3) /* misaligned load without AC */
        __asm__ volatile(SET_RESUME LEA("conform_buf", DI) MARK "mov 1(" DI "), %%eax\n2:\t"
                         : : : CLOB_ALL);
    else /* a push with a misaligned stack pointer */
        __asm__ volatile(SET_RESUME "mov " SP ", " SI "\n\t" AC_ON "sub $1, " SP "\n\t" MARK
                         "push " AX "\n2:\tmov " SI ", " SP "\n\t" AC_OFF
                         : : : CLOB_ALL);
    g_resume = 0;
    if (g_fault.signo)
        out_fault("");
    else
        out("ok");
}

/* ---- SSE #XM, x87 #MF ------------------------------------------------------------------- */

/* The operand pairs of the SSE cases and the operation each gets. */
static const struct {
    float a, b;
    int op; /* 0 divss, 1 sqrtss (of a), 2 mulss, 3 addss */
} XM_INPUTS[] = {
    {1.0f, 0.0f, 0},    /* ZE */
    {-1.0f, 1.0f, 1},   /* IE */
    {3e38f, 3e38f, 2},  /* OE, PE */
    {1e-30f, 1e-30f, 2}, /* UE, PE */
    {1.0f, 1e-30f, 3},  /* PE */
    {1.0f, 1e-40f, 3},  /* DE (a denormal operand), PE */
};

/* MXCSR with exception `bit` (0 IE, 1 DE, 2 ZE, 3 OE, 4 UE, 5 PE) unmasked (all masked
 * when bit > 5), then the operation of XM_INPUTS[in]: SIGFPE with the si_code Linux
 * derives from the unmasked flags; masked, the MXCSR flags. */
static void xm_case(uintptr_t bit, uintptr_t in) {
    uint32_t csr = bit > 5 ? 0x1f80u : 0x1f80u & ~(0x80u << bit), after = 0, dflt = 0x1f80;
    float a = XM_INPUTS[in].a, b = XM_INPUTS[in].b;
    TRY {
        switch (XM_INPUTS[in].op) {
        case 0:
            __asm__ volatile("ldmxcsr %1\n\tmovss %2, %%xmm0\n\t" MARK "divss %3, %%xmm0\n\t"
                             "stmxcsr %0\n\tldmxcsr %4"
                             : "=m"(after)
                             : "m"(csr), "m"(a), "m"(b), "m"(dflt)
                             : CLOB_X);
            break;
        case 1:
            __asm__ volatile("ldmxcsr %1\n\t" MARK "sqrtss %2, %%xmm0\n\t"
                             "stmxcsr %0\n\tldmxcsr %3"
                             : "=m"(after)
                             : "m"(csr), "m"(a), "m"(dflt)
                             : CLOB_X);
            break;
        case 2:
            __asm__ volatile("ldmxcsr %1\n\tmovss %2, %%xmm0\n\t" MARK "mulss %3, %%xmm0\n\t"
                             "stmxcsr %0\n\tldmxcsr %4"
                             : "=m"(after)
                             : "m"(csr), "m"(a), "m"(b), "m"(dflt)
                             : CLOB_X);
            break;
        default:
            __asm__ volatile("ldmxcsr %1\n\tmovss %2, %%xmm0\n\t" MARK "addss %3, %%xmm0\n\t"
                             "stmxcsr %0\n\tldmxcsr %4"
                             : "=m"(after)
                             : "m"(csr), "m"(a), "m"(b), "m"(dflt)
                             : CLOB_X);
            break;
        }
        out("ok mxcsr-flags=%#x", after & 0x3f);
    }
    else out_fault("");
}

static void c_ldmxcsr_reserved(void) {
    uint32_t csr = 0x11f80;
    TRY {
        __asm__ volatile(MARK "ldmxcsr %0" : : "m"(csr) : CLOB);
        out("ok");
    }
    else out_fault("");
}

INSN(c_movaps_misaligned, LEA("conform_buf", DI), "movaps 8(" DI "), %%xmm0")

/* x87: control word `cw`, an operation, then fwait (the labelled instruction) raises the
 * pending #MF; masked, the status word's exception flags. */
static void mf_case(uintptr_t cw, uintptr_t op) {
    uint16_t c = (uint16_t)cw, sw = 0;
    TRY {
        if (op == 0) /* 1 / 0 */
            __asm__ volatile("fninit\n\tfldcw %1\n\tfldz\n\tfld1\n\tfdiv %%st(1), %%st\n\t" MARK
                             "fwait\n\tfnstsw %0\n\tfninit"
                             : "=m"(sw)
                             : "m"(c)
                             : CLOB, "st", "st(1)");
        else /* sqrt(-1) */
            __asm__ volatile("fninit\n\tfldcw %1\n\tfld1\n\tfchs\n\tfsqrt\n\t" MARK
                             "fwait\n\tfnstsw %0\n\tfninit"
                             : "=m"(sw)
                             : "m"(c)
                             : CLOB, "st", "st(1)");
        out("ok fsw-flags=%#x", sw & 0x3f);
    }
    else out_fault("");
}

/* ---- undefined and invalid opcodes ---------------------------------------------------- */

INSN(c_ud0, "", ".byte 0x0f, 0xff, 0xc0")
INSN(c_ud1, "", ".byte 0x0f, 0xb9, 0xc0")
INSN(c_ud2, "", "ud2")
INSN(c_op_0f04, "", ".byte 0x0f, 0x04")
INSN(c_op_0f0a, "", ".byte 0x0f, 0x0a")
INSN(c_op_0f0e, "", ".byte 0x0f, 0x0e")
INSN(c_op_0f36, "", ".byte 0x0f, 0x36")
INSN(c_op_0fa6, "", ".byte 0x0f, 0xa6, 0xc0")
INSN(c_op_fe_2, "", ".byte 0xfe, 0xd0")
INSN(c_op_ff_7, "", ".byte 0xff, 0xf8")
INSN(c_op_c6_1, "", ".byte 0xc6, 0xc8, 0x00")
INSN(c_lock_mov, "", ".byte 0xf0, 0x89, 0xc0")
INSN(c_lock_add_reg, "", ".byte 0xf0, 0x01, 0xc0")
INSN(c_lock_nop, "", ".byte 0xf0, 0x90")
INSN(c_lock_add_mem, LEA("conform_buf", DI), "lock addl $1, (" DI ")")
/* 14 operand-size prefixes and a nop: 15 bytes, the limit; one more: #GP. */
INSN(c_insn_15, "", ".fill 14, 1, 0x66\n\tnop")
INSN(c_insn_16, "", ".fill 15, 1, 0x66\n\tnop")

#ifdef __x86_64__
/* One-byte opcodes that are invalid in 64-bit mode. */
INSN(c_op64_06, "", ".byte 0x06")
INSN(c_op64_07, "", ".byte 0x07")
INSN(c_op64_0e, "", ".byte 0x0e")
INSN(c_op64_16, "", ".byte 0x16")
INSN(c_op64_17, "", ".byte 0x17")
INSN(c_op64_1e, "", ".byte 0x1e")
INSN(c_op64_1f, "", ".byte 0x1f")
INSN(c_op64_27, "", ".byte 0x27")
INSN(c_op64_2f, "", ".byte 0x2f")
INSN(c_op64_37, "", ".byte 0x37")
INSN(c_op64_3f, "", ".byte 0x3f")
INSN(c_op64_60, "", ".byte 0x60")
INSN(c_op64_61, "", ".byte 0x61")
INSN(c_op64_82, "", ".byte 0x82, 0xc0, 0x00")
INSN(c_op64_9a, "", ".byte 0x9a, 0, 0, 0, 0, 0x33, 0")
INSN(c_op64_d4, "", ".byte 0xd4, 0x0a")
INSN(c_op64_d5, "", ".byte 0xd5, 0x0a")
INSN(c_op64_d6, "", ".byte 0xd6")
INSN(c_op64_ea, "", ".byte 0xea, 0, 0, 0, 0, 0x33, 0")
#else
/* ---- 32-bit legacy instructions --------------------------------------------------------- */

/* BCD and friends: ax and the flags the instruction defines (`mask`) after `text`. */
#define VALUE(fn, setup, text, mask)                                                       \
    static void fn(void) {                                                                 \
        TRY {                                                                              \
            uint32_t v;                                                                    \
            __asm__ volatile(setup MARK text "\n\tpushf\n\tpop %%edx\n\tand $" #mask ", %%edx\n\t" \
                             "shl $16, %%edx\n\tmovzwl %%ax, %%eax\n\tor %%edx, %%eax"        \
                             : "=a"(v)                                                     \
                             :                                                             \
                             : CLOB, "edx");                                               \
            out("ok ax=%#x flags=%#x", v & 0xffff, v >> 16);                               \
        }                                                                                  \
        else out_fault("");                                                                \
    }
/* Masks: CF 0x1, PF 0x4, AF 0x10, ZF 0x40, SF 0x80, OF 0x800. */
VALUE(c_daa, "mov $0x19, %%eax\n\tadd $0x28, %%al\n\t", "daa", 0xd5)
VALUE(c_das, "mov $0x47, %%eax\n\tsub $0x28, %%al\n\t", "das", 0xd5)
VALUE(c_aaa, "mov $0x0009, %%eax\n\tadd $0x08, %%al\n\t", "aaa", 0x11)
VALUE(c_aas, "mov $0x0102, %%eax\n\tsub $0x05, %%al\n\t", "aas", 0x11)
VALUE(c_aam, "mov $0x4f, %%eax\n\t", "aam", 0xc4)
VALUE(c_aad, "mov $0x0705, %%eax\n\t", "aad", 0xc4)
VALUE(c_salc, "stc\n\tmov $0x1234, %%eax\n\t", ".byte 0xd6", 0x1)
VALUE(c_op_82, "mov $0x10, %%eax\n\t", ".byte 0x82, 0xc0, 0x05", 0x8d5)
VALUE(c_arpl, "mov $0x2b, %%eax\n\tmov $0x28, %%ecx\n\t", "arpl %%ax, %%cx\n\tmov %%ecx, %%eax", 0x40)

/* pusha/popa restore every register but esp. */
static void c_pusha_popa(void) {
    TRY {
        uint32_t sum;
        __asm__ volatile("mov $1, %%eax\n\tmov $2, %%ebx\n\tmov $3, %%ecx\n\tmov $4, %%edx\n\t"
                         "mov $5, %%esi\n\tmov $6, %%edi\n\t" MARK "pusha\n\t"
                         "xor %%eax, %%eax\n\txor %%ebx, %%ebx\n\txor %%ecx, %%ecx\n\t"
                         "xor %%edx, %%edx\n\txor %%esi, %%esi\n\txor %%edi, %%edi\n\tpopa\n\t"
                         "shl $4, %%ebx\n\tshl $8, %%ecx\n\tshl $12, %%edx\n\tshl $16, %%esi\n\t"
                         "shl $20, %%edi\n\tadd %%ebx, %%eax\n\tadd %%ecx, %%eax\n\t"
                         "add %%edx, %%eax\n\tadd %%esi, %%eax\n\tadd %%edi, %%eax"
                         : "=a"(sum)
                         :
                         : CLOB, "ebx", "ecx", "edx", "esi", "edi");
        out("ok regs=%#x", sum);
    }
    else out_fault("");
}

/* bound against [0, 10]: inside runs, outside raises #BR. */
int32_t conform_bounds[2] __attribute__((used)) = {0, 10};
static void bound_case(uintptr_t v, uintptr_t unused) {
    (void)unused;
    TRY {
        __asm__ volatile(MARK "bound %0, conform_bounds" : : "r"((uint32_t)v) : CLOB);
        out("ok");
    }
    else out_fault("");
}

/* lds from a far pointer (user data selector), restored. */
static void c_lds_user(void) {
    static struct __attribute__((packed)) {
        uint32_t off;
        uint16_t sel;
    } fp = {0x1234, 0x2b};
    TRY {
        uint32_t off, sel;
        __asm__ volatile("mov %%ds, %%ecx\n\t" MARK "lds %2, %%eax\n\tmov %%ds, %%edx\n\t"
                         "mov %%ecx, %%ds"
                         : "=a"(off), "=d"(sel)
                         : "m"(fp)
                         : CLOB, "ecx");
        out("ok off=%#x sel=%#x", off, sel & 0xffff);
    }
    else out_fault("");
}
#endif

#define ACC(name, k, addr) {name, NULL, access_case, k, (uintptr_t)(addr)}
#define KADDR(x) ((uintptr_t)(x##ULL))

const struct conform_case fault_cases[] = {
    {"div-zero", c_div_zero, NULL, 0, 0},
    {"div8-zero", c_div8_zero, NULL, 0, 0},
    {"div-quotient-overflow", c_div_overflow, NULL, 0, 0},
    {"idiv-int-min", c_idiv_int_min, NULL, 0, 0},
#ifdef __x86_64__
    {"idiv64-int-min", c_idiv64_int_min, NULL, 0, 0},
#endif
    {"aam-0", c_aam_0, NULL, 0, 0},
    ACC("read-null", A_READ, 0),
    ACC("write-null", A_WRITE, 0),
    ACC("exec-null", A_EXEC, 0),
    ACC("rmw-null", A_RMW, 0),
    {"read-prot-none", NULL, own_page_case, A_READ, PROT_NONE},
    {"write-read-only", NULL, own_page_case, A_WRITE, PROT_READ},
    {"rmw-read-only", NULL, own_page_case, A_RMW, PROT_READ},
    {"exec-no-exec", NULL, own_page_case, A_EXEC, PROT_READ | PROT_WRITE},
    {"write-text", c_write_text, NULL, 0, 0},
#ifdef __x86_64__
    ACC("read-user-top", A_READ, KADDR(0x00007ffffffff000)),
    ACC("read8-canonical-straddle", A_READ8, KADDR(0x00007ffffffffffc)),
    ACC("read-upper-start", A_READ, KADDR(0xffff800000000000)),
    ACC("write-upper-start", A_WRITE, KADDR(0xffff800000000000)),
    ACC("exec-upper-start", A_EXEC, KADDR(0xffff800000000000)),
    ACC("rmw-upper-start", A_RMW, KADDR(0xffff800000000000)),
    ACC("lock-add-upper-start", A_LOCK_ADD, KADDR(0xffff800000000000)),
    ACC("push-mem-upper-start", A_PUSH_MEM, KADDR(0xffff800000000000)),
    ACC("pop-mem-upper-start", A_POP_MEM, KADDR(0xffff800000000000)),
    ACC("movs-from-upper-start", A_MOVS_FROM, KADDR(0xffff800000000000)),
    ACC("movs-to-upper-start", A_MOVS_TO, KADDR(0xffff800000000000)),
    ACC("xchg-upper-start", A_XCHG, KADDR(0xffff800000000000)),
    ACC("cmpxchg-upper-start", A_CMPXCHG, KADDR(0xffff800000000000)),
    ACC("fxsave-upper-start", A_FXSAVE, KADDR(0xffff800000000000)),
    ACC("read-slot-257", A_READ, KADDR(0xffff808000000000)),
    ACC("write-slot-257", A_WRITE, KADDR(0xffff808000000000)),
    ACC("rmw-slot-257", A_RMW, KADDR(0xffff808000000000)),
    ACC("read-direct-map", A_READ, KADDR(0xffff888000000000)),
    ACC("write-direct-map", A_WRITE, KADDR(0xffff888000000000)),
    ACC("rmw-direct-map", A_RMW, KADDR(0xffff888000000000)),
    ACC("rmw-vmalloc", A_RMW, KADDR(0xffffc90000000000)),
    ACC("read-cpu-entry-area", A_READ, KADDR(0xfffffe0000000000)),
    ACC("write-cpu-entry-area", A_WRITE, KADDR(0xfffffe0000000000)),
    ACC("rmw-cpu-entry-area", A_RMW, KADDR(0xfffffe0000000000)),
    ACC("exec-cpu-entry-area", A_EXEC, KADDR(0xfffffe0000000000)),
    ACC("read-kernel-text", A_READ, KADDR(0xffffffff81000000)),
    ACC("write-kernel-text", A_WRITE, KADDR(0xffffffff81000000)),
    ACC("rmw-kernel-text", A_RMW, KADDR(0xffffffff81000000)),
    ACC("exec-kernel-text", A_EXEC, KADDR(0xffffffff81000000)),
    ACC("read-vsyscall", A_READ, KADDR(0xffffffffff600000)),
    ACC("exec-vsyscall", A_EXEC, KADDR(0xffffffffff600000)),
    ACC("read-top-page", A_READ, KADDR(0xfffffffffffff000)),
    ACC("rmw-top-page", A_RMW, KADDR(0xfffffffffffff000)),
    ACC("read-noncanonical", A_READ, KADDR(0x8000000000000000)),
    ACC("write-noncanonical", A_WRITE, KADDR(0x8000000000000000)),
    ACC("exec-noncanonical", A_EXEC, KADDR(0x8000000000000000)),
    ACC("rmw-noncanonical", A_RMW, KADDR(0x8000000000000000)),
    ACC("read-noncanonical-low", A_READ, KADDR(0x0000800000000000)),
    ACC("rmw-noncanonical-low", A_RMW, KADDR(0x0000800000000000)),
    ACC("read-noncanonical-high", A_READ, KADDR(0xffff7ffffffff000)),
    ACC("ss-read-noncanonical", A_SS_READ, KADDR(0x8000000000000000)),
    {"ss-push-noncanonical-rsp", c_ss_push_noncanonical, NULL, 0, 0},
    {"ss-read-noncanonical-rsp", c_ss_read_noncanonical, NULL, 0, 0},
#else
    ACC("read-top-page", A_READ, 0xfffff000u),
    ACC("write-top-page", A_WRITE, 0xfffff000u),
    ACC("exec-top-page", A_EXEC, 0xfffff000u),
    ACC("rmw-top-page", A_RMW, 0xfffff000u),
    ACC("read-above-task-size", A_READ, 0xffffe000u),
#endif
    {"ss-limit-push", c_ss_limit_push, NULL, 0, 0},
    {"ac-misaligned-load", NULL, ac_case, 0, 0},
    {"ac-aligned-load", NULL, ac_case, 1, 0},
    {"ac-misaligned-store", NULL, ac_case, 2, 0},
    {"ac-off-misaligned-load", NULL, ac_case, 3, 0},
    {"ac-misaligned-push", NULL, ac_case, 4, 0},
    {"xm-divide-by-zero", NULL, xm_case, 2, 0},
    {"xm-invalid-sqrt", NULL, xm_case, 0, 1},
    {"xm-overflow", NULL, xm_case, 3, 2},
    {"xm-underflow", NULL, xm_case, 4, 3},
    {"xm-precision", NULL, xm_case, 5, 4},
    {"xm-denormal", NULL, xm_case, 1, 5},
    {"xm-masked-divide-by-zero", NULL, xm_case, 6, 0},
    {"xm-masked-overflow", NULL, xm_case, 6, 2},
    {"ldmxcsr-reserved", c_ldmxcsr_reserved, NULL, 0, 0},
    {"movaps-misaligned", c_movaps_misaligned, NULL, 0, 0},
    {"mf-divide-by-zero", NULL, mf_case, 0x37b, 0},
    {"mf-invalid-sqrt", NULL, mf_case, 0x37e, 1},
    {"mf-masked-divide-by-zero", NULL, mf_case, 0x37f, 0},
    {"ud0", c_ud0, NULL, 0, 0},
    {"ud1", c_ud1, NULL, 0, 0},
    {"ud2", c_ud2, NULL, 0, 0},
    {"op-0f04", c_op_0f04, NULL, 0, 0},
    {"op-0f0a", c_op_0f0a, NULL, 0, 0},
    {"op-0f0e-femms", c_op_0f0e, NULL, 0, 0},
    {"op-0f36", c_op_0f36, NULL, 0, 0},
    {"op-0fa6", c_op_0fa6, NULL, 0, 0},
    {"op-fe-reg2", c_op_fe_2, NULL, 0, 0},
    {"op-ff-reg7", c_op_ff_7, NULL, 0, 0},
    {"op-c6-reg1", c_op_c6_1, NULL, 0, 0},
    {"lock-mov-reg", c_lock_mov, NULL, 0, 0},
    {"lock-add-reg", c_lock_add_reg, NULL, 0, 0},
    {"lock-nop", c_lock_nop, NULL, 0, 0},
    {"lock-add-mem", c_lock_add_mem, NULL, 0, 0},
    {"insn-15-bytes", c_insn_15, NULL, 0, 0},
    {"insn-16-bytes", c_insn_16, NULL, 0, 0},
#ifdef __x86_64__
    {"op64-06-push-es", c_op64_06, NULL, 0, 0},
    {"op64-07-pop-es", c_op64_07, NULL, 0, 0},
    {"op64-0e-push-cs", c_op64_0e, NULL, 0, 0},
    {"op64-16-push-ss", c_op64_16, NULL, 0, 0},
    {"op64-17-pop-ss", c_op64_17, NULL, 0, 0},
    {"op64-1e-push-ds", c_op64_1e, NULL, 0, 0},
    {"op64-1f-pop-ds", c_op64_1f, NULL, 0, 0},
    {"op64-27-daa", c_op64_27, NULL, 0, 0},
    {"op64-2f-das", c_op64_2f, NULL, 0, 0},
    {"op64-37-aaa", c_op64_37, NULL, 0, 0},
    {"op64-3f-aas", c_op64_3f, NULL, 0, 0},
    {"op64-60-pusha", c_op64_60, NULL, 0, 0},
    {"op64-61-popa", c_op64_61, NULL, 0, 0},
    {"op64-82", c_op64_82, NULL, 0, 0},
    {"op64-9a-call-far", c_op64_9a, NULL, 0, 0},
    {"op64-d4-aam", c_op64_d4, NULL, 0, 0},
    {"op64-d5-aad", c_op64_d5, NULL, 0, 0},
    {"op64-d6-salc", c_op64_d6, NULL, 0, 0},
    {"op64-ea-jmp-far", c_op64_ea, NULL, 0, 0},
#else
    {"daa", c_daa, NULL, 0, 0},
    {"das", c_das, NULL, 0, 0},
    {"aaa", c_aaa, NULL, 0, 0},
    {"aas", c_aas, NULL, 0, 0},
    {"aam", c_aam, NULL, 0, 0},
    {"aad", c_aad, NULL, 0, 0},
    {"salc", c_salc, NULL, 0, 0},
    {"op-82", c_op_82, NULL, 0, 0},
    {"arpl", c_arpl, NULL, 0, 0},
    {"pusha-popa", c_pusha_popa, NULL, 0, 0},
    {"bound-inside", NULL, bound_case, 5, 0},
    {"bound-outside", NULL, bound_case, 11, 0},
    {"lds-user", c_lds_user, NULL, 0, 0},
#endif
};
const size_t fault_ncases = sizeof fault_cases / sizeof fault_cases[0];
