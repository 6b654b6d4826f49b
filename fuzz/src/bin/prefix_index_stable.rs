//! The `prefix_index` fuzz target without libFuzzer, for stable toolchains and CI:
//!
//! ```text
//! prefix_index_stable [COUNT [SEED]]   # COUNT seeded random inputs (default 20000, seed 0)
//! prefix_index_stable PATH...          # replay saved inputs (files, or every file in a dir)
//! ```
//!
//! A failing input panics with the op that broke agreement; random inputs are also
//! written to `prefix_index_stable-failure.bin` first so they can be replayed.

#![allow(
    clippy::disallowed_methods,
    reason = "a command-line runner, not a shard thread: blocking file reads are fine"
)]

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let numeric = args.iter().all(|a| a.parse::<u64>().is_ok());
    if !args.is_empty() && !numeric {
        let mut n = 0;
        for arg in &args {
            n += replay(Path::new(arg));
        }
        println!("prefix_index: {n} saved inputs ok");
        return ExitCode::SUCCESS;
    }
    let count = args.first().map_or(20_000, |a| a.parse().unwrap());
    let seed = args.get(1).map_or(0, |a| a.parse().unwrap());
    for input in radixgate_fuzz::random_inputs(seed, count) {
        let ok = std::panic::catch_unwind(|| radixgate_fuzz::prefix_index(&input));
        if ok.is_err() {
            let file = "prefix_index_stable-failure.bin";
            std::fs::write(file, &input).expect("write the failing input");
            eprintln!("failing input saved to {file}");
            return ExitCode::FAILURE;
        }
    }
    println!("prefix_index: {count} random inputs (seed {seed}) ok");
    ExitCode::SUCCESS
}

fn replay(path: &Path) -> usize {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .expect("read the corpus dir")
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        return entries.iter().map(|p| replay(p)).sum();
    }
    let input = std::fs::read(path).expect("read a saved input");
    radixgate_fuzz::prefix_index(&input);
    1
}
