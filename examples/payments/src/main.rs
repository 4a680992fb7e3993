//! Run with: cargo run -p payments
//!
//! A small payments API protected by idem; see the `payments` library for the contract. Logs go to
//! stderr; once the service accepts connections, stdout gets one line,
//! `payments listening on http://127.0.0.1:<port>` (so that `PORT=0` is usable from scripts).

use std::io::Write;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    payments::logs::init();
    match start().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("payments: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn start() -> Result<(), payments::StartError> {
    let server = payments::Server::bind(&payments::Config::from_env()?).await?;
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "payments listening on http://{}",
        server.local_addr()?
    )?;
    stdout.flush()?;
    drop(stdout);
    server.run().await
}
