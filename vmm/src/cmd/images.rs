//! `kpin images`: fetch and build the guest images and the engine image (cached), and
//! say where they are.

use std::path::PathBuf;

use crate::progress;

/// Builds (or finds) every image in `dir` (default: `images/out` in the source tree).
pub(crate) fn images(dir: Option<PathBuf>, generic_612: bool, debian: bool) -> anyhow::Result<()> {
    let dir = dir.unwrap_or_else(kpin_images::default_out_dir);
    let linux = kpin_images::ensure_linux(&dir, &mut progress)?;
    let mk = kpin_images::ensure_minikernel(&dir, &mut progress)?;
    let engine = kpin_images::ensure_engine(&dir, &mut progress)?;
    println!("kernel (bzImage): {}", linux.bzimage.display());
    println!("kernel (vmlinux): {}", linux.vmlinux.display());
    println!("System.map:       {}", linux.system_map.display());
    println!("config:           {}", linux.config.display());
    println!("initramfs:        {}", linux.initramfs.display());
    println!("mini-kernel:      {}", mk.display());
    println!("engine image:     {}", engine.display());
    if generic_612 {
        let generic = kpin_images::ensure_linux_generic_612(&dir, &mut progress)?;
        println!("generic 6.12:     {}", generic.vmlinux.display());
    }
    if debian {
        let image =
            kpin_images::ensure_debian(kpin_images::GuestKernel::Debian61, &dir, &mut progress)?;
        println!("Debian disk:      {}", image.disk.display());
        for kernel in kpin_images::GuestKernel::ALL {
            let initrd = image
                .initrd
                .with_file_name(format!("initrd.img-{}", kernel.release()));
            println!("Debian initrd:    {}", initrd.display());
        }
        println!("Debian md5:       {}", image.expected_md5);
    }
    Ok(())
}
