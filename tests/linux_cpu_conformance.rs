//! Issue #22's CPU-conformance corpus, with the host CPU as the reference.
//!
//! `kpin-conform` and `kpin-conform32` (`images/workloads/kpin-conform.c` and
//! `conform-*.c`, built 64- and 32-bit by kpin-images) print one line per case,
//! `KPIN-CONFORM <bits> <uid> <case> <outcome>`: system and sensitive instructions at
//! CPL 3, faults, undefined opcodes, flags, segments and far transfers, the debug
//! architecture, port I/O with permission. The same static binaries run natively on the
//! host, as root and as uid 65534, and in the Linux guest under kpin (`kpin.workload=conform`,
//! which runs them the same four ways) with `--tool null` and with `--tool memtrace`; the
//! guest's lines must be the host's, line for line, and the run must power off cleanly.
//!
//! The reference is the host, except where the host cannot give it: [`QEMU_REFERENCE`]
//! (the host kernel differs from the guest's, so QEMU TCG booting the guest's own kernel
//! and initramfs answers; CPUID fields are not compared there, QEMU's CPU model being its
//! own) and [`ARCHITECTURAL`] (this host's hypervisor answers differently from the
//! architecture). Differences are allowed only through [`ALLOWED`], each with its reason:
//! a deliberate CPU-model difference (the guest's CPU model lacks a CPUID feature: the
//! line's `cpuid.<feature>=` field differs, and the guest's outcome is what a CPU without
//! it gives), or a known engine gap. A gap entry whose cases all match now fails the test,
//! so the list stays honest; gaps that end or hang the run are skipped in the main runs
//! and probed together in one run of their own, which must still fail. The lists are in
//! `tests/cpu_conformance_lists.rs`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

use kpin_tests::{kpin_bin, noticed_the_engine, qemu_linux, require_kvm, scratch_dir};

mod cpu_conformance_lists;
use cpu_conformance_lists::{Kind, ALLOWED, ARCHITECTURAL, QEMU_REFERENCE};

/// Seconds kpin may run the guest (the corpus takes ~15 s under the engine here).
const BUDGET_SECONDS: &str = "600";
/// Seconds the run of the cases that end or hang the run may take.
const PROBE_SECONDS: &str = "120";
/// Prefix of the corpus' lines.
const PREFIX: &str = "KPIN-CONFORM ";
/// The unprivileged uid every case also runs as.
const NOBODY: &str = "65534";
/// Records memtrace writes at most (it still instruments every access past them).
const MEMTRACE_LIMIT: &str = "limit=1000000";

/// `<bits> <uid> <case>`.
type Key = (String, String, String);
/// Outcome by key.
type Lines = BTreeMap<Key, String>;

/// The corpus' lines in `text`; panics on a malformed or repeated line.
fn parse_lines(text: &str, origin: &str) -> Lines {
    let mut lines = Lines::new();
    for line in text.lines().map(|l| l.trim_end_matches('\r')) {
        let Some(rest) = line.strip_prefix(PREFIX) else {
            continue;
        };
        let mut f = rest.splitn(4, ' ');
        let (Some(bits), Some(uid), Some(case)) = (f.next(), f.next(), f.next()) else {
            panic!("{origin}: malformed line `{line}`");
        };
        let key = (bits.to_owned(), uid.to_owned(), case.to_owned());
        let outcome = f.next().unwrap_or("").to_owned();
        if lines.insert(key, outcome).is_some() {
            panic!("{origin}: repeated line for `{bits} {uid} {case}`");
        }
    }
    lines
}

/// Whether `text` matches `pattern`: `*` any run of characters, `?` one character.
fn glob(pattern: &str, text: &str) -> bool {
    fn bytes(p: &[u8], t: &[u8]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some((b'*', rest)) => (0..=t.len()).any(|i| bytes(rest, &t[i..])),
            Some((b'?', rest)) => !t.is_empty() && bytes(rest, &t[1..]),
            Some((c, rest)) => t.first() == Some(c) && bytes(rest, &t[1..]),
        }
    }
    bytes(pattern.as_bytes(), text.as_bytes())
}

