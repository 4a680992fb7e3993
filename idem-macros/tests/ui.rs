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

/// The layer (`IdempotencyLayer` without a scope, the case `layer_without_scope`) and the
/// attribute (`scope_missing`) say the same thing about a missing scope, each in its own terms.
/// Both messages are compile errors, so their committed snapshots are where they can be compared;
/// [`ui`] checks the snapshots against the compiler.
#[test]
fn a_missing_scope_is_worded_alike_by_the_layer_and_the_attribute() {
    let opening = "missing `scope`: keys are unique per caller, so name";
    let closing = "to share keys between all callers";
    for case in ["scope_missing", "layer_without_scope"] {
        let path = format!("tests/ui/fail/{case}.stderr");
        let stderr = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.contains(opening) && first.contains(closing),
            "{case}: {stderr}"
        );
    }
}
