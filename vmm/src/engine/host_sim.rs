//! A tool's simulation on a host thread (cachesim's): the engine appends and resolves the
//! records (the guest's side of the work) and pushes them into the record ring
//! ([`kpin_abi::record_ring`]); a thread of the VMM, on another core, feeds them to the
//! tool's [`RecordConsumer`] (its host part's, from the registry) while the guest runs
//! on. When the run ends the thread drains the ring and the VMM writes the tool's files
//! through the daemon, as the engine would have.
//!
//! drcachesim's online mode has the same shape (the traced process writes records into a
//! pipe, a simulator process reads them). The ring applies back-pressure: a full ring makes
//! the engine wait, so every record is simulated, in order. The engine waits by ringing
//! the doorbell ([`kpin_abi::ports::DOORBELL_RECORD_ROOM`]) and the vCPU thread sleeps
//! ([`RecordRoom`]) until the thread has emptied half the ring: a spinning engine would
//! burn the vCPU's core for as long as the simulator sets the pace.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use host_daemon::Daemon;
use kpin_abi::record_ring::{self, Consumer, Observer};
use kpin_abi::stolen::{RECORD_RING_BYTES, RECORD_RING_OFFSET};
use kpin_tool::host::{Error as SinkError, Sink};
use kpin_tool::host_side::RecordConsumer;
use kpin_tool::MemRecord;

use crate::engine::EngineConfig;
use crate::error::{Result, VmmError};
use crate::vstate::memory::VmMemory;

/// Records simulated between two releases of ring slots.
const BATCH: u64 = 4096;
/// Empty polls spun before the thread starts sleeping between polls.
const SPINS: u32 = 20_000;
/// Sleep between polls of an idle ring (the guest halted, or little to record).
const IDLE_SLEEP: Duration = Duration::from_micros(50);

/// Records handed to the consumer in one call.
const FEED: usize = 256;
/// Longest sleep of a vCPU waiting for room before it looks at the ring, the watchdog
/// and stop requests again (a wake-up is due long before, when the thread makes room).
const ROOM_POLL: Duration = Duration::from_millis(10);

/// A run whose tool's records are to be simulated on the host: which tool, with which
/// options ([`HostSim::plan`]).
#[derive(Clone, Debug)]
pub struct Planned {
    tool: &'static str,
    options: String,
}

/// The simulator thread of a run.
pub struct HostSim {
    /// The tool it simulates.
    tool: &'static str,
    /// The ring's base in the VMM's mapping of the stolen region, and its length.
    ring: *const u8,
    len: usize,
    stop: Arc<AtomicBool>,
    waiter: Arc<Waiter>,
    thread: Option<JoinHandle<Served>>,
}

/// A vCPU waiting for room, as the simulator thread sees it.
struct Waiter {
    /// Set while the vCPU thread sleeps in [`RecordRoom::wait`].
    waiting: AtomicBool,
    /// The vCPU thread (the one that started the simulator).
    vcpu: std::thread::Thread,
}

impl Waiter {
    /// Called by the thread after it released slots (`available` records are left):
    /// wakes a waiting vCPU once half the ring is free.
    fn made_room(&self, available: u64, capacity: u64) {
        // Orders the release of the slots before the read of `waiting`, as `wait` orders
        // its store of `waiting` before its read of the free slots: one of the two sees
        // the other, so no wake-up is lost.
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::Relaxed) && available <= capacity / 2 {
            self.vcpu.unpark();
        }
    }
}

/// The vCPU thread's side of the engine's waits for room in the record ring
/// ([`HostSim::room`]).
pub struct RecordRoom {
    ring: Observer,
    waiter: Arc<Waiter>,
}

impl RecordRoom {
    /// Sleeps until half the ring is free, the ring needs no more waiting (the engine
    /// closed it, or the simulator stopped), or `give_up` says so (checked at least every
    /// [`ROOM_POLL`]: the watchdog, a stop request).
    pub fn wait(&self, give_up: impl Fn() -> bool) {
        let half = self.ring.capacity() / 2;
        self.waiter.waiting.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        while self.ring.free() < half.max(1) && !self.ring.settled() && !give_up() {
            std::thread::park_timeout(ROOM_POLL);
        }
        self.waiter.waiting.store(false, Ordering::Relaxed);
    }
}

