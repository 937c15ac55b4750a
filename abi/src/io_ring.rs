//! The host I/O ring: a single-producer (engine) / single-consumer (VMM + host daemon)
//! byte ring in the stolen region, through which tools write files and the engine writes
//! its log.
//!
//! Layout: a [`HEADER_BYTES`] header ([`RingHeader`]), then `data_bytes` of data (a power
//! of two). `head` and `tail` count bytes ever produced and consumed; their difference is
//! the fill level, and a position is `count % data_bytes`. A record is an 8-byte
//! [`RecordHeader`] and its payload padded to 8 bytes, never split across the end: a
//! record that does not fit before the end is preceded by a [`Kind::Pad`] record filling
//! the rest. Ordering: the producer writes a record, then publishes it with a release
//! store of `head`; the consumer reads `head` with acquire, consumes, then releases `tail`.
//!
//! The consumer treats the ring as untrusted input: a malformed record is an error, never
//! an out-of-bounds read.

use core::sync::atomic::{AtomicU64, Ordering};

/// `magic` of an initialised ring: "KPINRING".
pub const MAGIC: u64 = u64::from_le_bytes(*b"KPINRING");
/// Layout version; bump on any change.
pub const VERSION: u32 = 1;
/// Bytes of the header page in front of the data.
pub const HEADER_BYTES: usize = 4096;
/// Bytes of a record header.
pub const RECORD_HEADER_BYTES: usize = 8;
/// Longest file name an `Open` record may carry.
pub const MAX_NAME_BYTES: usize = 128;

/// Record kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    /// Filler up to the end of the data area; no payload meaning.
    Pad = 0,
    /// Create (truncate) file `file`, payload = its name relative to the output directory.
    Open = 1,
    /// Append the payload to file `file`.
    Write = 2,
    /// Close file `file`.
    Close = 3,
    /// An engine log line; `file` carries the [`LogLevel`], payload = the text.
    Log = 4,
    /// Bytes the guest wrote to COM1's transmit register while the UART could neither
    /// interrupt nor loop them back, batched by the engine (one doorbell for a console
    /// line instead of a port exit per byte); the VMM writes them to its UART in order.
    /// `file` is unused (0).
    Console = 5,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0 => Kind::Pad,
            1 => Kind::Open,
            2 => Kind::Write,
            3 => Kind::Close,
            4 => Kind::Log,
            5 => Kind::Console,
            _ => return None,
        })
    }
}

/// Engine log levels, carried in a `Log` record's `file` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u16)]
pub enum LogLevel {
    /// Something is wrong.
    Error = 1,
    /// Something is suspicious.
    Warn = 2,
    /// Progress.
    Info = 3,
    /// Detail.
    Debug = 4,
}

impl LogLevel {
    /// The level for a raw value; unknown values read as `Debug`.
    pub fn from_u16(v: u16) -> Self {
        match v {
            1 => LogLevel::Error,
            2 => LogLevel::Warn,
            3 => LogLevel::Info,
            _ => LogLevel::Debug,
        }
    }
}

/// The ring header. `head` and `tail` sit on their own cache lines.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct RingHeader {
    /// [`MAGIC`].
    pub magic: u64,
    /// [`VERSION`].
    pub version: u32,
    /// Bytes of the data area (a power of two).
    pub data_bytes: u32,
    /// Fill level at which the producer rings the doorbell.
    pub batch_bytes: u32,
    /// Padding.
    pub pad0: [u32; 11],
    /// Bytes ever produced (written only by the producer).
    pub head: AtomicU64,
    /// Padding.
    pub pad1: [u64; 7],
    /// Bytes ever consumed (written only by the consumer).
    pub tail: AtomicU64,
    /// Padding.
    pub pad2: [u64; 7],
    /// Doorbells rung (producer statistics).
    pub doorbells: AtomicU64,
    /// Records pushed (producer statistics).
    pub records: AtomicU64,
}

const _: () = assert!(core::mem::size_of::<RingHeader>() <= HEADER_BYTES);

/// A record header.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// [`Kind`] as `u16`.
    pub kind: u16,
    /// File id, or the log level for `Log`.
    pub file: u16,
    /// Payload bytes (before padding).
    pub len: u32,
}

