//! Run with: cargo run -p payments --bin charge-consumer
//!
//! Charges the payments requested on a RabbitMQ queue, once per message_id; see the `payments`
//! library's `consumer` module for the contract. Logs go to stderr; once it consumes, stdout gets
//! one line, `charge-consumer ready`.

use std::io::Write;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    payments::logs::init();
    let config = match payments::consumer::ConsumerConfig::from_env() {
        Ok(config) => config,
        Err(error) => return fail(&error),
    };
    let consumer = match payments::consumer::ChargeConsumer::connect(&config).await {
        Ok(consumer) => consumer,
        Err(error) => return fail(&error),
    };
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = writeln!(stdout, "charge-consumer ready").and_then(|()| stdout.flush()) {
        return fail(&error);
    }
    drop(stdout);
    match consumer.run(payments::stop_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => fail(&error),
    }
}

fn fail(error: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("charge-consumer: {error}");
    ExitCode::FAILURE
}
