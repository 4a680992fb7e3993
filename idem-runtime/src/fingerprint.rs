//! What makes two requests "the same request": the fingerprint.
//!
//! A fingerprint is SHA-256 over the method, the path (with its query) and the body. A JSON body
//! (`application/json` or any `+json` type) is hashed by meaning: object keys in sorted order and no
//! insignificant whitespace, so a client that re-serialises its payload on retry is not told that it
//! sent a different request. Numbers and strings are hashed as written after parsing (`1.0` and `1`
//! differ). Any other body, and a JSON body that does not parse, is hashed byte for byte.

pub use crate::coverage::Coverage;
use crate::source::KeySource;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::fmt;

/// SHA-256 of a request's method, path and canonical body.
///
/// ```
/// use idem_runtime::Fingerprint;
/// let a = Fingerprint::of_request("POST", "/payments", Some("application/json"), br#"{"amount":1000,"currency":"KRW"}"#);
/// let b = Fingerprint::of_request("POST", "/payments", Some("application/json"), b"{ \"currency\": \"KRW\", \"amount\": 1000 }");
/// assert_eq!(a, b);
/// let other_path = Fingerprint::of_request("POST", "/refunds", Some("application/json"), br#"{"amount":1000,"currency":"KRW"}"#);
/// assert_ne!(a, other_path);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Fingerprints a request. `content_type` decides whether the body is compared as JSON.
    pub fn of_request(method: &str, path: &str, content_type: Option<&str>, body: &[u8]) -> Self {
        Self::of_json(method, path, parse_json(content_type, body).as_ref(), body)
    }

    /// Fingerprints a request as a handler with this [`Coverage`] and [`KeySource`] sees it: a
    /// JSON body loses the excluded members (or keeps only the named ones), and never counts the
    /// member its key is read from. Any other body is compared whole, byte for byte.
    ///
    /// ```
    /// use idem_runtime::{fingerprint::Coverage, source::KeySource, Fingerprint};
    /// let cover = Coverage::Exclude(&["/sent_at"]);
    /// let of = |body: &str| Fingerprint::of_request_covering("POST", "/hooks", Some("application/json"),
    ///     body.as_bytes(), &cover, &KeySource::BodyField("/id"));
    /// assert_eq!(of(r#"{"id":"a","sent_at":1,"amount":5}"#), of(r#"{"id":"b","sent_at":2,"amount":5}"#));
    /// assert_ne!(of(r#"{"id":"a","sent_at":1,"amount":5}"#), of(r#"{"id":"a","sent_at":1,"amount":6}"#));
    /// ```
    pub fn of_request_covering(
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
        coverage: &Coverage,
        key: &KeySource,
    ) -> Self {
        let json = parse_json(content_type, body);
        Self::of_covered(method, path, json, body, coverage, key)
    }

    /// [`of_request_covering`](Self::of_request_covering) on a body parsed already (`None`: not
    /// JSON).
    pub(crate) fn of_covered(
        method: &str,
        path: &str,
        json: Option<Value>,
        body: &[u8],
        coverage: &Coverage,
        key: &KeySource,
    ) -> Self {
        let Some(mut value) = json else {
            return Self::of_json(method, path, None, body);
        };
        if let KeySource::BodyField(pointer) = key {
            crate::source::remove(&mut value, pointer);
        }
        match coverage {
            Coverage::Whole => Self::of_json(method, path, Some(&value), body),
            Coverage::Exclude(pointers) => {
                for pointer in *pointers {
                    crate::source::remove(&mut value, pointer);
                }
                Self::of_json(method, path, Some(&value), body)
            }
            Coverage::Only(pointers) => {
                // Each named member, or its absence, in the order the policy names them.
                let mut h = head(method, path);
                h.update(b"json-only\0");
                for pointer in *pointers {
                    write(&mut h, pointer);
                    match value.pointer(pointer) {
                        Some(member) => {
                            h.update(b"=");
                            canonical(&mut h, member);
                        }
                        None => h.update(b"-"),
                    }
                    h.update(b"\0");
                }
                Self(h.finalize().into())
            }
        }
    }

    /// Fingerprints a function's input ([`Engine::once`](crate::Engine::once)): its JSON form
    /// (serde), compared as JSON, so that member order and number formatting do not matter. Never
    /// equal to a request's fingerprint.
    ///
    /// ```
    /// use idem_runtime::Fingerprint;
    /// let a = Fingerprint::of_input(&serde_json::json!({"amount": 1000, "currency": "KRW"})).unwrap();
    /// let b = Fingerprint::of_input(&serde_json::json!({"currency": "KRW", "amount": 1000})).unwrap();
    /// assert_eq!(a, b);
    /// assert_ne!(a, Fingerprint::of_input(&("KRW", 1000)).unwrap());
    /// ```
    pub fn of_input<T: serde::Serialize + ?Sized>(input: &T) -> Result<Self, serde_json::Error> {
        // "function call" is no HTTP method (a method has no space), so no request hashes the same.
        let value = serde_json::to_value(input)?;
        Ok(Self::of_json("function call", "", Some(&value), &[]))
    }

    fn of_json(method: &str, path: &str, json: Option<&Value>, body: &[u8]) -> Self {
        let mut h = head(method, path);
        match json {
            Some(value) => {
                h.update(b"json\0");
                canonical(&mut h, value);
            }
            None => {
                h.update(b"bytes\0");
                h.update(body);
            }
        }
        Self(h.finalize().into())
    }

    /// Lower-case hex, as stored by the SQL stores and shown in logs.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(DIGITS[usize::from(b >> 4)] as char);
            s.push(DIGITS[usize::from(b & 0xf)] as char);
        }
        s
    }

    /// Parses [`to_hex`](Self::to_hex) output.
    pub fn from_hex(s: &str) -> Option<Self> {
        let bytes = s.as_bytes();
        if bytes.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = u8::try_from(hi * 16 + lo).ok()?;
        }
        Some(Self(out))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..12])
    }
}

