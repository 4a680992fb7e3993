//! Compile-time behaviour of `#[idempotent]`: every good form in `ui/pass` compiles (and its router
//! accepts the handler), every mistake in `ui/fail` (one per file, named for it) fails with the
//! message committed next to it in `.stderr`.
//!
//! The `.stderr` files match rustc 1.95 (the toolchain on our machines). Compiler wording and
//! layout change between releases, so on another toolchain the compile-fail half is skipped (with
//! a message) and only the pass cases run. After a deliberate change to a message, regenerate with
//! `TRYBUILD=overwrite cargo test -p idem-tests --test ui` and read every changed `.stderr`: each
//! must still tell a user what is wrong and how to fix it.

use std::process::Command;

/// The toolchain the `.stderr` snapshots were written with.
const SNAPSHOT_RUSTC: &str = "rustc 1.95.";

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default();
    if version.starts_with(SNAPSHOT_RUSTC) {
        cases.compile_fail("ui/fail/*.rs");
    } else {
        println!(
            "skipped the compile-fail UI cases: their .stderr match {SNAPSHOT_RUSTC}x, this is {}",
            version.trim()
        );
    }
}
