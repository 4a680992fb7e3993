//! Transactional mode over HTTP on SQLite and PostgreSQL, and its crash tests with real processes.

#[macro_use]
mod transactional_support;

mod crash;
mod postgres;
mod sqlite;
