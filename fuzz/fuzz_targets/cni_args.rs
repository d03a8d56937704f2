//! Feeds arbitrary strings to the `CNI_ARGS` parser, which must never panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ipwarden::cni::args::parse_args(&String::from_utf8_lossy(data));
});
