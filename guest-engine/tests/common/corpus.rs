//! A corpus of compiled functions (sorting, hashing, recursion, switch-heavy
//! interpretation, non-local returns, PLT calls into libc) and a harness that runs one
//! natively and under translation from the same state.

use super::{HostMemory, HostPlatform, Region, Rig, FLAGS_MASK};
use guest_engine::{Config, GuestRegs, GuestVirt, Stop, Tool};

pub type Work = extern "sysv64" fn(*mut u64, u64) -> u64;

pub const BUF_WORDS: usize = 4096;

#[inline(never)]
pub extern "sysv64" fn quicksort_fn(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: the harness passes a buffer of BUF_WORDS words.
    let v = unsafe { std::slice::from_raw_parts_mut(buf, n as usize) };
    fn qs(v: &mut [u64]) {
        if v.len() <= 1 {
            return;
        }
        let last = v.len() - 1;
        v.swap(v.len() / 2, last);
        let p = v[last];
        let mut store = 0;
        for i in 0..last {
            if v[i] < p {
                v.swap(i, store);
                store += 1;
            }
        }
        v.swap(store, last);
        let (a, b) = v.split_at_mut(store);
        let b = &mut b[1..];
        qs(a);
        qs(b);
    }
    qs(v);
    v.iter().enumerate().fold(0u64, |h, (i, x)| {
        h.wrapping_mul(31).wrapping_add(x ^ i as u64)
    })
}

#[inline(never)]
pub extern "sysv64" fn std_sort_fn(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: as above.
    let v = unsafe { std::slice::from_raw_parts_mut(buf, n as usize) };
    v.sort_unstable();
    v[0] ^ v[v.len() - 1]
}

#[inline(never)]
pub extern "sysv64" fn hash_fn(buf: *mut u64, n: u64) -> u64 {
    use std::hash::{Hash, Hasher};
    // SAFETY: as above.
    let v = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), 8 * n as usize) };
    let mut fnv: u64 = 0xcbf2_9ce4_8422_2325;
    for b in v {
        fnv = (fnv ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
    }
    let mut crc = 0xFFFF_FFFFu32;
    for b in v {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    fnv ^ u64::from(crc) ^ h.finish()
}

#[inline(never)]
pub extern "sysv64" fn recursion_fn(buf: *mut u64, n: u64) -> u64 {
    fn fib(n: u64) -> u64 {
        if n < 2 {
            n
        } else {
            fib(n - 1) + fib(n - 2)
        }
    }
    fn ack(m: u64, n: u64) -> u64 {
        match (m, n) {
            (0, n) => n + 1,
            (m, 0) => ack(m - 1, 1),
            (m, n) => ack(m - 1, ack(m, n - 1)),
        }
    }
    fn even(n: u64) -> bool {
        if n == 0 {
            true
        } else {
            odd(n - 1)
        }
    }
    fn odd(n: u64) -> bool {
        if n == 0 {
            false
        } else {
            even(n - 1)
        }
    }
    let k = std::hint::black_box(n % 7 + 14);
    // SAFETY: as above.
    unsafe { *buf = fib(k) };
    fib(k) + ack(2, std::hint::black_box(3)) + u64::from(even(std::hint::black_box(n % 100 + 50)))
}

#[inline(never)]
pub extern "sysv64" fn interp_fn(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: as above.
    let code = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), 8 * n as usize) };
    let mut acc: u64 = 1;
    let mut stack = [0u64; 16];
    let mut sp = 0usize;
    for (pc, op) in code.iter().enumerate() {
        acc = match op % 12 {
            0 => acc.wrapping_add(u64::from(*op)),
            1 => acc.wrapping_mul(3),
            2 => acc ^ (acc >> 7),
            3 => {
                stack[sp % 16] = acc;
                sp = sp.wrapping_add(1);
                acc
            }
            4 => {
                sp = sp.wrapping_sub(1);
                acc.wrapping_add(stack[sp % 16])
            }
            5 => acc.rotate_left(u32::from(*op)),
            6 => acc.wrapping_sub(pc as u64),
            7 => !acc,
            8 => acc / (u64::from(*op) + 1),
            9 => acc.wrapping_shl(3) | 1,
            10 => (acc.count_ones() as u64).wrapping_add(acc),
            _ => acc.swap_bytes(),
        };
    }
    acc
}

#[inline(never)]
pub extern "sysv64" fn libc_fn(buf: *mut u64, n: u64) -> u64 {
    // memcpy/memmove/memcmp/strlen through the PLT (indirect calls via the GOT).
    let bytes = 8 * n as usize / 2;
    // SAFETY: the buffer holds 8*n bytes.
    unsafe {
        let p = buf.cast::<u8>();
        libc::memmove(p.add(bytes).cast(), p.cast(), bytes - 8);
        libc::memcpy(p.add(3).cast(), p.add(bytes + 5).cast(), 100);
        *p.add(bytes - 1) = 0;
        let l = libc::strlen(p.cast()) as u64;
        let c = libc::memcmp(p.cast(), p.add(bytes).cast(), 64) as i64 as u64;
        l ^ c
    }
}

