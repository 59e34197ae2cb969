#![no_main]
//! Any bytes as the plugin configuration: refused with a reason, or accepted and usable.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match idemgate::config::Config::parse(data) {
        Ok(c) => {
            let _ = c.policy_for("POST", "/");
            for path in ["", "*", "//a/./b/../%70%2F?q#f", "/%", "/..%2e/.."] {
                let _ = c.policy_index_for_route("POST", path, Some("r"));
            }
            assert!(c.policies().next().is_some());
        }
        Err(e) => assert!(!e.reason.is_empty()),
    }
});
