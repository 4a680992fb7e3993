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
use crate::policy::{Coverage, KeySource, MissingKey, Policy};
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
                describe_body_key(operation);
                let params = operation.parameters.iter().flatten();
                let from_params = params
                    .filter_map(|p| p.extensions.as_ref()?.get(EXTENSION))
                    .next();
                let own = operation.extensions.as_ref().and_then(|e| e.get(EXTENSION));
                let Some(policy) = from_params.or(own).cloned() else {
                    continue;
                };
                let policy = &policy;
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

/// The key parameter of an operation under `policy`, for documents built by hand (the attribute
/// adds it to `#[utoipa::path]` operations itself): the `Idempotency-Key` header, or the header the
/// policy reads its key from (`webhook-id`). For a key read from a JSON body field there is no
/// parameter to document: the parameter is then a stand-in, named [`BODY_KEY_PARAMETER`], that
/// [`Idempotency`] replaces with a paragraph of the operation's description and an `x-idem`
/// extension on the operation. Either way the policy's `x-idem` extension names the key's source
/// (`key_source`) and what the fingerprint leaves out (`fingerprint`).
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
    let (source, name) = match policy.key_source {
        KeySource::Header(name) => (json!({"header": name}), name),
        KeySource::BodyField(pointer) => (json!({"body": pointer}), BODY_KEY_PARAMETER),
        _ => (json!({"header": crate::key::HEADER}), "Idempotency-Key"),
    };
    let (covered, exclusions) = match policy.fingerprint {
        Coverage::Exclude(pointers) => (json!({"exclude": pointers}), format!(" The request is the same request whatever its body's {} say (its stored response is replayed as it was).", list(pointers))),
        Coverage::Only(pointers) => (json!({"only": pointers}), format!(" Only the method, the path and the body's {} decide whether a retry is the same request.", list(pointers))),
        _ => (json!("whole"), String::new()),
    };
    let extension = json!({
        "ttl_ms": policy.ttl.as_millis() as u64, "retain_ms": policy.retain.as_millis() as u64,
        "wait_ms": policy.wait.as_millis() as u64, "derive_window_ms": policy.derive_window.as_millis() as u64,
        "missing_key": format!("{:?}", policy.missing_key).to_lowercase(), "reject_after_ms": policy.reject_after_ms,
        "server_errors": format!("{:?}", policy.server_errors).to_lowercase(),
        "client_errors": format!("{:?}", policy.client_errors).to_lowercase(), "max_request_body": policy.max_request_body,
        "key_source": source, "fingerprint": covered,
    });
    let expiry = format!("Expiry: a response is replayed for {ttl} after the first request; after that, and until {retain} after it, the key answers 410 and is not run again.");
    let description = match policy.key_source {
        KeySource::BodyField(pointer) => format!("The idempotency key is the JSON body's `{pointer}` member (a string of 1 to 255 visible ASCII characters, or an integer), sent again unchanged when the request is retried: a retry gets the first request's stored response instead of running again. It is not part of the request's fingerprint. {without}{exclusions} {expiry}"),
        KeySource::Header(_) => format!("The idempotency key of this operation (in place of `Idempotency-Key`), sent again unchanged when the request is retried: a retry gets the first request's stored response instead of running again. 1 to 255 visible ASCII characters, bare or as a quoted string. {without}{exclusions} {expiry}"),
        _ => format!("A unique key for this request (a UUID, say), sent again unchanged when the request is retried: a retry gets the first request's stored response instead of running again. 1 to 255 visible ASCII characters, bare or as a quoted string (quote a key that contains a comma). {without}{exclusions} {expiry}"),
    };
    let schema = json!({"type": "string", "minLength": 1, "maxLength": KEY_MAX_LENGTH, "pattern": KEY_PATTERN});
    let parameter = json!({"name": name, "in": "header", "required": required && name != BODY_KEY_PARAMETER,
        "description": description, "schema": schema, "example": "8e03978e-40d5-43e8-bc93-6894a57f9324", EXTENSION: extension});
    serde_json::from_value(parameter).expect("the parameter is well-formed")
}

/// The stand-in parameter of an operation whose key is a JSON body field, which [`Idempotency`]
/// turns into the operation's description and extension.
pub const BODY_KEY_PARAMETER: &str = "x-idem-body-key";

