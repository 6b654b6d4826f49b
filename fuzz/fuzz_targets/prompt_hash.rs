//! libFuzzer target: see `radixgate_fuzz::prompt_hash` for what it checks.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| radixgate_fuzz::prompt_hash(data));
