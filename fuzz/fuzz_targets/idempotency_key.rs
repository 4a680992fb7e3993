//! `IdempotencyKey::parse` on arbitrary header bytes: never panics; what it accepts is 1 to 255
//! visible ASCII characters, parses again to itself, and its quoted (structured-field) form names the
//! same key.
#![no_main]

use idem_runtime::key::MAX_KEY_LEN;
use idem_runtime::IdempotencyKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = IdempotencyKey::parse(data) else {
        return;
    };
    let s = key.as_str();
    assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN, "{s:?}");
    assert!(s.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{s:?}");
    let bare = IdempotencyKey::parse(s.as_bytes());
    // A bare key that itself starts with a quote is read as a quoted form, and one with a comma is
    // refused (two merged keys): only keys without either must parse back bare.
    if !s.starts_with('"') && !s.contains(',') {
        assert_eq!(bare.as_ref(), Ok(&key), "bare form of {s:?}");
    }
    let mut quoted = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    assert_eq!(
        IdempotencyKey::parse(quoted.as_bytes()).as_ref(),
        Ok(&key),
        "quoted form {quoted:?}"
    );
});
