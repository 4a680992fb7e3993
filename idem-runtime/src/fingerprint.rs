//! What makes two requests "the same request": the fingerprint.
//!
//! A fingerprint is SHA-256 over the method, the path (with its query) and the body. A JSON body
//! (`application/json` or any `+json` type) is hashed by meaning: object keys in sorted order and no
//! insignificant whitespace, so a client that re-serialises its payload on retry is not told that it
//! sent a different request. Numbers and strings are hashed as written after parsing (`1.0` and `1`
//! differ). Any other body, and a JSON body that does not parse, is hashed byte for byte.

use serde::de::{Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::cell::RefCell;
use std::fmt;

// The one-parse path serves the axum integration's `Json<T>` (and the fuzz target, and its tests).
#[cfg(any(feature = "axum", fuzzing, test))]
mod tee;

#[cfg(any(feature = "axum", fuzzing))]
pub(crate) use tee::of_json_request;

/// The one-parse path of `Json<T>`, for `fuzz/fuzz_targets/json_once.rs`; only under
/// `--cfg fuzzing`, which cargo-fuzz sets.
#[cfg(fuzzing)]
#[doc(hidden)]
#[allow(missing_docs)]
pub mod fuzzing {
    pub fn of_json_request<T: serde::de::DeserializeOwned>(
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Option<(T, super::Fingerprint)> {
        super::of_json_request(method, path, content_type, body)
    }
}

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
        let mut h = Self::hasher(method, path);
        let json = content_type.is_some_and(is_json) && hash_json(&mut h, body);
        if !json {
            h.update(b"bytes\0");
            h.update(body);
        }
        Self(h.finalize().into())
    }

    /// The hash with the request's method and path written, the body to follow.
    fn hasher(method: &str, path: &str) -> Sha256 {
        let mut h = Sha256::new();
        h.update(method.as_bytes());
        h.update([0]);
        h.update(path.as_bytes());
        h.update([0]);
        h
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
    // What nearly every client sends, accepted without splitting it.
    if content_type == "application/json" {
        return true;
    }
    let essence = content_type.split(';').next().unwrap_or("").trim();
    let Some((_, subtype)) = essence.split_once('/') else {
        return false;
    };
    subtype.eq_ignore_ascii_case("json")
        || subtype.len() > 5
            && subtype.as_bytes()[subtype.len() - 5..].eq_ignore_ascii_case(b"+json")
}

/// Hashes the canonical form of a JSON body, if it is one JSON document, and says whether it was;
/// if not, nothing was hashed. The canonical form is the bytes serde_json writes for the equivalent
/// `Value` with its object keys sorted and no whitespace. A key given twice keeps its last value, as
/// `Value` does. Sorting here, rather than relying on serde_json's map type, keeps the fingerprint
/// stable even if another crate in the build turns on serde_json's `preserve_order` feature.
///
/// No tree is built. While serde_json parses the body, each scalar is written as serde_json
/// serialises it (string escapes, number formatting) and each object's members where they fall;
/// an object whose keys are not in order gets the list of its members in key order. The form is
/// then hashed from what was written: in one piece if every object was in order, else with each
/// such object's members taken in its list's order (a member overridden by a later duplicate is
/// left out). Either way each byte of the form is hashed once, however deep the objects nest.
/// Nesting is bounded by serde_json's parser (128 levels; hashing recurses twice per level). What
/// is written goes into buffers each thread keeps, so that fingerprinting a body of up to
/// [`KEEP`] bytes allocates nothing, unless a key or string has an escape (serde_json then
/// decodes it into a buffer, and a key's decoded string is kept until the hash is done).
fn hash_json(h: &mut Sha256, body: &[u8]) -> bool {
    with_scratch(|canon| canon.hash(h, body))
}

/// Runs `f` on this thread's buffers, trimmed afterwards. While the thread is being torn down, or
/// if `f` runs inside another `f` on the same thread (a `Deserialize` of the handler's that
/// fingerprints something itself), it gets new buffers instead.
fn with_scratch<R>(mut f: impl FnMut(&mut Canonical) -> R) -> R {
    thread_local! {
        static SCRATCH: RefCell<Canonical> = const { RefCell::new(Canonical::new()) };
    }
    let kept = SCRATCH.try_with(|scratch| {
        let mut canon = scratch.try_borrow_mut().ok()?;
        let result = f(&mut canon);
        canon.trim();
        Some(result)
    });
    match kept {
        Ok(Some(result)) => result,
        _ => f(&mut Canonical::new()),
    }
}

/// The body as written, and where its objects and their members are in it.
#[derive(Debug)]
struct Canonical {
    /// Scalars in canonical form, members in the body's order.
    out: Vec<u8>,
    /// Every object, in the order they open (so ordered by `open`).
    objects: Vec<Object>,
    /// The members of the objects still open, an object's after those of the objects around it.
    open_members: Vec<Member>,
    /// The members of the objects not in key order, in key order, each key once.
    ordered: Vec<Member>,
    /// The keys written with an escape, as parsed (the written bytes are then not the string's).
    escaped_keys: Vec<String>,
    /// The key the one-parse path ([`tee`]) has just written, for its object to list once the
    /// value is written.
    pending_key: Option<KeyWritten>,
    /// Whether the one-parse path saw a value in a form `Write` does not write (see [`tee`]).
    unsure: bool,
    /// Whether the one-parse path saw an error, or a call it cannot reproduce, anywhere: its
    /// value and its form then stand for nothing (see [`tee`]).
    refused: bool,
    /// The one-parse path's calls out to serde_json or the handler's type not yet returned: more
    /// than none at the end means a panic was caught past the form's bookkeeping (see [`tee`]).
    handed_off: usize,
}

/// Whether serde_json writes any byte of `bytes` as an escape: a control character, `"` or `\\`
/// (DEL and every non-ASCII character are written as they are). Eight bytes at a time, as one
/// integer: a byte-by-byte loop costs about as much as serde_json's own escaping.
fn has_escape(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_le_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_le_bytes([0x80; 8]);
    // Whether some byte of `word` is below `n` (n at most 0x80): a byte's high bit survives the
    // subtraction only if it was below `n` (or borrowed from a lower byte that was), and not if
    // its own high bit was set. Exact for the word as a whole, which is all that is asked.
    let below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGH != 0;
    let any = |word: u64| {
        below(word, 0x20) || below(word ^ (ONES * 0x22), 1) || below(word ^ (ONES * 0x5c), 1)
    };
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        if any(u64::from_le_bytes(word)) {
            return true;
        }
    }
    // The last few bytes, padded with a byte that is never escaped.
    let rest = chunks.remainder();
    let mut word = [b'a'; 8];
    word[..rest.len()].copy_from_slice(rest);
    any(u64::from_le_bytes(word))
}