/// Whether a `<bits> <case>[|<case>...]` pattern covers `key` (any uid).
fn covers(pattern: &str, key: &Key) -> bool {
    let (bits, cases) = pattern.split_once(' ').expect("pattern is `<bits> <case>`");
    glob(bits, &key.0) && cases.split('|').any(|case| glob(case, &key.2))
}

/// The outcome without its `cpuid.<feature>=<bit>` fields.
fn without_cpuid(outcome: &str) -> String {
    outcome
        .split(' ')
        .filter(|w| !w.starts_with("cpuid."))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The outcome from its verdict on (`ok`, `sig`, ...), after the `name=value` fields.
fn verdict(outcome: &str) -> String {
    outcome
        .split(' ')
        .skip_while(|w| w.contains('='))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The value of field `cpuid.<feature>=` in `outcome`.
fn cpuid_field<'a>(outcome: &'a str, feature: &str) -> Option<&'a str> {
    let name = format!("cpuid.{feature}=");
    outcome
        .split(' ')
        .find_map(|w| w.strip_prefix(name.as_str()))
}

/// The host's lines, the QEMU reference lines (if QEMU is installed), and the programs.
struct References {
    host: Lines,
    qemu: Option<Lines>,
}

fn check_output(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: {:?}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs both builds natively, as root and as 65534 (the tests run as root).
fn host_lines(bin64: &Path, bin32: &Path) -> Lines {
    let mut text = String::new();
    for bin in [bin64, bin32] {
        for uid in [None, Some(NOBODY)] {
            let mut cmd = Command::new(bin);
            if let Some(uid) = uid {
                cmd.args(["--uid", uid]);
            }
            let out = cmd
                .output()
                .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
            text.push_str(&check_output(
                &format!("{} (uid {uid:?})", bin.display()),
                &out,
            ));
        }
    }
    parse_lines(&text, "host")
}

/// The case names the patterns of `QEMU_REFERENCE` cover among `host`'s keys.
fn qemu_cases(host: &Lines) -> Vec<String> {
    let mut cases: Vec<String> = host
        .keys()
        .filter(|k| QEMU_REFERENCE.iter().any(|(p, _)| covers(p, k)))
        .map(|k| k.2.clone())
        .collect();
    cases.sort();
    cases.dedup();
    cases
}

/// QEMU TCG boots the guest's bzImage and initramfs and runs the corpus' `cases`.
fn qemu_lines(cases: &[String]) -> Option<Lines> {
    let output = qemu_linux(
        &format!(
            "kpin.workload=conform kpin.conform.cases={}",
            cases.join(",")
        ),
        BUDGET_SECONDS,
        ": the QEMU-referenced cases are not compared",
    )?;
    let console = String::from_utf8_lossy(&output.stdout);
    let context = format!("QEMU: {:?}\n{console}", output.status);
    assert!(output.status.success(), "{context}");
    Some(console_lines(&console, "QEMU", &context))
}

/// The corpus' lines on a guest's console, checked against the md5 the guest printed
/// after them (`KPIN-WORKLOAD-DONE`): every line arrived whole.
fn console_lines(console: &str, origin: &str, context: &str) -> Lines {
    let text: String = console
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| l.starts_with(PREFIX))
        .map(|l| format!("{l}\n"))
        .collect();
    let done = console
        .lines()
        .find_map(|l| l.trim_end_matches('\r').strip_prefix("KPIN-WORKLOAD-DONE "))
        .unwrap_or_else(|| panic!("{origin}: no KPIN-WORKLOAD-DONE line\n{context}"));
    assert_eq!(
        done,
        kpin_images::md5_hex(text.as_bytes()),
        "{origin}: the console's lines are not the ones the guest hashed\n{context}"
    );
    parse_lines(&text, origin)
}

