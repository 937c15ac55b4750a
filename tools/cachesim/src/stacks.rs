//! Shadow call stacks kept from the record stream, and the events per task and calling
//! context ([`crate::attr`]'s call stacks: `attribute=on callstacks=on`).
//!
//! A shadow call stack per task (user mode) or per kernel stack follows the engine's
//! [`kpin_tool::access::CALL`] and [`kpin_tool::access::RET`] bits: a `call` pushes a
//! frame (its return address, the slot it was stored in, the context its target runs in)
//! when the next fetch of that stack shows the target; a `ret` unwinds its stack to the
//! slot it read — or, without one, pops to the frame it returns through; a `ret` that
//! matches nothing leaves the stack as it is. Interrupts and exceptions need nothing:
//! their handlers' calls and returns balance above the interrupted frames. Kernel stacks
//! are told apart by the slots' addresses ([`KERNEL_STACK_SHIFT`]): Linux switches tasks
//! inside the kernel, where no `TASK` record comes. A call whose target jumps elsewhere
//! within [`ENTRY_INSNS`] instructions, or returns elsewhere than its own call's end (a
//! retpoline), is retargeted: a thunk's frame becomes its target's. Contexts deeper than
//! [`MAX_DEPTH`] stay at that depth; a stack keeps its newest [`MAX_FRAMES`] frames.

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::attr::{Context, Stacked, MAX_DEPTH, MAX_FRAMES, OVERFLOW, ROOT};

/// A call on a shadow stack.
#[derive(Clone, Copy, Debug)]
struct Frame {
    /// Where it returns to.
    ret: u64,
    /// The virtual address of the slot holding the return address (`u64::MAX`: not
    /// known).
    slot: u64,
    /// The context its target runs in.
    ctx: u32,
    /// Instructions its target ran itself so far, while at most [`ENTRY_INSNS`] (`None`
    /// past that): a jump, or a return from a call it made to somewhere else than that
    /// call's end, within them retargets the frame (an indirect-branch thunk, a
    /// retpoline, a PLT stub).
    entering: Option<u32>,
}

/// The count of a frame's own instructions after `k` and `n` more, if still entering.
fn entering(k: u32, n: u32) -> Option<u32> {
    let k = k.saturating_add(n);
    (k <= ENTRY_INSNS).then_some(k)
}

/// What the last `call` or `ret` of a stack left to do at its next fetch.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) enum Pending {
    #[default]
    None,
    Call {
        ret: u64,
        slot: u64,
    },
    Ret {
        slot: u64,
    },
}

/// A shadow call stack.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stack {
    frames: Vec<Frame>,
    pub(crate) pending: Pending,
    /// The fall-through of the stack's last fetch.
    next: u64,
}

impl Stack {
    pub(crate) fn ctx(&self) -> u32 {
        self.frames.last().map_or(ROOT, |f| f.ctx)
    }

    /// Drops the frames whose slots are at or below `slot` (the stack pointer is above
    /// them: they returned, or were unwound past); returns the last one dropped.
    fn unwind_to(&mut self, slot: u64) -> Option<Frame> {
        let mut last = None;
        while self
            .frames
            .last()
            .is_some_and(|f| f.slot != u64::MAX && f.slot <= slot)
        {
            last = self.frames.pop();
        }
        last
    }
}

/// Shift of a kernel stack's size: Linux's x86-64 task and IRQ stacks are
/// `THREAD_SIZE`-aligned blocks of 16 KiB (without KASAN), so a return address slot's
/// virtual address names the stack it is on.
pub const KERNEL_STACK_SHIFT: u32 = 14;
/// Bit 63 of a user stack's key (its task row below it); kernel stacks are keyed by
/// their slots' virtual address shifted right, which leaves it clear.
const USER_STACK: u64 = 1 << 63;
/// The stack of kernel code entered from user mode before its first call or return
/// shows the stack it runs on (always empty there).
const ENTRY_STACK: u64 = u64::MAX;
/// Most stacks kept besides the current one (each at most [`MAX_FRAMES`] frames); fewer
/// for a smaller tree (the engine's heap).
pub const MAX_PARKED: usize = 8192;
/// Instructions at a call's target within which a jump retargets the call.
pub const ENTRY_INSNS: u32 = 2;

/// Most entries of the direct-mapped caches in front of the trees: 2^RECENT_BITS (fewer
/// for a smaller tree: the engine's heap).
const RECENT_BITS: u32 = 16;

/// The entry of a direct-mapped cache of 2^`bits` entries for a key hashing to `x`.
#[inline]
fn slot(x: u64, bits: u32) -> usize {
    (x.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - bits)) as usize
}