/// What the thread did.
struct Served {
    sim: Box<dyn RecordConsumer>,
    /// The engine closed the ring (its tool's window ended) and every record was read.
    finished: bool,
    records: u64,
    producer_waits: u64,
    /// Time spent simulating, and the thread's whole life.
    busy: Duration,
    life: Duration,
    /// The simulation panicked (a bug): the files are not written.
    panicked: bool,
}

impl HostSim {
    /// Whether this host has a core for the simulator besides the vCPU's: with one, the
    /// two threads would take turns and the engine simulates itself.
    pub fn worthwhile() -> bool {
        std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
    }

    /// The host simulation the engine `e` starts with, if any: asked for
    /// (`EngineConfig::host_sim`), the tool's SPEC lets its records go to the host
    /// (`HostPart::takes_records`), and the host has a core for it.
    pub fn plan(e: &EngineConfig) -> Option<Planned> {
        let spec = kpin_tool_registry::find(&e.tool)?;
        let takes = spec.host.is_some_and(|h| h.takes_records.is_some());
        (e.host_sim && takes && Self::worthwhile()).then(|| Planned {
            tool: spec.name,
            options: e.options.clone(),
        })
    }

    /// Formats the record ring in `mem`'s stolen region and starts the thread with the
    /// planned tool's consumer (`None` if the tool refuses the options: the engine then
    /// refuses them too, and says so).
    pub fn start(mem: &VmMemory, plan: &Planned) -> Result<Option<Self>> {
        let base = mem.stolen_host_address(RECORD_RING_OFFSET)?;
        // SAFETY: the stolen region's mapping covers the layout (the abi asserts the ring
        // lies inside it), is page-aligned, and outlives the thread: `HostSim` joins it
        // in `finish` or on drop, and the `Vm` that owns the mapping drops after it
        // (`Vm::run_with_control` holds both). No engine runs yet.
        unsafe { Self::start_at(base, RECORD_RING_BYTES as usize, plan) }
    }

    /// [`HostSim::start`] on the ring of `len` bytes at `base`.
    ///
    /// # Safety
    /// `base` is 64-byte aligned and valid for reads and writes of `len` bytes until the
    /// returned `HostSim` is finished or dropped, and nothing else consumes the ring.
    unsafe fn start_at(base: *mut u8, len: usize, plan: &Planned) -> Result<Option<Self>> {
        let Some(sim) = kpin_tool_registry::host::find(plan.tool)
            .and_then(|h| h.record_consumer(&plan.options))
        else {
            return Ok(None);
        };
        let bad = |e| VmmError::HostSim(format!("the record ring: {e:?}"));
        // SAFETY: forwarded from this function's contract.
        unsafe { record_ring::format(base, len) }.map_err(bad)?;
        // SAFETY: as above; this is the ring's only consumer.
        let ring = unsafe { Consumer::attach(base, len) }.map_err(bad)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let waiter = Arc::new(Waiter {
            waiting: AtomicBool::new(false),
            vcpu: std::thread::current(),
        });
        let waiter2 = Arc::clone(&waiter);
        let thread = std::thread::Builder::new()
            .name(format!("kpin-{}", plan.tool))
            .spawn(move || serve(ring, sim, &stop2, &waiter2))
            .map_err(|e| VmmError::HostSim(format!("its thread: {e}")))?;
        Ok(Some(Self {
            tool: plan.tool,
            ring: base,
            len,
            stop,
            waiter,
            thread: Some(thread),
        }))
    }

    /// The vCPU thread's handle for the engine's waits for room (to be used on the thread
    /// that started the simulator: the one it wakes).
    pub fn room(&self) -> Result<RecordRoom> {
        // SAFETY: `start` formatted the ring of `len` bytes at `ring`, in the stolen
        // region's mapping, which outlives the run loop that uses the handle (see
        // `start`); an observer only reads it.
        let ring = unsafe { Observer::attach(self.ring, self.len) }
            .map_err(|e| VmmError::HostSim(format!("the record ring: {e:?}")))?;
        Ok(RecordRoom {
            ring,
            waiter: Arc::clone(&self.waiter),
        })
    }

