// The expansion names everything by absolute path, so local items that shadow prelude and
// common names do not change its meaning.
#![deny(warnings)]
#![allow(non_camel_case_types, dead_code)]
use crate::support;

use ::idem_runtime::idempotent;
use support::AuthUser;

type Result = ();
type Option = ();
struct Some;
struct None;
struct Ok;
struct Err;
struct Box;
struct String;
struct Vec;
struct Cow;
struct Duration;
struct Policy;
struct Response;
struct EngineState;
struct WithBody;
trait Future {}
trait IntoResponse {}
mod __private {}
mod idem_runtime {}
const __IDEM_POLICY: u8 = 0;

#[idempotent(scope = "user", ttl = "1h", missing_key = "derive", replay = "minimal")]
async fn create(user: AuthUser, body: std::string::String) -> std::string::String {
    let __idem_scope = 1;
    let __idem_request = 2;
    let __idem_ret = 3;
    let __idem_engine = 4;
    format!(
        "{} {body} {}",
        user.id,
        __idem_scope + __idem_request + __idem_ret + __idem_engine
    )
}

#[test]
fn routes() {
    let _ = support::route(create);
}
