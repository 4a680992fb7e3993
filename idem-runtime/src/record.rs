//! What a store keeps per key: the claim, and once completed, the response to replay.

use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use std::borrow::Cow;
use std::fmt;

/// A key as stored: the caller's scope plus the client's key. Two scopes never share a record.
///
/// Both parts come from callers (a scope is often a user or tenant id, taken from a token), so
/// each is bounded to [`MAX_PART`](Self::MAX_PART) bytes whatever they send: a longer part is
/// stored as its first bytes, kept readable for operators, then its SHA-256, exactly
/// `MAX_PART + 1` bytes in all. A part kept as it is never reaches that length, so no two
/// different (scope, key) pairs share a stored key, and every store's limits hold (PostgreSQL's
/// index rows, Redis keys).
///
/// ```
/// use idem_runtime::RecordKey;
/// let long = "u".repeat(3000);
/// let key = RecordKey::new(long.clone(), "order-42");
/// assert_eq!(key.scope().len(), RecordKey::MAX_PART + 1);
/// assert!(key.scope().starts_with("uuuu"));
/// assert_ne!(key, RecordKey::new(long + "v", "order-42"));
/// assert_eq!(RecordKey::new("user-7", "order-42").scope(), "user-7");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey {
    scope: String,
    key: String,
}

impl RecordKey {
    /// The longest scope or key stored as it is, in bytes.
    pub const MAX_PART: usize = 255;

    /// A key for `key` within `scope`, each part bounded to [`MAX_PART`](Self::MAX_PART) bytes.
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Self {
        let key = key.into();
        // A key that starts with the namespace mark gets a second one, so that it can never take
        // the form of a derived key (a client's key is ASCII and never starts with it).
        let key = match key.starts_with(NAMESPACE) {
            true => format!("{NAMESPACE}{key}"),
            false => key,
        };
        Self {
            scope: bounded(scope.into()),
            key: bounded(key),
        }
    }

    /// A key derived from the request itself (`missing_key = "derive"`), from its fingerprint in
    /// hex: in a namespace of its own (`§derived …`), which no key given to [`new`](Self::new),
    /// and no `Idempotency-Key` header, can name.
    pub fn derived(scope: impl Into<String>, fingerprint_hex: &str) -> Self {
        Self {
            scope: bounded(scope.into()),
            key: bounded(format!("{NAMESPACE}derived {fingerprint_hex}")),
        }
    }

    /// A key read from `source`: for the `Idempotency-Key` header, [`new`](Self::new); for any
    /// other source, in that source's namespace (`§header webhook-id …`, `§body /id …`), which no
    /// other source, no derived key and no `Idempotency-Key` header can name.
    ///
    /// ```
    /// use idem_runtime::{source::KeySource, RecordKey};
    /// let header = RecordKey::sourced("global", &KeySource::Header("webhook-id"), "msg_1");
    /// let body = RecordKey::sourced("global", &KeySource::BodyField("/id"), "msg_1");
    /// let client = RecordKey::sourced("global", &KeySource::IdempotencyKey, "msg_1");
    /// assert_ne!(header, body);
    /// assert_ne!(header, client);
    /// assert_eq!(client, RecordKey::new("global", "msg_1"));
    /// ```
    pub fn sourced(scope: impl Into<String>, source: &crate::source::KeySource, key: &str) -> Self {
        match source.namespace() {
            None => Self::new(scope, key),
            Some(namespace) => Self {
                scope: bounded(scope.into()),
                key: bounded(format!("{NAMESPACE}{namespace} {key}")),
            },
        }
    }

