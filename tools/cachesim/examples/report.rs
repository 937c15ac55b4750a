//! Re-makes `cachesim.txt`, `cachesim.json` and `cachesim-timeline.svg` from the files a
//! `--tool cachesim` run left in an output directory:
//! `cargo run --release -p kpin-tool-cachesim --features host --example report -- DIR`.

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: report OUTPUT-DIR");
        std::process::exit(2);
    };
    match kpin_tool_cachesim::report::write_reports(std::path::Path::new(&dir)) {
        Ok(Some((report, files))) => {
            print!("{}", report.text());
            for f in files {
                println!("wrote {}", f.display());
            }
        }
        Ok(None) => {
            eprintln!("no cachesim files in {}", dir.to_string_lossy());
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
