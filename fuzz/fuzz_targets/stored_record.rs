//! Decoding what a store holds, from arbitrary bytes: the header list every store keeps as JSON
//! (`StoredResponse::decode_headers`), and the Redis store's record fields and completion-message
//! tags. Never panics; what decodes re-encodes to the same value.
#![no_main]

use idem_runtime::store::redis::fuzzing;
use idem_runtime::{RecordKey, StoredResponse};
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
            // Ten fields, as HMGET returns them: separated by 0xff, a field of one 0xfe is nil.
            let fields: Vec<Option<Vec<u8>>> = rest
                .split(|&b| b == 0xff)
                .map(|f| (f != [0xfe]).then(|| f.to_vec()))
                .collect();
            let _ = fuzzing::decode_record(&fields);
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