    /// A key read back from a store, already bounded (bounding it again would hash a hashed part).
    #[cfg(any(
        feature = "postgres",
        feature = "redis",
        feature = "sqlite",
        feature = "mysql"
    ))]
    pub(crate) fn stored(scope: String, key: String) -> Self {
        Self { scope, key }
    }

    /// Who is asking (bounded): a user or tenant id, or `"global"` for handlers that opted out of
    /// scoping.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The client's `Idempotency-Key`, or a derived key (bounded).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// A key to pass on to the services this request's handler calls (a payment provider's own
    /// `Idempotency-Key`, a message id), for the record of this key with `fingerprint` first
    /// claimed at `created_at` and expiring at `expires_at`: the same for every attempt at that
    /// record, whichever instance runs it and however often it is taken over or resumed after a
    /// release, and different for every other scope, key or request, and for every later record
    /// under the same key text (a later window of a derived key, a key sent again after its record
    /// expired). It is `idem_` and 32 hex digits of a SHA-256 over all of these, so it reveals none
    /// of them and fits every provider's limit.
    ///
    /// Records are told apart by their ttl window: the creation divided by the ttl. A later record
    /// under the same key text is created at least a ttl after the first (the first must expire, or
    /// be released by another request, whose fingerprint differs), so it lands in a later window; a
    /// record that a store lost (a restart without persistence) and that a retry claims again soon
    /// after lands in the same window, and keeps its downstream key, unless the window ended in
    /// between.
    ///
    /// ```
    /// use idem_runtime::{clock::Timestamp, Fingerprint, RecordKey};
    /// use std::time::Duration;
    /// let fp = Fingerprint::of_request("POST", "/payments", None, b"1000 KRW");
    /// let ttl = Duration::from_secs(24 * 3600);
    /// let at = Timestamp::from_millis(1_800_000_000_000);
    /// let key = RecordKey::new("user-7", "order-42");
    /// let first = key.downstream_key(&fp, at, at + ttl);
    /// assert_eq!(first, RecordKey::new("user-7", "order-42").downstream_key(&fp, at, at + ttl));
    /// assert_ne!(first, RecordKey::new("user-8", "order-42").downstream_key(&fp, at, at + ttl));
    /// // The same key text a ttl later: another record, another downstream key.
    /// let later = at + ttl;
    /// assert_ne!(first, key.downstream_key(&fp, later, later + ttl));
    /// assert_eq!(first.len(), 37);
    /// ```
    pub fn downstream_key(
        &self,
        fingerprint: &Fingerprint,
        created_at: Timestamp,
        expires_at: Timestamp,
    ) -> String {
        use sha2::{Digest, Sha256};
        let ttl = expires_at
            .as_millis()
            .saturating_sub(created_at.as_millis());
        let window = match ttl {
            1.. => created_at.as_millis().div_euclid(ttl),
            _ => created_at.as_millis(),
        };
        let digest = Sha256::new()
            .chain_update(b"idem downstream key\0")
            .chain_update((self.scope.len() as u64).to_be_bytes())
            .chain_update(&self.scope)
            .chain_update((self.key.len() as u64).to_be_bytes())
            .chain_update(&self.key)
            .chain_update(fingerprint.0)
            .chain_update(window.to_be_bytes())
            .finalize();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("idem_{hex}")
    }
}

/// The first character of a derived key, doubled at the start of any other key that begins with it.
const NAMESPACE: char = '§';

/// `part` as stored: itself up to `MAX_PART` bytes, else its readable head and its SHA-256 in
/// exactly `MAX_PART + 1` bytes.
fn bounded(part: String) -> String {
    if part.len() <= RecordKey::MAX_PART {
        return part;
    }
    use sha2::{Digest, Sha256};
    let hex: String = Sha256::digest(part.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // The head, cut on a character boundary, padded to the fixed length with `~`.
    let room = RecordKey::MAX_PART + 1 - hex.len() - 1;
    let mut cut = room;
    while !part.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut out = String::with_capacity(RecordKey::MAX_PART + 1);
    out.push_str(&part[..cut]);
    out.extend(std::iter::repeat_n('~', room - cut + 1));
    out.push_str(&hex);
    out
}

impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.key)
    }
}

/// Identifies one claim of a key. A completion or release carrying an older token than the record's
/// (a worker whose lease ran out and whose claim was taken over) is refused.
///
/// Tokens are random, not counters, so that a key released and claimed afresh never hands an old
/// worker's token to a new claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub i64);

impl FencingToken {
    /// A fresh token: 63 random bits (positive, so it fits a signed SQL column unchanged).
    pub fn generate() -> Self {
        use std::cell::Cell;
        use std::collections::hash_map::RandomState;
        use std::hash::BuildHasher;
        thread_local! {
            // Each thread hashes its own counter under its own RandomState keys (random, drawn by
            // the standard library from the OS for each thread): distinct, unpredictable values
            // without a rand dependency, and without a counter shared by every core (whose cache
            // line would move between the cores on every claim).
            static KEYS: RandomState = RandomState::new();
            static COUNTER: Cell<u64> = const { Cell::new(0) };
        }
        let n = COUNTER.with(|c| {
            let n = c.get();
            c.set(n.wrapping_add(1));
            n
        });
        Self((KEYS.with(|keys| keys.hash_one(n)) >> 1) as i64)
    }
}

