//! OpenAPI documents that know each handler's idempotency policy, through [utoipa] 5.
//!
//! Write `#[utoipa::path(...)]` below `#[idempotent]` (above it, utoipa would run first and idem
//! could not add anything, so that order is a compile error saying so), and add [`Idempotency`] to
//! the API's modifiers once, by its bare name (utoipa's `modifiers(...)` takes no path):
//!
//! ```
//! # use idem_runtime::idempotent;
//! use axum::http::StatusCode;
//! use idem_runtime::openapi::Idempotency;
//! use utoipa::OpenApi;
//!
//! #[idempotent(scope = "global", ttl = "1h")]
//! #[utoipa::path(post, path = "/orders", responses((status = 201, description = "Created")))]
//! async fn create_order(body: String) -> StatusCode {
//!     StatusCode::CREATED
//! }
//!
//! #[derive(OpenApi)]
//! #[openapi(paths(create_order), modifiers(&Idempotency))]
//! struct Api;
//!
//! let api = Api::openapi();
//! let create = api.paths.paths["/orders"].post.as_ref().unwrap();
//! assert_eq!(create.parameters.as_ref().unwrap()[0].name, "Idempotency-Key");
//! assert!(create.responses.responses.contains_key("409"));
//! ```
//!
//! Each such operation then documents:
//!
//! - the `Idempotency-Key` header: required as `missing_key` says (`"pass"` with `reject_after`:
//!   required once the date has passed when the document is built), its syntax, and the expiry
//!   policy (`ttl` and `retain`), which the IETF draft says a server must publish. The policy is
//!   also the parameter's `x-idem` extension, for tools (durations in milliseconds);
//! - `Idempotency-Replayed` and `Idempotency-Expires` on the responses the handler declares, as
//!   idem stores and replays them (not its 5xx ones, unless `server_errors = "store"`). Both are
//!   optional headers: a response answered before the handler runs, such as an extractor's 401,
//!   carries neither;
//! - the problems idem answers, `application/problem+json` with the RFC 9457 `ProblemDetails`
//!   schema: 400, 409 and 503 with `Retry-After`, 410, 413, and 422 with `Idempotency-Expires`. A
//!   status the handler declares too keeps its own description and content, and gets idem's.
//!
//! The attribute adds a type to the path's `params(...)` that yields the header from the
//! handler's final policy (the named `policy`, then the options written). The responses are the
//! modifier's work, on the finished document: utoipa keeps one response per status, so a 422 of
//! the handler's and idem's 422 could not both be listed by the attribute. With utoipa-axum's
//! `OpenApiRouter`, run it on the document `split_for_parts` returns:
//! `Idempotency.modify(&mut api)`.
//!
//! utoipa reads the handler as the attribute rewrote it, whose last parameter is wrapped: declare
//! the request body (`request_body = ...`) and a path parameter that comes last
//! (`params(("id" = String, Path))`) in `#[utoipa::path]`, as `axum_extras` cannot find them.
//!
//! Why utoipa and not aide: utoipa documents each handler where it is declared, by an attribute on
//! the function, which is where idem's policy is known, and it leaves axum's `Router` and the
//! application's types as they are. aide builds the document from the routes instead, which asks
//! an application to move to its `ApiRouter` and to derive `schemars` schemas for its types, and
//! it sees extractor types, which do not carry the policy. utoipa is also the one most axum
//! services already use.
//!
//! [utoipa]: https://docs.rs/utoipa

use crate::axum::problem::{ProblemType, PROBLEM_JSON};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::policy::{MissingKey, Policy};
use serde_json::{json, Map, Value};
use std::time::Duration;
use utoipa::openapi::path::Parameter;
use utoipa::openapi::OpenApi;

/// The extension of the `Idempotency-Key` parameter that holds the policy.
const EXTENSION: &str = "x-idem";
/// How the descriptions of idem's problem responses begin.
const IDEM: &str = "idem:";

/// Completes the document for every operation whose `Idempotency-Key` parameter `#[idempotent]`
/// added: the response headers and the problem responses (see the [module](self)).
///
/// Running it twice changes nothing more.
#[derive(Debug, Clone, Copy, Default)]
pub struct Idempotency;

