//! A deterministic stream of memory records shaped like the engine's for a guest that
//! runs kernel and user code: the records a program of many functions makes, grouped as
//! the engine groups them (`guest-engine/src/records.rs` `fetch_runs`): a run of
//! consecutive instructions without operands is one `FETCH_RUN` record (or a plain
//! `FETCH` record when alone), an instruction with operands has its fetch carried by its
//! first operand record (`WITH_FETCH`), the others follow it.
//!
//! The program: functions of a few basic blocks of 1–10 instructions (x86-like lengths),
//! called with a skewed popularity (a few hot functions, a long tail), loops, calls up to
//! a depth, user code calling into the kernel. Data: stack slots, globals of skewed
//! popularity, fields of objects picked per call, and sequential streams (copies); sizes
//! 1–64 bytes, some crossing lines, a few without a physical address.

use kpin_tool::{access, MemRecord};

/// splitmix64: the stream's only source of randomness.
pub struct Rng(pub u64);

impl Rng {
    pub fn word(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.word() % n
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// An index below `n`, small ones far more often (about `n·u⁸`).
    pub fn skewed(&mut self, n: u64) -> u64 {
        let u = (self.word() >> 11) as f64 / (1u64 << 53) as f64;
        ((n as f64) * u.powi(8)) as u64
    }
}

#[derive(Clone, Copy)]
enum Place {
    /// At this offset from the frame's stack pointer.
    Stack(u64),
    /// This physical address.
    Global(u64),
    /// At this offset in the object the frame works on.
    Field(u64),
    /// The frame's sequential cursor (advanced by the size).
    Stream,
}

#[derive(Clone, Copy)]
struct Operand {
    place: Place,
    size: u32,
    access: u32,
}

struct Insn {
    len: u64,
    ops: Vec<Operand>,
}

struct Block {
    /// Offset of the first instruction in the function.
    offset: u64,
    insns: Vec<Insn>,
    /// A loop's back edge to this earlier block of the function.
    back_to: Option<usize>,
}

struct Func {
    pa: u64,
    va: u64,
    kernel: bool,
    blocks: Vec<Block>,
}

struct Frame {
    func: usize,
    block: usize,
    sp: u64,
    object: u64,
    cursor: u64,
    loops_left: u32,
}

/// Kernel functions, then user ones.
const KERNEL_FUNCS: usize = 3000;
const USER_FUNCS: usize = 3000;
const MAX_DEPTH: usize = 24;
const KERNEL_VA: u64 = 0xffff_ffff_8000_0000;
const USER_VA: u64 = 0x40_0000;

pub struct Program {
    rng: Rng,
    funcs: Vec<Func>,
    stack: Vec<Frame>,
}

impl Program {
    pub fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut funcs = Vec::new();
        let (mut kernel_pa, mut user_pa) = (0x100_0000u64, 0x800_0000u64);
        for f in 0..KERNEL_FUNCS + USER_FUNCS {
            let kernel = f < KERNEL_FUNCS;
            let mut blocks = Vec::new();
            let mut offset = 0;
            for b in 0..2 + rng.below(14) as usize {
                let insns: Vec<Insn> = (0..1 + rng.below(10))
                    .map(|_| Insn {
                        len: insn_len(&mut rng),
                        ops: operands(&mut rng),
                    })
                    .collect();
                let back_to = (b > 0 && rng.chance(25)).then(|| rng.below(b as u64) as usize);
                let len: u64 = insns.iter().map(|i| i.len).sum();
                blocks.push(Block {
                    offset,
                    insns,
                    back_to,
                });
                offset += len;
            }
            let pa = if kernel { &mut kernel_pa } else { &mut user_pa };
            let at = *pa;
            // Functions 16-byte aligned; user code now and then on a fresh page.
            *pa = (at + offset + 15) & !15;
            if !kernel && rng.chance(10) {
                *pa = (*pa + 0x1000 + rng.below(64) * 0x1000) & !0xfff;
            }
            let va = if kernel {
                KERNEL_VA + at
            } else {
                USER_VA + at - 0x800_0000
            };
            funcs.push(Func {
                pa: at,
                va,
                kernel,
                blocks,
            });
        }
        Program {
            rng,
            funcs,
            stack: Vec::new(),
        }
    }

    fn call(&mut self, func: usize) {
        let r = &mut self.rng;
        let kernel = self.funcs[func].kernel;
        // A kernel stack per "task" and one user stack, frames 192 bytes apart.
        let sp = match self.stack.last() {
            Some(f) if self.funcs[f.func].kernel == kernel => f.sp - 192,
            _ if kernel => 0x3000_0000 + r.below(8) * 0x4000 + 0x3f00,
            _ => 0x3800_0000 + 0xff00,
        };
        // Mostly one of a few hot objects, else one of many.
        let objects = if r.chance(97) { 16 } else { 1 << 16 };
        let object = if kernel { 0x1000_0000 } else { 0x2000_0000 } + r.skewed(objects) * 256;
        let cursor = 0x4000_0000 + r.below(1 << 15) * 0x1000;
        self.stack.push(Frame {
            func,
            block: 0,
            sp,
            object,
            cursor,
            loops_left: r.below(6) as u32,
        });
    }

    fn pick_func(&mut self, kernel: bool) -> usize {
        let n = if kernel { KERNEL_FUNCS } else { USER_FUNCS };
        let base = if kernel { 0 } else { KERNEL_FUNCS };
        base + self.rng.skewed(n as u64) as usize
    }

