//! The record ring: a single-producer (engine) / single-consumer (a VMM thread) ring of
//! fixed-size memory records in the stolen region, through which a tool's records reach
//! a simulator running on the host, on another core, while the guest goes on (cachesim's
//! simulation: see `vmm/src/engine/host_sim.rs`).
//!
//! Layout: a [`HEADER_BYTES`] header ([`RingHeader`]), then `capacity` records of
//! [`RECORD_BYTES`] each. `head` and `tail` count records ever produced and consumed;
//! record `n` sits at slot `n % capacity`. The producer copies records into free slots,
//! then publishes them with a release store of `head`; the consumer reads `head` with
//! acquire, reads the records, then releases their slots with a release store of `tail`.
//! When the producer has no more records for the run (its tool's window ended) it stores
//! its final count in `end`. A consumer that stops on an error says so in `state`, and
//! the producer stops waiting for room.
//!
//! The VMM formats the ring only when a consumer will serve it; the engine uses it only
//! if it finds the header formatted. The consumer treats the records as data: any bytes
//! make a record it can simulate.

use core::sync::atomic::{AtomicU64, Ordering};

/// `magic` of an initialised ring: "KPINRECS".
pub const MAGIC: u64 = u64::from_le_bytes(*b"KPINRECS");
/// Layout version; bump on any change.
pub const VERSION: u32 = 1;
/// Bytes of the header page in front of the records.
pub const HEADER_BYTES: usize = 4096;
/// Bytes of one record (`guest_engine::MemRecord`: ip, ea, size and access, pa).
pub const RECORD_BYTES: usize = 32;
/// `end` while the producer may still publish records.
pub const OPEN: u64 = u64::MAX;
/// `state` while the consumer serves the ring.
pub const CONSUMER_RUNNING: u64 = 0;
/// `state` once the consumer stopped (it fails the run; the producer stops waiting).
pub const CONSUMER_STOPPED: u64 = 1;

/// The ring header. `head` and `tail` sit on their own cache lines.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct RingHeader {
    /// [`MAGIC`].
    pub magic: u64,
    /// [`VERSION`].
    pub version: u32,
    /// [`RECORD_BYTES`].
    pub record_bytes: u32,
    /// Records the data area holds.
    pub capacity: u64,
    /// Padding.
    pub pad0: [u64; 5],
    /// Records ever published (written only by the producer).
    pub head: AtomicU64,
    /// Padding.
    pub pad1: [u64; 7],
    /// Records ever consumed (written only by the consumer).
    pub tail: AtomicU64,
    /// Padding.
    pub pad2: [u64; 7],
    /// [`OPEN`], or the producer's final `head` (written once, by the producer).
    pub end: AtomicU64,
    /// [`CONSUMER_RUNNING`] or [`CONSUMER_STOPPED`] (written by the consumer).
    pub state: AtomicU64,
    /// Pushes that found the ring full and waited for the consumer (producer statistics).
    pub waits: AtomicU64,
}

const _: () = assert!(core::mem::size_of::<RingHeader>() <= HEADER_BYTES);

/// Why a ring cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordRingError {
    /// The region is too small for the header and one record, or misaligned.
    BadGeometry,
    /// The header's magic, version, record size or capacity does not match.
    BadHeader,
    /// The consumer stopped: nothing pushed now will be read.
    ConsumerStopped,
    /// The producer closed the ring already.
    Closed,
}

/// Records a region of `total_bytes` holds.
pub const fn capacity(total_bytes: usize) -> usize {
    total_bytes.saturating_sub(HEADER_BYTES) / RECORD_BYTES
}

/// Raw view of a ring's memory shared by the producer and consumer handles.
struct Raw {
    header: *const RingHeader,
    data: *mut u8,
    capacity: u64,
}

impl Raw {
    /// # Safety
    /// `base` is valid for reads and writes of `total_bytes` for the handle's lifetime,
    /// 64-byte aligned, and only one producer and one consumer use it.
    unsafe fn new(base: *mut u8, total_bytes: usize) -> Result<Self, RecordRingError> {
        let capacity = capacity(total_bytes);
        if capacity == 0 || !(base as usize).is_multiple_of(64) {
            return Err(RecordRingError::BadGeometry);
        }
        Ok(Raw {
            header: base.cast(),
            // SAFETY: `HEADER_BYTES` is within the region (capacity > 0).
            data: unsafe { base.add(HEADER_BYTES) },
            capacity: capacity as u64,
        })
    }

