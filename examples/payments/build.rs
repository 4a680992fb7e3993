//! Rebuilds the example when a migration changes, so that `sqlx::migrate!` embeds the current files.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
