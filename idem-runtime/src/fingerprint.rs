//! What makes two requests "the same request": the fingerprint.
//!
//! A fingerprint is SHA-256 over the method, the path (with its query) and the body. A JSON body
//! (`application/json` or any `+json` type) is hashed by meaning: object keys in sorted order and no
//! insignificant whitespace, so a client that re-serialises its payload on retry is not told that it
//! sent a different request. Numbers and strings are hashed as written after parsing (`1.0` and `1`
//! differ). Any other body, and a JSON body that does not parse, is hashed byte for byte.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::fmt;
use std::io::Write;

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
        let mut h = Sha256::new();
        h.update(method.as_bytes());
        h.update([0]);
        h.update(path.as_bytes());
        h.update([0]);
        match content_type
            .filter(|ct| is_json(ct))
            .and_then(|_| parse_json(body))
        {
            Some(mut value) => {
                h.update(b"json\0");
                hash_canonical(&mut h, &mut value);
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
        hex(&self.0)
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

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

/// `application/json`, `application/problem+json`, `text/json; charset=utf-8`, ...
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    let Some((_, subtype)) = essence.split_once('/') else {
        return false;
    };
    subtype.eq_ignore_ascii_case("json")
        || subtype.len() > 5
            && subtype.as_bytes()[subtype.len() - 5..].eq_ignore_ascii_case(b"+json")
}

fn parse_json(body: &[u8]) -> Option<Node<'_>> {
    serde_json::from_slice(body).ok()
}

/// A parsed JSON document whose strings borrow from the body where they contain no escapes. It holds
/// what a `serde_json::Value` would (serde_json's own parser builds it, with the same depth limit and
/// the same numbers), without a map node and an owned string per key: fingerprinting a request then
/// costs one vector per object or array instead of allocations per member.
enum Node<'a> {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    /// Members as written; sorted (and duplicates resolved) when hashed.
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
}

impl<'de> Deserialize<'de> for Node<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Node<'de>, E> {
        Ok(Node::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node<'de>, E> {
        Ok(Node::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node<'de>, E> {
        Ok(Node::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node<'de>, E> {
        // As `Value` does: a float JSON cannot represent becomes null (the parser never yields one).
        Ok(serde_json::Number::from_f64(v).map_or(Node::Null, Node::Number))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Node<'de>, E> {
        Ok(Node::String(Cow::Owned(v)))
    }
    fn visit_unit<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }
    fn visit_none<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node<'de>, D::Error> {
        Node::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node<'de>, A::Error> {
        let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(Key(key)) = map.next_key()? {
            members.push((key, map.next_value()?));
        }
        Ok(Node::Object(members))
    }
}

/// An object key, borrowed from the body unless it contains escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// Writes `node` into the hash with object keys sorted: the bytes serde_json writes for the
/// equivalent `Value` with its keys sorted. Sorting here, rather than relying on serde_json's map
/// type, keeps the fingerprint stable even if another crate in the build turns on serde_json's
/// `preserve_order` feature. A key given twice keeps its last value, as `Value` does. Recursion depth
/// is bounded by serde_json's parser (128).
fn hash_canonical(h: &mut Sha256, node: &mut Node<'_>) {
    match node {
        Node::Object(members) => {
            // Stable, so that among equal keys the last one written stays last.
            members.sort_by(|a, b| a.0.cmp(&b.0));
            h.update(b"{");
            let mut first = true;
            for i in 0..members.len() {
                if members
                    .get(i + 1)
                    .is_some_and(|next| next.0 == members[i].0)
                {
                    continue; // overridden by a later duplicate
                }
                if !first {
                    h.update(b",");
                }
                first = false;
                let (key, value) = &mut members[i];
                write_json(h, &**key);
                h.update(b":");
                hash_canonical(h, value);
            }
            h.update(b"}");
        }
        Node::Array(items) => {
            h.update(b"[");
            for (i, v) in items.iter_mut().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                hash_canonical(h, v);
            }
            h.update(b"]");
        }
        Node::Null => h.update(b"null"),
        Node::Bool(true) => h.update(b"true"),
        Node::Bool(false) => h.update(b"false"),
        Node::Number(n) => write_json(h, n),
        Node::String(s) => write_json(h, &**s),
    }
}