    /// Whether the engine closed the ring: the window's last record is in, and the
    /// results can be written (into the window's directory: before the VMM moves on to
    /// the next window's).
    pub fn closed(&self) -> bool {
        // SAFETY: `start` formatted the ring at `ring`, in the stolen region's mapping,
        // which outlives `self` (see `start`).
        unsafe { record_ring::is_closed(self.ring) }
    }

    /// The vCPU stopped, or the engine closed the ring: drains the ring, then writes the
    /// tool's files and a summary line through `daemon` if the engine closed the ring (its
    /// window ended in order).
    pub fn finish(mut self, daemon: &mut Daemon) {
        let Some(s) = self.join() else {
            return;
        };
        if s.panicked {
            daemon.log_host_line(
                kpin_abi::io_ring::LogLevel::Error,
                &format!(
                    "host: {}'s simulator thread failed; its files are not written",
                    self.tool
                ),
            );
            return;
        }
        if !s.finished {
            daemon.log_host_line(
                kpin_abi::io_ring::LogLevel::Warn,
                &format!(
                    "host: {}'s window did not end in order; {} records simulated, no files written",
                    self.tool, s.records
                ),
            );
            return;
        }
        let mut files = Collected::default();
        if let Err(e) = s.sim.write_files(&mut files) {
            daemon.log_host_line(
                kpin_abi::io_ring::LogLevel::Error,
                &format!("host: {} could not write its files: {e}", self.tool),
            );
        }
        for (name, bytes) in &files.0 {
            daemon.write_host_file(name, bytes);
        }
        let mut line = String::from("host: ");
        if s.sim.summary(&mut line).is_ok() {
            line.push_str(&format!(
                " ({} records from the engine, which waited for room {} times; the simulator thread busy {:.2} s of {:.2} s)",
                s.records,
                s.producer_waits,
                s.busy.as_secs_f64(),
                s.life.as_secs_f64()
            ));
            daemon.log_host_line(kpin_abi::io_ring::LogLevel::Info, &line);
        }
    }

    fn join(&mut self) -> Option<Served> {
        self.stop.store(true, Ordering::Release);
        self.thread.take()?.join().ok()
    }
}

impl Drop for HostSim {
    fn drop(&mut self) {
        // The thread reads the stolen region: it ends before the mapping can go.
        let _ = self.join();
    }
}

/// The thread: simulates the published records in order until the engine closes the
/// ring and everything is read, or the VMM stops it and nothing is left.
fn serve(
    mut ring: Consumer,
    mut sim: Box<dyn RecordConsumer>,
    stop: &AtomicBool,
    waiter: &Waiter,
) -> Served {
    let capacity = ring.capacity();
    let mut records = 0u64;
    let born = Instant::now();
    let mut busy = Duration::ZERO;
    let mut batch = Batch::new();
    let run = catch_unwind(AssertUnwindSafe(|| {
        let mut idle = 0u32;
        loop {
            let n = ring.contiguous().min(BATCH);
            if n == 0 {
                if ring.finished() {
                    return true;
                }
                if stop.load(Ordering::Acquire) && ring.available() == 0 {
                    return false;
                }
                idle = idle.saturating_add(1);
                if idle < SPINS {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(IDLE_SLEEP);
                }
                continue;
            }
            idle = 0;
            let t0 = Instant::now();
            feed_stretch(&ring, n, &mut batch, &mut *sim);
            records += n;
            ring.release(n);
            waiter.made_room(ring.available(), capacity);
            busy += t0.elapsed();
        }
    }));
    // From here on nothing reads the ring: a producer waiting for room must not wait on.
    ring.stop();
    waiter.vcpu.unpark();
    Served {
        finished: matches!(run, Ok(true)),
        panicked: run.is_err(),
        producer_waits: ring.producer_waits(),
        records,
        busy,
        life: born.elapsed(),
        sim,
    }
}

