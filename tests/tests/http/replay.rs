//! Fresh responses, replays, and what a replay contains.

use crate::http_support::*;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::idempotent;
use idem_runtime::metrics::Outcome;
use idem_runtime::RecordKey;

/// The payment body as the next deploy reads it: `reference` became required.
#[derive(serde::Deserialize)]
struct NewPaymentV2 {
    amount: i64,
    currency: String,
    reference: String,
}

#[idempotent(scope = "user")]
async fn create_payment_v2(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPaymentV2>,
) -> Response {
    assert!(!req.reference.is_empty());
    let req = NewPayment {
        amount: req.amount,
        currency: req.currency,
    };
    created(probe.call(), &user, &req)
}

/// A retry that reaches a newer deploy, whose handler would refuse its body, still gets the
/// response its request was given: the body's extractor runs only once a key is claimed.
#[tokio::test]
async fn a_replay_does_not_run_the_body_extractor() {
    let h = Harness::new();
    let fresh = h
        .send(json_post("/payments", "alice", &["k1"], PAY_1000))
        .await;
    assert_eq!(fresh.status, 201);
    let deployed = Router::new()
        .route("/payments", post(create_payment_v2))
        .with_state(App {
            engine: h.engine.clone(),
            probe: h.probe.clone(),
        });
    let retry = send(
        deployed.clone(),
        json_post("/payments", "alice", &["k1"], PAY_1000),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, fresh.body);
    // A new request with that body is refused by the new extractor, and its key released.
    let new = send(deployed, json_post("/payments", "alice", &["k2"], PAY_1000)).await;
    assert_eq!(new.status, 422);
    assert!(!new.replayed());
    assert!(h.kept("alice", "k2").await.is_none());
    assert_eq!(h.probe.calls(), 1);
}

