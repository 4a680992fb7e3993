//! Concurrency, expiry, store failures, handler failures and rejected requests.

use crate::http_support::*;
use idem_runtime::metrics::Outcome;
use idem_runtime::{RecordKey, Store};
use std::sync::atomic::Ordering;
use std::time::Duration;

http_test! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sixteen_concurrent_identical_requests_run_the_handler_once(h) {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let router = h.router.clone();
            tasks.spawn(
                async move { send(router, json_post("/gated", "alice", &["k1"], PAY_1000)).await },
            );
        }
        // One request holds the key at the gate; hold it there until the 15 others have found it in
        // flight and subscribed to its completion, so that every duplicate really overlaps it.
        h.probe.wait_started(1).await;
        let mut subscriptions = h.store.subscriptions.subscribe();
        subscriptions.wait_for(|n| *n >= 15).await.unwrap();
        h.probe.open_gate();

        let mut replies = Vec::new();
        while let Some(reply) = tasks.join_next().await {
            replies.push(reply.unwrap());
        }
        assert_eq!(h.probe.calls(), 1, "the handler ran once");
        assert!(replies.iter().all(|r| r.status == 201));
        assert!(replies.iter().all(|r| r.body == replies[0].body));
        assert!(replies
            .iter()
            .all(|r| r.header("location") == Some("/payments/pay_1")));
        assert_eq!(replies.iter().filter(|r| r.replayed()).count(), 15);
        assert_eq!(h.count(Outcome::Waited), 15);
    }
}

