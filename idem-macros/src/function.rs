//! Function mode: `#[idempotent(key = ...)]` on a plain `async fn` (a queue consumer, a job, a
//! call to another service), run once per key through the runtime's `Engine::once`.
//!
//! Input:
//!
//! ```text
//! #[idempotent(engine = self.engine, scope = msg.user, key = msg.id, input = msg, attempt = attempt, ttl = "24h")]
//! async fn charge(&self, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
//!     BODY
//! }
//! ```
//!
//! Output:
//!
//! ```text
//! async fn charge(&self, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
//!     const __IDEM_POLICY: ::idem_runtime::Policy = ::idem_runtime::Policy::new()
//!         .ttl(::core::time::Duration::from_millis(86400000u64))
//!         .handler("charge")
//!         .checked();
//!     let __idem_engine: ::idem_runtime::Engine = ::idem_runtime::Engine::clone(&(self.engine));
//!     let __idem_key = ::idem_runtime::RecordKey::new(
//!         ::std::string::ToString::to_string(&(msg.user)),
//!         ::std::string::ToString::to_string(&(msg.id)),
//!     );
//!     let __idem_e = match ::idem_runtime::Fingerprint::of_input(&(msg)) {
//!         Ok(__idem_fingerprint) => __idem_engine
//!             .once::<Receipt, _, _, _>(__idem_key, __idem_fingerprint, &__IDEM_POLICY,
//!                 move |attempt: ::idem_runtime::function::Attempt| async move {
//!                     let __idem_ret: Result<Receipt, ChargeError> = { BODY };
//!                     __idem_ret
//!                 })
//!             .await,
//!         Err(__idem_e) => Err(CallError::Once(OnceError::from(__idem_e))),
//!     };
//!     match __idem_e {
//!         Ok(output) => Ok(output),
//!         Err(::idem_runtime::function::CallError::Failed(__idem_e)) => Err(__idem_e),
//!         Err(::idem_runtime::function::CallError::Once(__idem_e)) =>
//!             Err(<ChargeError as From<::idem_runtime::function::OnceError>>::from(__idem_e)),
//!     }
//! }
//! ```
//!
//! Why each piece looks the way it does:
//! - `engine`, `scope`, `key` and `input` are evaluated first, each to an owned value, because
//!   they borrow the parameters that the body's `async move` block then moves (`self` included).
//!   `Engine::clone(&(..))` takes an `Engine`, a `&Engine` or an `Arc<Engine>` by deref coercion.
//! - Each expression keeps its own span, so a scope or key that is not `Display`, an input that is
//!   not `Serialize` or an engine of another type is reported at what the user wrote.
//! - `T` and `E` are written out as the signature gives them (`once::<T, ..>`, `<E as From<..>>`),
//!   so that an output that is not `Serialize` and an error without `From<OnceError>` are reported
//!   at the return type; the call and its `.await` are located there too, as each asks again.
//!   With an alias (`io::Result<T>`) the error type is inferred and reported at the attribute.
//! - An input that does not encode as JSON is the engine's error, through the same `From`.
//! - The body is `expand::body`'s, as in handler mode: its `?` and `return` leave the `async
//!   move` block with the function's declared `Result`.
//! - Only public paths of the runtime are named: function mode works without its `axum` feature.

use crate::attr::{Args, Written};
use crate::config::{self, Broken, Errors, Rule, Value};
use crate::expand::{body, generated};
use crate::options::{Applies, Opt};
use crate::policy::{policy, Paths};
use proc_macro2::{Span, TokenStream};
use quote::{quote_spanned, ToTokens};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Expr, FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, ReturnType, Type};

/// The validated attribute in function mode.
pub(crate) struct FnConfig {
    pub(crate) function: ItemFn,
    pub(crate) engine: Expr,
    pub(crate) scope: Expr,
    pub(crate) key: Expr,
    pub(crate) input: Expr,
    /// `attempt = <name>`: the name the body sees the `Attempt` by.
    pub(crate) attempt: Option<Ident>,
    /// `policy = PATH`: the base the written options override; else `Policy::new()`.
    pub(crate) base: Option<syn::Path>,
    /// The policy values the attribute states, in [`Opt::ALL`]'s order.
    pub(crate) values: Vec<(Opt, Value)>,
    /// Rules checked when the policy constant is evaluated.
    pub(crate) rules: Vec<Rule>,
}