    fn check_header(&self) -> Result<(), RecordRingError> {
        let h = self.header();
        if h.magic != MAGIC
            || h.version != VERSION
            || h.record_bytes as usize != RECORD_BYTES
            || h.capacity != self.capacity
        {
            return Err(RecordRingError::BadHeader);
        }
        Ok(())
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: `Raw::new`'s contract: the header memory is valid and aligned for the
        // handle's lifetime; every field shared between the two sides is atomic.
        unsafe { &*self.header }
    }
}

/// Initialises an empty ring in `total_bytes` at `base`. The owner of the stolen region
/// (the VMM) does this, before the engine starts, only when a consumer will serve it.
///
/// # Safety
/// `base` is valid for writes of `total_bytes`, 64-byte aligned, and no producer or
/// consumer is attached to it.
pub unsafe fn format(base: *mut u8, total_bytes: usize) -> Result<(), RecordRingError> {
    // SAFETY: forwarded from this function's contract.
    let raw = unsafe { Raw::new(base, total_bytes)? };
    let header = RingHeader {
        magic: MAGIC,
        version: VERSION,
        record_bytes: RECORD_BYTES as u32,
        capacity: raw.capacity,
        pad0: [0; 5],
        head: AtomicU64::new(0),
        pad1: [0; 7],
        tail: AtomicU64::new(0),
        pad2: [0; 7],
        end: AtomicU64::new(OPEN),
        state: AtomicU64::new(CONSUMER_RUNNING),
        waits: AtomicU64::new(0),
    };
    // SAFETY: the header slot is valid and aligned, and nothing is attached to the ring.
    unsafe { core::ptr::write_volatile(raw.header.cast_mut(), header) };
    Ok(())
}

/// Whether the producer of the ring [`format`] initialised at `base` closed it (its
/// consumer may still be reading the last records).
///
/// # Safety
/// `base` is the base of a formatted ring, valid for reads of its header for the call.
pub unsafe fn is_closed(base: *const u8) -> bool {
    // SAFETY: forwarded from this function's contract; `end` is atomic.
    let h = unsafe { &*base.cast::<RingHeader>() };
    h.end.load(Ordering::Acquire) != OPEN
}

/// Copies `bytes` (a multiple of [`RECORD_BYTES`]) from `src` into ring slots at `dst`
/// with non-temporal stores, then fences them, before the caller publishes the slots.
///
/// The slots were just read by the consumer on another core: ordinary stores would first
/// fetch each line back from that core's cache (a read for ownership) only to overwrite
/// all of it. Streaming stores write whole lines without fetching them: on a Linux boot
/// under cachesim the engine's pushes fell from ~5.9 to ~3.9 TSC ticks a record, and the
/// consumer, which reads the lines from memory instead of the producer's cache, was no
/// slower.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `bytes` bytes, `dst` is 8-byte
/// aligned, and the two do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, bytes: usize) {
    debug_assert!(bytes.is_multiple_of(RECORD_BYTES) && (dst as usize).is_multiple_of(8));
    if bytes == 0 {
        return;
    }
    // SAFETY: the loop reads and writes exactly `bytes` bytes (a nonzero multiple of 32,
    // 32 a turn) from `src` and to `dst`, which the contract makes valid and 8-aligned
    // for `movnti`; `sfence` orders the weakly ordered streaming stores before the
    // caller's release store of `head`, so the consumer never sees a slot published
    // before its bytes. No stack is used; flags are clobbered (no `preserves_flags`).
    unsafe {
        core::arch::asm!(
            "2:",
            "mov {t}, [{s}]",
            "movnti [{d}], {t}",
            "mov {t}, [{s} + 8]",
            "movnti [{d} + 8], {t}",
            "mov {t}, [{s} + 16]",
            "movnti [{d} + 16], {t}",
            "mov {t}, [{s} + 24]",
            "movnti [{d} + 24], {t}",
            "add {s}, 32",
            "add {d}, 32",
            "sub {n}, 32",
            "jnz 2b",
            "sfence",
            s = inout(reg) src => _,
            d = inout(reg) dst => _,
            n = inout(reg) bytes => _,
            t = out(reg) _,
            options(nostack),
        );
    }
}

/// [`stream_copy`] where there are no streaming stores: an ordinary copy (the release
/// store of `head` orders it).
///
/// # Safety
/// As [`stream_copy`]'s.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, bytes: usize) {
    // SAFETY: forwarded from this function's contract.
    unsafe { core::ptr::copy_nonoverlapping(src, dst, bytes) }
}

