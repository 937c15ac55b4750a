//! The run summary, `run.json`'s body at the end of a run (part of the `kpin` binary).
//!
//! It is serialized straight from the structs that hold the data: the exit counts
//! ([`vmm::ExitCounters`]) and the daemon's statistics ([`host_daemon::DaemonStats`])
//! through serde's remote derives below, which give each field its `run.json` key. The
//! keys, their order and their meanings are `run.json`'s (documented in
//! `docs/host-input.md`, "Host-side faults"); the file is written by
//! `run_record::write_run_json`.

use std::collections::BTreeMap;
use std::path::Path;

use host_daemon::DaemonStats;
use serde::{Serialize, Serializer};
use vmm::ExitCounters;

use crate::cmd::reports::ToolEntries;

/// The run summary written to `<out>/run.json` at the end of the run.
#[derive(Serialize)]
pub(crate) struct Summary<'a> {
    /// Whether the directory holds the run's whole output: not stopped by a signal, every
    /// file written, and no tool file left unfinished. (Whether the guest ended well is
    /// `outcome` and `clean`.)
    pub(crate) complete: bool,
    /// `run_record::STATUS_COMPLETE` or `STATUS_INCOMPLETE` (`STATUS_RUNNING` is the file
    /// written at the start).
    pub(crate) status: &'static str,
    /// Why the output is incomplete (causes joined with "; "), or `null`.
    pub(crate) incomplete_reason: Option<String>,
    /// The tool files the engine opened and had not closed when the run ended, relative
    /// to the output directory: what was written so far, not finished results.
    pub(crate) unfinished_files: Vec<String>,
    pub(crate) outcome: String,
    pub(crate) clean: bool,
    /// What was booted: `kernel`, `initrd`, `cmdline`, `mem_mib`.
    #[serde(flatten)]
    pub(crate) guest: GuestRecord<'a>,
    pub(crate) entry: String,
    pub(crate) tool: Option<&'a str>,
    pub(crate) wall_seconds: f64,
    pub(crate) console_bytes: u64,
    /// `exits_total` … `record_ring_waits` ([`ExitsRecord`]).
    #[serde(flatten, with = "ExitsRecord")]
    pub(crate) exits: ExitCounters,
    /// The virtio devices (`--disk`, `--rng`): kind, image, window, IRQ, counters.
    pub(crate) devices: Vec<vmm::devices::virtio::DeviceRecord>,
    /// `ring_records` … `engine_log_lines_dropped` ([`RingRecord`]).
    #[serde(flatten, with = "RingRecord")]
    pub(crate) ring: DaemonStats,
    /// The engine's `counters.json` (instrumented runs that got far enough to write it).
    pub(crate) engine_counters: Option<serde_json::Value>,
    /// The processes the engine saw run, from its `processes.json` (`docs/processes.md`).
    pub(crate) processes: Option<crate::cmd::processes::Processes>,
    /// The tools' entries, one key per registry tool whose host part has one (bbcount's
    /// user/kernel split and hottest blocks, for a `--tool bbcount` run that wrote
    /// `bbcount.csv`), `null` for another tool's run.
    #[serde(flatten)]
    pub(crate) tools: ToolEntries,
}

/// The guest a run booted, as `run.json` names it.
#[derive(Clone, Copy, Serialize)]
pub(crate) struct GuestRecord<'a> {
    pub(crate) kernel: &'a Path,
    pub(crate) initrd: Option<&'a Path>,
    pub(crate) cmdline: &'a str,
    pub(crate) mem_mib: u64,
}

/// `run.json`'s keys for the vCPU loop's exit counts, in `run.json`'s order.
#[derive(Serialize)]
#[serde(remote = "ExitCounters")]
struct ExitsRecord {
    #[serde(rename = "exits_total")]
    total: u64,
    #[serde(rename = "exits_io_in")]
    io_in: u64,
    #[serde(rename = "exits_io_out")]
    io_out: u64,
    #[serde(rename = "exits_io_absent")]
    io_absent: u64,
    /// Accesses to ports no device serves (read all ones, writes dropped), by port
    /// (`"0x2e"`: count).
    #[serde(serialize_with = "hex_keys")]
    unpopulated_ports: BTreeMap<u16, u64>,
    /// MMIO accesses below 4 GiB to unbacked addresses, in all and by page.
    unbacked_mmio_total: u64,
    #[serde(rename = "unbacked_mmio_pages", serialize_with = "hex_keys")]
    unbacked_mmio: BTreeMap<u64, u64>,
    /// MMIO accesses the virtio devices served.
    #[serde(rename = "exits_mmio_device")]
    mmio_device: u64,
    #[serde(rename = "exits_interrupted")]
    interrupted: u64,
    #[serde(rename = "ring_doorbells")]
    doorbells: u64,
    /// Of the doorbells, the engine's waits for room in the record ring.
    #[serde(rename = "record_ring_waits")]
    record_room_waits: u64,
}

/// `run.json`'s keys for what the host daemon did with the I/O ring, in `run.json`'s
/// order.
#[derive(Serialize)]
#[serde(remote = "DaemonStats")]
struct RingRecord {
    #[serde(rename = "ring_records")]
    records: u64,
    #[serde(rename = "files_written")]
    files_opened: u64,
    files_refused: u64,
    writes_dropped: u64,
    #[serde(rename = "output_bytes_dropped")]
    bytes_dropped: u64,
    #[serde(rename = "engine_log_lines")]
    log_lines: u64,
    #[serde(rename = "engine_log_lines_dropped")]
    log_lines_dropped: u64,
}

