//! Run with: cargo run -p payments
//!
//! A small payments API protected by idem; see the `payments` library for the contract.

use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> Result<(), payments::StartError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,idem=debug")),
        )
        .init();
    payments::serve(payments::Config::from_env()?).await
}