/// The response stored for replay.
///
/// The headers are `http`'s own types (re-exported as [`idem_runtime::http`](crate::http)),
/// checked once when the response is captured: a replay hands them to the response as they are,
/// and a store that keeps them as bytes (memory, Redis) shares its buffer with them instead of
/// copying each one into a string of its own. Every store keeps every value byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// Replayable headers, in the order `http`'s `HeaderMap` yields them (a name's values together).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body (empty in minimal mode unless the resource id was found).
    pub body: Bytes,
}

impl StoredResponse {
    /// Encodes the headers for a text column: a JSON array of `[name, value]` string pairs.
    ///
    /// A value is written as ISO-8859-1 text, each byte the character of that code point, as
    /// HTTP/1.1 first defined header text: a value of visible ASCII (all that most responses carry)
    /// is written as it is, and one with other bytes (obs-text) still comes back byte for byte.
    pub fn encode_headers(&self) -> String {
        let pairs: Vec<(&str, Cow<'_, str>)> = self
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), latin1(value.as_bytes())))
            .collect();
        serde_json::to_string(&pairs).unwrap_or_else(|_| "[]".to_owned())
    }

    /// Decodes [`encode_headers`](Self::encode_headers) output. Text that is not such an array, or a
    /// pair that is not a valid header name and value, is an error: a store reports it as
    /// [`Corrupt`](crate::store::StoreErrorKind::Corrupt) rather than replay part of a response.
    ///
    /// ```
    /// use idem_runtime::StoredResponse;
    ///
    /// let headers = StoredResponse::decode_headers(r#"[["location","/payments/1"]]"#)?;
    /// assert_eq!(headers[0].0, "location");
    /// assert_eq!(headers[0].1, "/payments/1");
    /// assert!(StoredResponse::decode_headers(r#"[["bad name","x"]]"#).is_err());
    /// # Ok::<(), idem_runtime::record::HeaderDecodeError>(())
    /// ```
    pub fn decode_headers(s: &str) -> Result<Vec<(HeaderName, HeaderValue)>, HeaderDecodeError> {
        let pairs: Vec<(String, String)> =
            serde_json::from_str(s).map_err(|e| HeaderDecodeError(e.to_string()))?;
        pairs
            .into_iter()
            .map(|(name, value)| {
                let value = if value.is_ascii() {
                    Bytes::from(value)
                } else {
                    value
                        .chars()
                        .map(u8::try_from)
                        .collect::<Result<Vec<u8>, _>>()
                        .map_err(|_| {
                            HeaderDecodeError(format!(
                                "the value of {} holds a character beyond ISO-8859-1",
                                shown(name.as_bytes())
                            ))
                        })?
                        .into()
                };
                header(name.as_bytes(), value)
            })
            .collect()
    }
}

/// `bytes` as ISO-8859-1 text: borrowed when they are ASCII.
fn latin1(bytes: &[u8]) -> Cow<'_, str> {
    match std::str::from_utf8(bytes) {
        Ok(ascii) if bytes.is_ascii() => Cow::Borrowed(ascii),
        _ => Cow::Owned(bytes.iter().map(|&b| char::from(b)).collect()),
    }
}

/// At most the first 64 bytes of a stored name, for an error message (a corrupt length may
/// claim gigabytes).
fn shown(name: &[u8]) -> String {
    let cut = &name[..name.len().min(64)];
    let more = if name.len() > cut.len() { "…" } else { "" };
    format!("{:?}{more}", String::from_utf8_lossy(cut))
}

/// One stored header from its name's bytes and its value's, which the value keeps without a copy.
pub(crate) fn header(
    name: &[u8],
    value: Bytes,
) -> Result<(HeaderName, HeaderValue), HeaderDecodeError> {
    let name = HeaderName::from_bytes(name)
        .map_err(|_| HeaderDecodeError(format!("{} is not a header name", shown(name))))?;
    let value = HeaderValue::from_maybe_shared(value)
        .map_err(|_| HeaderDecodeError(format!("the value of {name} is not a header value")))?;
    Ok((name, value))
}

/// Whether `http` accepts `b` in a header value: any byte but the control characters, tab aside
/// (visible ASCII, space and obs-text). For the tests that build values of arbitrary bytes.
#[cfg(test)]
pub(crate) fn is_value_byte(b: u8) -> bool {
    b == b'\t' || (b >= 0x20 && b != 0x7f)
}

