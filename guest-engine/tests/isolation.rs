//! Isolation checks (`arch/x86_64/isolate.rs`): translated memory operands whose address
//! lies in PML4 slots 256–259 (the engine window, the physmap, their guards) never reach
//! memory. The check's trap (`ud2`, SIGILL here) is redirected to the exit routine like any
//! fault in the cache; the engine maps it back to the guest instruction with the guest
//! registers exactly as before it, and `isolation::classify_fault` names the operand. A
//! check that let the access through would SIGSEGV (those addresses are kernel space in
//! this host process) and kill the test.

mod common;

use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::instrument::access;
use guest_engine::isolation::{classify_fault, IsolationFault};
use guest_engine::{Config, Gpr, GuestPhys, GuestVirt, Mode, NullTool, Stop};

const WINDOW_VA: u64 = 0xffff_8080_0000_0000;
const PHYSMAP_VA: u64 = 0xffff_8100_0000_0000;

/// One rig at a time owns the SIGILL redirect.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Case {
    rig: Rig,
    block: Region,
    mode: Mode,
}

impl Case {
    fn new(mode: Mode) -> Case {
        let rig = Rig::new(Config {
            mode,
            ..Config::default()
        });
        common::fault_redirect::install(&rig, libc::SIGILL);
        Case {
            rig,
            block: Region::map(2 * 4096, 0),
            mode,
        }
    }

    /// Runs `code` (at the block's start; it must end by jumping to `exit`, outside
    /// guest memory) with `regs` set; returns the stop and the guest bytes.
    fn run(&mut self, code: &[u8], regs: &[(Gpr, u64)]) -> Stop {
        let base = self.block.addr();
        // The previous case's translation of this page goes (new code, same address).
        self.rig.engine.invalidate_code_page(GuestPhys(base));
        self.block.slice()[..code.len()].copy_from_slice(code);
        let mut mem = HostMemory::new(vec![(base, base + 4096)]);
        self.rig.engine.regs_mut().gpr = [0x1111; 16];
        self.rig
            .engine
            .regs_mut()
            .set(Gpr::Rsp, base + 2 * 4096 - 64);
        for &(r, v) in regs {
            self.rig.engine.regs_mut().set(r, v);
        }
        self.rig.engine.regs_mut().rflags = 0x202;
        self.rig.engine.set_rip(GuestVirt(base));
        self.rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool)
    }

    fn classify(&self, pc: u64) -> IsolationFault {
        let off = (pc - self.block.addr()) as usize;
        let bytes = &self.block.slice()[off..off + 15];
        classify_fault(
            self.mode,
            bytes,
            pc,
            self.rig.engine.regs(),
            0,
            0,
            self.rig.engine.vector_lane_checked(),
        )
    }
}

/// `jmp rel32` from `at` (offset in the block) to `target`.
fn jmp(code: &mut Vec<u8>, base: u64, target: u64) {
    let at = base + code.len() as u64 + 5;
    code.push(0xE9);
    code.extend_from_slice(&((target as i64 - at as i64) as i32).to_le_bytes());
}

fn expect_hit(stop: Stop, pc: u64) {
    match stop {
        Stop::Fault { guest_pc, .. } => assert_eq!(guest_pc, GuestVirt(pc), "faulting guest pc"),
        other => panic!("expected the isolation trap, got {other:?}"),
    }
}

