//! Shared by the transactional UI cases: a state holding a transactional engine (next to the plain
//! engine), and a check that a handler routes. SQLite only: the UI cases build idem with the
//! features they need and no more (the PostgreSQL handlers are compiled by the payments example).
#![allow(dead_code)]

use axum::extract::FromRef;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::{Engine, Transactional};

#[derive(Clone, FromRef)]
pub struct TxApp {
    pub engine: Engine,
    pub sqlite: Transactional<SqliteStore>,
    pub name: String,
}

/// Compiles only if `handler` is an axum handler for a router whose state is `TxApp`.
pub fn route_tx<H, T>(handler: H) -> axum::Router<TxApp>
where
    H: axum::handler::Handler<T, TxApp>,
    T: 'static,
{
    axum::Router::new().route("/", axum::routing::post(handler))
}
