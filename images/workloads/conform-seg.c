/*
 * conform-seg.c: selectors and segments at CPL 3 (kpin-conform): lar/lsl/verr/verw on
 * Linux's GDT selectors, segment register loads, far pointers, far transfers between the
 * 64-bit (0x33) and 32-bit (0x23) code segments and through LDT selectors set with
 * modify_ldt, and the FS/GS bases around selector loads (vendor-dependent: the line
 * carries the CPUID vendor string).
 */
#include "conform.h"

#include <asm/ldt.h>
#include <errno.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A far pointer in memory, m16:32. */
struct __attribute__((packed)) farptr {
    uint32_t off;
    uint16_t sel;
};
struct farptr conform_far __attribute__((used));      /* where a case jumps */
struct farptr conform_back_far __attribute__((used)); /* where the snippet returns */
uintptr_t conform_saved_sp __attribute__((used));

/* ---- lar, lsl, verr, verw --------------------------------------------------------- */

/* lar: ZF and the access rights (type, S, DPL, P, AVL, L, D/B, G) without the accessed
 * bit, which depends on whether the descriptor was loaded before. */
static void lar_case(uint32_t sel) {
    TRY {
        uint32_t v = 0;
        volatile uint8_t zf;
        __asm__ volatile(MARK "lar %k2, %k0\n\tsetz %1" : "+r"(v), "=m"(zf) : "r"(sel) : CLOB);
        if (zf)
            out("ok zf=1 ar=%#x", v & 0x00f0fe00u);
        else
            out("ok zf=0");
    }
    else out_fault("");
}
static void lsl_case(uint32_t sel) {
    TRY {
        uint32_t v = 0;
        volatile uint8_t zf;
        __asm__ volatile(MARK "lsl %k2, %k0\n\tsetz %1" : "+r"(v), "=m"(zf) : "r"(sel) : CLOB);
        if (zf)
            out("ok zf=1 limit=%#x", v);
        else
            out("ok zf=0");
    }
    else out_fault("");
}
static void ver_case(uint32_t sel, int write) {
    TRY {
        volatile uint8_t zf;
        if (write)
            __asm__ volatile(MARK "verw %w1\n\tsetz %0" : "=m"(zf) : "r"(sel) : CLOB);
        else
            __asm__ volatile(MARK "verr %w1\n\tsetz %0" : "=m"(zf) : "r"(sel) : CLOB);
        out("ok zf=%d", zf);
    }
    else out_fault("");
}
static void c_lar_00(void) { lar_case(0); }
static void c_lar_10(void) { lar_case(SEL_KERNEL_CS); }
static void c_lar_23(void) { lar_case(SEL_USER32_CS); }
static void c_lar_2b(void) { lar_case(SEL_USER_DS); }
static void c_lar_33(void) { lar_case(SEL_USER_CS); }
static void c_lar_40(void) { lar_case(0x40); }
static void c_lar_7b(void) { lar_case(SEL_CPUNODE); }
static void c_lar_ldt(void) { lar_case(SEL_LDT(0)); }
static void c_lsl_00(void) { lsl_case(0); }
static void c_lsl_23(void) { lsl_case(SEL_USER32_CS); }
static void c_lsl_2b(void) { lsl_case(SEL_USER_DS); }
static void c_lsl_33(void) { lsl_case(SEL_USER_CS); }
static void c_lsl_7b(void) { lsl_case(SEL_CPUNODE); }
static void c_verr_00(void) { ver_case(0, 0); }
static void c_verr_10(void) { ver_case(SEL_KERNEL_CS, 0); }
static void c_verr_23(void) { ver_case(SEL_USER32_CS, 0); }
static void c_verr_2b(void) { ver_case(SEL_USER_DS, 0); }
static void c_verr_33(void) { ver_case(SEL_USER_CS, 0); }
static void c_verw_00(void) { ver_case(0, 1); }
static void c_verw_2b(void) { ver_case(SEL_USER_DS, 1); }
static void c_verw_33(void) { ver_case(SEL_USER_CS, 1); }

/* ---- segment register loads --------------------------------------------------------- */

/* Loads `sel` into a segment register, reads it back, restores the old selector. GS is
 * the 32-bit C library's thread pointer and FS the 64-bit one: the restore follows in
 * the same asm statement (FS's base with wrfsbase: loading a selector changes it). */
#define LOAD_SEG(fn, seg)                                                                  \
    static void fn(uint32_t sel) {                                                         \
        TRY {                                                                              \
            uint32_t got;                                                                  \
            __asm__ volatile("mov %%" seg ", %%ecx\n\t" MARK "mov %k1, %%" seg "\n\t"       \
                             "mov %%" seg ", %k0\n\tmov %%ecx, %%" seg                     \
                             : "=&r"(got)                                                  \
                             : "r"(sel)                                                    \
                             : CLOB, "ecx");                                               \
            out("ok sel=%#x", got);                                                        \
        }                                                                                  \
        else out_fault("");                                                                \
    }
LOAD_SEG(load_ds, "ds")
LOAD_SEG(load_es, "es")
LOAD_SEG(load_ss, "ss")
#ifdef __x86_64__
/* Saves and restores the C library's FS base with arch_prctl(ARCH_GET_FS/ARCH_SET_FS)
 * system calls inside the asm statement (rdfsbase needs FSGSBASE, which a CPU model may
 * lack). */
