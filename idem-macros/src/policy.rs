//! The policy constant's expression, shared by both modes: handlers (`expand.rs`) and plain
//! async functions (`function.rs`), which name the runtime's items by different paths.

use crate::config::{Broken, Rule, Value};
use crate::options::Opt;
use proc_macro2::{Span, TokenStream};
use quote::{quote_spanned, ToTokens};
use syn::Ident;

/// Where the expansion finds the runtime's policy items.
pub(crate) struct Paths {
    /// The module with `PolicyError`, `MissingKey` and the options' enums.
    pub(crate) module: TokenStream,
    /// `Duration`.
    pub(crate) duration: TokenStream,
}

/// The policy constant's expression: the base, a builder call for each option written (in
/// [`Opt::ALL`]'s order: `ttl`, which raises `retain`, before an explicit `retain`), the handler
/// name, the rules, and the compile-time check, spanned at a named policy if there is one.
///
/// Input:  `scope = "user", ttl = "1h"` on `create`
/// Output: `Policy::new().ttl(Duration::from_millis(3600000u64)).handler("create").checked()`
///
/// With a rule on a value left to the policy (`retain = "1h"`, the default `ttl` unknown here):
/// `{ let __idem_policy = CHAIN; match __idem_policy.validate() { Err(..) => panic!(..), _ =>
/// __idem_policy.checked() } }`.
pub(crate) fn policy(
    paths: &Paths,
    base: &TokenStream,
    name: &str,
    global: bool,
    values: &[(Opt, Value)],
    rules: &[Rule],
) -> TokenStream {
    let (def, p, duration) = (Span::mixed_site(), &paths.module, &paths.duration);
    let mut chain = base.clone();
    for (opt, value) in values {
        let method = match opt {
            Opt::MaxBody => "max_request_body",
            Opt::RejectAfter => "reject_after_ms",
            other => other.name(),
        };
        let method = Ident::new(method, def);
        let arg = match value {
            Value::Duration(d) => {
                let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                quote_spanned!(def=> #duration::from_millis(#ms))
            }
            Value::Choice(ty, choice) => {
                let (ty, variant) = (Ident::new(ty, def), Ident::new(choice.variant, def));
                quote_spanned!(def=> #p::#ty::#variant)
            }
            Value::Date(ms) => ms.to_token_stream(),
            Value::Size(bytes) => bytes.to_token_stream(),
            Value::Str(text) => text.to_token_stream(),
            Value::Strs(pointers) => {
                let pointers = pointers.iter().map(|(p, _)| p);
                quote_spanned!(def=> &[#(#pointers),*])
            }
        };
        chain.extend(quote_spanned!(def=> .#method(#arg)));
    }
    chain.extend(quote_spanned!(def=> .handler(#name)));
    // Keys shared by every caller must not be derived from bodies that callers share.
    let check_span = base.clone().into_iter().next().map_or(def, |t| t.span());
    let checked = match global {
        true => quote_spanned!(check_span=> .checked_for_global_scope()),
        false => quote_spanned!(check_span=> .checked()),
    };
    if rules.is_empty() {
        return quote_spanned!(def=> #chain #checked);
    }
    // Hygienic, as `expand.rs` makes its generated names (this file stays below it).
    let policy = Ident::new("__idem_policy", def);
    let arms = rules.iter().map(|Rule(broken, at, message)| {
        let panic = quote_spanned!(*at=> ::core::panic!("{}", #message));
        match broken {
            Broken::Policy(error) => {
                let error = Ident::new(error, def);
                quote_spanned!(def=> ::core::result::Result::Err(#p::PolicyError::#error) => #panic,)
            }
            Broken::MissingKeyIsNot(variant) => {
                let variant = Ident::new(variant, def);
                quote_spanned!(def=> _ if !::core::matches!(#policy.missing_key, #p::MissingKey::#variant) => #panic,)
            }
        }
    });
    quote_spanned!(def=> {
        let #policy = #chain;
        match #policy.validate() {
            #(#arms)*
            _ => #policy #checked,
        }
    })
}
