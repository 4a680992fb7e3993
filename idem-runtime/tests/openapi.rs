//! `#[utoipa::path]` below `#[idempotent]`, and the [`Idempotency`] modifier: what each handler's
//! operation documents, for each way a path attribute can be written and each `missing_key`.

#![cfg(feature = "utoipa")]

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem_runtime::axum::Scope;
use idem_runtime::openapi::Idempotency;
use idem_runtime::policy::Policy;
use idem_runtime::{idempotent, Engine};
use serde_json::Value;
use std::borrow::Cow;
use std::time::Duration;
use utoipa::{Modify, OpenApi};

const ORDERS: Policy = Policy::new()
    .ttl(Duration::from_secs(3600))
    .max_request_body(4096);

/// Parameters and responses of its own, a named policy and an override.
#[idempotent(scope = "global", policy = ORDERS, retain = "30d")]
#[utoipa::path(
    post,
    path = "/shops/{shop}/orders",
    params(("shop" = String, Path, description = "The shop")),
    responses(
        (status = 201, description = "Created"),
        (status = 422, description = "The order is invalid"),
        (status = 500, description = "Failed"),
    ),
)]
async fn create_order(Path(shop): Path<String>, body: String) -> (StatusCode, String) {
    (StatusCode::CREATED, format!("{shop}: {body}"))
}

/// No `params` and no `responses`; the key required from a date in the past.
#[idempotent(scope = "global", missing_key = "pass", reject_after = "2020-01-01")]
#[utoipa::path(post, path = "/late")]
async fn late() -> StatusCode {
    StatusCode::OK
}

#[idempotent(
    scope = "global",
    missing_key = "pass",
    reject_after = "2999-01-01",
    server_errors = "store"
)]
#[utoipa::path(post, path = "/early", responses((status = 503, description = "Down")),)]
async fn early() -> StatusCode {
    StatusCode::OK
}

/// The body's path parameter, written last, is wrapped by the attribute: utoipa's `axum_extras`
/// no longer sees it, so it is declared.
#[idempotent(scope = "caller", missing_key = "derive", wait = "0s")]
#[utoipa::path(post, path = "/legacy/{id}", params(("id" = u64, Path)), responses((status = 200, description = "Done")))]
async fn legacy(caller: Caller, Path(id): Path<u64>) -> String {
    format!("{} {id}", caller.0)
}

