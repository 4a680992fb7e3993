//! The retrying client against a fault-injecting server: what is retried, with which key, after
//! how long. Every scenario runs against both forms (the plain client and the reqwest-middleware
//! stack), on tokio's paused clock with the server in the same runtime (see `client_support`), so
//! waits are asserted on tokio's clock and take no wall time.

use crate::client_support::{Caller, FaultServer, Form, Step};
use idem_runtime::client::{
    CauseKind, Client, ClientBuilder, DeadKey, KeyChoice, KeyFormat, RetryBudget, StopReason,
    TransportFailure, KEY_EXPIRED, KEY_MISMATCH, REQUEST_IN_FLIGHT,
};
use idem_runtime::http::Method;
use idem_runtime::IdempotencyKey;
use std::time::Duration;

fn retrying(form: Form, builder: ClientBuilder) -> Caller {
    Caller::new(
        form,
        builder.budget(RetryBudget::unlimited()).max_attempts(5),
    )
}

fn payment() -> serde_json::Value {
    serde_json::json!({ "amount": 1000, "currency": "KRW" })
}

fn keys(server: &FaultServer) -> Vec<Option<String>> {
    server.seen().into_iter().map(|s| s.key).collect()
}

#[tokio::test(start_paused = true)]
async fn a_lost_answer_is_retried_with_the_same_key_and_the_effect_happens_once() {
    for form in Form::BOTH {
        let server = FaultServer::start([Step::DropAfterEffect], Step::status(201)).await;
        let client = retrying(form, Client::builder());

        let response = client
            .post(server.url("/payments"))
            .json(&payment())
            .send()
            .await
            .unwrap();

        assert_eq!(response.status(), 201, "{form:?}");
        assert_eq!(response.attempts(), 2);
        assert!(
            response.replayed(),
            "the second attempt was answered from the stored result"
        );
        let key = response.key().unwrap().as_str().to_owned();
        assert_eq!(keys(&server), [Some(key.clone()), Some(key.clone())]);
        assert_eq!(server.effects(&key), 1);
        assert_eq!(server.payments(), 1);
        assert_eq!(response.headers()["location"], "/payments/1");
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_cut_mid_read_is_retried_with_the_same_key_and_the_replay_returned() {
    for form in Form::BOTH {
        // The payment is made, the 201's headers and half its body arrive, then the connection drops.
        let server =
            FaultServer::start([Step::status(201).cut_mid_body()], Step::status(201)).await;
        let client = retrying(form, Client::builder());

        let response = client
            .post(server.url("/payments"))
            .json(&payment())
            .send()
            .await
            .unwrap();

        assert_eq!(
            response.attempts(),
            2,
            "{form:?}: the cut body was a failed attempt"
        );
        assert!(response.replayed(), "{form:?}");
        let key = response.key().unwrap().as_str().to_owned();
        assert_eq!(keys(&server), [Some(key.clone()), Some(key.clone())]);
        assert_eq!(server.effects(&key), 1, "{form:?}: charged once");
        // The body was read inside the loop: reading it here cannot fail.
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(body["id"], 1);
        assert_eq!(body["status"], "captured");
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_cut_on_a_keyless_post_is_an_error_not_a_retry() {
    for form in Form::BOTH {
        let cut = Step::status(200).body("a body cut in two").cut_mid_body();
        let server = FaultServer::start([cut], Step::status(200)).await;
        let client = retrying(form, Client::builder());

        let error = client
            .post(server.url("/scripted"))
            .without_idempotency_key()
            .send()
            .await
            .unwrap_err();

        assert!(
            matches!(error.stop_reason(), StopReason::NotRetryable { .. }),
            "{form:?}: {error}"
        );
        assert_eq!(
            error.causes()[0].kind(),
            CauseKind::Transport(TransportFailure::Interrupted)
        );
        assert_eq!(server.seen().len(), 1, "{form:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_longer_than_the_buffer_is_handed_back_whole_and_unbuffered() {
    let long = "x".repeat(64 * 1024);
    for form in Form::BOTH {
        let whole = Step::status(200).body(long.clone());
        for step in [whole.clone(), whole.chunked()] {
            let server = FaultServer::start([], step).await;
            let client = retrying(form, Client::builder().max_buffered_body(1024));

            let response = client.get(server.url("/scripted")).send().await.unwrap();

            let text = response.text().await.unwrap();
            assert_eq!(text.len(), long.len(), "{form:?}");
            assert!(text == long);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn two_503s_then_a_201_succeed_on_the_third_attempt_with_one_key() {
    for form in Form::BOTH {
        let server = FaultServer::start(
            [Step::status(503), Step::status(503), Step::status(201)],
            Step::status(500),
        )
        .await;
        let client = retrying(form, Client::builder());

        let response = client
            .post(server.url("/scripted"))
            .json(&payment())
            .send()
            .await
            .unwrap();

        assert_eq!(response.status(), 201, "{form:?}");
        assert_eq!(response.attempts(), 3);
        assert!(!response.replayed());
        let key = response.key().unwrap().as_str().to_owned();
        assert!(
            uuid::Uuid::parse_str(&key).is_ok_and(|u| u.get_version_num() == 4),
            "a generated key is a UUID v4: {key}"
        );
        assert_eq!(keys(&server), vec![Some(key); 3]);
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_delays_the_next_attempt_on_tokios_clock() {
    for form in Form::BOTH {
        let server = FaultServer::start(
            [Step::status(429).header("retry-after", "1")],
            Step::status(200),
        )
        .await;
        // A backoff far below a second: the wait can only come from Retry-After.
        let client = retrying(
            form,
            Client::builder().backoff(idem_runtime::client::ExponentialBackoff::new(
                Duration::from_millis(1),
                Duration::from_millis(1),
            )),
        );

        let response = client.get(server.url("/scripted")).send().await.unwrap();

        assert_eq!(response.status(), 200, "{form:?}");
        let seen = server.seen();
        assert_eq!(seen.len(), 2);
        let waited = seen[1].at - seen[0].at;
        assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honoured() {
    for form in Form::BOTH {
        // The date form names a wall-clock instant; the client turns it into a wait on tokio's clock.
        let at = std::time::SystemTime::now() + Duration::from_secs(3);
        let server = FaultServer::start(
            [Step::status(503).header("retry-after", httpdate::fmt_http_date(at))],
            Step::status(200),
        )
        .await;
        let client = retrying(form, Client::builder());

        let response = client.get(server.url("/scripted")).send().await.unwrap();

        assert_eq!(response.status(), 200, "{form:?}");
        let seen = server.seen();
        // HTTP dates have whole seconds, so the 3 s may have shrunk by up to one.
        let waited = seen[1].at - seen[0].at;
        assert!(waited >= Duration::from_secs(2), "waited only {waited:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_beyond_the_cap_ends_the_request() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::status(429).header("retry-after", "3600")).await;
        let client = retrying(
            form,
            Client::builder().max_retry_after(Duration::from_secs(60)),
        );

        let error = client
            .get(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();

        assert_eq!(
            error.stop_reason(),
            &StopReason::RetryAfterTooLong {
                requested: Duration::from_secs(3600),
                cap: Duration::from_secs(60)
            },
            "{form:?}"
        );
        assert_eq!(error.attempts(), 1);
        assert_eq!(server.seen().len(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn final_answers_are_returned_after_one_attempt() {
    for form in Form::BOTH {
        for status in [400, 401, 403, 404, 410, 422, 501] {
            let server = FaultServer::start([], Step::status(status)).await;
            let client = retrying(form, Client::builder());

            let response = client
                .post(server.url("/scripted"))
                .json(&payment())
                .send()
                .await
                .unwrap();

            assert_eq!(response.status(), status);
            assert_eq!(response.attempts(), 1, "{form:?} {status}");
            assert_eq!(server.seen().len(), 1, "{status} is not retried");
            assert_eq!(response.dead_key(), None, "no problem type, no dead key");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn idems_dead_key_answers_are_typed_and_final() {
    for form in Form::BOTH {
        for (step, dead) in [
            (Step::problem(422, KEY_MISMATCH), Some(DeadKey::Mismatch)),
            (Step::problem(410, KEY_EXPIRED), Some(DeadKey::Expired)),
            (
                Step::problem(410, KEY_EXPIRED).chunked(),
                Some(DeadKey::Expired),
            ),
            (
                Step::problem(422, "https://example.test/invalid-amount"),
                None,
            ),
        ] {
            let server = FaultServer::start([], step).await;
            let client = retrying(form, Client::builder());

            let response = client
                .post(server.url("/scripted"))
                .json(&payment())
                .send()
                .await
                .unwrap();

            assert_eq!(response.dead_key(), dead, "{form:?}");
            assert_eq!(response.attempts(), 1);
            assert_eq!(server.seen().len(), 1, "a dead key is never retried");
            // The problem document is still there to read.
            let body: serde_json::Value = response.json().await.unwrap();
            assert_eq!(body["title"], "scripted problem");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_conflict_other_than_in_flight_is_final_and_keeps_its_body() {
    for form in Form::BOTH {
        let server = FaultServer::start(
            [],
            Step::problem(409, "https://example.test/problems/already-shipped"),
        )
        .await;
        let client = retrying(form, Client::builder());

        let response = client.post(server.url("/scripted")).send().await.unwrap();

        assert_eq!(response.status(), 409, "{form:?}");
        assert_eq!(server.seen().len(), 1);
        assert_eq!(response.url().as_str(), server.url("/scripted"));
        assert_eq!(
            response.problem_type(),
            Some("https://example.test/problems/already-shipped")
        );
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(
            body["type"],
            "https://example.test/problems/already-shipped"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_in_flight_conflict_is_retried_after_its_retry_after_whatever_its_framing() {
    for form in Form::BOTH {
        for conflict in [
            Step::problem(409, REQUEST_IN_FLIGHT),
            // As a proxy that re-chunks (or compresses) sends it: no Content-Length.
            Step::problem(409, REQUEST_IN_FLIGHT).chunked(),
        ] {
            let server =
                FaultServer::start([conflict.header("retry-after", "2")], Step::status(201)).await;
            let client = retrying(form, Client::builder());

            let response = client.post(server.url("/scripted")).send().await.unwrap();

            assert_eq!(response.status(), 201, "{form:?}");
            assert_eq!(response.attempts(), 2, "{form:?}");
            let seen = server.seen();
            assert!(seen[1].at - seen[0].at >= Duration::from_secs(2));
            assert_eq!(seen[0].key, seen[1].key);
            assert!(seen[0].key.is_some());
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_post_without_a_key_is_never_retried() {
    for form in Form::BOTH {
        let server = FaultServer::start([Step::status(503)], Step::status(201)).await;
        let client = retrying(form, Client::builder());

        let response = client
            .post(server.url("/scripted"))
            .without_idempotency_key()
            .send()
            .await
            .unwrap();

        assert_eq!(response.status(), 503, "the 503 is the answer");
        assert_eq!(response.attempts(), 1);
        assert!(response.key().is_none());
        assert_eq!(keys(&server), [None]);

        // Nor after a lost answer: the effect may have happened.
        let server = FaultServer::start([Step::DropAfterEffect], Step::status(201)).await;
        let error = client
            .patch(server.url("/scripted"))
            .without_idempotency_key()
            .send()
            .await
            .unwrap_err();
        assert!(matches!(
            error.stop_reason(),
            StopReason::NotRetryable { .. }
        ));
        assert_eq!(error.attempts(), 1);
        assert!(error.key().is_none());
        assert_eq!(server.seen().len(), 1, "{form:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn keys_go_on_posts_and_patches_by_default_and_safe_methods_are_retried_without() {
    for form in Form::BOTH {
        for method in [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::PUT,
            Method::DELETE,
        ] {
            let server = FaultServer::start([Step::status(502)], Step::status(200)).await;
            let client = retrying(form, Client::builder());

            let response = client
                .request(method.clone(), server.url("/scripted"))
                .send()
                .await
                .unwrap();

            assert_eq!(response.status(), 200, "{form:?} {method}");
            assert_eq!(response.attempts(), 2, "{form:?} {method}");
            assert!(response.key().is_none());
            assert_eq!(keys(&server), [None, None], "{form:?} {method}");
        }
        for method in [Method::POST, Method::PATCH] {
            let server = FaultServer::start([Step::status(502)], Step::status(200)).await;
            let client = retrying(form, Client::builder());

            let response = client
                .request(method.clone(), server.url("/scripted"))
                .send()
                .await
                .unwrap();

            let key = response.key().map(|k| k.as_str().to_owned());
            assert!(key.is_some(), "{form:?} {method}");
            assert_eq!(keys(&server), [key.clone(), key], "{form:?} {method}");
        }
        // A PUT whose server deduplicates by key gets one on request.
        let server = FaultServer::start([Step::status(503)], Step::status(200)).await;
        let client = retrying(form, Client::builder());
        let response = client
            .request(Method::PUT, server.url("/scripted"))
            .key(KeyChoice::Generate)
            .send()
            .await
            .unwrap();
        let key = response.key().map(|k| k.as_str().to_owned());
        assert!(key.is_some(), "{form:?}");
        assert_eq!(keys(&server), [key.clone(), key]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_callers_key_is_sent_on_every_attempt() {
    for form in Form::BOTH {
        let server = FaultServer::start([Step::status(500)], Step::status(200)).await;
        let client = retrying(form, Client::builder());
        let key = IdempotencyKey::new("order-42-charge").unwrap();

        let response = client
            .post(server.url("/scripted"))
            .idempotency_key(key.clone())
            .send()
            .await
            .unwrap();

        assert_eq!(response.key(), Some(&key), "{form:?}");
        assert_eq!(keys(&server), vec![Some("order-42-charge".to_owned()); 2]);

        // The IETF draft's quoted form, on request.
        let server = FaultServer::start([], Step::status(200)).await;
        let client = retrying(form, Client::builder().key_format(KeyFormat::Quoted));
        client
            .post(server.url("/scripted"))
            .idempotency_key(key)
            .send()
            .await
            .unwrap();
        assert_eq!(keys(&server), [Some("\"order-42-charge\"".to_owned())]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_key_set_as_a_header_by_hand_is_the_requests_key() {
    for form in Form::BOTH {
        let server = FaultServer::start([Step::status(503)], Step::status(200)).await;
        let client = retrying(form, Client::builder());

        let response = client
            .post(server.url("/scripted"))
            .header("Idempotency-Key", "by-hand-1")
            .send()
            .await
            .unwrap();

        assert_eq!(response.key().unwrap().as_str(), "by-hand-1", "{form:?}");
        assert_eq!(keys(&server), vec![Some("by-hand-1".to_owned()); 2]);

        let error = client
            .post(server.url("/scripted"))
            .header("Idempotency-Key", "has space")
            .send()
            .await
            .unwrap_err();
        assert_eq!(error.stop_reason(), &StopReason::InvalidRequest);
        assert_eq!(error.attempts(), 0);
        assert_eq!(server.seen().len(), 2, "nothing sent");
    }
}

#[tokio::test(start_paused = true)]
async fn the_replay_marker_is_exposed() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::status(201)).await;
        let client = retrying(form, Client::builder());
        let key = IdempotencyKey::new("pay-once").unwrap();
        let pay = || {
            client
                .post(server.url("/payments"))
                .idempotency_key(key.clone())
                .json(&payment())
                .send()
        };

        let first = pay().await.unwrap();
        let second = pay().await.unwrap();

        assert_eq!((first.status().as_u16(), first.replayed()), (201, false));
        assert_eq!((second.status().as_u16(), second.replayed()), (201, true));
        assert_eq!(first.headers()["location"], second.headers()["location"]);
        assert_eq!(server.effects("pay-once"), 1, "{form:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn connection_refused_is_retried_and_collapsed_into_one_cause() {
    // A port that was just free: nothing listens on it.
    let addr = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    for form in Form::BOTH {
        let client = Caller::new(
            form,
            Client::builder()
                .budget(RetryBudget::unlimited())
                .max_attempts(3),
        );

        let error = client
            .get(format!("http://{addr}/scripted"))
            .send()
            .await
            .unwrap_err();

        assert_eq!(error.attempts(), 3, "{form:?}");
        assert_eq!(
            error.stop_reason(),
            &StopReason::AttemptsExhausted { max_attempts: 3 }
        );
        assert_eq!(error.causes().len(), 1, "{error}");
        assert_eq!(
            error.causes()[0].kind(),
            CauseKind::Transport(TransportFailure::Connect)
        );
        assert_eq!(error.causes()[0].count(), 3);
        assert!(error.to_string().contains("(x3)"), "{error}");
        assert!(std::error::Error::source(&error).is_some());
        assert!(error.last_answer().is_none());
    }
}
