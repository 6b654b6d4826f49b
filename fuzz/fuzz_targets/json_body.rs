//! libFuzzer target: see `radixgate_fuzz::json_body` for what it checks.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| radixgate_fuzz::json_body(data));