    /// Appends the records of the next basic block executed.
    pub fn step(&mut self, out: &mut Vec<MemRecord>) {
        if self.stack.is_empty() {
            let kernel = self.rng.chance(40);
            let f = self.pick_func(kernel);
            self.call(f);
        }
        let frame = self.stack.last_mut().expect("a frame");
        let func = &self.funcs[frame.func];
        let block = &func.blocks[frame.block];
        let cpl = if func.kernel {
            0
        } else {
            3u32 << access::CPL_SHIFT
        };
        let (mut pa, mut va) = (func.pa + block.offset, func.va + block.offset);
        let mut insns = block.insns.iter().peekable();
        while let Some(i) = insns.next() {
            if i.ops.is_empty() {
                // A run of instructions without operands: one record.
                let (start_pa, start_va) = (pa, va);
                let (mut n, mut lens) = (1u32, i.len);
                pa += i.len;
                va += i.len;
                while n < 16 && insns.peek().is_some_and(|j| j.ops.is_empty()) {
                    let j = insns.next().expect("peeked");
                    lens |= j.len << (4 * n);
                    n += 1;
                    pa += j.len;
                    va += j.len;
                }
                out.push(if n == 1 {
                    MemRecord {
                        ip: start_va,
                        ea: start_va,
                        size: i.len as u32,
                        access: access::FETCH | cpl,
                        pa: start_pa,
                    }
                } else {
                    MemRecord {
                        ip: start_va,
                        ea: lens,
                        size: n,
                        access: access::FETCH | access::FETCH_RUN | cpl,
                        pa: start_pa,
                    }
                });
                continue;
            }
            for (k, op) in i.ops.iter().enumerate() {
                let data = match op.place {
                    Place::Stack(off) => frame.sp + off,
                    Place::Global(at) => at,
                    Place::Field(off) => frame.object + off,
                    Place::Stream => {
                        frame.cursor += u64::from(op.size);
                        frame.cursor - u64::from(op.size)
                    }
                };
                let data = if self.rng.below(5000) == 0 {
                    u64::MAX
                } else {
                    data
                };
                out.push(if k == 0 {
                    MemRecord {
                        ip: va,
                        ea: pa,
                        size: op.size,
                        access: op.access
                            | access::WITH_FETCH
                            | (i.len as u32) << access::FETCH_LEN_SHIFT
                            | cpl,
                        pa: data,
                    }
                } else {
                    MemRecord {
                        ip: va,
                        ea: va,
                        size: op.size,
                        access: op.access | cpl,
                        pa: data,
                    }
                });
            }
            pa += i.len;
            va += i.len;
        }
        // Where control goes next: a loop's back edge, a call, a forward branch, the next
        // block, or a return after the last.
        let (back_to, last) = (block.back_to, frame.block + 1 == func.blocks.len());
        let kernel = func.kernel;
        if let Some(to) = back_to.filter(|_| frame.loops_left > 0) {
            frame.loops_left -= 1;
            frame.block = to;
            return;
        }
        if last {
            self.stack.pop();
            return;
        }
        frame.block += 1;
        if frame.block + 1 < func.blocks.len() && self.rng.chance(15) {
            frame.block += 1;
        }
        if self.stack.len() < MAX_DEPTH && self.rng.chance(3) {
            // User code enters the kernel now and then (a system call).
            let kernel = kernel || self.rng.chance(8);
            let f = self.pick_func(kernel);
            self.call(f);
        }
    }

    /// The next `n` records or a few more (whole blocks).
    pub fn records(&mut self, n: usize, out: &mut Vec<MemRecord>) {
        out.clear();
        while out.len() < n {
            self.step(out);
        }
    }
}

/// x86-like instruction lengths, 1–15 bytes, mostly 2–7.
fn insn_len(r: &mut Rng) -> u64 {
    const WEIGHTS: [u64; 15] = [5, 12, 20, 18, 14, 8, 10, 4, 2, 2, 1, 1, 1, 1, 1];
    let mut x = r.below(WEIGHTS.iter().sum());
    for (i, w) in WEIGHTS.iter().enumerate() {
        if x < *w {
            return i as u64 + 1;
        }
        x -= w;
    }
    unreachable!()
}

/// An instruction's operands: none for most, a read, a write, a read-modify-write,
/// or two (a `push [m]`: a read and a stack write).
fn operands(r: &mut Rng) -> Vec<Operand> {
    let size = match r.below(100) {
        0..=59 => 8,
        60..=79 => 4,
        80..=84 => 1,
        85..=89 => 2,
        90..=94 => 16,
        95..=97 => 32,
        _ => 64,
    };
    let aligned = |r: &mut Rng, span: u64| {
        let off = r.below(span);
        if r.chance(3) {
            off
        } else {
            off & !(u64::from(size) - 1)
        }
    };
    let place = match r.below(100) {
        0..=44 => Place::Stack(aligned(r, 192)),
        45..=64 => {
            let lines = if r.chance(97) { 128 } else { 1 << 17 };
            Place::Global(0x200_0000 + r.skewed(lines) * 64 + aligned(r, 64))
        }
        65..=94 => Place::Field(aligned(r, 256)),
        _ => Place::Stream,
    };
    let op = |access| Operand {
        place,
        size,
        access,
    };
    match r.below(100) {
        0..=69 => Vec::new(),
        70..=86 => vec![op(access::READ)],
        87..=94 => vec![op(access::WRITE)],
        95..=97 => vec![op(access::READ | access::WRITE)],
        _ => vec![
            op(access::READ),
            Operand {
                place: Place::Stack(0),
                size: 8,
                access: access::WRITE,
            },
        ],
    }
}