/// A thread's buffers are kept up to this many bytes each; larger ones, grown by a larger body, are
/// let go once it is hashed, and so are the decoded escaped keys.
const KEEP: usize = 16 * 1024;

/// One object as written: `out[open..close]`, from its `{` to after its `}`.
#[derive(Debug, Clone)]
struct Object {
    open: usize,
    close: usize,
    /// The index in `objects` after its last descendant.
    after: usize,
    /// Its members in `ordered`, if it is not in key order.
    reordered: Option<std::ops::Range<usize>>,
}

/// An object [opened](Canonical::open_object) and not yet closed: its index in `objects`, and
/// where its members start in `open_members`.
#[derive(Debug, Clone, Copy)]
struct Opened {
    index: usize,
    first: usize,
}

/// A member whose key is written and whose value is not yet: see [`Canonical::member_key`].
#[derive(Debug, Clone, Copy)]
struct KeyWritten {
    start: usize,
    key_end: usize,
    escaped: Option<usize>,
}

/// One object member as written: `"key":value` at `out[start..end]`, the key's closing quote at
/// `out[key_end - 1]`.
#[derive(Debug, Clone, Copy)]
struct Member {
    start: usize,
    key_end: usize,
    end: usize,
    /// If the key as written has an escape, where the parsed key is in `escaped_keys`.
    escaped: Option<usize>,
}