/// The hash so far of the method and the path.
fn head(method: &str, path: &str) -> Sha256 {
    let mut h = Sha256::new();
    for part in [method, path] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h
}

/// The body as JSON, if its content type says JSON and it parses.
pub(crate) fn parse_json(content_type: Option<&str>, body: &[u8]) -> Option<Value> {
    content_type
        .filter(|t| is_json(t))
        .and_then(|_| serde_json::from_slice(body).ok())
}

/// `application/json`, `application/problem+json`, `text/json; charset=utf-8`, ...
pub(crate) fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    let Some((_, subtype)) = essence.split_once('/') else {
        return false;
    };
    subtype.eq_ignore_ascii_case("json")
        || subtype.len() > 5
            && subtype.as_bytes()[subtype.len() - 5..].eq_ignore_ascii_case(b"+json")
}

/// Hashes the bytes serde_json writes for `value`, with every object's keys sorted and no
/// whitespace. A key given twice in the body kept its last value when it was parsed. Numbers are
/// the parsed `u64`, `i64` or `f64` as serde_json writes them (`1e3` is `1000.0`); the
/// `float_roundtrip` feature makes the parse exact, so a client that writes a number in another
/// form of the same double keeps its fingerprint. Sorting here rather than relying on `Value`'s
/// map keeps the form stable if another crate turns on serde_json's `preserve_order`. Nesting is
/// bounded by serde_json's parser (128 levels).
fn canonical(h: &mut Sha256, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| a.0.cmp(b.0));
            h.update(b"{");
            for (i, (key, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write(h, key);
                h.update(b":");
                canonical(h, value);
            }
            h.update(b"}");
        }
        Value::Array(items) => {
            h.update(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                canonical(h, item);
            }
            h.update(b"]");
        }
        scalar => write(h, scalar),
    }
}

