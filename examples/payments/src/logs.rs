//! Logs to stderr, filtered by `RUST_LOG` (default `info,idem=debug`), for both binaries.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; call once, at the start of `main`.
pub fn init() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,idem=debug")),
        )
        .init();
}