/// Why a ring cannot be used or a record cannot be pushed or read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingError {
    /// The region is too small or its data area is not a power of two.
    BadGeometry,
    /// The header's magic or version does not match.
    BadHeader,
    /// Not enough free space now; ring the doorbell and retry.
    Full,
    /// The payload can never fit (more than half the data area).
    TooLarge,
    /// A record read from the ring is malformed (unknown kind, length past `head`).
    Corrupt,
}

/// A record as the consumer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    /// Kind.
    pub kind: Kind,
    /// File id or log level.
    pub file: u16,
    /// Payload.
    pub payload: &'a [u8],
}

/// Bytes a record with `len` payload bytes occupies.
pub const fn record_bytes(len: usize) -> usize {
    RECORD_HEADER_BYTES + len.next_multiple_of(8)
}

/// Raw view of a ring's memory shared by the producer and consumer handles.
struct Raw {
    header: *const RingHeader,
    data: *mut u8,
    size: u64,
}

impl Raw {
    /// # Safety
    /// `base` is valid for reads and writes of `total_bytes` for the handle's lifetime,
    /// 64-byte aligned, and only one producer and one consumer use it.
    unsafe fn new(base: *mut u8, total_bytes: usize) -> Result<Self, RingError> {
        let data_bytes = total_bytes
            .checked_sub(HEADER_BYTES)
            .ok_or(RingError::BadGeometry)?;
        if !data_bytes.is_power_of_two() || data_bytes < 64 || !(base as usize).is_multiple_of(64) {
            return Err(RingError::BadGeometry);
        }
        // SAFETY: `HEADER_BYTES` is within the region (checked above).
        let data = unsafe { base.add(HEADER_BYTES) };
        Ok(Raw {
            header: base.cast(),
            data,
            size: data_bytes as u64,
        })
    }

    fn check_header(&self) -> Result<(), RingError> {
        let h = self.header();
        if h.magic != MAGIC || h.version != VERSION || u64::from(h.data_bytes) != self.size {
            return Err(RingError::BadHeader);
        }
        Ok(())
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: `Raw::new`'s contract: the header memory is valid and aligned for the
        // handle's lifetime; every field shared between the two sides is atomic.
        unsafe { &*self.header }
    }
}

/// Initialises an empty ring in `total_bytes` at `base` (header + power-of-two data area)
/// with doorbell threshold `batch_bytes`. The owner of the stolen region (the VMM) does
/// this before either end attaches.
///
/// # Safety
/// `base` is valid for writes of `total_bytes`, 64-byte aligned, and no producer or
/// consumer is attached to it.
pub unsafe fn format(base: *mut u8, total_bytes: usize, batch_bytes: u32) -> Result<(), RingError> {
    // SAFETY: forwarded from this function's contract.
    let raw = unsafe { Raw::new(base, total_bytes)? };
    let header = RingHeader {
        magic: MAGIC,
        version: VERSION,
        data_bytes: u32::try_from(raw.size).map_err(|_| RingError::BadGeometry)?,
        batch_bytes,
        pad0: [0; 11],
        head: AtomicU64::new(0),
        pad1: [0; 7],
        tail: AtomicU64::new(0),
        pad2: [0; 7],
        doorbells: AtomicU64::new(0),
        records: AtomicU64::new(0),
    };
    // SAFETY: the header slot is valid and aligned, and nothing is attached to the ring.
    unsafe { core::ptr::write_volatile(raw.header.cast_mut(), header) };
    Ok(())
}

/// The engine's end of the ring.
pub struct Producer {
    raw: Raw,
}

impl Producer {
    /// Attaches to a ring that [`format`] initialised.
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `total_bytes` for the producer's lifetime,
    /// 64-byte aligned, and no other producer uses it.
    pub unsafe fn attach(base: *mut u8, total_bytes: usize) -> Result<Self, RingError> {
        // SAFETY: forwarded from this function's contract.
        let raw = unsafe { Raw::new(base, total_bytes)? };
        raw.check_header()?;
        Ok(Producer { raw })
    }

