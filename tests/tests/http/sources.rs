//! Where the key comes from (another header, a JSON body field), what the fingerprint covers
//! (members a retry may change left out), which answers are kept (a 4xx released for the
//! corrected retry), and the outcome a middleware reads from the response. Each case runs against
//! the attribute's handlers and against the same plain handlers under `IdempotencyLayer`,
//! counting the handler's runs.

use crate::http_support::{send, App, Harness, Probe, Reply};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::axum::{IdempotencyLayer, ProblemType, RequestOutcome};
use idem_runtime::idempotent;
use idem_runtime::policy::{ClientErrors, Policy, PolicyError};
use idem_runtime::Engine;
use serde::Deserialize;
use std::sync::{Arc, Mutex};

#[derive(Deserialize)]
struct Delivery {
    amount: u64,
}

/// A delivery's effect: counted, and answered with the run's number and what it was given.
fn delivered(probe: &Probe, delivery: &serde_json::Value) -> Response {
    let n = probe.call();
    (
        StatusCode::OK,
        Json(serde_json::json!({ "run": n, "got": delivery })),
    )
        .into_response()
}

/// An order that the handler refuses with a 422 when its amount is zero.
fn validated(probe: &Probe, order: &Delivery) -> Response {
    let n = probe.call();
    match order.amount {
        0 => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("run {n}: amount must be positive"),
        )
            .into_response(),
        amount => (StatusCode::CREATED, format!("run {n}: {amount}")).into_response(),
    }
}

mod attr {
    use super::*;

    #[idempotent(scope = "global", key_header = "Webhook-Id", fingerprint_exclude = ["/sent_at", "/meta/trace_id"])]
    pub(super) async fn hook(
        State(probe): State<Probe>,
        Json(delivery): Json<serde_json::Value>,
    ) -> Response {
        delivered(&probe, &delivery)
    }

    #[idempotent(scope = "global", key_field = "/request_id")]
    pub(super) async fn by_field(
        State(probe): State<Probe>,
        Json(body): Json<serde_json::Value>,
    ) -> Response {
        delivered(&probe, &body)
    }

    #[idempotent(scope = "global")]
    pub(super) async fn by_client_key(
        State(probe): State<Probe>,
        Json(body): Json<serde_json::Value>,
    ) -> Response {
        delivered(&probe, &body)
    }

    #[idempotent(scope = "global", client_errors = "release")]
    pub(super) async fn released(
        State(probe): State<Probe>,
        Json(order): Json<Delivery>,
    ) -> Response {
        validated(&probe, &order)
    }

    #[idempotent(scope = "global")]
    pub(super) async fn stored(
        State(probe): State<Probe>,
        Json(order): Json<Delivery>,
    ) -> Response {
        validated(&probe, &order)
    }
}

mod plain {
    use super::*;

    pub(super) async fn any(
        State(probe): State<Probe>,
        Json(body): Json<serde_json::Value>,
    ) -> Response {
        delivered(&probe, &body)
    }

    pub(super) async fn validate(
        State(probe): State<Probe>,
        Json(order): Json<Delivery>,
    ) -> Response {
        validated(&probe, &order)
    }
}

const HOOKS: Policy = Policy::new()
    .key_header("webhook-id")
    .fingerprint_exclude(&["/sent_at", "/meta/trace_id"]);

/// The routes, protected by the attribute or by the layer, with a middleware outside that
/// records each response's outcome.
fn routes(app: App, layered: bool, seen: Arc<Mutex<Vec<RequestOutcome>>>) -> Router {
    let router = match layered {
        false => Router::new()
            .route("/hooks", post(attr::hook))
            .route("/by-field", post(attr::by_field))
            .route("/by-client-key", post(attr::by_client_key))
            .route("/released", post(attr::released))
            .route("/stored", post(attr::stored)),
        true => {
            let engine = app.engine.clone();
            let idem =
                |policy: Policy| IdempotencyLayer::new(engine.clone(), policy).global_scope();
            Router::new()
                .route("/hooks", post(plain::any).route_layer(idem(HOOKS)))
                .route(
                    "/by-field",
                    post(plain::any).route_layer(idem(Policy::new().key_field("/request_id"))),
                )
                .route(
                    "/by-client-key",
                    post(plain::any).route_layer(idem(Policy::new())),
                )
                .route(
                    "/released",
                    post(plain::validate)
                        .route_layer(idem(Policy::new().client_errors(ClientErrors::Release))),
                )
                .route(
                    "/stored",
                    post(plain::validate).route_layer(idem(Policy::new())),
                )
        }
    };
    router
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            let seen = seen.clone();
            async move {
                let response = next.run(request).await;
                if let Some(outcome) = response.extensions().get::<RequestOutcome>() {
                    seen.lock().unwrap().push(*outcome);
                }
                response
            }
        }))
        .with_state(app)
}