/// The engine's end of the ring.
pub struct Producer {
    raw: Raw,
}

impl Producer {
    /// Attaches to a ring that [`format`] initialised (`BadHeader` if nobody did: then no
    /// consumer serves it) and no producer closed.
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `total_bytes` for the producer's lifetime,
    /// 64-byte aligned, and no other producer uses it.
    pub unsafe fn attach(base: *mut u8, total_bytes: usize) -> Result<Self, RecordRingError> {
        // SAFETY: forwarded from this function's contract.
        let raw = unsafe { Raw::new(base, total_bytes)? };
        raw.check_header()?;
        if raw.header().end.load(Ordering::Acquire) != OPEN {
            return Err(RecordRingError::Closed);
        }
        Ok(Producer { raw })
    }

    /// Publishes `records` (a whole number of [`RECORD_BYTES`] records; a trailing part
    /// record is ignored), spinning for room while the consumer works. Fails only when the
    /// consumer has stopped (`ConsumerStopped`), or after [`Producer::close`] (`Closed`).
    pub fn push(&mut self, records: &[u8]) -> Result<(), RecordRingError> {
        self.push_waiting(records, &mut core::hint::spin_loop)
    }

    /// [`Producer::push`], calling `wait` each time the ring is found full: the engine's
    /// `wait` exits to the VMM, which sleeps until the consumer has made room
    /// ([`Observer`]) instead of spinning on a core the host counts. `wait` may return
    /// before there is room; the push checks again.
    pub fn push_waiting(
        &mut self,
        records: &[u8],
        wait: &mut dyn FnMut(),
    ) -> Result<(), RecordRingError> {
        let h = self.raw.header();
        if h.end.load(Ordering::Relaxed) != OPEN {
            return Err(RecordRingError::Closed);
        }
        let mut left = records.len() / RECORD_BYTES;
        let mut src = records.as_ptr();
        let mut head = h.head.load(Ordering::Relaxed);
        let mut waited = false;
        while left > 0 {
            let used = head.wrapping_sub(h.tail.load(Ordering::Acquire));
            let free = self.raw.capacity.saturating_sub(used);
            if free == 0 {
                if !waited {
                    waited = true;
                    h.waits.fetch_add(1, Ordering::Relaxed);
                }
                if h.state.load(Ordering::Acquire) != CONSUMER_RUNNING {
                    return Err(RecordRingError::ConsumerStopped);
                }
                wait();
                continue;
            }
            let slot = head % self.raw.capacity;
            let n = (left as u64).min(free).min(self.raw.capacity - slot);
            let bytes = n as usize * RECORD_BYTES;
            // SAFETY: slots `slot..slot + n` are inside the data area (bounded by the
            // capacity above), 8-aligned (the region is 64-aligned, the header and slots
            // multiples of 32 bytes) and free (the consumer released them: `used + n <=
            // capacity`); `src` has `bytes` more bytes of `records`, which the ring does
            // not overlap.
            unsafe {
                stream_copy(src, self.raw.data.add(slot as usize * RECORD_BYTES), bytes);
                src = src.add(bytes);
            }
            head = head.wrapping_add(n);
            h.head.store(head, Ordering::Release);
            left -= n as usize;
        }
        Ok(())
    }

    /// No more records: the consumer may finish once it has read those published.
    pub fn close(&mut self) {
        let h = self.raw.header();
        let head = h.head.load(Ordering::Relaxed);
        h.end.store(head, Ordering::Release);
    }

    /// Records published so far.
    pub fn published(&self) -> u64 {
        self.raw.header().head.load(Ordering::Relaxed)
    }

    /// Pushes that waited for the consumer.
    pub fn waits(&self) -> u64 {
        self.raw.header().waits.load(Ordering::Relaxed)
    }
}

// SAFETY: a `Producer` is the ring's only writer of records and `head` (its constructor's
// contract), its memory stays valid wherever the handle goes, and all state shared with
// the consumer is accessed through atomics with release/acquire ordering.
unsafe impl Send for Producer {}

/// A read-only view of the ring for the side that puts a waiting producer to sleep (the
/// VMM's vCPU thread, while the engine waits for room): how much room there is, and
/// whether waiting for more can end otherwise.
pub struct Observer {
    raw: Raw,
}