/// Who calls, from a header.
struct Caller(String);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let caller = parts.headers.get("x-caller").and_then(|v| v.to_str().ok());
        caller
            .map(|c| Caller(c.into()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for Caller {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[derive(OpenApi)]
#[openapi(paths(create_order, late, early, legacy), modifiers(&Idempotency))]
struct Api;

fn document() -> Value {
    serde_json::to_value(Api::openapi()).unwrap()
}

fn post_of<'a>(doc: &'a Value, path: &str) -> &'a Value {
    &doc["paths"][path]["post"]
}

fn key_header(operation: &Value) -> &Value {
    let params = operation["parameters"].as_array().unwrap();
    let keys: Vec<&Value> = params
        .iter()
        .filter(|p| p["name"] == "Idempotency-Key")
        .collect();
    assert_eq!(keys.len(), 1, "{params:#?}");
    assert_eq!(keys[0]["in"], "header");
    keys[0]
}

#[test]
fn the_handlers_are_still_axum_handlers() {
    let _: Router<Engine> = Router::new()
        .route("/shops/{shop}/orders", post(create_order))
        .route("/late", post(late))
        .route("/early", post(early))
        .route("/legacy/{id}", post(legacy));
}

#[test]
fn the_key_header_states_the_final_policy() {
    let doc = document();
    let create = post_of(&doc, "/shops/{shop}/orders");
    let key = key_header(create);
    assert_eq!(key["required"], true);
    let text = key["description"].as_str().unwrap();
    assert!(text.contains("replayed for 1 h"), "{text}");
    assert!(text.contains("until 30 d after it"), "{text}");
    assert_eq!(key["x-idem"]["ttl_ms"], 3_600_000);
    assert_eq!(key["x-idem"]["retain_ms"], 30 * 86_400_000u64);
    assert_eq!(key["x-idem"]["max_request_body"], 4096);
    // Exactly the keys idem accepts (tests/tests/http/key_schema.rs checks the pattern).
    assert_eq!(
        key["schema"]["maxLength"],
        idem_runtime::openapi::KEY_MAX_LENGTH
    );
    assert_eq!(key["schema"]["pattern"], idem_runtime::openapi::KEY_PATTERN);
    // The handler's own parameter is kept.
    let params = create["parameters"].as_array().unwrap();
    assert!(params
        .iter()
        .any(|p| p["name"] == "shop" && p["in"] == "path"));

    assert_eq!(key_header(post_of(&doc, "/late"))["required"], true);
    let early = key_header(post_of(&doc, "/early"));
    assert_eq!(early["required"], false);
    assert!(early["description"]
        .as_str()
        .unwrap()
        .contains("Optional until Tue, 01 Jan 2999 00:00:00 GMT"));
    let legacy = post_of(&doc, "/legacy/{id}");
    assert_eq!(key_header(legacy)["required"], false);
    assert!(legacy["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["name"] == "id"));
}

#[test]
fn stored_responses_carry_the_replay_headers_and_problems_are_added() {
    let doc = document();
    let responses = &post_of(&doc, "/shops/{shop}/orders")["responses"];
    for status in ["201", "422"] {
        let headers = &responses[status]["headers"];
        assert!(headers["Idempotency-Replayed"].is_object(), "{status}");
        assert!(headers["Idempotency-Expires"].is_object(), "{status}");
    }
    // A 5xx is released, not stored: never replayed.
    assert!(responses["500"]["headers"]
        .get("Idempotency-Replayed")
        .is_none());

    let problem = "#/components/schemas/ProblemDetails";
    for status in ["400", "409", "410", "413", "422", "503"] {
        let content = &responses[status]["content"]["application/problem+json"];
        assert_eq!(content["schema"]["$ref"], problem, "{status}");
    }
    for status in ["409", "503"] {
        assert!(
            responses[status]["headers"]["Retry-After"].is_object(),
            "{status}"
        );
    }
    // The handler's 422 and idem's share the status: both are described.
    let unprocessable = responses["422"]["description"].as_str().unwrap();
    assert!(
        unprocessable.starts_with("The order is invalid"),
        "{unprocessable}"
    );
    assert!(
        unprocessable.contains("urn:idem:problem:key-mismatch"),
        "{unprocessable}"
    );
    assert!(responses["413"]["description"]
        .as_str()
        .unwrap()
        .contains("over 4096 bytes"));
    assert!(responses["400"]["description"]
        .as_str()
        .unwrap()
        .contains("urn:idem:problem:missing-key"));
    assert!(responses["503"]["description"]
        .as_str()
        .unwrap()
        .contains("urn:idem:problem:busy"));

    let schema = &doc["components"]["schemas"]["ProblemDetails"];
    for member in ["type", "title", "status", "detail", "instance"] {
        assert!(schema["properties"][member].is_object(), "{member}");
    }
}

#[test]
fn the_policy_decides_which_problems_and_headers_apply() {
    let doc = document();
    // Stored 5xx are replayed like any other response.
    let early = &post_of(&doc, "/early")["responses"];
    assert!(early["503"]["headers"]["Idempotency-Replayed"].is_object());
    assert!(early["503"]["description"]
        .as_str()
        .unwrap()
        .starts_with("Down"));
    // Without `reject_after`... a derived key is never missing.
    let legacy = &post_of(&doc, "/legacy/{id}")["responses"];
    let bad_request = legacy["400"]["description"].as_str().unwrap();
    assert!(!bad_request.contains("missing-key"), "{bad_request}");
    assert!(bad_request.contains("malformed-key"), "{bad_request}");
    assert!(legacy["409"]["description"]
        .as_str()
        .unwrap()
        .contains("after 0 ms"));
    assert!(legacy["200"]["headers"]["Idempotency-Replayed"].is_object());
}

#[test]
fn modifying_again_changes_nothing() {
    let mut api = Api::openapi();
    let once = serde_json::to_value(&api).unwrap();
    Idempotency.modify(&mut api);
    assert_eq!(serde_json::to_value(&api).unwrap(), once);
}

#[test]
fn without_the_modifier_only_the_header_is_documented() {
    #[derive(OpenApi)]
    #[openapi(paths(create_order))]
    struct Bare;
    let doc = serde_json::to_value(Bare::openapi()).unwrap();
    let create = post_of(&doc, "/shops/{shop}/orders");
    assert_eq!(key_header(create)["required"], true);
    assert!(create["responses"].get("409").is_none());
}
