//! Parsing the attribute's arguments into [`Args`]: each option's keyword token next to its value,
//! nothing interpreted yet, so that `config.rs` can point every error at what the user wrote.
//!
//! Parsing never gives up on the first mistake: an unknown option or a duplicate is recorded and
//! the loop skips to the next comma, so one compile reports every mistake.

use proc_macro2::TokenTree;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, Token};

pub(crate) mod kw {
    syn::custom_keyword!(scope);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(retain);
    syn::custom_keyword!(lease);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(missing_key);
    syn::custom_keyword!(derive_window);
    syn::custom_keyword!(reject_after);
    syn::custom_keyword!(replay);
    syn::custom_keyword!(policy);
    syn::custom_keyword!(max_body);
    syn::custom_keyword!(transaction);
}

/// Every option name, for "did you mean" on unknown ones.
pub(crate) const OPTIONS: &[&str] = &[
    "scope",
    "ttl",
    "retain",
    "lease",
    "wait",
    "missing_key",
    "derive_window",
    "reject_after",
    "replay",
    "policy",
    "max_body",
    "transaction",
];

/// One option as written: `kw = value`.
pub(crate) struct Opt<K> {
    pub(crate) kw: K,
    pub(crate) value: Expr,
}

/// The raw arguments of `#[idempotent(...)]`.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) scope: Option<Opt<kw::scope>>,
    pub(crate) ttl: Option<Opt<kw::ttl>>,
    pub(crate) retain: Option<Opt<kw::retain>>,
    pub(crate) lease: Option<Opt<kw::lease>>,
    pub(crate) wait: Option<Opt<kw::wait>>,
    pub(crate) missing_key: Option<Opt<kw::missing_key>>,
    pub(crate) derive_window: Option<Opt<kw::derive_window>>,
    pub(crate) reject_after: Option<Opt<kw::reject_after>>,
    pub(crate) replay: Option<Opt<kw::replay>>,
    pub(crate) policy: Option<Opt<kw::policy>>,
    pub(crate) max_body: Option<Opt<kw::max_body>>,
    pub(crate) transaction: Option<Opt<kw::transaction>>,
    /// Syntax errors, unknown and duplicate options.
    pub(crate) errors: Vec<syn::Error>,
}

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        while !input.is_empty() {
            if let Err(e) = args.parse_one(input) {
                args.errors.push(e);
                skip_to_comma(input)?;
            }
            if input.is_empty() {
                break;
            }
            if let Err(e) = input.parse::<Token![,]>() {
                args.errors.push(e);
                skip_to_comma(input)?;
                input.parse::<Option<Token![,]>>()?;
            }
        }
        Ok(args)
    }
}

impl Args {
    fn parse_one(&mut self, input: ParseStream<'_>) -> syn::Result<()> {
        let lookahead = input.lookahead1();
        macro_rules! options {
            ($($name:ident)*) => {$(
                if lookahead.peek(kw::$name) {
                    let kw = input.parse::<kw::$name>()?;
                    input.parse::<Token![=]>()?;
                    let value = input.parse::<Expr>()?;
                    return set_once(&mut self.$name, Opt { kw, value }, stringify!($name));
                }
            )*};
        }
        options!(scope ttl retain lease wait missing_key derive_window reject_after replay policy max_body transaction);
        let mut error = lookahead.error();
        if let Ok(ident) = input.fork().call(syn::Ident::parse_any) {
            let name = ident.to_string();
            if let Some(best) = crate::values::closest(&name, OPTIONS) {
                error = syn::Error::new(
                    ident.span(),
                    format!("unknown option `{name}`: did you mean `{best}`? ({error})"),
                );
            } else {
                error = syn::Error::new(ident.span(), format!("unknown option `{name}`: {error}"));
            }
        }
        Err(error)
    }
}

/// Stores an option, rejecting a second occurrence on its own span.
fn set_once<K: quote::ToTokens>(
    slot: &mut Option<Opt<K>>,
    opt: Opt<K>,
    name: &str,
) -> syn::Result<()> {
    if slot.is_some() {
        let (kw, value) = (&opt.kw, &opt.value);
        return Err(syn::Error::new_spanned(
            quote::quote!(#kw = #value),
            format!(
                "duplicate option `{name}`: it is already set earlier in this attribute; keep one"
            ),
        ));
    }
    *slot = Some(opt);
    Ok(())
}

/// After a mistake, resume at the next top-level comma.
fn skip_to_comma(input: ParseStream<'_>) -> syn::Result<()> {
    while !input.is_empty() && !input.peek(Token![,]) {
        input.parse::<TokenTree>()?;
    }
    Ok(())
}
