//! The record as one Redis string: a fixed 75-byte header, then, once completed, the response.
//!
//! ```text
//! offset  bytes  field
//!      0      1  layout version: 1
//!      1      1  state: b'F' in flight, b'D' done, b'R' released
//!      2      1  watched: 1 once a duplicate announced it waits (meaningful in flight), else 0
//!      3      8  fencing token
//!     11      8  created_at     ms since the Unix epoch
//!     19      8  expires_at     ms
//!     27      8  retain_until   ms
//!     35      8  lease_until    ms (a completed record keeps its last lease; it is ignored)
//!     43     32  fingerprint
//!     75         end of an in-flight record
//! done only:
//!     75      2  status
//!     77      4  number of headers n
//!     81         n times: name length (4), name (a header name, lower case), value length (4),
//!                value (a header value's bytes)
//!      …         the body: every byte to the end
//! ```
//!
//! Integers are big-endian, times signed. The fields the scripts read (state, watched, token, retain)
//! sit at fixed offsets, so a script checks a claim or a retention by slicing, without decoding the
//! rest; `settle.lua` turns an in-flight record into a completed one by changing the state byte and
//! appending a [`Response`], or into a released one by changing the state byte alone, and
//! `claim.lua` writes a fresh header or a taken-over one. A change to the layout must change the
//! version: the decoder refuses every other version as corrupt, and so do the scripts.

use super::super::{StateKind, StoreError};
use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordState, StoredResponse};
use ::redis::{RedisWrite, ToRedisArgs};
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use std::io;

/// The layout version this module writes and reads.
pub(super) const VERSION: u8 = 1;
const IN_FLIGHT: u8 = b'F';
const DONE: u8 = b'D';
const RELEASED: u8 = b'R';
/// The length of the header, and of a whole in-flight record.
pub(super) const HEADER_LEN: usize = 75;

const STATE: usize = 1;
const WATCHED: usize = 2;
const TOKEN: usize = 3;
const CREATED: usize = 11;
const EXPIRES: usize = 19;
const RETAIN: usize = 27;
const LEASE: usize = 35;
const FINGERPRINT: usize = 43;

/// `record` as stored, not watched. A completed record's lease field is 0. (The scripts write
/// records; this is for the tests and the fuzz targets.)
#[cfg(any(test, fuzzing))]
pub(super) fn encode(record: &Record) -> Result<Vec<u8>, StoreError> {
    match &record.state {
        RecordState::InFlight { lease_until } => {
            Ok(header(record, IN_FLIGHT, *lease_until).to_vec())
        }
        RecordState::Completed { response } => {
            let response = Response::new(response)?;
            let mut out = Vec::with_capacity(HEADER_LEN + response.len());
            out.extend_from_slice(&header(record, DONE, Timestamp::from_millis(0)));
            // Writing into a Vec cannot fail.
            let _ = response.write(&mut out);
            Ok(out)
        }
        RecordState::Released => Ok(header(record, RELEASED, Timestamp::from_millis(0)).to_vec()),
    }
}

#[cfg(any(test, fuzzing))]
fn header(record: &Record, state: u8, lease: Timestamp) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0] = VERSION;
    out[STATE] = state;
    out[TOKEN..TOKEN + 8].copy_from_slice(&record.token.0.to_be_bytes());
    for (at, time) in [
        (CREATED, record.created_at),
        (EXPIRES, record.expires_at),
        (RETAIN, record.retain_until),
        (LEASE, lease),
    ] {
        out[at..at + 8].copy_from_slice(&time.as_millis().to_be_bytes());
    }
    out[FINGERPRINT..].copy_from_slice(&record.fingerprint.0);
    out
}

/// How the scripts compare a token: its 8 stored bytes.
pub(super) fn token(token: FencingToken) -> [u8; 8] {
    token.0.to_be_bytes()
}

/// The state byte of a record of kind `state`, as `forget.lua` compares it.
pub(super) fn state(state: StateKind) -> &'static [u8] {
    match state {
        StateKind::InFlight => &[IN_FLIGHT],
        StateKind::Completed => &[DONE],
        StateKind::Released => &[RELEASED],
    }
}

/// A completed record's tail: what `settle.lua` appends to the header. As a command argument
/// it is written straight into the command, without a buffer of its own.
#[derive(Clone, Copy)]
pub(super) struct Response<'a>(&'a StoredResponse);

impl<'a> Response<'a> {
    /// Fails if a length does not fit the layout's 4 bytes (a header of 4 GiB).
    pub(super) fn new(response: &'a StoredResponse) -> Result<Self, StoreError> {
        let fits = |n: usize| u32::try_from(n).is_ok();
        if fits(response.headers.len())
            && response
                .headers
                .iter()
                .all(|(name, value)| fits(name.as_str().len()) && fits(value.len()))
        {
            Ok(Self(response))
        } else {
            Err(StoreError::corrupt(
                "a response header is too long to store (4 GiB)",
            ))
        }
    }

