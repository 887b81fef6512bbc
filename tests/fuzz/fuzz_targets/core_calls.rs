//! Fuzz target: `kvrelay_runtime::fuzz::core_calls` (see that module for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvrelay_runtime::fuzz::core_calls(data);
});