#define SAVE_FS "mov $158, %%eax\n\tmov $0x1003, %%edi\n\tlea conform_fs_save(%%rip), %%rsi\n\t" \
                "syscall\n\t"
#define RESTORE_FS "mov $158, %%eax\n\tmov $0x1002, %%edi\n\tmov conform_fs_save(%%rip), %%rsi\n\t" \
                   "syscall\n\t"
uintptr_t conform_fs_save __attribute__((used));
static void load_fs(uint32_t sel) {
    TRY {
        uint32_t got;
        __asm__ volatile(SAVE_FS "mov %%fs, %%r8d\n\t" MARK "mov %k1, %%fs\n\t"
                         "mov %%fs, %k0\n\tmov %%r8d, %%fs\n\t" RESTORE_FS
                         : "=&r"(got)
                         : "r"(sel)
                         : CLOB, "rax", "rcx", "rsi", "rdi", "r8");
        out("ok sel=%#x", got);
    }
    else out_fault("");
}
#else
LOAD_SEG(load_fs, "fs")
#endif
LOAD_SEG(load_gs, "gs")

static void c_mov_ds_null(void) { load_ds(0); }
static void c_mov_es_null(void) { load_es(0); }
static void c_mov_fs_null(void) { load_fs(0); }
static void c_mov_gs_null(void) { load_gs(0); }
static void c_mov_ss_null(void) { load_ss(0); }
static void c_mov_ds_user(void) { load_ds(SEL_USER_DS); }
static void c_mov_fs_user(void) { load_fs(SEL_USER_DS); }
static void c_mov_gs_user(void) { load_gs(SEL_USER_DS); }
static void c_mov_ss_user(void) { load_ss(SEL_USER_DS); }
static void c_mov_ds_rpl0(void) { load_ds(SEL_USER_DS & ~3u); }
static void c_mov_ss_rpl0(void) { load_ss(SEL_USER_DS & ~3u); }
static void c_mov_ds_code(void) { load_ds(SEL_USER_CS); }
static void c_mov_ss_code(void) { load_ss(SEL_USER_CS); }
static void c_mov_ds_kernel(void) { load_ds(SEL_KERNEL_CS); }
static void c_mov_ds_tss(void) { load_ds(0x40); }
static void c_mov_ds_no_ldt(void) { load_ds(SEL_LDT(0)); }
static void c_mov_ds_beyond_gdt(void) { load_ds(0xfff8 | 3); }
INSN(c_mov_cs, "mov %%cs, %%eax\n\t", ".byte 0x8e, 0xc8")

#ifdef __x86_64__
static void c_push_pop_fs(void) {
    TRY {
        uint32_t got;
        /* pop fs reloads the selector, and with it (on some CPUs) the base: restored. */
        __asm__ volatile(SAVE_FS MARK "push %%fs\n\tpop %%fs\n\tmov %%fs, %k0\n\t" RESTORE_FS
                         : "=&r"(got)
                         :
                         : CLOB, "rax", "rcx", "rsi", "rdi");
        out("ok sel=%#x", got);
    }
    else out_fault("");
}
static void c_push_pop_gs(void) {
    TRY {
        uint32_t got;
        __asm__ volatile("push $0x2b\n\t" MARK "pop %%gs\n\tpush %%gs\n\tpop %%rax\n\tmov %%gs, %k0"
                         : "=r"(got)
                         :
                         : CLOB, "rax");
        out("ok sel=%#x", got);
    }
    else out_fault("");
}
#else
/* Push and pop every segment register (pop ss included). */
static void c_push_pop_segs(void) {
    TRY {
        uint32_t ds, es, ss, fs, gs;
        __asm__ volatile(MARK "push %%ds\n\tpop %%ds\n\tpush %%es\n\tpop %%es\n\t"
                         "push %%ss\n\tpop %%ss\n\tpush %%fs\n\tpop %%fs\n\tpush %%gs\n\tpop %%gs\n\t"
                         "mov %%ds, %0\n\tmov %%es, %1\n\tmov %%ss, %2\n\tmov %%fs, %3\n\tmov %%gs, %4"
                         : "=m"(ds), "=m"(es), "=m"(ss), "=m"(fs), "=m"(gs)
                         :
                         : CLOB);
        out("ok ds=%#x es=%#x ss=%#x fs=%#x gs-nonzero=%d", ds & 0xffff, es & 0xffff,
            ss & 0xffff, fs & 0xffff, (gs & 0xffff) != 0);
    }
    else out_fault("");
}
#endif

/* lss/lgs from a far pointer in memory (m16:32). */
static void load_far(int which, uint16_t sel) {
    conform_far.off = 0x1234;
    conform_far.sel = sel;
    TRY {
        uint32_t off, got;
        if (which == 0)
            __asm__ volatile("mov %%ss, %%ecx\n\t" LEA("conform_far", DI) MARK
                             "lss (" DI "), %%eax\n\tmov %%ss, %%edx\n\tmov %%ecx, %%ss"
                             : "=a"(off), "=d"(got)
                             :
                             : CLOB, "ecx", "edi");
        else
            __asm__ volatile("mov %%gs, %%ecx\n\t" LEA("conform_far", DI) MARK
                             "lgs (" DI "), %%eax\n\tmov %%gs, %%edx\n\tmov %%ecx, %%gs"
                             : "=a"(off), "=d"(got)
                             :
                             : CLOB, "ecx", "edi");
        out("ok off=%#x sel=%#x", off, got & 0xffff);
    }
    else out_fault("");
}
static void c_lss_user(void) { load_far(0, SEL_USER_DS); }
static void c_lss_null(void) { load_far(0, 0); }
static void c_lgs_user(void) { load_far(1, SEL_USER_DS); }
static void c_lgs_kernel(void) { load_far(1, SEL_KERNEL_CS); }

