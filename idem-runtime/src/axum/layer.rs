//! [`IdempotencyLayer`]: `#[idempotent]`'s protection as a tower layer, for handlers that stay plain.
//!
//! ```
//! use axum::routing::post;
//! use axum::Router;
//! use idem_runtime::axum::IdempotencyLayer;
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::{Engine, Policy};
//! # use idem_runtime::axum::Scope;
//! # use axum::extract::FromRequestParts;
//! # struct AuthUser(String);
//! # impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
//! #     type Rejection = axum::http::StatusCode;
//! #     async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, Self::Rejection> { Ok(AuthUser("a".into())) }
//! # }
//! # impl Scope for AuthUser { fn scope_id(&self) -> std::borrow::Cow<'_, str> { (&self.0).into() } }
//!
//! const REFUNDS: Policy = Policy::new().handler("refund").checked();
//!
//! async fn refund(body: String) -> String {
//!     format!("refunded {body}")
//! }
//!
//! let engine = Engine::new(MemoryStore::new());
//! let idempotent = IdempotencyLayer::new(engine, REFUNDS).scope::<AuthUser>();
//! let router: Router = Router::new().route("/refunds", post(refund).route_layer(idempotent));
//! # let _ = router;
//! ```
//!
//! Without a scope choice the layer is no [`Layer`]: the router refuses it at compile time with
//! the attribute's message for a missing `scope`.
//!
//! ```compile_fail
//! # use idem_runtime::{axum::IdempotencyLayer, store::memory::MemoryStore, Engine, Policy};
//! let layer = IdempotencyLayer::new(Engine::new(MemoryStore::new()), Policy::new());
//! let router: axum::Router = axum::Router::new()
//!     .route("/refunds", axum::routing::post(|| async { "ok" }))
//!     .route_layer(layer);
//! ```

use super::request::{context, read_body, rebuilt, Deferred};
use super::run::{run, KeyPolicy};
use super::{Attempt, RequestOutcome, Scope};
use crate::engine::Engine;
use crate::policy::{Policy, PolicyError};
use ::axum::extract::{FromRequestParts, Request};
use ::axum::http::request::Parts;
use ::axum::response::{IntoResponse, Response};
use futures_util::future::BoxFuture;
use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_layer::Layer;
use tower_service::Service;

/// The [`#[idempotent]`](crate::idempotent) attribute as a tower [`Layer`], for teams that keep
/// their handlers free of macros: the same [`Engine`], the same [`Policy`] (checked when the layer
/// is built, with the attribute's messages), the same HTTP behaviour and the same guarantees (an
/// atomic claim, the handler run once in a task of its own with its lease renewed, the response
/// stored and replayed). Apply it to a route with `route_layer` (or to a whole router).
///
/// Every key is scoped to its caller, as with the attribute's required `scope`: choose with
/// [`scope`](Self::scope) (an extractor implementing [`Scope`]), [`scope_fn`](Self::scope_fn) (a
/// function of the request head) or [`global_scope`](Self::global_scope) (keys shared by every
/// caller). A layer without a choice does not compile where it is applied.
///
/// What differs from the attribute, because a layer sees the handler only as a service:
///
/// - **The handler's own extractors run inside the claim.** The layer reads the body (up to the
///   policy's [`max_request_body`](Policy::max_request_body), else 413) and the scope before it
///   claims the key, but a request the handler's extractors then reject (malformed JSON, a body
///   over axum's `DefaultBodyLimit`) has its 4xx stored and replayed like the handler's own 4xx: a
///   client that corrects its body must send it under a new key. With the attribute, such a
///   rejection releases the key instead.
/// - **No transactional mode**: committing the handler's writes with the stored response needs the
///   handler's cooperation (a transaction handed to it), which only the attribute can arrange.
/// - **Logs and metrics name the handler** after the policy's [`handler`](Policy::handler), which
///   the attribute sets to the function's name: set it (`Policy::new().handler("refund")`).
///
/// [`Attempt`] works as with the attribute: the layer fills it in for the handler's extractor.
#[derive(Debug, Clone)]
pub struct IdempotencyLayer<S = Unscoped> {
    engine: Engine,
    policy: Arc<Policy>,
    scope: S,
}

impl IdempotencyLayer {
    /// A layer over `engine` under `policy`, once [validated](Policy::validate); choose its scope
    /// next.
    ///
    /// # Panics
    ///
    /// If the policy is invalid, with [`PolicyError`]'s message (the one `#[idempotent]` gives at
    /// compile time for the same policy). [`try_new`](Self::try_new) returns the error instead.
    #[track_caller]
    pub fn new(engine: Engine, policy: Policy) -> Self {
        Self::try_new(engine, policy).unwrap_or_else(|error| panic!("{error}"))
    }

    /// [`new`](Self::new), with the invalid policy's error returned.
    pub fn try_new(engine: Engine, policy: Policy) -> Result<Self, PolicyError> {
        policy.validate()?;
        Ok(Self {
            engine,
            policy: Arc::new(policy),
            scope: Unscoped,
        })
    }
}

impl<S> IdempotencyLayer<S> {
    /// Scopes keys to the caller that the extractor `T` identifies (it runs before the key is
    /// claimed; its rejection is the response). `T` extracts from the request head without the
    /// router's state, like an authentication extractor that reads a header or an extension set by
    /// an authentication middleware; one that needs the state goes through
    /// [`scope_fn`](Self::scope_fn) or a middleware.
    pub fn scope<T>(self) -> IdempotencyLayer<ScopeExtractor<T>>
    where
        T: FromRequestParts<()> + Scope + Send + 'static,
    {
        self.with(ScopeExtractor(PhantomData))
    }

