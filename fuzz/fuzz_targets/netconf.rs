//! Feeds arbitrary bytes to the network configuration parser, which must never panic.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ipwarden::cni::netconf::parse_netconf(data);
});
