//! The payments example's contract, driven in process.

use crate::payments_support::*;
use std::time::Duration;

#[tokio::test]
async fn create_answers_201_with_location_and_a_retry_replays_it() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    let created = send(&app, post("/payments", Some("alice"), Some("k1"), KRW_1000)).await;
    assert_eq!(created.status, 201);
    let payment = created.json();
    let id = payment["id"].as_str().unwrap().to_owned();
    assert_eq!(payment["amount"], 1000);
    assert_eq!(payment["currency"], "KRW");
    assert_eq!(payment["status"], "captured");
    assert_eq!(
        created.header("location"),
        Some(format!("/payments/{id}").as_str())
    );
    assert!(!created.replayed());
    assert!(created.headers.contains_key("idempotency-expires"));

    let retry = send(
        &app,
        post("/payments", Some("alice"), Some("k1"), KRW_1000_REORDERED),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, created.body);
    assert_eq!(retry.header("location"), created.header("location"));
    assert_eq!(list(&app, "alice").await.len(), 1, "charged once");
}

#[tokio::test]
async fn create_requires_a_key_and_rejects_a_reused_one() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    send(&app, post("/payments", Some("alice"), None, KRW_1000))
        .await
        .assert_problem(400, "urn:idem:problem:missing-key");
    send(&app, post("/payments", Some("alice"), Some("k1"), KRW_1000)).await;
    send(&app, post("/payments", Some("alice"), Some("k1"), KRW_2000))
        .await
        .assert_problem(422, "urn:idem:problem:key-mismatch");
    assert_eq!(list(&app, "alice").await.len(), 1);
}

#[tokio::test]
async fn requests_without_a_bearer_token_are_401_and_do_not_burn_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    let anonymous = send(&app, post("/payments", None, Some("k1"), KRW_1000)).await;
    assert_eq!(anonymous.status, 401);
    assert_eq!(anonymous.header("www-authenticate"), Some("Bearer"));
    assert_eq!(send(&app, get("/payments", None)).await.status, 401);
    assert_eq!(send(&app, get("/payments/pay_x", None)).await.status, 401);
    assert_eq!(
        send(&app, post("/payments/pay_x/refund", None, Some("r1"), ""))
            .await
            .status,
        401
    );
    let mut basic = get("/payments", None);
    basic
        .headers_mut()
        .insert("authorization", "Basic YWxpY2U6eA==".parse().unwrap());
    assert_eq!(send(&app, basic).await.status, 401);

    let authed = send(&app, post("/payments", Some("alice"), Some("k1"), KRW_1000)).await;
    assert_eq!(authed.status, 201);
    assert!(!authed.replayed());
}

#[tokio::test]
async fn extractor_and_validation_errors() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    // Bad JSON is refused by axum's `Json` once the key is claimed, which releases it: the
    // corrected retry runs.
    let bad = send(
        &app,
        post("/payments", Some("alice"), Some("k1"), "{\"amount\": 10"),
    )
    .await;
    assert_eq!(bad.status, 400);
    let ok = send(&app, post("/payments", Some("alice"), Some("k1"), KRW_1000)).await;
    assert_eq!(ok.status, 201);

    // A payment the handler refuses is a result like any other: stored and replayed.
    let negative = r#"{"amount": -5, "currency": "KRW"}"#;
    let refused = send(&app, post("/payments", Some("alice"), Some("k2"), negative)).await;
    assert_eq!(refused.status, 422);
    assert!(refused.json()["error"].as_str().unwrap().contains("amount"));
    let again = send(&app, post("/payments", Some("alice"), Some("k2"), negative)).await;
    assert!(again.replayed());
    let lowercase = r#"{"amount": 5, "currency": "krw"}"#;
    assert_eq!(
        send(
            &app,
            post("/payments", Some("alice"), Some("k3"), lowercase)
        )
        .await
        .status,
        422
    );
    // serde's sequence form of the request is not a payment: axum refuses it, no key is burnt.
    let sequence = r#"[1000, "KRW"]"#;
    let refused = send(&app, post("/payments", Some("alice"), Some("k4"), sequence)).await;
    assert_eq!(refused.status, 422);
    assert!(!refused.replayed());
    let corrected = send(&app, post("/payments", Some("alice"), Some("k4"), KRW_1000)).await;
    assert_eq!(corrected.status, 201, "the key was not used");
    assert_eq!(list(&app, "alice").await.len(), 2);
}

#[tokio::test]
async fn each_user_sees_only_their_own_payments() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    let a1 = send(&app, post("/payments", Some("alice"), Some("k1"), KRW_1000))
        .await
        .json();
    let a2 = send(&app, post("/payments", Some("alice"), Some("k2"), KRW_2000))
        .await
        .json();
    // Bob's key "k1" is his own: a new payment, not Alice's replay.
    let b1 = send(&app, post("/payments", Some("bob"), Some("k1"), KRW_1000)).await;
    assert_eq!(b1.status, 201);
    assert!(!b1.replayed());
    let b1 = b1.json();
    assert_ne!(b1["id"], a1["id"]);

    assert_eq!(list(&app, "alice").await, vec![a1.clone(), a2]);
    assert_eq!(list(&app, "bob").await, vec![b1.clone()]);
    assert!(list(&app, "carol").await.is_empty());

    let a1_id = a1["id"].as_str().unwrap();
    let own = send(&app, get(&format!("/payments/{a1_id}"), Some("alice"))).await;
    assert_eq!(own.status, 200);
    assert_eq!(own.json(), a1);
    let foreign = send(&app, get(&format!("/payments/{a1_id}"), Some("bob"))).await;
    assert_eq!(foreign.status, 404);
    let unknown = send(&app, get("/payments/pay_nope", Some("alice"))).await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test]