#[test]
fn test_user_and_kernel_accesses_to_the_window_and_physmap_trap_before_touching_memory() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for mode in [Mode::USER, Mode::KERNEL] {
        let mut c = Case::new(mode);
        let base = c.block.addr();
        let exit = base + 0x10_0000;

        // mov rdx, 7; mov rax, [rdi + 0x10]; (never reached) ...
        let mut code = vec![0x48, 0xC7, 0xC2, 7, 0, 0, 0];
        let load = base + code.len() as u64;
        code.extend_from_slice(&[0x48, 0x8B, 0x47, 0x10]);
        jmp(&mut code, base, exit);
        let stop = c.run(&code, &[(Gpr::Rdi, WINDOW_VA), (Gpr::Rcx, 0xC0FFEE)]);
        expect_hit(stop, load);
        let r = c.rig.engine.regs();
        assert_eq!(
            r.get(Gpr::Rcx),
            0xC0FFEE,
            "the check's scratch register is restored"
        );
        assert_eq!(r.get(Gpr::Rdx), 7, "the instruction before it ran");
        assert_eq!(r.get(Gpr::Rax), 0x1111, "the load did not run");
        assert_eq!(
            c.classify(load),
            IsolationFault::Zone {
                addr: WINDOW_VA + 0x10,
                access: access::READ
            }
        );

        // The same with the status flags dead at the load (the shorter check).
        let mut code = vec![0x48, 0x8B, 0x47, 0x10, 0x83, 0xC1, 0x01]; // ...; add ecx, 1
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rdi, PHYSMAP_VA), (Gpr::Rcx, 5)]), base);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rcx), 5);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: PHYSMAP_VA + 0x10,
                access: access::READ
            }
        );

        // mov [rbx + rcx*8 + 0x20], eax into the physmap.
        let mut code = vec![0x89, 0x44, 0xCB, 0x20];
        jmp(&mut code, base, exit);
        let stop = c.run(&code, &[(Gpr::Rbx, PHYSMAP_VA), (Gpr::Rcx, 3)]);
        expect_hit(stop, base);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: PHYSMAP_VA + 0x38,
                access: access::WRITE
            }
        );

        // movabs rax, [0xffff_8000_0000_0000] (slot 256): decided at translation time.
        let mut code = vec![0x48, 0xA1];
        code.extend_from_slice(&0xffff_8000_0000_0000u64.to_le_bytes());
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[]), base);
        assert!(matches!(
            c.classify(base),
            IsolationFault::Zone {
                addr: 0xffff_8000_0000_0000,
                ..
            }
        ));

        // push rax with RSP in slot 259 (the guard): the stack's base check.
        let mut code = vec![0x50];
        jmp(&mut code, base, exit);
        let rsp = 0xffff_8180_0000_0100;
        expect_hit(c.run(&code, &[(Gpr::Rsp, rsp)]), base);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rsp), rsp);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: rsp - 8,
                access: access::WRITE
            }
        );

        // leave with RBP in the window (no explicit operand, no fixed stack increment:
        // its pop reads [rbp]).
        let mut code = vec![0xC9];
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rbp, WINDOW_VA + 0x100)]), base);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rbp), WINDOW_VA + 0x100);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rsp), base + 2 * 4096 - 64);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: WINDOW_VA + 0x100,
                access: access::READ
            }
        );

        // rep stosb with RDI in the window: nothing written, RCX unchanged.
        let mut code = vec![0xF3, 0xAA];
        jmp(&mut code, base, exit);
        expect_hit(
            c.run(&code, &[(Gpr::Rdi, WINDOW_VA + 0x1000), (Gpr::Rcx, 64)]),
            base,
        );
        assert_eq!(c.rig.engine.regs().get(Gpr::Rcx), 64);

        // A base just below the zone in the non-canonical hole reaching into it.
        let mut code = vec![0x48, 0x8B, 0x83];
        code.extend_from_slice(&0x2000i32.to_le_bytes()); // mov rax, [rbx + 0x2000]
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rbx, 0xffff_7fff_ffff_f000)]), base);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: 0xffff_8000_0000_1000,
                access: access::READ
            }
        );

        // A non-canonical address the check cannot tell from the zone: #GP for the guest,
        // #SS(0) through SS.
        for (code, stack) in [
            (vec![0x48, 0x8B, 0x04, 0x0B], false), // mov rax, [rbx + rcx]
            (vec![0x36, 0x48, 0x8B, 0x04, 0x0B], true), // mov rax, ss:[rbx + rcx]
        ] {
            let mut code = code;
            jmp(&mut code, base, exit);
            expect_hit(
                c.run(&code, &[(Gpr::Rbx, 0x01ff_8000_0000_0000), (Gpr::Rcx, 0)]),
                base,
            );
            assert_eq!(
                c.classify(base),
                IsolationFault::NonCanonical {
                    addr: 0x01ff_8000_0000_0000,
                    stack
                }
            );
        }

        // gs: with 32-bit addressing: the offset wraps at 4 GiB before the base is added,
        // so RCX's upper bits cannot hide a physmap access.
        let mut code = vec![0x65, 0x67, 0x8B, 0x01]; // mov eax, gs:[ecx]
        jmp(&mut code, base, exit);
        // SAFETY: this test thread's GS base is unused by Rust on x86-64 Linux (TLS is
        // FS); it is restored right after the run.
        unsafe { std::arch::asm!("wrgsbase {}", in(reg) PHYSMAP_VA) };
        let stop = c.run(&code, &[(Gpr::Rcx, 0xffff_ffff_0000_0010)]);
        // SAFETY: as above.
        unsafe { std::arch::asm!("wrgsbase {}", in(reg) 0u64) };
        expect_hit(stop, base);
        let bytes = &c.block.slice()[..15];
        assert_eq!(
            classify_fault(mode, bytes, base, c.rig.engine.regs(), 0, PHYSMAP_VA, 0),
            IsolationFault::Zone {
                addr: PHYSMAP_VA + 0x10,
                access: access::READ
            }
        );

        // bts with a register bit offset from a valid address into the physmap (the
        // operand names only [rdi]; the access is at rdi + (rax >> 6) * 8).
        let data = base + 0x800;
        let target = PHYSMAP_VA + 0x100;
        let rax = (target.wrapping_sub(data) as i64 * 8) as u64;
        let mut code = vec![0x48, 0x0F, 0xAB, 0x07]; // bts [rdi], rax
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rdi, data), (Gpr::Rax, rax)]), base);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: target,
                access: access::READ | access::WRITE
            }
        );

        // xlat: [rbx + al]; RAX's upper bits must not hide the window.
        let mut code = vec![0xD7];
        jmp(&mut code, base, exit);
        expect_hit(
            c.run(
                &code,
                &[(Gpr::Rbx, WINDOW_VA), (Gpr::Rax, 0x1000_0000_0000_0005)],
            ),
            base,
        );
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: WINDOW_VA + 5,
                access: access::READ
            }
        );

        // vpgatherdd ymm0, [rdi + ymm1*4], ymm2 with RDI at the physmap and every lane
        // enabled: every lane (within ±2^33 bytes of the base, whatever YMM1 holds) lies
        // in the zone.
        if std::arch::is_x86_feature_detected!("avx2") {
            use iced_x86::{Code, Instruction, MemoryOperand, Register};
            let ones = Instruction::with3(
                Code::VEX_Vpcmpeqd_ymm_ymm_ymmm256,
                Register::YMM2,
                Register::YMM2,
                Register::YMM2,
            )
            .unwrap();
            let g = Instruction::with3(
                Code::VEX_Vpgatherdd_ymm_vm32y_ymm,
                Register::YMM0,
                MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 4),
                Register::YMM2,
            )
            .unwrap();
            let pc = base + encode_at(&[ones], base).len() as u64;
            let mut code = encode_at(&[ones, g], base);
            jmp(&mut code, base, exit);
            expect_hit(c.run(&code, &[(Gpr::Rdi, PHYSMAP_VA)]), pc);
            let hit = c.classify(pc);
            assert!(
                matches!(hit, IsolationFault::Zone { addr, access: access::READ }
                    if (0xffff_8000_0000_0000..0xffff_8200_0000_0000).contains(&addr)),
                "{hit:?}"
            );
        }

        // The guest's own ud2 is a sensitive instruction, and a #UD there is the guest's.
        let mut code = vec![0x0F, 0x0B];
        jmp(&mut code, base, exit);
        assert!(matches!(c.run(&code, &[]), Stop::Sensitive(s) if s.pc == GuestVirt(base)));
        assert_eq!(c.classify(base), IsolationFault::GuestUd);
    }
}