    /// Bytes waiting for the consumer.
    pub fn used(&self) -> u64 {
        let h = self.raw.header();
        h.head
            .load(Ordering::Relaxed)
            .wrapping_sub(h.tail.load(Ordering::Acquire))
    }

    /// Whether the fill level has reached the doorbell threshold.
    pub fn wants_doorbell(&self) -> bool {
        self.used() >= u64::from(self.raw.header().batch_bytes)
    }

    /// Counts a doorbell (the caller rings it).
    pub fn note_doorbell(&self) {
        self.raw.header().doorbells.fetch_add(1, Ordering::Relaxed);
    }

    /// Doorbells counted so far.
    pub fn doorbells(&self) -> u64 {
        self.raw.header().doorbells.load(Ordering::Relaxed)
    }

    /// Appends one record, or fails with `Full` (ring the doorbell, then retry) or
    /// `TooLarge`.
    pub fn push(&mut self, kind: Kind, file: u16, payload: &[u8]) -> Result<(), RingError> {
        let need = record_bytes(payload.len()) as u64;
        if need > self.raw.size / 2 {
            return Err(RingError::TooLarge);
        }
        let h = self.raw.header();
        let head = h.head.load(Ordering::Relaxed);
        let tail = h.tail.load(Ordering::Acquire);
        let pos = head % self.raw.size;
        let to_end = self.raw.size - pos;
        let pad = if need > to_end { to_end } else { 0 };
        // `head` and `tail` are free-running counters: their difference is the fill level
        // even after they wrap (the data size divides 2^64).
        if self.raw.size.saturating_sub(head.wrapping_sub(tail)) < need + pad {
            return Err(RingError::Full);
        }
        let mut at = head;
        if pad > 0 {
            self.write_header(
                at,
                Kind::Pad,
                0,
                (pad as usize - RECORD_HEADER_BYTES) as u32,
            );
            at = at.wrapping_add(pad);
        }
        self.write_header(at, kind, file, payload.len() as u32);
        let off = (at % self.raw.size) as usize + RECORD_HEADER_BYTES;
        // SAFETY: the record fits before the end of the data area (padding above), the
        // space is free (checked against `tail`), and only this producer writes it.
        unsafe {
            core::ptr::copy_nonoverlapping(payload.as_ptr(), self.raw.data.add(off), payload.len())
        };
        h.records.fetch_add(1, Ordering::Relaxed);
        h.head.store(at.wrapping_add(need), Ordering::Release);
        Ok(())
    }

    fn write_header(&self, at: u64, kind: Kind, file: u16, len: u32) {
        let rec = RecordHeader {
            kind: kind as u16,
            file,
            len,
        };
        let off = (at % self.raw.size) as usize;
        // SAFETY: `off` is 8-aligned and at least 8 bytes before the end of the data area
        // (all records are multiples of 8 bytes); the space is free and producer-owned.
        unsafe { core::ptr::write_volatile(self.raw.data.add(off).cast::<RecordHeader>(), rec) };
    }
}

// SAFETY: a `Producer` is the ring's only writer of records and `head` (its constructor's
// contract), its memory stays valid wherever the handle goes, and all state shared with
// the consumer is accessed through atomics with release/acquire ordering.
unsafe impl Send for Producer {}

/// The host's end of the ring.
pub struct Consumer {
    raw: Raw,
}

impl Consumer {
    /// Attaches to an initialised ring.
    ///
    /// # Safety
    /// `base` is valid for reads and writes of `total_bytes` for the consumer's lifetime,
    /// 64-byte aligned, and no other consumer uses it.
    pub unsafe fn attach(base: *mut u8, total_bytes: usize) -> Result<Self, RingError> {
        // SAFETY: forwarded from this function's contract.
        let raw = unsafe { Raw::new(base, total_bytes)? };
        raw.check_header()?;
        Ok(Consumer { raw })
    }

    /// Doorbells and records the producer has counted.
    pub fn producer_stats(&self) -> (u64, u64) {
        let h = self.raw.header();
        (
            h.doorbells.load(Ordering::Relaxed),
            h.records.load(Ordering::Relaxed),
        )
    }

