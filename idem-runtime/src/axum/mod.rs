//! axum integration: what the `#[idempotent]` attribute expands to calls into this module.
//!
//! (Interface fixed; behaviour being filled in.)

#[doc(hidden)]
pub mod private;
pub mod scope;

pub use scope::Scope;