/// A per-address count map with the addresses in hex (`"0x2e"`), ordered as strings
/// (as a `BTreeMap<String, u64>`), for `run.json`.
fn hex_keys<K: std::fmt::LowerHex, S: Serializer>(
    m: &BTreeMap<K, u64>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let hex: BTreeMap<String, u64> = m.iter().map(|(k, v)| (format!("{k:#x}"), *v)).collect();
    hex.serialize(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run.json`'s keys, in order, as they were when `Summary` copied them by hand
    /// (`tests/host_faults.rs`, `vmm/tests/cli.rs` and users' scripts read them), then
    /// the tools' (`tool_keys`).
    const RUN_JSON_KEYS: [&str; 35] = [
        "complete",
        "status",
        "incomplete_reason",
        "unfinished_files",
        "outcome",
        "clean",
        "kernel",
        "initrd",
        "cmdline",
        "mem_mib",
        "entry",
        "tool",
        "wall_seconds",
        "console_bytes",
        "exits_total",
        "exits_io_in",
        "exits_io_out",
        "exits_io_absent",
        "unpopulated_ports",
        "unbacked_mmio_total",
        "unbacked_mmio_pages",
        "exits_mmio_device",
        "exits_interrupted",
        "ring_doorbells",
        "record_ring_waits",
        "devices",
        "ring_records",
        "files_written",
        "files_refused",
        "writes_dropped",
        "output_bytes_dropped",
        "engine_log_lines",
        "engine_log_lines_dropped",
        "engine_counters",
        "processes",
    ];

    /// The tools' keys after them: the registry's: bbcount's, cachesim's and insmix's.
    fn tool_keys() -> Vec<&'static str> {
        kpin_tool_registry::host::HOST_TOOLS
            .iter()
            .filter_map(|h| h.run_json_key())
            .collect()
    }

    #[test]
    fn test_the_tools_keys_are_the_registrys() {
        assert_eq!(tool_keys(), ["bbcount", "cachesim", "insmix"]);
    }

    #[test]
    fn test_the_summary_keeps_run_jsons_keys_order_and_hex_addresses() {
        let exits = ExitCounters {
            total: 9,
            io_in: 1,
            io_out: 2,
            io_absent: 3,
            unpopulated_ports: BTreeMap::from([(0x2e, 4), (0x100, 5)]),
            unbacked_mmio_total: 6,
            unbacked_mmio: BTreeMap::from([(0xfed0_0000, 6)]),
            mmio_device: 0,
            interrupted: 7,
            doorbells: 8,
            record_room_waits: 18,
        };
        let ring = DaemonStats {
            records: 10,
            files_opened: 11,
            files_refused: 12,
            writes_dropped: 13,
            bytes_dropped: 14,
            log_lines: 15,
            log_lines_dropped: 16,
            ..Default::default()
        };
        let summary = Summary {
            complete: true,
            status: "complete",
            incomplete_reason: None,
            unfinished_files: vec![],
            outcome: "guest powered off".into(),
            clean: true,
            guest: GuestRecord {
                kernel: Path::new("/k"),
                initrd: None,
                cmdline: "console=ttyS0",
                mem_mib: 256,
            },
            entry: "0x1000".into(),
            tool: Some("null"),
            wall_seconds: 0.5,
            console_bytes: 17,
            exits,
            devices: vec![],
            ring,
            engine_counters: None,
            processes: None,
            tools: ToolEntries::none(),
        };
        let json = serde_json::to_string_pretty(&summary).unwrap();
        let value: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&json).unwrap();
        let keys: Vec<&str> = value.keys().map(String::as_str).collect();
        let all: Vec<&str> = RUN_JSON_KEYS.iter().copied().chain(tool_keys()).collect();
        let mut sorted = all.clone();
        sorted.sort_unstable();
        assert_eq!(keys, sorted, "the same keys");
        let positions: Vec<usize> = all
            .iter()
            .map(|k| json.find(&format!("\n  \"{k}\":")).unwrap())
            .collect();
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "in order: {json}"
        );
        let numbers = [
            ("exits_total", 9),
            ("exits_io_in", 1),
            ("exits_io_out", 2),
            ("exits_io_absent", 3),
            ("unbacked_mmio_total", 6),
            ("exits_interrupted", 7),
            ("ring_doorbells", 8),
            ("record_ring_waits", 18),
            ("ring_records", 10),
            ("files_written", 11),
            ("files_refused", 12),
            ("writes_dropped", 13),
            ("output_bytes_dropped", 14),
            ("engine_log_lines", 15),
            ("engine_log_lines_dropped", 16),
            ("console_bytes", 17),
            ("mem_mib", 256),
        ];
        for (key, n) in numbers {
            assert_eq!(value[key], n, "{key}");
        }
        assert_eq!(
            value["unpopulated_ports"],
            serde_json::json!({"0x100": 5, "0x2e": 4})
        );
        assert_eq!(
            value["unbacked_mmio_pages"],
            serde_json::json!({"0xfed00000": 6})
        );
    }
}
