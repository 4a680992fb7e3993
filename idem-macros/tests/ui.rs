//! Compile-time errors of `#[idempotent]`: every mistake in `ui/fail` (one per file, named for it)
//! fails with the message committed next to it in `.stderr`. The good forms are `forms.rs`'s, an
//! ordinary test: with no case here that must build and run, trybuild only type-checks.
//!
//! The `.stderr` files match the compiler that wrote them, [`SNAPSHOT_RUSTC`]: compiler wording
//! and layout change between releases. The repository's `rust-toolchain.toml` pins that compiler,
//! so rustup builds and runs everything here with it (installing it first if need be). On another
//! compiler (`cargo +nightly test`, a rustc without rustup) the cases cannot match: under CI
//! (`CI=true`) the test fails and says so; elsewhere it is skipped, with a note on the test's
//! output, and `IDEM_UI_FAIL=1` runs the cases anyway.
//!
//! After a deliberate change to a message, or to move to a newer compiler (`rust-toolchain.toml`
//! and [`SNAPSHOT_RUSTC`] together), regenerate with
//! `TRYBUILD=overwrite cargo test -p idem-macros --test ui` and read every changed `.stderr`: each
//! must still tell a user what is wrong and how to fix it.
//!
//! The cases are compiled in their own target directory, with this crate's dependencies and
//! dev-dependencies only: keep those to what the cases need.

use std::io::Write;
use std::process::Command;

/// The compiler the `.stderr` snapshots were written with: `rust-toolchain.toml`'s channel.
const SNAPSHOT_RUSTC: &str = "1.95.0";

#[test]
fn ui() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .unwrap_or_default();
    // `rustc 1.95.0 (hash date)`: not a `1.95.0-nightly` or `-beta`.
    let snapshots_compiler = version.starts_with(&format!("rustc {SNAPSHOT_RUSTC} "));
    if !snapshots_compiler && std::env::var_os("IDEM_UI_FAIL").is_none() {
        let why = format!(
            "the compile-fail UI cases compare with .stderr snapshots written by rustc \
             {SNAPSHOT_RUSTC} (rust-toolchain.toml), and this is `{version}`: run them with \
             `cargo +{SNAPSHOT_RUSTC} test -p idem-macros --test ui` \
             (`rustup toolchain install {SNAPSHOT_RUSTC}` first if need be)"
        );
        // Under CI a check that cannot run is a failure, never a pass.
        assert!(!ci(), "{why}");
        // Written to the process's stderr, past the test harness's capture, so that it shows
        // in every run and not only with `--nocapture`.
        let _ = writeln!(
            std::io::stderr(),
            "note: NOT run: {why}; IDEM_UI_FAIL=1 runs them anyway"
        );
        return;
    }
    trybuild::TestCases::new().compile_fail("tests/ui/fail/*.rs");
}

/// `CI=true` (or `1`), as the workspace's tests read it.
fn ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true" | "1"))
}

/// `rust-toolchain.toml` pins the compiler that wrote the snapshots: changing one without the
/// other would have CI compare the snapshots with a compiler that did not write them.
#[test]
fn the_pinned_toolchain_is_the_one_that_wrote_the_snapshots() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../rust-toolchain.toml");
    let pin = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let channel = format!("channel = \"{SNAPSHOT_RUSTC}\"");
    assert!(pin.lines().any(|line| line.trim() == channel), "{pin}");
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
