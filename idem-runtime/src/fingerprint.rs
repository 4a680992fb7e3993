//! What makes two requests "the same request": the fingerprint.
//!
//! A fingerprint is SHA-256 over the method, the path (with its query) and the body. A JSON body
//! (`application/json` or any `+json` type) is hashed by meaning: object keys in sorted order and no
//! insignificant whitespace, so a client that re-serialises its payload on retry is not told that it
//! sent a different request. Numbers and strings are hashed as written after parsing (`1.0` and `1`
//! differ). Any other body, and a JSON body that does not parse, is hashed byte for byte.

use serde_json::Value;
use sha2::{Digest, Sha256};
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
            Some(value) => {
                h.update(b"json\0");
                hash_canonical(&mut h, &value);
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

fn parse_json(body: &[u8]) -> Option<Value> {
    serde_json::from_slice(body).ok()
}

/// Writes `value` into the hash with object keys sorted. Sorting here, rather than relying on
/// serde_json's map type, keeps the fingerprint stable even if another crate in the build turns on
/// serde_json's `preserve_order` feature. Recursion depth is bounded by serde_json's parser (128).
fn hash_canonical(h: &mut Sha256, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            h.update(b"{");
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                write_scalar(h, &Value::String(k.clone()));
                h.update(b":");
                hash_canonical(h, v);
            }
            h.update(b"}");
        }
        Value::Array(items) => {
            h.update(b"[");
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    h.update(b",");
                }
                hash_canonical(h, v);
            }
            h.update(b"]");
        }
        scalar => write_scalar(h, scalar),
    }
}

fn write_scalar(h: &mut Sha256, value: &Value) {
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

    #[test]
    fn hex_round_trips() {
        let a = Fingerprint::of_request("POST", "/p", None, b"x");
        assert_eq!(Fingerprint::from_hex(&a.to_hex()), Some(a));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }
}
