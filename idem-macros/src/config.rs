//! Validation: raw [`Args`] plus the handler become a [`Config`] the expansion can trust.
//!
//! Every check reports on the token the user wrote (the literal, the keyword, the `fn` token), and
//! every check runs even after an earlier one failed: the errors are folded into one.
//!
//! Only what the attribute states is judged here. A rule between options that may involve a value
//! the attribute leaves to the policy (`Policy::new()`'s defaults, or a named `policy`) becomes a
//! [`Rule`], checked when the policy constant is evaluated and reported at the option it concerns:
//! the runtime's defaults are read from the runtime, never copied here.

use crate::attr::{Args, Written};
use crate::options::{Applies, Kind, Opt};
use crate::values::{self, format_ms, Bad, Choice};
use proc_macro2::{Span, TokenStream, TokenTree};
use quote::ToTokens;
use std::time::Duration;
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Expr, FnArg, Ident, ItemFn, Lit, LitStr, Pat, PatIdent, PatType, Signature, Type};

/// The runtime's `MAX_TTL`: one year, leap day included.
const YEAR_MS: u64 = 366 * 24 * 3_600_000;
/// The largest `max_body`: bodies are buffered in memory, so more is almost surely a unit mistake.
const MAX_BODY: u64 = 1 << 30;
/// axum implements `Handler` for up to 16 extractors.
const MAX_PARAMS: usize = 16;

/// The validated attribute: what the expansion needs, nothing it has to check.
pub(crate) struct Config {
    pub(crate) handler: ItemFn,
    pub(crate) scope: ScopeSource,
    /// `transaction = "<parameter>"`: the index of that parameter in the signature.
    pub(crate) transaction: Option<usize>,
    /// `policy = PATH`: the base the written options override; else `Policy::new()`.
    pub(crate) base: Option<syn::Path>,
    /// The policy values the attribute states, in [`Opt::ALL`]'s order.
    pub(crate) values: Vec<(Opt, Value)>,
    /// Rules checked when the policy constant is evaluated.
    pub(crate) rules: Vec<Rule>,
}

/// Where the scope id comes from.
pub(crate) enum ScopeSource {
    /// `scope = "global"`.
    Global,
    /// A parameter bound to this name, whose type is at this span.
    Param(Ident, Span),
}

/// One policy value, typed. A choice is a variant of the runtime's enum named first.
pub(crate) enum Value {
    Duration(Duration),
    /// A variant of the runtime's enum `ty`.
    Choice(&'static str, &'static Choice),
    /// `reject_after`: milliseconds since the Unix epoch of the date's midnight UTC.
    Date(i64),
    /// `max_body`, in bytes.
    Size(usize),
    /// `key_header` (lower-cased) or `key_field`.
    Str(String),
    /// `fingerprint_exclude` or `fingerprint_only`: each pointer and where it was written.
    Strs(Vec<(String, Span)>),
}

/// A rule between options, checked on the final policy: when it is broken, the message is
/// reported at the span.
pub(crate) struct Rule(pub(crate) Broken, pub(crate) Span, pub(crate) String);

