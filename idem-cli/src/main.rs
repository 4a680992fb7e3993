//! `idem`: see and act on idempotency records from a shell, without the application running.
//!
//! ```text
//! idem inspect   --store URL --scope S --key K        one record: state, times, stored response
//! idem forget    --store URL --scope S --key K        delete it, so the key runs again
//! idem erase     --store URL --scope S                delete every record of a caller
//! idem in-flight --store URL --older-than 30s         claims in flight for that long
//! idem stats     --store URL                          how many records, by state
//! ```
//!
//! `--store` takes the URLs the payments example's `IDEM_STORE_URL` takes (and reads that variable
//! when the flag is absent): `sqlite:path`, `postgres://…`, `mysql://…`, `redis://…`, `redis-cluster://…`.
//! `--json` prints one JSON document with stable field names. Exit codes: 0 found or done, 1 not
//! found (or not forgotten), 2 a usage error or a store that cannot be opened or read.

mod render;

use clap::{Args, Parser, Subcommand};
use idem_runtime::admin::{Forgettable, Forgotten};
use idem_runtime::store::OpenError;
use idem_runtime::Engine;
use std::process::ExitCode;
use std::time::Duration;

/// See and act on idem's idempotency records in a store.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where the records are, and how to print.
#[derive(Debug, Args)]
struct Store {
    /// The store's URL: sqlite:path, postgres://…, mysql://…, redis://host:port/db?prefix=name (db and
    /// prefix optional), redis-cluster://host:port,host:port…?prefix=name.
    #[arg(
        long,
        env = "IDEM_STORE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    store: String,
    /// Print one JSON document (stable field names) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the record of one key: state, times, the stored response's status, headers and size.
    Inspect {
        #[command(flatten)]
        store: Store,
        /// The caller's scope as the application gives it (user id, tenant, or `global`).
        #[arg(long)]
        scope: String,
        /// The `Idempotency-Key` as the client sent it.
        #[arg(long)]
        key: String,
    },
    /// Delete the record of one key, so that its next request runs as new.
    ///
    /// Completed and released records only, unless `--dead-claims` (also claims whose lease ran
    /// out) or `--force` (also a live claim: its handler may still be running, and a retry would
    /// run it a second time).
    Forget {
        #[command(flatten)]
        store: Store,
        /// The caller's scope as the application gives it.
        #[arg(long)]
        scope: String,
        /// The `Idempotency-Key` as the client sent it.
        #[arg(long)]
        key: String,
        /// Also forget a claim whose lease ran out (a worker that died).
        #[arg(long, conflicts_with = "force")]
        dead_claims: bool,
        /// Forget whatever the state, a live claim included.
        #[arg(long)]
        force: bool,
    },
    /// Delete every record of one scope, stored responses included (an erasure request).
    Erase {
        #[command(flatten)]
        store: Store,
        /// The caller's scope as the application gives it.
        #[arg(long)]
        scope: String,
    },
    /// List the claims in flight for at least a given age, oldest first.
    InFlight {
        #[command(flatten)]
        store: Store,
        /// The least age: `500ms`, `30s`, `5m`, `2h`, `1d` (a bare number is seconds).
        #[arg(long, value_name = "AGE", default_value = "0s", value_parser = parse_duration)]
        older_than: Duration,
        /// At most this many records.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Count the store's records by state.
    Stats {
        #[command(flatten)]
        store: Store,
    },
}

/// What ended a command: the exit code, and for 2 the message on stderr.
enum Failure {
    /// Exit 1: nothing found, or nothing done (the output says why).
    NotFound,
    /// Exit 2: the store could not be opened or read.
    Store(String),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // clap prints usage errors itself and exits 2; `--help` and `--version` exit 0.
    let cli = Cli::parse();
    match run(cli.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::NotFound) => ExitCode::from(1),
        Err(Failure::Store(message)) => {
            eprintln!("idem: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Inspect { store, scope, key } => {
            let engine = open(&store.store).await?;
            let found = engine.inspect(&scope, &key).await.map_err(read_error)?;
            render::inspection(store.json, &scope, &key, found.as_ref());
            found.map(drop).ok_or(Failure::NotFound)
        }
        Command::Forget {
            store,
            scope,
            key,
            dead_claims,
            force,
        } => {
            let allowed = match (dead_claims, force) {
                (_, true) => Forgettable::Anything,
                (true, false) => Forgettable::DeadClaims,
                (false, false) => Forgettable::Done,
            };
            let engine = open(&store.store).await?;
            let forgotten = engine
                .forget(&scope, &key, allowed)
                .await
                .map_err(read_error)?;
            render::forgotten(store.json, &scope, &key, forgotten);
            match forgotten {
                Forgotten::Deleted(_) => Ok(()),
                _ => Err(Failure::NotFound),
            }
        }
        Command::Erase { store, scope } => {
            let engine = open(&store.store).await?;
            let erased = engine.erase(&scope).await.map_err(read_error)?;
            render::erased(store.json, &scope, erased);
            Ok(())
        }
        Command::InFlight {
            store,
            older_than,
            limit,
        } => {
            let engine = open(&store.store).await?;
            let (listed, now) = engine
                .in_flight(older_than, limit)
                .await
                .map_err(read_error)?;
            render::in_flight(store.json, older_than, &listed, now);
            if listed.is_empty() {
                Err(Failure::NotFound)
            } else {
                Ok(())
            }
        }
        Command::Stats { store } => {
            let engine = open(&store.store).await?;
            let stats = engine.stats().await.map_err(read_error)?;
            render::stats(store.json, engine.store().kind(), &stats);
            Ok(())
        }
    }
}

/// The engine over the store at `url`; the error never repeats the URL (it may hold a password).
async fn open(url: &str) -> Result<Engine, Failure> {
    match idem_runtime::store::open(url).await {
        Ok(opened) => Ok(Engine::from_arc(opened.store)),
        Err(OpenError::Unsupported(why)) => Err(Failure::Store(format!("--store: {why}"))),
        Err(e) => Err(Failure::Store(format!("cannot open the store: {e}"))),
    }
}

fn read_error(e: idem_runtime::StoreError) -> Failure {
    Failure::Store(format!("the store failed: {e}"))
}

/// `500ms`, `30s`, `5m`, `2h`, `1d`, or a bare number of seconds.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not an age such as 30s, 5m or 2h"))?;
    let seconds = |factor: u64| {
        number
            .checked_mul(factor)
            .map(Duration::from_secs)
            .ok_or_else(|| format!("`{text}` is too long"))
    };
    match unit.trim() {
        "ms" => Ok(Duration::from_millis(number)),
        "" | "s" => seconds(1),
        "m" => seconds(60),
        "h" => seconds(3600),
        "d" => seconds(86_400),
        other => Err(format!(
            "unknown unit `{other}` in `{text}`: use ms, s, m, h or d"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_duration, Cli};
    use clap::CommandFactory;
    use std::time::Duration;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn ages_parse_with_their_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
    }
}