http_test! {
    #[tokio::test]
    async fn a_duplicate_of_a_running_request_gets_409_without_waiting(h) {
        let router = h.router.clone();
        let original = tokio::spawn(async move {
            send(
                router,
                json_post("/gated-no-wait", "alice", &["k1"], PAY_1000),
            )
            .await
        });
        h.probe.wait_started(1).await;

        let duplicate = h
            .send(json_post("/gated-no-wait", "alice", &["k1"], PAY_1000))
            .await;
        duplicate.assert_problem(409, "urn:idem:problem:in-flight");
        // Retry soon (not at the 30 s lease end): the retry itself waits on the server for the original.
        assert_eq!(duplicate.header("retry-after"), Some("1"));

        h.probe.open_gate();
        assert_eq!(original.await.unwrap().status, 201);
        let retry = h
            .send(json_post("/gated-no-wait", "alice", &["k1"], PAY_1000))
            .await;
        assert!(retry.replayed());
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn an_expired_key_answers_410(h) {
        let fresh = h
            .send(json_post("/short-ttl", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(
            fresh.header("idempotency-expires"),
            Some("Mon, 30 Nov 2026 00:01:00 GMT")
        );
        h.clock.advance(Duration::from_secs(59));
        assert!(h
            .send(json_post("/short-ttl", "alice", &["k1"], PAY_1000))
            .await
            .replayed());

        h.clock.advance(Duration::from_secs(1));
        let expired = h
            .send(json_post("/short-ttl", "alice", &["k1"], PAY_1000))
            .await;
        expired.assert_problem(410, "urn:idem:problem:key-expired");
        assert_eq!(
            h.probe.calls(),
            1,
            "an expired key never runs the handler again"
        );
        assert_eq!(h.count(Outcome::Expired), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn an_unavailable_store_answers_503_and_nothing_runs(h) {
        h.store.fail.store(true, Ordering::SeqCst);
        let reply = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        reply.assert_problem(503, "urn:idem:problem:store-unavailable");
        assert_eq!(reply.header("retry-after"), Some("1"));
        assert_eq!(h.probe.calls(), 0);
        assert_eq!(h.count(Outcome::Unavailable), 1);

        h.store.fail.store(false, Ordering::SeqCst);
        let retry = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(!retry.replayed());
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_server_error_releases_the_key_and_a_retry_runs_again(h) {
        let failed = h
            .send(json_post("/flaky", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(failed.status, 502);
        assert!(!failed.headers.contains_key("idempotency-expires"));
        assert!(h.kept("alice", "k1").await.is_none(), "nothing is stored");

        let retry = h
            .send(json_post("/flaky", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(!retry.replayed());
        assert_eq!(h.probe.calls(), 2);
        assert_eq!(h.count(Outcome::Released), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_stored_server_error_is_replayed_and_never_run_again(h) {
        // `server_errors = "store"`: a 504 may come after the effect happened, so it is kept.
        let failed = h
            .send(json_post("/flaky-stored", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(failed.status, 504);
        assert!(failed.headers.contains_key("idempotency-expires"));
        let retry = h
            .send(json_post("/flaky-stored", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 504);
        assert!(retry.replayed());
        assert_eq!(&retry.body[..], &failed.body[..]);
        assert_eq!(h.probe.calls(), 1);
        assert_eq!(h.count(Outcome::Released), 0);
    }
}

http_test! {
    #[tokio::test]
    async fn a_panicking_handler_releases_the_key(h) {
        let crashed = h
            .send(json_post("/panicking", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(crashed.status, 500, "a panic is a plain 500, as in axum");
        assert!(!crashed.headers.contains_key("idempotency-expires"));
        assert_eq!(h.count(Outcome::Released), 1);
        assert!(h.kept("alice", "k1").await.is_none(), "released");

        let retry = h
            .send(json_post("/panicking", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(!retry.replayed());
        assert_eq!(h.probe.calls(), 2);
    }
}

http_test! {
    /// A client that hangs up while the handler runs (hyper drops the request's future) cancels
    /// nothing: the handler runs on in its own task, its response is stored, and the retry replays.
    #[tokio::test]
    async fn a_cancelled_request_runs_on_and_its_retry_replays(h) {
        let router = h.router.clone();
        let original =
            tokio::spawn(
                async move { send(router, json_post("/gated", "alice", &["k1"], PAY_1000)).await },
            );
        h.probe.wait_started(1).await;
        original.abort();
        assert!(original.await.unwrap_err().is_cancelled());
        let mut stored = h.store.subscribe(&RecordKey::new("alice", "k1"));
        h.probe.open_gate();
        stored.changed().await;

        let retry = h
            .send(json_post("/gated", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed());
        assert_eq!(h.probe.calls(), 1);
        assert_eq!(h.count(Outcome::Released), 0);
    }
}

http_test! {
    #[tokio::test]
    async fn a_body_over_the_limit_is_413_and_claims_nothing(h) {
        let big = r#"{"amount":1000,"currency":"KRW","memo":"far too long for this endpoint"}"#;
        let reply = h.send(json_post("/small", "alice", &["k1"], big)).await;
        reply.assert_problem(413, "urn:idem:problem:body-too-large");
        assert_eq!(h.store.claims.load(Ordering::SeqCst), 0);
        assert_eq!(h.probe.calls(), 0);

        let good = h
            .send(json_post("/small", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(good.status, 201);
    }
}

http_test! {
    /// The handler's extractors answer with axum's own responses. Under the attribute the body's
    /// extractor runs once the key is claimed and its rejection releases the key, so a corrected
    /// retry with the same key runs; under the layer they run inside the claim, so their 4xx is the
    /// key's stored answer (as `IdempotencyLayer` documents). The scope's extractor runs before
    /// the claim under both.
    #[tokio::test]
    async fn extractor_rejections_keep_axums_response(h) {
        let bad_json = || json_post("/payments", "alice", &["k1"], r#"{"amount": 10"#);
        let syntax = h.send(bad_json()).await;
        assert_eq!(syntax.status, 400);
        assert_ne!(
            syntax.header("content-type"),
            Some("application/problem+json")
        );
        let mut anonymous = json_post("/payments", "alice", &["k1"], PAY_1000);
        anonymous.headers_mut().remove("x-user");
        assert_eq!(h.send(anonymous).await.status, 401);
        let claims = h.store.claims.load(Ordering::SeqCst);
        let good = json_post("/payments", "alice", &["k1"], PAY_1000);
        if h.layered {
            assert_eq!(claims, 1, "only the request that reached the handler claimed");
            let again = h.send(bad_json()).await;
            assert!(again.replayed());
            assert_eq!((again.status, &again.body), (syntax.status, &syntax.body));
            h.send(good)
                .await
                .assert_problem(422, "urn:idem:problem:key-mismatch");
            let fresh = h
                .send(json_post("/payments", "alice", &["k2"], PAY_1000))
                .await;
            assert_eq!(fresh.status, 201);
        } else {
            assert_eq!(claims, 1, "the bad JSON was claimed; the anonymous request was not");
            assert_eq!(h.store.releases.load(Ordering::SeqCst), 1);
            assert!(h.kept("alice", "k1").await.is_none(), "the rejection is not stored");
            let missing_field = json_post("/payments", "alice", &["k1"], r#"{"amount": 10}"#);
            let refused = h.send(missing_field).await;
            assert_eq!(refused.status, 422);
            assert!(!refused.replayed());
            assert_eq!(h.store.releases.load(Ordering::SeqCst), 2);
            let good = h.send(good).await;
            assert_eq!(good.status, 201);
            assert!(!good.replayed());
            // The key now belongs to the request that ran.
            h.send(bad_json())
                .await
                .assert_problem(422, "urn:idem:problem:key-mismatch");
        }
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_response_that_cannot_be_stored_still_reaches_the_client(h) {
        h.store.fail_complete.store(true, Ordering::SeqCst);
        let fresh = h
            .send(json_post("/payments", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(fresh.status, 201);
        assert_eq!(fresh.json()["id"], "pay_1");
        assert!(
            !fresh.headers.contains_key("idempotency-expires"),
            "no promise that the key is remembered"
        );
        // The handler's task goes on trying to store it (with backoff) after the client has it.
        assert!(h.count(Outcome::CompletionFailed) >= 1);
    }
}

/// What a plain axum handler taking `Json<NewPayment>` answers to `request`.
async fn axums_answer(request: axum::http::Request<axum::body::Body>) -> Reply {
    let plain = axum::Router::new().route(
        "/refunds",
        axum::routing::post(|axum::Json(_): axum::Json<NewPayment>| async {
            axum::http::StatusCode::CREATED
        }),
    );
    send(plain, request).await
}

/// alice's POST of `body` to `path` under `key`, with `content_type` (none if `None`).
fn post_as(
    path: &str,
    content_type: Option<&str>,
    key: &str,
    body: &str,
) -> axum::http::Request<axum::body::Body> {
    let mut request = json_post(path, "alice", &[key], body);
    let headers = request.headers_mut();
    headers.remove(axum::http::header::CONTENT_TYPE);
    if let Some(content_type) = content_type {
        let value = axum::http::HeaderValue::from_str(content_type).expect("a header value");
        headers.insert(axum::http::header::CONTENT_TYPE, value);
    }
    request
}

http_test! {
    #[tokio::test]
    async fn a_json_handlers_rejections_are_axums_own(h) {
        // `/refunds` takes `Json<NewPayment>` through `#[idempotent]`, which parses it once for the
        // handler and the fingerprint: every rejection must still be the one axum's `Json` gives.
        // Each claims its key: under the attribute the rejection releases it, under the layer it
        // is stored (see above).
        let json = Some("application/json");
        let cases = [
            (json, r#"{"amount": 10"#),                                 // syntax: 400
            (json, ""),                                                 // no value: 400
            (json, r#"{"amount": 10, "currency": "KRW"} x"#),           // trailing: 400
            (json, r#"{"amount": 10}"#),                                // a field missing: 422
            (json, r#"{"amount": "10", "currency": "KRW"}"#),           // a wrong type: 422
            (json, r#"{"amount": 1, "amount": 2, "currency": "KRW"}"#), // a field twice: 422
            (Some("text/json"), PAY_1000),                              // not a JSON media type: 415
            (Some("text/plain"), PAY_1000),
            (Some("application/jsonx"), PAY_1000),
            (None, PAY_1000),
        ];
        for (i, (content_type, body)) in cases.into_iter().enumerate() {
            let key = format!("bad-{i}");
            let ours = h.send(post_as("/refunds", content_type, &key, body)).await;
            let axums = axums_answer(post_as("/refunds", content_type, &key, body)).await;
            assert!(axums.status.is_client_error(), "{content_type:?} {body}");
            assert_eq!(
                (ours.status, ours.header("content-type"), &ours.body),
                (axums.status, axums.header("content-type"), &axums.body),
                "{content_type:?} {body}"
            );
        }
        assert_eq!(h.store.claims.load(Ordering::SeqCst), cases.len());
        let released = if h.layered { 0 } else { cases.len() };
        assert_eq!(h.store.releases.load(Ordering::SeqCst), released);
        assert_eq!(h.kept("alice", "bad-0").await.is_some(), h.layered);
        assert_eq!(h.probe.calls(), 0);

        // A media type is accepted exactly when axum's `Json` accepts it, however it is written, and
        // also with whitespace before it or its parameters, which HTTP allows and axum refuses.
        for (i, content_type) in [
            "application/json",
            "application/json; charset=utf-8",
            "application/json;charset=UTF-8",
            "APPLICATION/JSON",
            "application/json;",
            "application/json; charset",
            "application/json ; charset=utf-8",
            " application/json",
            "application/merge-patch+json",
            "application/vnd.api+json; ext=\"x\"",
            "application/+json",
            "application/json+x",
            "text/plain+json",
            "application",
        ]
        .into_iter()
        .enumerate()
        {
            let key = format!("accept-{i}");
            let ours = h
                .send(post_as("/refunds", Some(content_type), &key, PAY_1000))
                .await;
            let axums = axums_answer(post_as("/refunds", Some(content_type), &key, PAY_1000)).await;
            let spaced = content_type.starts_with(' ') || content_type.contains(" ;");
            if axums.status == 201 || spaced {
                assert_eq!(ours.status, 201, "{content_type}: {:?}", ours.body);
            } else {
                assert_eq!(
                    (ours.status, &ours.body),
                    (axums.status, &axums.body),
                    "{content_type}"
                );
            }
        }
    }
}

http_test! {
    #[tokio::test]
    async fn the_routers_body_limit_holds_for_a_json_handler(h) {
        let over = r#"{"amount":1000,"currency":"KRW","memo":"a few bytes too many"}"#;
        assert!(over.len() > ROUTER_LIMIT && PAY_1000.len() <= ROUTER_LIMIT);
        // Refused by the handler's own `Json`, which reads the body under the router's limit: axum's
        // 413, which releases the key under the attribute.
        let reply = h.send(json_post("/limited", "alice", &["k1"], over)).await;
        assert_eq!(reply.status, 413, "{:?}", reply.body);
        assert_eq!(h.probe.calls(), 0);
        if h.layered {
            // Inside the claim under the layer (whose own limit is the policy's
            // `max_request_body`): the 413 is the key's answer.
            assert_eq!(h.store.claims.load(Ordering::SeqCst), 1);
            let again = h.send(json_post("/limited", "alice", &["k1"], over)).await;
            assert!(again.replayed());
            assert_eq!(again.status, 413);
            let good = h
                .send(json_post("/limited", "alice", &["k2"], PAY_1000))
                .await;
            assert_eq!(good.status, 201);
            assert_eq!(h.probe.calls(), 1);
            return;
        }
        assert_eq!(h.store.releases.load(Ordering::SeqCst), 1);
        assert!(h.kept("alice", "k1").await.is_none());

        // A media type `Json` refuses is refused as axum's `Json` refuses it, before any limit.
        let text = post_as("/limited", Some("text/plain"), "k1", over);
        assert_eq!(h.send(text).await.status, 415);
        assert_eq!(h.store.releases.load(Ordering::SeqCst), 2);

        let good = h
            .send(json_post("/limited", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(good.status, 201);
        assert_eq!(h.probe.calls(), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn a_body_over_a_limit_further_out_is_413_and_claims_nothing(h) {
        // `/outer-limited` takes its body through a middleware's limit (as tower-http's
        // `RequestBodyLimit` applies it) and extracts through `WithBody`: too large is 413, never
        // "unreadable, send it again".
        let over = r#"{"amount":1000,"currency":"KRW","memo":"a few bytes too many"}"#;
        let reply = h
            .send(json_post("/outer-limited", "alice", &["k1"], over))
            .await;
        reply.assert_problem(413, "urn:idem:problem:body-too-large");
        assert_eq!(h.store.claims.load(Ordering::SeqCst), 0);
        assert_eq!(h.probe.calls(), 0);
        let good = h
            .send(json_post("/outer-limited", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(good.status, 201);
    }
}