#[test]
fn test_checks_keep_flags_and_registers_of_ordinary_accesses() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = Case::new(Mode::USER);
    let base = c.block.addr();
    let data = base + 0x800;
    c.block.slice()[0x800..0x808].copy_from_slice(&0x1234_5678u64.to_le_bytes());
    c.block.slice()[0x810..0x818].copy_from_slice(&0x9abcu64.to_le_bytes());
    let exit = base + 0x10_0000;
    let mut code = vec![
        0x48, 0x0F, 0xAB, 0x2F, // bts [rdi], rbp: bit 65 = bit 1 of [rdi + 8]
        0x31, 0xC0, // xor eax, eax
        0x83, 0xF8, 0x01, // cmp eax, 1: CF = SF = 1, ZF = 0
        0x48, 0x8B, 0x17, // mov rdx, [rdi]          (base check of RDI)
        0x48, 0x8B, 0x5C, 0x37, 0x10, // mov rbx, [rdi + rsi + 0x10] (full check)
        0x48, 0x89, 0x57, 0x20, // mov [rdi + 0x20], rdx    (elided: RDI checked)
        0x50, // push rax                  (base check of RSP)
        0x58, // pop rax                   (elided)
        0x0F, 0x92, 0xC1, // setb cl
        0x0F, 0x98, 0xC5, // sets ch
        0x0F, 0x94, 0xC0, // sete al
    ];
    jmp(&mut code, base, exit);
    let stop = c.run(
        &code,
        &[
            (Gpr::Rdi, data),
            (Gpr::Rsi, 0),
            (Gpr::Rcx, 0),
            (Gpr::Rbp, 65),
        ],
    );
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let r = c.rig.engine.regs();
    assert_eq!(r.get(Gpr::Rdx), 0x1234_5678);
    assert_eq!(r.get(Gpr::Rbx), 0x9abc);
    assert_eq!(
        r.get(Gpr::Rcx) & 0xffff,
        0x0101,
        "CF and SF survive the checks"
    );
    assert_eq!(r.get(Gpr::Rax) & 0xff, 0, "ZF survives the checks");
    assert_eq!(r.get(Gpr::Rdi), data);
    let stored = u64::from_le_bytes(c.block.slice()[0x820..0x828].try_into().unwrap());
    assert_eq!(stored, 0x1234_5678);
    let bits = u64::from_le_bytes(c.block.slice()[0x808..0x810].try_into().unwrap());
    assert_eq!(bits, 2, "bts with a register bit offset ran");

    // A gather from ordinary memory passes its check and loads.
    if std::arch::is_x86_feature_detected!("avx2") {
        use iced_x86::{Code, Encoder, Instruction, MemoryOperand, Register};
        let ymm = |c, a, b, d| Instruction::with3(c, a, b, d).unwrap();
        let insns = [
            ymm(
                Code::VEX_Vpxor_ymm_ymm_ymmm256,
                Register::YMM1,
                Register::YMM1,
                Register::YMM1,
            ),
            ymm(
                Code::VEX_Vpcmpeqd_ymm_ymm_ymmm256,
                Register::YMM2,
                Register::YMM2,
                Register::YMM2,
            ),
            Instruction::with3(
                Code::VEX_Vpgatherdd_ymm_vm32y_ymm,
                Register::YMM0,
                MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 4),
                Register::YMM2,
            )
            .unwrap(),
            Instruction::with2(Code::VEX_Vmovd_rm32_xmm, Register::EAX, Register::XMM0).unwrap(),
        ];
        let mut code = Vec::new();
        for i in insns {
            let mut enc = Encoder::new(64);
            enc.encode(&i, base + code.len() as u64).unwrap();
            code.extend_from_slice(&enc.take_buffer());
        }
        jmp(&mut code, base, exit);
        let stop = c.run(&code, &[(Gpr::Rdi, data)]);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        assert_eq!(c.rig.engine.regs().get(Gpr::Rax), 0x1234_5678);
    }
}

/// Encodes `insns` at `at`, one after the other.
fn encode_at(insns: &[iced_x86::Instruction], at: u64) -> Vec<u8> {
    let mut code = Vec::new();
    for i in insns {
        let mut enc = iced_x86::Encoder::new(64);
        enc.encode(i, at + code.len() as u64).unwrap();
        code.extend_from_slice(&enc.take_buffer());
    }
    code
}

