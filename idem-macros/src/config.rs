//! Validation: raw [`Args`] plus the handler become a [`Config`] the expansion can trust.
//!
//! Every check reports on the token the user wrote (the literal, the keyword, the `fn` token), and
//! every check runs even after an earlier one failed: the errors are folded into one.
//!
//! The defaults below mirror `idem_runtime::Policy::new()` (this crate cannot depend on the runtime,
//! which depends on it). They are only used to judge cross-option rules such as "`retain` must be at
//! least `ttl`" when `ttl` is left at its default; the expansion still calls `Policy::checked()` in a
//! `const`, so if they ever drifted the result would be a compile error, never a silent difference.

use crate::attr::{kw, Args, Opt};
use crate::values::{self, format_ms, BadDate, BadDuration, BadSize, MissingKey, Replay};
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::{Expr, FnArg, Ident, ItemFn, Lit, LitStr, Pat, Signature, Type};

const DEFAULT_TTL_MS: u64 = 24 * 3_600_000;
const DEFAULT_DERIVE_WINDOW_MS: u64 = 10_000;
/// `MAX_TTL` in the runtime: one year, leap day included.
const MAX_TTL_MS: u64 = 366 * 24 * 3_600_000;
/// The largest `max_body`: bodies are buffered in memory, so more is almost surely a unit mistake.
const MAX_BODY: u64 = 1 << 30;
/// axum implements `Handler` for up to 16 extractors; the expansion adds one.
const MAX_PARAMS: usize = 15;

/// The validated attribute: what the expansion needs, nothing it has to check.
pub(crate) struct Config {
    pub(crate) handler: ItemFn,
    pub(crate) scope: ScopeSource,
    /// `policy = PATH`: the base the explicit options override; else `Policy::new()`.
    pub(crate) base: Option<syn::Path>,
    pub(crate) ttl_ms: Option<u64>,
    pub(crate) retain_ms: Option<u64>,
    pub(crate) lease_ms: Option<u64>,
    pub(crate) wait_ms: Option<u64>,
    pub(crate) missing_key: Option<MissingKey>,
    pub(crate) derive_window_ms: Option<u64>,
    pub(crate) reject_after_ms: Option<i64>,
    pub(crate) replay: Option<Replay>,
    pub(crate) max_body: Option<u64>,
    /// `transaction = "<parameter>"`: the index of that parameter in the signature.
    pub(crate) transaction: Option<usize>,
}

/// Where the scope id comes from.
pub(crate) enum ScopeSource {
    /// `scope = "global"`.
    Global,
    /// A parameter bound to `ident`, whose type is at `ty_span`.
    Param { ident: Ident, ty_span: Span },
}

/// Errors folded into one (`syn::Error::combine`).
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn at(&mut self, tokens: impl ToTokens, message: impl std::fmt::Display) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    fn into_result<T>(self, value: T) -> syn::Result<T> {
        match self.0 {
            Some(e) => Err(e),
            None => Ok(value),
        }
    }
}

