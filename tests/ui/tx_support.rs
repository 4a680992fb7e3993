//! Shared by the transactional UI cases: a state holding transactional engines for both databases
//! (next to the plain engine), and a check that a handler routes.
#![allow(dead_code)]

use axum::extract::FromRef;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::{Engine, Transactional};

#[derive(Clone, FromRef)]
pub struct TxApp {
    pub engine: Engine,
    pub sqlite: Transactional<SqliteStore>,
    pub postgres: Transactional<PostgresStore>,
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