    /// Hands every published record to `f`, in order, releasing each one's space after
    /// `f` returns. Returns the number of non-pad records.
    ///
    /// Everything read from the ring is untrusted: `head` is loaded once, every record
    /// header once; `head`, `tail` and lengths are only combined with wrapping or
    /// range-checked arithmetic (the counters are free-running and may sit anywhere in
    /// `u64`, e.g. just below `u64::MAX`), and a record must lie wholly inside both the
    /// data area and the published bytes. Anything else is [`RingError::Corrupt`], and
    /// `tail` stays at the first bad record.
    pub fn drain(&mut self, mut f: impl FnMut(Record<'_>)) -> Result<usize, RingError> {
        let h = self.raw.header();
        let head = h.head.load(Ordering::Acquire);
        let mut tail = h.tail.load(Ordering::Relaxed);
        let mut n = 0;
        while tail != head {
            let avail = head.wrapping_sub(tail);
            let off = (tail % self.raw.size) as usize;
            if avail > self.raw.size || avail < RECORD_HEADER_BYTES as u64 || !off.is_multiple_of(8)
            {
                return Err(RingError::Corrupt);
            }
            // SAFETY: `off` is 8-aligned and the record header lies within the data area
            // (records are 8-byte multiples and `off < size`); the producer published it.
            let rec =
                unsafe { core::ptr::read_volatile(self.raw.data.add(off).cast::<RecordHeader>()) };
            let kind = Kind::from_u16(rec.kind).ok_or(RingError::Corrupt)?;
            let len = rec.len as usize;
            // `len < 2^32`, so neither this nor `off + total` (both below 2^33) can
            // overflow a 64-bit `usize`/`u64`.
            let total = record_bytes(len) as u64;
            if total > avail || off as u64 + total > self.raw.size {
                return Err(RingError::Corrupt);
            }
            if kind != Kind::Pad {
                // SAFETY: the payload lies within the data area and within the published
                // bytes (both checked just above); the producer does not touch it until
                // `tail` moves past it.
                let payload = unsafe {
                    core::slice::from_raw_parts(self.raw.data.add(off + RECORD_HEADER_BYTES), len)
                };
                f(Record {
                    kind,
                    file: rec.file,
                    payload,
                });
                n += 1;
            }
            // Free-running: `tail` may wrap past `u64::MAX` exactly as `head` did.
            tail = tail.wrapping_add(total);
            h.tail.store(tail, Ordering::Release);
        }
        Ok(n)
    }
}

// SAFETY: as for `Producer`: the `Consumer` is the only writer of `tail`, and reads
// records only after an acquire load of `head` has published them.
unsafe impl Send for Consumer {}

/// Why a file name is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameError {
    /// Empty, or longer than [`MAX_NAME_BYTES`].
    Length,
    /// A byte outside `[A-Za-z0-9._-/]`.
    Character,
    /// An absolute path, an empty component, or a component starting with `.` (`.`,
    /// `..`, dotfiles): it could escape, alias or hide in the output directory.
    Component,
}