/// The references, computed once for both tests.
fn references() -> &'static References {
    static REFS: OnceLock<References> = OnceLock::new();
    REFS.get_or_init(|| {
        let out = kpin_images::default_out_dir();
        // A missing gcc-multilib fails here, naming the package (.ci/setup installs it).
        let programs =
            kpin_images::ensure_conform_programs(&out, &mut |l| eprintln!("images: {l}"))
                .unwrap_or_else(|e| panic!("build the conformance corpus: {e} ({e:?})"));
        for bin in [&programs.bin64, &programs.bin32] {
            assert!(bin.is_file(), "{} is missing", bin.display());
        }
        let host = host_lines(&programs.bin64, &programs.bin32);
        let count = |bits: &str| host.keys().filter(|k| k.0 == bits && k.1 == "0").count();
        assert!(
            count("64") >= 110 && count("64") + count("32") >= 150,
            "the corpus is too small: {} 64-bit and {} 32-bit cases",
            count("64"),
            count("32")
        );
        let qemu = qemu_lines(&qemu_cases(&host));
        References { host, qemu }
    })
}

/// The case patterns (fnmatch, for `kpin.conform.skip=`) of the cases that end or hang
/// the run.
fn skip_words() -> Vec<&'static str> {
    ALLOWED
        .iter()
        .filter(|a| matches!(a.kind, Kind::EngineGap { stops_run: true }))
        .flat_map(|a| a.cases.split_once(' ').expect("pattern").1.split('|'))
        .collect()
}