/// Parses and validates the attribute arguments against the handler.
pub(crate) fn build(args: TokenStream, item: TokenStream) -> syn::Result<Config> {
    let mut errors = Errors::default();
    let args = match syn::parse2::<Args>(args) {
        Ok(args) => args,
        Err(e) => {
            errors.push(e);
            Args::default()
        }
    };
    let handler = match syn::parse2::<ItemFn>(item) {
        Ok(f) => f,
        Err(e) => {
            errors.push(syn::Error::new(
                e.span(),
                "`#[idempotent]` applies to an `async fn` axum handler",
            ));
            return Err(errors.0.unwrap_or(e));
        }
    };
    let Args {
        scope,
        ttl,
        retain,
        lease,
        wait,
        missing_key,
        derive_window,
        reject_after,
        replay,
        policy,
        max_body,
        transaction,
        errors: parse_errors,
    } = args;
    for e in parse_errors {
        errors.push(e);
    }

    check_signature(&handler.sig, &mut errors);
    let scope = resolve_scope(scope.as_ref(), &handler.sig, &mut errors);
    let transaction = transaction
        .as_ref()
        .and_then(|opt| resolve_transaction(opt, &handler.sig, scope.as_ref(), &mut errors));

    let ttl_ms = duration(ttl.as_ref(), "ttl", Range::TTL, &mut errors);
    let retain_ms = duration(retain.as_ref(), "retain", Range::TTL, &mut errors);
    let lease_ms = duration(lease.as_ref(), "lease", Range::POSITIVE_MS, &mut errors);
    let wait_ms = duration(wait.as_ref(), "wait", Range::ZERO_OK_MS, &mut errors);
    let derive_window_ms = duration(
        derive_window.as_ref(),
        "derive_window",
        Range::POSITIVE,
        &mut errors,
    );
    let missing_key_value = missing_key.as_ref().and_then(|opt| {
        let lit = string(opt, "missing_key", "reject", &mut errors)?;
        values::parse_missing_key(&lit.value())
            .map_err(|hint| {
                errors.at(
                    &lit,
                    format!(
                        "`missing_key` must be \"reject\" (answer 400), \"pass\" (run unprotected) or \"derive\" (derive a key from the request){}",
                        did_you_mean(hint)
                    ),
                )
            })
            .ok()
    });
    let replay_value = replay.as_ref().and_then(|opt| {
        let lit = string(opt, "replay", "full", &mut errors)?;
        values::parse_replay(&lit.value())
            .map_err(|hint| {
                errors.at(
                    &lit,
                    format!(
                        "`replay` must be \"full\" (status, headers and body) or \"minimal\" (status, `Location` and the resource id){}",
                        did_you_mean(hint)
                    ),
                )
            })
            .ok()
    });
    let reject_after_ms = reject_after.as_ref().and_then(|opt| date(opt, &mut errors));
    let max_body_value = max_body.as_ref().and_then(|opt| size(opt, &mut errors));
    let base = policy
        .as_ref()
        .and_then(|opt| policy_path(opt, &mut errors));

    // Cross-option rules. Without `policy`, unset options take the defaults; with it, an unset
    // option is unknown here and `Policy::checked()` judges it at compile time instead.
    let known = |explicit: Option<u64>, default: u64| match (explicit, &base) {
        (Some(v), _) => Some(v),
        (None, None) => Some(default),
        (None, Some(_)) => None,
    };
    let eff_ttl = known(ttl_ms, DEFAULT_TTL_MS);
    let eff_missing_key = match (missing_key_value, &base) {
        (Some(m), _) => Some(m),
        (None, None) => Some(MissingKey::Reject),
        (None, Some(_)) => None,
    };
    // Messages quote durations as the user wrote them (validated, so canonical).
    let ttl_text = written(ttl.as_ref()).unwrap_or_else(|| "24h".to_string());
    let ttl_note = if ttl_ms.is_some() {
        format!("`ttl` ({ttl_text})")
    } else {
        format!("`ttl` ({ttl_text}, the default)")
    };

    if let (Some(opt), Some(retain), Some(ttl)) = (&retain, retain_ms, eff_ttl) {
        if retain < ttl {
            errors.at(
                &opt.value,
                format!(
                    "`retain` ({}) must be at least {}: tombstones outlive the keys they remember; use `retain = \"{}\"` or more, or leave `retain` out (it defaults to 7d, or to `ttl` if longer)",
                    written(Some(opt)).unwrap_or_else(|| format_ms(retain)),
                    ttl_note,
                    ttl_text
                ),
            );
        }
    }

    let derive = eff_missing_key.map(|m| m == MissingKey::Derive);
    if let Some(opt) = &derive_window {
        if derive == Some(false) {
            errors.at(
                opt.kw,
                "`derive_window` only applies with `missing_key = \"derive\"`: add `missing_key = \"derive\"`, or remove `derive_window`",
            );
        }
    }
    if derive != Some(false) {
        if let (Some(window), Some(ttl)) = (derive_window_ms, eff_ttl) {
            if let Some(opt) = derive_window.as_ref().filter(|_| window > ttl) {
                errors.at(
                    &opt.value,
                    format!(
                        "`derive_window` ({}) must not exceed {}: a derived key cannot outlive the record; use `derive_window = \"{}\"` or less (a few seconds is typical: it catches double taps)",
                        written(Some(opt)).unwrap_or_else(|| format_ms(window)),
                        ttl_note,
                        ttl_text
                    ),
                );
            }
        }
        if let (None, Some(true), Some(opt), Some(ttl)) = (&derive_window, derive, &ttl, ttl_ms) {
            if base.is_none() && ttl < DEFAULT_DERIVE_WINDOW_MS {
                errors.at(
                    &opt.value,
                    format!(
                        "`ttl` ({}) is shorter than the default `derive_window` (10s): add `derive_window = \"{}\"` or less",
                        ttl_text, ttl_text
                    ),
                );
            }
        }
    }

    if let (Some(true), Some(ScopeSource::Global), Some(opt)) = (derive, &scope, &missing_key) {
        errors.at(
            &opt.value,
            "`missing_key = \"derive\"` cannot be used with `scope = \"global\"`: two callers sending the identical request within `derive_window` would share one execution and one response; scope the handler to its caller (`scope = \"<parameter>\"`), or use `missing_key = \"pass\"` or \"reject\"",
        );
    }

    if let Some(opt) = &reject_after {
        if let Some(mk) = eff_missing_key.filter(|m| *m != MissingKey::Pass) {
            let now = match (mk, missing_key_value) {
                (MissingKey::Reject, None) => "`missing_key` defaults to \"reject\"".to_string(),
                (MissingKey::Reject, _) => "`missing_key` is \"reject\" here".to_string(),
                (_, _) => "`missing_key` is \"derive\" here".to_string(),
            };
            errors.at(
                opt.kw,
                format!(
                    "`reject_after` only applies with `missing_key = \"pass\"` (pass requests without a key until the date, reject them from it), but {now}: add `missing_key = \"pass\"`, or remove `reject_after`"
                ),
            );
        }
    }

    let config = Config {
        handler,
        scope: scope.unwrap_or(ScopeSource::Global),
        base,
        ttl_ms,
        retain_ms,
        lease_ms,
        wait_ms,
        missing_key: missing_key_value,
        derive_window_ms,
        reject_after_ms,
        replay: replay_value,
        max_body: max_body_value,
        transaction,
    };
    errors.into_result(config)
}

