//! The `prompt_hash` fuzz target without libFuzzer, for stable toolchains and CI:
//!
//! ```text
//! prompt_hash_stable [COUNT [SEED]]   # COUNT seeded random inputs (default 20000, seed 0)
//! prompt_hash_stable PATH...          # replay saved inputs, e.g. corpus/prompt_hash
//! ```
//!
//! A failing random input is written to `prompt_hash_stable-failure.bin`; a failing saved
//! input is named in the panic.

fn main() -> std::process::ExitCode {
    radixgate_fuzz::stable::main("prompt_hash", radixgate_fuzz::prompt_hash)
}