std::arch::global_asm!(
    ".globl kpin_nlr_test",
    "kpin_nlr_test:",
    "push rbx",
    "push rbp",
    "push r12",
    "mov [rdi], rsp",
    "lea rax, [rip + 2f]",
    "mov [rdi + 8], rax",
    "mov rbx, rdi",
    "mov rdi, rsi",
    "and rdi, 63",
    "call kpin_nlr_rec",
    "ud2",
    "2:",
    "pop r12",
    "pop rbp",
    "pop rbx",
    "ret",
    "kpin_nlr_rec:",
    "test rdi, rdi",
    "jz 3f",
    "push rdi",
    "dec rdi",
    "call kpin_nlr_rec",
    "pop rdi",
    "ret",
    "3:",
    "mov rsp, [rbx]",
    "mov rax, [rsp - 64]",
    "add rax, 0x1234",
    "jmp qword ptr [rbx + 8]",
);

extern "sysv64" {
    fn kpin_nlr_test(buf: *mut u64, n: u64) -> u64;
}

pub extern "sysv64" fn nlr_fn(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: the asm only uses the first two words of the buffer and its own stack.
    unsafe { kpin_nlr_test(buf, n) }
}

pub fn corpus() -> Vec<(&'static str, Work)> {
    vec![
        ("quicksort", quicksort_fn as Work),
        ("std_sort_unstable", std_sort_fn as Work),
        ("hash", hash_fn as Work),
        ("recursion", recursion_fn as Work),
        ("switch_interpreter", interp_fn as Work),
        ("libc_plt", libc_fn as Work),
        ("non_local_return", nlr_fn as Work),
    ]
}

pub struct Harness {
    pub rig: Rig,
    pub stack: Region,
    pub buf: Region,
}

impl Harness {
    pub fn new(config: Config) -> Self {
        Harness {
            rig: Rig::new(config),
            stack: Region::map(1 << 20, 0),
            buf: Region::map(BUF_WORDS * 8, 0),
        }
    }

    fn fill(&self, seed: u64) {
        let mut r = super::gen::Rng(seed | 1);
        // SAFETY: the buffer region is BUF_WORDS words.
        let w = unsafe { std::slice::from_raw_parts_mut(self.buf.ptr.cast::<u64>(), BUF_WORDS) };
        for x in w.iter_mut() {
            *x = r.next() >> 1;
        }
    }

    fn init(&self, n: u64, exit: u64) -> GuestRegs {
        let top = self.stack.addr() + self.stack.len as u64 - 4096;
        // return address slot: the function "returns" to the exit routine.
        // SAFETY: inside the stack mapping.
        unsafe { *((top - 8) as *mut u64) = exit };
        let mut g = GuestRegs {
            gpr: [0x5a5a_0000; 16],
            rflags: 0x202,
        };
        g.gpr[7] = self.buf.addr();
        g.gpr[6] = n;
        g.gpr[4] = top - 8;
        g
    }

    /// Single-steps `f` natively in a forked child (see `ptrace`).
    pub fn single_step(&mut self, f: Work, seed: u64, n: u64) -> Vec<super::ptrace::Step> {
        let exit = self.rig.native.exit_address();
        self.fill(seed);
        *self.rig.native.regs_mut() = self.init(n, exit);
        super::ptrace::single_step(&mut self.rig.native, f as usize as u64)
    }

    /// Returns (native regs, native buf), (translated regs, translated buf).
    pub fn run(
        &mut self,
        f: Work,
        seed: u64,
        n: u64,
        tool: &mut dyn Tool,
    ) -> ((GuestRegs, Vec<u8>), (GuestRegs, Vec<u8>)) {
        let exit = self.rig.native.exit_address();
        self.fill(seed);
        *self.rig.native.regs_mut() = self.init(n, exit);
        // SAFETY: the function returns to the exit routine through the prepared slot.
        unsafe { self.rig.native.run(f as usize as u64) };
        let mut native = *self.rig.native.regs();
        native.rflags &= FLAGS_MASK;
        let nbuf = self.buf.slice().to_vec();

        self.fill(seed);
        self.rig.engine.flush();
        *self.rig.engine.regs_mut() = self.init(n, exit);
        self.rig.engine.set_rip(GuestVirt(f as usize as u64));
        let mut mem = HostMemory::executable_mappings();
        mem.ranges.retain(|&(s, _)| s != self.rig.cache.addr());
        let mut plat = HostPlatform::default();
        let stop = self.rig.engine.run(&mut mem, &mut plat, tool);
        if let Stop::Error(
            guest_engine::EngineError::Encode(va) | guest_engine::EngineError::Unsupported(va),
        ) = stop
        {
            // SAFETY: the address is in the test binary's text.
            let b = unsafe { std::slice::from_raw_parts(va.0 as *const u8, 15) };
            let mut d = iced_x86::Decoder::with_ip(64, b, va.0, 0);
            let i = d.decode();
            eprintln!("cannot translate {:?} {:02x?}", i.code(), &b[..i.len()]);
        }
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        let mut tr = *self.rig.engine.regs();
        tr.rflags &= FLAGS_MASK;
        ((native, nbuf), (tr, self.buf.slice().to_vec()))
    }
}