    /// The encoded length.
    pub(super) fn len(&self) -> usize {
        6 + self
            .0
            .headers
            .iter()
            .map(|(name, value)| 8 + name.as_str().len() + value.len())
            .sum::<usize>()
            + self.0.body.len()
    }

    fn write(&self, out: &mut impl io::Write) -> io::Result<()> {
        // Lengths were checked by `new`.
        let len = |n: usize| (n as u32).to_be_bytes();
        let r = self.0;
        out.write_all(&r.status.to_be_bytes())?;
        out.write_all(&len(r.headers.len()))?;
        for (name, value) in &r.headers {
            out.write_all(&len(name.as_str().len()))?;
            out.write_all(name.as_str().as_bytes())?;
            out.write_all(&len(value.len()))?;
            out.write_all(value.as_bytes())?;
        }
        out.write_all(&r.body)
    }
}

impl ToRedisArgs for Response<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        // Writing into a command's buffer cannot fail.
        let _ = self.write(&mut out.writer_for_next_arg());
    }
}

/// Decodes a stored record; any bytes that are not one [`encode`] could have written (or
/// `settle.lua` made of one) are [`Corrupt`](super::super::StoreErrorKind::Corrupt). The header
/// values and the body are sliced out of `blob` without a copy.
pub(super) fn decode(blob: Vec<u8>) -> Result<Record, StoreError> {
    let Some(header) = blob.first_chunk::<HEADER_LEN>() else {
        return Err(corrupt(format!(
            "{} bytes, shorter than the {HEADER_LEN}-byte header",
            blob.len()
        )));
    };
    if header[0] != VERSION {
        return Err(corrupt(format!(
            "layout version {}, expected {VERSION}",
            header[0]
        )));
    }
    if header[WATCHED] > 1 {
        return Err(corrupt(format!("watched flag {}", header[WATCHED])));
    }
    let int = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&header[at..at + 8]);
        i64::from_be_bytes(b)
    };
    let time = |at: usize| Timestamp::from_millis(int(at));
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&header[FINGERPRINT..]);
    let (token, created_at, expires_at, retain_until) = (
        FencingToken(int(TOKEN)),
        time(CREATED),
        time(EXPIRES),
        time(RETAIN),
    );
    let state = match header[STATE] {
        IN_FLIGHT if blob.len() == HEADER_LEN => RecordState::InFlight {
            lease_until: time(LEASE),
        },
        IN_FLIGHT => return Err(corrupt("bytes after an in-flight record's header")),
        RELEASED if blob.len() == HEADER_LEN => RecordState::Released,
        RELEASED => return Err(corrupt("bytes after a released record's header")),
        DONE => {
            // The header values and the body share the blob's allocation instead of copying it.
            let blob = Bytes::from(blob);
            let Tail {
                status,
                headers,
                body_at,
            } = decode_tail(&blob)?;
            RecordState::Completed {
                response: StoredResponse {
                    status,
                    headers,
                    body: blob.slice(body_at..),
                },
            }
        }
        other => return Err(corrupt(format!("state byte {other:#04x}"))),
    };
    Ok(Record {
        fingerprint: Fingerprint(fingerprint),
        token,
        created_at,
        expires_at,
        retain_until,
        state,
    })
}

/// Decodes a record from its header alone (what `peek.lua` returns), for listings and counts: a
/// completed record's response is not read, and comes back empty (status 0, no headers, no body).
pub(super) fn summary(header: Vec<u8>) -> Result<Record, StoreError> {
    if header.len() != HEADER_LEN || header[STATE] != DONE {
        return decode(header);
    }
    let mut released = header;
    released[STATE] = RELEASED;
    Ok(Record {
        state: RecordState::Completed {
            response: StoredResponse {
                status: 0,
                headers: Vec::new(),
                body: Bytes::new(),
            },
        },
        ..decode(released)?
    })
}

/// What follows a completed record's header, up to its body.
struct Tail {
    status: u16,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// Where the body starts in the blob.
    body_at: usize,
}

fn decode_tail(blob: &Bytes) -> Result<Tail, StoreError> {
    let mut rest = &blob[HEADER_LEN..];
    let status = u16::from_be_bytes(take::<2>(&mut rest, "status")?);
    let count = u32::from_be_bytes(take::<4>(&mut rest, "header count")?);
    // Each header takes at least 8 bytes: a count beyond that is corrupt, and never allocated.
    if u64::from(count) * 8 > rest.len() as u64 {
        return Err(corrupt(format!("{count} headers in {} bytes", rest.len())));
    }
    let mut headers = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let name = field(&mut rest, "header name")?;
        let value = blob.slice_ref(field(&mut rest, "header value")?);
        headers.push(crate::record::header(name, value).map_err(|e| corrupt(e.to_string()))?);
    }
    Ok(Tail {
        status,
        headers,
        body_at: blob.len() - rest.len(),
    })
}