/// The string an option was given, if it was a string literal.
fn written<K>(opt: Option<&Opt<K>>) -> Option<String> {
    match &opt?.value {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s.value()),
        _ => None,
    }
}

fn did_you_mean(hint: Option<&str>) -> String {
    hint.map(|h| format!("; did you mean \"{h}\"?"))
        .unwrap_or_default()
}

fn check_signature(sig: &Signature, errors: &mut Errors) {
    if sig.asyncness.is_none() {
        errors.at(
            sig.fn_token,
            format!(
                "`#[idempotent]` handlers must be `async fn`: write `async fn {}(...)`",
                sig.ident
            ),
        );
    }
    if let Some(FnArg::Receiver(receiver)) = sig.inputs.first() {
        errors.at(
            receiver,
            "an `#[idempotent]` handler cannot take `self`: axum passes handlers only extractors; make it a free function (or an associated function without `self`) and reach shared data through `State`",
        );
    }
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.at(
            &sig.generics,
            "`#[idempotent]` handlers cannot be generic: each handler gets its own constant policy; use concrete types (the handler can call a generic helper)",
        );
    }
    if let Some(variadic) = &sig.variadic {
        errors.at(variadic, "`#[idempotent]` handlers cannot be variadic");
    }
    if sig.inputs.len() > MAX_PARAMS {
        errors.at(
            &sig.inputs,
            format!(
                "an `#[idempotent]` handler takes at most {MAX_PARAMS} parameters: axum handlers take at most 16 extractors and `#[idempotent]` adds one; group extractors into a struct that implements `FromRequestParts`"
            ),
        );
    }
}

