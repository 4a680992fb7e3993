//! Items the `#[idempotent]` expansion names. Not a public API: no stability guarantees.
//!
//! The expansion of
//!
//! ```ignore
//! #[idempotent(scope = "user", ttl = "24h")]
//! async fn create(State(app): State<App>, user: AuthUser, Json(req): Json<New>) -> impl IntoResponse { BODY }
//! ```
//!
//! is, in essence (`cargo expand` prints the real expansion; see `idem-macros/src/expand.rs`):
//!
//! ```ignore
//! async fn create(
//!     State(app): State<App>,
//!     user: AuthUser,
//!     ::idem_runtime::__private::WithBody(__idem_last, __idem_request, __idem_engine): ::idem_runtime::__private::WithBody<Json<New>, 1048576>,
//! ) -> ::idem_runtime::__private::Response {
//!     const __IDEM_POLICY: ::idem_runtime::__private::Policy = ::idem_runtime::__private::Policy::new()
//!         .ttl(::idem_runtime::__private::Duration::from_millis(86400000))
//!         .handler("create")
//!         .checked();
//!     // A parameter before the last one that reads the body is reported at its type.
//!     (&&::idem_runtime::__private::Param::<AuthUser>::new()).check();
//!     // Copied out: the body below is an `async move` block that may use `user` itself.
//!     let __idem_scope: ::std::string::String = ::idem_runtime::__private::scope_id(&user);
//!     // The last parameter is extracted once the key is claimed, and handed to the closure.
//!     ::idem_runtime::__private::run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, __idem_last,
//!         move |Json(req): Json<New>| async move { BODY }).await
//! }
//! ```
//!
//! The engine comes with the last parameter ([`WithBody`]'s third field, [`EngineState`] by
//! default) rather than as a parameter of its own, so that the handler's type, which the compiler
//! shows when a router refuses it, lists the user's parameters only.

pub use super::request::{Deferred, KeyHeader, RequestContext};
pub use crate::engine::Engine;
pub use crate::policy::{ClientErrors, MissingKey, Policy, PolicyError, ReplayMode, ServerErrors};
pub use ::axum::response::Response;
pub use core::time::Duration;

use ::axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
use ::axum::http::request::Parts;
use ::axum::response::IntoResponse;
use std::future::Future;
use std::marker::PhantomData;

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

/// Wraps the handler's last parameter: extracts the engine `E` from the router state, buffers the
/// body (up to `LIMIT` bytes, else 413), records what the fingerprint needs, and prepares the
/// wrapped extractor `T` on the same bytes ([`Deferred`]). `E` is [`EngineState`], or [`TxState`]
/// in transactional mode (any request-head extractor works, `()` included).
#[derive(Debug)]
pub struct WithBody<T, const LIMIT: usize, E = EngineState>(
    pub Deferred<T>,
    pub RequestContext,
    pub E,
);

/// The marker for [`WithBody`] around an extractor that reads only the request head.
#[doc(hidden)]
#[derive(Debug)]
pub enum ViaPartsExtractor {}

impl<S, T, E, const LIMIT: usize> FromRequest<S> for WithBody<T, LIMIT, E>
where
    T: FromRequest<S> + 'static,
    E: FromRequestParts<S> + Send,
    S: Clone + Send + Sync + 'static,
{
    type Rejection = Response;

    // Not an `async fn`, here and below: that would keep the request twice in the future (as the
    // argument and as a local), and this future is part of the one axum boxes each request in.
    #[allow(clippy::manual_async_fn)]
    fn from_request(
        req: Request,
        state: &S,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        let (mut parts, body) = req.into_parts();
        async move {
            let engine = E::from_request_parts(&mut parts, state)
                .await
                .map_err(IntoResponse::into_response)?;
            let bytes = super::request::read_body(body, LIMIT).await?;
            let ctx = super::request::context(&parts, &bytes);
            let request = super::request::rebuilt(parts, bytes);
            let state = state.clone();
            let extract = async move {
                T::from_request(request, &state)
                    .await
                    .map_err(IntoResponse::into_response)
            };
            Ok(Self(Deferred::later(extract), ctx, engine))
        }
    }
}

impl<S, T, E, const LIMIT: usize> FromRequest<S, ViaPartsExtractor> for WithBody<T, LIMIT, E>
where
    T: FromRequestParts<S>,
    E: FromRequestParts<S> + Send,
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
            let engine = E::from_request_parts(&mut parts, state)
                .await
                .map_err(IntoResponse::into_response)?;
            let bytes = super::request::read_body(body, LIMIT).await?;
            let inner = T::from_request_parts(&mut parts, state)
                .await
                .map_err(IntoResponse::into_response)?;
            let ctx = super::request::context(&parts, &bytes);
            Ok(Self(Deferred::ready(inner), ctx, engine))
        }
    }
}

/// A router state that asks nothing of an extractor: an extractor that extracts from it extracts
/// from every state. [`Param`] probes extractors with it, so that a probe never refuses a handler
/// that works with the application's own state.
#[derive(Debug, Clone, Copy)]
pub struct AnyState;

/// The probe of a handler parameter before the last one, which the expansion calls as
/// `(&&Param::<T>::new()).check()` at the parameter's type. Method resolution picks the first
/// `check` whose impl applies: [`ReadsTheHead`] (an extractor from the request head), then
/// [`ReadsTheBody`] (an extractor of the body, for every state: an error, as axum gives the body
/// to the last parameter only), then [`Unknown`] (an extractor for some states only, or none:
/// left to the compiler's check of the handler against the router's state).
pub struct Param<T>(PhantomData<fn() -> T>);

