// Doc comments, other attributes and the visibility survive; a raw identifier as handler name;
// a handler in a module used from outside it; an associated function (without `self`).
#![deny(warnings)]
use crate::support;

mod handlers {
    use super::support::AuthUser;
    use idem_runtime::idempotent;

    /// Creates a payment.
    #[idempotent(scope = "user")]
    #[allow(clippy::needless_pass_by_value)]
    #[inline]
    pub(crate) async fn r#match(user: AuthUser, body: String) -> String {
        format!("{} {body}", user.id)
    }

    #[idempotent(scope = "r#type")]
    pub async fn typed(r#type: AuthUser) -> String {
        r#type.id
    }

    pub struct Payments;

    impl Payments {
        /// An associated handler returning `impl Trait`.
        #[idempotent(scope = "user")]
        pub async fn refund(user: AuthUser) -> impl axum::response::IntoResponse {
            user.id
        }
    }
}

#[test]
fn routes() {
    let _ = support::route(handlers::r#match);
    let _ = support::route(handlers::typed);
    let _ = support::route(handlers::Payments::refund);
}
