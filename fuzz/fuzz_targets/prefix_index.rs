//! libFuzzer target: random operation sequences against the prefix index, checked
//! after every operation against the brute-force model (see `radixgate_fuzz`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| radixgate_fuzz::prefix_index(data));