#[test]
fn test_qword_index_gathers_check_every_lane() {
    use iced_x86::{Code, Instruction, MemoryOperand, Register};
    if !std::arch::is_x86_feature_detected!("avx2") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let lanes_at = |r| MemoryOperand::with_base_displ(r, 0x400);
    let load = |v, r| Instruction::with2(Code::VEX_Vmovdqu_ymm_ymmm256, v, lanes_at(r)).unwrap();
    let ones = Instruction::with3(
        Code::VEX_Vpcmpeqd_ymm_ymm_ymmm256,
        Register::YMM2,
        Register::YMM2,
        Register::YMM2,
    )
    .unwrap();
    for mode in [Mode::USER, Mode::KERNEL] {
        let mut c = Case::new(mode);
        let base = c.block.addr();
        let data = base + 0x800;
        let exit = base + 0x10_0000;
        let set_lanes = |c: &mut Case, lanes: [u64; 4]| {
            for (k, l) in lanes.iter().enumerate() {
                let at = 0xC00 + 8 * k;
                c.block.slice()[at..at + 8].copy_from_slice(&l.to_le_bytes());
            }
        };

        // vpgatherqq ymm0, [rdi + ymm1], ymm2: lane 2 at the window (flags dead after).
        set_lanes(&mut c, [0, 8, WINDOW_VA.wrapping_sub(data), 16]);
        let gather = Instruction::with3(
            Code::VEX_Vpgatherqq_ymm_vm64y_ymm,
            Register::YMM0,
            MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 1),
            Register::YMM2,
        )
        .unwrap();
        let cmp = Instruction::with2(Code::Cmp_r32_rm32, Register::EAX, Register::EAX).unwrap();
        let prefix = encode_at(&[load(Register::YMM1, Register::RDI), ones], base);
        let pc = base + prefix.len() as u64;
        let mut code = encode_at(
            &[load(Register::YMM1, Register::RDI), ones, gather, cmp],
            base,
        );
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rdi, data)]), pc);
        let r = c.rig.engine.regs();
        assert_eq!(
            (r.get(Gpr::Rdi), r.get(Gpr::Rax), r.get(Gpr::Rcx)),
            (data, 0x1111, 0x1111),
            "registers exact at the gather"
        );
        assert_eq!(
            c.classify(pc),
            IsolationFault::Zone {
                addr: WINDOW_VA,
                access: access::READ
            }
        );

        // vpgatherqd xmm0, [rcx + ymm1*8 + 0x10], xmm2: RCX (spilled by the check) as
        // the base, lane 3 in the physmap (flags live after).
        let target = PHYSMAP_VA + 0x100;
        set_lanes(&mut c, [0, 1, 2, target.wrapping_sub(data + 0x10) / 8]);
        let gather = Instruction::with3(
            Code::VEX_Vpgatherqd_xmm_vm64y_xmm,
            Register::XMM0,
            MemoryOperand::with_base_index_scale_displ_size(
                Register::RCX,
                Register::YMM1,
                8,
                0x10,
                1,
            ),
            Register::XMM2,
        )
        .unwrap();
        let prefix = encode_at(&[load(Register::YMM1, Register::RCX), ones], base);
        let pc = base + prefix.len() as u64;
        let mut code = encode_at(&[load(Register::YMM1, Register::RCX), ones, gather], base);
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rcx, data), (Gpr::Rax, 7)]), pc);
        let r = c.rig.engine.regs();
        assert_eq!((r.get(Gpr::Rcx), r.get(Gpr::Rax)), (data, 7));
        assert_eq!(
            c.classify(pc),
            IsolationFault::Zone {
                addr: target,
                access: access::READ
            }
        );

        // vpgatherqq xmm0, [xmm1 + 0x40], xmm2 without a base: lane 1 at the window.
        set_lanes(&mut c, [0, WINDOW_VA - 0x40, 0, 0]);
        let gather = Instruction::with3(
            Code::VEX_Vpgatherqq_xmm_vm64x_xmm,
            Register::XMM0,
            MemoryOperand::new(
                Register::None,
                Register::XMM1,
                1,
                0x40,
                4,
                false,
                Register::None,
            ),
            Register::XMM2,
        )
        .unwrap();
        let prefix = encode_at(&[load(Register::YMM1, Register::RDI), ones], base);
        let pc = base + prefix.len() as u64;
        let mut code = encode_at(&[load(Register::YMM1, Register::RDI), ones, gather], base);
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, &[(Gpr::Rdi, data)]), pc);
        assert_eq!(
            c.classify(pc),
            IsolationFault::Zone {
                addr: WINDOW_VA,
                access: access::READ
            }
        );
    }

    // An ordinary qword-index gather passes its checks, loads every lane, keeps the flags.
    let mut c = Case::new(Mode::USER);
    let base = c.block.addr();
    let data = base + 0x800;
    let exit = base + 0x10_0000;
    for k in 0..4u64 {
        let at = 0x800 + 8 * k as usize;
        c.block.slice()[at..at + 8].copy_from_slice(&(0xA0 + k).to_le_bytes());
        let at = 0xC00 + 8 * k as usize;
        c.block.slice()[at..at + 8].copy_from_slice(&(0x18 - 8 * k).to_le_bytes());
    }
    let insns = [
        Instruction::with2(Code::Xor_r32_rm32, Register::EAX, Register::EAX).unwrap(),
        Instruction::with2(Code::Cmp_rm32_imm8, Register::EAX, 1).unwrap(),
        load(Register::YMM1, Register::RDI),
        ones,
        Instruction::with3(
            Code::VEX_Vpgatherqq_ymm_vm64y_ymm,
            Register::YMM0,
            MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 1),
            Register::YMM2,
        )
        .unwrap(),
        Instruction::with1(Code::Setb_rm8, Register::CL).unwrap(),
        Instruction::with1(Code::Sets_rm8, Register::CH).unwrap(),
        Instruction::with1(Code::Sete_rm8, Register::AL).unwrap(),
        Instruction::with2(Code::VEX_Vmovq_rm64_xmm, Register::RDX, Register::XMM0).unwrap(),
        Instruction::with3(
            Code::VEX_Vpextrq_rm64_xmm_imm8,
            Register::RBX,
            Register::XMM0,
            1,
        )
        .unwrap(),
        Instruction::with3(
            Code::VEX_Vextracti128_xmmm128_ymm_imm8,
            Register::XMM3,
            Register::YMM0,
            1,
        )
        .unwrap(),
        Instruction::with2(Code::VEX_Vmovq_rm64_xmm, Register::RSI, Register::XMM3).unwrap(),
    ];
    let mut code = encode_at(&insns, base);
    jmp(&mut code, base, exit);
    let stop = c.run(&code, &[(Gpr::Rdi, data), (Gpr::Rcx, 0)]);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let r = c.rig.engine.regs();
    assert_eq!(
        (r.get(Gpr::Rdx), r.get(Gpr::Rbx), r.get(Gpr::Rsi)),
        (0xA3, 0xA2, 0xA1),
        "lanes 0, 1, 2 loaded"
    );
    assert_eq!(
        r.get(Gpr::Rcx) & 0xffff,
        0x0101,
        "CF and SF survive the checks"
    );
    assert_eq!(r.get(Gpr::Rax) & 0xff, 0, "ZF survives the checks");
    assert_eq!(r.get(Gpr::Rdi), data);
}

