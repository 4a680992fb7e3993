//! What a handler's fingerprint covers: the whole request (the default), or a JSON body without
//! the members a retry may change (a `sent_at`, a `trace_id`, a rotated credential), or only the
//! members that make the request what it is.
//!
//! Members are named by JSON Pointer (RFC 6901), nested ones included (`/meta/trace_id`); an
//! array element is blanked, not removed, so the elements after it keep their places. The
//! method and the path always count, and a body that is not JSON is compared whole.
//!
//! A retry that differs only in an excluded member is the same request: it gets the stored
//! response, as it was, including whatever the first request's excluded members made of it (the
//! `sent_at` it echoed, say). The retry's own values are not seen by anything.

/// What a handler's fingerprint covers.
///
/// ```
/// use idem_runtime::fingerprint::Coverage;
/// use idem_runtime::Policy;
/// const WEBHOOK: Policy = Policy::new()
///     .fingerprint_exclude(&["/sent_at", "/meta/trace_id"])
///     .checked();
/// assert_eq!(WEBHOOK.fingerprint, Coverage::Exclude(&["/sent_at", "/meta/trace_id"]));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Coverage {
    /// The method, the path with its query and the whole body.
    #[default]
    Whole,
    /// The method, the path and the JSON body without these members.
    Exclude(&'static [&'static str]),
    /// The method, the path and only these members of the JSON body (each member's value, or
    /// its absence).
    Only(&'static [&'static str]),
}

impl Coverage {
    /// The pointers it names (none for [`Whole`](Self::Whole)).
    pub const fn pointers(&self) -> &'static [&'static str] {
        match self {
            Self::Whole => &[],
            Self::Exclude(pointers) | Self::Only(pointers) => pointers,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::fingerprint::{Coverage, Fingerprint};
    use crate::source::KeySource;
    use proptest::prelude::*;
    use serde_json::{json, Map, Value};

    const JSON: Option<&str> = Some("application/json");

    fn of(body: &Value, coverage: &Coverage, key: &KeySource) -> Fingerprint {
        let bytes = serde_json::to_vec(body).unwrap_or_default();
        Fingerprint::of_request_covering("POST", "/hooks", JSON, &bytes, coverage, key)
    }

    #[test]
    fn the_whole_request_is_the_fingerprint_of_before() {
        let body = br#"{"b":1,"a":[1,2]}"#;
        let whole = Fingerprint::of_request_covering(
            "POST",
            "/p",
            JSON,
            body,
            &Coverage::Whole,
            &KeySource::IdempotencyKey,
        );
        assert_eq!(whole, Fingerprint::of_request("POST", "/p", JSON, body));
    }

    #[test]
    fn only_the_named_members_count() {
        let only = Coverage::Only(&["/amount", "/data/payment_id"]);
        let key = KeySource::IdempotencyKey;
        let a = of(
            &json!({"amount": 5, "data": {"payment_id": "p1", "x": 1}, "y": 2}),
            &only,
            &key,
        );
        let b = of(
            &json!({"amount": 5, "data": {"payment_id": "p1", "x": 9}}),
            &only,
            &key,
        );
        assert_eq!(a, b);
        assert_ne!(
            a,
            of(
                &json!({"amount": 6, "data": {"payment_id": "p1"}}),
                &only,
                &key
            )
        );
        // A member sent as null is not a member left out.
        assert_ne!(
            of(
                &json!({"amount": null, "data": {"payment_id": "p1"}}),
                &only,
                &key
            ),
            of(&json!({"data": {"payment_id": "p1"}}), &only, &key)
        );
    }

    #[test]
    fn the_key_field_is_never_part_of_its_own_fingerprint() {
        let key = KeySource::BodyField("/id");
        for coverage in [Coverage::Whole, Coverage::Exclude(&["/sent_at"])] {
            assert_eq!(
                of(&json!({"id": "a", "n": 1}), &coverage, &key),
                of(&json!({"id": "b", "n": 1}), &coverage, &key)
            );
        }
    }

    /// A member of a document: its pointer and the document with it set to `value`.
    fn set(doc: &mut Value, path: &[String], value: Value) {
        let mut at = doc;
        for (i, name) in path.iter().enumerate() {
            let Value::Object(map) = at else { return };
            if i + 1 == path.len() {
                map.insert(name.clone(), value);
                return;
            }
            at = map
                .entry(name.clone())
                .or_insert_with(|| Value::Object(Map::new()));
        }
    }

    fn pointer(path: &[String]) -> String {
        path.iter()
            .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
            .collect()
    }

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(Value::from),
            "[a-z~/ ]{0,6}".prop_map(Value::String),
        ]
    }

    proptest! {
        /// Excluded members, nested or not, never change the fingerprint; a change to any other
        /// member always does.
        #[test]
        fn excluded_members_do_not_count_and_every_other_member_does(
            names in proptest::collection::vec(proptest::collection::vec("[a-c~/]{1,3}", 1..4), 2..6),
            values in proptest::collection::vec((leaf(), leaf()), 6),
            excluded_count in 1usize..3,
        ) {
            let mut names = names;
            names.sort();
            names.dedup();
            // No member may sit inside another, or setting one would replace the other.
            let prefix = |a: &Vec<String>, b: &Vec<String>| a != b && b.starts_with(a);
            let names: Vec<Vec<String>> = names.iter()
                .filter(|n| !names.iter().any(|m| prefix(n, m) || prefix(m, n)))
                .cloned().collect();
            prop_assume!(names.len() >= 2);
            let excluded_count = excluded_count.min(names.len() - 1);
            let pointers: Vec<&'static str> = names[..excluded_count].iter()
                .map(|n| &*Box::leak(pointer(n).into_boxed_str())).collect();
            let coverage = Coverage::Exclude(Box::leak(pointers.into_boxed_slice()));
            let key = KeySource::IdempotencyKey;
            let mut base = Value::Object(Map::new());
            for (name, (first, _)) in names.iter().zip(&values) {
                set(&mut base, name, first.clone());
            }
            let fingerprint = of(&base, &coverage, &key);
            for (i, (name, (first, second))) in names.iter().zip(&values).enumerate() {
                let mut changed = base.clone();
                set(&mut changed, name, second.clone());
                if i < excluded_count {
                    prop_assert_eq!(of(&changed, &coverage, &key), fingerprint);
                    let mut gone = base.clone();
                    crate::source::remove(&mut gone, &pointer(name));
                    prop_assert_eq!(of(&gone, &coverage, &key), fingerprint);
                } else if first != second {
                    prop_assert_ne!(of(&changed, &coverage, &key), fingerprint, "{}", pointer(name));
                }
            }
        }
    }
}