/* ES loaded with the null selector, then a string store through ES: #GP in 32-bit code,
 * no effect in 64-bit mode (where ES is not used). The kernel reloads ES for a 32-bit
 * signal handler. */
INSN(c_es_null_stos,
     "xor %%eax, %%eax\n\tmov %%eax, %%es\n\t" LEA("conform_buf", DI) "mov $1, %%ecx\n\t",
     "rep stosb\n\tmov $0x2b, %%eax\n\tmov %%eax, %%es")

/* ---- far transfers -------------------------------------------------------------------- */

/* The snippets a case's far transfer enters, in the other code size. Each decrements eax
 * with 0x48 (dec eax in 32- and 16-bit code, a REX prefix in 64-bit mode), copies CS to
 * ecx, and goes back through conform_back_far (or lret). */
#ifdef __x86_64__
__asm__(".pushsection .text\n"
        ".code32\n"
        ".globl conform_c32_jmp\nconform_c32_jmp:\n\t"
        ".byte 0x48\n\tmov %cs, %ecx\n\tljmp *%ss:conform_back_far\n"
        ".globl conform_c32_lret\nconform_c32_lret:\n\t"
        ".byte 0x48\n\tmov %cs, %ecx\n\tlret\n"
        /* int 0x80 from compatibility mode in a 64-bit process: eax 20 = getpid. */
        ".globl conform_c32_int80\nconform_c32_int80:\n\t"
        "mov $20, %eax\n\tint $0x80\n\tmov %cs, %ecx\n\tljmp *%ss:conform_back_far\n"
        ".code16\n"
        ".globl conform_c16_jmp\nconform_c16_jmp:\n\t"
        /* 16-bit: b8 01 00 = mov $1, %ax; in 32-bit code b8 would take 4 bytes. */
        ".byte 0xb8, 0x01, 0x00, 0x90, 0x90\n\tmov %cs, %cx\n\t"
        /* addr32 data32 ljmp *%ss:conform_back_far (SS is flat, DS may be null) */
        ".byte 0x67, 0x66, 0x36, 0xff, 0x2d\n\t.long conform_back_far\n"
        ".code64\n"
        /* The same-mode target of a far jump to the own code segment. */
        ".globl conform_self_jmp\nconform_self_jmp:\n\t"
        "mov %cs, %ecx\n\tljmp *conform_back_far(%rip)\n"
        ".popsection");
extern char conform_c32_jmp[], conform_c32_lret[], conform_c32_int80[], conform_c16_jmp[];
extern char conform_self_jmp[];
#define OTHER_JMP conform_c32_jmp
#define OTHER_LRET conform_c32_lret
#define OTHER_CS SEL_USER32_CS
#define SYSCALL_SNIPPET conform_c32_int80
#else
__asm__(".pushsection .text\n"
        ".code64\n"
        ".globl conform_c64_jmp\nconform_c64_jmp:\n\t"
        ".byte 0x48, 0x90\n\t" /* 64-bit: rex.w nop (eax unchanged) */
        "movabs $0x100000000, %rax\n\tshr $32, %rax\n\tmov %cs, %ecx\n\t"
        "ljmp *conform_back_far(%rip)\n"
        ".globl conform_c64_lret\nconform_c64_lret:\n\t"
        "movabs $0x100000000, %rax\n\tshr $32, %rax\n\tmov %cs, %ecx\n\tlretl\n"
        /* A 64-bit system call from a 32-bit process: eax 39 = getpid (the 64-bit table). */
        ".globl conform_c64_syscall\nconform_c64_syscall:\n\t"
        "mov $39, %eax\n\tsyscall\n\tmov %cs, %ecx\n\tljmp *conform_back_far(%rip)\n"
        ".code32\n"
        ".globl conform_self_jmp\nconform_self_jmp:\n\t"
        "mov %cs, %ecx\n\tljmp *conform_back_far\n"
        ".popsection");
extern char conform_c64_jmp[], conform_c64_lret[], conform_c64_syscall[], conform_self_jmp[];
#define OTHER_JMP conform_c64_jmp
#define OTHER_LRET conform_c64_lret
#define OTHER_CS SEL_USER_CS
#define SYSCALL_SNIPPET conform_c64_syscall
#endif

/* Far transfer kinds. */
enum far_kind { FAR_JMP, FAR_CALL, FAR_RETF, FAR_IRET };

/* Sets conform_far to sel:target, then transfers there with `kind` (the 64-bit build on
 * the low stack); the snippet comes back to the label after it. Prints eax (5 on entry)
 * and the CS the snippet saw. */
