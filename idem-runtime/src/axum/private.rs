//! Items the `#[idempotent]` expansion names. Not a public API: no stability guarantees.
//!
//! The expansion of
//!
//! ```ignore
//! #[idempotent(scope = "user", ttl = "24h")]
//! async fn create(State(app): State<App>, user: AuthUser, Json(req): Json<New>) -> impl IntoResponse { BODY }
//! ```
//!
//! is, in essence (`IDEM_DEBUG_EXPAND=1` prints the real expansion; see `idem-macros/src/expand.rs`;
//! a last parameter of another type is wrapped in [`WithBody`] instead of [`WithJson`]):
//!
//! ```ignore
//! async fn create(
//!     __idem_engine: ::idem_runtime::__private::EngineState,
//!     State(app): State<App>,
//!     user: AuthUser,
//!     ::idem_runtime::__private::WithJson(Json(req), __idem_request): ::idem_runtime::__private::WithJson<Json<New>, 1048576>,
//! ) -> ::idem_runtime::__private::Response {
//!     const __IDEM_POLICY: ::idem_runtime::__private::Policy = ::idem_runtime::__private::Policy::new()
//!         .ttl(::idem_runtime::__private::Duration::from_secs(86400))
//!         .handler("create")
//!         .checked();
//!     // A last parameter written `Json<..>` must be axum's (reported at its type otherwise).
//!     ::idem_runtime::__private::json_body::<Json<New>>();
//!     // Copied out: the body below is an `async move` block that may use `user` itself.
//!     let __idem_scope = ::std::borrow::Cow::Owned(::idem_runtime::__private::scope_id(&user).into_owned());
//!     ::idem_runtime::__private::run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, async move { BODY }).await
//! }
//! ```

pub use crate::engine::Engine;
pub use crate::policy::{MissingKey, Policy, ReplayMode, ServerErrors};
pub use ::axum::response::Response;
pub use core::time::Duration;

use ::axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
use ::axum::http::request::Parts;
use ::axum::response::IntoResponse;
use std::borrow::Cow;
use std::future::Future;

/// The scope string of handlers declared `scope = "global"`.
pub const GLOBAL_SCOPE: &str = "global";

/// Extracts the [`Engine`] from the router state (`Engine: FromRef<S>`), so that a router whose
/// state holds no engine fails to compile.
#[derive(Debug, Clone)]
pub struct EngineState(pub Engine);

impl<S> FromRequestParts<S> for EngineState
where
    Engine: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(Engine::from_ref(state)))
    }
}

/// What the engine needs from the request, taken while extracting the last parameter: the
/// request's fingerprint and its `Idempotency-Key` header. Small on purpose: it is moved through
/// every layer of the request's future.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// Method, path and query as the client sent them, content type and body.
    pub fingerprint: crate::Fingerprint,
    /// The `Idempotency-Key` header.
    pub key: KeyHeader,
    /// GET, HEAD, OPTIONS or TRACE: safe by definition, passed through untouched.
    pub safe_method: bool,
    /// The handler's [`Attempt`](super::Attempt) extractor, if it has one, to fill in on claiming.
    pub attempt: Option<super::Attempt>,
}

/// The request's `Idempotency-Key` header, read while extracting.
///
/// The key is parsed there, into the owned copy the record key needs anyway, so that nothing refers
/// to the request head (whose header values share the connection's read buffer) after extraction.
#[derive(Debug, Clone)]
pub enum KeyHeader {
    /// None.
    Missing,
    /// Exactly one, well-formed.
    Valid(crate::IdempotencyKey),
    /// Malformed, or sent more than once: the request is refused.
    Invalid(crate::KeyError),
}

/// Wraps the handler's last parameter: buffers the body (up to `LIMIT` bytes, else 413), records what
/// the fingerprint needs, and hands the same bytes to the wrapped extractor `T`.
#[derive(Debug)]
pub struct WithBody<T, const LIMIT: usize>(pub T, pub RequestContext);

/// The marker for [`WithBody`] around an extractor that reads only the request head.
#[doc(hidden)]
#[derive(Debug)]
pub enum ViaPartsExtractor {}

impl<S, T, const LIMIT: usize> FromRequest<S> for WithBody<T, LIMIT>
where
    T: FromRequest<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    // Not an `async fn`, here and below: that would keep the request twice in the future (as the
    // argument and as a local), and this future is part of the one axum boxes each request in.
    #[allow(clippy::manual_async_fn)]
    fn from_request(
        req: Request,
        state: &S,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        let (parts, body) = req.into_parts();
        async move {
            let bytes = super::request::read_body(body, LIMIT).await?;
            let (inner, ctx) = super::request::extract_from(parts, bytes, state).await?;
            Ok(Self(inner, ctx))
        }
    }
}

impl<S, T, const LIMIT: usize> FromRequest<S, ViaPartsExtractor> for WithBody<T, LIMIT>
where
    T: FromRequestParts<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    #[allow(clippy::manual_async_fn)]
    fn from_request(
        req: Request,
        state: &S,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        let (mut parts, body) = req.into_parts();
        async move {
            let bytes = super::request::read_body(body, LIMIT).await?;
            let inner = T::from_request_parts(&mut parts, state)
                .await
                .map_err(IntoResponse::into_response)?;
            Ok(Self(inner, super::request::context(&parts, &bytes)))
        }
    }
}