impl Observer {
    /// Views a ring that [`format`] initialised.
    ///
    /// # Safety
    /// `base` is valid for reads of `total_bytes` for the observer's lifetime and 64-byte
    /// aligned.
    pub unsafe fn attach(base: *const u8, total_bytes: usize) -> Result<Self, RecordRingError> {
        // SAFETY: forwarded from this function's contract; an observer never writes.
        let raw = unsafe { Raw::new(base.cast_mut(), total_bytes)? };
        raw.check_header()?;
        Ok(Observer { raw })
    }

    /// Records the data area holds.
    pub fn capacity(&self) -> u64 {
        self.raw.capacity
    }

    /// Free slots: the capacity less the records published and not yet released (a
    /// `head` more than a ring's worth ahead counts as a full ring).
    pub fn free(&self) -> u64 {
        let h = self.raw.header();
        let used = h
            .head
            .load(Ordering::Acquire)
            .wrapping_sub(h.tail.load(Ordering::Acquire));
        self.raw.capacity.saturating_sub(used)
    }

    /// Whether no wait for room is worth making: the producer closed the ring or the
    /// consumer stopped.
    pub fn settled(&self) -> bool {
        let h = self.raw.header();
        h.end.load(Ordering::Acquire) != OPEN || h.state.load(Ordering::Acquire) != CONSUMER_RUNNING
    }
}

/// The host's end of the ring.
pub struct Consumer {
    raw: Raw,
    tail: u64,
    /// `tail % capacity`, kept without a division per record.
    slot: u64,
}

impl Consumer {
    /// Attaches to a ring that [`format`] initialised.
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `total_bytes` for the consumer's lifetime,
    /// 64-byte aligned, and no other consumer uses it.
    pub unsafe fn attach(base: *mut u8, total_bytes: usize) -> Result<Self, RecordRingError> {
        // SAFETY: forwarded from this function's contract.
        let raw = unsafe { Raw::new(base, total_bytes)? };
        raw.check_header()?;
        let tail = raw.header().tail.load(Ordering::Relaxed);
        let slot = tail % raw.capacity;
        Ok(Consumer { raw, tail, slot })
    }

    /// Records the data area holds.
    pub fn capacity(&self) -> u64 {
        self.raw.capacity
    }

    /// Records published and not yet released, at most a ring's worth (a `head` further
    /// ahead than that is not the producer's: it is clamped).
    pub fn available(&self) -> u64 {
        let head = self.raw.header().head.load(Ordering::Acquire);
        head.wrapping_sub(self.tail).min(self.raw.capacity)
    }

    /// How many of the available records lie in order before the end of the data area
    /// (the rest follow from its start): `record(i)` for `i` below this is one slot after
    /// another.
    pub fn contiguous(&self) -> u64 {
        self.available().min(self.raw.capacity - self.slot)
    }

    /// The `i`-th available record (`i < contiguous()`), as four little-endian words.
    #[inline]
    pub fn record(&self, i: u64) -> [u64; 4] {
        let slot = (self.slot + i).min(self.raw.capacity - 1);
        // SAFETY: `slot < capacity`, so the record lies in the data area, 8-aligned
        // (the header and records are multiples of 8 bytes); published slots are not
        // written by the producer until released, and a volatile read takes whatever
        // bytes are there.
        unsafe {
            core::ptr::read_volatile(
                self.raw
                    .data
                    .add(slot as usize * RECORD_BYTES)
                    .cast::<[u64; 4]>(),
            )
        }
    }