impl<T> Param<T> {
    /// The probe of `T`.
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T> Default for Param<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for Param<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Param<T> {}

/// [`Param`]'s first choice: `T` reads the request head.
pub trait ReadsTheHead: Sized {
    /// Passes.
    fn check(self) {}
}

impl<T: FromRequestParts<AnyState>> ReadsTheHead for &&Param<T> {}

/// [`Param`]'s second choice: `T` reads the body, before the last parameter.
pub trait ReadsTheBody<T>: Sized {
    /// Fails to compile, at the parameter's type.
    fn check(self)
    where
        T: BodyLast,
    {
    }
}

impl<T: FromRequest<AnyState>> ReadsTheBody<T> for &Param<T> {}

/// [`Param`]'s last choice: nothing is known of `T` here.
pub trait Unknown: Sized {
    /// Passes.
    fn check(self) {}
}

impl<T> Unknown for Param<T> {}

/// Implemented by no type: the bound of [`ReadsTheBody::check`], whose message it carries.
#[diagnostic::on_unimplemented(
    message = "`{Self}` reads the request body, so it must be the handler's last parameter",
    label = "reads the request body, but is not the last parameter",
    note = "axum gives the request body to the last parameter only (and `#[idempotent]` reads it there to fingerprint it): make this parameter the last one, and keep a single parameter that reads the body"
)]
pub trait BodyLast {}

/// The scope id of the `scope` parameter. Fails to compile (pointing at the parameter) when its type
/// does not implement [`Scope`](super::Scope).
///
/// The id is returned owned (the record key needs an owned copy anyway) so that the parameter can
/// still move into the handler body after its id was taken.
pub fn scope_id<T: super::Scope + ?Sized>(value: &T) -> String {
    value.scope_id().into_owned()
}

/// Runs `handler` under idempotency protection: reads the key, asks the engine, then extracts
/// `last` and runs and stores, replays, or answers a problem. See [`axum`](super) for the
/// behaviour.
pub fn run<B, F, Fut, R>(
    engine: EngineState,
    policy: &'static Policy,
    scope: String,
    request: RequestContext,
    last: Deferred<B>,
    handler: F,
) -> impl Future<Output = Response>
where
    B: Send + 'static,
    F: FnOnce(B) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    let policy = super::run::KeyPolicy::Static(policy);
    super::run::run(engine.0, policy, scope, request, last, handler, ())
}

/// Extracts the [`Transactional`](crate::transaction::Transactional) engine for a handler whose
/// transaction parameter has type `T` from the router state, so that a router whose state holds
/// none fails to compile. `T` must be an idem transaction type.
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub struct TxState<T: crate::transaction::TxHandle>(
    pub crate::transaction::Transactional<T::Store>,
);

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
impl<T: crate::transaction::TxHandle> std::fmt::Debug for TxState<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TxState").field(&self.0).finish()
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
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
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub async fn run_transactional<T, B, F, Fut, R>(
    txn: TxState<T>,
    policy: &'static Policy,
    scope: String,
    request: RequestContext,
    last: Deferred<B>,
    handler: F,
) -> Response
where
    T: crate::transaction::TxHandle,
    B: Send + 'static,
    F: FnOnce(T, B) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    let (tx, finish) = super::transactional::lend::<T>(&txn.0, policy.handler);
    let engine = txn.0.engine().clone();
    let policy = super::run::KeyPolicy::Static(policy);
    let handler = move |last| handler(tx, last);
    super::run::run(engine, policy, scope, request, last, handler, finish).await
}

/// What `#[idempotent]` adds for a `#[utoipa::path(...)]` written below it: a hidden type per
/// handler, `impl Documented` for it with the handler's policy (the handler's own policy constant
/// is then that one), and `Idem<that type>` in the path's `params(...)`.
pub mod openapi {
    use super::Policy;
    use std::marker::PhantomData;

    /// A handler's policy, for its documentation.
    pub trait Documented {
        /// The handler's final policy.
        const POLICY: Policy;
    }

    /// The `Idempotency-Key` parameter of the handler `T` documents: [`KeyParam`] with the
    /// `utoipa` feature, an error at the `#[utoipa::path]` attribute without it.
    pub type Idem<T> = <T as Enabled>::Param;

    /// The `Idempotency-Key` parameter of the handler `T` documents.
    #[derive(Debug)]
    pub struct KeyParam<T>(PhantomData<T>);

    #[cfg(feature = "utoipa")]
    impl<T: Documented> utoipa::IntoParams for KeyParam<T> {
        fn into_params(
            _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
        ) -> Vec<utoipa::openapi::path::Parameter> {
            vec![crate::openapi::key_parameter(&T::POLICY)]
        }
    }

    /// Implemented for every type with the `utoipa` feature and for none without it, so that
    /// `#[utoipa::path]` on an idempotent handler is an error at that attribute, not a document
    /// that silently lacks idem's part.
    #[diagnostic::on_unimplemented(
        message = "`#[utoipa::path]` on an `#[idempotent]` handler needs idem-runtime's `utoipa` feature",
        label = "idem documents this operation's `Idempotency-Key` header with the `utoipa` feature",
        note = "enable it: `idem-runtime = {{ version = \"0.1\", features = [\"utoipa\"] }}`, and add `idem_runtime::openapi::Idempotency` to the API's modifiers"
    )]
    pub trait Enabled {
        /// The parameter's type.
        type Param;
    }

    #[cfg(feature = "utoipa")]
    impl<T> Enabled for T {
        type Param = KeyParam<T>;
    }
}
