//! `RecordKey` construction over arbitrary scopes and keys, in both namespaces: every stored part
//! fits the stores' limits; two different (scope, key, namespace) inputs never make one stored key;
//! a key a client can send never names a derived key; and the Redis store's tag of a stored key
//! decodes back to it.
#![no_main]

use idem_runtime::store::redis::fuzzing::{decode_tag, encode_tag};
use idem_runtime::{IdempotencyKey, RecordKey};
use libfuzzer_sys::fuzz_target;

/// Four strings from the input, split at 0xff bytes (which UTF-8 never uses).
fn parts(data: &[u8]) -> [String; 4] {
    let mut it = data.split(|&b| b == 0xff).map(|p| String::from_utf8_lossy(p).into_owned());
    std::array::from_fn(|_| it.next().unwrap_or_default())
}

fn stored(scope: &str, key: &str, derived: bool) -> RecordKey {
    if derived {
        RecordKey::derived(scope, key)
    } else {
        RecordKey::new(scope, key)
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let [s1, k1, s2, k2] = parts(rest);
    let (d1, d2) = (flags & 1 == 1, flags & 2 == 2);
    let (a, b) = (stored(&s1, &k1, d1), stored(&s2, &k2, d2));
    for key in [&a, &b] {
        assert!(key.scope().len() <= RecordKey::MAX_PART + 1, "{key:?}");
        assert!(key.key().len() <= RecordKey::MAX_PART + 1, "{key:?}");
        assert_eq!(decode_tag(encode_tag(key).as_bytes()).as_ref(), Some(key));
    }
    if (s1.as_str(), k1.as_str(), d1) != (s2.as_str(), k2.as_str(), d2) {
        assert_ne!(a, b, "{s1:?}/{k1:?}/{d1} and {s2:?}/{k2:?}/{d2}");
    }
    // A client's key, however spelled, is never a derived key of the same scope.
    if let Ok(client) = IdempotencyKey::parse(k1.as_bytes()) {
        assert_ne!(RecordKey::new(&s1, client.as_str()), RecordKey::derived(&s1, &k2));
    }
});
