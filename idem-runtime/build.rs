//! Rebuilds the crate when the embedded SQL migrations change.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