#[test]
fn test_dword_index_gathers_check_every_lane() {
    // A base just below the zone (non-canonical) with 32-bit indices: lane 0 reaches slot
    // 256 and must trap at the gather with that lane's address; with an ordinary base the
    // same gather runs and loads every lane.
    use iced_x86::{Code, Instruction, MemoryOperand, Register};
    if !std::arch::is_x86_feature_detected!("avx2") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let zone_start = 0xffff_8000_0000_0000u64;
    let load_lanes = Instruction::with2(
        Code::VEX_Vmovdqu_ymm_ymmm256,
        Register::YMM1,
        MemoryOperand::with_base_displ(Register::RSI, 0x400),
    )
    .unwrap();
    let ones = Instruction::with3(
        Code::VEX_Vpcmpeqd_ymm_ymm_ymmm256,
        Register::YMM2,
        Register::YMM2,
        Register::YMM2,
    )
    .unwrap();
    let gather = Instruction::with3(
        Code::VEX_Vpgatherdd_ymm_vm32y_ymm,
        Register::YMM0,
        MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 1),
        Register::YMM2,
    )
    .unwrap();
    let store_result = Instruction::with2(
        Code::VEX_Vmovdqu_ymmm256_ymm,
        MemoryOperand::with_base_displ(Register::RSI, 0x600),
        Register::YMM0,
    )
    .unwrap();
    for mode in [Mode::USER, Mode::KERNEL] {
        let mut c = Case::new(mode);
        let base = c.block.addr();
        let data = base + 0x800;
        let exit = base + 0x10_0000;
        let lanes: [i32; 8] = [0x200, 0, 4, 8, 12, 16, 20, 24];
        for (k, l) in lanes.iter().enumerate() {
            let at = 0xC00 + 4 * k;
            c.block.slice()[at..at + 4].copy_from_slice(&l.to_le_bytes());
        }
        let pc = base + encode_at(&[load_lanes, ones], base).len() as u64;
        let mut code = encode_at(&[load_lanes, ones, gather, store_result], base);
        jmp(&mut code, base, exit);

        let stop = c.run(&code, &[(Gpr::Rsi, data), (Gpr::Rdi, zone_start - 0x100)]);
        expect_hit(stop, pc);
        assert_eq!(
            c.classify(pc),
            IsolationFault::Zone {
                addr: zone_start + 0x100,
                access: access::READ
            }
        );

        // An ordinary base: the gather reads data[lane] for every lane.
        for k in 0..0x40usize {
            c.block.slice()[0x800 + k] = k as u8;
        }
        let stop = c.run(&code, &[(Gpr::Rsi, data), (Gpr::Rdi, data)]);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        let got = &c.block.slice()[0xE00..0xE20];
        for (k, l) in lanes.iter().enumerate() {
            let want = if *l == 0x200 {
                [0, 0, 0, 0] // data + 0x200 is the block's untouched zeroes
            } else {
                let o = *l as usize;
                [o as u8, o as u8 + 1, o as u8 + 2, o as u8 + 3]
            };
            assert_eq!(got[4 * k..4 * k + 4], want, "lane {k}");
        }
    }
}

