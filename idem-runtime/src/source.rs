//! Where a handler's key comes from: the `Idempotency-Key` header (the default), another header
//! (a webhook's `webhook-id`, `X-GitHub-Delivery`), or a field of the JSON body named by a JSON
//! Pointer (RFC 6901: `/id`, `/data/request_id`).
//!
//! Keys from different sources never meet: a key read from `webhook-id` is stored in a namespace
//! named after that header, a key read from the body in one named after its pointer, both apart
//! from the client's `Idempotency-Key` and from derived keys (see [`RecordKey::sourced`]).
//!
//! The names are checked where the policy is built: at compile time by `#[idempotent]`, with an
//! error on the literal, and by [`Policy::validate`](crate::Policy::validate) for a policy built
//! by hand (the layer's constructors return it as a [`PolicyError`](crate::policy::PolicyError)).
//!
//! [`RecordKey::sourced`]: crate::RecordKey::sourced

/// Where a handler reads its key.
///
/// ```
/// use idem_runtime::policy::Policy;
/// use idem_runtime::source::KeySource;
/// // Standard Webhooks deliveries carry their id in `webhook-id`.
/// const WEBHOOKS: Policy = Policy::new().key_header("webhook-id").checked();
/// assert_eq!(WEBHOOKS.key_source, KeySource::Header("webhook-id"));
/// // Google's AIP-155 puts it in the body.
/// const CREATE: Policy = Policy::new().key_field("/request_id").checked();
/// assert_eq!(CREATE.key_source, KeySource::BodyField("/request_id"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeySource {
    /// The `Idempotency-Key` header.
    #[default]
    IdempotencyKey,
    /// Another request header, by its lower-case name (`webhook-id`). Its value is read as an
    /// `Idempotency-Key` value is: 1 to 255 visible ASCII characters, bare or quoted, sent once.
    Header(&'static str),
    /// A member of the JSON body, by JSON Pointer (`/data/request_id`). The member is a string of
    /// 1 to 255 visible ASCII characters, or an integer; a body that is no JSON, or has no such
    /// member (or `null`), has no key. The member never counts in the request's fingerprint.
    BodyField(&'static str),
}

impl KeySource {
    /// How problems and the documentation name the source: `the Idempotency-Key header`, `the
    /// webhook-id header`, `the body field /id`.
    pub fn describe(&self) -> String {
        match self {
            Self::IdempotencyKey => "the Idempotency-Key header".into(),
            Self::Header(name) => format!("the {name} header"),
            Self::BodyField(pointer) => format!("the body field {pointer}"),
        }
    }

    /// The namespace of keys from this source, `None` for the `Idempotency-Key` header (whose keys
    /// are stored as they are). No two sources share one: a header name has no space, and a
    /// key read from anywhere has none either, so the last space of a stored key ends the source.
    pub(crate) fn namespace(&self) -> Option<String> {
        match self {
            Self::IdempotencyKey | Self::Header(crate::key::HEADER) => None,
            Self::Header(name) => Some(format!("header {name}")),
            Self::BodyField(pointer) => Some(format!("body {pointer}")),
        }
    }
}

/// Why a header name or a JSON Pointer was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NameError {
    /// Empty.
    Empty,
    /// A header name with a character outside RFC 9110's token characters, or upper case.
    HeaderCharacter,
    /// A pointer that does not start with `/`.
    PointerStart,
    /// A `~` not followed by `0` or `1` (RFC 6901's only escapes).
    PointerEscape,
}

/// Checks a header name: RFC 9110 token characters, lower case (as `http` stores names).
pub(crate) const fn check_header(name: &str) -> Result<(), NameError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() {
        return Err(NameError::Empty);
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let token = matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'!' | b'#' | b'$' | b'%' | b'&' | b'\''
            | b'*' | b'+' | b'-' | b'.' | b'^' | b'_' | b'`' | b'|' | b'~');
        if !token {
            return Err(NameError::HeaderCharacter);
        }
        i += 1;
    }
    Ok(())
}

/// Checks a JSON Pointer (RFC 6901) that names a member, not the whole document: it starts with
/// `/`, and every `~` is `~0` or `~1`.
pub(crate) const fn check_pointer(pointer: &str) -> Result<(), NameError> {
    let bytes = pointer.as_bytes();
    if bytes.is_empty() {
        return Err(NameError::Empty);
    }
    if bytes[0] != b'/' {
        return Err(NameError::PointerStart);
    }
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'~' && (i + 1 == bytes.len() || !matches!(bytes[i + 1], b'0' | b'1')) {
            return Err(NameError::PointerEscape);
        }
        i += 1;
    }
    Ok(())
}

/// The pointer's reference tokens, unescaped (`~1` is `/`, `~0` is `~`, in that order).
pub(crate) fn tokens(pointer: &str) -> impl Iterator<Item = String> + '_ {
    pointer
        .split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
}

/// Removes what `pointer` names from `value`, if it is there. A member leaves its object; an
/// array element is replaced by `null`, so that the elements after it keep their places.
pub(crate) fn remove(value: &mut serde_json::Value, pointer: &str) {
    let Some((parent, _)) = pointer.rsplit_once('/') else {
        return;
    };
    let Some(last) = tokens(pointer).last() else {
        return;
    };
    match value.pointer_mut(parent) {
        Some(serde_json::Value::Object(map)) => {
            map.remove(&last);
        }
        Some(serde_json::Value::Array(items)) => {
            if let Some(item) = last.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                *item = serde_json::Value::Null;
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn header_names_are_lower_case_tokens() {
        assert_eq!(check_header("webhook-id"), Ok(()));
        assert_eq!(check_header("x-github-delivery"), Ok(()));
        assert_eq!(check_header(""), Err(NameError::Empty));
        assert_eq!(check_header("Webhook-Id"), Err(NameError::HeaderCharacter));
        assert_eq!(check_header("webhook id"), Err(NameError::HeaderCharacter));
        assert_eq!(check_header("webhook:id"), Err(NameError::HeaderCharacter));
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        for ok in ["/id", "/data/request_id", "/a~1b", "/m~0n", "/", "/items/0"] {
            assert_eq!(check_pointer(ok), Ok(()), "{ok}");
        }
        assert_eq!(check_pointer(""), Err(NameError::Empty));
        assert_eq!(check_pointer("id"), Err(NameError::PointerStart));
        assert_eq!(check_pointer("/a~2"), Err(NameError::PointerEscape));
        assert_eq!(check_pointer("/a~"), Err(NameError::PointerEscape));
    }

    #[test]
    fn removal_takes_members_and_blanks_elements() {
        let mut v = json!({"a": {"b/c": 1, "d": 2}, "e": [1, 2, 3], "m~n": 4});
        remove(&mut v, "/a/b~1c");
        remove(&mut v, "/e/1");
        remove(&mut v, "/m~0n");
        remove(&mut v, "/nothing/here");
        assert_eq!(v, json!({"a": {"d": 2}, "e": [1, null, 3]}));
        let keyed = json!({"a": {"b/c": 1}});
        assert_eq!(keyed.pointer("/a/b~1c"), Some(&json!(1)));
    }
}
