//! The `Idempotency-Key` schema in the OpenAPI document admits exactly the values idem accepts: its
//! pattern and `maxLength` against `IdempotencyKey::parse`, on every short value over the
//! characters that matter and on generated long ones, bare and quoted.

use idem_runtime::openapi::{KEY_MAX_LENGTH, KEY_PATTERN};
use idem_runtime::IdempotencyKey;
use proptest::prelude::*;
use std::sync::LazyLock;

static PATTERN: LazyLock<regex::Regex> =
    LazyLock::new(|| regex::Regex::new(KEY_PATTERN).expect("the key pattern compiles"));

/// Whether the schema (`type: string`, `minLength: 1`, `maxLength`, `pattern`) admits `value`.
fn schema_admits(value: &str) -> bool {
    let chars = value.chars().count();
    (1..=KEY_MAX_LENGTH).contains(&chars) && PATTERN.is_match(value)
}

fn parser_accepts(value: &str) -> bool {
    IdempotencyKey::parse(value.as_bytes()).is_ok()
}

/// A header's value never starts or ends with spaces (HTTP strips them), so the schema need not
/// describe what the parser's trimming makes of them.
fn is_a_header_value(value: &str) -> bool {
    !value.starts_with([' ', '\t']) && !value.ends_with([' ', '\t'])
}

#[test]
fn the_schema_and_the_parser_agree_on_every_short_value() {
    // The characters the grammar treats apart, and one from each plain class.
    let alphabet = ['a', '~', '!', '"', '\\', ',', ' ', '\t', '\u{7f}', 'é'];
    let mut values = vec![String::new()];
    let mut checked = 0;
    for _ in 0..5 {
        values = values
            .iter()
            .flat_map(|v| alphabet.iter().map(move |c| format!("{v}{c}")))
            .collect();
        for value in values.iter().filter(|v| is_a_header_value(v)) {
            assert_eq!(
                schema_admits(value),
                parser_accepts(value),
                "{value:?}: schema and parser disagree"
            );
            checked += 1;
        }
    }
    assert!(checked > 50_000, "{checked}");
}

#[test]
fn known_values() {
    let too_long = "k".repeat(256);
    let longest = "k".repeat(255);
    let longest_quoted = format!("\"{}\"", "\\\\".repeat(255));
    let cases: [(&str, bool); 14] = [
        ("order-42", true),
        ("\"order-42\"", true),
        ("a,b", false),
        ("\"a,b\"", true),
        ("\"\"", false),
        ("\"a b\"", false),
        ("a\"b", true),
        ("\"a\\\"b\"", true),
        ("\"a\\x\"", false),
        ("\"abc", false),
        (&longest, true),
        (&too_long, false),
        (&longest_quoted, true),
        ("clé", false),
    ];
    for (value, accepted) in cases {
        assert_eq!(parser_accepts(value), accepted, "{value:?} by the parser");
        assert_eq!(schema_admits(value), accepted, "{value:?} by the schema");
    }
    assert_eq!(longest_quoted.len(), KEY_MAX_LENGTH);
}

/// Values of every length around the bounds: bare, quoted, quoted with escapes, with a stray
/// character from the ones that matter.
fn long_values() -> impl Strategy<Value = String> {
    let plain = "[!#-+\\--~]";
    let stray = prop::sample::select(vec!['"', '\\', ',', ' ', '\u{7f}', 'a']);
    let body = prop_oneof![
        prop::string::string_regex(&format!("{plain}{{240,260}}")).expect("regex"),
        prop::string::string_regex(&format!("\"({plain}|\\\\[\"\\\\]){{240,260}}\""))
            .expect("regex"),
    ];
    (body, stray, any::<prop::sample::Index>(), any::<bool>()).prop_map(
        |(body, stray, at, insert)| {
            if !insert {
                return body;
            }
            let chars: Vec<char> = body.chars().collect();
            let at = at.index(chars.len() + 1);
            chars[..at]
                .iter()
                .chain([stray].iter())
                .chain(&chars[at..])
                .collect()
        },
    )
}

proptest! {
    #[test]
    fn the_schema_and_the_parser_agree_on_long_values(value in long_values()) {
        prop_assume!(is_a_header_value(&value));
        prop_assert_eq!(schema_admits(&value), parser_accepts(&value), "{:?}", value);
    }
}
