//! A simulated card network, standing in for a remote payment provider.
//!
//! It behaves as the real ones do where it matters to idempotency:
//!
//! - **A charge request, once sent, is carried out** even if the caller stops waiting for the
//!   answer (a timeout, a crash, a client that hung up): the network records the charge as the
//!   request arrives, then takes `PAYMENT_LATENCY_MS` to answer.
//! - **It deduplicates by the caller's idempotency key**, as Stripe, Adyen and Checkout.com do: a
//!   repeat with a key it has seen makes no new charge, counts one more attempt, and answers with
//!   the first charge. The service passes idem's downstream key (`Attempt::downstream_key`), so a
//!   run that takes over a crashed one never charges twice.
//!
//! Its charges live in the ledger's database (`card_charges`), written on their own, outside any
//! transaction of the service's: they stand for state on the provider's side, which no rollback of
//! ours undoes. `GET /charges` lists them, so that a test can count what the network really did.

use crate::ledger::Database;
use serde::Serialize;
use std::time::Duration;

/// One charge the network made, as `GET /charges` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Charge {
    /// The charge's id at the network (`ch_` and 32 hex digits).
    pub id: String,
    /// In the currency's minor unit.
    pub amount: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// The calls the network received for this charge: 1, plus every deduplicated repeat.
    pub attempts: i64,
    /// Whether it was refunded.
    pub refunded: bool,
}

/// The card network (simulated; see the [module documentation](self)).
#[derive(Debug, Clone)]
pub struct CardNetwork {
    db: Database,
    latency: Duration,
}

impl CardNetwork {
    /// A network keeping its charges in `db`, answering after `latency`.
    pub fn new(db: Database, latency: Duration) -> Self {
        Self { db, latency }
    }

    /// The database the network keeps its charges in.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Charges `amount` to `owner`'s card under `idempotency_key`; returns the charge's id, the same
    /// for every call with that key.
    pub async fn charge(
        &self,
        owner: &str,
        amount: i64,
        currency: &str,
        idempotency_key: &str,
    ) -> Result<String, sqlx::Error> {
        let network = self.clone();
        let (owner, currency, key) = (owner.to_owned(), currency.to_owned(), idempotency_key);
        let key = key.to_owned();
        // The network's own task: it goes on if the caller stops waiting.
        let call = tokio::spawn(async move {
            let id = network.record(&owner, amount, &currency, &key).await?;
            tokio::time::sleep(network.latency).await;
            Ok(id)
        });
        call.await
            .map_err(|e| sqlx::Error::Io(std::io::Error::other(e)))?
    }

    /// Refunds the charge `charge_id` (refunding twice changes nothing).
    pub async fn refund(&self, charge_id: &str) -> Result<(), sqlx::Error> {
        match &self.db {
            Database::Sqlite(pool) => {
                sqlx::query("UPDATE card_charges SET refunded = 1 WHERE id = ?")
                    .bind(charge_id)
                    .execute(pool)
                    .await?;
            }
            Database::Postgres(pool) => {
                sqlx::query("UPDATE card_charges SET refunded = true WHERE id = $1")
                    .bind(charge_id)
                    .execute(pool)
                    .await?;
            }
            Database::MySql(pool) => {
                sqlx::query("UPDATE card_charges SET refunded = TRUE WHERE id = ?")
                    .bind(charge_id)
                    .execute(pool)
                    .await?;
            }
        }
        tokio::time::sleep(self.latency).await;
        Ok(())
    }

    /// `owner`'s charges, oldest first.
    pub async fn charges(&self, owner: &str) -> Result<Vec<Charge>, sqlx::Error> {
        const LIST: &str = "SELECT id, amount, currency, attempts, refunded FROM card_charges
                            WHERE owner = $1 ORDER BY seq";
        let charge = |row: (String, i64, String, i64, bool)| Charge {
            id: row.0,
            amount: row.1,
            currency: row.2,
            attempts: row.3,
            refunded: row.4,
        };
        Ok(match &self.db {
            Database::Sqlite(pool) => sqlx::query_as(LIST).bind(owner).fetch_all(pool).await?,
            Database::Postgres(pool) => sqlx::query_as(LIST).bind(owner).fetch_all(pool).await?,
            Database::MySql(pool) => {
                sqlx::query_as(
                    "SELECT CAST(id AS CHAR), amount, CAST(currency AS CHAR), attempts, refunded
                     FROM card_charges WHERE owner = ? ORDER BY seq",
                )
                .bind(owner)
                .fetch_all(pool)
                .await?
            }
        }
        .into_iter()
        .map(charge)
        .collect())
    }

    /// The charge for `key`: inserted by the first call, counted by every repeat.
    async fn record(
        &self,
        owner: &str,
        amount: i64,
        currency: &str,
        key: &str,
    ) -> Result<String, sqlx::Error> {
        const UPSERT: &str = "
            INSERT INTO card_charges (idempotency_key, id, owner, amount, currency, attempts)
            VALUES ($1, $2, $3, $4, $5, 1)
            ON CONFLICT (idempotency_key) DO UPDATE SET attempts = card_charges.attempts + 1
            RETURNING id";
        let id = format!("ch_{}", uuid::Uuid::new_v4().simple());
        let (key, owner, currency) = (key.to_owned(), owner.to_owned(), currency.to_owned());
        match &self.db {
            Database::Sqlite(pool) => {
                sqlx::query_scalar(UPSERT)
                    .bind(key)
                    .bind(id)
                    .bind(owner)
                    .bind(amount)
                    .bind(currency)
                    .fetch_one(pool)
                    .await
            }
            Database::Postgres(pool) => {
                sqlx::query_scalar(UPSERT)
                    .bind(key)
                    .bind(id)
                    .bind(owner)
                    .bind(amount)
                    .bind(currency)
                    .fetch_one(pool)
                    .await
            }
            // No `RETURNING` on MySQL: the upsert, then the charge's id by its key.
            Database::MySql(pool) => {
                sqlx::query(
                    "INSERT INTO card_charges
                       (idempotency_key, id, owner, amount, currency, attempts)
                     VALUES (?, ?, ?, ?, ?, 1)
                     ON DUPLICATE KEY UPDATE attempts = attempts + 1",
                )
                .bind(&key)
                .bind(id)
                .bind(owner)
                .bind(amount)
                .bind(currency)
                .execute(pool)
                .await?;
                sqlx::query_scalar(
                    "SELECT CAST(id AS CHAR) FROM card_charges WHERE idempotency_key = ?",
                )
                .bind(key)
                .fetch_one(pool)
                .await
            }
        }
    }
}
