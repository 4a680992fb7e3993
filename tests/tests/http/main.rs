//! idem's HTTP behaviour on axum, in process: keys, replays, failures, hostile input, metrics, and
//! the checks `IdempotencyLayer` makes when it is built.

#[macro_use]
mod http_support;

mod failures;
mod hostile;
mod key_schema;
mod keys;
mod layer_checks;
mod metrics;
mod replay;
mod sources;
