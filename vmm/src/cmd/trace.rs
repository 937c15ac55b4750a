//! `kpin trace`: a run's trace printed as text through the registry — the trace printer
//! of a tool's host part (`HostTool::trace`; memtrace's: `memtrace.bin` as CSV in the
//! column order of QEMU's mem plugin), instruction addresses named from the run's kernel
//! if given. The printer is the one whose file the run left (the first tool's with a
//! printer if none did, to say what is missing).

use std::path::Path;

use anyhow::{bail, Context};
use kpin_tool::host_side::{TraceError, TracePrinter};
use vmm::diag::kernel_symbols::KernelSymbols;

/// The trace printer for the run in `run`.
fn printer(run: &Path) -> anyhow::Result<&'static dyn TracePrinter> {
    let printers: Vec<&'static dyn TracePrinter> = kpin_tool_registry::host::HOST_TOOLS
        .iter()
        .filter_map(|h| h.trace())
        .collect();
    printers
        .iter()
        .copied()
        .find(|p| std::fs::symlink_metadata(run.join(p.file())).is_ok())
        .or_else(|| printers.first().copied())
        .context("no tool in this kpin leaves a trace")
}

/// `kpin trace`: a run's trace records as text on stdout.
pub(crate) fn trace(
    run: &Path,
    limit: Option<u64>,
    kernel: Option<&Path>,
    system_map: Option<&Path>,
) -> anyhow::Result<()> {
    let mut symbols = match kernel {
        Some(k) => KernelSymbols::load(k, system_map)?,
        None => None,
    };
    let printer = printer(run)?;
    let bin = run.join(printer.file());
    let bytes = std::fs::read(&bin).with_context(|| format!("cannot read {}", bin.display()))?;
    // Where the kernel's instructions ran tells a KASLR slide (a bzImage boot).
    if let (Some(s), Some(executed)) = (symbols.as_mut(), printer.code_addresses(&bytes)) {
        if let Some(found) = s.find_slide(executed) {
            if found.slide != 0 {
                eprintln!("kpin: names from {}", s.source);
            }
        }
    }
    let name = |a: u64| symbols.as_ref().and_then(|s| s.describe(a));
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match printer.print(&bytes, limit, &name, &mut out) {
        Ok(()) => {}
        // `kpin trace … | head` closes the pipe early: not an error.
        Err(TraceError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => bail!("{}: {e}", bin.display()),
    }
    match std::io::Write::flush(&mut out) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
