//! `kpin tools` lists every registry tool with its summary and its options.

use std::process::Command;

use vmm::input_check::TOOLS;

#[test]
fn test_kpin_tools_lists_every_registry_tool_and_its_options() {
    let o = Command::new(env!("CARGO_BIN_EXE_kpin"))
        .arg("tools")
        .output()
        .expect("run kpin");
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for t in TOOLS {
        assert!(
            out.lines().any(|l| l == t.name),
            "no line naming {}:\n{out}",
            t.name
        );
        assert!(out.contains(t.summary), "{}'s summary:\n{out}", t.name);
        for opt in t.options {
            assert!(
                out.contains(&format!("      {}=", opt.key)),
                "{}:\n{out}",
                opt.key
            );
            assert!(out.contains(opt.help), "{}'s help:\n{out}", opt.key);
        }
    }
    assert!(
        out.contains("      L1D_size=SIZE\n          L1 data cache size [default: 32K]"),
        "{out}"
    );
    assert!(out.contains("      cpl=0|3|all\n"), "{out}");
    assert!(out.contains("bringup.crash"), "{out}");
}

/// The `--tool` help of `kpin run` and `kpin attach` names exactly the registry's tools
/// (it is generated from the registry, not written by hand).
#[test]
fn test_tool_help_names_every_registry_tool() {
    for cmd in ["run", "attach"] {
        let o = Command::new(env!("CARGO_BIN_EXE_kpin"))
            .args([cmd, "--help"])
            .output()
            .expect("run kpin");
        let out = String::from_utf8(o.stdout).unwrap();
        assert!(o.status.success(), "{cmd}: {out}");
        for t in TOOLS {
            assert!(
                out.contains(t.name),
                "kpin {cmd} --help lacks {}:\n{out}",
                t.name
            );
        }
    }
    let o = Command::new(env!("CARGO_BIN_EXE_kpin"))
        .args(["run", "--help"])
        .output()
        .expect("run kpin");
    let out = String::from_utf8(o.stdout).unwrap();
    for t in TOOLS {
        assert!(
            out.contains(&format!("{}: {}", t.name, t.summary)),
            "{}'s summary in kpin run --help:\n{out}",
            t.name
        );
    }
}

/// `kpin new-tool` writes a crate named after the tool into a new directory, and refuses
/// an existing directory (1) and a name kpin already has or cannot take (2).
#[test]
fn test_new_tool_writes_a_skeleton_and_refuses_what_it_cannot_write() {
    let dir = std::env::temp_dir().join(format!("kpin-new-tool-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let kpin = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kpin"))
            .arg("new-tool")
            .args(args)
            .output()
            .expect("run kpin")
    };
    let crate_dir = dir.join("mine");
    let o = kpin(&[crate_dir.to_str().unwrap(), "--name", "mine"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
    assert!(manifest.contains("name = \"kpin-tool-mine\""), "{manifest}");
    assert!(manifest.contains("tools/kpin-tool\""), "{manifest}");
    let lib = std::fs::read_to_string(crate_dir.join("src/lib.rs")).unwrap();
    assert!(
        lib.contains("name: \"mine\"") && lib.contains("\"mine.csv\""),
        "{lib}"
    );
    assert!(lib.contains("pub fn new_tool(options: &str)"), "{lib}");
    assert_eq!(
        kpin(&[crate_dir.to_str().unwrap(), "--name", "other"])
            .status
            .code(),
        Some(1)
    );
    for name in [TOOLS[0].name, "a b", ""] {
        let o = kpin(&[dir.join("x").to_str().unwrap(), "--name", name]);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{name:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