/// Runs the conform workload under `tool` with the extra `append` words.
fn run_kpin(dir: &Path, tool: &str, append: &str, budget: &str) -> (Output, String, String) {
    let bin = kpin_bin();
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build --release -p vmm --bin kpin`",
        bin.display()
    );
    let mut cmd = Command::new(&bin);
    cmd.args(["run", "--guest", "linux", "--tool", tool])
        .args(["--append", &format!("kpin.workload=conform {append}")])
        .args(["--quiet", "--timeout", budget])
        .arg("--out")
        .arg(dir);
    if tool == "memtrace" {
        cmd.args(["--tool-option", MEMTRACE_LIMIT]);
    }
    let output = cmd.output().expect("run kpin");
    let console = std::fs::read_to_string(dir.join("console.log")).unwrap_or_default();
    let engine_log = std::fs::read_to_string(dir.join("engine.log")).unwrap_or_default();
    let _ = std::fs::remove_file(dir.join("memtrace.bin"));
    (output, console, engine_log)
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One comparison's tally.
#[derive(Default)]
struct Tally {
    identical: usize,
    /// Per ALLOWED entry: differences it explained, and its cases that now match.
    explained: BTreeMap<usize, (usize, usize)>,
    skipped: BTreeMap<usize, usize>,
    not_compared: usize,
    unexplained: Vec<String>,
}

fn describe(key: &Key) -> String {
    format!("{} {} {}", key.0, key.1, key.2)
}

/// Compares the guest's lines with the references.
fn compare(refs: &References, guest: &Lines) -> Tally {
    let mut t = Tally::default();
    let mut keys: Vec<&Key> = refs.host.keys().chain(guest.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let gap_index = ALLOWED.iter().position(|a| covers(a.cases, key));
        if let Some(i) = gap_index {
            if matches!(ALLOWED[i].kind, Kind::EngineGap { stops_run: true }) {
                *t.skipped.entry(i).or_default() += 1;
                continue;
            }
        }
        // The reference outcome, and whether CPUID fields take part.
        let (reference, origin, with_cpuid) =
            if let Some((_, o, _)) = ARCHITECTURAL.iter().find(|(p, _, _)| covers(p, key)) {
                (Some((*o).to_owned()), "architecture", true)
            } else if QEMU_REFERENCE.iter().any(|(p, _)| covers(p, key)) {
                match &refs.qemu {
                    Some(q) => (q.get(key).cloned(), "QEMU", false),
                    None => {
                        t.not_compared += 1;
                        continue;
                    }
                }
            } else {
                (refs.host.get(key).cloned(), "host", true)
            };
        let got = guest.get(key).cloned();
        let norm = |o: &Option<String>| {
            o.as_ref().map(|s| {
                if with_cpuid {
                    s.clone()
                } else {
                    without_cpuid(s)
                }
            })
        };
        if norm(&reference) == norm(&got) {
            t.identical += 1;
            if let Some(i) = gap_index {
                t.explained.entry(i).or_default().1 += 1;
            }
            continue;
        }
        let allowed = gap_index.filter(|&i| match &ALLOWED[i].kind {
            Kind::EngineGap { .. } => true,
            Kind::CpuModel { feature, guest } => {
                let (Some(r), Some(g)) = (&reference, &got) else {
                    return false;
                };
                (without_cpuid(g).starts_with(guest) || verdict(g).starts_with(guest))
                    && feature.is_none_or(|f| cpuid_field(r, f) != cpuid_field(g, f))
            }
        });
        match allowed {
            Some(i) => t.explained.entry(i).or_default().0 += 1,
            None => t.unexplained.push(format!(
                "{}\n    {origin}: {}\n    guest: {}",
                describe(key),
                reference.as_deref().unwrap_or("(no line)"),
                got.as_deref().unwrap_or("(no line)")
            )),
        }
    }
    t
}

/// Boots the corpus under `tool` and compares it with the references.
fn conformance_under(tool: &str) {
    let refs = references();
    let dir = scratch_dir(&format!("linux-cpu-conformance-{tool}"));
    let out = dir.join("out");
    let skip = skip_words().join(",");
    let (output, console, engine_log) = run_kpin(
        &out,
        tool,
        &format!("kpin.conform.skip={skip}"),
        BUDGET_SECONDS,
    );
    let context = format!(
        "kpin --tool {tool}: {:?}\nstderr (tail):\n{}\nconsole (tail):\n{}\nengine.log (tail):\n{}",
        output.status,
        tail(&String::from_utf8_lossy(&output.stderr), 20),
        tail(&console, 30),
        tail(&engine_log, 60)
    );
    match output.status.code() {
        Some(0) => {}
        Some(3) => panic!("an instruction ended the run (exit status 3)\n{context}"),
        Some(4) => panic!("the run timed out (exit status 4): a case hangs the guest\n{context}"),
        _ => panic!("the run did not power off cleanly\n{context}"),
    }
    if let Some(line) = noticed_the_engine(&console) {
        panic!("`{line}` on the console\n{context}");
    }
    let guest = console_lines(&console, "guest", &context);
    let t = compare(refs, &guest);

    // The summary.
    let total =
        t.identical + t.explained.values().map(|e| e.0).sum::<usize>() + t.unexplained.len();
    println!(
        "--tool {tool}: {total} lines compared, {} identical, {} allowed differences, {} \
         unexplained, {} skipped (they end the run), {} not compared (no QEMU)",
        t.identical,
        t.explained.values().map(|e| e.0).sum::<usize>(),
        t.unexplained.len(),
        t.skipped.values().sum::<usize>(),
        t.not_compared
    );
    for (i, (n, now_same)) in &t.explained {
        if *n > 0 {
            let a = &ALLOWED[*i];
            let kind = match a.kind {
                Kind::CpuModel { .. } => "CPU model",
                Kind::EngineGap { .. } => "engine gap",
            };
            let note = if *now_same > 0 {
                format!(" ({now_same} of its lines already match)")
            } else {
                String::new()
            };
            println!("  {n:4} {kind}: {}: {}{note}", a.cases, a.why);
        }
    }
    for (i, n) in &t.skipped {
        println!(
            "  {n:4} skipped: {}: {}",
            ALLOWED[*i].cases, ALLOWED[*i].why
        );
    }

    // The list stays honest: every gap entry still explains a difference, every entry
    // covers a case.
    let mut stale = Vec::new();
    for (i, a) in ALLOWED.iter().enumerate() {
        let covered = refs
            .host
            .keys()
            .chain(guest.keys())
            .any(|k| covers(a.cases, k));
        if !covered {
            stale.push(format!("`{}` covers no case", a.cases));
        } else if matches!(a.kind, Kind::EngineGap { stops_run: false })
            && t.explained.get(&i).is_none_or(|e| e.0 == 0)
        {
            stale.push(format!(
                "`{}` matches the reference now: remove it from ALLOWED ({})",
                a.cases, a.why
            ));
        }
    }
    assert!(
        t.unexplained.is_empty() && stale.is_empty(),
        "--tool {tool}: {} lines differ from the reference without an ALLOWED entry:\n{}\n\
         stale ALLOWED entries:\n{}",
        t.unexplained.len(),
        t.unexplained.join("\n"),
        stale.join("\n")
    );
}

#[test]
fn test_corpus_gives_the_host_cpus_outcomes_under_tool_null() {
    require_kvm!();
    conformance_under("null");
}

#[test]
fn test_corpus_gives_the_host_cpus_outcomes_under_tool_memtrace() {
    require_kvm!();
    conformance_under("memtrace");
}

/// The cases listed as ending or hanging the run still do: run together, they must not
/// let the guest power off cleanly (when they do, their entries must lose `stops_run`).
#[test]
fn test_cases_listed_as_ending_the_run_still_do() {
    require_kvm!();
    let cases = skip_words().join(",");
    if cases.is_empty() {
        return;
    }
    let dir = scratch_dir("linux-cpu-conformance-stops");
    let out = dir.join("out");
    let (output, console, engine_log) = run_kpin(
        &out,
        "null",
        &format!("kpin.conform.cases={cases}"),
        PROBE_SECONDS,
    );
    assert_ne!(
        output.status.code(),
        Some(0),
        "the cases {cases} no longer end or hang the run: drop `stops_run` from their ALLOWED \
         entries\nconsole (tail):\n{}\nengine.log (tail):\n{}",
        tail(&console, 30),
        tail(&engine_log, 30)
    );
}

#[test]
fn test_patterns_and_fields() {
    let key = |b: &str, c: &str| (b.to_owned(), "0".to_owned(), c.to_owned());
    assert!(covers("* far-*", &key("64", "far-jmp-null")));
    assert!(!covers("32 far-*", &key("64", "far-jmp-null")));
    assert!(covers("64 rd?sbase", &key("64", "rdgsbase")));
    assert!(!covers("64 rd?sbase", &key("64", "rdgsbasex")));
    assert!(covers("32 daa|das", &key("32", "das")));
    assert!(!covers("32 daa|das", &key("32", "dasx")));
    assert!(glob("a*c*e", "abcde") && !glob("a*c", "abcd") && glob("*", ""));
    assert!(skip_words().iter().all(|w| !w.contains(['|', ' ', ','])));
    assert_eq!(without_cpuid("cpuid.svm=1 sig SIGILL"), "sig SIGILL");
    assert_eq!(
        verdict("cpuid.a=0 prctl=0 sig SIGILL code=2"),
        "sig SIGILL code=2"
    );
    assert_eq!(cpuid_field("cpuid.a=1 cpuid.b=0 ok", "b"), Some("0"));
    let lines = parse_lines("x\nKPIN-CONFORM 64 0 hlt sig SIGSEGV code=128\r\n", "t");
    assert_eq!(lines[&key("64", "hlt")], "sig SIGSEGV code=128");
}

/// The QEMU and architectural references and the allowed list are consistent: no pattern
/// is in two of them, every pattern has a bits part.
#[test]
fn test_reference_lists_are_well_formed() {
    let mut all: Vec<&str> = QEMU_REFERENCE.iter().map(|(p, _)| *p).collect();
    all.extend(ARCHITECTURAL.iter().map(|(p, _, _)| *p));
    all.extend(ALLOWED.iter().map(|a| a.cases));
    for p in &all {
        let (bits, case) = p
            .split_once(' ')
            .unwrap_or_else(|| panic!("`{p}`: no bits part"));
        assert!(["*", "64", "32"].contains(&bits), "`{p}`");
        assert!(!case.is_empty(), "`{p}`");
    }
}
