//! The tests (tests/cli.rs) need PostgreSQL and Redis: `IDEM_TEST_SKIP` is read as for the
//! workspace's tests.

#[path = "../tests/build.rs"]
mod test_skip;

fn main() {
    test_skip::main();
}