http_test! {
    #[tokio::test]
    async fn a_fresh_response_is_stored_and_a_retry_replays_it(h) {
        let fresh = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(fresh.status, 201);
        assert!(!fresh.headers.contains_key("idempotency-replayed"));
        assert_eq!(fresh.header("idempotency-expires"), Some(START_PLUS_DAY));
        assert_eq!(fresh.header("location"), Some("/payments/pay_1"));
        assert_eq!(fresh.json()["id"], "pay_1");

        let retry = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed());
        assert_eq!(retry.header("idempotency-expires"), Some(START_PLUS_DAY));
        assert_eq!(retry.header("location"), Some("/payments/pay_1"));
        assert_eq!(retry.header("content-type"), Some("application/json"));
        assert_eq!(retry.body, fresh.body);
        assert_eq!(h.probe.calls(), 1, "the handler ran once");
        assert_eq!(h.count(Outcome::Executed), 1);
        assert_eq!(h.count(Outcome::Replayed), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn the_same_json_in_another_key_order_replays(h) {
        let fresh = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        let retry = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000_REORDERED))
            .await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed());
        assert_eq!(retry.body, fresh.body);
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_different_body_under_the_same_key_is_a_mismatch(h) {
        h.send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        let other = h
            .send(json_post("/payments", "alice", &["k1"], PAY_2000))
            .await;
        other.assert_problem(422, "urn:idem:problem:key-mismatch");
        assert_eq!(other.header("idempotency-expires"), Some(START_PLUS_DAY));
        assert_eq!(h.probe.calls(), 1);
        assert_eq!(h.count(Outcome::Mismatch), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn the_same_key_on_another_endpoint_is_a_mismatch(h) {
        h.send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        let refund = h
            .send(json_post("/refunds", "alice", &["k1"], PAY_1000))
            .await;
        refund.assert_problem(422, "urn:idem:problem:key-mismatch");
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_quoted_key_is_the_bare_key(h) {
        let fresh = h
            .send(json_post("/payments", "alice", &["\"order-42\""], PAY_1000))
            .await;
        assert_eq!(fresh.status, 201);
        let retry = h
            .send(json_post("/payments", "alice", &["order-42"], PAY_1000))
            .await;
        assert!(retry.replayed());
        assert_eq!(retry.body, fresh.body);
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_4xx_from_the_handler_is_stored_and_replayed(h) {
        let fresh = h
            .send(json_post("/declined", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(fresh.status, 402);
        assert!(fresh.headers.contains_key("idempotency-expires"));
        let retry = h
            .send(json_post("/declined", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 402);
        assert!(retry.replayed());
        assert_eq!(retry.json()["attempt"], 1);
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn set_cookie_and_unlisted_headers_are_not_replayed(h) {
        let fresh = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        assert!(fresh.headers.contains_key("set-cookie"));
        assert_eq!(fresh.header("x-not-replayed"), Some("yes"));

        let retry = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        assert!(retry.replayed());
        assert!(!retry.headers.contains_key("set-cookie"));
        assert!(!retry.headers.contains_key("x-not-replayed"));
        // Listed in the policy's replay_headers.
        assert_eq!(retry.header("x-request-ref"), Some("ref-1"));
    }
}

http_test! {
    #[tokio::test]
    async fn minimal_mode_replays_only_status_location_and_id(h) {
        let fresh = h
            .send(json_post("/minimal", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(fresh.status, 201);
        assert_eq!(
            fresh.json()["status"],
            "captured",
            "the fresh response is whole"
        );

        let retry = h
            .send(json_post("/minimal", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed());
        assert_eq!(retry.header("location"), Some("/payments/pay_1"));
        assert_eq!(retry.json(), serde_json::json!({ "id": "pay_1" }));
        assert!(!retry.headers.contains_key("x-request-ref"));
        assert!(!retry.headers.contains_key("set-cookie"));
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_body_over_the_stored_cap_is_sent_whole_and_replayed_minimally(h) {
        let fresh = h.send(json_post("/big", "alice", &["k1"], PAY_1000)).await;
        assert_eq!(fresh.status, 201);
        assert_eq!(fresh.json()["amount"], 1000, "the first client gets it all");
        assert!(fresh.headers.contains_key("idempotency-expires"));

        let retry = h.send(json_post("/big", "alice", &["k1"], PAY_1000)).await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed());
        assert_eq!(retry.header("location"), Some("/payments/pay_1"));
        assert!(retry.body.is_empty());
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_response_stream_error_does_not_run_the_handler_again(h) {
        let response = {
            use tower::ServiceExt;
            h.router
                .clone()
                .oneshot(json_post("/broken-stream", "alice", &["k1"], PAY_1000))
                .await
                .unwrap()
        };
        assert_eq!(response.status(), 201);
        let read = http_body_util::BodyExt::collect(response.into_body()).await;
        assert!(read.is_err(), "the first client sees the stream fail");

        let retry = h
            .send(json_post("/broken-stream", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed());
        assert_eq!(retry.header("location"), Some("/payments/pay_stream"));
        assert_eq!(h.probe.calls(), 1, "the effects happened once");
    }
}

http_test! {
    #[tokio::test]
    async fn two_callers_with_the_same_key_get_their_own_responses(h) {
        let alice = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        let bob = h
            .send(json_post("/payments", "bob", &["k1"], PAY_1000))
            .await;
        assert_eq!(bob.status, 201);
        assert!(!bob.replayed());
        assert_eq!(alice.json()["owner"], "alice");
        assert_eq!(bob.json()["owner"], "bob");

        let alice_again = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        let bob_again = h
            .send(json_post("/payments", "bob", &["k1"], PAY_1000))
            .await;
        assert_eq!(alice_again.body, alice.body);
        assert_eq!(bob_again.body, bob.body);
        assert_eq!(h.probe.calls(), 2);
    }
}

http_test! {
    #[tokio::test]
    async fn a_global_handler_with_a_head_only_extractor_replays(h) {
        let fresh = h.send(json_post("/ping", "alice", &["k1"], "")).await;
        assert_eq!(fresh.status, 200);
        assert_eq!(&fresh.body[..], b"pong 1 for alice");
        // Global scope: another caller's identical request with the same key gets the stored answer.
        let other = h.send(json_post("/ping", "bob", &["k1"], "")).await;
        assert!(other.replayed());
        assert_eq!(&other.body[..], b"pong 1 for alice");
        assert!(h.record("global", "k1").await.is_some());
    }
}

http_test! {
    #[tokio::test]
    async fn nested_routers_do_not_share_fingerprints(h) {
        let app = App {
            engine: h.engine.clone(),
            probe: h.probe.clone(),
        };
        let nested = axum::Router::new()
            .nest("/v1", (h.build)(app.clone()))
            .nest("/v2", (h.build)(app));
        let v1 = send(
            nested.clone(),
            json_post("/v1/payments", "alice", &["k1"], PAY_1000),
        )
        .await;
        assert_eq!(v1.status, 201);
        // The same inner path under another prefix is another endpoint.
        let v2 = send(
            nested,
            json_post("/v2/payments", "alice", &["k1"], PAY_1000),
        )
        .await;
        v2.assert_problem(422, "urn:idem:problem:key-mismatch");
    }
}

/// The record alice's key `k1` holds carries the fingerprint `Fingerprint::of_request` gives a
/// JSON POST of `body` to `path`.
async fn assert_stored_fingerprint_is_of(h: &Harness, path: &str, body: &str) {
    let record = h.record("alice", "k1").await.expect("stored");
    let json = Some("application/json");
    assert_eq!(
        record.fingerprint,
        idem_runtime::Fingerprint::of_request("POST", path, json, body.as_bytes())
    );
}

const ORDER: &str = r#"{"currency":"KRW","items":[{"sku":"apple","quantity":2}],"delivery":{"Courier":{"address":"1 Main St"}}}"#;
const ORDER_REWRITTEN: &str = r#" { "delivery" : { "Courier" : { "address" : "1 Main St" } } ,
    "items" : [ { "quantity" : 2 , "sku" : "app\u006ce" } ] , "currency" : "KRW" } "#;

http_test! {
    #[tokio::test]
    async fn a_json_body_reaches_the_handler_and_is_fingerprinted_by_meaning(h) {
        // `/orders` takes `Json<NewOrder>` (enums in both of serde_json's forms, nested structs).
        let fresh = h.send(json_post("/orders", "alice", &["k1"], ORDER)).await;
        assert_eq!(fresh.status, 201);
        assert_eq!(
            fresh.json()["variants"],
            r#"Won Courier { address: "1 Main St" }"#
        );
        assert_eq!(
            fresh.json()["order"],
            serde_json::json!({
                "currency": "KRW",
                "items": [{ "sku": "apple", "quantity": 2 }],
                "delivery": { "Courier": { "address": "1 Main St" } },
            }),
            "the handler got the order as serde_json reads it"
        );
        assert_stored_fingerprint_is_of(&h, "/orders", ORDER).await;

        // Re-serialised by the client (members reordered, an escape, other whitespace, another way
        // to write the media type): the same request.
        let mut rewritten = json_post("/orders", "alice", &["k1"], ORDER_REWRITTEN);
        rewritten.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json; charset=utf-8"),
        );
        let retry = h.send(rewritten).await;
        assert!(retry.replayed(), "{:?}", retry.body);
        assert_eq!(retry.body, fresh.body);

        // A member `NewOrder` ignores is still part of the request.
        let other = ORDER.replace(r#""currency""#, r#""gift":true,"currency""#);
        h.send(json_post("/orders", "alice", &["k1"], &other))
            .await
            .assert_problem(422, "urn:idem:problem:key-mismatch");
        let other = ORDER.replace("KRW", "EUR");
        h.send(json_post("/orders", "alice", &["k1"], &other))
            .await
            .assert_problem(422, "urn:idem:problem:key-mismatch");
        let other = ORDER.replace(r#"{"Courier":{"address":"1 Main St"}}"#, r#""Pickup""#);
        h.send(json_post("/orders", "alice", &["k1"], &other))
            .await
            .assert_problem(422, "urn:idem:problem:key-mismatch");
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_body_fingerprinted_by_a_second_parse_replays_the_same_way(h) {
        // `/readings` takes an `f32`, which the fingerprint's `Value` holds as an `f64`: the
        // fingerprint is still the one of the body's meaning.
        let body = r#"{"celsius": 21.5, "station": {"b": 1, "a": 2}}"#;
        let fresh = h.send(json_post("/readings", "alice", &["k1"], body)).await;
        assert_eq!(fresh.status, 201);
        assert_eq!(&fresh.body[..], b"reading 1 by alice: 21.5");
        assert_stored_fingerprint_is_of(&h, "/readings", body).await;
        let retry = h
            .send(json_post(
                "/readings",
                "alice",
                &["k1"],
                r#"{"station":{"a":2,"b":1},"celsius":21.5}"#,
            ))
            .await;
        assert!(retry.replayed());
        h.send(json_post(
            "/readings",
            "alice",
            &["k1"],
            r#"{"celsius": 21.6, "station": {"b": 1, "a": 2}}"#,
        ))
        .await
        .assert_problem(422, "urn:idem:problem:key-mismatch");
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn bodies_that_deserialize_alike_but_differ_are_a_mismatch(h) {
        // `/lenient` drops a note that is not a number: both bodies give the handler the same value,
        // but they are two requests, and the second must not be answered with the first's response.
        let first = r#"{"amount":1000,"note":"abc"}"#;
        let fresh = h.send(json_post("/lenient", "alice", &["k1"], first)).await;
        assert_eq!(fresh.status, 201);
        assert_eq!(&fresh.body[..], b"payment 1 by alice: 1000 (None)");
        assert_stored_fingerprint_is_of(&h, "/lenient", first).await;
        h.send(json_post(
            "/lenient",
            "alice",
            &["k1"],
            r#"{"amount":1000,"note":true}"#,
        ))
        .await
        .assert_problem(422, "urn:idem:problem:key-mismatch");
        let retry = h
            .send(json_post(
                "/lenient",
                "alice",
                &["k1"],
                r#"{"note":"abc","amount":1000}"#,
            ))
            .await;
        assert!(retry.replayed());
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    /// The handler learns its run's downstream key (`Attempt`), filled in when its key is claimed.
    #[tokio::test]
    async fn the_handler_gets_its_downstream_key(h) {
        let fresh = h.send(json_post("/downstream", "alice", &["k1"], "")).await;
        let record = h.record("alice", "k1").await.expect("claimed");
        let expected = RecordKey::new("alice", "k1").downstream_key(
            &record.fingerprint,
            record.created_at,
            record.expires_at,
        );
        assert_eq!(fresh.status, 201);
        assert_eq!(std::str::from_utf8(&fresh.body).unwrap(), format!("{expected} taken over: false"));
        let retry = h.send(json_post("/downstream", "alice", &["k1"], "")).await;
        assert!(retry.replayed());
        assert_eq!(retry.body, fresh.body);
        let bob = h.send(json_post("/downstream", "bob", &["k1"], "")).await;
        assert_ne!(bob.body, fresh.body, "another caller's key is another key downstream");
        assert_eq!(h.probe.calls(), 2);
    }
}
