//! The store conformance suite (`idem_tests::conformance`) on every store, each store's own extras,
//! and a Redis Cluster primary killed under load.

mod memory;
mod mysql;
mod postgres;
mod redis;
mod redis_cluster;
mod redis_cluster_failover;
mod sqlite;
