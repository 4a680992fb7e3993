//! The `Idempotency-Key` header: malformed keys, and what each policy does without one.

use crate::http_support::*;
use idem_runtime::clock::Timestamp;
use idem_runtime::metrics::Outcome;
use std::time::Duration;

http_test! {
    #[tokio::test]
    async fn malformed_keys_are_rejected_before_the_handler_runs(h) {
        let too_long = "k".repeat(256);
        let cases: Vec<(&str, axum::http::Request<axum::body::Body>)> = vec![
            ("empty", json_post("/payments", "alice", &[""], PAY_1000)),
            (
                "256 characters",
                json_post("/payments", "alice", &[&too_long], PAY_1000),
            ),
            (
                "non-ASCII",
                post_raw_key("/payments", "alice", "clé".as_bytes(), PAY_1000),
            ),
            (
                "inner space",
                json_post("/payments", "alice", &["a b"], PAY_1000),
            ),
            (
                "unclosed quote",
                json_post("/payments", "alice", &["\"abc"], PAY_1000),
            ),
            (
                "two headers",
                json_post("/payments", "alice", &["a", "b"], PAY_1000),
            ),
            (
                "two identical headers",
                json_post("/payments", "alice", &["a", "a"], PAY_1000),
            ),
        ];
        let n = cases.len();
        for (what, request) in cases {
            let reply = h.send(request).await;
            assert_eq!(reply.status, 400, "{what}");
            reply.assert_problem(400, "urn:idem:problem:malformed-key");
        }
        assert_eq!(h.probe.calls(), 0);
        assert_eq!(h.count(Outcome::MalformedKey), n as u64);
        assert_eq!(h.store.claims.load(std::sync::atomic::Ordering::SeqCst), 0);
    }
}

http_test! {
    #[tokio::test]
    async fn the_longest_key_is_accepted(h) {
        let longest = "k".repeat(255);
        let reply = h
            .send(json_post("/payments", "alice", &[&longest], PAY_1000))
            .await;
        assert_eq!(reply.status, 201);
    }
}

http_test! {
    #[tokio::test]
    async fn a_missing_key_is_rejected_by_default(h) {
        let reply = h.send(json_post("/payments", "alice", &[], PAY_1000)).await;
        reply.assert_problem(400, "urn:idem:problem:missing-key");
        assert_eq!(h.probe.calls(), 0);
        assert_eq!(h.count(Outcome::MissingKeyRejected), 1);
    }
}

http_test! {
    #[tokio::test]
    async fn pass_runs_unprotected_and_counts_it(h) {
        let first = h.send(json_post("/pass", "alice", &[], PAY_1000)).await;
        let second = h.send(json_post("/pass", "alice", &[], PAY_1000)).await;
        assert_eq!(first.status, 201);
        assert_eq!(second.status, 201);
        assert!(!second.replayed());
        assert!(!first.headers.contains_key("idempotency-expires"));
        assert_eq!(
            h.probe.calls(),
            2,
            "nothing protects a request without a key"
        );
        assert_eq!(h.count(Outcome::MissingKeyPassed), 2);

        // A key still protects.
        h.send(json_post("/pass", "alice", &["k1"], PAY_1000)).await;
        let retry = h.send(json_post("/pass", "alice", &["k1"], PAY_1000)).await;
        assert!(retry.replayed());
        assert_eq!(h.probe.calls(), 3);
    }
}

http_test! {
    #[tokio::test]
    async fn pass_with_a_deadline_rejects_from_the_deadline_on(h) {
        h.clock.set(Timestamp::from_millis(DEADLINE_MS - 1));
        let before = h.send(json_post("/deadline", "alice", &[], PAY_1000)).await;
        assert_eq!(before.status, 201);
        assert_eq!(h.count(Outcome::MissingKeyPassed), 1);

        h.clock.set(Timestamp::from_millis(DEADLINE_MS));
        let after = h.send(json_post("/deadline", "alice", &[], PAY_1000)).await;
        after.assert_problem(400, "urn:idem:problem:missing-key");
        assert!(
            after.json()["detail"]
                .as_str()
                .unwrap()
                .contains("Mon, 30 Nov 2026 01:00:00 GMT"),
            "the detail names the deadline: {}",
            after.json()
        );
        assert_eq!(h.count(Outcome::MissingKeyRejected), 1);
        assert_eq!(h.probe.calls(), 1);

        // Keys keep working after the deadline.
        let keyed = h
            .send(json_post("/deadline", "alice", &["k1"], PAY_1000))
            .await;
        assert_eq!(keyed.status, 201);
    }
}

http_test! {
    #[tokio::test]
    async fn derive_deduplicates_double_taps_within_the_window(h) {
        let first = h.send(json_post("/derive", "alice", &[], PAY_1000)).await;
        assert_eq!(first.status, 201);
        let tap = h
            .send(json_post("/derive", "alice", &[], PAY_1000_REORDERED))
            .await;
        assert_eq!(tap.status, 201);
        assert!(tap.replayed());
        assert_eq!(tap.body, first.body);
        assert_eq!(h.probe.calls(), 1);
        assert_eq!(h.count(Outcome::KeyDerived), 2);

        // Another body is another request.
        let other = h.send(json_post("/derive", "alice", &[], PAY_2000)).await;
        assert!(!other.replayed());
        // Another caller's identical request is theirs.
        let bob = h.send(json_post("/derive", "bob", &[], PAY_1000)).await;
        assert!(!bob.replayed());
        assert_eq!(h.probe.calls(), 3);

        // After the window the same request runs again: a new purchase, not an expired key.
        h.clock.advance(Duration::from_secs(10));
        let later = h.send(json_post("/derive", "alice", &[], PAY_1000)).await;
        assert_eq!(later.status, 201);
        assert!(!later.replayed());
        assert_eq!(h.probe.calls(), 4);
    }
}

http_test! {
    #[tokio::test]
    async fn derive_with_a_key_uses_the_key(h) {
        h.send(json_post("/derive", "alice", &["k1"], PAY_1000))
            .await;
        h.clock.advance(Duration::from_secs(60));
        let retry = h
            .send(json_post("/derive", "alice", &["k1"], PAY_1000))
            .await;
        assert!(
            retry.replayed(),
            "a client key lives for the ttl, not the window"
        );
        assert_eq!(h.probe.calls(), 1);
    }
}