    /// Scopes keys to the caller that `scope` reads from the request head: its `Ok` is the
    /// caller's id, its `Err` the response refusing the request (a 401, say).
    pub fn scope_fn<F, E>(self, scope: F) -> IdempotencyLayer<ScopeFn<F>>
    where
        F: Fn(&Parts) -> Result<String, E> + Clone + Send + Sync + 'static,
        E: IntoResponse,
    {
        self.with(ScopeFn(scope))
    }

    /// Shares keys between every caller (the attribute's `scope = "global"`): right only where one
    /// caller's key can never return another caller's response.
    ///
    /// # Panics
    ///
    /// If the policy derives missing keys ([`PolicyError::DeriveWithGlobalScope`]): check with
    /// [`Policy::validate_for_global_scope`] to get the error instead.
    #[track_caller]
    pub fn global_scope(self) -> IdempotencyLayer<GlobalScope> {
        if let Err(error) = self.policy.validate_for_global_scope() {
            panic!("{error}");
        }
        self.with(GlobalScope)
    }

    fn with<T>(self, scope: T) -> IdempotencyLayer<T> {
        IdempotencyLayer {
            engine: self.engine,
            policy: self.policy,
            scope,
        }
    }
}

impl<S, Sc: ScopeSource> Layer<S> for IdempotencyLayer<Sc> {
    type Service = IdempotencyService<S, Sc>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            layer: self.clone(),
        }
    }
}

/// Where a layer takes its keys' scope from: [`IdempotencyLayer::scope`],
/// [`scope_fn`](IdempotencyLayer::scope_fn) or [`global_scope`](IdempotencyLayer::global_scope).
#[diagnostic::on_unimplemented(
    message = "missing `scope`: keys are unique per caller, so name what identifies the caller (`.scope::<AuthUser>()` with an extractor that implements `idem_runtime::axum::Scope`, or `.scope_fn(|parts| ...)`), or call `.global_scope()` to share keys between all callers",
    label = "this `IdempotencyLayer` has no scope"
)]
pub trait ScopeSource: Clone + Send + Sync + 'static {
    /// The caller's scope id, or the response refusing the request.
    fn scope(&self, parts: &mut Parts) -> impl Future<Output = Result<String, Response>> + Send;
}

/// A layer whose scope is not chosen yet: it is no [`Layer`].
#[derive(Debug, Clone, Copy)]
pub struct Unscoped;

/// Keys shared by every caller.
#[derive(Debug, Clone, Copy)]
pub struct GlobalScope;

impl ScopeSource for GlobalScope {
    async fn scope(&self, _: &mut Parts) -> Result<String, Response> {
        Ok(super::private::GLOBAL_SCOPE.to_owned())
    }
}

/// Keys scoped by a function of the request head.
#[derive(Clone)]
pub struct ScopeFn<F>(F);

impl<F> std::fmt::Debug for ScopeFn<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScopeFn")
    }
}

impl<F, E> ScopeSource for ScopeFn<F>
where
    F: Fn(&Parts) -> Result<String, E> + Clone + Send + Sync + 'static,
    E: IntoResponse,
{
    async fn scope(&self, parts: &mut Parts) -> Result<String, Response> {
        (self.0)(parts).map_err(IntoResponse::into_response)
    }
}

/// Keys scoped by the extractor `T`.
pub struct ScopeExtractor<T>(PhantomData<fn() -> T>);

impl<T> Clone for ScopeExtractor<T> {
    fn clone(&self) -> Self {
        Self(PhantomData)
    }
}

impl<T> std::fmt::Debug for ScopeExtractor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ScopeExtractor<{}>", std::any::type_name::<T>())
    }
}

impl<T> ScopeSource for ScopeExtractor<T>
where
    T: FromRequestParts<()> + Scope + Send + 'static,
{
    async fn scope(&self, parts: &mut Parts) -> Result<String, Response> {
        match T::from_request_parts(parts, &()).await {
            Ok(caller) => Ok(caller.scope_id().into_owned()),
            Err(rejection) => Err(rejection.into_response()),
        }
    }
}

/// The service an [`IdempotencyLayer`] wraps around a route.
#[derive(Debug, Clone)]
pub struct IdempotencyService<S, Sc> {
    inner: S,
    layer: IdempotencyLayer<Sc>,
}

impl<S, Sc> Service<Request> for IdempotencyService<S, Sc>
where
    S: Service<Request, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    Sc: ScopeSource,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone takes the place of the service that was polled ready, which serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let IdempotencyLayer {
            engine,
            policy,
            scope,
        } = self.layer.clone();
        Box::pin(async move {
            // Safe methods have no effect to protect: the handler reads the current state.
            if request.method().is_safe() {
                let Ok(response) = inner.call(request).await;
                return Ok(RequestOutcome::Unprotected.mark(response.into_response()));
            }
            let (mut parts, body) = request.into_parts();
            let scope = match scope.scope(&mut parts).await {
                Ok(scope) => scope,
                Err(refused) => return Ok(refused),
            };
            let bytes = match read_body(body, policy.max_request_body).await {
                Ok(bytes) => bytes,
                Err(refused) => return Ok(refused),
            };
            parts.extensions.get_or_insert_default::<Attempt>();
            let request_context = context(&parts, &bytes);
            let request = rebuilt(parts, bytes);
            let handler = move |()| async move {
                let Ok(response) = inner.call(request).await;
                response
            };
            let policy = KeyPolicy::Shared(policy);
            let now = Deferred::ready(());
            Ok(run(engine, policy, scope, request_context, now, handler, ()).await)
        })
    }
}