#[test]
fn test_masked_off_gather_lanes_never_trap() {
    // A lane whose mask is off accesses nothing on a real CPU, wherever it points: it
    // must not trap, while the same lane enabled does. AVX2 (mask vector, qword and dword
    // elements) and, where the host has it, AVX-512 (opmask).
    use iced_x86::{Code, Instruction, MemoryOperand, Register};
    if !std::arch::is_x86_feature_detected!("avx2") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let at = |r, d| MemoryOperand::with_base_displ(r, d);
    let vload = |v, d| Instruction::with2(Code::VEX_Vmovdqu_ymm_ymmm256, v, at(Register::RSI, d));
    let mut c = Case::new(Mode::USER);
    let base = c.block.addr();
    let data = base + 0x800;
    let exit = base + 0x10_0000;
    let put = |c: &mut Case, off: usize, words: &[u64]| {
        for (k, w) in words.iter().enumerate() {
            c.block.slice()[off + 8 * k..off + 8 * k + 8].copy_from_slice(&w.to_le_bytes());
        }
    };
    // Lanes at 0xC00 (index register), mask at 0xA00.
    put(&mut c, 0xC00, &[0, 8, WINDOW_VA.wrapping_sub(data), 16]);
    put(&mut c, 0x800, &[0xA0, 0xA1, 0xA2, 0xA3]);
    let qq = Instruction::with3(
        Code::VEX_Vpgatherqq_ymm_vm64y_ymm,
        Register::YMM0,
        MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 1),
        Register::YMM2,
    )
    .unwrap();
    let lanes = vload(Register::YMM1, 0x400).unwrap();
    let mask = vload(Register::YMM2, 0x200).unwrap();
    let first =
        Instruction::with2(Code::VEX_Vmovq_rm64_xmm, Register::RAX, Register::XMM0).unwrap();
    let pc = base + encode_at(&[lanes, mask], base).len() as u64;
    let mut code = encode_at(&[lanes, mask, qq, first], base);
    jmp(&mut code, base, exit);
    for (mask_words, traps) in [
        ([!0u64, !0, 0, !0], false),
        ([0, 0, 1 << 63, 0], true),
        ([!0u64, !0, 0x7fff_ffff_ffff_ffff, !0], false),
    ] {
        put(&mut c, 0xA00, &mask_words);
        let stop = c.run(&code, &[(Gpr::Rsi, data), (Gpr::Rdi, data)]);
        if traps {
            expect_hit(stop, pc);
            assert_eq!(
                c.classify(pc),
                IsolationFault::Zone {
                    addr: WINDOW_VA,
                    access: access::READ
                }
            );
        } else {
            assert_eq!(
                stop,
                Stop::FetchFault(GuestVirt(exit)),
                "mask {mask_words:x?}"
            );
            assert_eq!(c.rig.engine.regs().get(Gpr::Rax), 0xA0, "lane 0 loaded");
        }
    }

    // vpgatherdd with RDI in the physmap: every lane is in the zone; all masked off, the
    // gather runs (and loads nothing); one dword mask element on, it traps.
    let dd = Instruction::with3(
        Code::VEX_Vpgatherdd_ymm_vm32y_ymm,
        Register::YMM0,
        MemoryOperand::with_base_index_scale(Register::RDI, Register::YMM1, 4),
        Register::YMM2,
    )
    .unwrap();
    let pc = base + encode_at(&[lanes, mask], base).len() as u64;
    let mut code = encode_at(&[lanes, mask, dd], base);
    jmp(&mut code, base, exit);
    put(&mut c, 0xA00, &[0, 0, 0, 0]);
    let stop = c.run(&code, &[(Gpr::Rsi, data), (Gpr::Rdi, PHYSMAP_VA)]);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    put(&mut c, 0xA00, &[0, 0, 0x8000_0000 << 32, 0]); // element 5
    let stop = c.run(&code, &[(Gpr::Rsi, data), (Gpr::Rdi, PHYSMAP_VA)]);
    expect_hit(stop, pc);

    if std::arch::is_x86_feature_detected!("avx512f") {
        // vpgatherqq zmm0{k1}, [rdi + zmm1]: lane 2 at the window; k1 from RBX.
        put(
            &mut c,
            0xC00,
            &[0, 8, WINDOW_VA.wrapping_sub(data), 16, 0, 8, 16, 24],
        );
        let zlanes = Instruction::with2(
            Code::EVEX_Vmovdqu64_zmm_k1z_zmmm512,
            Register::ZMM1,
            at(Register::RSI, 0x400),
        )
        .unwrap();
        let setk = Instruction::with2(Code::VEX_Kmovq_kr_r64, Register::K1, Register::RBX).unwrap();
        let mut g = Instruction::with2(
            Code::EVEX_Vpgatherqq_zmm_k1_vm64z,
            Register::ZMM0,
            MemoryOperand::with_base_index_scale(Register::RDI, Register::ZMM1, 1),
        )
        .unwrap();
        g.set_op_mask(Register::K1);
        let pc = base + encode_at(&[zlanes, setk], base).len() as u64;
        let mut code = encode_at(&[zlanes, setk, g, first], base);
        jmp(&mut code, base, exit);
        let stop = c.run(
            &code,
            &[(Gpr::Rsi, data), (Gpr::Rdi, data), (Gpr::Rbx, 0xfb)],
        );
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        assert_eq!(c.rig.engine.regs().get(Gpr::Rax), 0xA0, "lane 0 loaded");
        let stop = c.run(
            &code,
            &[(Gpr::Rsi, data), (Gpr::Rdi, data), (Gpr::Rbx, 0x04)],
        );
        expect_hit(stop, pc);
        assert_eq!(
            c.classify(pc),
            IsolationFault::Zone {
                addr: WINDOW_VA,
                access: access::READ
            }
        );
    }
}