impl Canonical {
    const fn new() -> Self {
        Self {
            out: Vec::new(),
            objects: Vec::new(),
            open_members: Vec::new(),
            ordered: Vec::new(),
            escaped_keys: Vec::new(),
            pending_key: None,
            unsure: false,
            refused: false,
            handed_off: 0,
        }
    }

    /// If `body` is one JSON document, hashes its canonical form after the `json` tag; whether it
    /// was.
    fn hash(&mut self, h: &mut Sha256, body: &[u8]) -> bool {
        self.start(body.len());
        let mut parser = serde_json::Deserializer::from_slice(body);
        let json = Write(self).deserialize(&mut parser).is_ok() && parser.end().is_ok();
        if json {
            self.finish(h);
        }
        json
    }

    /// Empties the buffers for a body of `len` bytes.
    fn start(&mut self, len: usize) {
        self.out.clear();
        self.objects.clear();
        self.open_members.clear();
        self.ordered.clear();
        self.escaped_keys.clear();
        self.pending_key = None;
        self.unsure = false;
        self.refused = false;
        self.handed_off = 0;
        self.out.reserve(len);
    }

    /// Hashes the form written since [`start`](Self::start), after the `json` tag.
    fn finish(&self, h: &mut Sha256) {
        h.update(b"json\0");
        if self.objects.iter().all(|o| o.reordered.is_none()) {
            h.update(&self.out);
        } else {
            self.hash_range(h, 0, self.out.len());
        }
    }

    /// Hashes `out[from..to]`, each object that starts in it in canonical order.
    fn hash_range(&self, h: &mut Sha256, from: usize, to: usize) {
        let mut at = from;
        let mut next = self.objects.partition_point(|o| o.open < from);
        while let Some(object) = self.objects.get(next).filter(|o| o.open < to) {
            h.update(self.out.get(at..object.open).unwrap_or_default());
            h.update(b"{");
            match &object.reordered {
                // In order: its bytes as written, up to its `}`, each object inside it in order.
                None => self.hash_range(h, object.open + 1, object.close),
                Some(members) => {
                    for (i, member) in self
                        .ordered
                        .get(members.clone())
                        .unwrap_or_default()
                        .iter()
                        .enumerate()
                    {
                        if i > 0 {
                            h.update(b",");
                        }
                        self.hash_range(h, member.start, member.end);
                    }
                    h.update(b"}");
                }
            }
            // Never backwards, even over an object left unclosed (a parse that failed half-way is
            // never hashed, but a mistake here must not loop forever).
            at = object.close.max(at);
            next = object.after.max(next + 1);
        }
        h.update(self.out.get(at..to).unwrap_or_default());
    }

    /// Lets go of buffers a large body grew, and of the escaped keys' strings.
    fn trim(&mut self) {
        fn trim<T>(v: &mut Vec<T>) {
            if v.capacity() * std::mem::size_of::<T>() > KEEP {
                *v = Vec::new();
            }
        }
        trim(&mut self.out);
        trim(&mut self.objects);
        trim(&mut self.open_members);
        trim(&mut self.ordered);
        // Each key's string is the request's own; only the vector is kept.
        self.escaped_keys.clear();
        trim(&mut self.escaped_keys);
    }

    /// A scalar, as serde_json serialises it.
    fn scalar<T: serde::Serialize + ?Sized>(&mut self, value: &T) {
        // Writing into a vector cannot fail.
        let _ = serde_json::to_writer(&mut self.out, value);
    }

    /// A string, as serde_json serialises it; whether it was written with an escape. A string with
    /// nothing to escape (no control character, `"` or `\\`: nearly every key and value) is its
    /// bytes between quotes, written here without serde_json's escaping loop.
    fn string(&mut self, value: &str) -> bool {
        if has_escape(value.as_bytes()) {
            self.scalar(value);
            return true;
        }
        self.out.reserve(value.len() + 2);
        self.out.push(b'"');
        self.out.extend_from_slice(value.as_bytes());
        self.out.push(b'"');
        false
    }

