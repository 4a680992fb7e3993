//! The payments example's `GET /openapi.json`: a valid OpenAPI 3.1 document (checked against the
//! official schema, vendored in `tests/fixtures`), in which `POST /payments` states its
//! idempotency: the key header, the replay headers, idem's problem responses.

use crate::payments_support::*;
use serde_json::Value;

const OAS_31_SCHEMA: &str = include_str!("../../fixtures/openapi-3.1-schema-2022-10-07.json");

/// Every error the official OpenAPI 3.1 schema finds in `doc`, and in the schemas among its
/// components, which that schema leaves to JSON Schema 2020-12.
fn invalidity(doc: &Value) -> Vec<String> {
    let schema: Value = serde_json::from_str(OAS_31_SCHEMA).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let mut errors: Vec<String> = validator
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    let components = doc["components"]["schemas"]
        .as_object()
        .into_iter()
        .flatten();
    for (name, schema) in components {
        if let Err(e) = jsonschema::draft202012::meta::validate(schema) {
            errors.push(format!("components.schemas.{name}: {e}"));
        }
    }
    errors
}

/// What `POST /payments` must document; each missing piece, said.
fn missing_from_post_payments(doc: &Value) -> Vec<String> {
    let mut missing = Vec::new();
    let mut need = |ok: bool, what: &str| {
        if !ok {
            missing.push(what.to_owned());
        }
    };
    let operation = &doc["paths"]["/payments"]["post"];
    let params = operation["parameters"].as_array().into_iter().flatten();
    let key = params
        .filter(|p| p["name"] == "Idempotency-Key" && p["in"] == "header")
        .collect::<Vec<_>>();
    need(key.len() == 1, "one Idempotency-Key header parameter");
    let key = key.first().copied().unwrap_or(&Value::Null);
    need(key["required"] == true, "the key required");
    let text = key["description"].as_str().unwrap_or_default();
    need(
        text.contains("replayed for 1 d"),
        "the ttl in the key's description",
    );
    need(
        text.contains("until 7 d after"),
        "the retention in the key's description",
    );
    need(text.contains("1 to 255 visible ASCII"), "the key's syntax");
    need(key["schema"]["type"] == "string", "the key's schema");

    let responses = &operation["responses"];
    let created = &responses["201"]["headers"];
    for header in ["Idempotency-Replayed", "Idempotency-Expires", "Location"] {
        need(created[header].is_object(), &format!("{header} on the 201"));
    }
    let problem = "#/components/schemas/ProblemDetails";
    for status in ["400", "409", "410", "413", "422", "503"] {
        let content = &responses[status]["content"]["application/problem+json"];
        need(
            content["schema"]["$ref"] == problem,
            &format!("the problem schema on {status}"),
        );
    }
    for status in ["409", "503"] {
        let retry_after = &responses[status]["headers"]["Retry-After"];
        need(retry_after.is_object(), &format!("Retry-After on {status}"));
    }
    let expected_types = [
        ("400", "urn:idem:problem:missing-key"),
        ("409", "urn:idem:problem:in-flight"),
        ("410", "urn:idem:problem:key-expired"),
        ("413", "urn:idem:problem:body-too-large"),
        ("422", "urn:idem:problem:key-mismatch"),
        ("503", "urn:idem:problem:busy"),
    ];
    for (status, uri) in expected_types {
        let text = responses[status]["description"]
            .as_str()
            .unwrap_or_default();
        need(
            text.contains(uri),
            &format!("{uri} in the {status}'s description"),
        );
    }
    let schema = &doc["components"]["schemas"]["ProblemDetails"];
    for member in ["type", "title", "status", "detail", "instance"] {
        need(
            schema["properties"][member].is_object(),
            &format!("`{member}` in ProblemDetails"),
        );
    }
    missing
}

async fn served_document() -> Value {
    let dir = tempfile::tempdir().unwrap();
    let app = start(dir.path()).await;
    let reply = send(&app, get("/openapi.json", None)).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    reply.json()
}