    /// Asks the CPU to start loading the slots of the available records `i..i + n` (as
    /// many as lie before the end of the data area) into its caches, so that a later
    /// [`Consumer::copy_records`] finds them there: a hint, with no effect on the ring.
    #[inline]
    pub fn prefetch(&self, i: u64, n: u64) {
        #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
        {
            let n = self.contiguous().saturating_sub(i).min(n) as usize;
            let first = (self.slot + i) as usize * RECORD_BYTES;
            // From the start of the first slot's line, so that each line is asked for.
            for at in (first & !63..first + n * RECORD_BYTES).step_by(64) {
                // SAFETY: `at` lies inside the data area (the data area starts on a
                // 64-byte boundary and the slots `slot + i .. slot + i + n` lie in it:
                // `contiguous` stops at its end); a prefetch reads nothing into the
                // program and cannot fault.
                unsafe {
                    core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                        self.raw.data.add(at).cast::<i8>(),
                    );
                }
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
        let _ = (i, n);
    }

    /// Copies available records from the `i`-th on into `out` in one copy: as many whole
    /// records as `out` holds, no more than lie before the end of the data area
    /// ([`Consumer::contiguous`]); returns how many. Where [`Consumer::record`] reads a
    /// record, this moves a stretch of them as the 32 bytes each slot holds.
    #[inline]
    pub fn copy_records(&self, i: u64, out: &mut [u8]) -> usize {
        let n = self
            .contiguous()
            .saturating_sub(i)
            .min((out.len() / RECORD_BYTES) as u64) as usize;
        if n == 0 {
            return 0;
        }
        // SAFETY: slots `slot + i .. slot + i + n` are published and not released
        // (`i + n <= contiguous()`), so they lie in the data area (`contiguous` stops at
        // its end) and the producer does not write them until released; `out` holds
        // `n * RECORD_BYTES` bytes and is the caller's, so the two do not overlap. A
        // producer breaking the protocol can only change which bytes are copied: the
        // caller takes them as data, as from `record` (a copy of guest memory with
        // `copy_nonoverlapping`, as vm-memory's `copy_slice` does for more than a word).
        unsafe {
            core::ptr::copy_nonoverlapping(
                self.raw
                    .data
                    .add((self.slot + i) as usize * RECORD_BYTES)
                    .cast_const(),
                out.as_mut_ptr(),
                n * RECORD_BYTES,
            );
        }
        n
    }

    /// Releases the first `n` available records to the producer.
    pub fn release(&mut self, n: u64) {
        let n = n.min(self.available());
        self.tail = self.tail.wrapping_add(n);
        self.slot = (self.slot + n) % self.raw.capacity;
        self.raw.header().tail.store(self.tail, Ordering::Release);
    }

    /// Whether the producer closed the ring and every record it published was released.
    pub fn finished(&self) -> bool {
        self.raw.header().end.load(Ordering::Acquire) == self.tail
    }

    /// Whether the producer closed the ring.
    pub fn closed(&self) -> bool {
        self.raw.header().end.load(Ordering::Acquire) != OPEN
    }

    /// Tells the producer the consumer stopped (it stops waiting for room).
    pub fn stop(&self) {
        self.raw
            .header()
            .state
            .store(CONSUMER_STOPPED, Ordering::Release);
    }

    /// Pushes that waited for the consumer (the producer's count).
    pub fn producer_waits(&self) -> u64 {
        self.raw.header().waits.load(Ordering::Relaxed)
    }
}

// SAFETY: a `Consumer` is the ring's only reader of records and writer of `tail` (its
// constructor's contract), its memory stays valid wherever the handle goes (the caller
// keeps the mapping alive), and shared state is accessed through atomics.
unsafe impl Send for Consumer {}

#[cfg(test)]
mod tests {
    use super::*;

    extern crate std;
    use std::vec;
    use std::vec::Vec;

    #[repr(C, align(64))]
    struct Mem([u8; HEADER_BYTES + 5 * RECORD_BYTES]);

    /// A formatted five-slot ring in boxed memory, with its producer and consumer. Bound
    /// in this order, the handles drop before the memory (whose heap block does not move
    /// with the box).
    fn five_slots() -> (std::boxed::Box<Mem>, Producer, Consumer) {
        let mut mem = std::boxed::Box::new(Mem([0; HEADER_BYTES + 5 * RECORD_BYTES]));
        let (base, len) = (mem.0.as_mut_ptr(), mem.0.len());
        // SAFETY: the boxed memory outlives both handles (see above) and is 64-byte
        // aligned.
        unsafe { format(base, len) }.unwrap();
        // SAFETY: as above; the test is the only producer.
        let p = unsafe { Producer::attach(base, len) }.unwrap();
        // SAFETY: as above; the test is the only consumer.
        let c = unsafe { Consumer::attach(base, len) }.unwrap();
        (mem, p, c)
    }

    fn rec(n: u64) -> [u8; RECORD_BYTES] {
        let mut r = [0u8; RECORD_BYTES];
        for (k, w) in r.chunks_mut(8).enumerate() {
            w.copy_from_slice(&(n * 10 + k as u64).to_le_bytes());
        }
        r
    }