/// How the expansion tells a [`Rule`] is broken.
pub(crate) enum Broken {
    /// `Policy::validate` returns this `PolicyError` variant.
    Policy(&'static str),
    /// The policy's `missing_key` is not this `MissingKey` variant.
    MissingKeyIsNot(&'static str),
}

/// Errors folded into one (`syn::Error::combine`).
#[derive(Default)]
pub(crate) struct Errors(pub(crate) Vec<syn::Error>);

impl Errors {
    pub(crate) fn at(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.0.push(syn::Error::new_spanned(tokens, message));
    }
}

/// Parses and validates the attribute arguments against the handler.
#[cfg(test)]
pub(crate) fn build(args: TokenStream, item: TokenStream) -> syn::Result<Config> {
    build_parsed(crate::attr::parse(args), item)
}

/// Validates the parsed attribute arguments against the handler.
pub(crate) fn build_parsed(mut args: Args, item: TokenStream) -> syn::Result<Config> {
    let mut errors = Errors::default();
    let handler = match syn::parse2::<ItemFn>(item) {
        Ok(f) => f,
        Err(e) => {
            let message = "`#[idempotent]` applies to an `async fn` axum handler";
            errors.0.push(syn::Error::new(e.span(), message));
            return Err(combined(errors.0).unwrap_or(e));
        }
    };
    errors.0.append(&mut args.errors);
    for w in args
        .written
        .iter()
        .filter(|w| w.opt.applies() == Applies::Functions)
    {
        let kw = &w.kw;
        errors.at(kw, format!("`{kw}` applies to plain async functions only, which `key = ...` selects; {}", match w.opt {
            Opt::Engine => "a handler takes its engine from the router state (`FromRef`): remove `engine`",
            Opt::Input => "a handler's fingerprint is its request (see `fingerprint_exclude`, `fingerprint_only`): remove `input`",
            _ => "a handler takes its `Attempt` as an extractor parameter (`attempt: idem_runtime::axum::Attempt`): remove `attempt`",
        }));
    }

    check_signature(&handler.sig, &mut errors);
    let sig = &handler.sig;
    let scope = resolve_scope(args.get(Opt::Scope), sig, &mut errors);
    let transaction = args
        .get(Opt::Transaction)
        .and_then(|w| resolve_transaction(w, sig, scope.as_ref(), &mut errors));
    let base = args
        .get(Opt::Policy)
        .and_then(|w| policy_path(w, &mut errors));
    // The options that are values (`scope`, `transaction` and `policy` name code, resolved above).
    let values: Vec<(Opt, Value)> = Opt::ALL
        .iter()
        .filter(|opt| {
            !matches!(
                opt.kind(),
                Kind::Param | Kind::Path | Kind::Expr | Kind::Ident
            )
        })
        .filter_map(|&opt| Some((opt, value(args.get(opt)?, &mut errors)?)))
        .collect();
    let rules = rules(&args, &values, base.as_ref(), &mut errors);
    check_sources(&args, &values, &mut errors);
    if let (Some(ScopeSource::Global), Some(w)) = (&scope, args.get(Opt::MissingKey)) {
        if matches!(choice(&values, Opt::MissingKey), Some("Derive")) {
            errors.at(&w.value, "`missing_key = \"derive\"` cannot be used with `scope = \"global\"`: two callers sending the identical request within `derive_window` would share one execution and one response; scope the handler to its caller (`scope = \"<parameter>\"`), or use `missing_key = \"pass\"` or \"reject\"");
        }
    }
    match combined(errors.0) {
        Some(e) => Err(e),
        None => Ok(Config {
            handler,
            scope: scope.unwrap_or(ScopeSource::Global),
            transaction,
            base,
            values,
            rules,
        }),
    }
}

/// The rules between options, each at the option the attribute states (or none, if the attribute
/// states neither side: then `Policy::checked` reports it at the named policy).
pub(crate) fn rules(
    args: &Args,
    values: &[(Opt, Value)],
    base: Option<&syn::Path>,
    errors: &mut Errors,
) -> Vec<Rule> {
    // A valid option as written, and its text.
    let valid = |opt| {
        args.get(opt)
            .filter(|_| values.iter().any(|(o, _)| *o == opt))
    };
    let text = |opt| valid(opt).and_then(literal).map(|lit| lit.value());
    let rule = |error, w: &Written, message| Rule(Broken::Policy(error), w.value.span(), message);
    // How messages name a value the attribute does not state.
    let policy_s = |name: &str| match base {
        Some(path) => format!("the `{name}` of `{}`", compact(&path.to_token_stream())),
        None => format!("the default `{name}`"),
    };
    let ttl = text(Opt::Ttl);
    let ttl_named = ttl
        .as_ref()
        .map_or_else(|| policy_s("ttl"), |t| format!("`ttl` ({t})"));
    let mut rules = Vec::new();
    if let (Some(w), Some(retain)) = (valid(Opt::Retain), text(Opt::Retain)) {
        let fix = ttl.as_ref().map_or("raise it".into(), |t| {
            format!("use `retain = \"{t}\"` or more")
        });
        let message = format!("`retain` ({retain}) must be at least {ttl_named}: tombstones outlive the keys they remember; {fix}, or leave `retain` out (it is then at least `ttl`)");
        rules.push(rule("RetainShorterThanTtl", w, message));
    }
    // With no `derive_window` written, a `ttl` may be shorter than the policy's; that matters only
    // where `missing_key` may be "derive" (elsewhere `Policy::checked` is the safety net).
    let may_derive = choice(values, Opt::MissingKey).map_or(base.is_some(), |c| c == "Derive");
    if let (Some(w), Some(window)) = (valid(Opt::DeriveWindow), text(Opt::DeriveWindow)) {
        let fix = ttl.as_ref().map_or("a shorter one".into(), |t| {
            format!("`derive_window = \"{t}\"` or less")
        });
        let message = format!("`derive_window` ({window}) must not exceed {ttl_named}: a derived key cannot outlive the record; use {fix} (a few seconds is typical: it catches double taps)");
        rules.push(rule("DeriveWindowLongerThanTtl", w, message));
    } else if let (Some(w), Some(t), true) = (valid(Opt::Ttl), &ttl, may_derive) {
        let window = policy_s("derive_window");
        let message =
            format!("`ttl` ({t}) is shorter than {window}: add `derive_window = \"{t}\"` or less");
        rules.push(rule("DeriveWindowLongerThanTtl", w, message));
    }
    // An option that applies only with one `missing_key`. When the attribute states another, it
    // is an error now; when it states none, the policy's is checked.
    let reject_after = " (pass requests without a key until the date, reject them from it)";
    for (opt, needs, variant, what) in [
        (Opt::DeriveWindow, "derive", "Derive", ""),
        (Opt::RejectAfter, "pass", "Pass", reject_after),
    ] {
        let Some(w) = args.get(opt) else { continue };
        let name = opt.name();
        let message = format!("`{name}` only applies with `missing_key = \"{needs}\"`{what}: add `missing_key = \"{needs}\"`, or remove `{name}`");
        match choice(values, Opt::MissingKey) {
            Some(written) if written != variant => errors.at(&w.kw, message),
            Some(_) => {}
            None => rules.push(Rule(Broken::MissingKeyIsNot(variant), w.kw.span(), message)),
        }
    }
    rules
}

/// The key's source and the fingerprint's coverage: one of each, and the key field never in its
/// own fingerprint.
fn check_sources(args: &Args, values: &[(Opt, Value)], errors: &mut Errors) {
    for (first, second, what) in [
        (Opt::KeyHeader, Opt::KeyField, "a handler reads its key from one place: a header (`key_header`) or a body field (`key_field`), not both; remove one"),
        (Opt::FingerprintExclude, Opt::FingerprintOnly, "`fingerprint_exclude` and `fingerprint_only` cannot be combined: name the members that count (`fingerprint_only`), or the ones that do not (`fingerprint_exclude`); remove one"),
    ] {
        if let (Some(_), Some(w)) = (args.get(first), args.get(second)) {
            errors.at(&w.kw, what);
        }
    }
    let key_field = values.iter().find_map(|(opt, v)| match (opt, v) {
        (Opt::KeyField, Value::Str(pointer)) => Some(pointer),
        _ => None,
    });
    let only = values.iter().find_map(|(opt, v)| match (opt, v) {
        (Opt::FingerprintOnly, Value::Strs(pointers)) => Some(pointers),
        _ => None,
    });
    if let (Some(key), Some(only)) = (key_field, only) {
        for (pointer, at) in only.iter().filter(|(p, _)| p == key) {
            errors.0.push(syn::Error::new(*at, format!("\"{pointer}\" is the `key_field`, which is never part of its own fingerprint (a retry keeps its key, a new request has another): remove it from `fingerprint_only`")));
        }
    }
}

/// `fingerprint_exclude = ["/a", "/b"]` (or one string): each pointer, checked, at its literal.
fn pointers(w: &Written, errors: &mut Errors) -> Option<Value> {
    let name = w.opt.name();
    let lits: Vec<LitStr> = match &w.value {
        Expr::Array(array) => {
            let mut lits = Vec::new();
            for elem in &array.elems {
                match syn::parse2::<LitStr>(elem.to_token_stream()) {
                    Ok(lit) => lits.push(lit),
                    Err(_) => errors.at(
                        elem,
                        format!(
                            "`{name}` lists JSON Pointers as string literals, like `\"/sent_at\"`"
                        ),
                    ),
                }
            }
            if array.elems.is_empty() {
                errors.at(&w.value, format!("`{name}` needs at least one JSON Pointer, like `{name} = [\"{}\"]`; or leave it out", w.opt.example()));
                return None;
            }
            lits
        }
        _ => match literal(w) {
            Some(lit) => vec![lit],
            None => {
                errors.at(
                    &w.value,
                    format!(
                        "`{name}` takes a list of JSON Pointers: write `{name} = [\"{}\"]`",
                        w.opt.example()
                    ),
                );
                return None;
            }
        },
    };
    let mut out: Vec<(String, Span)> = Vec::new();
    let before = errors.0.len();
    for lit in lits {
        let text = lit.value();
        if let Some(message) = pointer_error(name, &text) {
            errors.at(&lit, message);
        } else if out.iter().any(|(p, _)| *p == text) {
            errors.at(
                &lit,
                format!("\"{text}\" is already listed in `{name}`; keep one"),
            );
        } else {
            out.push((text, lit.span()));
        }
    }
    (errors.0.len() == before).then_some(Value::Strs(out))
}

/// Why `text` is no JSON Pointer to a member, in `option`'s words.
fn pointer_error(option: &str, text: &str) -> Option<String> {
    let like = "a JSON Pointer (RFC 6901) like \"/id\" or \"/data/request_id\"";
    match crate::names::parse_pointer(text) {
        Ok(()) => None,
        Err(Bad::DidYouMean(s)) => {
            Some(format!("`{option}` expects {like}; did you mean \"{s}\"?"))
        }
        Err(Bad::Note(note)) => Some(format!("invalid `{option}` \"{text}\": {note}")),
        Err(_) => Some(format!("`{option}` expects {like}, found \"{text}\"")),
    }
}

/// Every error, in one.
pub(crate) fn combined(errors: Vec<syn::Error>) -> Option<syn::Error> {
    errors.into_iter().reduce(|mut all, e| {
        all.combine(e);
        all
    })
}

/// The variant the attribute gives `opt`, a choice.
fn choice(values: &[(Opt, Value)], opt: Opt) -> Option<&'static str> {
    values.iter().find_map(|(o, v)| match v {
        Value::Choice(_, choice) if *o == opt => Some(choice.variant),
        _ => None,
    })
}

/// A value option's value, if it is valid.
pub(crate) fn value(w: &Written, errors: &mut Errors) -> Option<Value> {
    let name = w.opt.name();
    let kind = w.opt.kind();
    if let Kind::Pointers = kind {
        return pointers(w, errors);
    }
    let lit = string(w, errors)?;
    let text = lit.value();
    // A literal the parser refused, given what the option expects.
    let refused = |bad, like: &str| match bad {
        Bad::Unrecognized => format!("`{name}` expects {like}, found \"{text}\""),
        Bad::DidYouMean(s) => format!("`{name}` expects {like}; did you mean \"{s}\"?"),
        Bad::Note(note) => format!("invalid `{name}` \"{text}\": {note}"),
        Bad::TooLarge => format!("`{name}` \"{text}\" is too large"),
    };
    let message = match kind {
        Kind::Duration { ms, zero, year } => match values::parse_duration(&text, ms) {
            Ok(0) if zero.is_some() => format!("`{name}` must be greater than zero{}", zero.unwrap_or_default()),
            Ok(n) if year && n > YEAR_MS => format!("`{name}` must be at most {} (one year), found {}: a longer value is almost certainly a unit mistake", format_ms(YEAR_MS), format_ms(n)),
            Ok(n) => return Some(Value::Duration(Duration::from_millis(n))),
            Err(bad) => {
                let units = if ms { "ms, s, m, h or d" } else { "s, m, h or d" };
                refused(bad, &format!("a duration like \"24h\" (a whole number followed by {units})"))
            }
        },
        Kind::Choice(ty, choices) => match values::parse_choice(&text, choices) {
            Ok(choice) => return Some(Value::Choice(ty, choice)),
            Err(hint) => {
                let mut list: Vec<String> = choices.iter().map(|c| format!("\"{}\" ({})", c.value, c.meaning)).collect();
                let last = list.pop().unwrap_or_default();
                let hint = hint.map(|h| format!("; did you mean \"{h}\"?")).unwrap_or_default();
                format!("`{name}` must be {} or {last}{hint}", list.join(", "))
            }
        },
        Kind::Date => match values::parse_date(&text) {
            Ok(ms) => return Some(Value::Date(ms)),
            Err(bad) => refused(bad, "a date written YYYY-MM-DD, like \"2027-03-01\""),
        },
        Kind::Size => match values::parse_size(&text) {
            Ok(0) => format!("`{name}` must be greater than zero"),
            Ok(n) if n > MAX_BODY => format!("`{name}` must be at most \"1GiB\": request bodies are buffered in memory"),
            Ok(n) => return usize::try_from(n).ok().map(Value::Size),
            Err(bad) => refused(bad, "a size like \"1MiB\" (a whole number followed by B, KiB, MiB or GiB)"),
        },
        Kind::Header => match crate::names::parse_header(&text) {
            Ok(name) if name == "idempotency-key" => format!("`{name}` is where keys come from by default: remove `key_header`"),
            Ok(name) => return Some(Value::Str(name)),
            Err(Bad::DidYouMean(s)) => format!("`key_header` expects a header name like \"webhook-id\"; did you mean \"{s}\"?"),
            Err(Bad::Note(note)) => format!("invalid `key_header` \"{text}\": {note}"),
            Err(_) => format!("`key_header` expects a header name like \"webhook-id\", found \"{text}\""),
        },
        Kind::Pointer => match pointer_error(name, &text) {
            None => return Some(Value::Str(text)),
            Some(message) => message,
        },
        Kind::Param | Kind::Path | Kind::Pointers | Kind::Expr | Kind::Ident => return None,
    };
    errors.at(&lit, message);
    None
}

/// The string literal an option was given, if it was one.
pub(crate) fn literal(w: &Written) -> Option<LitStr> {
    syn::parse2(w.value.to_token_stream()).ok()
}

/// The string literal of an option, or an error suggesting the quoted form.
fn string(w: &Written, errors: &mut Errors) -> Option<LitStr> {
    if let Some(lit) = literal(w) {
        return Some(lit);
    }
    let written = match &w.value {
        Expr::Lit(e) if matches!(e.lit, Lit::Int(_) | Lit::Float(_)) => {
            e.lit.to_token_stream().to_string()
        }
        Expr::Path(p) if p.path.get_ident().is_some() => p.path.to_token_stream().to_string(),
        _ => w.opt.example().to_string(),
    };
    let name = w.opt.name();
    errors.at(
        &w.value,
        format!("`{name}` takes a string literal: write `{name} = \"{written}\"`"),
    );
    None
}

pub(crate) fn policy_path(w: &Written, errors: &mut Errors) -> Option<syn::Path> {
    match &w.value {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => return Some(p.path.clone()),
        Expr::Lit(syn::ExprLit { lit: Lit::Str(s), .. }) => errors.at(
            s,
            format!("`policy` takes the path of a `const` policy, not a string: write `policy = {}`", s.value()),
        ),
        other => errors.at(other, "`policy` takes the path of a `const` `Policy`: declare `const PAYMENTS: Policy = Policy::new().ttl(...);` once and write `policy = PAYMENTS`"),
    }
    None
}

fn check_signature(sig: &Signature, errors: &mut Errors) {
    let name = &sig.ident;
    if sig.asyncness.is_none() {
        errors.at(
            sig.fn_token,
            format!("`#[idempotent]` handlers must be `async fn`: write `async fn {name}(...)`"),
        );
    }
    if let Some(FnArg::Receiver(receiver)) = sig.inputs.first() {
        errors.at(receiver, "an `#[idempotent]` handler cannot take `self`: axum passes handlers only extractors; make it a free function (or an associated function without `self`) and reach shared data through `State`");
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.at(&sig.generics, "`#[idempotent]` handlers cannot be generic: each handler gets its own constant policy; use concrete types (the handler can call a generic helper)");
    }
    if sig.inputs.len() > MAX_PARAMS {
        errors.at(&sig.inputs, format!("an `#[idempotent]` handler takes at most {MAX_PARAMS} parameters, as axum handlers take at most {MAX_PARAMS} extractors: group extractors into a struct that implements `FromRequestParts`"));
    }
    // The expansion binds the last parameter apart from the others, where rustc would no longer
    // see a name bound twice (E0415): report it as rustc would have.
    let mut bound: Vec<&Ident> = Vec::new();
    for arg in &sig.inputs {
        if let FnArg::Typed(pt) = arg {
            bindings(&pt.pat, &mut bound);
        }
    }
    for (i, ident) in bound.iter().enumerate() {
        if bound[..i]
            .iter()
            .any(|earlier| earlier.unraw() == ident.unraw())
        {
            errors.at(
                ident,
                format!("identifier `{ident}` is bound more than once in this parameter list"),
            );
        }
    }
}

/// The names `pat` binds.
fn bindings<'p>(pat: &'p Pat, out: &mut Vec<&'p Ident>) {
    match pat {
        Pat::Ident(pi) => {
            out.push(&pi.ident);
            if let Some((_, sub)) = &pi.subpat {
                bindings(sub, out);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| bindings(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| bindings(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| bindings(&f.pat, out)),
        Pat::Slice(s) => s.elems.iter().for_each(|p| bindings(p, out)),
        Pat::Reference(r) => bindings(&r.pat, out),
        Pat::Paren(p) => bindings(&p.pat, out),
        Pat::Type(t) => bindings(&t.pat, out),
        _ => {}
    }
}

/// The parameters bound whole to a name: `user: AuthUser`, `mut user: AuthUser`, `ref user: ..`.
fn named(sig: &Signature) -> impl Iterator<Item = (usize, &PatIdent, &PatType)> {
    sig.inputs
        .iter()
        .enumerate()
        .filter_map(|(i, arg)| match arg {
            FnArg::Typed(pt) => match &*pt.pat {
                Pat::Ident(pi) if pi.subpat.is_none() => Some((i, pi, pt)),
                _ => None,
            },
            FnArg::Receiver(_) => None,
        })
}

/// The parameter an option names: its index, binding and type; else an error at the option.
/// `example` shows a parameter of the right kind.
fn find_param<'s>(
    w: &Written,
    sig: &'s Signature,
    example: &str,
    errors: &mut Errors,
) -> Option<(usize, &'s PatIdent, &'s PatType, String)> {
    let lit = string(w, errors)?;
    let written = lit.value();
    let wanted = written.strip_prefix("r#").unwrap_or(&written).to_string();
    if let Some((i, pi, pt)) = named(sig).find(|(_, pi, _)| pi.ident.unraw() == wanted) {
        if pi.by_ref.is_some() {
            let option = w.opt.name();
            errors.at(
                &pt.pat,
                format!("the `{option}` parameter must bind by value: remove `ref`"),
            );
            return None;
        }
        return Some((i, pi, pt, wanted));
    }
    let fn_name = sig.ident.unraw();
    let names: Vec<String> = named(sig)
        .map(|(_, pi, _)| pi.ident.unraw().to_string())
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let nested = sig
        .inputs
        .iter()
        .any(|arg| matches!(arg, FnArg::Typed(pt) if binds(&pt.pat.to_token_stream(), &wanted)));
    let name = w.opt.name();
    let message = if nested {
        format!("`{wanted}` is destructured from a parameter pattern of `{fn_name}`; `{name}` must name a parameter bound whole, like {example}")
    } else {
        let hint = values::closest(&wanted, &refs).map(|c| format!("did you mean `{c}`? "));
        match (w.opt, hint) {
            (Opt::Scope, _) if names.is_empty() => format!("`{wanted}` is not a parameter of `{fn_name}`, which has no parameter bound to a plain name; add one that identifies the caller (like `user: AuthUser`), or write `scope = \"global\"`"),
            (Opt::Scope, hint) => format!(
                "`{wanted}` is not a parameter of `{fn_name}`; {}its parameters bound to a name are: {} (or write `scope = \"global\"` to opt out of per-caller keys)",
                hint.unwrap_or_default(),
                names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
            ),
            (_, Some(hint)) => format!("`{wanted}` is not a parameter of `{fn_name}`; {}", hint.trim_end()),
            (_, None) => format!("`{wanted}` is not a parameter of `{fn_name}`: add the transaction parameter, like {example}, and run the handler's queries on it"),
        }
    };
    errors.at(&lit, message);
    None
}

fn resolve_scope(w: Option<&Written>, sig: &Signature, errors: &mut Errors) -> Option<ScopeSource> {
    let Some(w) = w else {
        let example = match named(sig).next() {
            Some((_, pi, pt)) => {
                let (name, ty) = (pi.ident.unraw(), pt.ty.to_token_stream());
                format!("`scope = \"{name}\"` if `{ty}` identifies the caller")
            }
            None => "`scope = \"<parameter>\"`".into(),
        };
        let message = format!("missing `scope`: keys are unique per caller, so name the parameter that identifies the caller ({example}), or write `scope = \"global\"` to share keys between all callers");
        errors.0.push(syn::Error::new(Span::call_site(), message));
        return None;
    };
    let example = "`user: AuthUser` (its type implements `idem_runtime::axum::Scope`)";
    let written = literal(w).map(|lit| lit.value()).unwrap_or_default();
    if written.strip_prefix("r#").unwrap_or(&written) == "global" {
        return Some(ScopeSource::Global);
    }
    let (_, pi, pt, _) = find_param(w, sig, example, errors)?;
    Some(ScopeSource::Param(pi.ident.clone(), pt.ty.span()))
}

/// The index of the parameter `transaction = "..."` names. Its type is checked by the compiler
/// (the runtime's `TxHandle` trait, whose message lists the accepted types); here only what the
/// compiler could not explain well: a name that is no parameter, a pattern, `ref`, a reference.
fn resolve_transaction(
    w: &Written,
    sig: &Signature,
    scope: Option<&ScopeSource>,
    errors: &mut Errors,
) -> Option<usize> {
    let example = "`tx: idem_runtime::Tx<idem_runtime::sqlx::Postgres>` (or `Sqlite`, `MySql`)";
    let (index, pi, pt, wanted) = find_param(w, sig, example, errors)?;
    if let Some(ScopeSource::Param(ident, _)) = scope {
        if ident.unraw() == wanted {
            let message = format!("`{wanted}` is already the `scope` parameter; the transaction needs a parameter of its own, like {example}");
            errors.at(&w.value, message);
            return None;
        }
    }
    if let Type::Reference(r) = &*pt.ty {
        let (tx, ty) = (&pi.ident, compact(&r.elem.to_token_stream()));
        errors.at(r, format!("the `transaction` parameter takes the transaction by value: write `{tx}: {ty}` and run queries on `{tx}.conn().await?`"));
        return None;
    }
    Some(index)
}

/// Tokens as written, without the spaces `to_string` puts between them.
pub(crate) fn compact(tokens: &TokenStream) -> String {
    tokens.to_string().replace(' ', "")
}

/// Whether `pat` mentions `name` anywhere inside (binds it, or names a field so).
fn binds(pat: &TokenStream, name: &str) -> bool {
    pat.clone().into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident.unraw() == name,
        TokenTree::Group(group) => binds(&group.stream(), name),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use quote::quote;

    fn build(args: proc_macro2::TokenStream) -> Result<super::Config, Vec<String>> {
        let item = quote!(
            async fn create(user: AuthUser, body: String) -> String {
                body
            }
        );
        super::build(args, item).map_err(|e| e.into_iter().map(|e| e.to_string()).collect())
    }

    fn errors(args: proc_macro2::TokenStream) -> Vec<String> {
        build(args).err().unwrap_or_default()
    }

    fn rules(args: proc_macro2::TokenStream) -> Vec<String> {
        match build(args) {
            Ok(config) => config.rules.into_iter().map(|r| r.2).collect(),
            Err(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn rules_on_values_the_attribute_leaves_to_the_policy_are_checked_on_the_policy() {
        let r = rules(quote!(scope = "user", ttl = "5s", missing_key = "derive"));
        assert_eq!(r, ["`ttl` (5s) is shorter than the default `derive_window`: add `derive_window = \"5s\"` or less"]);
        let r = rules(quote!(scope = "user", policy = crate::P, retain = "1h"));
        assert_eq!(r.len(), 1);
        assert!(
            r[0].starts_with("`retain` (1h) must be at least the `ttl` of `crate::P`"),
            "{r:?}"
        );
        let r = rules(quote!(scope = "user", ttl = "2h", retain = "1h"));
        assert!(
            r[0].starts_with("`retain` (1h) must be at least `ttl` (2h)"),
            "{r:?}"
        );
        assert!(r[0].contains("use `retain = \"2h\"` or more"), "{r:?}");
        let r = rules(quote!(scope = "user", reject_after = "2027-03-01"));
        assert!(
            r[0].starts_with("`reject_after` only applies with `missing_key = \"pass\"`"),
            "{r:?}"
        );
        assert!(rules(quote!(
            scope = "user",
            missing_key = "pass",
            reject_after = "2027-03-01"
        ))
        .is_empty());
    }

    #[test]
    fn what_the_attribute_states_itself_is_judged_at_once() {
        let e = errors(quote!(
            scope = "user",
            missing_key = "derive",
            reject_after = "2027-03-01"
        ));
        assert_eq!(e, ["`reject_after` only applies with `missing_key = \"pass\"` (pass requests without a key until the date, reject them from it): add `missing_key = \"pass\"`, or remove `reject_after`"]);
        let e = errors(quote!(
            scope = "user",
            missing_key = "pass",
            derive_window = "5s"
        ));
        assert!(
            e[0].starts_with("`derive_window` only applies with `missing_key = \"derive\"`"),
            "{e:?}"
        );
        let e = errors(quote!(scope = "global", missing_key = "derive"));
        assert!(
            e[0].contains("cannot be used with `scope = \"global\"`"),
            "{e:?}"
        );
    }

    #[test]
    fn a_name_bound_twice_across_parameters_is_refused() {
        let item = quote!(
            async fn create(user: AuthUser, Json(r#user): Json<New>) {}
        );
        let e = match super::build(quote!(scope = "user"), item) {
            Ok(_) => panic!("accepted a name bound twice"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("`r#user` is bound more than once"), "{e}");
        let item = quote!(
            async fn create(user: AuthUser, Json(New { amount, .. }): Json<New>) {}
        );
        assert!(super::build(quote!(scope = "user"), item).is_ok());
    }

    #[test]
    fn the_options_of_plain_functions_are_refused_on_a_handler() {
        let e = errors(quote!(
            scope = "user",
            engine = self.engine,
            input = body,
            attempt = attempt
        ));
        assert_eq!(e.len(), 3, "{e:?}");
        for (e, option) in e.iter().zip(["engine", "input", "attempt"]) {
            let opening = format!(
                "`{option}` applies to plain async functions only, which `key = ...` selects; "
            );
            assert!(e.starts_with(&opening), "{e}");
            assert!(e.ends_with(&format!("remove `{option}`")), "{e}");
        }
    }

    #[test]
    fn the_scope_accepts_raw_names_and_global() {
        assert!(errors(quote!(scope = "global")).is_empty());
        assert!(errors(quote!(scope = "r#user")).is_empty());
        let e = errors(quote!(scope = "body_"));
        assert!(e[0].contains("did you mean `body`?"), "{e:?}");
    }

    #[test]
    fn key_sources_and_fingerprint_pointers_are_checked() {
        assert!(errors(quote!(
            scope = "global",
            key_header = "Webhook-Id",
            fingerprint_exclude = ["/sent_at", "/meta/trace_id"],
            client_errors = "release"
        ))
        .is_empty());
        assert!(errors(quote!(
            scope = "global",
            key_field = "/data/request_id",
            fingerprint_only = ["/amount"]
        ))
        .is_empty());
        let e = errors(quote!(scope = "global", key_field = "data.request_id"));
        assert_eq!(e, ["`key_field` expects a JSON Pointer (RFC 6901) like \"/id\" or \"/data/request_id\"; did you mean \"/data/request_id\"?"]);
        let e = errors(quote!(scope = "global", key_header = "webhook id"));
        assert!(
            e[0].starts_with("invalid `key_header` \"webhook id\": a space"),
            "{e:?}"
        );
        let e = errors(quote!(
            scope = "global",
            key_header = "webhook-id",
            key_field = "/id"
        ));
        assert!(
            e[0].starts_with("a handler reads its key from one place"),
            "{e:?}"
        );
        let e = errors(quote!(
            scope = "global",
            key_field = "/id",
            fingerprint_only = ["/amount", "/id"]
        ));
        assert!(e[0].starts_with("\"/id\" is the `key_field`"), "{e:?}");
        let e = errors(quote!(
            scope = "global",
            fingerprint_exclude = ["/a", "/a", "/b~"]
        ));
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].contains("already listed"), "{e:?}");
        assert!(e[1].contains("`~0`"), "{e:?}");
        let e = errors(quote!(scope = "global", fingerprint_exclude = []));
        assert!(e[0].contains("at least one JSON Pointer"), "{e:?}");
        let e = errors(quote!(scope = "global", client_errors = "keep"));
        assert!(e[0].ends_with("did you mean \"store\"?"), "{e:?}");
    }

    #[test]
    fn values_are_typed_and_bounded() {
        assert!(errors(quote!(
            scope = "user",
            max_body = "1GiB",
            server_errors = "store"
        ))
        .is_empty());
        let e = errors(quote!(scope = "user", max_body = "2GiB"));
        assert!(e[0].contains("at most \"1GiB\""), "{e:?}");
        let e = errors(quote!(scope = "user", max_body = "0B"));
        assert!(e[0].contains("greater than zero"), "{e:?}");
        let e = errors(quote!(scope = "user", server_errors = "retry"));
        assert_eq!(e, ["`server_errors` must be \"release\" (not stored: a retry runs the handler again) or \"store\" (stored and replayed like any other status); did you mean \"release\"?"]);
        let e = errors(quote!(
            scope = "user",
            wait = "0s",
            lease = "0s",
            retain = "367d"
        ));
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(
            e[0].starts_with("`retain` must be at most 366d (one year), found 367d"),
            "{e:?}"
        );
        assert!(
            e[1].starts_with("`lease` must be greater than zero: a claim"),
            "{e:?}"
        );
    }
}
