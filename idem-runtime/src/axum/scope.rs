//! Who is asking: the caller identity that keys are scoped to.

use std::borrow::Cow;

/// A handler parameter that identifies the caller (a user, a tenant, an API client). Keys are unique
/// per scope: one caller's key never returns another caller's response.
///
/// ```
/// use idem_runtime::axum::Scope;
/// use std::borrow::Cow;
/// struct AuthUser { id: String }
/// impl Scope for AuthUser {
///     fn scope_id(&self) -> Cow<'_, str> { Cow::Borrowed(&self.id) }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an idempotency scope",
    label = "the `scope` parameter's type must implement `idem_runtime::axum::Scope`",
    note = "implement `idem_runtime::axum::Scope for {Self}` returning the caller's id (user or tenant), or use `scope = \"global\"` to opt out of scoping"
)]
pub trait Scope {
    /// The caller's stable identifier.
    fn scope_id(&self) -> Cow<'_, str>;
}