/// The calling-context tree, the shadow stacks and the events per task and context.
#[derive(Clone, Debug)]
pub(crate) struct Stacks {
    pub(crate) contexts: Vec<Context>,
    tree: BTreeMap<(u32, bool, u64), u32>,
    capacity: usize,
    /// The current stack (out of `parked`).
    pub(crate) cur: Stack,
    /// Its key: `USER_STACK | row`, a kernel stack's slot address
    /// `>> KERNEL_STACK_SHIFT`, or `ENTRY_STACK`.
    key: u64,
    /// The other stacks with frames, at most `parked_capacity` (a guest names a kernel
    /// stack with any stack pointer it likes).
    parked: BTreeMap<u64, Stack>,
    parked_capacity: usize,
    /// The events per task and context.
    pub(crate) stacked: Vec<Stacked>,
    index: BTreeMap<(u32, bool, u32, u64), u32>,
    /// Direct-mapped cache in front of `tree`: (callee, parent | user << 32, context).
    recent_calls: Box<[(u64, u64, u32)]>,
    /// Direct-mapped cache in front of `index`: (code, task << 1 | user, context,
    /// place), the code [`OVERFLOW`] but in the root context.
    recent_counts: Box<[(u64, u64, u32, u32)]>,
    /// Both caches have 2^`bits` entries.
    bits: u32,
    stacked_capacity: usize,
    /// The place in `stacked` the events go to, and the task, mode, context and code it
    /// was taken for.
    pub(crate) at: usize,
    at_key: (u32, bool, u32, u64),
}

impl Stacks {
    pub(crate) fn new(contexts: usize, stacked: usize) -> Self {
        let bits = (contexts.max(1).ilog2() + 1).clamp(8, RECENT_BITS);
        let mut s = Stacks {
            contexts: alloc::vec![Context {
                parent: ROOT,
                user: false,
                callee: OVERFLOW,
                depth: 0,
            }],
            tree: BTreeMap::new(),
            capacity: contexts.max(1),
            cur: Stack::default(),
            key: ENTRY_STACK,
            parked: BTreeMap::new(),
            parked_capacity: (contexts / 16).clamp(64, MAX_PARKED),
            stacked: Vec::new(),
            index: BTreeMap::new(),
            recent_calls: alloc::vec![(0, u64::MAX, 0); 1 << bits].into_boxed_slice(),
            recent_counts: alloc::vec![(0, u64::MAX, 0, 0); 1 << bits].into_boxed_slice(),
            bits,
            stacked_capacity: stacked.max(1),
            at: 0,
            at_key: (u32::MAX, false, ROOT, OVERFLOW),
        };
        s.count_for(0, false, OVERFLOW);
        s
    }

    fn user(&self) -> bool {
        self.key != ENTRY_STACK && self.key & USER_STACK != 0
    }

    /// Makes `key`'s stack the current one.
    fn switch(&mut self, key: u64) {
        if key != self.key {
            let next = if key == ENTRY_STACK {
                Stack::default()
            } else {
                self.parked.remove(&key).unwrap_or_default()
            };
            let old = core::mem::replace(&mut self.cur, next);
            let live = !old.frames.is_empty() || !matches!(old.pending, Pending::None);
            if self.key != ENTRY_STACK && live {
                if self.parked.len() >= self.parked_capacity {
                    // Full: a stack goes (the lowest key; its task starts over at the root).
                    self.parked.pop_first();
                }
                self.parked.insert(self.key, old);
            }
            self.key = key;
        }
    }

    /// A fetch by task row `task` in user mode or not: the stack it runs on. Kernel code
    /// stays on the kernel stack it was on; entered from user mode, on the entry stack
    /// until a call or return names its stack.
    #[inline]
    pub(crate) fn enter(&mut self, task: u32, user: bool) {
        let key = if user {
            USER_STACK | u64::from(task)
        } else if self.user() {
            ENTRY_STACK
        } else {
            return;
        };
        self.switch(key);
    }

    /// The current stack's next fetch, `n` instructions, the `len` bytes at `ip` (its
    /// code `code`): does what the last `call` or `ret` left pending, or retargets a call
    /// whose target jumped at once.
    #[inline]
    pub(crate) fn arrive(&mut self, ip: u64, len: u64, code: u64, n: u32) {
        let jumped = ip != self.cur.next;
        self.cur.next = ip.wrapping_add(len);
        match core::mem::take(&mut self.cur.pending) {
            Pending::None => {}
            Pending::Call { ret, slot } => return self.push(ret, slot, code, n),
            Pending::Ret { slot } => return self.pop_to(ip, slot, code, n),
        }
        match self.cur.frames.last().and_then(|f| f.entering) {
            Some(_) if jumped => self.retarget(code, n),
            Some(k) => {
                if let Some(f) = self.cur.frames.last_mut() {
                    f.entering = entering(k, n);
                }
            }
            None => {}
        }
    }

    /// The top frame's target went on at `code` (`n` instructions) before doing anything
    /// of its own: the frame is a call of `code`.
    fn retarget(&mut self, code: u64, n: u32) {
        let Some(top) = self.cur.frames.last().copied() else {
            return;
        };
        let parent = self.contexts[top.ctx as usize].parent;
        let ctx = self.intern(parent, code);
        if let Some(f) = self.cur.frames.last_mut() {
            f.ctx = ctx;
            f.entering = entering(0, n);
        }
    }