static void far_case(enum far_kind kind, uint16_t sel, void *target, const char *pfx) {
    conform_far.off = (uint32_t)(uintptr_t)target;
    conform_far.sel = sel;
    TRY {
        uint32_t eax = 5, cs = 0;
#ifdef __x86_64__
        switch (kind) {
        case FAR_JMP:
            __asm__ volatile("mov %%rsp, conform_saved_sp(%%rip)\n\tmov %2, %%rsp\n\t"
                             "lea 2f(%%rip), %%rdx\n\tmov %%edx, conform_back_far(%%rip)\n\t"
                             "movw $0x33, conform_back_far+4(%%rip)\n\t" MARK
                             "ljmp *conform_far(%%rip)\n2:\tmov conform_saved_sp(%%rip), %%rsp"
                             : "+a"(eax), "+c"(cs)
                             : "r"(LOWSTACK_TOP)
                             : CLOB, "rdx", "rbx", "rsi", "rdi", "r8", "r9", "r10", "r12",
                               "r13", "r14", "r15");
            break;
        case FAR_CALL:
            __asm__ volatile("mov %%rsp, conform_saved_sp(%%rip)\n\tmov %2, %%rsp\n\t" MARK
                             "lcall *conform_far(%%rip)\n\tmov conform_saved_sp(%%rip), %%rsp"
                             : "+a"(eax), "+c"(cs)
                             : "r"(LOWSTACK_TOP)
                             : CLOB, "rdx", "rbx", "rsi", "rdi", "r8", "r9", "r10", "r12",
                               "r13", "r14", "r15");
            break;
        case FAR_RETF:
            __asm__ volatile("mov %%rsp, conform_saved_sp(%%rip)\n\tmov %2, %%rsp\n\t"
                             "lea 2f(%%rip), %%rdx\n\tmov %%edx, conform_back_far(%%rip)\n\t"
                             "movw $0x33, conform_back_far+4(%%rip)\n\t"
                             "movzwl conform_far+4(%%rip), %%edx\n\tpush %%rdx\n\t"
                             "mov conform_far(%%rip), %%edx\n\tpush %%rdx\n\t" MARK
                             "lretq\n2:\tmov conform_saved_sp(%%rip), %%rsp"
                             : "+a"(eax), "+c"(cs)
                             : "r"(LOWSTACK_TOP)
                             : CLOB, "rdx", "rbx", "rsi", "rdi", "r8", "r9", "r10", "r12",
                               "r13", "r14", "r15");
            break;
        case FAR_IRET:
            __asm__ volatile("mov %%rsp, conform_saved_sp(%%rip)\n\tmov %2, %%rsp\n\t"
                             "lea 2f(%%rip), %%rdx\n\tmov %%edx, conform_back_far(%%rip)\n\t"
                             "movw $0x33, conform_back_far+4(%%rip)\n\t"
                             "push $0x2b\n\tpush %2\n\tpushfq\n\t"
                             "movzwl conform_far+4(%%rip), %%edx\n\tpush %%rdx\n\t"
                             "mov conform_far(%%rip), %%edx\n\tpush %%rdx\n\t" MARK
                             "iretq\n2:\tmov conform_saved_sp(%%rip), %%rsp"
                             : "+a"(eax), "+c"(cs)
                             : "r"(LOWSTACK_TOP)
                             : CLOB, "rdx", "rbx", "rsi", "rdi", "r8", "r9", "r10", "r12",
                               "r13", "r14", "r15");
            break;
        }
#else
        switch (kind) {
        case FAR_JMP:
            __asm__ volatile("mov %%esp, conform_saved_sp\n\t"
                             "movl $2f, conform_back_far\n\tmovw $0x23, conform_back_far+4\n\t" MARK
                             "ljmp *conform_far\n2:\tmov conform_saved_sp, %%esp"
                             : "+a"(eax), "+c"(cs)
                             :
                             : CLOB, "edx", "ebx", "esi", "edi");
            break;
        case FAR_CALL:
            __asm__ volatile("mov %%esp, conform_saved_sp\n\t" MARK
                             "lcall *conform_far\n\tmov conform_saved_sp, %%esp"
                             : "+a"(eax), "+c"(cs)
                             :
                             : CLOB, "edx", "ebx", "esi", "edi");
            break;
        case FAR_RETF:
            __asm__ volatile("mov %%esp, conform_saved_sp\n\t"
                             "movl $2f, conform_back_far\n\tmovw $0x23, conform_back_far+4\n\t"
                             "movzwl conform_far+4, %%edx\n\tpush %%edx\n\t"
                             "push conform_far\n\t" MARK "lret\n2:\tmov conform_saved_sp, %%esp"
                             : "+a"(eax), "+c"(cs)
                             :
                             : CLOB, "edx", "ebx", "esi", "edi");
            break;
        case FAR_IRET:
            __asm__ volatile("mov %%esp, conform_saved_sp\n\t"
                             "movl $2f, conform_back_far\n\tmovw $0x23, conform_back_far+4\n\t"
                             "pushf\n\tmovzwl conform_far+4, %%edx\n\tpush %%edx\n\t"
                             "push conform_far\n\t" MARK "iret\n2:\tmov conform_saved_sp, %%esp"
                             : "+a"(eax), "+c"(cs)
                             :
                             : CLOB, "edx", "ebx", "esi", "edi");
            break;
        }
#endif
        /* The snippets that make a system call leave getpid's result in eax. */
        if (target == SYSCALL_SNIPPET)
            out("%sok self=%d cs=%#x", pfx, (pid_t)eax == getpid(), cs & 0xffff);
        else
            out("%sok eax=%#x cs=%#x", pfx, eax, cs & 0xffff);
    }
    else out_fault(pfx);
}