/// Why an option of handlers does not apply to a function.
fn http_only(opt: Opt) -> &'static str {
    match opt {
        Opt::MissingKey | Opt::DeriveWindow | Opt::RejectAfter => {
            "a function's key is the `key` expression, always there: remove it"
        }
        Opt::Replay => {
            "a function's output is always stored and returned whole (it is no HTTP response): remove it"
        }
        Opt::ServerErrors | Opt::ClientErrors => {
            "a function's `Err` always releases the key; return a permanent failure as part of its `Ok` output to store it (`enum Charge { Captured(..), Declined(..) }`)"
        }
        Opt::KeyHeader | Opt::KeyField => {
            "a function's key is the `key` expression (there is no request to read it from): remove it"
        }
        Opt::FingerprintExclude | Opt::FingerprintOnly => {
            "a function's fingerprint is its `input`: pass the part that tells a retry from another call, like `input = (msg.amount, &msg.currency)`"
        }
        Opt::MaxBody => "a function has no request body to bound: remove it",
        _ => "the attribute does not write the transactional form of a function yet: call `idem_runtime::Transactional::once`, which hands the work a `Tx` whose writes commit with its output",
    }
}

/// Validates function mode's arguments (`key` is among them) against the function.
pub(crate) fn build(mut args: Args, item: TokenStream) -> syn::Result<FnConfig> {
    let mut errors = Errors::default();
    errors.0.append(&mut args.errors);
    let function = match syn::parse2::<ItemFn>(item) {
        Ok(f) => f,
        Err(e) => {
            let message = "`#[idempotent]` applies to an `async fn` (with `key = ...`, any async function returning `Result`)";
            errors.0.push(syn::Error::new(e.span(), message));
            return Err(config::combined(errors.0).unwrap_or(e));
        }
    };
    let name = function.sig.ident.unraw();
    for w in args
        .written
        .iter()
        .filter(|w| w.opt.applies() == Applies::Handlers)
    {
        let kw = &w.kw;
        let why = http_only(w.opt);
        errors.at(kw, format!("`{kw}` applies to axum handlers only, not to a plain function (`key = ...`): {why}"));
    }
    // The handler-only options are reported; the rules below must not see them again.
    args.written
        .retain(|w| w.opt.applies() != Applies::Handlers);
    let required = |opt: Opt, errors: &mut Errors, message: String| {
        let found = args.get(opt).map(|w| w.value.clone());
        if found.is_none() {
            errors.0.push(syn::Error::new(Span::call_site(), message));
        }
        found
    };
    let engine = required(Opt::Engine, &mut errors, "missing `engine`: a plain function takes its engine from an expression, like `engine = self.engine` or `engine = ENGINE` (an `Engine`, `&Engine` or `Arc<Engine>`)".into());
    let scope = required(Opt::Scope, &mut errors, format!("missing `scope`: keys are unique per scope, so give the expression that tells whose call this is (like `scope = msg.user`, any `Display`), or write `scope = \"{name}\"` to share keys between all calls of `{name}`"));
    let input = required(Opt::Input, &mut errors, "missing `input`: its fingerprint tells a retry of this call from another call that reuses its key (which then gets an error instead of the first call's output); name what the call acts on, like `input = msg` (any `Serialize`), or write `input = ()` to opt out of the check".into());
    let key = args.get(Opt::Key).map(|w| w.value.clone());
    if let Some(w) = args.get(Opt::Scope) {
        check_scope(w, &function, &mut errors);
    }
    let attempt = args
        .get(Opt::Attempt)
        .and_then(|w| attempt(w, &function, &mut errors));
    let base = args
        .get(Opt::Policy)
        .and_then(|w| config::policy_path(w, &mut errors));
    let values: Vec<(Opt, Value)> = [Opt::Ttl, Opt::Retain, Opt::Lease, Opt::Wait]
        .into_iter()
        .filter_map(|opt| Some((opt, config::value(args.get(opt)?, &mut errors)?)))
        .collect();
    let mut rules = config::rules(&args, &values, base.as_ref(), &mut errors);
    // `derive_window` means nothing to a function: only the rule between `ttl` and `retain` holds.
    rules.retain(|Rule(broken, ..)| matches!(broken, Broken::Policy("RetainShorterThanTtl")));
    check_signature(&function, &mut errors);
    match (config::combined(errors.0), engine, scope, key, input) {
        (None, Some(engine), Some(scope), Some(key), Some(input)) => Ok(FnConfig {
            function,
            engine,
            scope,
            key,
            input,
            attempt,
            base,
            values,
            rules,
        }),
        (Some(e), ..) => Err(e),
        // Each option left out was reported above, and `key` is what selected this mode.
        (None, ..) => Err(syn::Error::new(
            Span::call_site(),
            "`#[idempotent]` needs `engine`, `scope`, `key` and `input` on a plain function",
        )),
    }
}