    /// Whether the current stack has nothing to do at a fetch that goes on where the
    /// last one ended: no call or ret pending, no frame still entering.
    pub(crate) fn calm(&self) -> bool {
        matches!(self.cur.pending, Pending::None)
            && self.cur.frames.last().is_none_or(|f| f.entering.is_none())
    }

    /// The stack access of the `call` or `ret` just fetched: its return address's slot
    /// is at virtual address `slot`, on the kernel stack it names in kernel mode.
    pub(crate) fn slot(&mut self, slot: u64) {
        let mut pending = core::mem::take(&mut self.cur.pending);
        match &mut pending {
            Pending::None => return,
            Pending::Call { slot: s, .. } | Pending::Ret { slot: s } => *s = slot,
        }
        if !self.user() {
            self.switch(slot >> KERNEL_STACK_SHIFT);
        }
        self.cur.pending = pending;
    }

    /// The context of a call of `callee` in context `parent`, made if new (the parent
    /// itself past [`MAX_DEPTH`] or the tree's capacity).
    fn intern(&mut self, parent: u32, callee: u64) -> u32 {
        let user = self.user();
        let tag = u64::from(parent) | u64::from(user) << 32;
        let h = slot(callee ^ tag.rotate_right(17), self.bits);
        let hit = self.recent_calls[h];
        if hit.0 == callee && hit.1 == tag {
            return hit.2;
        }
        let c = self.intern_slow(parent, user, callee);
        self.recent_calls[h] = (callee, tag, c);
        c
    }

    #[inline(never)]
    fn intern_slow(&mut self, parent: u32, user: bool, callee: u64) -> u32 {
        let depth = self.contexts[parent as usize].depth;
        if depth >= MAX_DEPTH {
            return parent;
        }
        if let Some(&c) = self.tree.get(&(parent, user, callee)) {
            return c;
        }
        if self.contexts.len() >= self.capacity {
            return parent;
        }
        let c = self.contexts.len() as u32;
        self.contexts.push(Context {
            parent,
            user,
            callee,
            depth: depth + 1,
        });
        self.tree.insert((parent, user, callee), c);
        c
    }

    #[inline(never)]
    fn push(&mut self, ret: u64, slot: u64, callee: u64, n: u32) {
        if slot != u64::MAX {
            self.cur.unwind_to(slot);
        }
        let ctx = self.intern(self.cur.ctx(), callee);
        if self.cur.frames.len() >= MAX_FRAMES {
            self.cur.frames.remove(0);
        }
        self.cur.frames.push(Frame {
            ret,
            slot,
            ctx,
            entering: entering(0, n),
        });
    }

    /// A `ret` that went to `target` (its code `code`, `n` instructions fetched there),
    /// having read its address at `slot`: the frames at or below the slot go; without
    /// the slot, those down to the topmost that returns to `target` (none if no frame
    /// does). A return elsewhere than the call's end (a retpoline's) into a frame still
    /// entering retargets it.
    #[inline(never)]
    fn pop_to(&mut self, target: u64, slot: u64, code: u64, n: u32) {
        let popped = if slot != u64::MAX {
            self.cur.unwind_to(slot)
        } else if let Some(at) = self.cur.frames.iter().rposition(|f| f.ret == target) {
            let f = self.cur.frames[at];
            self.cur.frames.truncate(at);
            Some(f)
        } else {
            None
        };
        let entering = self.cur.frames.last().is_some_and(|t| t.entering.is_some());
        if popped.is_some_and(|f| f.ret != target) && entering {
            self.retarget(code, n);
        }
    }

    /// Counts from here on for `task` in the current context (`code`: the block, which
    /// matters in the root context only).
    #[inline]
    pub(crate) fn count_for(&mut self, task: u32, user: bool, code: u64) {
        let ctx = self.cur.ctx();
        let code = if ctx == ROOT { code } else { OVERFLOW };
        if self.at_key == (task, user, ctx, code) {
            return;
        }
        self.at_key = (task, user, ctx, code);
        let tag = u64::from(task) << 1 | u64::from(user);
        let h = slot(
            code ^ u64::from(ctx).rotate_right(13) ^ tag.rotate_right(29),
            self.bits,
        );
        let hit = self.recent_counts[h];
        if hit.0 == code && hit.1 == tag && hit.2 == ctx {
            self.at = hit.3 as usize;
            return;
        }
        self.at = self.find(task, user, ctx, code);
        self.recent_counts[h] = (code, tag, ctx, self.at as u32);
    }

    #[inline(never)]
    fn find(&mut self, task: u32, user: bool, ctx: u32, code: u64) -> usize {
        let mut key = (task, user, ctx, code);
        if let Some(&at) = self.index.get(&key) {
            return at as usize;
        }
        if self.stacked.len() >= self.stacked_capacity {
            // Past the table's capacity: the task's overflow entry.
            key = (task, user, ROOT, OVERFLOW);
        }
        let next = self.stacked.len() as u32;
        let at = *self.index.entry(key).or_insert(next);
        if at == next {
            self.stacked.push(Stacked {
                task,
                user,
                ctx: key.2,
                code: key.3,
                counts: [0; 9],
            });
        }
        at as usize
    }
}