static void c_ljmp_other(void) { far_case(FAR_JMP, OTHER_CS, OTHER_JMP, ""); }
static void c_lcall_other(void) { far_case(FAR_CALL, OTHER_CS, OTHER_LRET, ""); }
static void c_retf_other(void) { far_case(FAR_RETF, OTHER_CS, OTHER_JMP, ""); }
static void c_iret_other(void) { far_case(FAR_IRET, OTHER_CS, OTHER_JMP, ""); }
#ifdef __x86_64__
static void c_compat_int80(void) { far_case(FAR_JMP, SEL_USER32_CS, conform_c32_int80, ""); }
/* A far jump to the own code segment: a plain jump. */
static void c_ljmp_self(void) { far_case(FAR_JMP, SEL_USER_CS, conform_self_jmp, ""); }
#else
static void c_syscall64(void) { far_case(FAR_JMP, SEL_USER_CS, conform_c64_syscall, ""); }
static void c_ljmp_self(void) { far_case(FAR_JMP, SEL_USER32_CS, conform_self_jmp, ""); }
#endif
static void c_ljmp_data(void) { far_case(FAR_JMP, SEL_USER_DS, OTHER_JMP, ""); }
static void c_ljmp_kernel(void) { far_case(FAR_JMP, SEL_KERNEL_CS, OTHER_JMP, ""); }
static void c_ljmp_null(void) { far_case(FAR_JMP, 0, OTHER_JMP, ""); }
static void c_lcall_kernel(void) { far_case(FAR_CALL, SEL_KERNEL_CS, OTHER_LRET, ""); }

/* ---- LDT ------------------------------------------------------------------------------- */

/* modify_ldt(1, ...) for entry `n`; returns 0 or an errno. */
static int set_ldt(unsigned n, uintptr_t base, unsigned limit, int code, int bits32, int pages,
                   int present) {
    struct user_desc d;
    memset(&d, 0, sizeof d);
    d.entry_number = n;
    d.base_addr = (unsigned)base;
    d.limit = limit;
    d.seg_32bit = (unsigned)bits32;
    d.contents = code ? MODIFY_LDT_CONTENTS_CODE : MODIFY_LDT_CONTENTS_DATA;
    d.limit_in_pages = (unsigned)pages;
    d.seg_not_present = (unsigned)!present;
    d.useable = 1;
    long r = syscall(SYS_modify_ldt, 1, &d, sizeof d);
    return r == 0 ? 0 : errno;
}

/* A 32-bit code segment in the LDT (entry 0, selector 7): far jmp and far call. */
static void ldt_code32(int call) {
    char p[64];
    int r = set_ldt(0, 0, 0xfffff, 1, 1, 1, 1);
    snprintf(p, sizeof p, "modify_ldt=%s ", errname(r));
    if (r) {
        out("%s", p);
        return;
    }
#ifdef __x86_64__
    far_case(call ? FAR_CALL : FAR_JMP, SEL_LDT(0), call ? conform_c32_lret : conform_c32_jmp, p);
#else
    /* In the 32-bit build, jump to the own code through the LDT alias. */
    conform_far.sel = SEL_LDT(0);
    TRY {
        uint32_t cs = 0;
        if (call)
            __asm__ volatile("movl $3f, conform_far\n\t" MARK "lcall *conform_far\n\tjmp 4f\n"
                             "3:\tmov %%cs, %%ecx\n\tlret\n4:"
                             : "+c"(cs)
                             :
                             : CLOB);
        else
            __asm__ volatile("movl $3f, conform_far\n\t" MARK "ljmp *conform_far\n"
                             "3:\tmov %%cs, %%ecx\n\tljmp $0x23, $4f\n4:"
                             : "+c"(cs)
                             :
                             : CLOB);
        out("%sok cs=%#x", p, cs & 0xffff);
    }
    else out_fault(p);
#endif
}
static void c_ldt_jmp32(void) { ldt_code32(0); }
static void c_ldt_call32(void) { ldt_code32(1); }

/* A 16-bit code segment based at the snippet (64-bit build; needs CONFIG_X86_16BIT). */
#ifdef __x86_64__
static void c_ldt_jmp16(void) {
    char p[64];
    int r = set_ldt(1, (uintptr_t)conform_c16_jmp, 0xffff, 1, 0, 0, 1);
    snprintf(p, sizeof p, "modify_ldt=%s ", errname(r));
    if (r) {
        out("%s", p);
        return;
    }
    conform_far.off = 0;
    conform_far.sel = SEL_LDT(1);
    TRY {
        uint32_t eax = 0xabcd0000u, cs = 0;
        __asm__ volatile("mov %%rsp, conform_saved_sp(%%rip)\n\tmov %2, %%rsp\n\t"
                         "lea 2f(%%rip), %%rdx\n\tmov %%edx, conform_back_far(%%rip)\n\t"
                         "movw $0x33, conform_back_far+4(%%rip)\n\t" MARK
                         "ljmp *conform_far(%%rip)\n2:\tmov conform_saved_sp(%%rip), %%rsp"
                         : "+a"(eax), "+c"(cs)
                         : "r"(LOWSTACK_TOP)
                         : CLOB, "rdx", "rbx", "rsi", "rdi", "r8", "r9", "r10", "r12", "r13",
                           "r14", "r15");
        out("%sok eax=%#x cs=%#x", p, eax, cs & 0xffff);
    }
    else out_fault(p);
}
#endif

