//! The rewrite of a validated handler. Nothing here can fail: `config.rs` has checked everything.
//!
//! Input:
//!
//! ```text
//! #[idempotent(scope = "user", ttl = "1h")]
//! pub async fn create(State(app): State<App>, user: AuthUser, Json(req): Json<New>) -> Result<Json<Payment>, AppError> {
//!     BODY
//! }
//! ```
//!
//! Output:
//!
//! ```text
//! pub async fn create(
//!     State(app): State<App>,
//!     user: AuthUser,
//!     ::idem_runtime::__private::WithBody(__idem_last, __idem_request, __idem_engine):
//!         ::idem_runtime::__private::WithBody<Json<New>, { ::idem_runtime::__private::Policy::new().max_request_body }>,
//! ) -> ::idem_runtime::__private::Response {
//!     const __IDEM_POLICY: ::idem_runtime::__private::Policy = ::idem_runtime::__private::Policy::new()
//!         .ttl(::idem_runtime::__private::Duration::from_millis(3600000))
//!         .handler("create")
//!         .checked();
//!     const _: () = { /* no `#[utoipa::path]` written above: see `utoipa_order_check` */ };
//!     use ::idem_runtime::__private::{ReadsTheHead as _, ReadsTheBody as _, Unknown as _};
//!     (&&::idem_runtime::__private::Param::<State<App>>::new()).check();
//!     (&&::idem_runtime::__private::Param::<AuthUser>::new()).check();
//!     let __idem_scope: ::std::string::String = ::idem_runtime::__private::scope_id(&user);
//!     ::idem_runtime::__private::run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, __idem_last,
//!         move |Json(req): Json<New>| async move {
//!             let __idem_ret: Result<Json<Payment>, AppError> = { BODY };
//!             __idem_ret
//!         })
//!     .await
//! }
//! ```
//!
//! [`expand`] is a row of steps, each a function below that shows its tokens before and after:
//! [`policy`] builds the policy constant's expression; [`document`] adds it to a
//! `#[utoipa::path]` below, and [`utoipa_order_check`] refuses one above; [`Params::split`] sorts
//! the parameters; [`gen_signature`] rewrites the signature and [`gen_block`] the body, from
//! [`probes`], [`scope_id`], [`Last::new`], [`run_call`] and [`body`].
//!
//! With `transaction = "tx"` (a parameter `mut tx: Tx<Postgres>`), that parameter leaves the
//! extractor list, the engine becomes `WithBody`'s third type argument
//! `::idem_runtime::__private::TxState<Tx<Postgres>>` (the `Transactional` engine from the state;
//! `TxState<T>` requires `T: TxHandle`, so a wrong type is reported at the parameter's type), and
//! the call becomes
//! `::idem_runtime::__private::run_transactional(__idem_engine, &__IDEM_POLICY, __idem_scope,
//! __idem_request, __idem_last, move |mut tx: Tx<Postgres>, Json(req): Json<New>| async move { ... })`:
//! the runtime claims the key in a transaction and only then calls the closure with it.
//!
//! Why each piece looks the way it does:
//! - The last parameter is wrapped in `WithBody`, which takes the engine from the router state,
//!   buffers the body, fingerprints it and prepares the parameter's own extractor on the bytes
//!   (`Deferred`). The runtime runs that extractor once the key is claimed, so a replay never runs
//!   it, and hands the value to the closure, whose parameter is the user's pattern. A last
//!   parameter that is the `scope` parameter is extracted before the claim instead
//!   (`Deferred::now`, its rejection returned), as the key needs its value. The
//!   engine travels there rather than as a parameter of its own: the handler's type, which the
//!   compiler prints when a router refuses the handler, then lists the user's parameters only
//!   (the engine's type is `WithBody`'s default type argument, which is not printed).
//! - Each parameter before the last is probed (`Param::<T>::check`, spanned at its type): one that
//!   reads the body is reported there, instead of only as "not a `Handler`" at the router.
//! - The policy calls a builder method for each option written, nothing else: what is not written
//!   is the runtime's default (or the named policy's). A rule between options that involves such
//!   a value is a `match` on `Policy::validate()` whose arm panics at the option written, so the
//!   const evaluation reports it there.
//! - The scope id is copied out (`into_owned`) because the body is an `async move` block that may
//!   move the scope parameter itself; a borrow could not live alongside it.
//! - `scope_id(&user)` carries the span of the parameter's *type*, so a type without `Scope` is
//!   reported there, with `Scope`'s `on_unimplemented` note.
//! - The `let __idem_ret: <return type>` gives `?` and `.into()` in the body the type the original
//!   signature gave them. `impl Trait` in the return type becomes `_` (not allowed in a `let`),
//!   and the value passes through `fn __idem_returns(__idem_ret: T) -> T` with the original `T`,
//!   so the bound is still checked where the user wrote it.
//! - With a `#[utoipa::path(...)]` among the attributes (written below `#[idempotent]`, so it is
//!   still there), the policy is the associated const of a hidden `struct __idem_create` (`impl
//!   ::idem_runtime::__private::openapi::Documented`), which the handler's const names, so it is
//!   evaluated once; and `::idem_runtime::__private::openapi::Idem<__idem_create>` goes first into
//!   the path's `params(...)` (a new one if there is none), spanned at the path attribute: that
//!   type alias yields the `Idempotency-Key` parameter with the runtime's `utoipa` feature, and an
//!   error naming the feature there without it. Without one, a `#[utoipa::path]` written above
//!   `#[idempotent]` is a compile error at `#[idempotent]` ([`utoipa_order_check`]).
//! - With `policy = PATH` the const starts from `PATH` (its span on `.checked()`, so an invalid
//!   named policy is reported at the attribute) and the body limit is `{ PATH.max_request_body }`.

