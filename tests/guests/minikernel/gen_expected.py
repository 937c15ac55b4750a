#!/usr/bin/env python3
"""Writes expected.txt: the mini-kernel's full transcript (no step skipped) as the
architecture defines it, derived here from first principles -- NOT copied from a run.

Each line below states where its values come from: a constant the kernel chose
(src/layout.rs, the step's source), an architectural rule (Intel SDM: error codes,
SYSCALL/SYSRET selector arithmetic, #PF error bits), or a computation this script redoes
(the known loop). Host-dependent values are marked HOST: they are what the VMM's CPUID
table (KVM_GET_SUPPORTED_CPUID) gives on the host that runs the test, so expected.txt holds
them as the placeholders {vendor} and {max_basic_leaf}, and the checksum over the filled-in
transcript as {checksum}; `kpin_tests::minikernel_expected` (tests/lib.rs) and
check_transcript.py --vendor/--max-basic-leaf fill them in.

Usage: gen_expected.py [--check]   (--check: exit 1 if expected.txt differs)
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
M64 = (1 << 64) - 1


def h(v):
    """The kernel's print_hex: 0x + lowercase digits, no leading zeros."""
    return f"{v:#x}"


def fnv1a64(data: bytes) -> int:
    x = 0xCBF29CE484222325
    for b in data:
        x = ((x ^ b) * 0x100000001B3) & M64
    return x


def known_loop_1000(seed):
    """steps/cpu.rs known_loop_1000: acc = (acc * 31 + i) ^ 0x55, i = 1000 down to 1."""
    acc = seed
    for i in range(1000, 0, -1):
        acc = (((acc * 31) & M64) + i) & M64
        acc ^= 0x55
    return acc, 1000


# --- constants the kernel chose (src/layout.rs and the steps) ---
IMAGE_BASE = 0x100000
FRAME_POOL_END = 0x4000000
KTEST_BASE = 0xFFFF_FF80_0000_0000
KERNEL_DEMAND_VA = KTEST_BASE + 0x10_0000
KERNEL_DEMAND_OFFSET = 0x18
KERNEL_DEMAND_FILL = 0x600D_CAFE_0000_0006
USER_DEMAND_VA = 0x4008_0000
USER_DEMAND_OFFSET = 0x10
USER_PF_VALUE = 0x0123_4567_89AB_CDEF
AS_TEST_VA = 0x80_0000_0000
AS_A, AS_B = 0xAAAA_0000_0000_000A, 0xBBBB_0000_0000_000B
BAD_SELECTOR = 0xFF8
LOOP_SEED = 0x1234
MSRS = [("fs_base", 0x0000_1111_2222_3000), ("gs_base", 0x0000_4444_5555_6000),
        ("kernel_gs_base", 0xFFFF_8888_9999_A000), ("lstar", 0xFFFF_FFFF_8123_4560),
        ("star", 0x0018_0008_0000_0000), ("sfmask", 0x0004_7700)]
FS_PROBE, GS_A, GS_B = 0xF5F5_0000_0000_0001, 0x6565_0000_0000_000A, 0x6565_0000_0000_000B
SMC_FIRST, SMC_SECOND = 0x1234_5678, 0x9ABC_DEF0
KERNEL_CS, USER_CS32 = 0x08, 0x18
TIMER_HZ, TIMER_VECTOR = 1000, 0x20

# --- architectural rules ---
# STAR[47:32] = kernel CS, STAR[63:48] = base of the SYSRET selectors.
STAR = (USER_CS32 << 48) | (KERNEL_CS << 32)
SYSRET_CS = (USER_CS32 + 16) | 3       # SDM SYSRET (64-bit): CS = STAR[63:48] + 16, RPL 3
SYSRET_SS = (USER_CS32 + 8) | 3        # SS = STAR[63:48] + 8, RPL 3
USER_CS, USER_SS = 0x28 | 3, 0x20 | 3  # the GDT's user selectors, also what iretq loads
assert (SYSRET_CS, SYSRET_SS) == (USER_CS, USER_SS)
SFMASK = 0x47700
IF = 0x200
PF_P, PF_W, PF_U = 1, 2, 4
VEC_DE, VEC_UD, VEC_GP, VEC_PF = 0, 6, 13, 14
GP_ERR_NONCANONICAL = 0                 # #GP(0) for a non-canonical memory reference
GP_ERR_SELECTOR = BAD_SELECTOR & 0xFFF8  # #GP(selector): index, TI = 0, EXT = 0
PF_ERR_KERNEL_READ = 0                  # not present, read, CPL 0
PF_ERR_USER_WRITE = PF_W | PF_U         # not present, write, CPL 3
PRIV_GP_ERR = 0                         # hlt/cli/rdmsr/mov-from-cr3 at CPL 3: #GP(0)