fn take<const N: usize>(rest: &mut &[u8], what: &str) -> Result<[u8; N], StoreError> {
    let Some((head, tail)) = rest.split_first_chunk::<N>() else {
        return Err(corrupt(format!("truncated {what}")));
    };
    *rest = tail;
    Ok(*head)
}

/// A length-prefixed field off the front of `rest`.
fn field<'a>(rest: &mut &'a [u8], what: &str) -> Result<&'a [u8], StoreError> {
    let len = u32::from_be_bytes(take::<4>(rest, what)?) as usize;
    let Some((bytes, tail)) = rest.split_at_checked(len) else {
        return Err(corrupt(format!("truncated {what}")));
    };
    *rest = tail;
    Ok(bytes)
}

fn corrupt(why: impl Into<String>) -> StoreError {
    StoreError::corrupt(format!("redis record: {}", why.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;
    use proptest::prelude::*;

    fn record(state: RecordState) -> Record {
        Record {
            fingerprint: Fingerprint([7; 32]),
            token: FencingToken(9_007_199_254_740_993),
            created_at: Timestamp::from_millis(1_800_000_000_000),
            expires_at: Timestamp::from_millis(1_800_003_600_000),
            retain_until: Timestamp::from_millis(-1),
            state,
        }
    }

    fn completed() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                (http::header::LOCATION, HeaderValue::from_static("/p/1")),
                (
                    HeaderName::from_static("x-empty"),
                    HeaderValue::from_static(""),
                ),
                (
                    HeaderName::from_static("x-obs-text"),
                    HeaderValue::from_bytes(&[0xea, 0xb0, 0x92, 0xff])
                        .expect("obs-text is a value"),
                ),
            ],
            body: Bytes::from_static(&[0, 255, b'{', b'}']),
        }
    }

    fn is_corrupt(value: Vec<u8>) -> bool {
        matches!(decode(value), Err(e) if e.kind() == StoreErrorKind::Corrupt)
    }

    #[test]
    fn records_round_trip() {
        for state in [
            RecordState::InFlight {
                lease_until: Timestamp::from_millis(i64::MAX),
            },
            RecordState::Completed {
                response: completed(),
            },
            RecordState::Completed {
                response: StoredResponse {
                    status: 204,
                    headers: vec![],
                    body: Bytes::new(),
                },
            },
        ] {
            let record = record(state);
            let value = encode(&record).expect("encodes");
            assert_eq!(decode(value).expect("decodes"), record);
        }
    }

    /// The scripts slice the value at fixed offsets (Lua strings count from 1): state at 2, watched
    /// at 3, the token at 4..11, retain_until at 28..35; and `settle.lua` completes a record by
    /// changing byte 2 to `D` and appending [`response`].
    #[test]
    fn the_fields_sit_where_the_scripts_read_them() {
        let in_flight = record(RecordState::InFlight {
            lease_until: Timestamp::from_millis(5),
        });
        let value = encode(&in_flight).expect("encodes");
        assert_eq!(value.len(), HEADER_LEN);
        assert_eq!(value[0], VERSION);
        assert_eq!(&value[1..2], state(StateKind::InFlight));
        assert_eq!(&value[1..2], b"F");
        assert_eq!(value[2], 0, "not watched");
        assert_eq!(value[3..11], token(in_flight.token));
        assert_eq!(value[27..35], (-1i64).to_be_bytes());

        // What settle.lua does, and announce.lua before it.
        let mut done = value.clone();
        done[1] = b'D';
        done[2] = 1;
        let tail = completed();
        let tail = Response::new(&tail).expect("fits");
        let mut arg = Vec::new();
        tail.write_redis_args(&mut arg);
        assert_eq!(arg.len(), 1, "one argument");
        assert_eq!(arg[0].len(), tail.len());
        done.extend_from_slice(&arg[0]);
        let done_header = done[..HEADER_LEN].to_vec();
        let decoded = decode(done).expect("a completed record");
        assert_eq!(
            decoded,
            Record {
                state: RecordState::Completed {
                    response: completed()
                },
                ..in_flight
            }
        );
        assert_eq!(state(StateKind::of(&decoded.state)), b"D");
        assert_eq!(
            summary(done_header).expect("a header").state,
            RecordState::Completed {
                response: StoredResponse {
                    status: 0,
                    headers: vec![],
                    body: Bytes::new()
                }
            },
            "a completed record's header alone"
        );
        assert_eq!(summary(value.clone()).expect("in flight"), in_flight);
    }

    #[test]
    fn anything_else_is_corrupt() {
        let value = encode(&record(RecordState::Completed {
            response: completed(),
        }))
        .expect("encodes");
        let in_flight = encode(&record(RecordState::InFlight {
            lease_until: Timestamp::from_millis(5),
        }))
        .expect("encodes");
        let with = |at: usize, byte: u8| {
            let mut v = value.clone();
            v[at] = byte;
            v
        };
        assert!(is_corrupt(Vec::new()));
        assert!(is_corrupt(b"not a record".to_vec()));
        assert!(is_corrupt(value[..HEADER_LEN - 1].to_vec()), "short header");
        assert!(is_corrupt(with(0, 2)), "another layout version");
        assert!(is_corrupt(with(1, b'X')), "unknown state");
        assert!(is_corrupt(with(2, 2)), "watched is 0 or 1");
        assert!(
            is_corrupt([&in_flight[..], b"x"].concat()),
            "trailing bytes"
        );
        let mut done_without_response = in_flight.clone();
        done_without_response[1] = b'D';
        assert!(is_corrupt(done_without_response), "no status");
        // Header count 0xffff_ffff: refused before anything is allocated for it.
        assert!(is_corrupt(with(HEADER_LEN + 2, 0xff)));
        // A name length running past the end.
        assert!(is_corrupt(with(HEADER_LEN + 6, 0xff)));
        // A header name that is not one: a byte no name has, then a space ("location" starts at
        // HEADER_LEN + 10); and a value with a control character (the first value at + 22).
        assert!(is_corrupt(with(HEADER_LEN + 10, 0xff)));
        assert!(is_corrupt(with(HEADER_LEN + 10, b' ')));
        assert!(is_corrupt(with(HEADER_LEN + 22, b'\n')));
        for cut in HEADER_LEN + 1..HEADER_LEN + 20 {
            assert!(is_corrupt(value[..cut].to_vec()), "truncated at {cut}");
        }
    }

    /// Any header `http` accepts: a lower-case token for the name, and for the value any bytes but
    /// the control characters (tab aside), obs-text included.
    fn any_header() -> impl Strategy<Value = (HeaderName, HeaderValue)> {
        let value_byte =
            any::<u8>().prop_filter("a value byte", |b| crate::record::is_value_byte(*b));
        (
            "[a-z0-9!#$%&'*+.^_`|~-]{1,12}",
            proptest::collection::vec(value_byte, 0..24),
        )
            .prop_map(|(name, value)| {
                (
                    HeaderName::from_bytes(name.as_bytes()).expect("a token is a name"),
                    HeaderValue::from_bytes(&value).expect("no control character"),
                )
            })
    }

    fn any_record() -> impl Strategy<Value = Record> {
        let response = (
            any::<u16>(),
            proptest::collection::vec(any_header(), 0..4),
            proptest::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(status, headers, body)| StoredResponse {
                status,
                headers,
                body: body.into(),
            });
        let state = prop_oneof![
            any::<i64>().prop_map(|ms| RecordState::InFlight {
                lease_until: Timestamp::from_millis(ms)
            }),
            response.prop_map(|response| RecordState::Completed { response }),
            Just(RecordState::Released),
        ];
        (any::<[u8; 32]>(), any::<i64>(), any::<[i64; 3]>(), state).prop_map(
            |(fp, token, [c, e, r], state)| Record {
                fingerprint: Fingerprint(fp),
                token: FencingToken(token),
                created_at: Timestamp::from_millis(c),
                expires_at: Timestamp::from_millis(e),
                retain_until: Timestamp::from_millis(r),
                state,
            },
        )
    }

    proptest! {
        #[test]
        fn every_record_round_trips(record in any_record()) {
            let value = encode(&record).expect("encodes");
            prop_assert_eq!(decode(value).expect("decodes"), record);
        }

        /// Bytes from anywhere decode or are corrupt, never a panic; what decodes re-encodes to a
        /// value that decodes the same.
        #[test]
        fn any_bytes_decode_or_are_corrupt(mut value in proptest::collection::vec(any::<u8>(), 0..160), tweak in any::<bool>()) {
            if tweak && value.len() >= 3 {
                // Often a plausible header, so that the decoder gets past its first checks.
                value[0] = VERSION;
                value[1] = if value.len() == HEADER_LEN { IN_FLIGHT } else { DONE };
                value[2] &= 1;
            }
            match decode(value) {
                Ok(record) => {
                    let again = encode(&record).expect("encodes");
                    prop_assert_eq!(decode(again).expect("decodes"), record);
                }
                Err(e) => prop_assert_eq!(e.kind(), StoreErrorKind::Corrupt),
            }
        }
    }
}