async fn refund_is_idempotent_and_changes_the_state_behind_location() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    let created = send(
        &app,
        post("/payments", Some("alice"), Some("pay-1"), KRW_1000),
    )
    .await;
    let location = created.header("location").unwrap().to_owned();
    let refund_path = format!("{location}/refund");

    send(&app, post(&refund_path, Some("alice"), None, ""))
        .await
        .assert_problem(400, "urn:idem:problem:missing-key");
    let refunded = send(
        &app,
        post(&refund_path, Some("alice"), Some("refund-1"), ""),
    )
    .await;
    assert_eq!(refunded.status, 200);
    assert_eq!(refunded.json()["status"], "refunded");
    assert_eq!(refunded.json()["id"], created.json()["id"]);
    let retry = send(
        &app,
        post(&refund_path, Some("alice"), Some("refund-1"), ""),
    )
    .await;
    assert!(retry.replayed());
    assert_eq!(retry.body, refunded.body);

    // The create's replay is the create's result: 201 and its Location ...
    let replayed = send(
        &app,
        post("/payments", Some("alice"), Some("pay-1"), KRW_1000),
    )
    .await;
    assert_eq!(replayed.status, 201);
    assert!(replayed.replayed());
    assert_eq!(replayed.header("location"), Some(location.as_str()));
    assert_eq!(replayed.json()["status"], "captured");
    // ... and the current state lives behind the Location.
    let current = send(&app, get(&location, Some("alice"))).await;
    assert_eq!(current.json()["status"], "refunded");

    // Another user cannot refund it, and the refund key of one payment is not another's.
    let foreign = send(&app, post(&refund_path, Some("bob"), Some("refund-1"), "")).await;
    assert_eq!(foreign.status, 404);
    let other = send(
        &app,
        post("/payments", Some("alice"), Some("pay-2"), KRW_2000),
    )
    .await;
    let other_refund = format!("{}/refund", other.header("location").unwrap());
    send(
        &app,
        post(&other_refund, Some("alice"), Some("refund-1"), ""),
    )
    .await
    .assert_problem(422, "urn:idem:problem:key-mismatch");
}

#[tokio::test]
async fn legacy_double_taps_make_one_payment() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    let first = send(
        &app,
        post("/legacy/payments", Some("alice"), None, KRW_1000),
    )
    .await;
    assert_eq!(first.status, 201);
    let tap = send(
        &app,
        post("/legacy/payments", Some("alice"), None, KRW_1000_REORDERED),
    )
    .await;
    assert_eq!(tap.status, 201);
    assert!(tap.replayed());
    assert_eq!(tap.body, first.body);
    assert_eq!(list(&app, "alice").await.len(), 1);

    // A different amount is a different payment; a key still works as usual.
    send(
        &app,
        post("/legacy/payments", Some("alice"), None, KRW_2000),
    )
    .await;
    send(
        &app,
        post("/legacy/payments", Some("alice"), Some("k1"), KRW_1000),
    )
    .await;
    assert_eq!(list(&app, "alice").await.len(), 3);
}

/// A keyless payment sent again after its derive window is a new payment, and a new charge at the
/// card network: its downstream key names the new record, so the network does not answer with the
/// first charge (it would have, were the key built from the key text alone).
#[tokio::test]
async fn a_legacy_payment_after_its_window_is_a_second_charge() {
    let dir = tempfile::tempdir().unwrap();
    let clock = idem_runtime::clock::ManualClock::new(idem_runtime::clock::Timestamp::from_millis(
        1_800_000_000_000,
    ));
    let app = start_on_clock(dir.path(), clock.clone()).await;
    let first = send(&app, post("/legacy/payments", Some("dana"), None, KRW_1000)).await;
    assert_eq!(first.status, 201);
    clock.advance(Duration::from_secs(11)); // past the 10 s derive window
    let again = send(&app, post("/legacy/payments", Some("dana"), None, KRW_1000)).await;
    assert_eq!(again.status, 201);
    assert!(!again.replayed(), "a new request after the window");
    assert_ne!(again.json()["id"], first.json()["id"], "a second payment");
    let charges = charges(&app, "dana").await;
    assert_eq!(charges.len(), 2, "two charges at the network: {charges:?}");
    assert!(charges.iter().all(|c| c["attempts"] == 1), "{charges:?}");
    assert_eq!(list(&app, "dana").await.len(), 2);
}

