//! A deterministic fuzzer for the ring consumer and the daemon, run as a plain test.
//!
//! Each iteration builds a valid ring state (records pushed by the real producer from
//! counters placed anywhere in `u64`, often just below `u64::MAX`), mutates it (record
//! kinds, lengths, file ids, name bytes, payload bytes, `head` and `tail`), and serves it
//! into an output directory seeded with hazards: symlinks to a file and a directory
//! outside, a FIFO, a hard link to an outside file, a plain file to create names below.
//! After every serve and every episode it checks that nothing panicked, that nothing
//! outside the output directory changed, that no dot-file and no file through a symlink
//! appeared, that open files and output bytes stayed within the limits, and that no file
//! descriptor outlives its daemon.
//!
//! `KPIN_FUZZ_ITERATIONS` overrides the iteration count; `KPIN_FUZZ_SEED` the seed.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use host_daemon::{Daemon, DaemonConfig, ENGINE_LOG, RESERVED_NAMES};
use kpin_abi::io_ring::{format, Consumer, Kind, Producer, HEADER_BYTES};

/// Iterations in CI: about 4 s in a release build with /dev/shm, 15 s on ext4.
const ITERATIONS: u64 = 100_000;
/// Iterations that share one output directory.
const EPISODE: u64 = 100;
const DATA_BYTES: usize = 4096;
const CONFIG: DaemonConfig = DaemonConfig {
    max_open_files: 8,
    max_files: 48,
    max_output_bytes: 32 << 10,
    max_echoed_lines: 0,
};
/// Offsets of `head` and `tail` in the ring header.
const HEAD_AT: usize = 64;
const TAIL_AT: usize = 128;

/// xorshift64*: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

#[repr(C, align(64))]
struct Mem([u8; HEADER_BYTES + DATA_BYTES]);

const NAMES: &[&[u8]] = &[
    b"a.csv",
    b"dir/b.csv",
    b"dir/sub/c.txt",
    b"tool.csv",
    b"bbcount.csv",
    b"counters.json",
    b"outlink",
    b"outdir/x",
    b"fifo",
    b"hard",
    b"plain/below",
    b"dir",
    b".hidden",
    b"dir/.hidden",
    b"..",
    b"../escape",
    b"dir/../../escape",
    b"/tmp/abs",
    b"a//b",
    b"",
    b"x\0y",
    b"\x1b[31m",
    b"control.sock",
    b"run.json",
];

fn u64_at(mem: &Mem, at: usize) -> u64 {
    u64::from_le_bytes(mem.0[at..at + 8].try_into().expect("8 bytes"))
}