/// A key or scalar as serde_json writes it.
fn write<T: serde::Serialize + ?Sized>(h: &mut Sha256, value: &T) {
    // Writing into a hasher cannot fail.
    let _ = serde_json::to_writer(h, value);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const JSON: Option<&str> = Some("application/json");

    fn of(body: &[u8]) -> Fingerprint {
        Fingerprint::of_request("POST", "/p", JSON, body)
    }

    #[test]
    fn stored_fingerprints_keep_their_meaning() {
        // Computed by the implementations before this one; records in every store carry them.
        let cases: [(&str, Option<&str>, &[u8], &str); 9] = [
            ("/payments", JSON, br#"{"amount": 1000, "currency": "KRW", "description": "two apples"}"#,
             "4c955d6dd1b6f127981e330aa9fd0883673a10fa17428f7b85ba68d897215864"),
            ("/p", JSON, br#"{"b":{"y":[1,2.5,-3,1e3,1.0,-0.0,18446744073709551615,-9223372036854775808],"x":"s"},"a":null}"#,
             "ac0d5f426ba98fef6be913eff76e26996bc7c4db7379eaf3d1aaa7ad7fff8317"),
            ("/p", JSON, br#"{"a":1,"a":2,"b":[{"z":true,"a":false},{}],"a":3}"#,
             "e5d871e5ea53b3bb695db13c51d793b96c418f75ae6ffd8454909fd877a0b8b8"),
            ("/p", JSON, br#"{"esc\"aped":"line\nbreak \u00e9 \ud83d\ude00 \/","":"","a\u0000":1}"#,
             "b3d5c099cdc7191a8e9b4d746d43f0639a8c1e34526be774ce3233361cda6dd1"),
            ("/p", JSON, br#"["x",{"k":"v","K":"V"},123456789012345678901234567890,0.30000000000000004441,66666666666666666666666666666666666666666666666666666]"#,
             "a192b862f0156425c1929a71525c5dae0e71d030927de9675f77fd37c747fb12"),
            ("/p?q=1", Some("application/merge-patch+json; charset=utf-8"), br#"  "just a string"  "#,
             "49f87910c7df8742705dc1bb73b6d20dd88c6e8e8873d2a30b8ad7c8965628b6"),
            ("/p", JSON, b"{not json", "b67b494df3289bc9c0a14b5546669c02b35ff852db1185f8d6dab5861aad1eaf"),
            ("/p", Some("text/plain"), br#"{"b":2,"a":1}"#,
             "41dff882a7f64f1bf8dc75beb7dff3641c6bc30934960834096619ab205db2b9"),
            ("/p", None, b"", "0e3ffa86974e7cba492d70af53e71b5ca694fd0245a5ea21b874372df9f8cb1e"),
        ];
        for (path, content_type, body, hex) in cases {
            let fingerprint = Fingerprint::of_request("POST", path, content_type, body);
            assert_eq!(
                fingerprint.to_hex(),
                hex,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn json_is_compared_by_meaning() {
        let a = of(br#"{"a":1,"b":{"y":[1,2],"x":"s"}}"#);
        assert_eq!(
            a,
            of(b" {\n \"b\": {\"x\": \"s\", \"y\": [1, 2]}, \"a\": 1 } ")
        );
        assert_ne!(
            a,
            of(br#"{"a":1,"b":{"y":[2,1],"x":"s"}}"#),
            "array order is meaningful"
        );
        assert_ne!(
            a,
            of(br#"{"a":1.0,"b":{"y":[1,2],"x":"s"}}"#),
            "1.0 is not 1"
        );
        let merge_patch = Some("application/merge-patch+json; charset=utf-8");
        let body = br#"{"b":{"x":"s","y":[1,2]},"a":1}"#;
        assert_eq!(a, Fingerprint::of_request("POST", "/p", merge_patch, body));
        assert_eq!(
            a,
            Fingerprint::of_request("POST", "/p", Some("TEXT/JSON"), body)
        );
    }

    #[test]
    fn a_number_re_serialised_keeps_the_fingerprint() {
        // Found by fuzz/fingerprint: without exact float parsing, the 53-digit integer and the
        // shortest form of the same f64 parsed to neighbouring doubles.
        for (sent, resent) in [
            (
                "66666666666666666666666666666666666666666666666666666",
                "6.666666666666666e52",
            ),
            ("0.30000000000000004441", "0.30000000000000004"),
        ] {
            // The same double, written two ways (std's parser is exact).
            assert_eq!(sent.parse::<f64>(), resent.parse::<f64>());
            assert_eq!(
                of(sent.as_bytes()),
                of(resent.as_bytes()),
                "{sent} vs {resent}"
            );
        }
    }

    #[test]
    fn other_bodies_are_compared_by_bytes() {
        let text = Some("text/plain");
        let a = Fingerprint::of_request("POST", "/p", text, br#"{"a":1,"b":2}"#);
        assert_ne!(
            a,
            Fingerprint::of_request("POST", "/p", text, br#"{"b":2,"a":1}"#)
        );
        // JSON that does not parse, or has something after the document.
        assert_ne!(of(b"{\"a\":1} x"), of(b"{\"a\":1}  x"));
        assert_eq!(of(b"{not json"), of(b"{not json"));
    }

    #[test]
    fn method_and_path_are_part_of_the_request() {
        let a = Fingerprint::of_request("POST", "/p", None, b"x");
        assert_ne!(a, Fingerprint::of_request("PUT", "/p", None, b"x"));
        assert_ne!(a, Fingerprint::of_request("POST", "/q", None, b"x"));
        // The separator keeps "POST /p" + "x" apart from "POST /px" + "".
        assert_ne!(a, Fingerprint::of_request("POST", "/px", None, b""));
    }

    #[test]
    fn nesting_past_the_parsers_limit_is_hashed_as_bytes() {
        let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        let (deep, deeper) = (nested(127), nested(200));
        let spaced = |body: &str| body.replace(',', ", ").replace('[', "[ ");
        assert_eq!(of(deep.as_bytes()), of(spaced(&deep).as_bytes()));
        let bytes = Fingerprint::of_request("POST", "/p", None, deeper.as_bytes());
        assert_eq!(of(deeper.as_bytes()), bytes);
    }

    #[test]
    fn hex_round_trips() {
        let a = Fingerprint::of_request("POST", "/p", None, b"x");
        assert_eq!(Fingerprint::from_hex(&a.to_hex()), Some(a));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }

    /// A JSON document as a client might write it: members in any order, keys distinct.
    #[derive(Debug, Clone)]
    enum Doc {
        Scalar(Value),
        Array(Vec<Doc>),
        Object(Vec<(String, Doc)>),
    }

    impl Doc {
        /// The document as text: members in their order, or reversed; whitespace between tokens
        /// if `spaced`.
        fn write(&self, reversed: bool, spaced: bool, out: &mut String) {
            let gap = if spaced { " \n" } else { "" };
            match self {
                Doc::Scalar(v) => out.push_str(&v.to_string()),
                Doc::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        out.push_str(if i > 0 { "," } else { "" });
                        out.push_str(gap);
                        item.write(reversed, spaced, out);
                    }
                    out.push(']');
                }
                Doc::Object(members) => {
                    let mut members: Vec<_> = members.iter().collect();
                    if reversed {
                        members.reverse();
                    }
                    out.push('{');
                    for (i, (key, value)) in members.into_iter().enumerate() {
                        out.push_str(if i > 0 { "," } else { "" });
                        out.push_str(gap);
                        out.push_str(&Value::String(key.clone()).to_string());
                        out.push_str(gap);
                        out.push(':');
                        value.write(reversed, spaced, out);
                    }
                    out.push_str(gap);
                    out.push('}');
                }
            }
        }
    }

    /// Nested documents with escapes, non-ASCII text and every kind of number.
    fn any_doc() -> impl Strategy<Value = Doc> {
        let text = "[a-z\"\\\\\n\u{e9}\u{1F600}]{0,12}";
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text.prop_map(Value::String),
        ]
        .prop_map(Doc::Scalar);
        leaf.prop_recursive(4, 64, 8, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Doc::Array),
                proptest::collection::btree_map(text, inner, 0..8)
                    .prop_map(|members| Doc::Object(members.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever the document, its members in any order and with any whitespace: one
        /// fingerprint, the hash of the compact form with keys in order (which serde_json's
        /// `Value` writes, its map being sorted in this build).
        #[test]
        fn any_document_hashes_as_its_sorted_compact_form(doc in any_doc()) {
            let mut compact = String::new();
            doc.write(false, false, &mut compact);
            let value: Value = serde_json::from_str(&compact).expect("a document parses");
            let mut h = Sha256::new();
            h.update(b"POST\0/p\0json\0");
            h.update(serde_json::to_vec(&value).expect("a Value serialises"));
            let expected = Fingerprint(h.finalize().into());
            for (reversed, spaced) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut body = String::new();
                doc.write(reversed, spaced, &mut body);
                prop_assert_eq!(of(body.as_bytes()), expected, "{}", body);
            }
        }
    }
}
