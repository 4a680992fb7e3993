//! Rebuilds the example when a migration changes, so that `sqlx::migrate!` embeds the current files.
//! The example's own tests (tests/) need PostgreSQL, MariaDB, Redis and RabbitMQ: `IDEM_TEST_SKIP`
//! is read as for the workspace's tests.

#[path = "../../tests/build.rs"]
mod test_skip;

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    test_skip::main();
}