#[tokio::test]
async fn the_served_document_is_valid_openapi_3_1() {
    let doc = served_document().await;
    assert_eq!(doc["openapi"], "3.1.0");
    let errors = invalidity(&doc);
    assert!(errors.is_empty(), "{errors:#?}");
    // Every route is documented, and the other idempotent operations state their key too.
    for (path, method) in [
        ("/payments", "get"),
        ("/payments/{id}", "get"),
        ("/charges", "get"),
        ("/payments/{id}/refund", "post"),
        ("/legacy/payments", "post"),
    ] {
        assert!(doc["paths"][path][method].is_object(), "{method} {path}");
    }
    let key_of = |path: &str| {
        let params = doc["paths"][path]["post"]["parameters"].as_array().cloned();
        params
            .into_iter()
            .flatten()
            .find(|p| p["name"] == "Idempotency-Key" && p["in"] == "header")
            .unwrap_or_else(|| panic!("POST {path} documents no Idempotency-Key"))
    };
    assert_eq!(
        key_of("/legacy/payments")["required"],
        false,
        "derived when missing"
    );
    // The refund runs under IdempotencyLayer: its route names the key, the modifier does the rest.
    assert_eq!(key_of("/payments/{id}/refund")["required"], true);
    let refund = &doc["paths"]["/payments/{id}/refund"]["post"]["responses"];
    assert!(refund["409"]["headers"]["Retry-After"].is_object());
    assert!(refund["200"]["headers"]["Idempotency-Replayed"].is_object());
}

#[tokio::test]
async fn post_payments_documents_its_idempotency() {
    let doc = served_document().await;
    let missing = missing_from_post_payments(&doc);
    assert!(missing.is_empty(), "{missing:#?}");
    // The handler's own 422 and 503 keep their descriptions beside idem's.
    let responses = &doc["paths"]["/payments"]["post"]["responses"];
    let invalid = responses["422"]["description"].as_str().unwrap();
    assert!(
        invalid.starts_with("The body is JSON but not a payment request"),
        "{invalid}"
    );
    assert!(responses["422"]["content"]["application/json"].is_object());
    // What the body extractor and the auth refuse, as problems.
    for (status, uri) in [
        ("400", "urn:payments:problem:malformed-body"),
        ("401", "urn:payments:problem:unauthorized"),
        ("415", "urn:payments:problem:unsupported-media-type"),
        ("422", "urn:payments:problem:invalid-body"),
    ] {
        let text = responses[status]["description"].as_str().unwrap();
        assert!(text.contains(uri), "{status}: {text}");
        let content = &responses[status]["content"]["application/problem+json"];
        assert!(content["schema"].is_object(), "{status}");
    }
    // The key's schema is idem's grammar; the body's says what the handler takes.
    let key = doc["paths"]["/payments"]["post"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "Idempotency-Key")
        .unwrap();
    assert_eq!(key["schema"]["pattern"], idem_runtime::openapi::KEY_PATTERN);
    let body = &doc["components"]["schemas"]["NewPayment"]["properties"];
    assert_eq!(body["amount"]["minimum"], 1);
    assert_eq!(body["currency"]["pattern"], "^[A-Z]{3}$");
    let down = responses["503"]["description"].as_str().unwrap();
    assert!(
        down.contains("urn:payments:problem:database-unavailable"),
        "{down}"
    );
}

/// The checks above are not vacuous: each catches a document that lacks what it looks for.
#[tokio::test]
async fn the_checks_catch_what_a_document_lacks() {
    let doc = served_document().await;
    let remove = |pointer: &str, name: &str| {
        let mut doc = doc.clone();
        let object = doc.pointer_mut(pointer).unwrap().as_object_mut().unwrap();
        assert!(object.remove(name).is_some(), "{pointer}/{name}");
        doc
    };
    let post = "/paths/~1payments/post";
    for (pointer, name) in [
        (format!("{post}/responses/409/headers"), "Retry-After"),
        (
            format!("{post}/responses/201/headers"),
            "Idempotency-Replayed",
        ),
        (
            format!("{post}/responses/201/headers"),
            "Idempotency-Expires",
        ),
        (format!("{post}/responses"), "410"),
        (
            format!("{post}/responses/503/content"),
            "application/problem+json",
        ),
        (
            "/components/schemas/ProblemDetails/properties".into(),
            "instance",
        ),
    ] {
        let missing = missing_from_post_payments(&remove(&pointer, name));
        assert!(!missing.is_empty(), "without {pointer}/{name}");
    }
    let mut optional = doc.clone();
    optional["paths"]["/payments"]["post"]["parameters"][0]["required"] = false.into();
    assert_eq!(missing_from_post_payments(&optional), ["the key required"]);

    // And the validator refuses what OpenAPI 3.1 does not allow.
    let mut invalid = doc.clone();
    invalid["paths"]["/payments"]["post"]["parameters"][0]["in"] = "headers".into();
    assert!(!invalidity(&invalid).is_empty());
    let mut invalid = doc.clone();
    invalid["paths"]["/payments"]["post"]["responses"]["409"]["headers"]["Retry-After"]
        .as_object_mut()
        .unwrap()
        .remove("schema");
    assert!(
        !invalidity(&invalid).is_empty(),
        "a header needs a schema or content"
    );
}