use crate::config::{Config, ScopeSource, Value};
use crate::options::Opt;
use proc_macro2::{Delimiter, Group, Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{parse_quote_spanned, Attribute, Block, Meta, Signature};
use syn::{FnArg, Ident, ItemFn, PatType, ReturnType, Type};

/// The handler rewritten, one step per line: each step's tokens before and after are on its fn.
pub(crate) fn expand(config: Config) -> TokenStream {
    let Config {
        handler,
        scope,
        transaction,
        base,
        values,
        rules,
    } = config;
    let ItemFn {
        mut attrs,
        vis,
        sig,
        block,
    } = handler;
    let name = sig.ident.unraw().to_string();
    let base = match base {
        Some(path) => path.into_token_stream(),
        None => quote_spanned!(Span::mixed_site()=> ::idem_runtime::__private::Policy::new()),
    };
    let global = matches!(scope, ScopeSource::Global);
    let paths = crate::policy::Paths {
        module: private(),
        duration: quote_spanned!(Span::mixed_site()=> ::idem_runtime::__private::Duration),
    };
    let policy = crate::policy::policy(&paths, &base, &name, global, &values, &rules);
    let (companion, policy, order_check) = match utoipa_path(&mut attrs) {
        Some(path) => {
            let (companion, policy) = document(&name, path, policy);
            (companion, policy, TokenStream::new())
        }
        None => (TokenStream::new(), policy, utoipa_order_check(&name)),
    };
    let params = Params::split(&sig, transaction);
    let limit = body_limit(&base, &values);
    let block = gen_block(&params, scope, &policy, order_check, &sig.output, &block);
    let sig = gen_signature(sig, &params, &limit);
    quote_spanned! {Span::mixed_site()=>
        #companion
        #(#attrs)*
        #vis #sig #block
    }
}

/// The runtime's hidden module, the only path generated code names besides `::core` and `::std`.
fn private() -> TokenStream {
    quote_spanned!(Span::mixed_site()=> ::idem_runtime::__private)
}

/// A generated local or item, hygienic where the language allows (`__idem_`-prefixed anyway).
pub(crate) fn generated(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// The body limit, `WithBody`'s second type argument.
///
/// Input:  `max_body = "2KiB"`, or nothing (with `policy = PAYMENTS`)
/// Output: `2048usize`, or `{ ::idem_runtime::__private::Policy::new().max_request_body }`
/// (`{ PAYMENTS.max_request_body }`)
fn body_limit(base: &TokenStream, values: &[(Opt, Value)]) -> TokenStream {
    let def = Span::mixed_site();
    match values.iter().find(|(opt, _)| *opt == Opt::MaxBody) {
        Some((_, Value::Size(bytes))) => quote_spanned!(def=> #bytes),
        _ => quote_spanned!(def=> { #base.max_request_body }),
    }
}

/// The `#[utoipa::path(...)]` among the handler's attributes: written below `#[idempotent]`, it is
/// still there. Another attribute named `path` is not it.
fn utoipa_path(attrs: &mut [Attribute]) -> Option<&mut Attribute> {
    attrs.iter_mut().find(|attr| {
        attr.path()
            .segments
            .iter()
            .map(|s| s.ident.to_string())
            .eq(["utoipa", "path"])
    })
}

/// For `#[utoipa::path(...)]`: the hidden type whose `Documented` impl holds the policy, which the
/// handler's constant then names, and the key parameter added to the path's `params(...)`,
/// spanned at the path attribute: the runtime reports a missing `utoipa` feature there.
///
/// Input:  `#[utoipa::path(post, path = "/x")]` on `create`, the policy expression POLICY
/// Output: `#[utoipa::path(params(::idem_runtime::__private::openapi::Idem<__idem_create>), post, path = "/x")]`,
///         the companion `struct __idem_create; impl Documented for __idem_create { const POLICY: Policy = POLICY; }`,
///         and the handler's policy `<__idem_create as Documented>::POLICY`
fn document(name: &str, attr: &mut Attribute, policy: TokenStream) -> (TokenStream, TokenStream) {
    let (def, p) = (Span::mixed_site(), private());
    let ty = generated(&format!("__idem_{name}"));
    let param = quote_spanned!(attr.path().span()=> ::idem_runtime::__private::openapi::Idem<#ty>);
    add_key_param(attr, param);
    let companion = quote_spanned!(def=>
        #[allow(non_camel_case_types, dead_code)]
        struct #ty;
        impl #p::openapi::Documented for #ty {
            const POLICY: #p::Policy = #policy;
        }
    );
    let policy = quote_spanned!(def=> <#ty as #p::openapi::Documented>::POLICY);
    (companion, policy)
}

/// The key parameter goes first into the path's `params(...)`, or into a new one: utoipa takes
/// its arguments in any order.
///
/// Input:  `#[utoipa::path(post, params(("id" = u64, Path)))]`, or `#[utoipa::path(get)]`
/// Output: `#[utoipa::path(post, params(PARAM, ("id" = u64, Path)))]`, or `#[utoipa::path(params(PARAM), get)]`
fn add_key_param(attr: &mut Attribute, param: TokenStream) {
    let Meta::List(list) = &mut attr.meta else {
        return;
    };
    let mut args: Vec<TokenTree> = list.tokens.clone().into_iter().collect();
    let params = args.windows(2).position(|w| {
        matches!(w, [TokenTree::Ident(i), TokenTree::Group(g)] if i == "params" && g.delimiter() == Delimiter::Parenthesis)
    });
    list.tokens = match params.map(|i| &mut args[i + 1]) {
        Some(TokenTree::Group(group)) => {
            let listed = group.stream();
            let mut with = Group::new(Delimiter::Parenthesis, quote!(#param, #listed));
            with.set_span(group.span());
            *group = with;
            args.into_iter().collect()
        }
        _ => {
            let args = &list.tokens;
            quote!(params(#param), #args)
        }
    };
}

/// Without a `#[utoipa::path]` below `#[idempotent]`: a check that none was written above it.
/// Above, utoipa runs first, emits its `pub struct __path_<name>;` beside the function and leaves
/// the function as it was, so `#[idempotent]` never sees it and the document would silently lack
/// the key header and idem's problem responses.
///
/// The check is a closure parameter named `__path_<name>`: where a unit struct of that name is in
/// scope, the parameter is a pattern of that struct's type (an identifier pattern that names a unit
/// struct matches it), else a new binding. The trait bound below then holds only for the binding:
/// its type is left open, so it becomes `NoUtoipaPath` once the `0` falls back to `i32` (the one
/// impl). With utoipa's struct, the bound fails, with the message that says where to write the
/// path attribute, at `#[idempotent]`. A `const _` item: nothing runs, and the items it declares
/// are seen by nothing else. (A path attribute with `impl_for = Type` emits no struct, so that form
/// written above goes unnoticed.)
///
/// Input:  `#[idempotent(...)] async fn create(...)` with no `#[utoipa::path]` among its attributes
/// Output: `const _: () = { trait UtoipaPathBelow<P> {} struct NoUtoipaPath;
///         impl UtoipaPathBelow<NoUtoipaPath> for i32 {} fn order<P, I: UtoipaPathBelow<P>>(_: &P, _: I) {}
///         let _ = |__path_create| order(&__path_create, 0); };`
fn utoipa_order_check(name: &str) -> TokenStream {
    let (def, at) = (Span::mixed_site(), Span::call_site());
    let [below, none, order] = ["UtoipaPathBelow", "NoUtoipaPath", "order"].map(generated);
    // At the attribute, as written: resolved as the user's own code is, among the module's items.
    let path = Ident::new(&format!("__path_{name}"), at);
    let message = format!("`#[utoipa::path]` is written above `#[idempotent]`: utoipa documents `{name}` before idem runs, so the operation would lack the `Idempotency-Key` header and idem's problem responses");
    let label = "write `#[utoipa::path(...)]` below this attribute";
    let note = "`#[idempotent]` adds idem's part to a `#[utoipa::path(...)]` written below it; written above, utoipa runs first and emits `{P}` beside the function, which idem cannot change";
    let elsewhere = "with no `#[utoipa::path]` on this function, a `{P}` from elsewhere is in scope (a glob import?): the check cannot tell it from utoipa's";
    let order_call = quote_spanned!(at=> #order(&#path, 0));
    quote_spanned!(def=>
        const _: () = {
            #[diagnostic::on_unimplemented(message = #message, label = #label, note = #note, note = #elsewhere)]
            trait #below<P> {}
            struct #none;
            impl #below<#none> for i32 {}
            fn #order<P, I: #below<P>>(_: &P, _: I) {}
            let _ = |#path| #order_call;
        };
    )
}

/// The parameters, sorted as the rewrite needs them (`config.rs` rejected receivers).
struct Params {
    /// Those before the last: extractors of the request head, kept and probed.
    head: Vec<PatType>,
    /// The last, which may read the body: wrapped in `WithBody`, extracted once the key is claimed.
    last: Option<PatType>,
    /// `transaction = "tx"`'s parameter: no extractor; the runtime hands the body its transaction.
    tx: Option<PatType>,
}

impl Params {
    /// Input:  `(State(app): State<App>, mut tx: Tx<Postgres>, Json(req): Json<New>)`, `transaction = "tx"`
    /// Output: head `[State(app): State<App>]`, tx `mut tx: Tx<Postgres>`, last `Json(req): Json<New>`
    fn split(sig: &Signature, transaction: Option<usize>) -> Params {
        let typed = |arg: &FnArg| match arg {
            FnArg::Typed(pt) => Some(pt.clone()),
            FnArg::Receiver(_) => None,
        };
        let mut head: Vec<PatType> = sig.inputs.iter().filter_map(typed).collect();
        let tx = transaction.map(|index| head.remove(index));
        let last = head.pop();
        Params { head, last, tx }
    }

    /// The last parameter's attributes, which go where its bindings are.
    fn last_attrs(&self) -> impl Iterator<Item = &Attribute> {
        self.last.iter().flat_map(|pt| &pt.attrs)
    }

    /// The last parameter's pattern and type: `()` for a handler without parameters.
    fn last_pat_ty(&self) -> (TokenStream, TokenStream) {
        let def = Span::mixed_site();
        match &self.last {
            Some(pt) => (pt.pat.to_token_stream(), pt.ty.to_token_stream()),
            None => (quote_spanned!(def=> ()), quote_spanned!(def=> ())),
        }
    }
}

/// The signature: the head parameters as written, then the last one wrapped; the response type.
///
/// Input:  `async fn create(State(app): State<App>, user: AuthUser, Json(req): Json<New>) -> Json<Out>`
/// Output: `async fn create(State(app): State<App>, user: AuthUser,
///             ::idem_runtime::__private::WithBody(__idem_last, __idem_request, __idem_engine):
///                 ::idem_runtime::__private::WithBody<Json<New>, LIMIT>) -> ::idem_runtime::__private::Response`
///
/// With a transaction parameter `tx: Tx<Postgres>`, it leaves the list and the wrapper's third
/// type argument is `::idem_runtime::__private::TxState<Tx<Postgres>>`.
fn gen_signature(mut sig: Signature, params: &Params, limit: &TokenStream) -> Signature {
    let (def, p) = (Span::mixed_site(), private());
    let [engine, request, last] = ["__idem_engine", "__idem_request", "__idem_last"].map(generated);
    let (_, ty) = params.last_pat_ty();
    let wrapper = match &params.tx {
        None => quote_spanned!(def=> #p::WithBody<#ty, #limit>),
        // Spanned at the transaction parameter's type, as a whole: a type which is no idem
        // transaction type (`TxState<T>` requires `T: TxHandle`) is reported there, with
        // `TxHandle`'s message, not at the attribute.
        Some(PatType { ty: tx, .. }) => quote_spanned!(tx.span()=>
            ::idem_runtime::__private::WithBody<#ty, #limit, ::idem_runtime::__private::TxState<#tx>>
        ),
    };
    let head = &params.head;
    let attrs_last = params.last_attrs();
    sig.inputs = parse_quote_spanned!(def=>
        #(#head,)* #(#attrs_last)* #p::WithBody(#last, #request, #engine): #wrapper,
    );
    sig.output = parse_quote_spanned!(def=> -> #p::Response);
    sig
}

/// The handler's new body: the policy constant, the checks, the scope, and the call into the
/// runtime with the original body as a closure.
///
/// Input:  POLICY, the parameters, `-> Json<Out>` and `{ BODY }`
/// Output: `{ const __IDEM_POLICY: Policy = POLICY; [ORDER_CHECK] PROBES [EXTRACT_NOW]
///         let __idem_scope: String = SCOPE_ID; RUN.await }`
fn gen_block(
    params: &Params,
    scope: ScopeSource,
    policy: &TokenStream,
    order_check: TokenStream,
    output: &ReturnType,
    block: &Block,
) -> TokenStream {
    let (def, p) = (Span::mixed_site(), private());
    let [policy_const, scope_var] = ["__IDEM_POLICY", "__idem_scope"].map(generated);
    let probes = probes(&params.head);
    let last = Last::new(params, &scope);
    let scope_id = scope_id(scope);
    let run = run_call(params.tx.as_ref(), &last, body(output, block));
    let extract_now = &last.extract_now;
    quote_spanned!(def=> {
        const #policy_const: #p::Policy = #policy;
        #order_check
        #probes
        #extract_now
        let #scope_var: ::std::string::String = #scope_id;
        #run.await
    })
}

/// The probe of each parameter before the last (see `idem_runtime::__private::Param`), at its type.
///
/// Input:  `State(app): State<App>, user: AuthUser`
/// Output: `use ::idem_runtime::__private::{ReadsTheHead as _, ReadsTheBody as _, Unknown as _};
///         (&&::idem_runtime::__private::Param::<State<App>>::new()).check();
///         (&&::idem_runtime::__private::Param::<AuthUser>::new()).check();`
fn probes(head: &[PatType]) -> TokenStream {
    let (def, p) = (Span::mixed_site(), private());
    let probes = head
        .iter()
        .map(|PatType { ty, .. }| quote_spanned!(ty.span()=> (&&#p::Param::<#ty>::new()).check();));
    quote_spanned!(def=>
        #[allow(unused_imports)]
        use #p::{ReadsTheHead as _, ReadsTheBody as _, Unknown as _};
        #(#probes)*
    )
}

/// The scope id, owned (the record key keeps it), so that the parameter can still move into the
/// body afterwards.
///
/// Input:  `scope = "user"` (a parameter `user: AuthUser`), or `scope = "global"`
/// Output: `::idem_runtime::__private::scope_id(&user)`,
///         or `::std::string::String::from(::idem_runtime::__private::GLOBAL_SCOPE)`
fn scope_id(scope: ScopeSource) -> TokenStream {
    let (def, p) = (Span::mixed_site(), private());
    match scope {
        ScopeSource::Global => quote_spanned!(def=> ::std::string::String::from(#p::GLOBAL_SCOPE)),
        ScopeSource::Param(mut ident, ty_span) => {
            ident.set_span(ty_span.resolved_at(ident.span()));
            quote_spanned!(ty_span=> ::idem_runtime::__private::scope_id(&#ident))
        }
    }
}

/// Where the last parameter is extracted, in three pieces of the body.
struct Last {
    /// A statement before the claim, or nothing.
    extract_now: TokenStream,
    /// What the runtime gets to extract once the key is claimed.
    arg: TokenStream,
    /// The closure's parameter that receives it.
    param: TokenStream,
}

impl Last {
    /// The last parameter is extracted once the key is claimed, inside the runtime, which hands it
    /// to the closure; unless it is the scope parameter, whose value the key needs first.
    ///
    /// Input:  `Json(req): Json<New>` (not the scope)
    /// Output: nothing now; the runtime gets `__idem_last`; the closure takes `Json(req): Json<New>`
    ///
    /// Input:  `mut user: AuthUser`, the scope parameter
    /// Output: now `let mut user: AuthUser = match ::idem_runtime::__private::Deferred::now(__idem_last).await
    ///         { Ok(value) => value, Err(rejection) => return rejection };`; the runtime gets
    ///         `::idem_runtime::__private::Deferred::ready(())`; the closure takes `(): ()`
    fn new(params: &Params, scope: &ScopeSource) -> Last {
        let (def, p) = (Span::mixed_site(), private());
        let last_var = generated("__idem_last");
        let scope_is_last = match (scope, &params.last) {
            (ScopeSource::Param(ident, _), Some(pt)) => {
                matches!(&*pt.pat, syn::Pat::Ident(pi) if pi.ident.unraw() == ident.unraw())
            }
            _ => false,
        };
        let attrs = params.last_attrs();
        let (pat, ty) = params.last_pat_ty();
        match scope_is_last {
            true => Last {
                extract_now: quote_spanned!(def=>
                    #(#attrs)*
                    let #pat: #ty = match #p::Deferred::now(#last_var).await {
                        ::core::result::Result::Ok(value) => value,
                        ::core::result::Result::Err(rejection) => return rejection,
                    };
                ),
                arg: quote_spanned!(def=> #p::Deferred::ready(())),
                param: quote_spanned!(def=> (): ()),
            },
            false => Last {
                extract_now: TokenStream::new(),
                arg: last_var.to_token_stream(),
                // Its attributes go where its bindings are (an `allow` of unused variables, say).
                param: quote_spanned!(def=> #(#attrs)* #pat: #ty),
            },
        }
    }
}

/// The call into the runtime, with the original body as the closure's `async move` block.
///
/// Input:  the last parameter's piece `Json(req): Json<New>` and the body `{ BODY }`
/// Output: `::idem_runtime::__private::run(__idem_engine, &__IDEM_POLICY, __idem_scope,
///         __idem_request, __idem_last, move |Json(req): Json<New>| async move { BODY })`
///
/// With a transaction parameter `mut tx: Tx<Postgres>`:
/// `::idem_runtime::__private::run_transactional(..., move |mut tx: Tx<Postgres>, Json(req): Json<New>| async move { BODY })`
fn run_call(tx: Option<&PatType>, last: &Last, body: TokenStream) -> TokenStream {
    let (def, p) = (Span::mixed_site(), private());
    let [engine, request, policy_const, scope_var] = [
        "__idem_engine",
        "__idem_request",
        "__IDEM_POLICY",
        "__idem_scope",
    ]
    .map(generated);
    let Last { arg, param, .. } = last;
    let args = quote_spanned!(def=> #engine, &#policy_const, #scope_var, #request, #arg);
    match tx {
        None => quote_spanned!(def=> #p::run(#args, move |#param| async move #body)),
        Some(PatType { attrs, pat, ty, .. }) => {
            let run = quote_spanned!(ty.span()=> ::idem_runtime::__private::run_transactional);
            quote_spanned!(def=> #run(#args, move |#(#attrs)* #pat: #ty, #param| async move #body))
        }
    }
}

/// The original body as a block whose value has the declared return type, so `?` and `.into()`
/// infer as before. An `impl Trait` cannot be written in a `let`: there it becomes `_`, and the
/// value goes through a local fn declared with the original type, which keeps the bound checked
/// (and the user's `use ...::IntoResponse` used).
///
/// Input:  `-> Json<Out>` and `{ BODY }`
/// Output: `{ let __idem_ret: Json<Out> = { BODY }; __idem_ret }`; with `-> impl IntoResponse`:
///         `{ let __idem_ret: _ = { BODY }; { fn __idem_returns(__idem_ret: impl IntoResponse)
///         -> impl IntoResponse { __idem_ret } __idem_returns(__idem_ret) } }`
pub(crate) fn body(output: &ReturnType, block: &Block) -> TokenStream {
    let def = Span::mixed_site();
    let [ret, returns] = ["__idem_ret", "__idem_returns"].map(generated);
    let written: Type = match output {
        ReturnType::Default => parse_quote_spanned!(def=> ()),
        ReturnType::Type(_, ty) => (**ty).clone(),
    };
    let mut inferred = written.clone();
    let mut visitor = ImplToInfer(false);
    visitor.visit_type_mut(&mut inferred);
    let finish = match visitor.0 {
        true => {
            quote_spanned!(def=> { fn #returns(#ret: #written) -> #written { #ret } #returns(#ret) })
        }
        false => ret.to_token_stream(),
    };
    // Re-braced with a generated span: the user's statements keep theirs, and lints about the
    // block (unused braces) see generated code.
    let stmts = block.stmts.iter().map(ToTokens::to_token_stream).collect();
    let mut stmts = Group::new(Delimiter::Brace, stmts);
    stmts.set_span(def);
    quote_spanned!(def=> {
        let #ret: #inferred = #stmts;
        #finish
    })
}

/// `impl Trait` → `_`, wherever it appears in the return type; records whether it found one.
struct ImplToInfer(bool);

impl VisitMut for ImplToInfer {
    fn visit_type_mut(&mut self, ty: &mut Type) {
        if let Type::ImplTrait(it) = ty {
            self.0 = true;
            *ty = Type::Infer(syn::TypeInfer {
                underscore_token: syn::Token![_](it.impl_token.span),
            });
        } else {
            syn::visit_mut::visit_type_mut(self, ty);
        }
    }
}

#[cfg(test)]
mod tests {
    use quote::{quote, ToTokens};

    fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        match crate::config::build(args, item) {
            Ok(config) => super::expand(config).to_string(),
            Err(e) => panic!("{e}"),
        }
    }

    /// The handler's signature is what the compiler prints when a router refuses the handler: it
    /// must list the user's parameters as written and the last one's own type, with the engine
    /// only as `WithBody`'s default type argument (not printed), so the message reads as the user's
    /// handler and not as idem's internals.
    #[test]
    fn the_signature_shows_the_users_parameters_and_no_engine() {
        let head = [quote!(State(app): State<App>), quote!(user: AuthUser)];
        let item = quote!(
            async fn create(#(#head,)* Json(req): Json<New>) -> Json<Out> {
                todo!()
            }
        );
        let out = super::expand(crate::config::build(quote!(scope = "user"), item).unwrap());
        let syn::ItemFn { sig, .. } = syn::parse2(out).unwrap();
        let inputs: Vec<&syn::FnArg> = sig.inputs.iter().collect();
        assert_eq!(inputs.len(), 3, "{}", sig.to_token_stream());
        for (written, arg) in head.iter().zip(&inputs) {
            assert_eq!(arg.to_token_stream().to_string(), written.to_string());
        }
        let syn::FnArg::Typed(last) = inputs[2] else {
            panic!("a receiver")
        };
        let syn::Type::Path(wrapper) = &*last.ty else {
            panic!("{}", last.ty.to_token_stream())
        };
        let wrapper = wrapper.path.segments.last().unwrap();
        assert_eq!(wrapper.ident, "WithBody");
        let syn::PathArguments::AngleBracketed(args) = &wrapper.arguments else {
            panic!("no type arguments")
        };
        // The body's extractor and the size limit; the engine is the default third argument.
        assert_eq!(args.args.len(), 2, "{}", args.to_token_stream());
        assert_eq!(args.args[0].to_token_stream().to_string(), "Json < New >");
        let syn::ReturnType::Type(_, response) = &sig.output else {
            panic!("no return type")
        };
        assert_eq!(
            response.to_token_stream().to_string(),
            ":: idem_runtime :: __private :: Response"
        );
    }

    #[test]
    fn the_last_parameter_is_extracted_later_and_the_others_probed() {
        let out = expand(
            quote!(scope = "user", ttl = "1h", server_errors = "store"),
            quote!(
                async fn create(
                    State(app): State<App>,
                    user: AuthUser,
                    Json(req): Json<New>,
                ) -> Json<Out> {
                    todo!()
                }
            ),
        );
        assert!(
            out.contains(
                "__idem_request , __idem_last , move | Json (req) : Json < New > | async move {"
            ),
            "the last parameter is extracted after the claim: {out}"
        );
        assert!(!out.contains("Deferred :: now"), "{out}");
        assert!(out.contains(
            "= :: idem_runtime :: __private :: Policy :: new () . ttl (:: idem_runtime :: __private :: Duration :: from_millis (3600000u64)) . server_errors (:: idem_runtime :: __private :: ServerErrors :: Store) . handler (\"create\") . checked () ;"
        ), "{out}");
        assert!(out.contains("(&& :: idem_runtime :: __private :: Param :: < State < App > > :: new ()) . check () ;"), "{out}");
        assert!(
            out.contains(
                "(&& :: idem_runtime :: __private :: Param :: < AuthUser > :: new ()) . check () ;"
            ),
            "{out}"
        );
        assert!(
            !out.contains("Param :: < Json"),
            "the last parameter is not probed: {out}"
        );
        assert!(out.contains(":: idem_runtime :: __private :: scope_id (& user)"));
        assert!(out.contains("let __idem_ret : Json < Out > ="));
    }

    #[test]
    fn only_the_options_written_are_set() {
        let out = expand(
            quote!(scope = "global"),
            quote!(
                async fn ping(body: String) {}
            ),
        );
        assert!(out.contains(
            ": :: idem_runtime :: __private :: Policy = :: idem_runtime :: __private :: Policy :: new () . handler (\"ping\") . checked_for_global_scope () ;"
        ), "{out}");
        assert!(!out.contains("check ()"), "nothing to probe: {out}");
        assert!(
            out.contains("use :: idem_runtime :: __private :: { ReadsTheHead as _"),
            "{out}"
        );
    }

    #[test]
    fn no_parameters_wrap_the_unit_extractor() {
        let out = expand(
            quote!(scope = "global", max_body = "2KiB"),
            quote!(
                async fn ping() {}
            ),
        );
        assert!(out.contains("WithBody (__idem_last , __idem_request , __idem_engine) : :: idem_runtime :: __private :: WithBody < () , 2048usize >"));
        assert!(out.contains("move | () : () | async move"), "{out}");
        assert!(out.contains("GLOBAL_SCOPE"));
        assert!(out.contains(". max_request_body (2048usize)"));
    }

    #[test]
    fn the_last_parameters_attributes_go_where_its_bindings_are() {
        let out = expand(
            quote!(scope = "user"),
            quote!(
                async fn create(user: AuthUser, #[allow(unused_variables)] Json(req): Json<New>) {}
            ),
        );
        assert!(
            out.contains(
                "move | # [allow (unused_variables)] Json (req) : Json < New > | async move"
            ),
            "{out}"
        );
    }

    #[test]
    fn a_last_parameter_that_is_the_scope_is_extracted_before_the_claim() {
        let out = expand(
            quote!(scope = "user"),
            quote!(
                async fn refund(Path(id): Path<u64>, mut user: AuthUser) {}
            ),
        );
        let now = out
            .find("let mut user : AuthUser = match :: idem_runtime :: __private :: Deferred :: now (__idem_last) . await {")
            .unwrap_or_else(|| panic!("the scope parameter is extracted first: {out}"));
        let scope = out
            .find("scope_id (& user)")
            .unwrap_or_else(|| panic!("{out}"));
        assert!(now < scope, "{out}");
        assert!(
            out.contains("Result :: Err (rejection) => return rejection"),
            "{out}"
        );
        assert!(out.contains("__idem_request , :: idem_runtime :: __private :: Deferred :: ready (()) , move | () : () | async move"), "{out}");
    }

    #[test]
    fn rules_on_values_left_to_the_policy_are_checked_on_the_policy() {
        let out = expand(
            quote!(scope = "user", retain = "1h", reject_after = "2027-03-01"),
            quote!(
                async fn refund(user: AuthUser) {}
            ),
        );
        assert!(out.contains(". retain (:: idem_runtime :: __private :: Duration :: from_millis (3600000u64)) . reject_after_ms (1803859200000i64) . handler (\"refund\") ;"), "{out}");
        assert!(out.contains("match __idem_policy . validate () { :: core :: result :: Result :: Err (:: idem_runtime :: __private :: PolicyError :: RetainShorterThanTtl) => :: core :: panic ! (\"{}\" , \"`retain` (1h) must be at least the default `ttl`"), "{out}");
        assert!(out.contains("_ if ! :: core :: matches ! (__idem_policy . missing_key , :: idem_runtime :: __private :: MissingKey :: Pass) => :: core :: panic !"), "{out}");
        assert!(out.contains("_ => __idem_policy . checked () , }"), "{out}");
    }

    #[test]
    fn a_named_policy_is_the_base_and_sets_the_body_limit() {
        let out = expand(
            quote!(
                scope = "global",
                policy = crate::PAYMENTS,
                replay = "minimal"
            ),
            quote!(
                async fn create(body: String) -> impl IntoResponse {
                    body
                }
            ),
        );
        assert!(out.contains(
            "= crate :: PAYMENTS . replay (:: idem_runtime :: __private :: ReplayMode :: Minimal)"
        ));
        assert!(out.contains("WithBody < String , { crate :: PAYMENTS . max_request_body } >"));
        // `impl Trait` is inferred in the `let` and checked by a local fn with the written type.
        assert!(out.contains("let __idem_ret : _ ="));
        assert!(
            out.contains("fn __idem_returns (__idem_ret : impl IntoResponse) -> impl IntoResponse")
        );
    }

    #[test]
    fn a_utoipa_path_gets_the_key_parameter_and_the_policy() {
        let handler = |path: proc_macro2::TokenStream| {
            quote!(
                #[doc = "Creates."]
                #path
                async fn create(body: String) {}
            )
        };
        let param = ":: idem_runtime :: __private :: openapi :: Idem < __idem_create >";
        let out = expand(
            quote!(scope = "global", ttl = "1h"),
            handler(
                quote!(#[utoipa::path(post, path = "/x", params(("id" = u64, Path)), responses((status = 201)))]),
            ),
        );
        assert!(out.contains(&format!("# [utoipa :: path (post , path = \"/x\" , params ({param} , (\"id\" = u64 , Path)) , responses ((status = 201)))]")), "{out}");
        assert!(out.contains("struct __idem_create ; impl :: idem_runtime :: __private :: openapi :: Documented for __idem_create { const POLICY : :: idem_runtime :: __private :: Policy = :: idem_runtime :: __private :: Policy :: new () . ttl"), "{out}");
        assert!(out.contains("const __IDEM_POLICY : :: idem_runtime :: __private :: Policy = < __idem_create as :: idem_runtime :: __private :: openapi :: Documented > :: POLICY ;"), "{out}");
        let out = expand(
            quote!(scope = "global"),
            handler(quote!(#[utoipa::path(get, path = "/x")])),
        );
        assert!(
            out.contains(&format!(
                "# [utoipa :: path (params ({param}) , get , path = \"/x\")]"
            )),
            "{out}"
        );
        // Another attribute named `path` is left alone.
        let out = expand(
            quote!(scope = "global"),
            handler(quote!(#[other::path(get)])),
        );
        assert!(
            out.contains("# [other :: path (get)]") && !out.contains("Documented"),
            "{out}"
        );
    }

    #[test]
    fn a_utoipa_path_above_is_looked_for_only_when_none_is_below() {
        let handler =
            |path: proc_macro2::TokenStream| quote!(#path async fn r#create(body: String) {});
        let out = expand(quote!(scope = "global"), handler(quote!()));
        assert!(
            out.contains("let _ = | __path_create | order (& __path_create , 0) ;"),
            "{out}"
        );
        // Below, utoipa's `__path_create` is emitted after the rewrite, and must not trip it.
        let out = expand(
            quote!(scope = "global"),
            handler(quote!(#[utoipa::path(get, path = "/x")])),
        );
        assert!(!out.contains("__path_create"), "{out}");
    }

    #[test]
    fn every_mistake_is_reported_at_once() {
        let Err(errors) = crate::config::build(
            quote!(scope = "nobody", ttl = "0s", replay = "fast", ttl = "1h"),
            quote!(
                fn create(user: AuthUser) {}
            ),
        ) else {
            panic!("accepted")
        };
        let messages: Vec<String> = errors.into_iter().map(|e| e.to_string()).collect();
        assert_eq!(messages.len(), 5, "{messages:#?}");
        assert!(messages[0].starts_with("duplicate option `ttl`"));
        assert!(messages[1].contains("must be `async fn`"));
        assert!(messages[2].starts_with("`nobody` is not a parameter of `create`"));
        assert!(messages[3].starts_with("`ttl` must be greater than zero"));
        assert!(messages[4].starts_with("`replay` must be"));
    }
}