/// Feeds the first `n` available records of `ring` (`n <= ring.contiguous()`) to `sim`,
/// [`FEED`] at a time: each stretch copied out of the ring in one copy, straight into the
/// `MemRecord`s of `batch` (the slots hold the records' own bytes), which `sim` is fed.
#[inline(never)]
fn feed_stretch(ring: &Consumer, n: u64, batch: &mut Batch, sim: &mut dyn RecordConsumer) {
    let mut i = 0;
    while i < n {
        let got = ring.copy_records(i, batch.bytes((n - i).min(FEED as u64) as usize));
        if got == 0 {
            break;
        }
        // The engine writes the slots with streaming stores, so they come from memory:
        // the next stretch loads while this one is simulated.
        ring.prefetch(i + got as u64, FEED as u64);
        sim.feed(&batch.records[..got]);
        i += got as u64;
    }
}

/// The records a [`RecordConsumer`] is fed, copied from the ring's slots as they are.
struct Batch {
    records: Box<[MemRecord; FEED]>,
}

// A slot holds a record as `MemRecord` lays it out on this host: `ip`, `ea`, `size |
// access << 32` and `pa` as four little-endian words are its `#[repr(C)]` fields in order
// with no padding (guest_engine::instrument::MemRecord, which the engine appends).
const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<MemRecord>() == record_ring::RECORD_BYTES);
    assert!(align_of::<MemRecord>() <= 8);
    assert!(offset_of!(MemRecord, ip) == 0);
    assert!(offset_of!(MemRecord, ea) == 8);
    assert!(offset_of!(MemRecord, size) == 16);
    assert!(offset_of!(MemRecord, access) == 20);
    assert!(offset_of!(MemRecord, pa) == 24);
    assert!(cfg!(target_endian = "little"));
};

impl Batch {
    fn new() -> Self {
        Batch {
            records: Box::new([MemRecord::default(); FEED]),
        }
    }

    /// The first `n` records' bytes (`n <= FEED`), to copy slots into.
    fn bytes(&mut self, n: usize) -> &mut [u8] {
        let n = n.min(FEED);
        // SAFETY: the first `n` records are `n * RECORD_BYTES` initialised bytes (the
        // layout asserted above has no padding), borrowed mutably from `self` for the
        // slice's life; every byte pattern is a valid `MemRecord` (integer fields only),
        // so whatever the ring's slots hold, written here, makes records.
        unsafe {
            core::slice::from_raw_parts_mut(
                self.records.as_mut_ptr().cast::<u8>(),
                n * record_ring::RECORD_BYTES,
            )
        }
    }
}

/// The tool's files, collected to be written through the daemon.
#[derive(Default)]
struct Collected(Vec<(String, Vec<u8>)>);

impl Sink for Collected {
    fn open(&mut self, name: &str) -> std::result::Result<u16, SinkError> {
        self.0.push((name.to_owned(), Vec::new()));
        u16::try_from(self.0.len()).map_err(|_| SinkError::TooManyFiles)
    }

    fn write(&mut self, file: u16, data: &[u8]) -> std::result::Result<(), SinkError> {
        match self.0.get_mut(usize::from(file).wrapping_sub(1)) {
            Some((_, bytes)) => {
                bytes.extend_from_slice(data);
                Ok(())
            }
            None => Err(SinkError::Transport),
        }
    }

    fn close(&mut self, _file: u16) -> std::result::Result<(), SinkError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kpin_abi::record_ring::Producer;
    use kpin_tool::access;

    use super::*;

    /// The registry's tool whose records may go to the host (cachesim), with `options`.
    fn plan(options: &str) -> Planned {
        let spec = kpin_tool_registry::TOOLS
            .iter()
            .find(|t| t.host.is_some_and(|h| h.takes_records.is_some()))
            .expect("a tool that simulates on the host");
        Planned {
            tool: spec.name,
            options: options.into(),
        }
    }

