#!/usr/bin/env python3
"""Static checks on the built mini-kernel ELF (run after every build; exit 1 on a problem).

1. Layout: ET_EXEC, x86-64, entry = _start, every PT_LOAD has p_paddr == p_vaddr and lies in
   [0x100000, 0x200000), no PT_INTERP/PT_DYNAMIC (nothing would apply relocations).
2. Instructions (objdump -d, Intel syntax): nothing that is broken under the project's KVM
   or that the soft-float target must never contain (DESIGN.md §2):
   int n / int1 / into, int3 (except padding: a run of int3 that follows an unconditional
   transfer or a call (to a no-return function) and runs up to a 16-byte boundary or the next
   symbol), cmpxchg16b, xsave*/xrstor*/fxsave/fxrstor, clac/stac,
   popcnt/lzcnt/tzcnt, fwait and any x87 instruction, any MMX/SSE/AVX register.
3. Ports: `in`/`out` with an immediate port must name COM1, the PICs, the PIT or the i8042.
4. `syscall` appears only in .user_text (ring-3 code).

Usage: check_elf.py [path-to-elf]   (default: the release build in ../../../target-minikernel)
"""
import os
import re
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "../../../target-minikernel/x86_64-unknown-none/release/minikernel")

FORBIDDEN = {
    "int", "int1", "icebp", "into", "cmpxchg16b", "clac", "stac", "popcnt", "lzcnt", "tzcnt",
    "fwait", "wait", "xsave", "xsaveopt", "xsavec", "xsaves", "xsave64", "xsaveopt64",
    "xsavec64", "xsaves64", "xrstor", "xrstors", "xrstor64", "xrstors64", "fxsave", "fxrstor",
    "fxsave64", "fxrstor64", "emms",
}
# x87: every mnemonic starting with f except these non-FPU ones.
NOT_X87 = set()
SIMD_REG = re.compile(r"\b([xyz]mm\d+|mm\d|k[0-7])\b")
ALLOWED_PORTS = set(range(0x3F8, 0x400)) | {0x20, 0x21, 0xA0, 0xA1, 0x40, 0x41, 0x42, 0x43, 0x64}
UNCONDITIONAL = {"jmp", "ret", "retf", "retfq", "iretq", "iret", "ud2", "sysretq", "hlt", "call"}


def check_layout(path, errors):
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        errors.append("not a little-endian ELF64 file")
        return
    e_type, e_machine, _, e_entry, e_phoff = struct.unpack_from("<HHIQQ", data, 16)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 54)
    if e_type != 2:
        errors.append(f"e_type {e_type}, want ET_EXEC (2)")
    if e_machine != 0x3E:
        errors.append(f"e_machine {e_machine:#x}, want x86-64")
    loads = 0
    for i in range(e_phnum):
        p_type, _, _, p_vaddr, p_paddr, _, p_memsz = struct.unpack_from(
            "<IIQQQQQ", data, e_phoff + i * e_phentsize)
        if p_type in (2, 3):
            errors.append(f"program header {i} is PT_DYNAMIC/PT_INTERP")
        if p_type != 1:
            continue
        loads += 1
        if p_paddr != p_vaddr:
            errors.append(f"PT_LOAD {i}: p_paddr {p_paddr:#x} != p_vaddr {p_vaddr:#x}")
        if p_vaddr < 0x100000 or p_vaddr + p_memsz > 0x200000:
            errors.append(f"PT_LOAD {i}: {p_vaddr:#x}+{p_memsz:#x} outside [0x100000, 0x200000)")
    if loads == 0:
        errors.append("no PT_LOAD segment")
    syms = subprocess.run(["nm", path], capture_output=True, text=True, check=True).stdout
    start = [int(l.split()[0], 16) for l in syms.splitlines() if l.endswith(" _start")]
    if start != [e_entry]:
        errors.append(f"e_entry {e_entry:#x} is not _start {start}")


def check_code(path, errors):
    out = subprocess.run(["objdump", "-d", "-M", "intel", "--no-show-raw-insn", path],
                         capture_output=True, text=True, check=True).stdout
    section = None
    prev = None
    count = 0
    # An int3 run: (start text, allowed-by-predecessor); it is padding if it ends at a
    # 16-byte boundary or at a symbol.
    pending = None

    def end_run(next_addr):
        nonlocal pending
        if pending is not None:
            where, ok = pending
            if not ok or (next_addr is not None and next_addr % 16 != 0):
                errors.append(f"int3 that is not padding: {where}")
            pending = None

    for line in out.splitlines():
        m = re.match(r"Disassembly of section (\S+):", line)
        if m:
            end_run(None)
            section = m.group(1)
            prev = None
            continue
        if re.match(r"^[0-9a-f]+ <.*>:$", line):
            end_run(None)
            continue
        parts = line.split("\t")
        if len(parts) < 2 or not parts[0].strip().endswith(":"):
            continue
        addr = parts[0].strip().rstrip(":")
        text = parts[1].strip()
        words = text.split()
        # Skip prefixes objdump prints as words.
        while words and words[0] in ("lock", "rep", "repz", "repnz", "repe", "repne", "data16",
                                     "cs", "ds", "es", "ss", "fs", "gs", "notrack", "bnd"):
            words = words[1:]
        if not words:
            continue
        mnem = words[0]
        operands = " ".join(words[1:])
        count += 1
        where = f"{section} {addr}: {text}"
        if mnem == "int3":
            if pending is None:
                pending = (where, prev in UNCONDITIONAL)
            prev = "int3"
            continue
        end_run(int(addr, 16))
        if mnem in FORBIDDEN or mnem.startswith("xsave") or mnem.startswith("xrstor"):
            errors.append(f"forbidden instruction: {where}")
        elif mnem.startswith("f") and mnem not in NOT_X87:
            errors.append(f"x87 instruction: {where}")
        elif SIMD_REG.search(operands):
            errors.append(f"SIMD register: {where}")
        elif mnem in ("in", "out", "ins", "outs", "insb", "outsb"):
            m = re.search(r"\b0x([0-9a-f]+)\b", operands)
            if m and int(m.group(1), 16) not in ALLOWED_PORTS:
                errors.append(f"port outside the VMM's devices: {where}")
        elif mnem == "syscall" and section != ".user_text":
            errors.append(f"syscall outside .user_text: {where}")
        prev = mnem
    end_run(None)
    if count == 0:
        errors.append("no instructions disassembled")
    return count


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    errors = []
    check_layout(path, errors)
    count = check_code(path, errors)
    for e in errors:
        print("check_elf: " + e)
    if errors:
        print(f"check_elf: {len(errors)} problem(s) in {path}")
        return 1
    print(f"check_elf: ok ({count} instructions checked in {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