/// Writes a scalar as serde_json serialises it (string escapes, number formatting).
fn write_json<T: serde::Serialize + ?Sized>(h: &mut Sha256, value: &T) {
    struct HashWriter<'a>(&'a mut Sha256);
    impl Write for HashWriter<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // Writing a scalar into an in-memory hasher cannot fail.
    let _ = serde_json::to_writer(HashWriter(h), value);
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: Option<&str> = Some("application/json");

    #[test]
    fn json_is_compared_by_meaning() {
        let a = Fingerprint::of_request("POST", "/p", JSON, br#"{"a":1,"b":{"y":[1,2],"x":"s"}}"#);
        let b = Fingerprint::of_request(
            "POST",
            "/p",
            JSON,
            b" {\n \"b\": {\"x\": \"s\", \"y\": [1, 2]}, \"a\": 1 } ",
        );
        assert_eq!(a, b);
        let c = Fingerprint::of_request("POST", "/p", JSON, br#"{"a":1,"b":{"y":[2,1],"x":"s"}}"#);
        assert_ne!(a, c, "array order is meaningful");
        let d = Fingerprint::of_request(
            "POST",
            "/p",
            Some("application/merge-patch+json; charset=utf-8"),
            br#"{"b":{"x":"s","y":[1,2]},"a":1}"#,
        );
        assert_eq!(a, d);
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
            let a = Fingerprint::of_request("POST", "/p", JSON, sent.as_bytes());
            let b = Fingerprint::of_request("POST", "/p", JSON, resent.as_bytes());
            assert_eq!(a, b, "{sent} vs {resent}");
        }
    }

    #[test]
    fn other_bodies_are_compared_by_bytes() {
        let a = Fingerprint::of_request("POST", "/p", Some("text/plain"), br#"{"a":1,"b":2}"#);
        let b = Fingerprint::of_request("POST", "/p", Some("text/plain"), br#"{"b":2,"a":1}"#);
        assert_ne!(a, b);
        let bad_json = Fingerprint::of_request("POST", "/p", JSON, b"{not json");
        assert_eq!(
            bad_json,
            Fingerprint::of_request("POST", "/p", JSON, b"{not json")
        );
    }

    #[test]
    fn method_and_path_are_part_of_the_request() {
        let a = Fingerprint::of_request("POST", "/p", None, b"x");
        assert_ne!(a, Fingerprint::of_request("PUT", "/p", None, b"x"));
        assert_ne!(a, Fingerprint::of_request("POST", "/q", None, b"x"));
        // The separator keeps "POST /p" + "x" apart from "POST /px" + "".
        assert_ne!(a, Fingerprint::of_request("POST", "/px", None, b""));
    }

    /// The implementation before `Node`: parse into a `serde_json::Value`, hash it with sorted keys.
    /// The fingerprint must not change (stored records carry it).
    fn reference(method: &str, path: &str, body: &[u8]) -> Fingerprint {
        use serde_json::Value;
        fn canonical(h: &mut Sha256, value: &Value) {
            match value {
                Value::Object(map) => {
                    let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                    entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                    h.update(b"{");
                    for (i, (k, v)) in entries.into_iter().enumerate() {
                        if i > 0 {
                            h.update(b",");
                        }
                        write_json(h, &Value::String(k.clone()));
                        h.update(b":");
                        canonical(h, v);
                    }
                    h.update(b"}");
                }
                Value::Array(items) => {
                    h.update(b"[");
                    for (i, v) in items.iter().enumerate() {
                        if i > 0 {
                            h.update(b",");
                        }
                        canonical(h, v);
                    }
                    h.update(b"]");
                }
                scalar => write_json(h, scalar),
            }
        }
        let mut h = Sha256::new();
        h.update(method.as_bytes());
        h.update([0]);
        h.update(path.as_bytes());
        h.update([0]);
        match serde_json::from_slice::<Value>(body) {
            Ok(value) => {
                h.update(b"json\0");
                canonical(&mut h, &value);
            }
            Err(_) => {
                h.update(b"bytes\0");
                h.update(body);
            }
        }
        Fingerprint(h.finalize().into())
    }

    #[test]
    fn the_fingerprint_is_unchanged_from_the_value_based_implementation() {
        let bodies: &[&[u8]] = &[
            br#"{"amount": 1000, "currency": "KRW", "description": "two apples"}"#,
            br#"{"b":{"y":[1,2.5,-3,1e3,1.0,-0.0,18446744073709551615,-9223372036854775808],"x":"s"},"a":null}"#,
            br#"{"a":1,"a":2,"b":[{"z":true,"a":false},{}],"a":3}"#,
            br#"{"esc\"aped":"line\nbreak \u00e9 \ud83d\ude00 \/","":"","a\u0000":1}"#,
            r#"{"plain":"é😀","é":1,"e":2}"#.as_bytes(),
            br#"["x",{"k":"v","K":"V","k2":[[],[[]],{}]},123456789012345678901234567890]"#,
            br#"  "just a string"  "#,
            b"42",
            b"true",
            b"null",
            br#"{"dup":{"x":1},"dup":{"y":2}}"#,
            br#"{"b\u0061":1,"ba":2}"#,
            b"{not json",
            br#"{"a":1} trailing"#,
            b"",
        ];
        for body in bodies {
            assert_eq!(
                Fingerprint::of_request("POST", "/p", JSON, body),
                reference("POST", "/p", body),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    /// Any JSON document: nested, with duplicate-free objects, escapes, non-ASCII text, and strings
    /// longer than a SHA-256 block.
    fn any_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        use serde_json::Value;
        let text = prop_oneof!["[a-z\"\\\\\n\u{e9}\u{1F600}]{0,12}", "[a-z]{60,300}",];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text.clone().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 64, 8, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                proptest::collection::vec((text.clone(), inner), 0..8)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Whatever the document, compact or pretty-printed, the fingerprint is the reference
        /// implementation's.
        #[test]
        fn any_document_hashes_as_the_reference_does(value in any_json()) {
            for body in [
                serde_json::to_vec(&value).expect("a Value serialises"),
                serde_json::to_vec_pretty(&value).expect("a Value serialises"),
            ] {
                proptest::prop_assert_eq!(
                    Fingerprint::of_request("POST", "/p", JSON, &body),
                    reference("POST", "/p", &body)
                );
            }
        }
    }

    #[test]
    fn hex_round_trips() {
        let a = Fingerprint::of_request("POST", "/p", None, b"x");
        assert_eq!(Fingerprint::from_hex(&a.to_hex()), Some(a));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }
}
