//! Hostile and unlucky input at the HTTP layer: keys merged by a proxy, a header value spelled like
//! a derived key, safe methods, media types with spaces, minimal replays' media type, and callers
//! whose ids are far longer than any store's key limit. Each case counts the handler's runs.

use crate::http_support::*;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::{header, Request};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use idem_runtime::{idempotent, Fingerprint};

#[tokio::test]
async fn an_unquoted_comma_is_two_merged_keys_and_a_quoted_one_is_a_key() {
    let h = Harness::new();
    // What a proxy makes of two `Idempotency-Key` lines.
    let merged = h
        .send(json_post("/payments", "alice", &["a,b"], PAY_1000))
        .await;
    merged.assert_problem(400, "urn:idem:problem:malformed-key");
    assert!(merged.json()["detail"]
        .as_str()
        .is_some_and(|d| d.contains("comma")));
    assert_eq!(h.probe.calls(), 0);

    let quoted = h
        .send(json_post("/payments", "alice", &[r#""a,b""#], PAY_1000))
        .await;
    assert_eq!(quoted.status, 201);
    let again = h
        .send(json_post("/payments", "alice", &[r#""a,b""#], PAY_1000))
        .await;
    assert!(again.replayed());
    assert_eq!(h.probe.calls(), 1);
    assert!(h.record("alice", "a,b").await.is_some());
}

#[tokio::test]
async fn no_header_value_reaches_a_derived_key_and_no_derived_key_an_explicit_one() {
    let h = Harness::new();
    let fingerprint = Fingerprint::of_request(
        "POST",
        "/derive",
        Some("application/json"),
        PAY_1000.as_bytes(),
    )
    .to_hex();
    // The derived key's old spelling, and the bare fingerprint, sent as explicit keys.
    for spelling in [format!("derived-{fingerprint}"), fingerprint.clone()] {
        let explicit = h
            .send(json_post("/derive", "alice", &[&spelling], PAY_1000))
            .await;
        assert_eq!(explicit.status, 201, "{spelling}");
        assert!(!explicit.replayed());
    }
    // A keyless request derives its key: it meets neither explicit record.
    let keyless = h.send(json_post("/derive", "alice", &[], PAY_1000)).await;
    assert_eq!(keyless.status, 201);
    assert!(!keyless.replayed(), "a derived key met an explicit one");
    // And its double tap replays its own record.
    let tap = h.send(json_post("/derive", "alice", &[], PAY_1000)).await;
    assert!(tap.replayed());
    assert_eq!(h.probe.calls(), 3);
}

#[idempotent(scope = "user")]
async fn balance(State(probe): State<Probe>, user: User) -> String {
    let n = probe
        .calls
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        + 1;
    format!("{}: read {n}", user.0)
}

#[tokio::test]
async fn safe_methods_pass_through_untouched() {
    let h = Harness::new();
    let app = App {
        engine: h.engine.clone(),
        probe: h.probe.clone(),
    };
    let router = Router::new()
        .route("/balance", get(balance).head(balance))
        .with_state(app);
    let read = |key: Option<&str>| {
        let mut request = Request::get("/balance").header("x-user", "alice");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.body(axum::body::Body::empty()).expect("request")
    };
    // Without a key (which the policy would otherwise require) and with one, repeated: every GET
    // runs, none is replayed, nothing is claimed.
    for (i, key) in [None, Some("k1"), Some("k1")].into_iter().enumerate() {
        let reply = send(router.clone(), read(key)).await;
        assert_eq!(reply.status, 200);
        assert!(!reply.replayed());
        assert!(!reply.headers.contains_key("idempotency-expires"));
        assert_eq!(&reply.body[..], format!("alice: read {}", i + 1).as_bytes());
    }
    let head = Request::head("/balance")
        .header("x-user", "alice")
        .body(axum::body::Body::empty())
        .expect("request");
    assert_eq!(send(router, head).await.status, 200);
    assert_eq!(h.probe.calls(), 4);
    assert_eq!(h.store.claims.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(h.kept("alice", "k1").await.is_none());
}

#[tokio::test]
async fn a_space_before_a_media_types_parameters_is_still_json() {
    let h = Harness::new();
    let spaced = |key: &str| {
        Request::post("/payments")
            .header(header::CONTENT_TYPE, "application/json ; charset=utf-8")
            .header("x-user", "alice")
            .header("idempotency-key", key)
            .body(axum::body::Body::from(PAY_1000))
            .expect("request")
    };
    let reply = h.send(spaced("k1")).await;
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    // The same JSON under the usual spelling is the same request.
    let usual = h
        .send(json_post("/payments", "alice", &["k1"], PAY_1000_REORDERED))
        .await;
    assert!(usual.replayed());
    assert_eq!(h.probe.calls(), 1);
}

const VENDOR_JSON: &str = "application/vnd.payments+json; charset=utf-8";

#[idempotent(scope = "user", replay = "minimal")]
async fn vendor_payment(
    State(probe): State<Probe>,
    user: User,
    _body: String,
) -> impl IntoResponse {
    let n = probe
        .calls
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        + 1;
    let body = format!(
        r#"{{"id":"pay_{n}","owner":"{}","status":"captured"}}"#,
        user.0
    );
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, VENDOR_JSON)],
        body,
    )
}

#[tokio::test]
async fn a_minimal_replay_keeps_the_originals_json_media_type() {
    let h = Harness::new();
    let app = App {
        engine: h.engine.clone(),
        probe: h.probe.clone(),
    };
    let router = Router::new()
        .route("/vendor", post(vendor_payment))
        .with_state(app);
    let fresh = send(
        router.clone(),
        json_post("/vendor", "alice", &["k1"], PAY_1000),
    )
    .await;
    assert_eq!(fresh.status, 201);
    assert_eq!(fresh.header("content-type"), Some(VENDOR_JSON));
    let replay = send(router, json_post("/vendor", "alice", &["k1"], PAY_1000)).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("content-type"), Some(VENDOR_JSON));
    assert_eq!(&replay.body[..], br#"{"id":"pay_1"}"#);
    assert_eq!(h.probe.calls(), 1);
}

#[tokio::test]
async fn a_caller_id_of_kilobytes_is_one_caller_and_never_another() {
    let h = Harness::new();
    let long = "u".repeat(3000);
    let longer = format!("{long}v");
    let first = h
        .send(json_post("/payments", &long, &["k1"], PAY_1000))
        .await;
    assert_eq!(first.status, 201);
    let retry = h
        .send(json_post("/payments", &long, &["k1"], PAY_1000))
        .await;
    assert!(retry.replayed());
    // Another caller sharing the first 3000 characters has records of its own.
    let other = h
        .send(json_post("/payments", &longer, &["k1"], PAY_1000))
        .await;
    assert_eq!(other.status, 201);
    assert!(!other.replayed());
    assert_eq!(h.probe.calls(), 2);
}