fn resolve_scope(
    opt: Option<&Opt<kw::scope>>,
    sig: &Signature,
    errors: &mut Errors,
) -> Option<ScopeSource> {
    let named: Vec<(&Ident, &syn::PatType)> = sig
        .inputs
        .iter()
        .filter_map(|arg| match arg {
            FnArg::Typed(pt) => match &*pt.pat {
                Pat::Ident(pi) if pi.subpat.is_none() => Some((&pi.ident, pt)),
                _ => None,
            },
            FnArg::Receiver(_) => None,
        })
        .collect();
    let names = named
        .iter()
        .map(|(i, _)| format!("`{}`", i.unraw()))
        .collect::<Vec<_>>()
        .join(", ");

    let Some(opt) = opt else {
        let example = named
            .first()
            .map(|(i, pt)| {
                format!(
                    "`scope = \"{}\"` if `{}` identifies the caller",
                    i.unraw(),
                    pt.ty.to_token_stream()
                )
            })
            .unwrap_or_else(|| "`scope = \"<parameter>\"`".into());
        errors.push(syn::Error::new(
            Span::call_site(),
            format!(
                "missing `scope`: keys are unique per caller, so name the parameter that identifies the caller ({example}), or write `scope = \"global\"` to share keys between all callers"
            ),
        ));
        return None;
    };
    let lit = string(opt, "scope", "user", errors)?;
    let written = lit.value();
    let wanted = written.strip_prefix("r#").unwrap_or(&written).to_string();
    if wanted == "global" {
        return Some(ScopeSource::Global);
    }
    if let Some((ident, pt)) = named.iter().find(|(i, _)| i.unraw() == wanted) {
        if let Pat::Ident(pi) = &*pt.pat {
            if pi.by_ref.is_some() {
                errors.at(
                    &pt.pat,
                    "the `scope` parameter must bind by value: remove `ref`",
                );
                return None;
            }
        }
        return Some(ScopeSource::Param {
            ident: (*ident).clone(),
            ty_span: pt.ty.span(),
        });
    }

    let fn_name = sig.ident.unraw();
    let nested = sig.inputs.iter().any(|arg| match arg {
        FnArg::Typed(pt) => binds(&pt.pat, &wanted),
        FnArg::Receiver(_) => false,
    });
    let message = if nested {
        format!(
            "`{wanted}` is destructured from a parameter pattern of `{fn_name}`; `scope` must name a parameter bound whole, like `{wanted}: AuthUser` (its type implements `idem_runtime::axum::Scope`)"
        )
    } else if named.is_empty() {
        format!(
            "`{wanted}` is not a parameter of `{fn_name}`, which has no parameter bound to a plain name; add one that identifies the caller (like `user: AuthUser`), or write `scope = \"global\"`"
        )
    } else {
        let candidates: Vec<String> = named.iter().map(|(i, _)| i.unraw().to_string()).collect();
        let refs: Vec<&str> = candidates.iter().map(String::as_str).collect();
        let hint = values::closest(&wanted, &refs)
            .map(|c| format!("did you mean `{c}`? "))
            .unwrap_or_default();
        format!(
            "`{wanted}` is not a parameter of `{fn_name}`; {hint}its parameters bound to a name are: {names} (or write `scope = \"global\"` to opt out of per-caller keys)"
        )
    };
    errors.at(&lit, message);
    None
}