    /// The files the tool's SPEC says the host writes.
    fn host_files(plan: &Planned) -> Vec<String> {
        let spec = kpin_tool_registry::find(plan.tool).unwrap();
        let writes = spec.host.unwrap().takes_records.unwrap();
        writes
            .split(", ")
            .flat_map(|w| w.split(" and "))
            .map(str::to_owned)
            .collect()
    }

    const RING_BYTES: usize = record_ring::HEADER_BYTES + 64 * record_ring::RECORD_BYTES;

    #[repr(C, align(64))]
    struct Ring([u8; RING_BYTES]);

    fn out_dir(test: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kpin-host-sim-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Pushes `n` one-byte fetches at kernel addresses one line apart, in batches larger
    /// than the ring (the producer waits for the thread).
    fn push_fetches(p: &mut Producer, n: u64) {
        p.push(&fetches(n)).unwrap();
    }

    /// `n` one-byte fetches at kernel addresses one line apart, as the ring's bytes.
    fn fetches(n: u64) -> Vec<u8> {
        (0..n)
            .flat_map(|k| {
                let r = MemRecord {
                    ip: 0xffff_ffff_8100_0000 + k,
                    ea: 0xffff_ffff_8100_0000 + k * 64,
                    size: 1,
                    access: access::FETCH,
                    pa: 0x10_0000 + k * 64,
                };
                [
                    r.ip,
                    r.ea,
                    u64::from(r.size) | u64::from(r.access) << 32,
                    r.pa,
                ]
            })
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    /// A simulator with `options` started on a new ring, and the ring's producer. Bound
    /// in this order, the simulator ends before the ring's memory goes.
    fn started(options: &str) -> (Box<Ring>, Planned, HostSim, Producer) {
        let mut ring = Box::new(Ring([0; RING_BYTES]));
        let base = ring.0.as_mut_ptr();
        let plan = plan(options);
        // SAFETY: the boxed ring (its heap memory does not move with the box) outlives
        // the simulator and the producer, which the caller drops first, and is 64-byte
        // aligned.
        let sim = unsafe { HostSim::start_at(base, RING_BYTES, &plan) }
            .unwrap()
            .expect("options accepted");
        // SAFETY: as above; the caller is the ring's only producer.
        let p = unsafe { Producer::attach(base, RING_BYTES) }.unwrap();
        (ring, plan, sim, p)
    }

    #[test]
    fn a_closed_ring_is_simulated_in_full_and_its_files_written() {
        let (_ring, plan, sim, mut p) = started("L1I_size=1K LL_size=4K");
        push_fetches(&mut p, 1000);
        assert!(!sim.closed());
        p.close();
        assert!(sim.closed());
        let dir = out_dir("closed");
        let mut daemon = Daemon::new(&dir);
        sim.finish(&mut daemon);
        let files = host_files(&plan);
        assert_eq!(files.len(), 3, "{files:?}");
        for f in &files {
            assert!(dir.join(f).exists(), "{f}");
        }
        let counters = std::fs::read_to_string(dir.join(&files[0])).unwrap();
        assert!(
            counters.contains("fetch_kernel=1000 fetch_user=0"),
            "{counters}"
        );
        // 1000 distinct lines through a 16-line L1I: every fetch misses, once each.
        assert!(
            counters.contains("misses_kernel=1000 misses_user=0"),
            "{counters}"
        );
        daemon.finish().unwrap();
        let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap();
        assert!(
            log.contains("host: cachesim: 1000 references simulated"),
            "{log}"
        );
    }

    #[test]
    fn a_producer_waiting_for_room_sleeps_until_the_thread_has_emptied_half_the_ring() {
        let (ring, plan, sim, mut p) = started("L1I_size=1K LL_size=4K");
        // This thread started the simulator: the one its wake-ups are for, as the vCPU's.
        let room = sim.room().unwrap();
        // SAFETY: the ring outlives the observer (see `started`); an observer only reads.
        let o = unsafe { Observer::attach(ring.0.as_ptr(), RING_BYTES) }.unwrap();
        let start = Instant::now();
        let mut free_after = Vec::new();
        p.push_waiting(&fetches(1000), &mut || {
            room.wait(|| start.elapsed() > Duration::from_secs(60));
            free_after.push(o.free());
        })
        .unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "woken, not timed out"
        );
        // 1000 records through 64 slots: a wait at least every 32 records, each ended
        // with half the ring free.
        assert!(free_after.len() >= 1000 / 64, "{free_after:?}");
        assert!(free_after.iter().all(|&f| f >= 32), "{free_after:?}");
        p.close();
        let dir = out_dir("room");
        let mut daemon = Daemon::new(&dir);
        sim.finish(&mut daemon);
        let counters = std::fs::read_to_string(dir.join(&host_files(&plan)[0])).unwrap();
        assert!(
            counters.contains("fetch_kernel=1000 fetch_user=0"),
            "{counters}"
        );
        // Nothing left to wait for once the engine closed the ring.
        room.wait(|| panic!("a closed ring needs no waiting"));
    }

    #[test]
    fn a_ring_left_open_writes_no_files_and_says_so() {
        let (_ring, plan, sim, mut p) = started("");
        push_fetches(&mut p, 10);
        let dir = out_dir("open");
        let mut daemon = Daemon::new(&dir);
        sim.finish(&mut daemon);
        for f in host_files(&plan) {
            assert!(!dir.join(&f).exists(), "{f}");
        }
        daemon.finish().unwrap();
        let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap();
        assert!(
            log.contains("did not end in order; 10 records simulated"),
            "{log}"
        );
        // The thread is gone: a producer waiting for room stops waiting.
        assert_eq!(
            p.push(&vec![0; 100 * record_ring::RECORD_BYTES]),
            Err(record_ring::RecordRingError::ConsumerStopped)
        );
    }

    /// A ring of `capacity` records in 64-byte aligned memory (the `Vec` of lines).
    fn ring_memory(capacity: usize) -> (Vec<Line>, usize) {
        let len = record_ring::HEADER_BYTES + capacity * record_ring::RECORD_BYTES;
        (vec![Line([0; 64]); len.div_ceil(64)], len)
    }

    #[derive(Clone)]
    #[repr(C, align(64))]
    struct Line([u8; 64]);

    /// `n` records of every kind and of arbitrary bits (the engine's side is not trusted:
    /// a record's fields are data), from a fixed seed.
    fn mixed_records(n: usize) -> Vec<MemRecord> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        (0..n)
            .map(|_| {
                let r = next();
                let line = (r >> 8) % 512 * 64;
                let kernel = if r & 1 == 0 {
                    0xffff_ffff_8100_0000
                } else {
                    0x40_0000
                };
                match r % 7 {
                    6 => MemRecord {
                        ip: next(),
                        ea: next(),
                        // Any size is a record, but cachesim walks an access line by
                        // line: a size of billions costs the simulator that many lines.
                        size: (next() % 300) as u32,
                        access: next() as u32,
                        pa: next(),
                    },
                    k => MemRecord {
                        ip: kernel + (r >> 20) % 4096,
                        ea: kernel + line + (r >> 40) % 64,
                        size: [1, 2, 4, 8, 16, 64][(r >> 50) as usize % 6],
                        access: [
                            access::READ,
                            access::WRITE,
                            access::READ | access::WRITE,
                            access::FETCH,
                            access::FETCH | access::FETCH_RUN,
                            access::READ | access::WITH_FETCH | 3 << access::FETCH_LEN_SHIFT,
                        ][k as usize],
                        pa: 0x10_0000 + line + (r >> 40) % 64,
                    },
                }
            })
            .collect()
    }

