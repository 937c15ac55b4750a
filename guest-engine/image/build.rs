//! Link arguments for the engine image (see the mini-kernel's build.rs for why they are
//! given here rather than in `.cargo/config.toml`).

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo always sets CARGO_MANIFEST_DIR");
    // The linker script places the image at WINDOW_VA + ENGINE_OFFSET.
    println!("cargo:rustc-link-arg-bins=-T{dir}/link.ld");
    // A plain ET_EXEC at the script's fixed addresses: nobody applies relocations.
    println!("cargo:rustc-link-arg-bins=--no-pie");
    println!("cargo:rustc-link-arg-bins=-zmax-page-size=4096");
    println!("cargo:rerun-if-changed=link.ld");
    println!("cargo:rerun-if-changed=build.rs");
}