    /// Opens an object: its `{`, and where its members will be.
    fn open_object(&mut self) -> Opened {
        let opened = Opened {
            index: self.objects.len(),
            first: self.open_members.len(),
        };
        self.objects.push(Object {
            open: self.out.len(),
            close: 0,
            after: 0,
            reordered: None,
        });
        self.out.push(b'{');
        opened
    }

    /// Writes the next member's key in `object`, up to its `:`; the member is listed once its
    /// value is written ([`member_end`](Self::member_end)).
    fn member_key(&mut self, object: Opened, key: Cow<'_, str>) -> KeyWritten {
        if self.open_members.len() > object.first {
            self.out.push(b',');
        }
        let start = self.out.len();
        let escaped = self.string(&key).then(|| {
            self.escaped_keys.push(key.into_owned());
            self.escaped_keys.len() - 1
        });
        let key_end = self.out.len();
        self.out.push(b':');
        KeyWritten {
            start,
            key_end,
            escaped,
        }
    }

    /// The value after `key` is written: the member is complete.
    fn member_end(&mut self, key: KeyWritten) {
        self.open_members.push(Member {
            start: key.start,
            key_end: key.key_end,
            end: self.out.len(),
            escaped: key.escaped,
        });
    }

    /// Before an array's next element: its comma unless it is the `first`. Returns where the
    /// element starts, to [`truncate`](Vec::truncate) `out` to if there was none.
    fn element(&mut self, first: bool) -> usize {
        let before = self.out.len();
        if !first {
            self.out.push(b',');
        }
        before
    }

    /// Closes `object`, whose members are `open_members[object.first..]`: lists them in key order,
    /// the last of each key only, if they are not in key order already.
    fn close_object(&mut self, object: Opened) {
        let Opened { index, first } = object;
        self.out.push(b'}');
        let Self {
            out,
            objects,
            open_members,
            ordered,
            escaped_keys,
            ..
        } = self;
        let members = open_members.get_mut(first..).unwrap_or_default();
        let order =
            |a: &Member, b: &Member| key(out, escaped_keys, a).cmp(key(out, escaped_keys, b));
        let reordered = if members
            .windows(2)
            .all(|pair| order(&pair[0], &pair[1]).is_lt())
        {
            None
        } else {
            // Stable, so that among equal keys the last one written stays last.
            members.sort_by(order);
            let from = ordered.len();
            for (i, member) in members.iter().enumerate() {
                if !members
                    .get(i + 1)
                    .is_some_and(|next| order(member, next).is_eq())
                {
                    ordered.push(*member); // else overridden by a later duplicate
                }
            }
            Some(from..ordered.len())
        };
        open_members.truncate(first);
        let after = objects.len();
        if let Some(object) = objects.get_mut(index) {
            object.close = out.len();
            object.after = after;
            object.reordered = reordered;
        }
    }
}

/// A member's key as the bytes of its string, which order as the strings do (`str`'s order is by
/// bytes): the written bytes between the quotes, or the parsed key if the written one has an escape.
fn key<'a>(out: &'a [u8], escaped_keys: &'a [String], member: &Member) -> &'a [u8] {
    if let Some(parsed) = member.escaped.and_then(|i| escaped_keys.get(i)) {
        return parsed.as_bytes();
    }
    let written = out.get(member.start..member.key_end).unwrap_or_default();
    written
        .get(1..written.len().saturating_sub(1))
        .unwrap_or_default()
}

/// Writes the next JSON value of the parse into the form.
struct Write<'a>(&'a mut Canonical);

