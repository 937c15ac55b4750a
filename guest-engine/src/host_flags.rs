//! Flags the CPU's manual leaves *undefined* after an instruction but that this CPU in
//! fact recomputes, whatever their old value.
//!
//! Flags liveness (`arch/x86_64/decode.rs`) keeps a flag live across an instruction that
//! leaves it undefined, because a CPU may leave it unchanged: glue inserted before the
//! instruction (a block counter's `add`, an isolation check's `cmp`) must then preserve
//! it, which costs a spill, a flag-free sequence and a reload instead of one
//! instruction. AF after `and`, `or`, `xor` and `test` is the common case: it makes two
//! block starts in three "flags live" in real code. Where the CPU in fact writes the
//! flag (its value after does not depend on its value before), clobbering it before the
//! instruction cannot be seen, so the embedder may measure that on the CPU translated
//! code runs on ([`probe`]) and say so in [`crate::Config::host_flags`]; the default
//! claims nothing.

/// What [`probe`] found: undefined flags this CPU writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostFlags {
    /// `and`, `or`, `xor` and `test` write AF (its value after does not depend on its
    /// value before).
    pub logic_af_written: bool,
}

/// RFLAGS.AF.
const AF: u64 = 1 << 4;

/// Measures [`HostFlags`] on the running CPU: each instruction of the group, over a few
/// operand pairs, run with AF clear and with AF set before it; AF is written if its
/// value after is the same both ways for every pair. Any CPL; touches no memory but the
/// stack.
pub fn probe() -> HostFlags {
    const PAIRS: [(u64, u64); 5] = [
        (0, 0),
        (0x0f, 0xf0),
        (0xff, 0x0f),
        (0x8000_0000_0000_0001, 0x1),
        (0x1234_5678_9abc_def0, 0x0fed_cba9_8765_4321),
    ];
    let logic_af_written = PAIRS.iter().all(|&(a, b)| {
        (0..4).all(|op| logic_af_after(op, a, b, 0) == logic_af_after(op, a, b, AF))
    });
    HostFlags { logic_af_written }
}

/// AF after logic instruction `op` (0 `and`, 1 `or`, 2 `xor`, 3 `test`) of `a` and `b`,
/// run with RFLAGS = `0x2 | af_before`.
fn logic_af_after(op: u32, a: u64, b: u64, af_before: u64) -> u64 {
    let flags_in = 0x2 | af_before;
    let flags_out: u64;
    // `op` names the instruction between loading RFLAGS and reading them back.
    macro_rules! run {
        ($insn:literal) => {
            // SAFETY: pushes and pops its own RFLAGS word on the stack (below the red
            // zone: the asm starts by moving RSP under it) and changes only the registers
            // it declares; `popfq` loads only status flags here (IF, IOPL and TF are as
            // they were, or ignored at CPL 3).
            unsafe {
                core::arch::asm!(
                    "sub rsp, 128", "push {f}", "popfq", concat!($insn, " {a}, {b}"),
                    "pushfq", "pop {f}", "add rsp, 128",
                    f = inout(reg) flags_in => flags_out, a = inout(reg) a => _, b = in(reg) b,
                )
            }
        };
    }
    match op {
        0 => run!("and"),
        1 => run!("or"),
        2 => run!("xor"),
        _ => run!("test"),
    }
    flags_out & AF
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe answers the same every time (a flag that followed its old value for some
    /// operands and not others would make it flip).
    #[test]
    fn test_the_probe_is_stable() {
        let first = probe();
        for _ in 0..100 {
            assert_eq!(probe(), first);
        }
    }
}