impl utoipa::Modify for Idempotency {
    fn modify(&self, api: &mut OpenApi) {
        let mut found = false;
        for i in api.paths.paths.values_mut() {
            let operations = [
                &mut i.get,
                &mut i.put,
                &mut i.post,
                &mut i.delete,
                &mut i.patch,
            ];
            let more = [&mut i.options, &mut i.head, &mut i.trace];
            for operation in operations.into_iter().chain(more).flatten() {
                let params = operation.parameters.iter().flatten();
                let Some(policy) = params
                    .filter_map(|p| p.extensions.as_ref()?.get(EXTENSION))
                    .next()
                else {
                    continue;
                };
                let responses = &mut operation.responses.responses;
                let Ok(Value::Object(mut all)) = serde_json::to_value(&*responses) else {
                    continue;
                };
                document(&mut all, policy);
                if let Ok(documented) = serde_json::from_value(Value::Object(all)) {
                    (*responses, found) = (documented, true);
                }
            }
        }
        let schema = json!({"type": "object", "description": "Problem details (RFC 9457). Clients branch on `type`.", "required": ["type", "title", "status"], "properties": {
            "type": {"type": "string", "description": "A URI identifying the problem type, such as `urn:idem:problem:in-flight`."},
            "title": {"type": "string", "description": "A short summary of the problem type."},
            "status": {"type": "integer", "description": "The HTTP status code."},
            "detail": {"type": "string", "description": "What happened in this occurrence, and what to do."},
            "instance": {"type": "string", "description": "A URI identifying this occurrence."},
        }});
        if let (true, Ok(schema)) = (found, serde_json::from_value(schema)) {
            let components = api.components.get_or_insert_with(Default::default);
            components
                .schemas
                .entry("ProblemDetails".into())
                .or_insert(schema);
        }
    }
}

/// The `Idempotency-Key` header parameter of an operation under `policy`, for documents built
/// by hand (the attribute adds it to `#[utoipa::path]` operations itself).
pub fn key_parameter(policy: &Policy) -> Parameter {
    let (ttl, retain) = (human(policy.ttl), human(policy.retain));
    let window = human(policy.derive_window);
    let now = SystemClock.now().as_millis();
    // `reject_after` is only valid with `missing_key = "pass"`.
    let due = policy.reject_after_ms.is_some_and(|at| at <= now);
    let required = policy.missing_key == MissingKey::Reject || due;
    let without = match (policy.missing_key, policy.reject_after_ms) {
        (MissingKey::Reject, _) => "Required (400 without).".into(),
        (MissingKey::Pass, None) => "Optional: a request without one runs unprotected.".into(),
        (MissingKey::Pass, Some(at)) => format!("Optional until {}, then required.", date(at)),
        (MissingKey::Derive, _) => format!("Optional: identical requests within {window} are one."),
    };
    let extension = json!({
        "ttl_ms": policy.ttl.as_millis() as u64, "retain_ms": policy.retain.as_millis() as u64,
        "wait_ms": policy.wait.as_millis() as u64, "derive_window_ms": policy.derive_window.as_millis() as u64,
        "missing_key": format!("{:?}", policy.missing_key).to_lowercase(), "reject_after_ms": policy.reject_after_ms,
        "server_errors": format!("{:?}", policy.server_errors).to_lowercase(), "max_request_body": policy.max_request_body,
    });
    let description = format!("A unique key for this request (a UUID, say), sent again unchanged when the request is retried: a retry gets the first request's stored response instead of running again. 1 to 255 visible ASCII characters, bare or as a quoted string (quote a key that contains a comma). {without} Expiry: a response is replayed for {ttl} after the first request; after that, and until {retain} after it, the key answers 410 and is not run again.");
    let schema = json!({"type": "string", "minLength": 1, "maxLength": KEY_MAX_LENGTH, "pattern": KEY_PATTERN});
    let parameter = json!({"name": "Idempotency-Key", "in": "header", "required": required,
        "description": description, "schema": schema, "example": "8e03978e-40d5-43e8-bc93-6894a57f9324", EXTENSION: extension});
    serde_json::from_value(parameter).expect("the parameter is well-formed")
}

/// The `Idempotency-Key` values idem accepts ([`IdempotencyKey::parse`](crate::IdempotencyKey::parse)),
/// as an ECMA-262 regular expression: 1 to 255 visible ASCII characters bare (no comma, not
/// starting with `"`), or the same between double quotes, where `"` and `\` are escaped with `\`
/// (an RFC 8941 string). A header's surrounding spaces are not part of its value.
pub const KEY_PATTERN: &str =
    r#"^(?:[!#-+\--~][!-+\--~]{0,254}|"(?:[!#-\[\]-~]|\\["\\]){1,255}")$"#;

/// The longest value [`KEY_PATTERN`] admits: 255 escaped characters between quotes.
pub const KEY_MAX_LENGTH: usize = 2 + 2 * crate::key::MAX_KEY_LEN;

