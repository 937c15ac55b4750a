//! End-to-end: `ensure_linux_kernel` downloads the pinned packages of every kernel (≈660 MB
//! on a cold cache) and produces for each a kernel ELF, a full System.map and the initramfs
//! with `/init` and the test programs. Ignored by default because it needs apt and the
//! network; run it with
//! `cargo test -p kpin-images --test ensure_linux_produces_bootable_images -- --ignored`.

use std::fs;
use std::time::Instant;

use kpin_images::GuestKernel;

#[test]
#[ignore = "downloads ~660 MB with apt-get on a cold cache"]
fn test_ensure_linux_produces_bootable_images() {
    for kernel in GuestKernel::ALL {
        check_kernel(kernel);
    }
    // The default kernel is the first.
    let default = kpin_images::ensure_linux(&kpin_images::default_out_dir(), &mut |_| {})
        .expect("ensure_linux");
    assert_eq!(default.kernel, GuestKernel::Debian61);
}

fn check_kernel(kernel: GuestKernel) {
    let out_dir = kpin_images::default_out_dir();
    let start = Instant::now();
    let images = kpin_images::ensure_linux_kernel(kernel, &out_dir, &mut |line| println!("{line}"))
        .unwrap_or_else(|err| panic!("ensure_linux_kernel({kernel:?}): {err} ({err:?})"));
    assert_eq!(images.kernel, kernel);
    assert_eq!(images.kernel_version, kernel.release());
    println!("first call: {:.2}s", start.elapsed().as_secs_f64());

    let vmlinux = fs::read(&images.vmlinux).expect("read vmlinux");
    assert_eq!(&vmlinux[..5], b"\x7fELF\x02", "vmlinux is not ELF64");

    let bzimage = fs::read(&images.bzimage).expect("read bzImage");
    assert_eq!(&bzimage[0x202..0x206], b"HdrS");

    let map = fs::read_to_string(&images.system_map).expect("read System.map");
    assert!(map.lines().count() > 80_000, "System.map is too short");
    assert!(map.lines().any(|l| l.ends_with(" T start_kernel")));
    // The map describes this ELF: its entry point is `startup_64`'s address.
    let entry = u64::from_le_bytes(vmlinux[24..32].try_into().expect("8 bytes"));
    let startup_64 = map
        .lines()
        .find(|l| l.ends_with(" T startup_64"))
        .and_then(|l| u64::from_str_radix(&l[..16], 16).ok())
        .expect("startup_64 in the System.map");
    // e_entry is physical (the load address); startup_64's is virtual.
    assert_eq!(startup_64 & 0x3fff_ffff, entry & 0x3fff_ffff, "{kernel:?}");

    let config = fs::read_to_string(&images.config).expect("read config");
    assert!(config.contains("CONFIG_SERIAL_8250_CONSOLE=y"));

    let initramfs = fs::read(&images.initramfs).expect("read initramfs");
    assert!(initramfs.starts_with(b"070701"));
    assert!(
        initramfs.windows(5).any(|w| w == b"init\0"),
        "no /init entry"
    );
    for name in [
        "bin/kpin-test\0",
        "bin/kpin-conform\0",
        "bin/kpin-conform32\0",
    ] {
        assert!(
            initramfs.windows(name.len()).any(|w| w == name.as_bytes()),
            "no /{} entry",
            name.trim_end_matches('\0')
        );
    }

    // A warm call reports no download.
    let start = Instant::now();
    let mut lines = Vec::new();
    let again =
        kpin_images::ensure_linux_kernel(kernel, &out_dir, &mut |line| lines.push(line.to_owned()))
            .expect("second ensure_linux_kernel");
    println!("warm call: {:.2}s", start.elapsed().as_secs_f64());
    assert_eq!(again, images);
    assert!(
        lines.iter().all(|l| !l.starts_with("downloading")),
        "warm call downloaded: {lines:?}"
    );
}
