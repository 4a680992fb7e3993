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
//!     __idem_engine: ::idem_runtime::__private::EngineState,
//!     State(app): State<App>,
//!     user: AuthUser,
//!     ::idem_runtime::__private::WithJson(Json(req), __idem_request):
//!         ::idem_runtime::__private::WithJson<Json<New>, { ::idem_runtime::__private::Policy::new().max_request_body }>,
//! ) -> ::idem_runtime::__private::Response {
//!     const __IDEM_POLICY: ::idem_runtime::__private::Policy = ::idem_runtime::__private::Policy::new()
//!         .ttl(::idem_runtime::__private::Duration::from_millis(3600000))
//!         .handler("create")
//!         .checked();
//!     ::idem_runtime::__private::json_body::<Json<New>>();
//!     let __idem_scope: ::std::borrow::Cow<'static, str> =
//!         ::std::borrow::Cow::Owned(::idem_runtime::__private::scope_id(&user).into_owned());
//!     ::idem_runtime::__private::run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, async move {
//!         let __idem_ret: Result<Json<Payment>, AppError> = { BODY };
//!         __idem_ret
//!     })
//!     .await
//! }
//! ```
//!
//! With `transaction = "tx"` (a parameter `mut tx: Tx<Postgres>`), that parameter leaves the
//! extractor list, the engine parameter becomes
//! `__idem_engine: ::idem_runtime::__private::TxState<Tx<Postgres>>` (the `Transactional` engine
//! from the state; `TxState<T>` requires `T: TxHandle`, so a wrong type is reported at the
//! parameter's type), and the call becomes
//! `::idem_runtime::__private::run_transactional(__idem_engine, &__IDEM_POLICY, __idem_scope,
//! __idem_request, move |mut tx: Tx<Postgres>| async move { ... })`: the runtime claims the key in
//! a transaction and only then calls the closure with it.
//!
//! Why each piece looks the way it does:
//! - A last parameter written `Json<T>` is wrapped in `WithJson`, which deserializes `T` in the
//!   same parse that fingerprints the body; any other last parameter in `WithBody`, which buffers
//!   the body and hands the bytes to the parameter's own extractor (a second parse, for JSON).
//! - The scope id is copied out (`into_owned`) because the body is an `async move` block that may
//!   move the scope parameter itself; a borrow could not live alongside it.
//! - `scope_id(&user)` carries the span of the parameter's *type*, so a type without `Scope` is
//!   reported there, with `Scope`'s `on_unimplemented` note.
//! - The `let __idem_ret: <return type>` gives `?` and `.into()` in the body the type the original
//!   signature gave them. `impl Trait` in the return type becomes `_` (not allowed in a `let`),
//!   and the value passes through `fn __idem_returns(__idem_ret: T) -> T` with the original `T`,
//!   so the bound is still checked where the user wrote it.
//! - With `policy = PATH` the const starts from `PATH` (its span on `.checked()`, so an invalid
//!   named policy is reported at the attribute) and the body limit is `{ PATH.max_request_body }`.

