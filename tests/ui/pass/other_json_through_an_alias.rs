// Another crate's type named `Json`, named through an alias, is extracted as any other last
// parameter (its own extractor, after idem has buffered and fingerprinted the body).
#![deny(warnings)]
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

mod other {
    use axum::extract::{FromRequest, Request};

    pub struct Json<T>(pub T);

    impl<S: Send + Sync, T: From<String>> FromRequest<S> for Json<T> {
        type Rejection = ();

        async fn from_request(req: Request, state: &S) -> Result<Self, ()> {
            let text = String::from_request(req, state).await.map_err(|_| ())?;
            Ok(Json(T::from(text)))
        }
    }
}

type Text<T> = other::Json<T>;

#[idempotent(scope = "global")]
async fn create(other::Json(body): Text<String>) -> String {
    body
}

fn main() {
    let _ = support::route(create);
}