fn set_u64(mem: &mut Mem, at: usize, v: u64) {
    mem.0[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A counter base: 0, just below 2^64 (the overflow the fuzzer found), or anywhere.
fn base(rng: &mut Rng) -> u64 {
    match rng.below(4) {
        0 => 0,
        1 => (u64::MAX - 7) - rng.below(2 * DATA_BYTES as u64) / 8 * 8,
        2 => (1 << 63) - rng.below(DATA_BYTES as u64) / 8 * 8,
        _ => rng.next() / 8 * 8,
    }
}

/// Pushes a valid burst of records from counters at `start`.
fn fill(mem: &mut Mem, rng: &mut Rng, start: u64) {
    let ptr = mem.0.as_mut_ptr();
    let len = mem.0.len();
    // SAFETY: `mem` is 64-byte aligned and outlives the producer (dropped at the end of
    // this function); nothing else uses the ring meanwhile.
    unsafe { format(ptr, len, 1024) }.expect("a valid geometry");
    set_u64(mem, HEAD_AT, start);
    set_u64(mem, TAIL_AT, start);
    // SAFETY: as above.
    let mut p = unsafe { Producer::attach(ptr, len) }.expect("just formatted");
    for _ in 0..rng.below(24) {
        let file = rng.below(12) as u16;
        let r = match rng.below(10) {
            0..=2 => {
                let name = rng.pick::<&[u8]>(NAMES);
                p.push(Kind::Open, file, name)
            }
            3..=6 => {
                let n = rng.below(300) as usize;
                let data: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                p.push(Kind::Write, file, &data)
            }
            7 => p.push(Kind::Close, file, b""),
            _ => {
                let n = rng.below(120) as usize;
                let text: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                p.push(Kind::Log, rng.below(6) as u16, &text)
            }
        };
        if r.is_err() {
            break;
        }
    }
}

/// Mutates the ring state a few times.
fn mutate(mem: &mut Mem, rng: &mut Rng) {
    for _ in 0..rng.below(4) {
        let head = u64_at(mem, HEAD_AT);
        let tail = u64_at(mem, TAIL_AT);
        let rec = HEADER_BYTES + (tail % DATA_BYTES as u64) as usize / 8 * 8;
        match rng.below(10) {
            0 => set_u64(mem, HEAD_AT, rng.next()),
            1 => set_u64(
                mem,
                HEAD_AT,
                tail.wrapping_add(rng.below(2 * DATA_BYTES as u64)),
            ),
            2 => set_u64(mem, TAIL_AT, head.wrapping_sub(rng.below(64))),
            3 => {
                // The fuzzer's find: tail in the last slot before 2^64, head wrapped.
                set_u64(mem, TAIL_AT, u64::MAX - 7);
                set_u64(mem, HEAD_AT, rng.below(16) * 8);
            }
            4 => mem.0[rec..rec + 2].copy_from_slice(&(rng.below(8) as u16).to_le_bytes()),
            5 => mem.0[rec + 2..rec + 4].copy_from_slice(&(rng.next() as u16).to_le_bytes()),
            6 => {
                let any = rng.next() as u32;
                let len = *rng.pick(&[0, 1, 7, 8, 4088, 4096, u32::MAX, any]);
                mem.0[rec + 4..rec + 8].copy_from_slice(&len.to_le_bytes());
            }
            _ => {
                let at = HEADER_BYTES + rng.below(DATA_BYTES as u64) as usize;
                let any = rng.next() as u8;
                mem.0[at] = *rng.pick(&[0, b'.', b'/', b'a', 0x1b, b'\n', any]);
            }
        }
    }
}

struct Scene {
    root: PathBuf,
    out: PathBuf,
    victim_file: PathBuf,
    victim_dir: PathBuf,
}

fn scene(root: &Path) -> Scene {
    let _ = std::fs::remove_dir_all(root);
    let out = root.join("out");
    let victim_dir = root.join("victim-dir");
    let victim_file = root.join("victim-file");
    std::fs::create_dir_all(&out).expect("scratch");
    std::fs::create_dir_all(&victim_dir).expect("scratch");
    std::fs::write(&victim_file, "keep").expect("scratch");
    std::os::unix::fs::symlink(&victim_file, out.join("tool.csv")).expect("scratch");
    std::os::unix::fs::symlink(&victim_file, out.join("outlink")).expect("scratch");
    std::os::unix::fs::symlink(&victim_dir, out.join("outdir")).expect("scratch");
    std::fs::hard_link(&victim_file, out.join("hard")).expect("scratch");
    std::fs::write(out.join("plain"), "").expect("scratch");
    let fifo = std::ffi::CString::new(out.join("fifo").as_os_str().as_bytes()).expect("path");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    Scene {
        root: root.to_owned(),
        out,
        victim_file,
        victim_dir,
    }
}

/// Every entry beneath `dir` (not following symlinks).
fn walk(dir: &Path, found: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    for e in std::fs::read_dir(dir).expect("readable") {
        let e = e.expect("entry");
        let meta = std::fs::symlink_metadata(e.path()).expect("stat");
        if meta.is_dir() {
            walk(&e.path(), found);
        }
        found.push((e.path(), meta));
    }
}

fn check_scene(s: &Scene, daemons: u64) {
    assert_eq!(std::fs::read_to_string(&s.victim_file).unwrap(), "keep");
    assert_eq!(std::fs::read_dir(&s.victim_dir).unwrap().count(), 0);
    let top: Vec<_> = std::fs::read_dir(&s.root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        top.len(),
        3,
        "nothing new beside the output directory: {top:?}"
    );
    let mut found = Vec::new();
    walk(&s.out, &mut found);
    let mut bytes = 0;
    for (path, meta) in &found {
        let name = path.file_name().unwrap().as_bytes();
        assert!(name[0] != b'.', "dot-file {}", path.display());
        let rel = path.strip_prefix(&s.out).unwrap();
        let first = rel.iter().next().unwrap().to_str().unwrap();
        if first != ENGINE_LOG {
            assert!(!RESERVED_NAMES.contains(&first), "{}", path.display());
        }
        if meta.file_type().is_symlink() {
            assert!(
                ["tool.csv", "outlink", "outdir"].contains(&first),
                "new symlink {}",
                path.display()
            );
        }
        if meta.is_file() && first != "hard" {
            bytes += meta.len();
        }
    }
    // Each daemon writes at most its budget, plus its one "limit reached" line.
    assert!(
        bytes <= daemons * (CONFIG.max_output_bytes + 512),
        "{bytes} bytes"
    );
}

/// Whether files can be made in `dir`.
fn tempfile_ok(dir: &Path) -> bool {
    let probe = dir.join(format!("kpin-fuzz-probe-{}", std::process::id()));
    let ok = std::fs::write(&probe, b"").is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

#[test]
fn test_fuzzed_ring_states_never_escape_the_output_directory_or_exceed_the_limits() {
    let iterations = std::env::var("KPIN_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ITERATIONS);
    let seed = std::env::var("KPIN_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x6b70_696e_5f66_757a);
    // tmpfs where there is one: the fuzzer creates and deletes files by the thousand.
    let shm = Path::new("/dev/shm");
    let tmp = if shm.is_dir() && tempfile_ok(shm) {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    };
    let root = tmp.join(format!("kpin-fuzz-ring-{}", std::process::id()));
    let mut rng = Rng(seed | 1);
    let mut mem = Box::new(Mem([0; HEADER_BYTES + DATA_BYTES]));
    let (mut served, mut errors, mut records) = (0u64, 0u64, 0u64);
    let start = std::time::Instant::now();
    let fds = || std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count);
    let fds_before = fds();
    let mut it = 0;
    while it < iterations {
        let s = scene(&root);
        let mut daemon = Daemon::with_config(&s.out, CONFIG);
        let mut daemons = 1;
        for _ in 0..EPISODE.min(iterations - it) {
            it += 1;
            let start = base(&mut rng);
            fill(&mut mem, &mut rng, start);
            mutate(&mut mem, &mut rng);
            let ptr = mem.0.as_mut_ptr();
            // SAFETY: `mem` is 64-byte aligned and outlives the consumer, dropped at the
            // end of this iteration; the producer is gone.
            let mut c = unsafe { Consumer::attach(ptr, mem.0.len()) }.expect("valid header");
            match daemon.serve(&mut c) {
                Ok(n) => {
                    served += 1;
                    records += n as u64;
                    assert_eq!(u64_at(&mem, TAIL_AT), u64_at(&mem, HEAD_AT), "drained");
                }
                Err(_) => {
                    errors += 1;
                    let stats = daemon.finish().expect("flushes");
                    assert!(stats.bytes_written <= CONFIG.max_output_bytes);
                    daemon = Daemon::with_config(&s.out, CONFIG);
                    daemons += 1;
                }
            }
            assert!(daemon.open_files() <= CONFIG.max_open_files);
            assert!(daemon.output_bytes() <= CONFIG.max_output_bytes);
        }
        let stats = daemon.finish().expect("flushes");
        assert!(stats.files_opened <= CONFIG.max_files);
        check_scene(&s, daemons);
        assert_eq!(fds(), fds_before, "every file the daemons opened is closed");
    }
    let _ = std::fs::remove_dir_all(&root);
    eprintln!(
        "fuzz_ring: {iterations} ring states in {:.1} s: {served} served ({records} records), {errors} corrupt",
        start.elapsed().as_secs_f64()
    );
    assert!(
        served > iterations / 4 && errors > iterations / 20,
        "both paths exercised"
    );
}
