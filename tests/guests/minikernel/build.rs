//! Link arguments for the mini-kernel.
//!
//! They are given here rather than in `.cargo/config.toml` because cargo reads config files
//! from the directory it is *run* in, and the kernel is normally built from the repository root
//! with `--manifest-path`.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo always sets CARGO_MANIFEST_DIR");
    // Our linker script places everything at physical 0x100000 (p_paddr = p_vaddr).
    println!("cargo:rustc-link-arg-bins=-T{dir}/link.ld");
    // The target defaults to a static PIE, whose RELATIVE relocations nobody would apply:
    // link a plain ET_EXEC at the script's fixed addresses instead (lld: last flag wins).
    println!("cargo:rustc-link-arg-bins=--no-pie");
    println!("cargo:rustc-link-arg-bins=-zmax-page-size=4096");
    println!("cargo:rerun-if-changed=link.ld");
    println!("cargo:rerun-if-changed=build.rs");
}
