//! The `http_request` fuzz target without libFuzzer, for stable toolchains and CI:
//!
//! ```text
//! http_request_stable [COUNT [SEED]]   # COUNT seeded random inputs (default 20000, seed 0)
//! http_request_stable PATH...          # replay saved inputs, e.g. corpus/http_request
//! ```
//!
//! A failing random input is written to `http_request_stable-failure.bin`; a failing saved
//! input is named in the panic.

fn main() -> std::process::ExitCode {
    radixgate_fuzz::stable::main("http_request", radixgate_fuzz::http_request)
}