#[tokio::test]
async fn configuration_from_the_environment() {
    let defaults = payments::Config::from_lookup(|_| None).unwrap();
    assert_eq!(defaults, payments::Config::default());
    assert_eq!(defaults.port, 3000);
    assert_eq!(defaults.database_url, "sqlite://payments.db?mode=rwc");
    assert_eq!(defaults.idem_store_url, None);
    assert!(defaults.payment_latency.is_zero());

    let set = payments::Config::from_lookup(|name| {
        Some(
            match name {
                "PORT" => "8080",
                "DATABASE_URL" => "sqlite://some/dir/payments.db?mode=rwc",
                "IDEM_STORE_URL" => "memory:",
                "PAYMENT_LATENCY_MS" => "250",
                _ => return None,
            }
            .to_owned(),
        )
    })
    .unwrap();
    assert_eq!(set.port, 8080);
    assert_eq!(set.database_url, "sqlite://some/dir/payments.db?mode=rwc");
    assert_eq!(set.idem_store_url.as_deref(), Some("memory:"));
    assert_eq!(set.payment_latency.as_millis(), 250);

    let bad_port = payments::Config::from_lookup(|n| (n == "PORT").then(|| "http".to_owned()));
    assert!(bad_port.unwrap_err().to_string().contains("PORT"));
    let bad_latency =
        payments::Config::from_lookup(|n| (n == "PAYMENT_LATENCY_MS").then(|| "-1".to_owned()));
    assert!(bad_latency
        .unwrap_err()
        .to_string()
        .contains("PAYMENT_LATENCY_MS"));
}

#[tokio::test]
async fn an_unsupported_idempotency_store_fails_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let config = payments::Config {
        database_url: database_url(dir.path()),
        idem_store_url: Some("ftp://example".to_owned()),
        ..payments::Config::default()
    };
    let error = payments::app(&config).await.unwrap_err();
    assert!(error.to_string().contains("ftp:"), "{error}");

    let memory = payments::Config {
        idem_store_url: Some("memory:".to_owned()),
        ..config
    };
    assert!(payments::app(&memory).await.is_ok());

    let ledger = payments::Config {
        database_url: "oracle://localhost/payments".to_owned(),
        idem_store_url: None,
        ..memory
    };
    let error = payments::app(&ledger).await.unwrap_err();
    assert!(error.to_string().contains("DATABASE_URL"), "{error}");
    assert!(error.to_string().contains("oracle:"), "{error}");
}

#[tokio::test]
async fn a_body_over_the_payment_policys_64_kib_is_413_and_burns_no_key() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;
    let padding = "x".repeat(64 * 1024);
    let huge = format!(r#"{{"amount":1000,"currency":"KRW","note":"{padding}"}}"#);
    let refused = send(&app, post("/payments", Some("alice"), Some("k1"), &huge)).await;
    assert_eq!(refused.status, 413);
    // The key was never claimed: the same key with a normal body runs.
    let ok = send(&app, post("/payments", Some("alice"), Some("k1"), KRW_1000)).await;
    assert_eq!(ok.status, 201);
    assert_eq!(ok.header("idempotency-replayed"), None);
}

/// The body extractor's and the auth's refusals are problems, as the API document says; the body's
/// release the key, so the corrected request uses it.
#[tokio::test]
async fn refused_bodies_and_callers_get_problems_and_keep_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;

    let not_json = send(
        &app,
        post("/payments", Some("alice"), Some("k1"), "{\"amount\": 10"),
    )
    .await;
    not_json.assert_problem(400, "urn:payments:problem:malformed-body");
    let wrong_shape = r#"{"amount": "ten", "currency": "KRW"}"#;
    let wrong = send(
        &app,
        post("/payments", Some("alice"), Some("k1"), wrong_shape),
    )
    .await;
    wrong.assert_problem(422, "urn:payments:problem:invalid-body");
    let mut plain = post("/payments", Some("alice"), Some("k1"), KRW_1000);
    plain.headers_mut().remove("content-type");
    send(&app, plain)
        .await
        .assert_problem(415, "urn:payments:problem:unsupported-media-type");
    for token in ["SCHEMATHESIS-INVALID-VALUE", "a b", &"a".repeat(4097)] {
        let refused = send(&app, post("/payments", Some(token), Some("k1"), KRW_1000)).await;
        refused.assert_problem(401, "urn:payments:problem:unauthorized");
        assert_eq!(refused.header("www-authenticate"), Some("Bearer"));
    }
    // A whole number written with a fraction of zero is an integer, as the schema counts them.
    let decimal = r#"{"amount": 1000.0, "currency": "KRW"}"#;
    let created = send(&app, post("/payments", Some("alice"), Some("k1"), decimal)).await;
    assert_eq!(created.status, 201, "the key was not used by the refusals");
    assert_eq!(created.json()["amount"], 1000);
    let fraction = r#"{"amount": 1000.5, "currency": "KRW"}"#;
    send(&app, post("/payments", Some("alice"), Some("k2"), fraction))
        .await
        .assert_problem(422, "urn:payments:problem:invalid-body");
    assert_eq!(list(&app, "alice").await.len(), 1);
}