/// Wraps a last parameter written `Json<T>`: what [`WithBody`] does, but `T` is deserialized in
/// the parse that fingerprints the body instead of in a second one. A body of a JSON media type is
/// read under the router's `DefaultBodyLimit` as well as `LIMIT`, as axum's `Json` would read it;
/// any other is read as `WithBody` reads it, for `J` to refuse. Whenever that
/// parse cannot stand in for axum's exactly (a media type `Json` refuses, a body `T` does not
/// deserialize from, a form of value the one parse does not reproduce), `J` extracts itself from
/// the same bytes, so every rejection is axum's own.
#[derive(Debug)]
pub struct WithJson<J, const LIMIT: usize>(pub J, pub RequestContext);

/// Fails to compile when the last parameter written `Json<..>` is not axum's `Json`; the expansion
/// calls it at the parameter's type, where the error is then reported.
pub const fn json_body<J: JsonBody>() {}

/// axum's `Json<T>`, which [`WithJson`] builds from the `T` it deserialized.
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` reads a last parameter of a type named `Json<..>` as axum's `Json`, and `{Self}` is not axum's `Json`",
    label = "not `axum::Json`",
    note = "idem deserializes axum's `Json<T>` in the same parse that fingerprints the body; to extract another type named `Json`, name it through an alias, e.g. `type Body<T> = my_crate::Json<T>;`"
)]
pub trait JsonBody: Sized {
    /// The deserialized type.
    type Value: ::serde::de::DeserializeOwned;

    /// The extractor around `value`.
    fn from_value(value: Self::Value) -> Self;
}

impl<T: ::serde::de::DeserializeOwned> JsonBody for ::axum::Json<T> {
    type Value = T;

    fn from_value(value: T) -> Self {
        ::axum::Json(value)
    }
}

impl<S, J, const LIMIT: usize> FromRequest<S> for WithJson<J, LIMIT>
where
    J: JsonBody + FromRequest<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    #[allow(clippy::manual_async_fn)]
    fn from_request(
        req: Request,
        state: &S,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        use ::axum::RequestExt;
        // A media type `Json` refuses is read as `WithBody` reads it, so that `Json` answers it
        // (415) before any limit of its own applies, as it would alone.
        let json = super::request::json_media_type(req.headers());
        let req = if json { req.with_limited_body() } else { req };
        let (parts, body) = req.into_parts();
        async move {
            let bytes = super::request::read_body(body, LIMIT).await?;
            if json {
                if let Some((value, ctx)) = super::request::json_context::<J::Value>(&parts, &bytes)
                {
                    return Ok(Self(J::from_value(value), ctx));
                }
            }
            // Boxed: `J`'s own extraction runs only when the one parse stands aside (another media
            // type, a body `J` refuses, a form of value it does not reproduce), and its future
            // inline would triple the size of every request's.
            let (inner, ctx) = Box::pin(super::request::extract_from(parts, bytes, state)).await?;
            Ok(Self(inner, ctx))
        }
    }
}

/// The scope id of the `scope` parameter. Fails to compile (pointing at the parameter) when its type
/// does not implement [`Scope`](super::Scope).
///
/// The id is returned owned (the record key needs an owned copy anyway) so that the parameter can
/// still move into the handler body after its id was taken.
pub fn scope_id<T: super::Scope + ?Sized>(value: &T) -> Cow<'static, str> {
    Cow::Owned(value.scope_id().into_owned())
}

/// Runs `handler` under idempotency protection: reads the key, asks the engine, then runs and stores,
/// replays, or answers a problem. See [`axum`](super) for the behaviour.
pub fn run<F, R>(
    engine: EngineState,
    policy: &'static Policy,
    scope: Cow<'_, str>,
    request: RequestContext,
    handler: F,
) -> impl Future<Output = Response>
where
    F: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    super::run::run(engine.0, policy, scope.into_owned(), request, handler)
}

/// Extracts the [`Transactional`](crate::transaction::Transactional) engine for a handler whose
/// transaction parameter has type `T` from the router state, so that a router whose state holds
/// none fails to compile. `T` must be an idem transaction type.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub struct TxState<T: crate::transaction::TxHandle>(
    pub crate::transaction::Transactional<T::Store>,
);

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl<T: crate::transaction::TxHandle> std::fmt::Debug for TxState<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TxState").field(&self.0).finish()
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl<S, T> FromRequestParts<S> for TxState<T>
where
    T: crate::transaction::TxHandle,
    crate::transaction::Transactional<T::Store>: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(crate::transaction::Transactional::from_ref(state)))
    }
}

/// [`run`] in transactional mode: `handler` receives the transaction the key was claimed in.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub async fn run_transactional<T, F, Fut, R>(
    txn: TxState<T>,
    policy: &'static Policy,
    scope: Cow<'_, str>,
    request: RequestContext,
    handler: F,
) -> Response
where
    T: crate::transaction::TxHandle,
    F: FnOnce(T) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    super::run::run_transactional(&txn.0, policy, scope.into_owned(), request, handler).await
}
