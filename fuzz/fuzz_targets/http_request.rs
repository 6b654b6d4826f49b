//! libFuzzer target: see `radixgate_fuzz::http_request` for what it checks.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| radixgate_fuzz::http_request(data));
