//! Profiles in the formats people already read them with (feature `host`): the Cachegrind
//! output format ([`Profile`], for `cg_annotate` and KCachegrind), folded stacks
//! ([`Folded`], Brendan Gregg's `stack;frames count` lines) and a flame graph SVG drawn
//! from them with `inferno`. A tool's report fills them with names it found (the kernel's
//! symbols, the guest's ELF files) and counts it kept; nothing here reads guest data.

extern crate std;

use alloc::collections::BTreeMap;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;
use std::io;

/// A name as a line of either format takes it: control characters (a newline would end
/// the line) as `?`. The names come from the guest (a file path, a symbol).
fn line_safe(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// A name as a frame of a folded stack: as [`line_safe`], and `;` (which would split
/// the frame) as `:`.
pub fn frame_safe(name: &str) -> String {
    line_safe(name).replace(';', ":")
}

/// Counts per object (`fl=`) and function (`fn=`) for a Cachegrind file: one count per
/// event, in the order of [`Profile::events`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    /// The event names (`Ir`, `I1mr`, …), as the `events:` line lists them.
    pub events: Vec<String>,
    /// Per object, then function: the counts.
    pub functions: BTreeMap<String, BTreeMap<String, Vec<u64>>>,
}

impl Profile {
    /// An empty profile of `events` (names without spaces, e.g. Cachegrind's `Ir I1mr
    /// ILmr Dr D1mr DLmr Dw D1mw DLmw`).
    pub fn new(events: &[&str]) -> Self {
        Profile {
            events: events.iter().map(|e| String::from(*e)).collect(),
            functions: BTreeMap::new(),
        }
    }

    /// Adds `counts` (one per event; missing ones are 0, extra ones ignored) to
    /// `function` of `object`.
    pub fn add(&mut self, object: &str, function: &str, counts: &[u64]) {
        let n = self.events.len();
        let row = self
            .functions
            .entry(line_safe(object))
            .or_default()
            .entry(line_safe(function))
            .or_insert_with(|| vec![0; n]);
        for (total, c) in row.iter_mut().zip(counts) {
            *total += c;
        }
    }

    /// The sum of every function's counts, per event (the `summary:` line).
    pub fn totals(&self) -> Vec<u64> {
        let mut t = vec![0; self.events.len()];
        for row in self.functions.values().flat_map(|f| f.values()) {
            for (total, c) in t.iter_mut().zip(row) {
                *total += c;
            }
        }
        t
    }

    /// Writes the Cachegrind output format: the `desc:` lines (e.g. the caches'
    /// geometries), `cmd:`, `events:`, then per object `fl=` and per function `fn=` with
    /// one line `0 COUNTS` (line 0: no line information), and `summary:` with the totals.
    pub fn write_cachegrind(
        &self,
        out: &mut dyn io::Write,
        desc: &[String],
        cmd: &str,
    ) -> io::Result<()> {
        for d in desc {
            writeln!(out, "desc: {}", line_safe(d))?;
        }
        writeln!(out, "cmd: {}", line_safe(cmd))?;
        writeln!(out, "events: {}", self.events.join(" "))?;
        let counts = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ");
        for (object, functions) in &self.functions {
            writeln!(out, "fl={object}")?;
            for (function, row) in functions {
                writeln!(out, "fn={function}")?;
                writeln!(out, "0 {}", counts(row))?;
            }
        }
        writeln!(out, "summary: {}", counts(&self.totals()))
    }
}

/// Folded stacks: `frame;frame;frame count` lines, the input of `flamegraph.pl` and
/// `inferno-flamegraph`, the outermost frame first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Folded {
    /// Per stack (frames joined by `;`): its count.
    pub stacks: BTreeMap<String, u64>,
}

impl Folded {
    /// Adds `count` to the stack of `frames` (outermost first). A frame's `;` becomes `:`
    /// (it would split the frame) and control characters `?`; a count of 0 adds nothing.
    pub fn add(&mut self, frames: &[&str], count: u64) {
        if count == 0 {
            return;
        }
        let stack = frames
            .iter()
            .map(|f| frame_safe(f))
            .collect::<Vec<_>>()
            .join(";");
        *self.stacks.entry(stack).or_default() += count;
    }

