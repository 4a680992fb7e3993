//! Responses in and out of the store: what a fresh response leaves behind, and how a replay is rebuilt.
//!
//! Only what is safe to send again is stored: the status, `Content-Type`, `Content-Language`,
//! `Location` and the policy's [`replay_headers`](crate::Policy::replay_headers), and the body up to
//! [`max_stored_body`](crate::Policy::max_stored_body). `Set-Cookie` (a session minted for one
//! response must not be handed out again), hop-by-hop headers and `Content-Length` are never stored,
//! whatever the policy lists.

use crate::clock::Timestamp;
use crate::policy::{Policy, ReplayMode};
use crate::record::StoredResponse;
use ::axum::body::Body;
use ::axum::http::header::{
    HeaderMap, HeaderName, HeaderValue, CONNECTION, CONTENT_LANGUAGE, CONTENT_LENGTH, CONTENT_TYPE,
    LOCATION, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, SET_COOKIE, TE, TRAILER, TRANSFER_ENCODING,
    UPGRADE,
};
use ::axum::http::response::Parts;
use ::axum::http::StatusCode;
use ::axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::stream::{self, StreamExt};
use http_body_util::BodyExt;
use std::future::Future;

/// Marks a replayed response (`true`); fresh responses do not carry it.
pub(crate) static REPLAYED: HeaderName = HeaderName::from_static(super::REPLAYED_HEADER);
/// Until when the key is remembered, as an IMF-fixdate.
pub(crate) static EXPIRES: HeaderName = HeaderName::from_static(super::EXPIRES_HEADER);

/// Headers stored in [`ReplayMode::Full`] besides the policy's own list. Names, not strings:
/// comparing two standard `HeaderName`s compares a discriminant, and every header of every fresh
/// response is compared with these.
static ALWAYS_REPLAYED: [HeaderName; 3] = [CONTENT_TYPE, CONTENT_LANGUAGE, LOCATION];

/// Headers never stored, even if a policy names them, and never replayed, even if stored.
static NEVER_REPLAYED: [HeaderName; 14] = [
    SET_COOKIE,
    HeaderName::from_static("set-cookie2"),
    CONTENT_LENGTH,
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    PROXY_AUTHENTICATE,
    PROXY_AUTHORIZATION,
    HeaderName::from_static("proxy-connection"),
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    HeaderName::from_static(super::REPLAYED_HEADER),
    HeaderName::from_static(super::EXPIRES_HEADER),
];

/// Sets the `Idempotency-Expires` header.
pub(crate) fn set_expires(headers: &mut HeaderMap, at: Timestamp) {
    if let Some(value) = http_date(at) {
        headers.insert(EXPIRES.clone(), value);
    }
}

/// `at` as an IMF-fixdate, to the second.
fn http_date(at: Timestamp) -> Option<HeaderValue> {
    HeaderValue::try_from(httpdate::fmt_http_date(at.to_system_time())).ok()
}

/// The handler's response, split into what to store and what to send now.
///
/// The body is read up to the stored-body cap. A body within the cap is sent from the buffer. A larger
/// one is sent whole (the buffered part, then the rest as it streams) and stored as in
/// [`ReplayMode::Minimal`] without the id. A body whose stream fails is also stored minimally: the
/// handler has run, its effects happened, and a retry must not run it again; the client receives what
/// was produced and then the same stream error. Trailers are not forwarded.
pub(crate) fn capture(
    response: Response,
    policy: &Policy,
) -> impl Future<Output = (StoredResponse, Response)> + '_ {
    // Split before the future exists, so that it holds the parts once (see `run::run`).
    let (parts, body) = response.into_parts();
    let mut body = body;
    async move {
        let cap = policy.max_stored_body;
        let mut chunks = Chunks::default();
        let ending = loop {
            match body.frame().await {
                None => break Ending::Complete,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        chunks.push(data);
                        if chunks.len > cap {
                            break Ending::Overflow;
                        }
                    }
                }
                Some(Err(e)) => break Ending::Failed(e),
            }
        };
        match ending {
            Ending::Complete => {
                let bytes = chunks.concat();
                let stored = match policy.replay {
                    ReplayMode::Full => full(&parts, bytes.clone(), policy),
                    ReplayMode::Minimal => minimal(&parts, Some(&bytes)),
                };
                (stored, Response::from_parts(parts, Body::from(bytes)))
            }
            Ending::Overflow => {
                tracing::debug!(target: "idem", handler = policy.handler, cap,
                    "response body over max_stored_body; storing status and Location only");
                let stored = minimal(&parts, None);
                let rest = stream::iter(chunks.frames().map(Ok)).chain(body.into_data_stream());
                (stored, Response::from_parts(parts, Body::from_stream(rest)))
            }
            Ending::Failed(error) => {
                tracing::warn!(target: "idem", handler = policy.handler, %error,
                    "response body failed while streaming; storing status and Location only");
                let stored = minimal(&parts, None);
                let sent = stream::iter(chunks.frames().map(Ok).chain(std::iter::once(Err(error))));
                (stored, Response::from_parts(parts, Body::from_stream(sent)))
            }
        }
    }
}

