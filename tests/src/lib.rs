//! Workspace-level test support: the store conformance suite that every backend runs, and helpers for
//! reaching the PostgreSQL and Redis services the tests need.

pub mod conformance;
pub mod local_cluster;
pub mod proxy;
#[doc(hidden)]
pub mod readme;
pub mod services;
