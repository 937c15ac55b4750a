//! End-to-end: `ensure_linux` downloads the pinned packages (≈310 MB on a cold cache) and
//! produces a kernel ELF, a full System.map and an initramfs with `/init`. Ignored by default
//! because it needs apt and the network; run it with
//! `cargo test -p kpin-images --test ensure_linux_produces_bootable_images -- --ignored`.

use std::fs;
use std::time::Instant;

#[test]
#[ignore = "downloads ~310 MB with apt-get on a cold cache"]
fn test_ensure_linux_produces_bootable_images() {
    let out_dir = kpin_images::default_out_dir();
    let start = Instant::now();
    let images = kpin_images::ensure_linux(&out_dir, &mut |line| println!("{line}"))
        .unwrap_or_else(|err| panic!("ensure_linux: {err} ({err:?})"));
    println!("first call: {:.2}s", start.elapsed().as_secs_f64());

    let vmlinux = fs::read(&images.vmlinux).expect("read vmlinux");
    assert_eq!(&vmlinux[..5], b"\x7fELF\x02", "vmlinux is not ELF64");

    let bzimage = fs::read(&images.bzimage).expect("read bzImage");
    assert_eq!(&bzimage[0x202..0x206], b"HdrS");

    let map = fs::read_to_string(&images.system_map).expect("read System.map");
    assert!(map.lines().count() > 80_000, "System.map is too short");
    assert!(map.lines().any(|l| l.ends_with(" T start_kernel")));

    let config = fs::read_to_string(&images.config).expect("read config");
    assert!(config.contains("CONFIG_SERIAL_8250_CONSOLE=y"));

    let initramfs = fs::read(&images.initramfs).expect("read initramfs");
    assert!(initramfs.starts_with(b"070701"));
    assert!(
        initramfs.windows(5).any(|w| w == b"init\0"),
        "no /init entry"
    );

    // A warm call reports no download.
    let start = Instant::now();
    let mut lines = Vec::new();
    let again = kpin_images::ensure_linux(&out_dir, &mut |line| lines.push(line.to_owned()))
        .expect("second ensure_linux");
    println!("warm call: {:.2}s", start.elapsed().as_secs_f64());
    assert_eq!(again, images);
    assert!(
        lines.iter().all(|l| !l.starts_with("downloading")),
        "warm call downloaded: {lines:?}"
    );
}
