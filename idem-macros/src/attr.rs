//! Parsing the attribute's arguments into [`Args`]: each option's keyword next to its value,
//! nothing interpreted yet, so that `config.rs` can point every error at what the user wrote.
//!
//! Parsing never gives up on the first mistake: an unknown option or a duplicate is recorded and
//! the loop skips to the next comma, so one compile reports every mistake.

use crate::options::Opt;
use proc_macro2::TokenTree;
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, Ident, Token};

/// One option as written: `kw = value`.
pub(crate) struct Written {
    pub(crate) opt: Opt,
    pub(crate) kw: Ident,
    pub(crate) value: Expr,
}

/// The raw arguments of `#[idempotent(...)]`: each option at most once.
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) written: Vec<Written>,
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
                input.parse::<Option<Token![,]>>()?;
            }
        }
        Ok(args)
    }
}

/// The attribute's arguments; a syntax error the parser could not get past is one of its errors.
pub(crate) fn parse(args: proc_macro2::TokenStream) -> Args {
    syn::parse2::<Args>(args).unwrap_or_else(|e| Args {
        written: Vec::new(),
        errors: vec![e],
    })
}

impl Args {
    pub(crate) fn get(&self, opt: Opt) -> Option<&Written> {
        self.written.iter().find(|w| w.opt == opt)
    }

    fn parse_one(&mut self, input: ParseStream<'_>) -> syn::Result<()> {
        let kw = input.call(Ident::parse_any)?;
        let Some(opt) = Opt::ALL.iter().copied().find(|opt| kw == opt.name()) else {
            return Err(unknown(&kw));
        };
        input.parse::<Token![=]>()?;
        let value = input.parse::<Expr>()?;
        if self.get(opt).is_some() {
            return Err(syn::Error::new_spanned(
                quote::quote!(#kw = #value),
                format!("duplicate option `{kw}`: it is already set earlier in this attribute; keep one"),
            ));
        }
        self.written.push(Written { opt, kw, value });
        if !input.is_empty() {
            input.parse::<Token![,]>()?;
        }
        Ok(())
    }
}

/// An unknown option: its probable meaning, else the list of options.
fn unknown(ident: &Ident) -> syn::Error {
    let names: Vec<&str> = Opt::ALL.iter().map(|opt| opt.name()).collect();
    let hint = match crate::values::closest(&ident.to_string(), &names) {
        Some(best) => format!("did you mean `{best}`?"),
        None => format!("expected one of `{}`", names.join("`, `")),
    };
    syn::Error::new(ident.span(), format!("unknown option `{ident}`: {hint}"))
}

/// After a mistake, resume at the next top-level comma.
fn skip_to_comma(input: ParseStream<'_>) -> syn::Result<()> {
    while !input.is_empty() && !input.peek(Token![,]) {
        input.parse::<TokenTree>()?;
    }
    Ok(())
}
