//! The key layout: a record's tag (`<n>:<scope>:<key>`, escaped) and its Redis key
//! (`<prefix>:{<tag>}`), written straight into the commands that send them.

use super::*;

pub(super) fn escape(s: &str, out: &mut impl fmt::Write) -> fmt::Result {
    let mut rest = s;
    while let Some(at) = rest.find(['%', '{', '}']) {
        out.write_str(&rest[..at])?;
        out.write_str(match rest.as_bytes()[at] {
            b'%' => "%25",
            b'{' => "%7B",
            _ => "%7D",
        })?;
        rest = &rest[at + 1..];
    }
    out.write_str(rest)
}

/// The length of `s` escaped: each of `%`, `{`, `}` becomes three bytes.
pub(super) fn escaped_len(s: &str) -> usize {
    s.len()
        + 2 * s
            .bytes()
            .filter(|b| matches!(b, b'%' | b'{' | b'}'))
            .count()
}

pub(super) fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 3)?;
        out.push(match code {
            "25" => '%',
            "7B" => '{',
            "7D" => '}',
            _ => return None,
        });
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// `<n>:<scope>:<key>` with `%`, `{`, `}` escaped and `n` the escaped scope's byte length: injective,
/// brace-free, and the message published on completion. The store writes it inside keys
/// ([`RedisKey`]); as a string of its own it serves the tests and the fuzz target.
#[cfg(any(test, fuzzing))]
pub(super) fn encode_tag(key: &RecordKey) -> String {
    let mut out = String::with_capacity(tag_len(key));
    // Writing to a String cannot fail.
    let _ = write_tag(key, &mut out);
    out
}

/// An upper bound of the tag's length ([`write_tag`]), so that keys are built in one allocation.
pub(super) fn tag_len(key: &RecordKey) -> usize {
    // At most 20 digits for the length and a colon, then the escaped scope, a colon, the escaped key.
    21 + escaped_len(key.scope()) + 1 + escaped_len(key.key())
}

pub(super) fn write_tag(key: &RecordKey, out: &mut impl fmt::Write) -> fmt::Result {
    write!(out, "{}:", escaped_len(key.scope()))?;
    escape(key.scope(), out)?;
    out.write_char(':')?;
    escape(key.key(), out)
}

/// A record's Redis key, `<prefix>:{<tag>}`, written straight into the command that sends it.
#[derive(Clone, Copy)]
pub(super) struct RedisKey<'a> {
    pub(super) prefix: &'a str,
    pub(super) key: &'a RecordKey,
}

impl RedisKey<'_> {
    /// An upper bound of the key's length.
    pub(super) fn max_len(&self) -> usize {
        self.prefix.len() + 3 + tag_len(self.key)
    }
}

impl fmt::Display for RedisKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prefix)?;
        f.write_str(":{")?;
        write_tag(self.key, f)?;
        f.write_str("}")
    }
}

impl ToRedisArgs for RedisKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        out.write_arg_fmt(self);
    }
}

pub(super) fn decode_tag(tag: &[u8]) -> Option<RecordKey> {
    let tag = std::str::from_utf8(tag).ok()?;
    let (len, rest) = tag.split_once(':')?;
    let len: usize = len.parse().ok()?;
    let scope = rest.get(..len)?;
    let key = rest.get(len..)?.strip_prefix(':')?;
    Some(RecordKey::stored(unescape(scope)?, unescape(key)?))
}

/// `*`, `?`, `[`, `]` and `\` are glob syntax in `SCAN MATCH`.
pub(super) fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