/// Checks that `name` stays inside the run's output directory: relative, components made
/// of `[A-Za-z0-9._-]`, none empty or starting with `.` (so no `.`, `..` or dotfile). Both the engine (so `create` fails at
/// once) and the host daemon (which trusts nothing) apply it.
pub fn validate_name(name: &[u8]) -> Result<(), NameError> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(NameError::Length);
    }
    if !name
        .iter()
        .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-' | b'/'))
    {
        return Err(NameError::Character);
    }
    if name
        .split(|&c| c == b'/')
        .any(|comp| comp.is_empty() || comp[0] == b'.')
    {
        return Err(NameError::Component);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec;
    use std::vec::Vec;

    use super::*;

    /// 64-byte aligned test memory.
    #[repr(C, align(64))]
    struct Mem([u8; HEADER_BYTES + 256]);

    fn ring(mem: &mut Mem) -> (Producer, Consumer) {
        let base = mem.0.as_mut_ptr();
        // SAFETY: `mem` outlives both handles in each test and is 64-byte aligned.
        unsafe { format(base, mem.0.len(), 128) }.unwrap();
        // SAFETY: as above.
        let p = unsafe { Producer::attach(base, mem.0.len()) }.unwrap();
        // SAFETY: as above.
        let c = unsafe { Consumer::attach(base, mem.0.len()) }.unwrap();
        (p, c)
    }

    fn collect(c: &mut Consumer) -> Vec<(Kind, u16, Vec<u8>)> {
        let mut v = Vec::new();
        c.drain(|r| v.push((r.kind, r.file, r.payload.to_vec())))
            .unwrap();
        v
    }

    #[test]
    fn test_records_round_trip_in_order() {
        let mut mem = Mem([0; HEADER_BYTES + 256]);
        let (mut p, mut c) = ring(&mut mem);
        p.push(Kind::Open, 1, b"out.csv").unwrap();
        p.push(Kind::Write, 1, b"a,b\n").unwrap();
        p.push(Kind::Close, 1, b"").unwrap();
        assert_eq!(
            collect(&mut c),
            vec![
                (Kind::Open, 1, b"out.csv".to_vec()),
                (Kind::Write, 1, b"a,b\n".to_vec()),
                (Kind::Close, 1, vec![]),
            ]
        );
        assert_eq!(p.used(), 0);
        assert_eq!(c.producer_stats().1, 3);
    }

    #[test]
    fn test_full_ring_refuses_then_accepts_after_drain_and_wraps_with_padding() {
        let mut mem = Mem([0; HEADER_BYTES + 256]);
        let (mut p, mut c) = ring(&mut mem);
        let chunk = [7u8; 40]; // 48-byte records
        let mut pushed = 0;
        while p.push(Kind::Write, 2, &chunk).is_ok() {
            pushed += 1;
        }
        assert_eq!(pushed, 5, "256 bytes hold five 48-byte records");
        assert!(p.wants_doorbell());
        assert_eq!(p.push(Kind::Write, 2, &chunk), Err(RingError::Full));
        assert_eq!(collect(&mut c).len(), 5);
        // The next record does not fit in the 16 bytes left before the end: padded, wrapped.
        for i in 0..20u8 {
            p.push(Kind::Write, 3, &[i; 40]).unwrap();
            let got = collect(&mut c);
            assert_eq!(got, vec![(Kind::Write, 3, vec![i; 40])]);
        }
        assert_eq!(p.push(Kind::Write, 3, &[0; 200]), Err(RingError::TooLarge));
    }

    #[test]
    fn test_consumer_rejects_corrupt_records_and_bad_headers() {
        let mut mem = Mem([0; HEADER_BYTES + 256]);
        {
            let (mut p, _) = ring(&mut mem);
            p.push(Kind::Write, 1, b"x").unwrap();
        }
        mem.0[HEADER_BYTES] = 99; // unknown kind
        let base = mem.0.as_mut_ptr();
        // SAFETY: `mem` outlives the consumer.
        let mut c = unsafe { Consumer::attach(base, mem.0.len()) }.unwrap();
        assert_eq!(c.drain(|_| {}), Err(RingError::Corrupt));
        // Break the magic.
        mem.0[0] = 0;
        // SAFETY: as above.
        let attached = unsafe { Consumer::attach(base, mem.0.len()) };
        assert!(matches!(attached, Err(RingError::BadHeader)));
    }

    #[test]
    fn test_counters_wrapping_past_u64_max_are_consumed_not_overflowed() {
        let mut mem = Mem([0; HEADER_BYTES + 256]);
        {
            let (_p, _c) = ring(&mut mem);
        }
        // `tail` 8 bytes below 2^64 (position 248, the last record slot), an 8-byte
        // Close record there, and `head` wrapped to 0: the state the fuzzer found.
        let tail = u64::MAX - 7;
        let head_at = 64;
        let tail_at = 128;
        mem.0[head_at..head_at + 8].copy_from_slice(&0u64.to_le_bytes());
        mem.0[tail_at..tail_at + 8].copy_from_slice(&tail.to_le_bytes());
        let rec = HEADER_BYTES + 248;
        mem.0[rec..rec + 2].copy_from_slice(&(Kind::Close as u16).to_le_bytes());
        mem.0[rec + 2..rec + 4].copy_from_slice(&5u16.to_le_bytes());
        mem.0[rec + 4..rec + 8].copy_from_slice(&0u32.to_le_bytes());
        let base = mem.0.as_mut_ptr();
        // SAFETY: `mem` outlives both handles and is 64-byte aligned.
        let mut c = unsafe { Consumer::attach(base, mem.0.len()) }.unwrap();
        assert_eq!(collect(&mut c), vec![(Kind::Close, 5, vec![])]);
        // SAFETY: as above.
        let mut p = unsafe { Producer::attach(base, mem.0.len()) }.unwrap();
        assert_eq!(p.used(), 0, "tail wrapped to head");
        // The producer goes on from the wrapped counters.
        p.push(Kind::Write, 5, b"after").unwrap();
        assert_eq!(collect(&mut c), vec![(Kind::Write, 5, b"after".to_vec())]);
        // A record claiming more than was published across the wrap is corrupt, not a
        // panic, and `tail` stays put.
        mem.0[tail_at..tail_at + 8].copy_from_slice(&(u64::MAX - 7).to_le_bytes());
        mem.0[head_at..head_at + 8].copy_from_slice(&0u64.to_le_bytes());
        mem.0[rec + 4..rec + 8].copy_from_slice(&8u32.to_le_bytes());
        // SAFETY: as above.
        let mut c = unsafe { Consumer::attach(base, mem.0.len()) }.unwrap();
        assert_eq!(c.drain(|_| {}), Err(RingError::Corrupt));
    }

    #[test]
    fn test_names_that_could_escape_are_refused() {
        for ok in [&b"out.csv"[..], b"bbcount/blocks.json", b"a-b_c.1"] {
            assert_eq!(validate_name(ok), Ok(()), "{ok:?}");
        }
        assert_eq!(validate_name(b"../etc/passwd"), Err(NameError::Component));
        assert_eq!(validate_name(b"/etc/passwd"), Err(NameError::Component));
        assert_eq!(validate_name(b"a//b"), Err(NameError::Component));
        assert_eq!(validate_name(b"a/./b"), Err(NameError::Component));
        assert_eq!(validate_name(b".bashrc"), Err(NameError::Component));
        assert_eq!(validate_name(b"out/.hidden"), Err(NameError::Component));
        assert_eq!(validate_name(b"a/b/"), Err(NameError::Component));
        assert_eq!(validate_name(b"a.b/c..d"), Ok(()));
        assert_eq!(validate_name(b"a b"), Err(NameError::Character));
        assert_eq!(validate_name(b"a\\..\\b"), Err(NameError::Character));
        assert_eq!(validate_name(b""), Err(NameError::Length));
        assert_eq!(validate_name(&[b'a'; 129]), Err(NameError::Length));
    }

    #[test]
    fn test_threads_transfer_every_byte_in_order() {
        #[repr(C, align(64))]
        struct Big([u8; HEADER_BYTES + 4096]);
        let mut mem = std::boxed::Box::new(Big([0; HEADER_BYTES + 4096]));
        let base = mem.0.as_mut_ptr() as usize;
        let len = mem.0.len();
        // SAFETY: `mem` outlives both threads (joined below) and is 64-byte aligned.
        unsafe { format(base as *mut u8, len, 1024) }.unwrap();
        // SAFETY: as above.
        let mut p = unsafe { Producer::attach(base as *mut u8, len) }.unwrap();
        // SAFETY: as above.
        let mut c = unsafe { Consumer::attach(base as *mut u8, len) }.unwrap();
        const N: u32 = 20_000;
        let producer = std::thread::spawn(move || {
            for i in 0..N {
                let bytes = i.to_le_bytes();
                let payload = &bytes[..(i % 4 + 1) as usize];
                while p.push(Kind::Write, 1, payload) == Err(RingError::Full) {
                    std::thread::yield_now();
                }
            }
        });
        let mut next = 0u32;
        while next < N {
            c.drain(|r| {
                let want = next.to_le_bytes();
                assert_eq!(r.payload, &want[..(next % 4 + 1) as usize]);
                next += 1;
            })
            .unwrap();
        }
        producer.join().unwrap();
        drop(mem);
    }
}
