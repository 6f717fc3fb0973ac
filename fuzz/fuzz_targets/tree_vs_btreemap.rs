#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    arbor_engine::fuzzing::tree_vs_btreemap(data);
});