/// The index of the parameter `transaction = "..."` names. Its type is checked by the compiler
/// (the runtime's `TxHandle` trait, whose message lists the accepted types); here only what the
/// compiler could not explain well: a name that is no parameter, a pattern, `ref`, a reference.
fn resolve_transaction(
    opt: &Opt<kw::transaction>,
    sig: &Signature,
    scope: Option<&ScopeSource>,
    errors: &mut Errors,
) -> Option<usize> {
    let lit = string(opt, "transaction", "tx", errors)?;
    let written = lit.value();
    let wanted = written.strip_prefix("r#").unwrap_or(&written).to_string();
    let fn_name = sig.ident.unraw();
    let example = "`tx: idem_runtime::Tx<idem_runtime::sqlx::Postgres>` (or `Sqlite`)";
    let found = sig
        .inputs
        .iter()
        .enumerate()
        .find_map(|(i, arg)| match arg {
            FnArg::Typed(pt) => match &*pt.pat {
                Pat::Ident(pi) if pi.subpat.is_none() && pi.ident.unraw() == wanted => {
                    Some((i, pi, pt))
                }
                _ => None,
            },
            FnArg::Receiver(_) => None,
        });
    let Some((index, pi, pt)) = found else {
        let nested = sig.inputs.iter().any(|arg| match arg {
            FnArg::Typed(pt) => binds(&pt.pat, &wanted),
            FnArg::Receiver(_) => false,
        });
        let message = if nested {
            format!(
                "`{wanted}` is destructured from a parameter pattern of `{fn_name}`; `transaction` must name a parameter bound whole, like {example}"
            )
        } else {
            let names: Vec<String> = sig
                .inputs
                .iter()
                .filter_map(|arg| match arg {
                    FnArg::Typed(pt) => match &*pt.pat {
                        Pat::Ident(pi) if pi.subpat.is_none() => Some(pi.ident.unraw().to_string()),
                        _ => None,
                    },
                    FnArg::Receiver(_) => None,
                })
                .collect();
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            match values::closest(&wanted, &refs) {
                Some(c) => format!("`{wanted}` is not a parameter of `{fn_name}`; did you mean `{c}`?"),
                None => format!(
                    "`{wanted}` is not a parameter of `{fn_name}`: add the transaction parameter, like {example}, and run the handler's queries on it"
                ),
            }
        };
        errors.at(&lit, message);
        return None;
    };
    if let Some(ScopeSource::Param { ident, .. }) = scope {
        if ident.unraw() == wanted {
            errors.at(
                &lit,
                format!("`{wanted}` is already the `scope` parameter; the transaction needs a parameter of its own, like {example}"),
            );
            return None;
        }
    }
    if pi.by_ref.is_some() {
        errors.at(
            &pt.pat,
            "the `transaction` parameter must bind by value: remove `ref`",
        );
        return None;
    }
    if let Type::Reference(r) = &*pt.ty {
        errors.at(
            r,
            format!(
                "the `transaction` parameter takes the transaction by value: write `{}: {}` and run queries on `&mut *{}`",
                pi.ident,
                compact(&r.elem.to_token_stream().to_string()),
                pi.ident
            ),
        );
        return None;
    }
    Some(index)
}

/// A type as written, without the spaces `to_string` puts around `<`, `>` and `::`.
fn compact(tokens: &str) -> String {
    tokens
        .replace(" :: ", "::")
        .replace(":: ", "::")
        .replace(" < ", "<")
        .replace(" <", "<")
        .replace("< ", "<")
        .replace(" >", ">")
        .replace(" ,", ",")
}

/// Whether `pat` binds `name` anywhere inside.
fn binds(pat: &Pat, name: &str) -> bool {
    match pat {
        Pat::Ident(pi) => {
            pi.ident.unraw() == name || pi.subpat.as_ref().is_some_and(|(_, p)| binds(p, name))
        }
        Pat::TupleStruct(p) => p.elems.iter().any(|p| binds(p, name)),
        Pat::Tuple(p) => p.elems.iter().any(|p| binds(p, name)),
        Pat::Struct(p) => p.fields.iter().any(|f| binds(&f.pat, name)),
        Pat::Reference(p) => binds(&p.pat, name),
        Pat::Paren(p) => binds(&p.pat, name),
        Pat::Slice(p) => p.elems.iter().any(|p| binds(p, name)),
        Pat::Type(p) => binds(&p.pat, name),
        _ => false,
    }
}

