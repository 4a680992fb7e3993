//! The payments example (`examples/payments`) driven from outside: its API contract, concurrency,
//! its OpenAPI document and restarts.

mod payments_support;

mod api;
mod concurrency;
mod openapi;
mod restart;