struct Case {
    router: Router,
    probe: Probe,
    seen: Arc<Mutex<Vec<RequestOutcome>>>,
}

impl Case {
    fn new(layered: bool) -> Self {
        let h = Harness::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let app = App {
            engine: h.engine.clone(),
            probe: h.probe.clone(),
        };
        Self {
            router: routes(app, layered, seen.clone()),
            probe: h.probe,
            seen,
        }
    }

    async fn post(&self, path: &str, headers: &[(&str, &str)], body: serde_json::Value) -> Reply {
        let mut request =
            axum::http::Request::post(path).header("content-type", "application/json");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        send(
            self.router.clone(),
            request.body(Body::from(body.to_string())).unwrap(),
        )
        .await
    }

    fn outcomes(&self) -> Vec<RequestOutcome> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// Runs `case` for the attribute and for the layer.
macro_rules! both {
    (async fn $name:ident($case:ident) $body:block) => {
        mod $name {
            use super::*;
            async fn run($case: Case) $body
            #[tokio::test]
            async fn attribute() { run(Case::new(false)).await }
            #[tokio::test]
            async fn layer() { run(Case::new(true)).await }
        }
    };
}

both! {
    async fn a_webhook_id_runs_once_and_its_redeliveries_replay(c) {
        let delivery = |sent_at: u64, trace: &str, amount: u64| serde_json::json!({
            "type": "charge.disputed", "amount": amount, "sent_at": sent_at,
            "meta": { "trace_id": trace, "attempt": 1 },
        });
        let first = c.post("/hooks", &[("webhook-id", "msg_1")], delivery(1, "t1", 5)).await;
        assert_eq!(first.status, 200);
        assert!(!first.replayed());
        // Redeliveries change the excluded members only: the same request, the stored answer.
        for i in 2..=5 {
            let again = c.post("/hooks", &[("webhook-id", "msg_1")], delivery(i, &format!("t{i}"), 5)).await;
            assert_eq!(again.status, 200);
            assert!(again.replayed());
            assert_eq!(again.body, first.body, "replayed as it was, with the first sent_at");
        }
        assert_eq!(c.probe.calls(), 1);
        // Any other member counts.
        let changed = c.post("/hooks", &[("webhook-id", "msg_1")], delivery(1, "t1", 6)).await;
        changed.assert_problem(422, "urn:idem:problem:key-mismatch");
        let mut nested = delivery(1, "t1", 5);
        nested["meta"]["attempt"] = 2.into();
        let nested = c.post("/hooks", &[("webhook-id", "msg_1")], nested).await;
        nested.assert_problem(422, "urn:idem:problem:key-mismatch");
        // Another id is another delivery.
        let second = c.post("/hooks", &[("webhook-id", "msg_2")], delivery(1, "t1", 5)).await;
        assert_eq!((second.status, second.replayed()), (StatusCode::OK, false));
        assert_eq!(c.probe.calls(), 2);
        // The Idempotency-Key header is not this endpoint's key.
        let unkeyed = c.post("/hooks", &[("idempotency-key", "msg_1")], delivery(1, "t1", 5)).await;
        unkeyed.assert_problem(400, "urn:idem:problem:missing-key");
        assert!(unkeyed.json()["detail"].as_str().unwrap().contains("webhook-id"));
        let twice = c.post("/hooks", &[("webhook-id", "a"), ("webhook-id", "b")], delivery(1, "t1", 5)).await;
        twice.assert_problem(400, "urn:idem:problem:malformed-key");
        assert_eq!(c.probe.calls(), 2);
    }
}

both! {
    async fn keys_from_different_sources_never_meet(c) {
        let body = serde_json::json!({ "request_id": "k1", "amount": 5 });
        // The same key text, from the client's header, another header and a body field: three
        // records, three runs, no mismatch between them.
        let by_client = c.post("/by-client-key", &[("idempotency-key", "k1")], body.clone()).await;
        let by_header = c.post("/hooks", &[("webhook-id", "k1")], body.clone()).await;
        let by_field = c.post("/by-field", &[], body.clone()).await;
        for reply in [&by_client, &by_header, &by_field] {
            assert_eq!((reply.status, reply.replayed()), (StatusCode::OK, false), "{reply:?}");
        }
        assert_eq!(c.probe.calls(), 3);
    }
}

both! {
    async fn a_key_from_a_body_field_replays_and_refuses_another_body(c) {
        let first = c.post("/by-field", &[], serde_json::json!({ "request_id": "req-7", "amount": 5 })).await;
        assert_eq!(first.status, 200);
        // Re-serialised, members reordered: the same request.
        let again = c.post("/by-field", &[], serde_json::json!({ "amount": 5, "request_id": "req-7" })).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        let other = c.post("/by-field", &[], serde_json::json!({ "request_id": "req-7", "amount": 6 })).await;
        other.assert_problem(422, "urn:idem:problem:key-mismatch");
        // An integer is a key too; another id is another request.
        let numbered = c.post("/by-field", &[], serde_json::json!({ "request_id": 42, "amount": 5 })).await;
        assert_eq!((numbered.status, numbered.replayed()), (StatusCode::OK, false));
        assert_eq!(c.probe.calls(), 2);
        // No field, a null, or a field that is no key.
        let missing = c.post("/by-field", &[("idempotency-key", "req-7")], serde_json::json!({ "amount": 5 })).await;
        missing.assert_problem(400, "urn:idem:problem:missing-key");
        let null = c.post("/by-field", &[], serde_json::json!({ "request_id": null })).await;
        null.assert_problem(400, "urn:idem:problem:missing-key");
        for bad in [serde_json::json!({ "id": 1 }), serde_json::json!(""), serde_json::json!("a b"), serde_json::json!(1.5)] {
            let reply = c.post("/by-field", &[], serde_json::json!({ "request_id": bad })).await;
            reply.assert_problem(400, "urn:idem:problem:malformed-key");
            assert!(reply.json()["detail"].as_str().unwrap().contains("/request_id"), "{reply:?}");
        }
        assert_eq!(c.probe.calls(), 2);
    }
}

both! {
    async fn a_released_4xx_lets_the_corrected_retry_run(c) {
        let refused = c.post("/released", &[("idempotency-key", "o1")], serde_json::json!({ "amount": 0 })).await;
        assert_eq!(refused.status, 422);
        // The same request again runs again: nothing was stored.
        let again = c.post("/released", &[("idempotency-key", "o1")], serde_json::json!({ "amount": 0 })).await;
        assert_eq!((again.status, again.replayed()), (StatusCode::UNPROCESSABLE_ENTITY, false));
        let corrected = c.post("/released", &[("idempotency-key", "o1")], serde_json::json!({ "amount": 5 })).await;
        assert_eq!((corrected.status, corrected.replayed()), (StatusCode::CREATED, false));
        assert_eq!(c.probe.calls(), 3);
        // A 2xx is kept.
        let retry = c.post("/released", &[("idempotency-key", "o1")], serde_json::json!({ "amount": 5 })).await;
        assert!(retry.replayed());
        assert_eq!(retry.body, corrected.body);
        assert_eq!(c.probe.calls(), 3);
        // By default the 4xx is kept: replayed to the same request, a mismatch for another.
        let kept = c.post("/stored", &[("idempotency-key", "o2")], serde_json::json!({ "amount": 0 })).await;
        assert_eq!(kept.status, 422);
        let replayed = c.post("/stored", &[("idempotency-key", "o2")], serde_json::json!({ "amount": 0 })).await;
        assert_eq!((replayed.status, replayed.replayed()), (StatusCode::UNPROCESSABLE_ENTITY, true));
        let corrected = c.post("/stored", &[("idempotency-key", "o2")], serde_json::json!({ "amount": 5 })).await;
        corrected.assert_problem(422, "urn:idem:problem:key-mismatch");
        assert_eq!(c.probe.calls(), 4);
    }
}

both! {
    async fn a_middleware_reads_the_outcome_of_every_response(c) {
        let body = serde_json::json!({ "amount": 5 });
        c.post("/by-client-key", &[("idempotency-key", "m1")], body.clone()).await;
        c.post("/by-client-key", &[("idempotency-key", "m1")], body.clone()).await;
        c.post("/by-client-key", &[], body.clone()).await;
        c.post("/released", &[("idempotency-key", "m2")], serde_json::json!({ "amount": 0 })).await;
        assert_eq!(c.outcomes(), [
            RequestOutcome::Executed,
            RequestOutcome::Replayed,
            RequestOutcome::Rejected(ProblemType::MissingKey),
            RequestOutcome::Released,
        ]);
        assert_eq!(c.probe.calls(), 2);
    }
}

#[test]
fn the_layer_refuses_a_malformed_source_with_a_typed_error() {
    let engine = || Engine::new(idem_runtime::store::memory::MemoryStore::new());
    let cases = [
        (
            Policy::new().key_header("webhook id"),
            PolicyError::InvalidKeyHeader,
        ),
        (
            Policy::new().key_field("id"),
            PolicyError::InvalidPointer("key_field"),
        ),
        (
            Policy::new().fingerprint_exclude(&["/ok", "/a~2"]),
            PolicyError::InvalidPointer("fingerprint_exclude"),
        ),
        (
            Policy::new().key_field("/id").fingerprint_only(&["/id"]),
            PolicyError::KeyFieldInFingerprint,
        ),
    ];
    for (policy, expected) in cases {
        let error = IdempotencyLayer::try_new(engine(), policy).expect_err("refused");
        assert_eq!(error, expected);
        assert!(error.to_string().starts_with("idem policy: "), "{error}");
    }
}