use crate::config::{Config, ScopeSource};
use crate::values::{MissingKey, Replay};
use proc_macro2::{Delimiter, Group, Span, TokenStream};
use quote::{quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{FnArg, Ident, ItemFn, ReturnType, Type};

pub(crate) fn expand(config: Config) -> TokenStream {
    let Config {
        handler,
        scope,
        base,
        ttl_ms,
        retain_ms,
        lease_ms,
        wait_ms,
        missing_key,
        derive_window_ms,
        reject_after_ms,
        replay,
        max_body,
        transaction,
    } = config;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = handler;

    let def = Span::mixed_site();
    let p = quote_spanned!(def=> ::idem_runtime::__private);
    let engine = Ident::new("__idem_engine", def);
    let request = Ident::new("__idem_request", def);
    let scope_var = Ident::new("__idem_scope", def);
    let ret = Ident::new("__idem_ret", def);
    let policy_const = Ident::new("__IDEM_POLICY", def);

    // The policy: the base, each explicit option in an order where `ttl` (which raises `retain`)
    // comes before an explicit `retain`, the handler name, then the compile-time check.
    let (base_expr, check_span) = match &base {
        Some(path) => (path.to_token_stream(), path.span()),
        None => (quote_spanned!(def=> #p::Policy::new()), def),
    };
    let mut policy = base_expr.clone();
    let duration = |ms: u64| quote_spanned!(def=> #p::Duration::from_millis(#ms));
    for (method, ms) in [
        ("ttl", ttl_ms),
        ("retain", retain_ms),
        ("lease", lease_ms),
        ("wait", wait_ms),
    ] {
        if let Some(ms) = ms {
            let method = Ident::new(method, def);
            let value = duration(ms);
            policy.extend(quote_spanned!(def=> .#method(#value)));
        }
    }
    if let Some(mk) = missing_key {
        let variant = match mk {
            MissingKey::Reject => quote_spanned!(def=> Reject),
            MissingKey::Pass => quote_spanned!(def=> Pass),
            MissingKey::Derive => quote_spanned!(def=> Derive),
        };
        policy.extend(quote_spanned!(def=> .missing_key(#p::MissingKey::#variant)));
    }
    if let Some(ms) = derive_window_ms {
        let value = duration(ms);
        policy.extend(quote_spanned!(def=> .derive_window(#value)));
    }
    if let Some(at) = reject_after_ms {
        policy.extend(quote_spanned!(def=> .reject_after_ms(#at)));
    }
    if let Some(mode) = replay {
        let variant = match mode {
            Replay::Full => quote_spanned!(def=> Full),
            Replay::Minimal => quote_spanned!(def=> Minimal),
        };
        policy.extend(quote_spanned!(def=> .replay(#p::ReplayMode::#variant)));
    }
    let limit = match max_body {
        Some(bytes) => {
            let bytes = bytes as usize;
            policy.extend(quote_spanned!(def=> .max_request_body(#bytes)));
            quote_spanned!(def=> #bytes)
        }
        None => quote_spanned!(def=> { #base_expr.max_request_body }),
    };
    let name = sig.ident.unraw().to_string();
    policy.extend(quote_spanned!(def=> .handler(#name)));
    policy.extend(match &scope {
        // Keys shared by every caller must not be derived from bodies that callers share.
        ScopeSource::Global => quote_spanned!(check_span=> .checked_for_global_scope()),
        ScopeSource::Param { .. } => quote_spanned!(check_span=> .checked()),
    });

    // Parameters: the engine first, the last one wrapped so the body is buffered and captured.
    let mut inputs: Vec<FnArg> = sig.inputs.iter().cloned().collect();
    // `transaction = "tx"`: that parameter is no extractor; the runtime hands it to the body.
    let tx_param = transaction.and_then(|index| match inputs.remove(index) {
        FnArg::Typed(pt) => Some(pt),
        FnArg::Receiver(_) => None,
    });
    let checks = TokenStream::new();
    let wrapped = match inputs.pop() {
        Some(FnArg::Typed(pt)) => {
            let (attrs, pat, ty) = (&pt.attrs, &pt.pat, &pt.ty);
            quote_spanned!(def=> #(#attrs)* #p::WithBody(#pat, #request): #p::WithBody<#ty, #limit>)
        }
        // A receiver was rejected in `config.rs`; with no parameter, wrap the unit extractor.
        _ => quote_spanned!(def=> #p::WithBody((), #request): #p::WithBody<(), #limit>),
    };

    let scope_let = match scope {
        ScopeSource::Global => quote_spanned!(def=>
            let #scope_var: ::std::borrow::Cow<'static, str> = ::std::borrow::Cow::Borrowed(#p::GLOBAL_SCOPE);
        ),
        ScopeSource::Param { ident, ty_span } => {
            let mut arg = ident;
            arg.set_span(ty_span.resolved_at(arg.span()));
            let call = quote_spanned!(ty_span=> ::idem_runtime::__private::scope_id(&#arg));
            quote_spanned!(def=>
                let #scope_var: ::std::borrow::Cow<'static, str> = ::std::borrow::Cow::Owned(#call.into_owned());
            )
        }
    };

    // The body's value gets the declared return type, so `?` and `.into()` infer as before. An
    // `impl Trait` cannot be written in a `let`: there it becomes `_`, and the value goes through
    // a local fn declared with the original type, which keeps the bound checked (and the user's
    // `use ...::IntoResponse` used).
    let returns = Ident::new("__idem_returns", def);
    let (ret_ty, finish) = match &sig.output {
        ReturnType::Default => (quote_spanned!(def=> ()), ret.to_token_stream()),
        ReturnType::Type(_, ty) => {
            let mut inferred = (**ty).clone();
            let mut visitor = ImplToInfer(false);
            visitor.visit_type_mut(&mut inferred);
            if visitor.0 {
                let finish = quote_spanned!(def=> {
                    fn #returns(#ret: #ty) -> #ty {
                        #ret
                    }
                    #returns(#ret)
                });
                (inferred.into_token_stream(), finish)
            } else {
                (inferred.into_token_stream(), ret.to_token_stream())
            }
        }
    };
    // Re-braced with a generated span: the user's statements keep theirs, and lints about the
    // block (unused braces) see generated code.
    let body = Group::new(
        Delimiter::Brace,
        block.stmts.iter().map(ToTokens::to_token_stream).collect(),
    );
    let mut body = body;
    body.set_span(def);

    let syn::Signature {
        constness,
        asyncness,
        unsafety,
        abi,
        fn_token,
        ident,
        ..
    } = &sig;
    let (engine_ty, run) = match &tx_param {
        None => (
            quote_spanned!(def=> #p::EngineState),
            quote_spanned!(def=> #p::run(#engine, &#policy_const, #scope_var, #request, async move {
                let #ret: #ret_ty = #body;
                #finish
            })),
        ),
        Some(pt) => {
            let (pat, ty) = (&pt.pat, &pt.ty);
            // Spanned at the parameter's type, so that a type which is no idem transaction type
            // is reported there (with `TxHandle`'s message), not at the attribute.
            let ty_span = ty.span();
            let state = quote_spanned!(ty_span=> ::idem_runtime::__private::TxState<#ty>);
            let run = quote_spanned!(ty_span=> ::idem_runtime::__private::run_transactional);
            (
                state,
                quote_spanned!(def=> #run(#engine, &#policy_const, #scope_var, #request, move |#pat: #ty| async move {
                    let #ret: #ret_ty = #body;
                    #finish
                })),
            )
        }
    };
    quote_spanned! {def=>
        #(#attrs)*
        #vis #constness #asyncness #unsafety #abi #fn_token #ident(
            #engine: #engine_ty,
            #(#inputs,)*
            #wrapped,
        ) -> #p::Response {
            const #policy_const: #p::Policy = #policy;
            #checks
            #scope_let
            #run.await
        }
    }
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

/// Prints the expansion when `IDEM_DEBUG_EXPAND` is `1` (every handler) or names this handler
/// (a comma-separated list of function names).
pub(crate) fn debug_print(name: &str, tokens: &TokenStream) {
    let Some(wanted) = std::env::var_os("IDEM_DEBUG_EXPAND") else {
        return;
    };
    let wanted = wanted.to_string_lossy();
    if wanted == "1" || wanted.split(',').any(|w| w.trim() == name) {
        eprintln!("#[idempotent] expansion of `{name}`:\n{tokens}\n");
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        let config = match crate::config::build(args, item) {
            Ok(config) => config,
            Err(e) => panic!("{e}"),
        };
        super::expand(config).to_string()
    }

    #[test]
    fn the_last_parameter_is_wrapped_and_the_engine_comes_first() {
        let out = expand(
            quote!(scope = "user", ttl = "1h"),
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
        assert!(out.contains(
            "async fn create (__idem_engine : :: idem_runtime :: __private :: EngineState , State (app) : State < App > , user : AuthUser , :: idem_runtime :: __private :: WithBody (Json (req) , __idem_request) : :: idem_runtime :: __private :: WithBody < Json < New > , { :: idem_runtime :: __private :: Policy :: new () . max_request_body } > ,) -> :: idem_runtime :: __private :: Response"
        ));
        assert!(out.contains(
            ". ttl (:: idem_runtime :: __private :: Duration :: from_millis (3600000u64))"
        ));
        assert!(out.contains(". handler (\"create\") . checked ()"));
        assert!(out.contains(":: idem_runtime :: __private :: scope_id (& user) . into_owned ()"));
        assert!(out.contains("let __idem_ret : Json < Out > ="));
    }

    #[test]
    fn no_parameters_wrap_the_unit_extractor() {
        let out = expand(
            quote!(scope = "global", max_body = "2KiB"),
            quote!(
                async fn ping() {}
            ),
        );
        assert!(out.contains("WithBody (() , __idem_request) : :: idem_runtime :: __private :: WithBody < () , 2048usize >"));
        assert!(out.contains("GLOBAL_SCOPE"));
        assert!(out.contains(". max_request_body (2048usize)"));
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
