// axum handlers take at most 16 extractors.
use axum::http::{HeaderMap, Method, Uri};
use idem_runtime::idempotent;

#[idempotent(scope = "global")]
#[allow(clippy::too_many_arguments)]
async fn create(
    _a: Method, _b: Uri, _c: HeaderMap, _d: Method, _e: Uri, _f: HeaderMap, _g: Method, _h: Uri,
    _i: HeaderMap, _j: Method, _k: Uri, _l: HeaderMap, _m: Method, _n: Uri, _o: HeaderMap,
    _p: Method, body: String,
) -> String {
    body
}

fn main() {}
