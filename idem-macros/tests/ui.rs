//! Compile-time errors of `#[idempotent]`: every mistake in `ui/fail` (one per file, named for it)
//! fails with the message committed next to it in `.stderr`. The good forms are `forms.rs`'s, an
//! ordinary test: with no case here that must build and run, trybuild only type-checks.
//!
//! The `.stderr` files match the compiler they were written with ([`SNAPSHOT_RUSTC`]): compiler
//! wording and layout change between releases. On another compiler the cases are skipped, with a
//! note on the test's output; `IDEM_UI_FAIL=1` runs them anyway. After a deliberate change to a message, regenerate with
//! `TRYBUILD=overwrite cargo test -p idem-macros --test ui` and read every changed `.stderr`: each
//! must still tell a user what is wrong and how to fix it.
//!
//! The cases are compiled in their own target directory, with this crate's dependencies and
//! dev-dependencies only: keep those to what the cases need.

use std::io::Write;
use std::process::Command;

/// The compiler the `.stderr` snapshots were written with.
const SNAPSHOT_RUSTC: &str = "rustc 1.95.";

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default();
    if version.starts_with(SNAPSHOT_RUSTC) || std::env::var_os("IDEM_UI_FAIL").is_some() {
        cases.compile_fail("tests/ui/fail/*.rs");
    } else {
        // Written to the process's stderr, past the test harness's capture, so that it shows
        // in every run and not only with `--nocapture`.
        let _ = writeln!(
            std::io::stderr(),
            "note: the compile-fail UI cases were NOT run: their .stderr match {SNAPSHOT_RUSTC}x, \
             this is {version} (IDEM_UI_FAIL=1 runs them anyway)"
        );
    }
}
