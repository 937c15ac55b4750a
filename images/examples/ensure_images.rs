//! Produces the guest images and reports how long it took:
//! `cargo run -p kpin-images --example ensure_images [-- [--all-kernels] [--generic-612]
//! [--only-generic-612] [--minikernel] [OUT_DIR]]` (without `--all-kernels`, only the default
//! kernel; `--generic-612` adds Debian's generic 6.12 kernel, a benchmark configuration that
//! `kpin images` does not fetch, and `--only-generic-612` fetches that one alone:
//! `tests/bench/side_by_side.py` calls it so).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    let mut out_dir = kpin_images::default_out_dir();
    let mut minikernel = false;
    let mut kernels = vec![kpin_images::GuestKernel::Debian61];
    let mut generic_612 = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--minikernel" => minikernel = true,
            "--all-kernels" => kernels = kpin_images::GuestKernel::ALL.to_vec(),
            "--generic-612" => generic_612 = true,
            "--only-generic-612" => {
                generic_612 = true;
                kernels.clear();
            }
            _ => out_dir = PathBuf::from(arg),
        }
    }
    if generic_612 {
        let start = Instant::now();
        let mut progress = |line: &str| println!("[{:7.2}s] {line}", start.elapsed().as_secs_f64());
        match kpin_images::ensure_linux_generic_612(&out_dir, &mut progress) {
            Ok(images) => println!(
                "generic 6.12 ready in {:.2}s: {images:#?}",
                start.elapsed().as_secs_f64()
            ),
            Err(err) => return report(&err),
        }
    }
    for kernel in kernels {
        let start = Instant::now();
        let mut progress = |line: &str| println!("[{:7.2}s] {line}", start.elapsed().as_secs_f64());
        match kpin_images::ensure_linux_kernel(kernel, &out_dir, &mut progress) {
            Ok(images) => println!(
                "linux ready in {:.2}s: {images:#?}",
                start.elapsed().as_secs_f64()
            ),
            Err(err) => return report(&err),
        }
    }
    if minikernel {
        let start = Instant::now();
        let mut progress = |line: &str| println!("[{:7.2}s] {line}", start.elapsed().as_secs_f64());
        match kpin_images::ensure_minikernel(&out_dir, &mut progress) {
            Ok(elf) => println!(
                "mini-kernel ready in {:.2}s: {}",
                start.elapsed().as_secs_f64(),
                elf.display()
            ),
            Err(err) => return report(&err),
        }
    }
    println!(
        "default workload md5: {}",
        kpin_images::workload_expected_md5()
    );
    println!(
        "programs workload md5: {}",
        kpin_images::programs_workload_expected_md5()
    );
    ExitCode::SUCCESS
}

/// Prints `err` and its chain of causes.
fn report(err: &dyn std::error::Error) -> ExitCode {
    eprintln!("error: {err}");
    let mut source = err.source();
    while let Some(cause) = source {
        eprintln!("  caused by: {cause}");
        source = cause.source();
    }
    ExitCode::FAILURE
}