/// A scope written as a string that names a parameter is the handler mode's habit: in function
/// mode it would be that text, the same for every call.
fn check_scope(w: &Written, function: &ItemFn, errors: &mut Errors) {
    let Some(lit) = config::literal(w) else {
        return;
    };
    let text = lit.value();
    if bound_names(function).any(|ident| ident.unraw() == text) {
        errors.at(&lit, format!("in a plain function, `scope` is an expression, and this string would be the same scope for every call: write `scope = {text}` to scope by the parameter's value (for the text itself, write `scope = (\"{text}\")`)"));
    }
}

/// `attempt = <name>`: a plain name, not one of the function's parameters (the body would lose it).
fn attempt(w: &Written, function: &ItemFn, errors: &mut Errors) -> Option<Ident> {
    let ident = match &w.value {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => p.path.get_ident().cloned(),
        _ => None,
    };
    let Some(ident) = ident else {
        errors.at(&w.value, "`attempt` takes the name the body calls the `Attempt` by, like `attempt = attempt`, then `attempt.downstream_key()` in the body");
        return None;
    };
    if bound_names(function).any(|param| param.unraw() == ident.unraw()) {
        let fn_name = &function.sig.ident;
        errors.at(&ident, format!("`{ident}` is already a parameter of `{fn_name}`, which the `Attempt` would hide in the body: choose another name, like `attempt = idem_attempt`"));
        return None;
    }
    Some(ident)
}

/// The names the parameters bind whole (`msg: Msg`, `mut msg: Msg`).
fn bound_names(function: &ItemFn) -> impl Iterator<Item = &Ident> {
    function.sig.inputs.iter().filter_map(|arg| match arg {
        FnArg::Typed(pt) => match &*pt.pat {
            Pat::Ident(pi) => Some(&pi.ident),
            _ => None,
        },
        FnArg::Receiver(_) => None,
    })
}

fn check_signature(function: &ItemFn, errors: &mut Errors) {
    let sig = &function.sig;
    let name = &sig.ident;
    if sig.asyncness.is_none() {
        errors.at(
            sig.fn_token,
            format!("`#[idempotent]` functions must be `async fn`: write `async fn {name}(...)`"),
        );
    }
    let result = "must return `Result<T, E>`: its `Ok` output is stored and returned to every retry, its `Err` releases the key for the next call; `T` must be `Serialize` and `DeserializeOwned`, and `E` must implement `From<idem_runtime::function::OnceError>` (the engine's errors)";
    match &sig.output {
        ReturnType::Default => errors.0.push(syn::Error::new(
            sig.paren_token.span.close(),
            format!("an `#[idempotent]` function {result}: add `-> Result<T, E>`"),
        )),
        ReturnType::Type(_, ty) if result_type(ty).is_none() => errors.at(
            ty,
            format!("an `#[idempotent]` function {result}; a type alias of `Result` must keep the name `Result`, like `io::Result<T>`"),
        ),
        ReturnType::Type(..) => {}
    }
}