enum Ending {
    Complete,
    Overflow,
    Failed(::axum::Error),
}

/// A response body's data frames as read. Most bodies arrive in one frame (axum's `Json`, any
/// `Bytes` or `String` body), which is kept without a list: the list, and a copy, only for more.
#[derive(Default)]
struct Chunks {
    first: Option<Bytes>,
    rest: Vec<Bytes>,
    /// The bytes in all frames (saturating; compared with the cap, and the capacity of the joined
    /// body only when the whole body is within the cap).
    len: usize,
}

impl Chunks {
    fn push(&mut self, data: Bytes) {
        self.len = self.len.saturating_add(data.len());
        match self.first {
            None => self.first = Some(data),
            Some(_) => self.rest.push(data),
        }
    }

    /// The frames in order, to send on when the body is not stored whole.
    fn frames(self) -> impl Iterator<Item = Bytes> {
        self.first.into_iter().chain(self.rest)
    }

    /// The body, joined.
    fn concat(self) -> Bytes {
        match self.first {
            None => Bytes::new(),
            Some(single) if self.rest.is_empty() => single,
            Some(first) => {
                let mut buf = BytesMut::with_capacity(self.len);
                buf.extend_from_slice(&first);
                for chunk in &self.rest {
                    buf.extend_from_slice(chunk);
                }
                buf.freeze()
            }
        }
    }
}

fn is_replayable(name: &HeaderName, policy: &Policy) -> bool {
    // No name of ALWAYS_REPLAYED is in NEVER_REPLAYED (a test checks), so the usual headers skip it.
    ALWAYS_REPLAYED.contains(name)
        || (!NEVER_REPLAYED.contains(name)
            && policy
                .replay_headers
                .iter()
                .any(|h| h.eq_ignore_ascii_case(name.as_str())))
}

/// Status, replayable headers (every value byte for byte, obs-text included), and the body.
fn full(parts: &Parts, body: Bytes, policy: &Policy) -> StoredResponse {
    let headers = parts
        .headers
        .iter()
        .filter(|(name, _)| is_replayable(name, policy))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body,
    }
}

/// Status, `Location`, and `{"id": …}` when `body` is a JSON object with a top-level `id`.
fn minimal(parts: &Parts, body: Option<&Bytes>) -> StoredResponse {
    let mut headers: Vec<(HeaderName, HeaderValue)> = parts
        .headers
        .get_all(LOCATION)
        .iter()
        .map(|value| (LOCATION, value.clone()))
        .collect();
    let id = body
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
        .and_then(|mut v| v.get_mut("id").map(serde_json::Value::take));
    let body = match id {
        Some(id) => {
            // The original's JSON media type (a charset, a vendor type), else plain JSON.
            let media_type = parts
                .headers
                .get(CONTENT_TYPE)
                .filter(|v| v.to_str().is_ok_and(crate::fingerprint::is_json))
                .cloned()
                .unwrap_or(HeaderValue::from_static("application/json"));
            headers.push((CONTENT_TYPE, media_type));
            Bytes::from(serde_json::json!({ "id": id }).to_string())
        }
        None => Bytes::new(),
    };
    StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body,
    }
}

