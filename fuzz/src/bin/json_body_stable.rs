//! The `json_body` fuzz target without libFuzzer, for stable toolchains and CI:
//!
//! ```text
//! json_body_stable [COUNT [SEED]]   # COUNT seeded random inputs (default 20000, seed 0)
//! json_body_stable PATH...          # replay saved inputs, e.g. corpus/json_body
//! ```
//!
//! A failing random input is written to `json_body_stable-failure.bin`; a failing saved
//! input is named in the panic.

fn main() -> std::process::ExitCode {
    radixgate_fuzz::stable::main("json_body", radixgate_fuzz::json_body)
}
