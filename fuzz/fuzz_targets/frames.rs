#![no_main]

#[path = "../wire.rs"]
mod wire;

#[global_allocator]
static ALLOC: wire::Counting = wire::Counting;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    wire::frames(data);
});