/// `Result<T, E>` (or an alias of that name, like `io::Result<T>`): its type arguments, `T` and
/// `E` as far as written. `None` if the type is no `Result` at all.
fn result_type(ty: &Type) -> Option<Vec<&Type>> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let args = match &last.arguments {
        PathArguments::AngleBracketed(args) => args
            .args
            .iter()
            .filter_map(|arg| match arg {
                GenericArgument::Type(ty) => Some(ty),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    Some(args)
}

/// The function rewritten: the signature kept, the body run through `Engine::once`.
pub(crate) fn expand(config: FnConfig) -> TokenStream {
    let FnConfig {
        function,
        engine,
        scope,
        key,
        input,
        attempt,
        base,
        values,
        rules,
    } = config;
    let ItemFn {
        attrs,
        vis,
        sig,
        block,
    } = function;
    let def = Span::mixed_site();
    let name = sig.ident.unraw().to_string();
    let base = match base {
        Some(path) => path.into_token_stream(),
        None => quote_spanned!(def=> ::idem_runtime::Policy::new()),
    };
    let paths = Paths {
        module: quote_spanned!(def=> ::idem_runtime::policy),
        duration: quote_spanned!(def=> ::core::time::Duration),
    };
    let policy = policy(&paths, &base, &name, false, &values, &rules);
    let [policy_const, engine_var, key_var, fingerprint_var, e] = [
        "__IDEM_POLICY",
        "__idem_engine",
        "__idem_key",
        "__idem_fingerprint",
        "__idem_e",
    ]
    .map(generated);
    let attempt = match attempt {
        Some(ident) => ident.into_token_stream(),
        None => quote_spanned!(def=> _),
    };
    let f = quote_spanned!(def=> ::idem_runtime::function);
    // `T` and `E` as written, so that an output that is not `Serialize` and an error without
    // `From<OnceError>` are reported there (an alias like `io::Result<T>` leaves `E` inferred).
    let (output, error) = match &sig.output {
        ReturnType::Type(_, ty) => match result_type(ty).as_deref() {
            Some([output, error, ..]) => (Some(*output), Some(*error)),
            Some([output]) => (Some(*output), None),
            _ => (None, None),
        },
        ReturnType::Default => (None, None),
    };
    let (once, at_output) = match output {
        Some(t) if !t.to_token_stream().to_string().contains("impl ") => (
            quote_spanned!(def=> once::<#t, _, _, _>),
            def.located_at(t.span()),
        ),
        _ => (quote_spanned!(def=> once), def),
    };
    let from_once_error = match error {
        Some(error) => {
            quote_spanned!(def=> <#error as ::core::convert::From<#f::OnceError>>::from(#e))
        }
        None => quote_spanned!(def=> ::core::convert::From::from(#e)),
    };
    let body = body(&sig.output, &block);
    let work = quote_spanned!(def=> move |#attempt: #f::Attempt| async move #body);
    // The call and its `.await` at `T` too: each asks again for `T: Serialize`.
    // The receiver located there as well: the call expression spans from it.
    let receiver = Ident::new("__idem_engine", at_output);
    let call = quote_spanned!(at_output=> #receiver.#once(#key_var, #fingerprint_var, &#policy_const, #work).await);
    let engine = quote_spanned!(engine.span()=> ::idem_runtime::Engine::clone(&(#engine)));
    let to_string =
        |expr: &Expr| quote_spanned!(expr.span()=> ::std::string::ToString::to_string(&(#expr)));
    let (scope, key) = (to_string(&scope), to_string(&key));
    let fingerprint =
        quote_spanned!(input.span()=> ::idem_runtime::Fingerprint::of_input(&(#input)));
    let block = quote_spanned! {def=> {
        const #policy_const: ::idem_runtime::Policy = #policy;
        let #engine_var: ::idem_runtime::Engine = #engine;
        let #key_var = ::idem_runtime::RecordKey::new(#scope, #key);
        // An input that does not encode is the engine's error, returned as the others are.
        let #e = match #fingerprint {
            ::core::result::Result::Ok(#fingerprint_var) => {
                #call
            }
            ::core::result::Result::Err(#e) => ::core::result::Result::Err(#f::CallError::Once(#f::OnceError::from(#e))),
        };
        match #e {
            ::core::result::Result::Ok(output) => ::core::result::Result::Ok(output),
            ::core::result::Result::Err(#f::CallError::Failed(#e)) => ::core::result::Result::Err(#e),
            ::core::result::Result::Err(#f::CallError::Once(#e)) => ::core::result::Result::Err(#from_once_error),
        }
    }};
    quote_spanned! {def=>
        #(#attrs)*
        #vis #sig #block
    }
}

#[cfg(test)]
mod tests {
    use crate::options::{Applies, Opt};
    use quote::quote;

    fn build(
        args: proc_macro2::TokenStream,
        item: proc_macro2::TokenStream,
    ) -> Result<super::FnConfig, Vec<String>> {
        super::build(crate::attr::parse(args), item)
            .map_err(|e| e.into_iter().map(|e| e.to_string()).collect())
    }

    fn charge() -> proc_macro2::TokenStream {
        quote!(
            async fn charge(&self, msg: Msg) -> Result<Receipt, ChargeError> {
                todo!()
            }
        )
    }

    fn errors(args: proc_macro2::TokenStream) -> Vec<String> {
        build(args, charge()).err().unwrap_or_default()
    }

    #[test]
    fn every_option_of_handlers_only_is_refused_with_its_reason() {
        for &opt in Opt::ALL {
            let name = syn::Ident::new(opt.name(), proc_macro2::Span::call_site());
            let e = errors(
                quote!(engine = self.engine, scope = msg.user, key = msg.id, input = msg, #name = "x"),
            );
            match opt.applies() {
                Applies::Handlers => {
                    assert_eq!(e.len(), 1, "{e:?}");
                    let prefix = format!("`{name}` applies to axum handlers only");
                    assert!(e[0].starts_with(&prefix), "{e:?}");
                    assert!(!super::http_only(opt).is_empty());
                }
                // Given twice, or given a string where an expression or a duration is expected:
                // never refused as an option of another mode.
                _ => assert!(
                    e.iter()
                        .all(|e| !e.contains("applies to axum handlers only")),
                    "{e:?}"
                ),
            }
        }
    }

    #[test]
    fn the_required_expressions_are_asked_for_at_once() {
        let e = errors(quote!(key = msg.id));
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e[0].starts_with("missing `engine`"), "{e:?}");
        assert!(e[1].starts_with("missing `scope`"), "{e:?}");
        assert!(e[1].contains("`scope = \"charge\"`"), "{e:?}");
        assert!(e[2].starts_with("missing `input`"), "{e:?}");
        assert!(e[2].contains("`input = ()` to opt out"), "{e:?}");
    }

    #[test]
    fn the_signature_is_an_async_fn_returning_result() {
        let args = quote!(engine = ENGINE, scope = "jobs", key = id, input = ());
        let e = build(
            args.clone(),
            quote!(
                fn run(id: u32) -> Result<u8, E> {
                    todo!()
                }
            ),
        );
        assert!(e.err().unwrap_or_default()[0].contains("must be `async fn`"));
        let e = build(
            args.clone(),
            quote!(
                async fn run(id: u32) -> u8 {
                    1
                }
            ),
        );
        assert!(e.err().unwrap_or_default()[0].contains("must return `Result<T, E>`"));
        let ok = |item| build(args.clone(), item).is_ok();
        assert!(ok(quote!(
            async fn run(id: u32) -> io::Result<u8> {
                todo!()
            }
        )));
        assert!(ok(quote!(
            async fn run<T: Send>(self, id: T) -> Result<u8, E> {
                todo!()
            }
        )));
    }

    #[test]
    fn attempt_is_a_new_name_and_scope_no_parameters_name() {
        let e = errors(quote!(
            engine = e,
            scope = msg.user,
            key = msg.id,
            input = msg,
            attempt = msg
        ));
        assert!(
            e[0].starts_with("`msg` is already a parameter of `charge`"),
            "{e:?}"
        );
        let e = errors(quote!(engine = e, scope = "msg", key = msg.id, input = msg));
        assert!(e[0].contains("write `scope = msg`"), "{e:?}");
        assert!(errors(quote!(
            engine = e,
            scope = "billing",
            key = msg.id,
            input = msg
        ))
        .is_empty());
    }

    #[test]
    fn the_expansion_evaluates_the_expressions_before_the_body_runs() {
        let args = quote!(
            engine = self.engine,
            scope = msg.user,
            key = msg.id,
            input = msg,
            attempt = attempt,
            ttl = "1h"
        );
        let Ok(config) = build(args, charge()) else {
            panic!("refused")
        };
        let out = super::expand(config).to_string();
        let at = |text: &str| {
            out.find(text)
                .unwrap_or_else(|| panic!("no `{text}` in {out}"))
        };
        assert!(out.contains(":: idem_runtime :: Policy :: new () . ttl (:: core :: time :: Duration :: from_millis (3600000u64)) . handler (\"charge\") . checked ()"), "{out}");
        let order = [
            ":: idem_runtime :: Engine :: clone (& (self . engine))",
            ":: std :: string :: ToString :: to_string (& (msg . user))",
            ":: std :: string :: ToString :: to_string (& (msg . id))",
            ":: idem_runtime :: Fingerprint :: of_input (& (msg))",
            "move | attempt : :: idem_runtime :: function :: Attempt | async move",
            "let __idem_ret : Result < Receipt , ChargeError > =",
        ]
        .map(at);
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{out}");
        assert!(
            !out.contains("__private"),
            "function mode names public paths only: {out}"
        );
    }
}