/// `` `/a`, `/b` and `/c` members ``.
fn list(pointers: &[&str]) -> String {
    let quoted: Vec<String> = pointers.iter().map(|p| format!("`{p}`")).collect();
    let members = match quoted.len() {
        1 => "member",
        _ => "members",
    };
    match quoted.split_last() {
        Some((last, [])) => format!("{last} {members}"),
        Some((last, rest)) => format!("{} and {last} {members}", rest.join(", ")),
        None => String::new(),
    }
}

/// An operation whose key is a body field: its stand-in parameter becomes a paragraph of the
/// description and the operation's `x-idem` extension.
fn describe_body_key(operation: &mut utoipa::openapi::path::Operation) {
    let Some(params) = operation.parameters.as_mut() else {
        return;
    };
    let Some(at) = params.iter().position(|p| p.name == BODY_KEY_PARAMETER) else {
        return;
    };
    let param = params.remove(at);
    if params.is_empty() {
        operation.parameters = None;
    }
    if let Some(text) = param.description {
        let description = operation.description.get_or_insert_with(String::new);
        if !description.contains(&text) {
            *description = [description.as_str(), &text].join(if description.is_empty() {
                ""
            } else {
                "\n\n"
            });
        }
    }
    if let Some(policy) = param
        .extensions
        .as_ref()
        .and_then(|e| e.get(EXTENSION))
        .cloned()
    {
        let extensions = operation.extensions.get_or_insert_with(Default::default);
        extensions.insert(EXTENSION.into(), policy);
    }
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
        let stored = match status.as_bytes().first() {
            Some(b'5') => policy["server_errors"] == "store",
            Some(b'4') => policy["client_errors"] != "release",
            _ => true,
        };
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
                (Some("reject"), _) => format!("no {} was sent", source(policy)),
                (Some("pass"), Some(at)) => format!("no {} was sent, from {} on", source(policy), date(at)),
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

/// How problems name the key's source under the `x-idem` policy.
fn source(policy: &Value) -> String {
    match (
        &policy["key_source"]["header"],
        &policy["key_source"]["body"],
    ) {
        (Value::String(name), _) if name != crate::key::HEADER => format!("`{name}` header"),
        (_, Value::String(pointer)) => format!("`{pointer}` body field"),
        _ => "`Idempotency-Key`".into(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    use utoipa::openapi::{OpenApiBuilder, PathsBuilder};
    use utoipa::Modify;

    fn documented(policy: &Policy) -> utoipa::openapi::path::Operation {
        let operation = OperationBuilder::new()
            .description(Some("Receives."))
            .parameter(key_parameter(policy))
            .build();
        let paths = PathsBuilder::new().path("/hooks", PathItem::new(HttpMethod::Post, operation));
        let mut api = OpenApiBuilder::new().paths(paths).build();
        Idempotency.modify(&mut api);
        let item = api.paths.paths.remove("/hooks").expect("the path");
        item.post.expect("the operation")
    }

    #[test]
    fn the_key_source_and_the_exclusions_are_documented() {
        let policy = Policy::new()
            .key_header("webhook-id")
            .fingerprint_exclude(&["/sent_at", "/meta/trace_id"]);
        let op = documented(&policy);
        let param = &op.parameters.as_ref().expect("parameters")[0];
        assert_eq!(param.name, "webhook-id");
        let text = param.description.as_deref().unwrap_or_default();
        assert!(
            text.contains("`/sent_at` and `/meta/trace_id` members"),
            "{text}"
        );
        let x = &param.extensions.as_ref().expect("x-idem")[EXTENSION];
        assert_eq!(x["key_source"], json!({"header": "webhook-id"}));
        assert_eq!(
            x["fingerprint"],
            json!({"exclude": ["/sent_at", "/meta/trace_id"]})
        );
        assert!(op.responses.responses.contains_key("400"));

        let op = documented(&Policy::new().key_field("/data/request_id"));
        assert!(op.parameters.is_none(), "the stand-in is gone");
        let text = op.description.as_deref().unwrap_or_default();
        assert!(
            text.starts_with(
                "Receives.\n\nThe idempotency key is the JSON body's `/data/request_id` member"
            ),
            "{text}"
        );
        let x = &op.extensions.as_ref().expect("x-idem")[EXTENSION];
        assert_eq!(x["key_source"], json!({"body": "/data/request_id"}));
        assert!(op.responses.responses.contains_key("422"));
    }
}