/// The replay headers on the handler's own responses (those idem stores), then idem's problems.
fn document(responses: &mut Map<String, Value>, policy: &Value) {
    let header = |text: &str, ty: &str| json!({"description": text, "schema": {"type": ty}});
    let expires = header("When the key stops being bound to this request and its response (an IMF-fixdate): until then a retry with the same key gets this response again. Absent if it was not stored.", "string");
    let replay = json!({"headers": {
        "Idempotency-Replayed": header("`true` on a replay: the stored response of the first request with this key, not a new execution. Absent on a fresh response.", "string"),
        "Idempotency-Expires": expires,
    }});
    for (status, response) in responses.iter_mut() {
        let ours = response["description"]
            .as_str()
            .is_some_and(|d| d.starts_with(IDEM));
        let stored = !status.starts_with('5') || policy["server_errors"] == "store";
        if stored && !ours && response.get("$ref").is_none() {
            merge(response, replay.clone());
        }
    }
    let retry_after = json!({"Retry-After": header("Seconds to wait before retrying with the same key.", "integer")});
    for (status, description) in problems(policy) {
        let response = responses
            .entry(status.to_string())
            .or_insert(json!({"description": ""}));
        let Some(Value::String(text)) = response.get_mut("description") else {
            continue; // a `$ref` to a shared response: left as it is
        };
        if !text.contains(&description) {
            *text = [text.as_str(), &description].join(if text.is_empty() { "" } else { "\n\n" });
        }
        let headers = match status {
            409 | 503 => retry_after.clone(),
            422 => json!({"Idempotency-Expires": expires}),
            _ => json!({}),
        };
        let schema = json!({"$ref": "#/components/schemas/ProblemDetails"});
        let problem = json!({"content": {PROBLEM_JSON: {"schema": schema}}, "headers": headers});
        merge(response, problem);
    }
}

/// Adds to `target` what it lacks of `patch`, at every depth; what it has stays.
fn merge(target: &mut Value, patch: Value) {
    if let (Value::Object(target), Value::Object(patch)) = (target, patch) {
        for (name, value) in patch {
            match target.get_mut(&name) {
                Some(existing) => merge(existing, value),
                None => drop(target.insert(name, value)),
            }
        }
    }
}

/// idem's problem responses under the `x-idem` policy: each status, with its problem types.
fn problems(policy: &Value) -> Vec<(u16, String)> {
    let ms = |name: &str| human(Duration::from_millis(policy[name].as_u64().unwrap_or(0)));
    let mut by_status: Vec<(u16, String)> = Vec::new();
    for kind in ProblemType::ALL {
        let what = match kind {
            ProblemType::MissingKey => match (policy["missing_key"].as_str(), policy["reject_after_ms"].as_i64()) {
                (Some("reject"), _) => "no `Idempotency-Key` was sent".into(),
                (Some("pass"), Some(at)) => format!("no `Idempotency-Key` was sent, from {} on", date(at)),
                _ => continue,
            },
            ProblemType::MalformedKey => "the key is malformed, or was sent twice".into(),
            ProblemType::UnreadableBody => "the request body could not be read".into(),
            ProblemType::BodyTooLarge => format!("the body is over {} bytes; no key was used", policy["max_request_body"]),
            ProblemType::KeyMismatch => "the key was used for a different request: never retry with it".into(),
            ProblemType::InFlight => format!("the first request with this key was still running after {}: retry with the same key after `Retry-After`", ms("wait_ms")),
            ProblemType::KeyExpired => format!("the key is older than {}: its result is no longer known", ms("ttl_ms")),
            ProblemType::StoreUnavailable => "the idempotency store could not be reached; nothing ran: retry with the same key after `Retry-After`".into(),
            ProblemType::Busy => "the idempotency store had no free connection; nothing ran: retry with the same key after `Retry-After`".into(),
        };
        let line = format!("`{}` ({}): {what}.", kind.uri(), kind.title());
        match by_status
            .iter_mut()
            .find(|(status, _)| *status == kind.status())
        {
            Some((_, text)) => *text = format!("{text}\n{line}"),
            None => by_status.push((kind.status(), format!("{IDEM}\n{line}"))),
        }
    }
    by_status
}

/// `d` in its largest whole unit: `24 h`, `7 d`, `90 s`, `250 ms`.
fn human(d: Duration) -> String {
    let ms = d.as_millis();
    let units = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("min", 60_000),
        ("s", 1000),
    ];
    let unit = units
        .into_iter()
        .find(|(_, size)| ms >= *size && ms % size == 0);
    unit.map_or(format!("{ms} ms"), |(unit, size)| {
        format!("{} {unit}", ms / size)
    })
}

fn date(ms: i64) -> String {
    httpdate::fmt_http_date(Timestamp::from_millis(ms).to_system_time())
}