#[test]
fn test_indexed_operands_check_base_wide_and_index_range() {
    // `mov rax, [rbx + rcx*8]` with the status flags dead (the `add` after it): the base
    // is checked wide once, the index against 2^31 at each use, a larger index through
    // the full check out of line. Each way into the zone traps at the load with the
    // registers as before it; an ordinary base and index load.
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for mode in [Mode::USER, Mode::KERNEL] {
        let mut c = Case::new(mode);
        let base = c.block.addr();
        let data = base + 0x800;
        c.block.slice()[0x818..0x820].copy_from_slice(&0xFEEDu64.to_le_bytes());
        let exit = base + 0x10_0000;
        // mov rax, [rbx + rcx*8]; add rdx, 1
        let mut code = vec![0x48, 0x8B, 0x04, 0xCB, 0x48, 0x83, 0xC2, 0x01];
        jmp(&mut code, base, exit);
        let stop = c.run(&code, &[(Gpr::Rbx, data), (Gpr::Rcx, 3), (Gpr::Rdx, 0)]);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        assert_eq!(c.rig.engine.regs().get(Gpr::Rax), 0xFEED);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rdx), 1);

        // The base in the window, a small index: the wide base check.
        let stop = c.run(&code, &[(Gpr::Rbx, WINDOW_VA), (Gpr::Rcx, 3)]);
        expect_hit(stop, base);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rcx), 3);
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: WINDOW_VA + 24,
                access: access::READ
            }
        );

        // An ordinary base, an index reaching the physmap: the out-of-line full check.
        let rcx = PHYSMAP_VA.wrapping_sub(data) / 8;
        let stop = c.run(&code, &[(Gpr::Rbx, data), (Gpr::Rcx, rcx)]);
        expect_hit(stop, base);
        assert_eq!(c.rig.engine.regs().get(Gpr::Rcx), rcx, "RCX restored");
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone {
                addr: data.wrapping_add(rcx * 8),
                access: access::READ
            }
        );

        // A base in the non-canonical hole just below the zone (the wide check hits):
        // the access is non-canonical, #GP as on a real CPU.
        let hole = 0xffff_8000_0000_0000 - (1 << 36);
        expect_hit(c.run(&code, &[(Gpr::Rbx, hole), (Gpr::Rcx, 0)]), base);
        assert_eq!(
            c.classify(base),
            IsolationFault::NonCanonical {
                addr: hole,
                stack: false
            }
        );
        // A base in the physmap with an index that takes the access above the zone: the
        // wide base check hits and the classifier names the base register (in user mode
        // the address itself is fenced off: the whole upper half is).
        let above = 0xffff_8200_0000_1000u64;
        let rcx = (above - PHYSMAP_VA) / 8;
        let stop = c.run(&code, &[(Gpr::Rbx, PHYSMAP_VA), (Gpr::Rcx, rcx)]);
        expect_hit(stop, base);
        let expected = if mode == Mode::USER {
            IsolationFault::Zone {
                addr: above,
                access: access::READ,
            }
        } else {
            IsolationFault::BaseInZone {
                base: PHYSMAP_VA,
                addr: above,
                access: access::READ,
            }
        };
        assert_eq!(c.classify(base), expected);
    }
}