impl<'de> DeserializeSeed<'de> for Write<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// The calls serde_json's `deserialize_any` makes (it reports `null` as a unit, never as an option;
/// an escaped string arrives through `visit_str`, which the default `visit_string` calls).
impl<'de> Visitor<'de> for Write<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.0.scalar(&v);
        Ok(())
    }
    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.0.scalar(&v);
        Ok(())
    }
    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        self.0.scalar(&v);
        Ok(())
    }
    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        // As `Value` does: a float JSON cannot represent is null (the parser never yields one).
        self.0.scalar(&v);
        Ok(())
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.0.string(v);
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.out.extend_from_slice(b"null");
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let canon = self.0;
        canon.out.push(b'[');
        let mut first = true;
        loop {
            let before = canon.element(first);
            if seq.next_element_seed(Write(&mut *canon))?.is_none() {
                canon.out.truncate(before);
                break;
            }
            first = false;
        }
        canon.out.push(b']');
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let canon = self.0;
        let object = canon.open_object();
        while let Some(Key(key)) = map.next_key()? {
            let key = canon.member_key(object, key);
            map.next_value_seed(Write(&mut *canon))?;
            canon.member_end(key);
        }
        canon.close_object(object);
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const JSON: Option<&str> = Some("application/json");

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        let mut samples: Vec<String> = (0u8..=0x7f).map(|b| char::from(b).to_string()).collect();
        samples.extend(
            [
                "",
                "amount",
                "KRW",
                "a\"b",
                "back\\slash",
                "tab\there",
                "é ü 決済 🦀",
                "\u{7f}\u{80}\u{2028}",
            ]
            .map(String::from),
        );
        // Each byte that needs an escape at each place in the eight-byte words and the tail.
        for special in ["\"", "\\", "\u{0}", "\u{1f}"] {
            for at in 0..19 {
                samples.push(format!(
                    "{}{special}{}",
                    "x".repeat(at),
                    "\u{7f}é".repeat(at % 3)
                ));
            }
        }
        // Bytes just past the escaped ones: space, `#`, `]`, DEL, and the high bit set.
        samples.push(" #]\u{7f}\u{ff} #]\u{7f}\u{ff}".to_string());
        for sample in &samples {
            let mut canon = Canonical::new();
            let escaped = canon.string(sample);
            let expected = serde_json::to_vec(sample).expect("a string serialises");
            assert_eq!(canon.out, expected, "{sample:?}");
            assert_eq!(escaped, expected.contains(&b'\\'), "{sample:?}");
        }
    }

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
    pub(super) fn reference(method: &str, path: &str, body: &[u8]) -> Fingerprint {
        use serde_json::Value;
        fn write_json(h: &mut Sha256, value: &Value) {
            h.update(serde_json::to_vec(value).expect("a Value serialises"));
        }
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
            // A key that another key extends with a character below `"` (space, `!`), or with `"`
            // itself, which is written escaped.
            br#"{"a ":1,"a":2,"a!":3,"a\"":4,"a#":5,"":6}"#,
            br#"{"a":{"a":1,"a ":2},"a ":[{"x!":1,"x":2}]}"#,
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

    /// A JSON document as a client might write it: members in any order, some keys repeated.
    #[derive(Debug, Clone)]
    pub(super) enum Doc {
        Scalar(serde_json::Value),
        Array(Vec<Doc>),
        Object(Vec<(String, Doc)>),
    }

    impl Doc {
        /// The document as text, members in their order, with whitespace between tokens if `spaced`.
        pub(super) fn write(&self, spaced: bool, out: &mut String) {
            let gap = if spaced { " \n" } else { "" };
            let text =
                |v: &serde_json::Value| serde_json::to_string(v).expect("a Value serialises");
            match self {
                Doc::Scalar(v) => out.push_str(&text(v)),
                Doc::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        out.push_str(gap);
                        item.write(spaced, out);
                    }
                    out.push(']');
                }
                Doc::Object(members) => {
                    out.push('{');
                    for (i, (key, value)) in members.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        out.push_str(gap);
                        out.push_str(&text(&serde_json::Value::String(key.clone())));
                        out.push_str(gap);
                        out.push(':');
                        value.write(spaced, out);
                    }
                    out.push_str(gap);
                    out.push('}');
                }
            }
        }
    }

    /// Nested documents with escapes, non-ASCII text, strings longer than a SHA-256 block, and
    /// objects whose keys are out of order or repeated.
    pub(super) fn any_doc() -> impl proptest::strategy::Strategy<Value = Doc> {
        use proptest::prelude::*;
        use serde_json::Value;
        let text = prop_oneof!["[a-z\"\\\\\n\u{e9}\u{1F600}]{0,12}", "[a-z]{60,300}"];
        // Space, `!` and `#` sort next to `"`, whose escape sorts elsewhere.
        let key = prop_oneof!["[abc]", "[ !#a-c\"\\\\\n\u{e9}]{0,6}"];
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
                proptest::collection::vec((key.clone(), inner), 0..8).prop_map(Doc::Object),
            ]
        })
    }

    proptest::proptest! {
        /// Whatever the document, compact or spaced out, the fingerprint is the reference
        /// implementation's.
        #[test]
        fn any_document_hashes_as_the_reference_does(doc in any_doc()) {
            for spaced in [false, true] {
                let mut body = String::new();
                doc.write(spaced, &mut body);
                proptest::prop_assert_eq!(
                    Fingerprint::of_request("POST", "/p", JSON, body.as_bytes()),
                    reference("POST", "/p", body.as_bytes()),
                    "{}", body
                );
            }
        }
    }

    /// `depth` objects inside one another, each `{"z":<the next>,"a":1}`: out of key order at every
    /// level, with `text` innermost.
    fn nested_out_of_order(depth: usize, text: &str) -> String {
        let mut body = format!("{text:?}");
        for _ in 0..depth {
            body = format!(r#"{{"z":{body},"a":1}}"#);
        }
        body
    }

    #[test]
    fn deep_objects_out_of_order_hash_as_the_reference_does() {
        // serde_json's parser stops at 128 levels: deeper bodies are hashed byte for byte.
        for depth in [1, 2, 64, 127, 128, 200] {
            let body = nested_out_of_order(depth, &"x".repeat(300));
            assert_eq!(
                Fingerprint::of_request("POST", "/p", JSON, body.as_bytes()),
                reference("POST", "/p", body.as_bytes()),
                "depth {depth}"
            );
        }
    }

    #[test]
    fn the_thread_buffer_carries_nothing_from_one_body_to_the_next() {
        let large = format!(r#"{{"z":"{}","a":[1,2,3]}}"#, "x".repeat(2 * KEEP));
        let bodies: [&[u8]; 5] = [
            br#"{"b":1,"a":{"d":2,"c":3}"#, // cut short: hashed byte for byte
            br#"{"b":1,"a":2}"#,
            large.as_bytes(), // grows the buffer past what a thread keeps
            br#"{"b":1,"a":2}"#,
            br#"[{"y":1,"x":2},"#,
        ];
        for body in bodies {
            assert_eq!(
                Fingerprint::of_request("POST", "/p", JSON, body),
                reference("POST", "/p", body),
                "{}",
                String::from_utf8_lossy(&body[..body.len().min(40)])
            );
        }
    }

    #[test]
    fn an_object_left_open_is_hashed_in_finite_time() {
        // Never hashed by the parses (a parse that fails is not hashed), but a mistake must not
        // loop: an object out of key order around one never closed.
        let mut canon = Canonical::new();
        canon.start(0);
        let outer = canon.open_object();
        let z = canon.member_key(outer, Cow::Borrowed("z"));
        let _never_closed = canon.open_object();
        canon.member_end(z);
        let a = canon.member_key(outer, Cow::Borrowed("a"));
        canon.scalar(&1);
        canon.member_end(a);
        canon.close_object(outer);
        assert!(canon.objects.iter().any(|o| o.reordered.is_some()));
        let mut h = Sha256::new();
        canon.finish(&mut h);
        let _ = h.finalize();
    }

    #[test]
    fn hex_round_trips() {
        let a = Fingerprint::of_request("POST", "/p", None, b"x");
        assert_eq!(Fingerprint::from_hex(&a.to_hex()), Some(a));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }
}
