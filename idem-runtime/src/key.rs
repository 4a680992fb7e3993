//! The `Idempotency-Key` header value.
//!
//! A key is 1 to 255 visible ASCII characters (`!` to `~`). The IETF draft sends the key as a
//! structured-field string (`"8e03978e-…"`); that form names the same key as the bare characters, so
//! `"abc"` and `abc` are one key. A bare key may not contain a comma: a proxy that merges two
//! `Idempotency-Key` lines into one joins them with one, so `a,b` is refused rather than taken for
//! a key; quoted, `"a,b"` is the key `a,b`.

use std::fmt;

/// The header that carries the key, as HTTP/2 and the `http` crate spell names. The server side
/// (`axum::KEY_HEADER`, feature `axum`) and the client (`client::IDEMPOTENCY_KEY`, feature
/// `client`) name the same constant.
pub const HEADER: &str = "idempotency-key";

/// The longest key accepted, in characters (Stripe's limit, which clients already honour).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key.
///
/// ```
/// use idem_runtime::IdempotencyKey;
/// let bare = IdempotencyKey::parse(b"order-42").unwrap();
/// let quoted = IdempotencyKey::parse(b"\"order-42\"").unwrap();
/// assert_eq!(bare, quoted);
/// assert!(IdempotencyKey::parse(b"has space").is_err());
/// assert!(IdempotencyKey::parse(b"a,b").is_err()); // two keys merged by a proxy
/// assert_eq!(IdempotencyKey::parse(b"\"a,b\"").unwrap().as_str(), "a,b");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a header value is not a usable key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty (or `""`).
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// More than [`MAX_KEY_LEN`] characters.
    #[error("the Idempotency-Key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    /// A character outside visible ASCII, at this byte offset of the key.
    #[error("the Idempotency-Key contains a character that is not visible ASCII at position {0}")]
    InvalidCharacter(usize),
    /// A quoted value that is not a well-formed structured-field string.
    #[error("the Idempotency-Key is quoted but not a well-formed string (check the closing quote and escapes)")]
    MalformedQuoted,
    /// The header was sent more than once.
    #[error("the Idempotency-Key header was sent more than once")]
    Repeated,
    /// A bare (unquoted) value with a comma: what a proxy makes of two header lines it merged. A key
    /// with a comma must be sent quoted (`"a,b"`).
    #[error("the Idempotency-Key has an unquoted comma, as when two Idempotency-Key headers are merged into one; send one key, or quote a key that contains a comma")]
    UnquotedComma,
    /// A key read from a JSON body field that is neither a string nor an integer.
    #[error("the Idempotency-Key is neither a string nor an integer")]
    NotText,
}

impl IdempotencyKey {
    /// A key given as text, not as a header value (a JSON body field): 1 to 255 visible ASCII
    /// characters, taken as they are (no quoting, commas allowed).
    ///
    /// ```
    /// use idem_runtime::IdempotencyKey;
    /// assert_eq!(IdempotencyKey::from_text("evt_1,2").unwrap().as_str(), "evt_1,2");
    /// assert!(IdempotencyKey::from_text("").is_err());
    /// ```
    pub fn from_text(text: &str) -> Result<Self, KeyError> {
        if text.is_empty() {
            return Err(KeyError::Empty);
        }
        if text.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if let Some(pos) = text.bytes().position(|b| !(0x21..=0x7e).contains(&b)) {
            return Err(KeyError::InvalidCharacter(pos));
        }
        Ok(Self(text.to_owned()))
    }

    /// Parses a header value, bare or in structured-field string form.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let raw = trim_ows(raw);
        let key = match raw.first() {
            Some(b'"') => unquote(raw)?,
            _ if raw.contains(&b',') => return Err(KeyError::UnquotedComma),
            _ => raw.to_vec(),
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if let Some(pos) = key.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter(pos));
        }
        // Every byte is ASCII, so this cannot fail; map rather than unwrap to keep the parser panic-free.
        String::from_utf8(key)
            .map(Self)
            .map_err(|_| KeyError::InvalidCharacter(0))
    }

    /// A key the caller constructed in code (for example a derived key). Same rules as [`parse`](Self::parse).
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        Self::parse(key.into().as_bytes())
    }

    /// The key's characters.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key, as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn trim_ows(mut s: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = s {
        s = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = s {
        s = rest;
    }
    s
}

/// RFC 8941 sf-string: `"` *( unescaped / `\"` / `\\` ) `"`, printable ASCII only.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let inner = match raw {
        [b'"', inner @ .., b'"'] if raw.len() >= 2 => inner,
        _ => return Err(KeyError::MalformedQuoted),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::MalformedQuoted),
            },
            b'"' => return Err(KeyError::MalformedQuoted),
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::MalformedQuoted),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_forms_are_one_key() {
        assert_eq!(
            IdempotencyKey::parse(b"abc").unwrap(),
            IdempotencyKey::parse(b"\"abc\"").unwrap()
        );
        assert_eq!(IdempotencyKey::parse(b"  abc\t").unwrap().as_str(), "abc");
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b\\c""#).unwrap().as_str(),
            r#"a"b\c"#
        );
    }

    #[test]
    fn rejects_what_is_not_a_key() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\""), Err(KeyError::MalformedQuoted));
        assert_eq!(
            IdempotencyKey::parse(b"\"abc"),
            Err(KeyError::MalformedQuoted)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\"b\""),
            Err(KeyError::MalformedQuoted)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a\\x\""),
            Err(KeyError::MalformedQuoted)
        );
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidCharacter(1))
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a b\""),
            Err(KeyError::InvalidCharacter(1))
        );
        assert_eq!(
            IdempotencyKey::parse("cl\u{e9}".as_bytes()),
            Err(KeyError::InvalidCharacter(2))
        );
        assert_eq!(IdempotencyKey::parse(&[b'k'; 256]), Err(KeyError::TooLong));
        assert!(IdempotencyKey::parse(&[b'k'; 255]).is_ok());
    }
}
