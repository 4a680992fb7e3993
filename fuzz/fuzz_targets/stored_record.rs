//! Decoding what a store holds, from arbitrary bytes: the header list the SQL stores keep as JSON
//! (`StoredResponse::decode_headers`), and the Redis store's record values and completion-message
//! tags. Never panics; what decodes re-encodes to a value that decodes the same.
#![no_main]

use idem_runtime::store::redis::fuzzing;
use idem_runtime::{RecordKey, StoreErrorKind, StoredResponse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    match selector % 3 {
        0 => {
            let Ok(text) = std::str::from_utf8(rest) else {
                return;
            };
            if let Ok(headers) = StoredResponse::decode_headers(text) {
                let response = StoredResponse {
                    status: 200,
                    headers: headers.clone(),
                    body: Default::default(),
                };
                assert_eq!(
                    StoredResponse::decode_headers(&response.encode_headers()).ok(),
                    Some(headers)
                );
            }
        }
        1 => {
            // A record value, as `GET` returns it: anything decodes to a record or fails as
            // corrupt, and a record survives its own encoding.
            match fuzzing::decode_record(rest) {
                Ok(record) => {
                    let value = fuzzing::encode_record(&record).expect("a decoded record encodes");
                    assert_eq!(fuzzing::decode_record(&value).ok(), Some(record));
                }
                Err(e) => assert_eq!(e.kind(), StoreErrorKind::Corrupt),
            }
        }
        _ => {
            if let Some(key) = fuzzing::decode_tag(rest) {
                assert_eq!(
                    fuzzing::decode_tag(fuzzing::encode_tag(&key).as_bytes()),
                    Some(key)
                );
            }
            let text = String::from_utf8_lossy(rest);
            let (scope, key) = text.split_once('\n').unwrap_or((&text, ""));
            let key = RecordKey::new(scope, key);
            assert_eq!(
                fuzzing::decode_tag(fuzzing::encode_tag(&key).as_bytes()),
                Some(key)
            );
        }
    }
});
