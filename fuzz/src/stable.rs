//! The fuzz targets without libFuzzer, for stable toolchains and CI: seeded random
//! inputs, or replays of saved ones ([`crate::replay`]). Each `*_stable` binary is
//! [`main`] for one target.

#![allow(
    clippy::disallowed_methods,
    reason = "command-line runners, not shard threads: blocking file writes are fine"
)]

use crate::replay::replay;
use std::path::Path;
use std::process::ExitCode;

/// `NAME_stable [COUNT [SEED]]`: COUNT seeded random inputs (default 20000, seed 0);
/// a failing one is saved to `NAME_stable-failure.bin`. `NAME_stable PATH...`:
/// replays saved inputs (files, or every file in a directory).
pub fn main(name: &str, check: fn(&[u8])) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let numeric = args.iter().all(|a| a.parse::<u64>().is_ok());
    if !args.is_empty() && !numeric {
        let n: usize = args.iter().map(|a| replay(Path::new(a), check)).sum();
        println!("{name}: {n} saved inputs ok");
        return ExitCode::SUCCESS;
    }
    let count = args.first().map_or(20_000, |a| a.parse().unwrap());
    let seed = args.get(1).map_or(0, |a| a.parse().unwrap());
    for input in crate::random_inputs(seed, count) {
        if std::panic::catch_unwind(|| check(&input)).is_err() {
            let file = format!("{name}_stable-failure.bin");
            std::fs::write(&file, &input).expect("write the failing input");
            eprintln!("failing input saved to {file}");
            return ExitCode::FAILURE;
        }
    }
    println!("{name}: {count} random inputs (seed {seed}) ok");
    ExitCode::SUCCESS
}