/// The string literal of an option, or an error suggesting the quoted form.
fn string<K: ToTokens>(
    opt: &Opt<K>,
    name: &str,
    example: &str,
    errors: &mut Errors,
) -> Option<LitStr> {
    let written = match &opt.value {
        Expr::Lit(e) => match &e.lit {
            Lit::Str(s) => return Some(s.clone()),
            Lit::Int(i) => i.to_string(),
            Lit::Float(f) => f.to_string(),
            _ => example.to_string(),
        },
        Expr::Path(p) if p.path.get_ident().is_some() => p.path.to_token_stream().to_string(),
        _ => example.to_string(),
    };
    errors.at(
        &opt.value,
        format!("`{name}` takes a string literal: write `{name} = \"{written}\"`"),
    );
    None
}

/// The bounds of one duration option.
struct Range {
    allow_zero: bool,
    allow_ms: bool,
    max_ms: Option<u64>,
}

impl Range {
    const TTL: Range = Range {
        allow_zero: false,
        allow_ms: false,
        max_ms: Some(MAX_TTL_MS),
    };
    const POSITIVE: Range = Range {
        allow_zero: false,
        allow_ms: false,
        max_ms: None,
    };
    const POSITIVE_MS: Range = Range {
        allow_zero: false,
        allow_ms: true,
        max_ms: None,
    };
    const ZERO_OK_MS: Range = Range {
        allow_zero: true,
        allow_ms: true,
        max_ms: None,
    };
}

fn duration<K: ToTokens>(
    opt: Option<&Opt<K>>,
    name: &str,
    range: Range,
    errors: &mut Errors,
) -> Option<u64> {
    let opt = opt?;
    let lit = string(opt, name, "24h", errors)?;
    let text = lit.value();
    let units = if range.allow_ms {
        "ms, s, m, h or d"
    } else {
        "s, m, h or d"
    };
    let ms = match values::parse_duration(&text, range.allow_ms) {
        Ok(ms) => ms,
        Err(bad) => {
            let message = match bad {
                BadDuration::Unrecognized => format!(
                    "`{name}` expects a duration like \"24h\" (a whole number followed by {units}), found \"{text}\""
                ),
                BadDuration::DidYouMean(s) => format!(
                    "`{name}` expects a duration like \"24h\" (a whole number followed by {units}); did you mean \"{s}\"?"
                ),
                BadDuration::Note(note) => format!("invalid `{name}` \"{text}\": {note}"),
                BadDuration::TooLarge => format!("`{name}` \"{text}\" is too large"),
            };
            errors.at(&lit, message);
            return None;
        }
    };
    if ms == 0 && !range.allow_zero {
        errors.at(
            &lit,
            format!(
                "`{name}` must be greater than zero{}",
                match name {
                    "ttl" => ": a key forgotten at once protects nothing",
                    "lease" => ": a claim must be held while the handler runs",
                    _ => "",
                }
            ),
        );
        return None;
    }
    if let Some(max) = range.max_ms.filter(|max| ms > *max) {
        errors.at(
            &lit,
            format!(
                "`{name}` must be at most {} (one year), found {}: a longer value is almost certainly a unit mistake",
                format_ms(max),
                format_ms(ms)
            ),
        );
        return None;
    }
    Some(ms)
}

fn date(opt: &Opt<kw::reject_after>, errors: &mut Errors) -> Option<i64> {
    let lit = string(opt, "reject_after", "2027-03-01", errors)?;
    let text = lit.value();
    match values::parse_date(&text) {
        Ok(ms) => Some(ms),
        Err(bad) => {
            let message = match bad {
                BadDate::Unrecognized => format!(
                    "`reject_after` expects a date written YYYY-MM-DD, like \"2027-03-01\", found \"{text}\""
                ),
                BadDate::DidYouMean(s) => format!(
                    "`reject_after` expects a date written YYYY-MM-DD; did you mean \"{s}\"?"
                ),
                BadDate::Note(note) => format!("invalid `reject_after` date \"{text}\": {note}"),
            };
            errors.at(&lit, message);
            None
        }
    }
}

