//! Reproducible random x86-64 test programs for differential testing.
//!
//! A program is a main body, a few subroutines, jump tables and a 4 KiB data area, all
//! assembled into one block. It ends with `jmp qword [rip+end_slot]`, whose slot the
//! harness fills with the native runner's exit address.

use iced_x86::code_asm::*;
use iced_x86::BlockEncoderOptions;

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
    pub fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

pub const DATA_BYTES: usize = 4096;

const R64: [AsmRegister64; 13] = [
    rax, rcx, rdx, rsi, rdi, rbp, r8, r9, r10, r11, r12, r13, r14,
];
const R32: [AsmRegister32; 13] = [
    eax, ecx, edx, esi, edi, ebp, r8d, r9d, r10d, r11d, r12d, r13d, r14d,
];
const R16: [AsmRegister16; 13] = [
    ax, cx, dx, si, di, bp, r8w, r9w, r10w, r11w, r12w, r13w, r14w,
];
const R8: [AsmRegister8; 13] = [
    al, cl, dl, sil, dil, bpl, r8b, r9b, r10b, r11b, r12b, r13b, r14b,
];
/// Index 1 is RCX; loops and string ops own it.
const NO_RCX: [usize; 12] = [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

macro_rules! alu {
    ($a:expr, $k:expr, $x:expr, $y:expr) => {
        match $k % 9 {
            0 => $a.add($x, $y),
            1 => $a.sub($x, $y),
            2 => $a.adc($x, $y),
            3 => $a.sbb($x, $y),
            4 => $a.and($x, $y),
            5 => $a.or($x, $y),
            6 => $a.xor($x, $y),
            7 => $a.cmp($x, $y),
            _ => $a.mov($x, $y),
        }
        .unwrap()
    };
}

macro_rules! alu_imm {
    ($a:expr, $k:expr, $x:expr, $y:expr) => {
        match $k % 8 {
            0 => $a.add($x, $y),
            1 => $a.sub($x, $y),
            2 => $a.adc($x, $y),
            3 => $a.sbb($x, $y),
            4 => $a.and($x, $y),
            5 => $a.or($x, $y),
            6 => $a.xor($x, $y),
            _ => $a.cmp($x, $y),
        }
        .unwrap()
    };
}

macro_rules! shift {
    ($a:expr, $k:expr, $x:expr, $y:expr) => {
        match $k % 7 {
            0 => $a.shl($x, $y),
            1 => $a.shr($x, $y),
            2 => $a.sar($x, $y),
            3 => $a.rol($x, $y),
            4 => $a.ror($x, $y),
            5 => $a.rcl($x, $y),
            _ => $a.rcr($x, $y),
        }
        .unwrap()
    };
}

/// setcc / cmovcc / jcc over all 16 conditions.
macro_rules! paste_cc {
    ($a:expr, $k:expr, set, $x:expr) => {
        match $k % 16 {
            0 => $a.seto($x),
            1 => $a.setno($x),
            2 => $a.setb($x),
            3 => $a.setae($x),
            4 => $a.sete($x),
            5 => $a.setne($x),
            6 => $a.setbe($x),
            7 => $a.seta($x),
            8 => $a.sets($x),
            9 => $a.setns($x),
            10 => $a.setp($x),
            11 => $a.setnp($x),
            12 => $a.setl($x),
            13 => $a.setge($x),
            14 => $a.setle($x),
            _ => $a.setg($x),
        }
        .unwrap()
    };
    ($a:expr, $k:expr, cmov, $x:expr, $y:expr) => {
        match $k % 16 {
            0 => $a.cmovo($x, $y),
            1 => $a.cmovno($x, $y),
            2 => $a.cmovb($x, $y),
            3 => $a.cmovae($x, $y),
            4 => $a.cmove($x, $y),
            5 => $a.cmovne($x, $y),
            6 => $a.cmovbe($x, $y),
            7 => $a.cmova($x, $y),
            8 => $a.cmovs($x, $y),
            9 => $a.cmovns($x, $y),
            10 => $a.cmovp($x, $y),
            11 => $a.cmovnp($x, $y),
            12 => $a.cmovl($x, $y),
            13 => $a.cmovge($x, $y),
            14 => $a.cmovle($x, $y),
            _ => $a.cmovg($x, $y),
        }
        .unwrap()
    };
    ($a:expr, $k:expr, j, $x:expr) => {
        match $k % 16 {
            0 => $a.jo($x),
            1 => $a.jno($x),
            2 => $a.jb($x),
            3 => $a.jae($x),
            4 => $a.je($x),
            5 => $a.jne($x),
            6 => $a.jbe($x),
            7 => $a.ja($x),
            8 => $a.js($x),
            9 => $a.jns($x),
            10 => $a.jp($x),
            11 => $a.jnp($x),
            12 => $a.jl($x),
            13 => $a.jge($x),
            14 => $a.jle($x),
            _ => $a.jg($x),
        }
        .unwrap()
    };
}

pub struct Program {
    pub bytes: Vec<u8>,
    pub entry: u64,
    pub data: u64,
    pub end_slot: u64,
    pub init_regs: [u64; 16],
    pub init_flags: u64,
    pub data_image: Vec<u8>,
}

struct G<'a> {
    a: CodeAssembler,
    r: &'a mut Rng,
    data_labels: Vec<CodeLabel>,
    subs: Vec<CodeLabel>,
    /// (label of a table, targets) to be filled after assembly.
    tables: Vec<(CodeLabel, Vec<CodeLabel>)>,
    fn_table: CodeLabel,
    ret8: CodeLabel,
    push_depth: u32,
}

