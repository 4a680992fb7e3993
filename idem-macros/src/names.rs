//! The names the attribute takes for where the key is and what the fingerprint covers: an HTTP
//! header name (`key_header`) and JSON Pointers (RFC 6901: `key_field`, `fingerprint_exclude`,
//! `fingerprint_only`). Like `values.rs`, they only read text; `config.rs` puts the option's name
//! and the span on the message. The runtime checks the same rules (`source.rs`) for policies
//! built by hand.

use crate::values::Bad;

/// RFC 9110 token characters, as header names are written.
fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A header name, lower-cased (names are case-insensitive; the runtime looks them up lower-case).
pub(crate) fn parse_header(text: &str) -> Result<String, Bad> {
    let trimmed = text.trim().trim_end_matches(':');
    if trimmed.is_empty() {
        return Err(Bad::Note("a header name cannot be empty".into()));
    }
    if let Some(bad) = text.chars().find(|c| !c.is_ascii() || !is_token(*c as u8)) {
        if trimmed.bytes().all(is_token) {
            return Err(Bad::DidYouMean(trimmed.to_ascii_lowercase()));
        }
        let what = match bad {
            ' ' => "a space".to_string(),
            c => format!("`{c}`"),
        };
        return Err(Bad::Note(format!(
            "{what} cannot appear in a header name (letters, digits and !#$%&'*+-.^_`|~)"
        )));
    }
    Ok(text.to_ascii_lowercase())
}

/// A JSON Pointer to a member (not the whole document). Near misses get the pointer they
/// probably meant: `"id"` → `"/id"`, `"data.request_id"` and `"$.data.request_id"` →
/// `"/data/request_id"`.
pub(crate) fn parse_pointer(text: &str) -> Result<(), Bad> {
    if text.is_empty() {
        return Err(Bad::Note(
            "the empty pointer names the whole body, not a member; name a member, like \"/id\""
                .into(),
        ));
    }
    if !text.starts_with('/') {
        let path = text.trim_start_matches('$').trim_start_matches('.');
        let suggestion: String = path
            .split('.')
            .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
            .collect();
        return match path.is_empty() {
            true => Err(Bad::Unrecognized),
            false => Err(Bad::DidYouMean(suggestion)),
        };
    }
    let bytes = text.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b == b'~' && !matches!(bytes.get(i + 1), Some(b'0' | b'1')) {
            return Err(Bad::Note(
                "`~` must be escaped as `~0` (and `/` inside a member's name as `~1`)".into(),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_names_are_tokens_and_lower_cased() {
        assert_eq!(parse_header("webhook-id"), Ok("webhook-id".into()));
        assert_eq!(
            parse_header("X-GitHub-Delivery"),
            Ok("x-github-delivery".into())
        );
        assert_eq!(
            parse_header("webhook-id:"),
            Err(Bad::DidYouMean("webhook-id".into()))
        );
        assert!(
            matches!(parse_header("webhook id"), Err(Bad::Note(n)) if n.starts_with("a space"))
        );
        assert!(matches!(parse_header("web/hook"), Err(Bad::Note(n)) if n.starts_with("`/`")));
        assert!(matches!(parse_header(""), Err(Bad::Note(_))));
    }

    #[test]
    fn pointers_follow_rfc_6901_and_near_misses_are_translated() {
        assert_eq!(parse_pointer("/id"), Ok(()));
        assert_eq!(parse_pointer("/a~1b/m~0n/0"), Ok(()));
        assert_eq!(parse_pointer("id"), Err(Bad::DidYouMean("/id".into())));
        assert_eq!(
            parse_pointer("$.data.request_id"),
            Err(Bad::DidYouMean("/data/request_id".into()))
        );
        assert!(matches!(parse_pointer("/a~b"), Err(Bad::Note(n)) if n.contains("~0")));
        assert!(matches!(parse_pointer(""), Err(Bad::Note(n)) if n.contains("whole body")));
    }
}