    /// [`Folded::add`] for a stack already joined from [`frame_safe`] frames (a report
    /// that shares the frames of many stacks joins them once).
    pub fn add_joined(&mut self, stack: &str, count: u64) {
        if count == 0 {
            return;
        }
        match self.stacks.get_mut(stack) {
            Some(n) => *n += count,
            None => {
                self.stacks.insert(String::from(stack), count);
            }
        }
    }

    /// The sum of the counts (the flame graph's root).
    pub fn total(&self) -> u64 {
        self.stacks.values().sum()
    }

    /// The lines, without their newlines.
    pub fn lines(&self) -> Vec<String> {
        self.stacks
            .iter()
            .map(|(stack, n)| alloc::format!("{stack} {n}"))
            .collect()
    }

    /// Writes the lines.
    pub fn write(&self, out: &mut dyn io::Write) -> io::Result<()> {
        for line in self.lines() {
            writeln!(out, "{line}")?;
        }
        Ok(())
    }

    /// The flame graph of the stacks as SVG (inferno's `flamegraph`): `title` on top,
    /// widths in `count_name` (`instructions`, `L1D misses`). Colours hash the frame
    /// names, so the same function has the same colour in every run.
    pub fn flame_graph_svg(&self, title: &str, count_name: &str) -> io::Result<Vec<u8>> {
        let mut opt = inferno::flamegraph::Options::default();
        opt.title = String::from(title);
        opt.count_name = String::from(count_name);
        opt.hash = true;
        opt.deterministic = true;
        let lines = self.lines();
        let mut svg = Vec::new();
        inferno::flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), &mut svg)?;
        Ok(svg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        let mut p = Profile::new(&["Ir", "I1mr", "Dr"]);
        p.add("[kernel]", "do_syscall_64", &[10, 1, 4]);
        p.add("/bin/busybox", "sort_main", &[100, 2, 30]);
        p.add("/bin/busybox", "sort_main", &[5, 0, 1]);
        p.add("/bin/busybox", "bad\nname", &[1]);
        p
    }

    #[test]
    fn cachegrind_file_sums_functions_and_ends_with_the_totals() {
        let p = profile();
        assert_eq!(p.totals(), [116, 3, 35]);
        let mut out = Vec::new();
        p.write_cachegrind(&mut out, &[String::from("I1 cache: 32768 B")], "kpin run")
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "desc: I1 cache: 32768 B\ncmd: kpin run\nevents: Ir I1mr Dr\n\
             fl=/bin/busybox\nfn=bad?name\n0 1 0 0\nfn=sort_main\n0 105 2 31\n\
             fl=[kernel]\nfn=do_syscall_64\n0 10 1 4\nsummary: 116 3 35\n"
        );
    }

    #[test]
    fn folded_lines_keep_frames_apart_and_sum() {
        let mut f = Folded::default();
        f.add(&["sort", "/bin/busybox", "sort_main"], 7);
        f.add(&["sort", "[kernel]", "a;b"], 3);
        f.add(&["sort", "/bin/busybox", "sort_main"], 1);
        f.add(&["idle", "[kernel]", "x"], 0);
        assert_eq!(
            f.lines(),
            ["sort;/bin/busybox;sort_main 8", "sort;[kernel];a:b 3"]
        );
        assert_eq!(f.total(), 11);
    }

    #[test]
    fn flame_graph_root_is_the_folded_total() {
        let mut f = Folded::default();
        f.add(&["sort", "/bin/busybox", "sort_main"], 1_234_567);
        f.add(&["init", "[kernel]", "schedule"], 3);
        let svg = String::from_utf8(f.flame_graph_svg("t", "instructions").unwrap()).unwrap();
        assert!(svg.contains("total_samples=\"1234570\""), "{svg}");
        assert!(svg.contains("sort_main"));
        // The folded text goes through inferno's folded-to-folded collapse tool
        // (`collapse-recursive`) unchanged: no frame repeats its caller.
        use inferno::collapse::Collapse;
        let mut collapsed = Vec::new();
        let text = f.lines().join("\n") + "\n";
        inferno::collapse::recursive::Folder::default()
            .collapse(text.as_bytes(), &mut collapsed)
            .unwrap();
        let mut back: Vec<String> = String::from_utf8(collapsed)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        back.sort();
        assert_eq!(back, f.lines());
    }
}