    #[test]
    fn records_wrap_in_order_and_the_end_is_seen() {
        let (mem, mut p, mut c) = five_slots();
        let mut seen = Vec::new();
        for round in 0..4u64 {
            let batch: Vec<u8> = (0..3).flat_map(|k| rec(round * 3 + k)).collect();
            p.push(&batch).unwrap();
            assert_eq!(c.available(), 3);
            let mut left = 3;
            while left > 0 {
                let n = c.contiguous();
                for i in 0..n {
                    seen.push(c.record(i)[0] / 10);
                    assert_eq!(c.record(i)[3] % 10, 3);
                }
                c.release(n);
                left -= n;
            }
            assert!(!c.closed());
        }
        // SAFETY: the ring is formatted and its memory alive.
        assert!(!unsafe { is_closed(mem.0.as_ptr()) });
        p.close();
        assert!(c.closed() && c.finished());
        // SAFETY: as above.
        assert!(unsafe { is_closed(mem.0.as_ptr()) });
        assert_eq!(seen, (0..12).collect::<Vec<_>>());
        assert_eq!(
            c.copy_records(0, &mut [0; RECORD_BYTES]),
            0,
            "nothing available"
        );
        assert_eq!(p.waits(), 0);
        assert_eq!(p.push(&rec(99)), Err(RecordRingError::Closed));
    }

    #[test]
    fn stretches_are_copied_up_to_the_end_of_the_data_area() {
        let (_mem, mut p, mut c) = five_slots();
        p.push(&(0..3).flat_map(rec).collect::<Vec<u8>>()).unwrap();
        c.release(3);
        p.push(&(3..7).flat_map(rec).collect::<Vec<u8>>()).unwrap();
        // A hint, whatever the range: nothing changes.
        c.prefetch(0, 100);
        c.prefetch(1000, 5);
        assert_eq!(c.available(), 4);
        // Records 3 and 4 lie before the end (slots 3, 4), 5 and 6 after the wrap.
        let mut out = vec![0xaa; 3 * RECORD_BYTES + 5];
        assert_eq!(c.copy_records(0, &mut out), 2);
        assert_eq!(out[..2 * RECORD_BYTES], [rec(3), rec(4)].concat()[..]);
        assert!(out[2 * RECORD_BYTES..].iter().all(|&b| b == 0xaa));
        assert_eq!(c.copy_records(1, &mut out), 1);
        assert_eq!(out[..RECORD_BYTES], rec(4));
        assert_eq!(c.copy_records(2, &mut out), 0);
        assert_eq!(c.copy_records(0, &mut out[..RECORD_BYTES - 1]), 0);
        c.release(2);
        assert_eq!(c.copy_records(0, &mut out), 2);
        assert_eq!(out[..2 * RECORD_BYTES], [rec(5), rec(6)].concat()[..]);
    }

    #[test]
    fn a_full_ring_fails_the_push_once_the_consumer_stops() {
        let (_mem, mut p, c) = five_slots();
        c.stop();
        let batch: Vec<u8> = (0..7).flat_map(rec).collect();
        assert_eq!(p.push(&batch), Err(RecordRingError::ConsumerStopped));
        assert_eq!(c.available(), 5, "the records that fitted were published");
        assert_eq!(c.producer_waits(), 1);
    }

    #[test]
    fn a_full_ring_calls_the_wait_and_the_observer_sees_the_room() {
        let (mem, mut p, mut c) = five_slots();
        // SAFETY: the memory outlives the observer (bound after it), which only reads.
        let o = unsafe { Observer::attach(mem.0.as_ptr(), mem.0.len()) }.unwrap();
        assert_eq!((o.capacity(), o.free(), o.settled()), (5, 5, false));
        let mut waits = Vec::new();
        // Seven records into five slots: the push waits once, with the ring full, and
        // the "host" makes room for three.
        let batch: Vec<u8> = (0..7).flat_map(rec).collect();
        p.push_waiting(&batch, &mut || {
            waits.push(o.free());
            c.release(3);
        })
        .unwrap();
        assert_eq!(waits, [0]);
        assert_eq!(o.free(), 1);
        assert_eq!(p.waits(), 1);
        p.close();
        assert!(o.settled());
    }

    #[test]
    fn an_unformatted_region_is_not_attached() {
        let mut mem = vec![0u64; (HEADER_BYTES + RECORD_BYTES) / 8];
        let (base, len) = (mem.as_mut_ptr().cast::<u8>(), mem.len() * 8);
        // SAFETY: the vector outlives the call; 8-byte aligned may not be 64: either
        // error is a refusal.
        assert!(unsafe { Producer::attach(base, len) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { Consumer::attach(base, HEADER_BYTES - 1) }.is_err());
    }
}