impl G<'_> {
    fn reg(&mut self, no_rcx: bool) -> usize {
        if no_rcx {
            self.r.pick(&NO_RCX)
        } else {
            self.r.below(13) as usize
        }
    }

    fn mem_disp(&mut self, size: u64) -> i32 {
        ((self.r.below((DATA_BYTES as u64 - 64) / size)) * size) as i32
    }

    /// One straight-line instruction (or short idiom) that does not touch RCX if asked.
    fn simple(&mut self, no_rcx: bool) {
        let x = self.reg(no_rcx);
        let y = self.reg(false);
        let k = self.r.below(9);
        let imm = self.r.next() as i32 >> self.r.below(31);
        match self.r.below(40) {
            0..=3 => alu!(self.a, k, R64[x], R64[y]),
            4..=5 => alu!(self.a, k, R32[x], R32[y]),
            6 => alu!(self.a, k, R16[x], R16[y]),
            7 => alu!(self.a, k, R8[x], R8[y]),
            8..=9 if k % 9 == 8 => self.a.mov(R64[x], imm as i64).unwrap(),
            8..=9 => alu_imm!(self.a, k, R64[x], imm),
            10 => alu_imm!(self.a, k, R32[x], imm),
            11 => {
                let d = self.mem_disp(8);
                alu!(self.a, k, R64[x], qword_ptr(rbx + d))
            }
            12 => {
                let d = self.mem_disp(4);
                alu!(self.a, k, dword_ptr(rbx + d), R32[y])
            }
            13 => {
                let d = self.mem_disp(1);
                alu_imm!(self.a, k, byte_ptr(rbx + d), imm as i8 as i32)
            }
            14 => {
                let l = self.r.pick(&self.data_labels);
                alu!(self.a, k, R64[x], qword_ptr(l))
            }
            15 => {
                let l = self.r.pick(&self.data_labels);
                alu!(self.a, k, dword_ptr(l), R32[y])
            }
            16 => {
                let l = self.r.pick(&self.data_labels);
                self.a.lea(R64[x], ptr(l)).unwrap()
            }
            17 => {
                let d = self.mem_disp(1) - 2048;
                let s = self.r.pick(&[1, 2, 4, 8]);
                let z = self.reg(false);
                self.a.lea(R64[x], ptr(R64[y] + R64[z] * s + d)).unwrap()
            }
            18 => match self.r.below(4) {
                0 => self.a.inc(R64[x]).unwrap(),
                1 => self.a.dec(R32[x]).unwrap(),
                2 => self.a.neg(R64[x]).unwrap(),
                _ => self.a.not(R16[x]).unwrap(),
            },
            19 => shift!(self.a, k, R64[x], (self.r.below(70)) as u32),
            20 => shift!(self.a, k, R32[x], (self.r.below(3)) as u32),
            21 if !no_rcx => shift!(self.a, k, R64[x], cl),
            21 => shift!(self.a, k, R8[x], 1u32),
            22 => match self.r.below(3) {
                0 => self.a.imul_2(R64[x], R64[y]).unwrap(),
                1 => self.a.imul_3(R32[x], R32[y], imm).unwrap(),
                _ => {
                    let d = self.mem_disp(8);
                    self.a.imul_2(R64[x], qword_ptr(rbx + d)).unwrap()
                }
            },
            23 => {
                // mul/div with a safe divisor (not RAX/RDX)
                let z = self.r.pick(&[3usize, 4, 6, 7, 8, 9, 10, 11, 12]);
                if self.r.chance(50) {
                    self.a.mul(R64[z]).unwrap();
                } else {
                    self.a.mov(R64[z], (self.r.below(1000) + 1) as i64).unwrap();
                    self.a.xor(edx, edx).unwrap();
                    self.a.div(R64[z]).unwrap();
                }
            }
            24 => {
                let c = self.r.below(16);
                paste_cc!(self.a, c, set, R8[x]);
            }
            25 => {
                let c = self.r.below(16);
                paste_cc!(self.a, c, cmov, R64[x], R64[y]);
            }
            26 => match self.r.below(5) {
                0 => self.a.movzx(R64[x], R8[y]).unwrap(),
                1 => self.a.movsx(R32[x], R16[y]).unwrap(),
                2 => self.a.movsxd(R64[x], R32[y]).unwrap(),
                3 => self.a.bswap(R64[x]).unwrap(),
                _ => self.a.bswap(R32[x]).unwrap(),
            },
            27 => match self.r.below(4) {
                0 if x != 1 && y != 1 || !no_rcx => self.a.xchg(R64[x], R64[y]).unwrap(),
                1 if x != 1 && y != 1 || !no_rcx => self.a.xadd(R64[x], R64[y]).unwrap(),
                2 => {
                    let d = self.mem_disp(8);
                    self.a.cmpxchg(qword_ptr(rbx + d), R64[x]).unwrap()
                }
                _ => {
                    let d = self.mem_disp(4);
                    self.a.xadd(dword_ptr(rbx + d), R32[x]).unwrap()
                }
            },
            28 => match self.r.below(6) {
                0 => self.a.bt(R64[x], R64[y]).unwrap(),
                1 => self.a.bts(R64[x], (self.r.below(64)) as u32).unwrap(),
                2 => self.a.btr(R32[x], R32[y]).unwrap(),
                3 => self.a.btc(R64[x], (self.r.below(64)) as u32).unwrap(),
                4 => self.a.bsf(R64[x], R64[y]).unwrap(),
                _ => self.a.bsr(R32[x], R32[y]).unwrap(),
            },
            29 => match self.r.below(3) {
                0 => self.a.popcnt(R64[x], R64[y]).unwrap(),
                1 => self.a.lzcnt(R64[x], R64[y]).unwrap(),
                _ => self.a.tzcnt(R32[x], R32[y]).unwrap(),
            },
            30 => match self.r.below(9) {
                0 => {
                    self.a.lahf().unwrap();
                }
                1 => self.a.sahf().unwrap(),
                2 => self.a.clc().unwrap(),
                3 => self.a.stc().unwrap(),
                4 => self.a.cmc().unwrap(),
                5 => self.a.cdqe().unwrap(),
                6 => self.a.cqo().unwrap(),
                7 => self.a.cwde().unwrap(),
                _ => self.a.cdq().unwrap(),
            },
            31 => match self.r.below(3) {
                0 => self
                    .a
                    .shld(R64[x], R64[y], (self.r.below(64)) as u32)
                    .unwrap(),
                1 => self
                    .a
                    .shrd(R32[x], R32[y], (self.r.below(32)) as u32)
                    .unwrap(),
                _ if !no_rcx => self.a.shld(R64[x], R64[y], cl).unwrap(),
                _ => self.a.nop().unwrap(),
            },
            32 => {
                let d = self.mem_disp(8);
                self.a.test(qword_ptr(rbx + d), R64[y]).unwrap()
            }
            33 => self.a.test(R32[x], imm).unwrap(),
            34 => {
                // high-byte registers
                let hb = [ah, ch, dh, bh];
                let lb = [al, cl, dl, bl];
                let p = self.r.below(4) as usize;
                let q = self.r.below(4) as usize;
                if no_rcx || p == 3 {
                    self.a.add(al, hb[q]).unwrap();
                } else {
                    alu!(self.a, k, hb[p], lb[q]);
                }
            }
            35 if self.push_depth < 24 => {
                match self.r.below(4) {
                    0 => self.a.push(R64[y]).unwrap(),
                    1 => self.a.push(imm).unwrap(),
                    2 => {
                        let d = self.mem_disp(8);
                        self.a.push(qword_ptr(rbx + d)).unwrap()
                    }
                    _ => {
                        let l = self.r.pick(&self.data_labels);
                        self.a.push(qword_ptr(l)).unwrap()
                    }
                }
                self.push_depth += 1;
            }
            36 if self.push_depth > 0 && self.push_depth < 24 => {
                if self.r.chance(70) {
                    self.a.pop(R64[x]).unwrap();
                } else {
                    let d = self.mem_disp(8);
                    self.a.pop(qword_ptr(rbx + d)).unwrap();
                }
                self.push_depth -= 1;
            }
            37 => {
                let z = self.reg(true);
                self.a.mov(R64[z], (self.r.below(60)) as i64).unwrap();
                let d = self.mem_disp(8) % 3000;
                alu!(self.a, k, R64[x], qword_ptr(rbx + R64[z] * 8 + d))
            }
            38 if self.r.chance(30) => {
                // mov r64, fs:[0] (the thread pointer; read-only)
                let hw: [u8; 13] = [0, 1, 2, 6, 7, 5, 8, 9, 10, 11, 12, 13, 14];
                let r = hw[x];
                let rex = 0x48 | if r >= 8 { 4 } else { 0 };
                self.a
                    .db(&[0x64, rex, 0x8B, 0x04 | ((r & 7) << 3), 0x25, 0, 0, 0, 0])
                    .unwrap();
            }
            38 => {
                let d = self.mem_disp(2);
                self.a.movzx(R32[x], word_ptr(rbx + d)).unwrap()
            }
            _ => {
                let d = self.mem_disp(8);
                self.a.mov(qword_ptr(rbx + d), R64[y]).unwrap()
            }
        }
    }

    fn string_op(&mut self) {
        let n = self.r.below(12) as i64;
        let down = self.r.chance(30);
        let so = 256 + self.r.below(1500) as i32;
        let doff = 1900 + self.r.below(1500) as i32;
        self.a.lea(rsi, ptr(rbx + so)).unwrap();
        self.a.lea(rdi, ptr(rbx + doff)).unwrap();
        self.a.mov(rcx, n).unwrap();
        if down {
            self.a.std().unwrap();
        }
        let rep = self.r.below(3); // 0 none, 1 rep/repe, 2 repne
        macro_rules! pre {
            ($kind:expr) => {
                match ($kind, rep) {
                    (_, 0) => &mut self.a,
                    (true, 2) => self.a.repne(),
                    (true, _) => self.a.repe(),
                    (false, _) => self.a.rep(),
                }
            };
        }
        match self.r.below(10) {
            0 => pre!(false).movsb().unwrap(),
            1 => pre!(false).movsq().unwrap(),
            2 => pre!(false).stosb().unwrap(),
            3 => pre!(false).stosd().unwrap(),
            4 => pre!(false).lodsw().unwrap(),
            5 => pre!(true).cmpsb().unwrap(),
            6 => pre!(true).cmpsq().unwrap(),
            7 => pre!(true).scasb().unwrap(),
            8 => pre!(true).scasd().unwrap(),
            _ => pre!(false).movsd().unwrap(),
        }
        if down && self.r.chance(70) {
            self.a.cld().unwrap();
        }
    }

    fn forward_jcc(&mut self, depth: u32) {
        let mut skip = self.a.create_label();
        let c = self.r.below(16);
        if self.r.chance(20) {
            self.a.jrcxz(skip).unwrap();
        } else {
            paste_cc!(self.a, c, j, skip);
        }
        let n = 1 + self.r.below(4);
        for _ in 0..n {
            self.item(depth + 1, false);
        }
        self.a.set_label(&mut skip).unwrap();
        self.a.nop().unwrap();
    }

    fn counted_loop(&mut self) {
        let iters = 1 + self.r.below(6) as i64;
        self.a.mov(rcx, iters).unwrap();
        let mut top = self.a.create_label();
        self.a.set_label(&mut top).unwrap();
        let n = 1 + self.r.below(4);
        for _ in 0..n {
            self.simple(true);
        }
        match self.r.below(4) {
            0 => self.a.loop_(top).unwrap(),
            1 => self.a.loope(top).unwrap(),
            2 => self.a.loopne(top).unwrap(),
            _ => {
                self.a.dec(rcx).unwrap();
                self.a.jne(top).unwrap();
            }
        }
    }

    fn jump_table(&mut self) {
        let n = 2 + self.r.below(4) as usize;
        let table = self.a.create_label();
        let mut targets: Vec<CodeLabel> = (0..n).map(|_| self.a.create_label()).collect();
        let mut join = self.a.create_label();
        let idx = self.r.below(n as u64) as i64;
        let z = self.reg(true);
        self.a.mov(R64[z], idx).unwrap();
        if self.r.chance(50) {
            let w = self.r.pick(&[3usize, 4, 6, 7, 8]);
            let w = if w == z { 9 } else { w };
            self.a.lea(R64[w], ptr(table)).unwrap();
            self.a.jmp(qword_ptr(R64[w] + R64[z] * 8)).unwrap();
        } else {
            self.a.mov(R64[z], qword_ptr(table)).unwrap(); // load first entry
            self.a.jmp(R64[z]).unwrap();
            // (only entry 0 reached in this variant)
        }
        for t in targets.iter_mut() {
            self.a.set_label(t).unwrap();
            self.simple(false);
            self.a.jmp(join).unwrap();
        }
        self.a.set_label(&mut join).unwrap();
        self.a.nop().unwrap();
        self.tables.push((table, targets));
    }

    fn call_sub(&mut self, depth: u32) {
        if self.subs.is_empty() {
            return;
        }
        let s = self.r.pick(&self.subs);
        match self.r.below(4) {
            0 => self.a.call(s).unwrap(),
            3 => {
                // an argument on the stack, popped by the callee's `ret 8`
                let imm = self.r.next() as i32;
                self.a.push(imm).unwrap();
                self.a.call(self.ret8).unwrap();
            }
            1 => {
                let k = self.r.below(self.subs.len() as u64) as i32;
                let z = self.reg(true);
                self.a.mov(R64[z], qword_ptr(self.fn_table)).unwrap();
                let _ = k;
                self.a.call(R64[z]).unwrap();
            }
            _ => {
                let k = self.r.below(self.subs.len() as u64) as i64;
                let z = self.reg(true);
                let w = if z == 3 { 4 } else { 3 };
                self.a.mov(R64[z], k).unwrap();
                self.a.lea(R64[w], ptr(self.fn_table)).unwrap();
                self.a.call(qword_ptr(R64[w] + R64[z] * 8)).unwrap();
            }
        }
        let _ = depth;
    }

    fn item(&mut self, depth: u32, top: bool) {
        let roll = self.r.below(100);
        match roll {
            0..=69 => self.simple(false),
            70..=76 if depth < 2 => self.forward_jcc(depth),
            77..=80 if depth < 2 => self.counted_loop(),
            81..=85 => self.string_op(),
            86..=90 if top => self.jump_table(),
            91..=96 if top => self.call_sub(depth),
            _ => self.simple(false),
        }
    }
}