/// Stored headers that do not decode: see [`StoredResponse::decode_headers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderDecodeError(String);

impl fmt::Display for HeaderDecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored headers do not decode: {}", self.0)
    }
}

impl std::error::Error for HeaderDecodeError {}

/// Where a record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed; the handler is (presumably) running until `lease_until`.
    InFlight {
        /// After this instant the claim may be taken over.
        lease_until: Timestamp,
    },
    /// The handler finished; this is what retries get.
    Completed {
        /// The stored response.
        response: StoredResponse,
    },
    /// Its run gave the key back (a 5xx, a panic, a refused body): a retry of the same request runs
    /// again as the same record (same times, same downstream key); another request under the key
    /// replaces it.
    Released,
}

/// One key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The current claim's token.
    pub token: FencingToken,
    /// When the key was first claimed.
    pub created_at: Timestamp,
    /// When the key stops being replayed and answers "expired".
    pub expires_at: Timestamp,
    /// When the record may be purged; until then an expired key is remembered as a tombstone.
    pub retain_until: Timestamp,
    /// In flight or completed.
    pub state: RecordState,
}

impl Record {
    /// Whether the record is past retention and counts as absent.
    pub fn is_forgotten(&self, now: Timestamp) -> bool {
        self.retain_until <= now
    }
}

#[cfg(test)]
mod tests {
    use super::{FencingToken, StoredResponse};
    use http::header::{HeaderName, HeaderValue, ETAG, LOCATION};
    use std::collections::HashSet;

    #[test]
    fn stored_headers_survive_their_text_column() {
        let response = StoredResponse {
            status: 201,
            headers: vec![
                (LOCATION, HeaderValue::from_static("/payments/1?a=b&c=\\d")),
                (ETAG, HeaderValue::from_static("\"v1\"")),
                (
                    HeaderName::from_static("x-empty"),
                    HeaderValue::from_static(""),
                ),
                (LOCATION, HeaderValue::from_static("/second")),
            ],
            body: Default::default(),
        };
        let text = response.encode_headers();
        assert_eq!(
            StoredResponse::decode_headers(&text).expect("decodes"),
            response.headers
        );
        // Names are compared as `http` keeps them: lower case, whatever case was stored.
        let upper = StoredResponse::decode_headers(r#"[["Location","/p"]]"#).expect("decodes");
        assert_eq!(upper, vec![(LOCATION, HeaderValue::from_static("/p"))]);
    }

    #[test]
    fn a_value_of_any_bytes_survives_the_text_column() {
        let every_byte: Vec<u8> = (0u8..=255).filter(|&b| super::is_value_byte(b)).collect();
        let response = StoredResponse {
            status: 200,
            headers: vec![(
                HeaderName::from_static("x-bytes"),
                HeaderValue::from_bytes(&every_byte).expect("no control character"),
            )],
            body: Default::default(),
        };
        let text = response.encode_headers();
        assert_eq!(
            StoredResponse::decode_headers(&text).expect("decodes"),
            response.headers
        );
        // Visible ASCII is written as it is.
        let plain = StoredResponse {
            headers: vec![(LOCATION, HeaderValue::from_static("/p/1"))],
            ..response
        };
        assert_eq!(plain.encode_headers(), r#"[["location","/p/1"]]"#);
    }

    #[test]
    fn stored_headers_that_are_not_headers_do_not_decode() {
        for text in [
            "",
            "{}",
            r#"[["location"]]"#,
            r#"[["", "x"]]"#,
            r#"[["bad name", "x"]]"#,
            r#"[["location", "line\nbreak"]]"#,
            r#"[["location", "nul\u0000"]]"#,
            // A character beyond ISO-8859-1 is no byte of a header value.
            r#"[["location", "값"]]"#,
        ] {
            assert!(
                StoredResponse::decode_headers(text).is_err(),
                "{text:?} decoded"
            );
        }
    }

    #[test]
    fn tokens_are_positive_and_distinct_across_threads() {
        let per_thread: Vec<Vec<FencingToken>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..10_000).map(|_| FencingToken::generate()).collect()))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("token thread"))
                .collect()
        });
        let all: Vec<FencingToken> = per_thread.into_iter().flatten().collect();
        assert!(
            all.iter().all(|t| t.0 >= 0),
            "tokens fit a signed column unchanged"
        );
        let distinct: HashSet<i64> = all.iter().map(|t| t.0).collect();
        assert_eq!(distinct.len(), all.len());
    }
}
