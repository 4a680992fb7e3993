//! The one parse of `Json<T>` (`idem-runtime/src/fingerprint/tee.rs`) on arbitrary bodies, as an
//! untyped `Value` and as a typed struct with enums, optional fields and a field that swallows its
//! errors: it never panics, never yields a value serde_json would not (`serde_json::from_slice` is
//! the reference for `T`), and its fingerprint is always `Fingerprint::of_request`'s for the same
//! bytes.
#![no_main]

use idem_runtime::fingerprint::fuzzing::of_json_request;
use idem_runtime::Fingerprint;
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Debug;

#[derive(Debug, PartialEq, Deserialize)]
struct Payment {
    amount: Option<i64>,
    currency: Option<Currency>,
    items: Option<Vec<Item>>,
    meta: Option<BTreeMap<String, Value>>,
    ratio: Option<f32>,
    /// Keeps what deserializes and swallows the error otherwise: serde_json then goes on past a
    /// value the one parse must not have half-written.
    #[serde(default, deserialize_with = "lenient")]
    loose: Option<Vec<Item>>,
}

fn lenient<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    de: D,
) -> Result<Option<T>, D::Error> {
    Ok(T::deserialize(de).ok())
}

#[derive(Debug, PartialEq, Deserialize)]
enum Currency {
    #[serde(rename = "KRW")]
    Won,
    #[serde(rename = "USD", alias = "usd")]
    Dollar,
    Other(String),
    Pair(u8, u8),
    Named { code: String },
}

#[derive(Debug, PartialEq, Deserialize)]
#[serde(untagged)]
enum Item {
    Sku(String),
    Line { sku: String, quantity: u32 },
}

fn check<T: DeserializeOwned + PartialEq + Debug>(content_type: &str, body: &[u8]) {
    let expected = serde_json::from_slice::<T>(body).ok();
    let Some((value, fingerprint)) = of_json_request::<T>("POST", "/p", Some(content_type), body)
    else {
        return; // refused: the extractor parses it itself
    };
    assert_eq!(Some(&value), expected.as_ref(), "a value serde_json does not give");
    assert_eq!(
        fingerprint,
        Fingerprint::of_request("POST", "/p", Some(content_type), body),
        "a fingerprint of_request does not give"
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let content_type = if selector & 1 == 0 { "application/json" } else { "text/plain" };
    check::<Value>(content_type, body);
    check::<Payment>(content_type, body);
    check::<Vec<Currency>>(content_type, body);
});