/* A not-present code segment: the far jump raises #NP with the selector. */
static void c_ldt_not_present(void) {
    char p[64];
    int r = set_ldt(2, 0, 0xfffff, 1, 1, 1, 0);
    snprintf(p, sizeof p, "modify_ldt=%s ", errname(r));
    if (r) {
        out("%s", p);
        return;
    }
    far_case(FAR_JMP, SEL_LDT(2), OTHER_JMP, p);
}

/* A data segment based at conform_buf + 0x100 with a 0x100-byte limit, in ES: base and
 * limit apply in 32-bit code; in 64-bit mode ES has neither (the access is to 0x10 or
 * 0x100 itself). */
static void ldt_data(uint32_t off, int bits32) {
    char p[64];
    int r = set_ldt(3, (uintptr_t)conform_buf + 0x100, 0xff, 0, bits32, 0, 1);
    snprintf(p, sizeof p, "modify_ldt=%s ", errname(r));
    if (r) {
        out("%s", p);
        return;
    }
    memset(conform_buf, 0, 0x400);
    conform_buf[0x110] = 0x5a;
    TRY {
        uint32_t v = 0;
        __asm__ volatile("mov %2, %%es\n\t" MARK "movzbl %%es:(%1), %0\n\tmov $0x2b, %1\n\t"
                         "mov %1, %%es"
                         : "=r"(v), "+r"(off)
                         : "r"((uint32_t)SEL_LDT(3))
                         : CLOB);
        out("%sok value=%#x", p, v);
    }
    else out_fault(p);
}
static void c_ldt_data_base(void) { ldt_data(0x10, 1); }
static void c_ldt_data_limit(void) { ldt_data(0x100, 1); }
static void c_ldt_data16(void) { ldt_data(0x10, 0); }

/* ---- FS and GS bases (64-bit) -------------------------------------------------------- */

#ifdef __x86_64__
#define BASE_X 0x12345000UL

static const char *base_name(uintptr_t b) {
    return b == BASE_X ? "kept" : b == 0 ? "zero" : "other";
}

/* wrfsbase X, then the null selector into FS: AMD keeps the base, Intel zeroes it. The
 * C library's thread pointer is restored in the same statement. */
static void c_fs_null_after_wrfsbase(void) {
    char p[80];
    snprintf(p, sizeof p, "cpuid.vendor=%s cpuid.nscb=%d cpuid.fsgsbase=%d ", vendor(), feat(F_NSCB), feat(F_FSGSBASE));
    TRY {
        uintptr_t b;
        __asm__ volatile("rdfsbase %%r8\n\t" MARK "wrfsbase %1\n\txor %%ecx, %%ecx\n\t"
                         "mov %%ecx, %%fs\n\trdfsbase %0\n\twrfsbase %%r8"
                         : "=&r"(b)
                         : "r"(BASE_X)
                         : CLOB, "rcx", "r8");
        out("%sok fsbase=%s", p, base_name(b));
    }
    else out_fault(p);
}

static void c_gs_null_after_wrgsbase(void) {
    char p[80];
    snprintf(p, sizeof p, "cpuid.vendor=%s cpuid.nscb=%d cpuid.fsgsbase=%d ", vendor(), feat(F_NSCB), feat(F_FSGSBASE));
    TRY {
        uintptr_t b;
        __asm__ volatile(MARK "wrgsbase %1\n\txor %%ecx, %%ecx\n\tmov %%ecx, %%gs\n\trdgsbase %0"
                         : "=&r"(b)
                         : "r"(BASE_X)
                         : CLOB, "rcx");
        out("%sok gsbase=%s", p, base_name(b));
    }
    else out_fault(p);
}

/* arch_prctl(ARCH_SET_FS, X), the null selector into FS, ARCH_GET_FS: all system calls
 * inside one asm statement (the C library's thread pointer is restored in it), so that
 * the case needs no FSGSBASE. */
static void c_fs_null_after_arch_prctl(void) {
    char p[80];
    snprintf(p, sizeof p, "cpuid.vendor=%s cpuid.nscb=%d ", vendor(), feat(F_NSCB));
    TRY {
        uintptr_t b = 1;
        long r;
        __asm__ volatile(SAVE_FS "mov $158, %%eax\n\tmov $0x1002, %%edi\n\tmov %2, %%rsi\n\t" MARK
                         "syscall\n\tmov %%rax, %%r12\n\txor %%ecx, %%ecx\n\tmov %%ecx, %%fs\n\t"
                         "mov $158, %%eax\n\tmov $0x1003, %%edi\n\tmov %3, %%rsi\n\tsyscall\n\t"
                         RESTORE_FS "mov %%r12, %1"
                         : "+m"(b), "=r"(r)
                         : "r"(BASE_X), "r"(&b)
                         : CLOB, "rax", "rcx", "rsi", "rdi", "r12");
        out("%sarch_prctl=%ld ok fsbase=%s", p, r, base_name(b));
    }
    else out_fault(p);
}

