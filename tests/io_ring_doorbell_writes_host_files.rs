//! The host I/O ring end to end: a guest writes ring records into the stolen region and
//! rings the doorbell; the VMM drains them through the host daemon into the run's output
//! directory. A name that would escape the directory is refused. The engine-failure port
//! ends the run as a crash after the engine's last log lines are written.

use iced_x86::code_asm::{dx, ptr, qword_ptr, rax, rcx, rdi, rsi, CodeAssembler};
use kpin_abi::io_ring::{format, Kind, LogLevel, Producer, RingHeader, HEADER_BYTES};
use kpin_abi::ports::{DOORBELL_PORT, ENGINE_FAILURE_PORT};
use kpin_abi::stolen::IO_RING_OFFSET;
use kpin_tests::{require_kvm, run_guest, scratch_dir, tiny_elf, TINY_LOAD_ADDR};
use vmm::layout::BOOT_PDPT_START;
use vmm::memory::stolen_base;
use vmm::{Outcome, VmConfig};

const MEM_MIB: u64 = 32;

/// Ring data bytes holding `records`, as the engine's producer lays them out.
fn ring_bytes(records: &[(Kind, u16, &[u8])]) -> Vec<u8> {
    #[repr(C, align(64))]
    struct Mem([u8; HEADER_BYTES + 4096]);
    let mut mem = Box::new(Mem([0; HEADER_BYTES + 4096]));
    let base = mem.0.as_mut_ptr();
    // SAFETY: `mem` outlives the producer, which is dropped at the end of this function.
    unsafe { format(base, mem.0.len(), 1024) }.unwrap();
    // SAFETY: as above.
    let mut p = unsafe { Producer::attach(base, mem.0.len()) }.unwrap();
    for (kind, file, payload) in records {
        p.push(*kind, *file, payload).unwrap();
    }
    let used = usize::try_from(p.used()).unwrap();
    mem.0[HEADER_BYTES..HEADER_BYTES + used].to_vec()
}

/// A free page below the kernel for the guest's extra page directory.
const EXTRA_PD: u64 = 0xf000;

/// A guest that maps the first 2 MiB of the stolen region (through a page directory of its
/// own at [`EXTRA_PD`]), copies `data` into the ring, publishes it, writes `port`, then
/// resets the machine.
fn ring_writer_guest(data: &[u8], port: u16) -> Vec<u8> {
    let stolen = stolen_base(MEM_MIB << 20);
    let ring = stolen + IO_RING_OFFSET;
    let head = ring + std::mem::offset_of!(RingHeader, head) as u64;
    let mut a = CodeAssembler::new(64).unwrap();
    let mut blob = a.create_label();
    // PD entry 0: [stolen, stolen + 2 MiB), present, writable, 2 MiB page; PDPT entry for
    // the stolen region's GiB: that PD.
    a.mov(rax, stolen | 0x83).unwrap();
    a.mov(qword_ptr(EXTRA_PD), rax).unwrap();
    a.mov(rax, EXTRA_PD | 0x3).unwrap();
    a.mov(qword_ptr(BOOT_PDPT_START + (stolen >> 30) * 8), rax)
        .unwrap();
    a.mov(rax, iced_x86::code_asm::cr3).unwrap();
    a.mov(iced_x86::code_asm::cr3, rax).unwrap();
    a.lea(rsi, ptr(blob)).unwrap();
    a.mov(rdi, ring + HEADER_BYTES as u64).unwrap();
    a.mov(rcx, data.len() as u64).unwrap();
    a.rep().movsb().unwrap();
    a.mov(rax, data.len() as u64).unwrap();
    a.mov(rdi, head).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
    a.mov(dx, u32::from(port)).unwrap();
    a.out(dx, iced_x86::code_asm::al).unwrap();
    a.mov(iced_x86::code_asm::al, 0xfe_u32).unwrap();
    a.out(0x64_u32, iced_x86::code_asm::al).unwrap();
    a.hlt().unwrap();
    a.set_label(&mut blob).unwrap();
    a.db(data).unwrap();
    a.assemble(TINY_LOAD_ADDR).unwrap()
}

fn run(name: &str, code: &[u8]) -> (vmm::RunReport, host_daemon::DaemonStats, std::path::PathBuf) {
    let dir = scratch_dir(name);
    let kernel = dir.join("guest.elf");
    std::fs::write(&kernel, tiny_elf(code)).unwrap();
    let cfg = VmConfig {
        mem_mib: MEM_MIB,
        timeout: Some(std::time::Duration::from_secs(30)),
        ..VmConfig::new(kernel)
    };
    let (report, stats) = run_guest(&cfg, &dir);
    (report, stats, dir)
}

#[test]
fn test_doorbell_drains_tool_files_into_output_dir() {
    require_kvm!();
    let data = ring_bytes(&[
        (Kind::Open, 1, b"tool/out.csv"),
        (Kind::Write, 1, b"block,count\n0x1000,42\n"),
        (Kind::Close, 1, b""),
        (Kind::Open, 2, b"../escape.txt"),
        (Kind::Write, 2, b"must not land"),
        (Kind::Log, LogLevel::Info as u16, b"hello from the guest"),
    ]);
    let (report, stats, dir) = run("ring", &ring_writer_guest(&data, DOORBELL_PORT));
    assert_eq!(report.outcome, Outcome::Poweroff, "{:?}", report.dump);
    assert_eq!(report.exits.doorbells, 1);
    assert_eq!(
        std::fs::read_to_string(dir.join("tool/out.csv")).unwrap(),
        "block,count\n0x1000,42\n"
    );
    assert!(!dir.parent().unwrap().join("escape.txt").exists());
    assert_eq!(stats.files_opened, 1);
    assert_eq!(stats.files_refused, 1);
    assert_eq!(stats.writes_dropped, 1);
    let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap();
    assert!(log.contains("[Info] hello from the guest"), "{log}");
    assert!(log.contains("refused to create \"../escape.txt\""), "{log}");
}

#[test]
fn test_engine_failure_port_is_a_crash_with_last_log_lines() {
    require_kvm!();
    let data = ring_bytes(&[(
        Kind::Log,
        LogLevel::Error as u16,
        b"engine: unexpected #PF in the engine",
    )]);
    let (report, _, dir) = run("ring-fail", &ring_writer_guest(&data, ENGINE_FAILURE_PORT));
    assert_eq!(report.outcome, Outcome::EngineFailure);
    assert!(report.dump.is_some());
    let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap();
    assert!(log.contains("unexpected #PF in the engine"), "{log}");
}

#[test]
fn test_corrupt_ring_ends_the_run_in_order_with_a_dump() {
    require_kvm!();
    let mut data = ring_bytes(&[
        (Kind::Log, LogLevel::Info as u16, b"before"),
        (Kind::Write, 1, b"x"),
    ]);
    // The second record's kind: no such kind.
    let second = kpin_abi::io_ring::record_bytes(b"before".len());
    data[second] = 99;
    let (report, _, dir) = run("ring-corrupt", &ring_writer_guest(&data, DOORBELL_PORT));
    assert_eq!(
        report.outcome,
        Outcome::HostDaemon("the engine's I/O ring is corrupt (Corrupt)".into())
    );
    assert!(report.dump.is_some(), "a dump, as for any crash");
    let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap();
    assert!(log.contains("[Info] before"), "{log}");
}