# --- HOST: the VMM's CPUID table on this project's machines ---
VENDOR = "{vendor}"
MAX_BASIC_LEAF = "{max_basic_leaf}"
FEATURES = ["fpu", "tsc", "msr", "pae", "apic", "syscall", "nx", "lm"]  # all set here


def body_lines():
    loop_result, loop_iters = known_loop_1000(LOOP_SEED)
    # syscall program: add(40,2) = 42; writes 42, CS, SS, IF -> returns 1, 2, 3, 4;
    # exit(42 + (1+2+3+4) + 100).
    writes = [42, USER_CS, USER_SS, IF]
    exit_code = 42 + sum(range(1, len(writes) + 1)) + 100
    L = []
    L.append(f"step 00 boot: e820 ram covers {h(IMAGE_BASE)}-{h(FRAME_POOL_END)} yes, own gdt+tss+idt "
             f"loaded, own page tables cr3 ok, pic at 0x20/0x28 imr=0xff/0xff")
    L.append(f"step 01 cpuid: vendor={VENDOR} max-basic-leaf={MAX_BASIC_LEAF} "
             + " ".join(f"{f}=1" for f in FEATURES))
    L.append("step 02 flags: cli if=0, sti if=1, popf(saved after cli) if=0, popf(saved after sti) if=1")
    L.append(f"step 03 de: vector={VEC_DE} rip-fixup ok")
    L.append(f"step 04 ud: vector={VEC_UD} rip-fixup ok")
    L.append(f"step 05 gp: non-canonical load vector={VEC_GP} err={h(GP_ERR_NONCANONICAL)} rip-fixup ok, "
             f"mov ds,{h(BAD_SELECTOR)} vector={VEC_GP} err={h(GP_ERR_SELECTOR)} rip-fixup ok")
    L.append(f"step 06 pf: vector={VEC_PF} err={h(PF_ERR_KERNEL_READ)} "
             f"cr2={h(KERNEL_DEMAND_VA + KERNEL_DEMAND_OFFSET)} mapped+retried rip ok read {h(KERNEL_DEMAND_FILL)}")
    L.append(f"step 07 loop: known_loop_1000({h(LOOP_SEED)}) iterations={loop_iters} result={h(loop_result)}")
    L.append(f"step 08 timer: pit {TIMER_HZ} hz irq0 vector={h(TIMER_VECTOR)} ticks=10 at-cpl0=10 imr-after=0xff")
    L.append("step 09 msr: " + "".join(f"{n}={h(v)} " for n, v in MSRS)
             + f"fs:[0]={h(FS_PROBE)} gs:[0]={h(GS_A)} swapgs gs:[0]={h(GS_B)} bases-exchanged ok "
             f"swapgs gs:[0]={h(GS_A)} bases-restored ok")
    L.append(f"step 10 syscall: star={h(STAR)} sfmask={h(SFMASK)} syscalls={2 + len(writes)} "
             f"writes={','.join(h(w) for w in writes)} if-masked-in-kernel ok user-if ok exit={exit_code}")
    L.append(f"step 11 cr3: va {h(AS_TEST_VA)} a={h(AS_A)} b={h(AS_B)} a={h(AS_A)} b={h(AS_B)} cr3-readback ok")
    L.append(f"step 12 user-pf: vector={VEC_PF} err={h(PF_ERR_USER_WRITE)} cr2={h(USER_DEMAND_VA + USER_DEMAND_OFFSET)} "
             f"from cpl3 traps=2 user read back {h(USER_PF_VALUE)} rest-of-page 0x0")
    L.append(f"step 13 smc: call={h(SMC_FIRST)} patched via alias, x-view sees it ok call={h(SMC_SECOND)}")
    L.append(f"step 14 hlt: woke by vector={h(TIMER_VECTOR)} ticks=1")
    L.append("step 15 user-priv: " + " ".join(
        f"{n} vector={VEC_GP} err={h(PRIV_GP_ERR)} rip ok" for n in ("hlt", "cli", "rdmsr", "mov-cr3"))
        + " gate ok exit=0x600d")
    L.append("step 16 user-irq: ticks at-cpl3=3 at-cpl0=0 user-saw=3")
    L.append(f"step 17 selectors: iretq to cpl3, user reads cs={h(USER_CS)} ss={h(USER_SS)} if=1")
    L.append(f"step 18 sysret: sysretq to cpl3, exit-gate frame cs={h(SYSRET_CS)} ss={h(SYSRET_SS)} if=1")
    return L


def transcript():
    body = "".join(line + "\n" for line in body_lines())
    return "MINIKERNEL-START\n" + body + "MINIKERNEL-DONE {checksum}\n"


def main():
    text = transcript()
    path = os.path.join(HERE, "expected.txt")
    if "--check" in sys.argv[1:]:
        with open(path) as f:
            if f.read() != text:
                print("gen_expected: expected.txt is out of date; run gen_expected.py")
                return 1
        print("gen_expected: expected.txt is up to date")
        return 0
    with open(path, "w") as f:
        f.write(text)
    print(f"gen_expected: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