fn size(opt: &Opt<kw::max_body>, errors: &mut Errors) -> Option<u64> {
    let lit = string(opt, "max_body", "1MiB", errors)?;
    let text = lit.value();
    let message = match values::parse_size(&text) {
        Ok(0) => "`max_body` must be greater than zero".to_string(),
        Ok(n) if n > MAX_BODY => {
            "`max_body` must be at most \"1GiB\": request bodies are buffered in memory".to_string()
        }
        Ok(n) => return Some(n),
        Err(BadSize::Unrecognized) => format!(
            "`max_body` expects a size like \"1MiB\" (a whole number followed by B, KiB, MiB or GiB), found \"{text}\""
        ),
        Err(BadSize::Note(note)) => format!("invalid `max_body` \"{text}\": {note}"),
        Err(BadSize::TooLarge) => format!("`max_body` \"{text}\" is too large"),
    };
    errors.at(&lit, message);
    None
}

fn policy_path(opt: &Opt<kw::policy>, errors: &mut Errors) -> Option<syn::Path> {
    match &opt.value {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => Some(p.path.clone()),
        Expr::Lit(e) if matches!(e.lit, Lit::Str(_)) => {
            let Lit::Str(s) = &e.lit else { return None };
            errors.at(
                s,
                format!(
                    "`policy` takes the path of a `const` policy, not a string: write `policy = {}`",
                    s.value()
                ),
            );
            None
        }
        other => {
            errors.at(
                other,
                "`policy` takes the path of a `const` `Policy`: declare `const PAYMENTS: Policy = Policy::new().ttl(...);` once and write `policy = PAYMENTS`",
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    fn errors(args: proc_macro2::TokenStream) -> Vec<String> {
        let item = quote!(
            async fn create(user: AuthUser, body: String) -> String {
                body
            }
        );
        match super::build(args, item) {
            Ok(_) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn a_ttl_below_the_default_derive_window_asks_for_a_window() {
        let e = errors(quote!(scope = "user", ttl = "5s", missing_key = "derive"));
        assert_eq!(
            e,
            ["`ttl` (5s) is shorter than the default `derive_window` (10s): add `derive_window = \"5s\"` or less"]
        );
        assert!(errors(quote!(
            scope = "user",
            ttl = "5s",
            missing_key = "derive",
            derive_window = "5s"
        ))
        .is_empty());
    }

    #[test]
    fn with_a_named_policy_unknown_values_are_left_to_checked() {
        // The policy's ttl and missing_key are unknown here: `Policy::checked` judges them.
        assert!(errors(quote!(scope = "user", policy = P, retain = "1h")).is_empty());
        assert!(errors(quote!(scope = "user", policy = P, derive_window = "1m")).is_empty());
        assert!(errors(quote!(
            scope = "user",
            policy = P,
            reject_after = "2027-03-01"
        ))
        .is_empty());
        // What the attribute states itself is still judged.
        let e = errors(quote!(
            scope = "user",
            policy = P,
            ttl = "2h",
            retain = "1h"
        ));
        assert_eq!(e.len(), 1);
        assert!(
            e[0].starts_with("`retain` (1h) must be at least `ttl` (2h)"),
            "{e:?}"
        );
        let e = errors(quote!(
            scope = "user",
            policy = P,
            missing_key = "derive",
            reject_after = "2027-03-01"
        ));
        assert!(
            e[0].contains("but `missing_key` is \"derive\" here"),
            "{e:?}"
        );
    }

    #[test]
    fn the_scope_accepts_raw_names_and_global() {
        assert!(errors(quote!(scope = "global")).is_empty());
        assert!(errors(quote!(scope = "r#user")).is_empty());
        let e = errors(quote!(scope = "body_"));
        assert!(e[0].contains("did you mean `body`?"), "{e:?}");
    }

    #[test]
    fn max_body_bounds() {
        assert!(errors(quote!(scope = "user", max_body = "1GiB")).is_empty());
        let e = errors(quote!(scope = "user", max_body = "2GiB"));
        assert!(e[0].contains("at most \"1GiB\""), "{e:?}");
        let e = errors(quote!(scope = "user", max_body = "0B"));
        assert!(e[0].contains("greater than zero"), "{e:?}");
    }
}
