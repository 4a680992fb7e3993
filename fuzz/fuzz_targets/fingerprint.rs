//! `Fingerprint::of_request` on arbitrary requests: never panics, and a JSON body re-serialised with
//! every object's keys in another order and other whitespace keeps its fingerprint (a client that
//! re-encodes its payload on retry must not be told it sent a different request).
#![no_main]

use idem_runtime::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const CONTENT_TYPES: [&str; 5] = [
    "application/json",
    "application/problem+json; charset=utf-8",
    "text/plain",
    "application/x-www-form-urlencoded",
    "APPLICATION/JSON",
];

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let content_type = CONTENT_TYPES[usize::from(selector) % CONTENT_TYPES.len()];
    let (path, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (
            String::from_utf8_lossy(&rest[..i]).into_owned(),
            &rest[i + 1..],
        ),
        None => ("/payments".to_owned(), rest),
    };
    let original = Fingerprint::of_request("POST", &path, Some(content_type), body);
    assert_eq!(
        original,
        Fingerprint::of_request("POST", &path, Some(content_type), body),
        "deterministic"
    );
    let as_json = content_type.to_ascii_lowercase().contains("json");
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if !as_json {
        return;
    }
    for (reverse, pretty) in [(true, false), (true, true), (false, true)] {
        let mut text = String::new();
        write(&value, reverse, pretty, 0, &mut text);
        let again = Fingerprint::of_request("POST", &path, Some(content_type), text.as_bytes());
        assert_eq!(
            original,
            again,
            "re-serialised JSON changed the fingerprint: {:?} vs {text:?}",
            String::from_utf8_lossy(body)
        );
    }
});

/// Writes `value` as JSON with object keys in reverse (or the parser's) order, compact or spread.
fn write(value: &Value, reverse: bool, pretty: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if pretty {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', depth * 2));
        }
    };
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            if reverse {
                entries.reverse();
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(if pretty { " : " } else { ":" });
                write(v, reverse, pretty, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, depth + 1);
                write(v, reverse, pretty, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}
