//! idem's HTTP client (`idem_runtime::client`): retries and limits against a scripted fault server,
//! and the client against an idem server. Its tracing is tested alone, in `client_spans.rs`.

mod client_support;

mod against_idem_server;
mod limits;
mod retry;