static void c_gs_null_after_arch_prctl(void) {
    char p[80];
    snprintf(p, sizeof p, "cpuid.vendor=%s cpuid.nscb=%d ", vendor(), feat(F_NSCB));
    long r = syscall(SYS_arch_prctl, 0x1001 /* ARCH_SET_GS */, BASE_X);
    TRY {
        uintptr_t k = 1;
        __asm__ volatile(MARK "xor %%ecx, %%ecx\n\tmov %%ecx, %%gs" : : : CLOB, "rcx");
        syscall(SYS_arch_prctl, 0x1004 /* ARCH_GET_GS */, &k);
        out("%sarch_prctl=%ld ok gsbase=%s", p, r, base_name(k));
    }
    else out_fault(p);
}

/* A non-null selector loads the base from its descriptor (0). */
static void c_gs_user_after_wrgsbase(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.fsgsbase=%d ", feat(F_FSGSBASE));
    TRY {
        uintptr_t b;
        __asm__ volatile(MARK "wrgsbase %1\n\tmov $0x2b, %%ecx\n\tmov %%ecx, %%gs\n\trdgsbase %0"
                         : "=&r"(b)
                         : "r"(BASE_X)
                         : CLOB, "rcx");
        out("%sok gsbase=%s", p, base_name(b));
    }
    else out_fault(p);
}

/* The GS base survives a system call and a reschedule. */
static void c_gsbase_across_syscalls(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.fsgsbase=%d ", feat(F_FSGSBASE));
    TRY {
        uintptr_t b;
        __asm__ volatile(MARK "wrgsbase %1\n\tmov $39, %%eax\n\tsyscall\n\tmov $24, %%eax\n\t"
                         "syscall\n\trdgsbase %0"
                         : "=&r"(b)
                         : "r"(BASE_X)
                         : CLOB, "rax", "rcx");
        out("%sok gsbase=%s", p, base_name(b));
    }
    else out_fault(p);
}

static void c_wrgsbase_noncanonical(void) {
    char p[64];
    snprintf(p, sizeof p, "cpuid.fsgsbase=%d ", feat(F_FSGSBASE));
    TRY {
        __asm__ volatile(MARK "wrgsbase %0" : : "r"(0x8000000000000000UL) : CLOB);
        out("%sok", p);
    }
    else out_fault(p);
}

/* An LDT data segment's base in GS (64-bit mode uses FS and GS bases): a read through
 * GS, and the base as the kernel reads it back (ARCH_GET_GS). */
static void c_ldt_gs_base(void) {
    char p[64];
    int r = set_ldt(3, (uintptr_t)conform_buf + 0x100, 0xff, 0, 1, 0, 1);
    snprintf(p, sizeof p, "modify_ldt=%s ", errname(r));
    if (r) {
        out("%s", p);
        return;
    }
    conform_buf[0x110] = 0x5a;
    TRY {
        uint32_t v;
        uintptr_t b = 1;
        __asm__ volatile("mov %1, %%gs\n\t" MARK "movzbl %%gs:0x10, %0"
                         : "=r"(v)
                         : "r"((uint32_t)SEL_LDT(3))
                         : CLOB);
        syscall(SYS_arch_prctl, 0x1004 /* ARCH_GET_GS */, &b);
        char a[48];
        out("%sok value=%#x gsbase=%s", p, v, fmt_addr(b, a, sizeof a));
    }
    else out_fault(p);
}
#endif

/* rd/wr fs/gs base: 64-bit mode only (#UD in 32-bit code). */
INSN_P(c_rdfsbase, "", ".byte 0xf3, 0x0f, 0xae, 0xc0", "cpuid.fsgsbase=%d ", feat(F_FSGSBASE))
INSN_P(c_rdgsbase, "", ".byte 0xf3, 0x0f, 0xae, 0xc8", "cpuid.fsgsbase=%d ", feat(F_FSGSBASE))
#ifndef __x86_64__
INSN_P(c_wrfsbase, "xor %%eax, %%eax\n\t", ".byte 0xf3, 0x0f, 0xae, 0xd0", "cpuid.fsgsbase=%d ",
       feat(F_FSGSBASE))
INSN_P(c_wrgsbase, "xor %%eax, %%eax\n\t", ".byte 0xf3, 0x0f, 0xae, 0xd8", "cpuid.fsgsbase=%d ",
       feat(F_FSGSBASE))
#endif

