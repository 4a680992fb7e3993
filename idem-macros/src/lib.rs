//! The `#[idempotent]` attribute. Use it through `idem-runtime`, which re-exports it.

use proc_macro::TokenStream;

/// Makes an axum handler idempotent (placeholder: passes the handler through).
#[proc_macro_attribute]
pub fn idempotent(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}