    fn ring_bytes(records: &[MemRecord]) -> Vec<u8> {
        records
            .iter()
            .flat_map(|r| {
                [
                    r.ip,
                    r.ea,
                    u64::from(r.size) | u64::from(r.access) << 32,
                    r.pa,
                ]
            })
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    fn consumer(plan: &Planned) -> Box<dyn RecordConsumer> {
        kpin_tool_registry::host::find(plan.tool)
            .and_then(|h| h.record_consumer(&plan.options))
            .expect("options accepted")
    }

    fn files(sim: &dyn RecordConsumer) -> Vec<(String, Vec<u8>)> {
        let mut files = Collected::default();
        sim.write_files(&mut files).unwrap();
        let mut summary = String::new();
        sim.summary(&mut summary).unwrap();
        files.0.push(("summary".into(), summary.into_bytes()));
        files.0
    }

    #[test]
    fn records_through_the_ring_make_the_files_they_make_fed_directly() {
        let plan = plan("L1I_size=1K L1D_size=1K LL_size=4K interval_refs=777");
        let records = mixed_records(20_000);
        let mut direct = consumer(&plan);
        for chunk in records.chunks(1000) {
            direct.feed(chunk);
        }
        // Through a 61-record ring, pushed 40 at a time: stretches split at every place
        // of the wrap.
        let (mut mem, len) = ring_memory(61);
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: the lines outlive both handles and are 64-byte aligned; the test is the
        // ring's only producer and consumer.
        unsafe { record_ring::format(base, len) }.unwrap();
        // SAFETY: as above.
        let mut p = unsafe { Producer::attach(base, len) }.unwrap();
        // SAFETY: as above.
        let mut c = unsafe { Consumer::attach(base, len) }.unwrap();
        let mut ringed = consumer(&plan);
        let mut batch = Batch::new();
        let mut fed = 0;
        for chunk in records.chunks(40) {
            p.push(&ring_bytes(chunk)).unwrap();
            while c.available() > 0 {
                let n = c.contiguous();
                feed_stretch(&c, n, &mut batch, &mut *ringed);
                c.release(n);
                fed += n;
            }
        }
        assert_eq!(fed, records.len() as u64);
        let (a, b) = (files(&*direct), files(&*ringed));
        assert_eq!(a.len(), 4);
        for ((na, fa), (nb, fb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(fa == fb, "{na} differs");
        }
    }

    /// A consumer that only reads its records: the feeding loop's own cost.
    struct Reads(u64);

    impl RecordConsumer for Reads {
        fn feed(&mut self, records: &[MemRecord]) {
            for r in records {
                self.0 = self.0.wrapping_add(
                    r.ip ^ r.ea ^ r.pa ^ u64::from(r.size) ^ u64::from(r.access) << 7,
                );
            }
        }
        fn write_files(&self, _: &mut dyn Sink) -> std::result::Result<(), SinkError> {
            Ok(())
        }
        fn summary(&self, _: &mut dyn std::fmt::Write) -> std::fmt::Result {
            Ok(())
        }
    }

    /// 1 M records through `feed_stretch` from a ring of the engine's stretch size, for
    /// `valgrind --tool=callgrind --toggle-collect='*feed_stretch*'` on the test binary
    /// (the host instructions the loop spends per record, outside the simulator).
    #[test]
    #[ignore = "a measurement: run it under callgrind"]
    fn feeding_cost() {
        const CAP: usize = 4096 + 61;
        let (mut mem, len) = ring_memory(CAP);
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: as in the test above.
        unsafe { record_ring::format(base, len) }.unwrap();
        // SAFETY: as above.
        let mut p = unsafe { Producer::attach(base, len) }.unwrap();
        // SAFETY: as above.
        let mut c = unsafe { Consumer::attach(base, len) }.unwrap();
        let bytes = ring_bytes(&mixed_records(BATCH as usize));
        let mut sim = Reads(0);
        let mut batch = Batch::new();
        for _ in 0..256 {
            p.push(&bytes).unwrap();
            while c.available() > 0 {
                let n = c.contiguous().min(BATCH);
                feed_stretch(&c, n, &mut batch, &mut sim);
                c.release(n);
            }
        }
        println!("{}", std::hint::black_box(sim.0));
    }

    #[test]
    fn refused_options_start_no_thread() {
        let mut ring = Box::new(Ring([0; RING_BYTES]));
        // SAFETY: as above.
        let sim =
            unsafe { HostSim::start_at(ring.0.as_mut_ptr(), RING_BYTES, &plan("L1I_size=3K")) };
        assert!(sim.unwrap().is_none());
    }
}
