//! The `#[idempotent]` attribute's literal parsers (durations, dates, sizes, policy names) on
//! arbitrary text: never panic, and every "did you mean" suggestion is itself accepted.
//!
//! The parsers live in `idem-macros/src/values.rs`, a module with no dependencies; a proc-macro
//! crate exports nothing but macros, so the target compiles that same file into itself (one copy of
//! the code, nothing duplicated, nothing public added to the macro crate).
#![no_main]

#[allow(dead_code, unreachable_pub)]
#[path = "../../idem-macros/src/values.rs"]
mod values;

use libfuzzer_sys::fuzz_target;
use values::Bad;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for allow_ms in [false, true] {
        match values::parse_duration(text, allow_ms) {
            Ok(ms) => {
                let canonical = values::format_ms(ms);
                if allow_ms || ms % 1000 == 0 {
                    assert_eq!(
                        values::parse_duration(&canonical, allow_ms),
                        Ok(ms),
                        "{text:?} -> {canonical:?}"
                    );
                }
            }
            Err(Bad::DidYouMean(suggestion)) => {
                assert!(
                    values::parse_duration(&suggestion, allow_ms).is_ok(),
                    "{text:?} suggests {suggestion:?}, which is rejected"
                );
            }
            Err(_) => {}
        }
    }
    match values::parse_date(text) {
        Ok(ms) => assert!(ms >= 0, "{text:?} -> {ms}"),
        Err(Bad::DidYouMean(suggestion)) => {
            assert!(
                values::parse_date(&suggestion).is_ok(),
                "{text:?} suggests {suggestion:?}, which is rejected"
            );
        }
        Err(_) => {}
    }
    let _ = values::parse_size(text);
    for choices in [values::MISSING_KEY, values::REPLAY, values::SERVER_ERRORS] {
        if let Err(Some(suggestion)) = values::parse_choice(text, choices) {
            assert!(
                values::parse_choice(suggestion, choices).is_ok(),
                "{text:?} suggests {suggestion:?}, which is rejected"
            );
        }
    }
    let _ = values::closest(text, &["ttl", "lease", "wait", "retain", "missing_key"]);
});
