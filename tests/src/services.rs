//! Where the shared services are, and what a test does when one is not there.
//!
//! Tests read `IDEM_TEST_POSTGRES_URL` and `IDEM_TEST_REDIS_URL`, defaulting to the local services
//! the development and CI machines run. Under CI (`CI=true`) an unreachable service fails the test;
//! on a laptop without it the test prints plainly that it was skipped.

/// The PostgreSQL server URL for tests (a database name is appended per test run).
pub fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// The Redis URL for tests.
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Whether this run is under CI, where a missing service is a failure.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Handles an unreachable service: panics under CI, otherwise says plainly that the test is skipped.
/// Returns `None` so callers can `return` from the test.
pub fn unreachable_service<T>(service: &str, error: &dyn std::fmt::Display) -> Option<T> {
    if under_ci() {
        panic!("{service} is required under CI but unreachable: {error}");
    }
    eprintln!("SKIPPED: {service} is unreachable ({error}); start it as README.md describes");
    None
}
