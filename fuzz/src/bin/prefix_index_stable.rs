//! The `prefix_index` fuzz target without libFuzzer, for stable toolchains and CI:
//!
//! ```text
//! prefix_index_stable [COUNT [SEED]]   # COUNT seeded random inputs (default 20000, seed 0)
//! prefix_index_stable PATH...          # replay saved inputs (files, or every file in a dir)
//! ```
//!
//! A failing input panics with the op that broke agreement; random inputs are also
//! written to `prefix_index_stable-failure.bin` first so they can be replayed.

fn main() -> std::process::ExitCode {
    radixgate_fuzz::stable::main("prefix_index", radixgate_fuzz::prefix_index)
}