/// Rebuilds a stored response, marked `Idempotency-Replayed: true` and carrying the key's expiry.
/// Takes the response by value: its header values become the replay's without a copy.
pub(crate) fn replay(stored: StoredResponse, expires_at: Timestamp) -> Response {
    let Ok(status) = StatusCode::from_u16(stored.status) else {
        tracing::warn!(target: "idem", status = stored.status, "stored response has an invalid status");
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        // Checked here as well as at capture: a record may come from a store written by hand.
        if !NEVER_REPLAYED.contains(&name) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED.clone(), HeaderValue::from_static("true"));
    set_expires(headers, expires_at);
    response
        .extensions_mut()
        .insert(super::RequestOutcome::Replayed);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_body_in_several_frames_is_stored_and_sent_whole_and_one_frame_is_not_copied() {
        let policy = Policy::default();
        let (stored, sent) = capture(frames(&["{\"id\":", "", "7}"], false), &policy).await;
        assert_eq!(&stored.body[..], b"{\"id\":7}");
        assert_eq!(sent_body(sent).await, stored.body);

        let one = Bytes::from_static(b"{\"id\":8}");
        let (stored, _) = capture(Response::new(Body::from(one.clone())), &policy).await;
        assert_eq!(
            stored.body.as_ptr(),
            one.as_ptr(),
            "a single frame is kept, not copied"
        );

        let (stored, sent) = capture(Response::new(Body::empty()), &policy).await;
        assert!(stored.body.is_empty());
        assert!(sent_body(sent).await.is_empty());
    }

    async fn sent_body(response: Response) -> Bytes {
        let body = response.into_body().collect().await;
        body.expect("the whole body").to_bytes()
    }

    fn frames(frames: &[&'static str], fail: bool) -> Response {
        let mut items: Vec<Result<Bytes, std::io::Error>> = frames
            .iter()
            .map(|f| Ok(Bytes::from_static(f.as_bytes())))
            .collect();
        if fail {
            items.push(Err(std::io::Error::other("upstream went away")));
        }
        Response::new(Body::from_stream(stream::iter(items)))
    }

    #[tokio::test]
    async fn a_body_over_the_cap_or_failing_is_sent_in_order_and_stored_minimally() {
        const CAPPED: Policy = Policy::new().max_stored_body(4);
        let (stored, sent) = capture(frames(&["ab", "cd", "ef", "gh"], false), &CAPPED).await;
        assert!(stored.body.is_empty(), "over the cap: not stored");
        assert_eq!(&sent_body(sent).await[..], b"abcdefgh");

        let policy = Policy::default();
        let (stored, sent) = capture(frames(&["ab", "cd"], true), &policy).await;
        assert!(stored.body.is_empty(), "a failed body is not stored");
        let mut body = sent.into_body();
        let mut got = Vec::new();
        let error = loop {
            match body.frame().await {
                Some(Ok(frame)) => got.extend_from_slice(&frame.into_data().expect("data")),
                Some(Err(error)) => break error,
                None => panic!("the stream's error must reach the client"),
            }
        };
        assert_eq!(got, b"abcd");
        assert!(error.to_string().contains("upstream went away"), "{error}");
    }

    #[tokio::test]
    async fn idem_s_own_headers_are_never_stored_even_if_a_policy_names_them() {
        const POLICY: Policy =
            Policy::new().replay_headers(&["idempotency-replayed", "Idempotency-Expires"]);
        let mut fresh = response("{}");
        let h = fresh.headers_mut();
        h.insert(REPLAYED.clone(), HeaderValue::from_static("true"));
        h.insert(
            EXPIRES.clone(),
            HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"),
        );
        let (stored, _) = capture(fresh, &POLICY).await;
        assert_eq!(names(&stored), ["content-type", "location"]);
    }

    fn response(body: &'static str) -> Response {
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::CREATED;
        let h = response.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(LOCATION, HeaderValue::from_static("/things/7"));
        h.insert(SET_COOKIE, HeaderValue::from_static("session=1"));
        h.insert("x-a", HeaderValue::from_static("a"));
        h.insert("x-b", HeaderValue::from_static("b"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        response
    }

    fn names(stored: &StoredResponse) -> Vec<&str> {
        let mut names: Vec<_> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        names
    }

    #[test]
    fn no_header_is_both_always_and_never_replayed() {
        for name in &ALWAYS_REPLAYED {
            assert!(!NEVER_REPLAYED.contains(name), "{name}");
        }
    }

    #[tokio::test]
    async fn a_value_that_is_not_visible_ascii_is_stored_and_replayed_byte_for_byte() {
        const POLICY: Policy = Policy::new().replay_headers(&["x-a"]);
        let obs_text = HeaderValue::from_bytes(b"caf\xe9").expect("obs-text is a value");
        let mut fresh = response(r#"{"id":7}"#);
        fresh.headers_mut().insert("x-a", obs_text.clone());
        let (stored, _) = capture(fresh, &POLICY).await;
        let kept: Vec<_> = stored.headers.iter().filter(|(n, _)| n == "x-a").collect();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].1, obs_text);
        // The SQL stores' text column keeps it too.
        let text = stored.encode_headers();
        assert_eq!(
            StoredResponse::decode_headers(&text).expect("decodes"),
            stored.headers
        );
        let replayed = replay(stored, Timestamp::from_millis(0));
        assert_eq!(replayed.headers()["x-a"].as_bytes(), b"caf\xe9");
    }

    #[tokio::test]
    async fn a_policy_cannot_make_set_cookie_or_hop_by_hop_headers_replayable() {
        const POLICY: Policy =
            Policy::new().replay_headers(&["X-A", "set-cookie", "transfer-encoding"]);
        let (stored, sent) = capture(response(r#"{"id":7}"#), &POLICY).await;
        assert_eq!(names(&stored), ["content-type", "location", "x-a"]);
        assert_eq!(stored.status, 201);
        assert_eq!(&stored.body[..], br#"{"id":7}"#);
        assert!(
            sent.headers().contains_key(SET_COOKIE),
            "the fresh response is untouched"
        );
    }

    #[tokio::test]
    async fn minimal_keeps_status_location_and_a_numeric_id() {
        const POLICY: Policy = Policy::new().replay(ReplayMode::Minimal);
        let (stored, _) = capture(response(r#"{"name":"x","id":7}"#), &POLICY).await;
        assert_eq!(names(&stored), ["content-type", "location"]);
        assert_eq!(&stored.body[..], br#"{"id":7}"#);

        let (no_id, _) = capture(response("[1,2]"), &POLICY).await;
        assert_eq!(names(&no_id), ["location"]);
        assert!(no_id.body.is_empty());
    }

    #[test]
    fn the_expiry_date_is_an_imf_fixdate_to_the_second() {
        let at = |ms| http_date(Timestamp::from_millis(ms)).expect("a valid date");
        assert_eq!(at(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(at(999), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(at(1_000), "Thu, 01 Jan 1970 00:00:01 GMT");
        assert_eq!(at(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(at(86_400_000), "Fri, 02 Jan 1970 00:00:00 GMT");
    }

    #[test]
    fn a_replay_skips_what_must_never_be_replayed_even_if_stored() {
        let stored = StoredResponse {
            status: 200,
            headers: [
                ("set-cookie", "session=1"),
                ("Set-Cookie", "session=2"),
                ("keep-alive", "timeout=5"),
                ("idempotency-replayed", "false"),
                ("content-type", "text/plain"),
            ]
            .into_iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_bytes(name.as_bytes()).expect("a name"),
                    HeaderValue::from_static(value),
                )
            })
            .collect(),
            body: Bytes::from_static(b"ok"),
        };
        let replay = replay(stored, Timestamp::from_millis(0));
        assert!(!replay.headers().contains_key(SET_COOKIE));
        assert!(!replay.headers().contains_key("keep-alive"));
        assert_eq!(replay.headers().get_all(&REPLAYED).iter().count(), 1);
        assert_eq!(replay.headers()[CONTENT_TYPE], "text/plain");
        assert_eq!(replay.headers()[&REPLAYED], "true");
        assert_eq!(replay.headers()[&EXPIRES], "Thu, 01 Jan 1970 00:00:00 GMT");
    }
}
