//! Fuzz target: `kvrelay_tests::fuzz::case_json` (see that module for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvrelay_tests::fuzz::case_json(data);
});