const struct conform_case seg_cases[] = {
    {"lar-0x00", c_lar_00, NULL, 0, 0},
    {"lar-0x10", c_lar_10, NULL, 0, 0},
    {"lar-0x23", c_lar_23, NULL, 0, 0},
    {"lar-0x2b", c_lar_2b, NULL, 0, 0},
    {"lar-0x33", c_lar_33, NULL, 0, 0},
    {"lar-0x40-tss", c_lar_40, NULL, 0, 0},
    {"lar-0x7b-cpunode", c_lar_7b, NULL, 0, 0},
    {"lar-ldt-empty", c_lar_ldt, NULL, 0, 0},
    {"lsl-0x00", c_lsl_00, NULL, 0, 0},
    {"lsl-0x23", c_lsl_23, NULL, 0, 0},
    {"lsl-0x2b", c_lsl_2b, NULL, 0, 0},
    {"lsl-0x33", c_lsl_33, NULL, 0, 0},
    {"lsl-0x7b-cpunode", c_lsl_7b, NULL, 0, 0},
    {"verr-0x00", c_verr_00, NULL, 0, 0},
    {"verr-0x10", c_verr_10, NULL, 0, 0},
    {"verr-0x23", c_verr_23, NULL, 0, 0},
    {"verr-0x2b", c_verr_2b, NULL, 0, 0},
    {"verr-0x33", c_verr_33, NULL, 0, 0},
    {"verw-0x00", c_verw_00, NULL, 0, 0},
    {"verw-0x2b", c_verw_2b, NULL, 0, 0},
    {"verw-0x33", c_verw_33, NULL, 0, 0},
    {"mov-ds-null", c_mov_ds_null, NULL, 0, 0},
    {"mov-es-null", c_mov_es_null, NULL, 0, 0},
    {"mov-fs-null", c_mov_fs_null, NULL, 0, 0},
    {"mov-gs-null", c_mov_gs_null, NULL, 0, 0},
    {"mov-ss-null", c_mov_ss_null, NULL, 0, 0},
    {"mov-ds-user", c_mov_ds_user, NULL, 0, 0},
    {"mov-fs-user", c_mov_fs_user, NULL, 0, 0},
    {"mov-gs-user", c_mov_gs_user, NULL, 0, 0},
    {"mov-ss-user", c_mov_ss_user, NULL, 0, 0},
    {"mov-ds-rpl0", c_mov_ds_rpl0, NULL, 0, 0},
    {"mov-ss-rpl0", c_mov_ss_rpl0, NULL, 0, 0},
    {"mov-ds-user-code", c_mov_ds_code, NULL, 0, 0},
    {"mov-ss-user-code", c_mov_ss_code, NULL, 0, 0},
    {"mov-ds-kernel-code", c_mov_ds_kernel, NULL, 0, 0},
    {"mov-ds-tss", c_mov_ds_tss, NULL, 0, 0},
    {"mov-ds-ldt-empty", c_mov_ds_no_ldt, NULL, 0, 0},
    {"mov-ds-beyond-gdt", c_mov_ds_beyond_gdt, NULL, 0, 0},
    {"mov-cs", c_mov_cs, NULL, 0, 0},
#ifdef __x86_64__
    {"push-pop-fs", c_push_pop_fs, NULL, 0, 0},
    {"push-pop-gs", c_push_pop_gs, NULL, 0, 0},
#else
    {"push-pop-segs", c_push_pop_segs, NULL, 0, 0},
#endif
    {"lss-user", c_lss_user, NULL, 0, 0},
    {"lss-null", c_lss_null, NULL, 0, 0},
    {"lgs-user", c_lgs_user, NULL, 0, 0},
    {"lgs-kernel-code", c_lgs_kernel, NULL, 0, 0},
    {"es-null-stos", c_es_null_stos, NULL, 0, 0},
    {"far-jmp-other-cs", c_ljmp_other, NULL, 0, 0},
    {"far-call-other-cs", c_lcall_other, NULL, 0, 0},
    {"far-ret-other-cs", c_retf_other, NULL, 0, 0},
    {"iret-other-cs", c_iret_other, NULL, 0, 0},
#ifdef __x86_64__
    {"compat-int80-getpid", c_compat_int80, NULL, 0, 0},
#else
    {"syscall64-getpid", c_syscall64, NULL, 0, 0},
#endif
    {"far-jmp-own-cs", c_ljmp_self, NULL, 0, 0},
    {"far-jmp-data-seg", c_ljmp_data, NULL, 0, 0},
    {"far-jmp-kernel-cs", c_ljmp_kernel, NULL, 0, 0},
    {"far-jmp-null", c_ljmp_null, NULL, 0, 0},
    {"far-call-kernel-cs", c_lcall_kernel, NULL, 0, 0},
    {"ldt-far-jmp-code32", c_ldt_jmp32, NULL, 0, 0},
    {"ldt-far-call-code32", c_ldt_call32, NULL, 0, 0},
#ifdef __x86_64__
    {"ldt-far-jmp-code16", c_ldt_jmp16, NULL, 0, 0},
#endif
    {"ldt-far-jmp-not-present", c_ldt_not_present, NULL, 0, 0},
    {"ldt-data-base", c_ldt_data_base, NULL, 0, 0},
    {"ldt-data-limit", c_ldt_data_limit, NULL, 0, 0},
    {"ldt-data16", c_ldt_data16, NULL, 0, 0},
#ifdef __x86_64__
    {"fs-null-after-wrfsbase", c_fs_null_after_wrfsbase, NULL, 0, 0},
    {"gs-null-after-wrgsbase", c_gs_null_after_wrgsbase, NULL, 0, 0},
    {"fs-null-after-arch-prctl", c_fs_null_after_arch_prctl, NULL, 0, 0},
    {"gs-null-after-arch-prctl", c_gs_null_after_arch_prctl, NULL, 0, 0},
    {"gs-user-after-wrgsbase", c_gs_user_after_wrgsbase, NULL, 0, 0},
    {"gsbase-across-syscalls", c_gsbase_across_syscalls, NULL, 0, 0},
    {"wrgsbase-noncanonical", c_wrgsbase_noncanonical, NULL, 0, 0},
    {"ldt-gs-base", c_ldt_gs_base, NULL, 0, 0},
#endif
    {"rdfsbase", c_rdfsbase, NULL, 0, 0},
    {"rdgsbase", c_rdgsbase, NULL, 0, 0},
#ifndef __x86_64__
    {"wrfsbase", c_wrfsbase, NULL, 0, 0},
    {"wrgsbase", c_wrgsbase, NULL, 0, 0},
#endif
};
const size_t seg_ncases = sizeof seg_cases / sizeof seg_cases[0];