/// Generates program number `seed` for placement at `base`.
pub fn program(seed: u64, base: u64, len_items: usize) -> Program {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for _ in 0..4 {
        rng.next();
    }
    let mut a = CodeAssembler::new(64).unwrap();
    let data_labels: Vec<CodeLabel> = (0..32).map(|_| a.create_label()).collect();
    let fn_table = a.create_label();
    let nsubs = 1 + rng.below(4) as usize;
    let subs: Vec<CodeLabel> = (0..nsubs).map(|_| a.create_label()).collect();
    let ret8 = a.create_label();
    let mut g = G {
        a,
        r: &mut rng,
        data_labels,
        subs: subs.clone(),
        tables: Vec::new(),
        fn_table,
        ret8,
        push_depth: 0,
    };
    let mut end_slot = g.a.create_label();
    let mut entry = g.a.create_label();
    g.a.set_label(&mut entry).unwrap();
    for _ in 0..len_items {
        g.item(0, true);
    }
    g.a.jmp(qword_ptr(end_slot)).unwrap();
    // Subroutines: sub k may call sub k+1 (nesting), some use `ret imm16`.
    let mut subs = subs;
    for k in 0..nsubs {
        let mut l = subs[k];
        g.a.set_label(&mut l).unwrap();
        subs[k] = l;
        let saved_depth = g.push_depth;
        g.push_depth = 24; // no push/pop inside subs (keeps the frame balanced)
        for _ in 0..(1 + g.r.below(5)) {
            g.simple(false);
        }
        if k + 1 < nsubs && g.r.chance(60) {
            g.a.call(subs[k + 1]).unwrap();
            g.simple(false);
        }
        g.push_depth = saved_depth;
        g.a.ret().unwrap();
    }
    // A callee that pops its stack argument: `add rax, [rsp+8]; ret 8`.
    let mut ret8 = g.ret8;
    g.a.set_label(&mut ret8).unwrap();
    g.a.add(rax, qword_ptr(rsp + 8)).unwrap();
    g.push_depth = 24; // no push/pop in the callee
    g.simple(false);
    g.a.ret_1(8).unwrap();
    // Tables then data.
    let mut tables = std::mem::take(&mut g.tables);
    for (t, targets) in tables.iter_mut() {
        g.a.set_label(t).unwrap();
        g.a.db(&vec![0u8; 8 * targets.len()]).unwrap();
    }
    let mut fn_table = fn_table;
    g.a.set_label(&mut fn_table).unwrap();
    g.a.db(&vec![0u8; 8 * nsubs]).unwrap();
    g.a.set_label(&mut end_slot).unwrap();
    g.a.db(&[0u8; 8]).unwrap();
    g.a.db(&[0u8; 56]).unwrap();
    let mut data_image = vec![0u8; DATA_BYTES];
    for b in data_image.iter_mut() {
        *b = g.r.next() as u8;
    }
    let mut labels = g.data_labels.clone();
    for (i, l) in labels.iter_mut().enumerate() {
        g.a.set_label(l).unwrap();
        g.a.db(&data_image[i * 128..(i + 1) * 128]).unwrap();
    }
    let mut init_regs = [0u64; 16];
    for r in init_regs.iter_mut() {
        *r = g.r.next() >> g.r.below(64);
    }
    let init_flags = 0x202 | (g.r.next() & 0x8D5);
    let res =
        g.a.assemble_options(base, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)
            .unwrap();
    let mut bytes = res.inner.code_buffer.clone();
    let ip = |l: &CodeLabel| res.label_ip(l).unwrap();
    for (t, targets) in &tables {
        let off = (ip(t) - base) as usize;
        for (i, tl) in targets.iter().enumerate() {
            bytes[off + 8 * i..off + 8 * i + 8].copy_from_slice(&ip(tl).to_le_bytes());
        }
    }
    let off = (ip(&fn_table) - base) as usize;
    for (i, s) in subs.iter().enumerate() {
        bytes[off + 8 * i..off + 8 * i + 8].copy_from_slice(&ip(s).to_le_bytes());
    }
    let data = ip(&labels[0]);
    init_regs[3] = data; // RBX = data base
    Program {
        entry: ip(&entry),
        data,
        end_slot: ip(&end_slot),
        bytes,
        init_regs,
        init_flags,
        data_image,
    }
}
