//! Transactional mode over HTTP on SQLite, PostgreSQL and MySQL/MariaDB, and its crash tests with real processes.

#[macro_use]
mod transactional_support;

mod crash;
mod mysql;
mod postgres;
mod sqlite;
