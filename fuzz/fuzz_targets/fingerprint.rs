//! `Fingerprint::of_request` on arbitrary requests: never panics, is the fingerprint as first
//! specified (SHA-256 over the method, the path and the body as a `serde_json::Value` writes it with
//! its keys sorted, or the bytes; stored records carry it, so it must never change), and a JSON body
//! re-serialised with every object's keys in another order and other whitespace keeps its
//! fingerprint (a client that re-encodes its payload on retry must not be told it sent a different
//! request).
#![no_main]

use idem_runtime::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sha2::{Digest, Sha256};

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
    let parsed = serde_json::from_slice::<Value>(body).ok().filter(|_| as_json);
    assert_eq!(
        original,
        reference(&path, parsed.as_ref(), body),
        "not the specified fingerprint"
    );
    let Some(value) = parsed else {
        return;
    };
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

/// The fingerprint as specified, from the `Value` a JSON body parses to, or from the body's bytes.
/// `Value`'s map is ordered by key (serde_json's `preserve_order` feature is off here), so it writes
/// the canonical form.
fn reference(path: &str, json: Option<&Value>, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"POST\0");
    h.update(path.as_bytes());
    h.update([0]);
    match json {
        Some(value) => {
            h.update(b"json\0");
            h.update(serde_json::to_vec(value).expect("a Value serialises"));
        }
        None => {
            h.update(b"bytes\0");
            h.update(body);
        }
    }
    Fingerprint(h.finalize().into())
}

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
