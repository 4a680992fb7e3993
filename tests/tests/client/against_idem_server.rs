//! The retrying client against a real `#[idempotent]` server: the two halves agree on the contract
//! (the in-flight problem type, `Retry-After`, the replay marker, the dead-key answers), not only
//! each half with a fake.

use crate::client_support::{Caller, Form};
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_runtime::axum::problem::ProblemType;
use idem_runtime::client::{Client, DeadKey, KEY_EXPIRED, KEY_MISMATCH, REQUEST_IN_FLIGHT};
use idem_runtime::metrics::Outcome;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{idempotent, Engine};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::Notify;

#[derive(Clone, FromRef)]
struct App {
    engine: Engine,
    gate: Arc<Gate>,
}

#[derive(Default)]
struct Gate {
    entered: Notify,
    open: Notify,
    runs: AtomicUsize,
}

/// Answers 409 at once (`wait = "0s"`) while the original runs, so the client must retry.
#[idempotent(scope = "global", wait = "0s")]
async fn pay(State(gate): State<Arc<Gate>>, body: String) -> (StatusCode, String) {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    gate.entered.notify_one();
    gate.open.notified().await;
    (StatusCode::CREATED, format!("paid {body}"))
}

/// Runs at once: the client must tell a reused key apart from a retry.
#[idempotent(scope = "global")]
async fn charge(State(gate): State<Arc<Gate>>, body: String) -> (StatusCode, String) {
    gate.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, format!("charged {body}"))
}

#[test]
fn the_client_recognises_the_servers_problem_types() {
    assert_eq!(REQUEST_IN_FLIGHT, ProblemType::InFlight.uri());
    assert_eq!(KEY_MISMATCH, ProblemType::KeyMismatch.uri());
    assert_eq!(KEY_EXPIRED, ProblemType::KeyExpired.uri());
}

#[tokio::test(start_paused = true)]
async fn a_key_reused_for_another_body_comes_back_as_a_dead_key() {
    for form in Form::BOTH {
        let gate = Arc::new(Gate::default());
        let app = Router::new()
            .route("/charge", post(charge))
            .with_state(App {
                engine: Engine::new(MemoryStore::new()),
                gate: gate.clone(),
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/charge", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = Caller::new(form, Client::builder());
        let key = idem_runtime::IdempotencyKey::new("order-8").unwrap();

        let first = client
            .post(&url)
            .idempotency_key(key.clone())
            .body("1000")
            .send()
            .await
            .unwrap();
        let reused = client
            .post(&url)
            .idempotency_key(key)
            .body("2000")
            .send()
            .await
            .unwrap();

        assert_eq!(
            (first.status(), first.dead_key()),
            (StatusCode::CREATED, None)
        );
        assert_eq!(
            reused.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "{form:?}"
        );
        assert_eq!(reused.dead_key(), Some(DeadKey::Mismatch), "{form:?}");
        assert_eq!(reused.attempts(), 1, "a dead key is not retried");
        assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "the handler ran once");
    }
}

#[tokio::test(start_paused = true)]
async fn an_in_flight_conflict_is_retried_until_the_original_replays() {
    let engine = Engine::new(MemoryStore::new());
    let gate = Arc::new(Gate::default());
    let app = Router::new().route("/pay", post(pay)).with_state(App {
        engine: engine.clone(),
        gate: gate.clone(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/pay", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The original request, from a caller that does not retry, holds the key.
    let original = {
        let url = url.clone();
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .header("Idempotency-Key", "order-7")
                .body("1000")
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    gate.entered.notified().await;

    // The retrying client sends the same request with the same key while it runs.
    let client = Client::builder().max_attempts(5).build().unwrap();
    let retried = {
        let url = url.clone();
        tokio::spawn(async move {
            client
                .post(url)
                .idempotency_key(idem_runtime::IdempotencyKey::new("order-7").unwrap())
                .body("1000")
                .send()
                .await
        })
    };
    // Let the original finish only once the server has answered the client's first attempt 409.
    while engine.metrics().get(Outcome::Conflict) == 0 {
        tokio::task::yield_now().await;
    }
    gate.open.notify_one();
    assert_eq!(original.await.unwrap(), StatusCode::CREATED);

    let response = retried.await.unwrap().expect("the retry succeeds");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert!(response.replayed(), "the retry got the stored response");
    assert!(response.attempts() >= 2);
    assert_eq!(gate.runs.load(Ordering::SeqCst), 1, "the handler ran once");
}