#[test]
fn test_user_mode_operands_in_the_upper_half_trap() {
    // User code may run on the kernel's shadow root (the shadow MMU's unified view), so
    // every user operand in the upper half traps, not only those in the zone: a base
    // register there (flags live and dead), an absolute address, the stack, a negative
    // displacement too large for the base check to cover, and a gather whose 32-bit
    // indices (no base) reach below 0. Each is classified at its address.
    use iced_x86::{Code, Instruction, MemoryOperand, Register};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let kernel = 0xffff_ffff_8100_0000u64;
    let mut c = Case::new(Mode::USER);
    let base = c.block.addr();
    let exit = base + 0x10_0000;
    let mut abs = vec![0x48, 0xA1];
    abs.extend_from_slice(&kernel.to_le_bytes());
    // (instruction, registers, the operand's address, its access)
    type Probe<'a> = (&'a [u8], &'a [(Gpr, u64)], u64, u32);
    let cases: [Probe; 7] = [
        // v = *p; *p = v: one load and one store through the same base register.
        (
            &[0x8B, 0x10, 0x89, 0x10],
            &[(Gpr::Rax, kernel)],
            kernel,
            access::READ,
        ),
        (
            &[0x48, 0x8B, 0x10, 0x48, 0x89, 0x10],
            &[(Gpr::Rax, kernel + 0x1000)],
            kernel + 0x1000,
            access::READ,
        ),
        (
            &[0x48, 0x8B, 0x47, 0x10],
            &[(Gpr::Rdi, kernel)],
            kernel + 0x10,
            access::READ,
        ),
        (
            &[0x48, 0x8B, 0x47, 0x10, 0x48, 0x83, 0xC2, 0x01],
            &[(Gpr::Rdi, kernel)],
            kernel + 0x10,
            access::READ,
        ),
        (&abs, &[], kernel, access::READ),
        (
            &[0x50],
            &[(Gpr::Rsp, kernel + 0x100)],
            kernel + 0xF8,
            access::WRITE,
        ),
        (
            &[0x48, 0x8B, 0x87, 0x00, 0x00, 0xC0, 0xFF], // mov rax, [rdi - 0x400000]
            &[(Gpr::Rdi, 0x1000)],
            0xffff_ffff_ffc0_1000,
            access::READ,
        ),
    ];
    for (insn, regs, addr, kind) in cases {
        let mut code = insn.to_vec();
        jmp(&mut code, base, exit);
        expect_hit(c.run(&code, regs), base);
        for dest in [Gpr::Rax, Gpr::Rdx] {
            if !regs.iter().any(|&(r, _)| r == dest) {
                assert_eq!(c.rig.engine.regs().get(dest), 0x1111, "nothing ran");
            }
        }
        assert_eq!(
            c.classify(base),
            IsolationFault::Zone { addr, access: kind },
            "{insn:02x?}"
        );
    }
    if std::arch::is_x86_feature_detected!("avx2") {
        // vpgatherdd ymm0, [ymm1*1], ymm2 with lane 0's index −64.
        let code = encode_at(
            &[
                Instruction::with2(
                    Code::VEX_Vmovdqu_ymm_ymmm256,
                    Register::YMM1,
                    MemoryOperand::with_base_displ(Register::RSI, 0x400),
                )
                .unwrap(),
                Instruction::with3(
                    Code::VEX_Vpcmpeqd_ymm_ymm_ymmm256,
                    Register::YMM2,
                    Register::YMM2,
                    Register::YMM2,
                )
                .unwrap(),
            ],
            base,
        );
        let pc = base + code.len() as u64;
        let gather = Instruction::with3(
            Code::VEX_Vpgatherdd_ymm_vm32y_ymm,
            Register::YMM0,
            MemoryOperand::new(
                Register::None,
                Register::YMM1,
                1,
                0,
                4,
                false,
                Register::None,
            ),
            Register::YMM2,
        )
        .unwrap();
        let mut code = [code, encode_at(&[gather], pc)].concat();
        jmp(&mut code, base, exit);
        let data = base + 0x800;
        c.block.slice()[0xC00..0xC20].fill(0);
        c.block.slice()[0xC00..0xC04].copy_from_slice(&(-64i32).to_le_bytes());
        expect_hit(c.run(&code, &[(Gpr::Rsi, data)]), pc);
        assert_eq!(
            c.classify(pc),
            IsolationFault::Zone {
                addr: 0u64.wrapping_sub(64),
                access: access::READ
            }
        );
    }
}

#[test]
fn test_self_looping_traces_hoist_checks_and_fall_back_on_a_hit() {
    use guest_engine::exit_code::EXIT_HOIST_MISS;
    // loop: mov rax, [rbx + rcx*8]; add rdx, rax; mov rsi, [rdi + 8]; add rcx, 1;
    //       cmp rcx, 4; jb loop
    // RBX and RDI are never written in the loop: their checks run once at the trace's
    // top. Ordinary values: the loop sums four words. RBX or RDI in the zone: the hoisted
    // check exits, the trace is built again without hoisting and the load traps there
    // with the registers of the first iteration.
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let code_at = |base: u64| {
        let mut code = vec![
            0x48, 0x8B, 0x04, 0xCB, // mov rax, [rbx + rcx*8]
            0x48, 0x01, 0xC2, // add rdx, rax
            0x48, 0x8B, 0x77, 0x08, // mov rsi, [rdi + 8]
            0x48, 0x83, 0xC1, 0x01, // add rcx, 1
            0x48, 0x83, 0xF9, 0x04, // cmp rcx, 4
            0x72, 0xEB, // jb loop
        ];
        jmp(&mut code, base, base + 0x10_0000);
        code
    };
    let misses = |c: &Case| c.rig.engine.stats().exits[EXIT_HOIST_MISS as usize];
    for (zone_reg, value, offset, addr) in [
        (None, 0, 0, 0),
        (Some(Gpr::Rbx), WINDOW_VA, 0, WINDOW_VA),
        (Some(Gpr::Rdi), PHYSMAP_VA, 7, PHYSMAP_VA + 8),
    ] {
        // A fresh engine each time: once a trace's hoisted check hit, that trace is
        // built without hoisting.
        let mut c = Case::new(Mode::USER);
        let base = c.block.addr();
        let data = base + 0x800;
        for k in 0..4u64 {
            let at = 0x800 + 8 * k as usize;
            c.block.slice()[at..at + 8].copy_from_slice(&(10 + k).to_le_bytes());
        }
        let mut regs = [
            (Gpr::Rbx, data),
            (Gpr::Rdi, data),
            (Gpr::Rcx, 0),
            (Gpr::Rdx, 0),
        ];
        let Some(r) = zone_reg else {
            let stop = c.run(&code_at(base), &regs);
            assert_eq!(stop, Stop::FetchFault(GuestVirt(base + 0x10_0000)));
            assert_eq!(c.rig.engine.regs().get(Gpr::Rdx), 10 + 11 + 12 + 13);
            assert_eq!(c.rig.engine.regs().get(Gpr::Rsi), 11);
            assert_eq!(misses(&c), 0);
            continue;
        };
        regs.iter_mut().find(|x| x.0 == r).unwrap().1 = value;
        let at = base + offset;
        expect_hit(c.run(&code_at(base), &regs), at);
        assert_eq!(misses(&c), 1, "the hoisted check hit once");
        assert_eq!(c.rig.engine.regs().get(Gpr::Rcx), 0, "first iteration");
        assert_eq!(
            c.classify(at),
            IsolationFault::Zone {
                addr,
                access: access::READ
            }
        );
    }
}
