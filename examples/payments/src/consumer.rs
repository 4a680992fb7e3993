//! The charge consumer (`cargo run -p payments --bin charge-consumer`): payments requested as
//! RabbitMQ messages, each charged once however often it is delivered.
//!
//! A message on the queue `CHARGE_QUEUE` is a JSON body `{"user": "<id>", "amount": 1000,
//! "currency": "KRW"}`; its AMQP `message_id` property is its idempotency key. It becomes one
//! payment of that user, charged through the card network, in the same ledger the HTTP service
//! serves (`GET /payments`, `GET /charges`). The work runs under [`Engine::once`]:
//!
//! - **Record.** Scope `charges:<user>` (the user's, in a namespace of its own: an HTTP record's
//!   scope is the bare user id, so an `Idempotency-Key` never meets a `message_id`), key the
//!   `message_id`, fingerprint the request (user, amount, currency). The stored output is the
//!   payment's and the charge's ids ([`Charged`]).
//! - **Once.** The card network is called with the record's downstream key, the same on a takeover,
//!   and deduplicates by it; the payment is recorded once per charge (a unique `charge_id`,
//!   insert-or-return-existing). So a consumer killed between its charge, its payment and its
//!   stored output leaves a message whose redelivery finds the same charge and the same payment.
//!
//! What happens to each delivery ([`Verdict`]):
//!
//! | the message | the consumer |
//! |---|---|
//! | charged now, or its stored output found | acks it, once the output is stored |
//! | the same `message_id` running elsewhere | waits for it (`policy.wait`) and acks; still running then: requeues it |
//! | the idempotency store or the ledger unreachable, the charge failed | requeues it (nack, `requeue`), after a short pause: nothing charged without a claim |
//! | no `message_id`, a body that is not the JSON above, an amount, currency or user out of range | dead-letters it |
//! | its `message_id` used with another body (mismatch), or past its ttl (expired) | dead-letters it |
//!
//! **Dead letters** are published by the consumer itself to `<queue>.dead` (declared durable), in
//! publisher-confirm mode, with the reason in the header `x-dead-reason`; the original is acked only
//! once the broker confirmed the copy (an unconfirmed copy requeues the original instead). The
//! queue's `x-dead-letter-*` arguments would do it in the broker, but only on a queue declared with
//! them, and re-declaring an existing queue with other arguments fails; publishing works on any
//! queue and carries the reason. A consumer killed between the confirm and the ack dead-letters
//! that message again when it comes back: a dead letter is delivered at least once.
//!
//! **Drain.** On SIGTERM or Ctrl-C the consumer cancels its subscription (the broker sends no
//! more), finishes the messages it was given and acks them, closes the connection and exits 0, all
//! within `SHUTDOWN_GRACE_MS`; what is still running then is left unacked, and the broker delivers
//! it again (its key is taken over after the lease).

use crate::ledger::Ledger;
use crate::{card::CardNetwork, Background, Config, StartError};
use futures_util::StreamExt;
use idem_runtime::function::{Attempt, CallError, OnceError};
use idem_runtime::{Engine, Fingerprint, Policy, RecordKey, Rejection};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The default `AMQP_URL`: the local RabbitMQ, user `guest`, vhost `/`.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The default `CHARGE_QUEUE`.
pub const DEFAULT_QUEUE: &str = "charges";

/// How many unacked messages the broker hands one consumer at a time; they run concurrently.
pub const PREFETCH: u16 = 16;

/// The default lease of a message's claim (`CHARGE_LEASE_MS`): renewed while the message runs, it
/// only bounds how long a killed consumer's messages wait before another takes them over.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// How long a message whose `message_id` runs elsewhere waits for it before being requeued.
const WAIT: Duration = Duration::from_secs(5);

/// The pause before requeueing a message that failed for a reason that takes time to go away (a
/// store or database down), so that the consumer does not spin on it.
const REQUEUE_PAUSE: Duration = Duration::from_millis(500);

/// The header of a dead letter that says why it was dead-lettered.
pub const DEAD_REASON_HEADER: &str = "x-dead-reason";

/// The scope of a message's record: the user's, in the consumer's namespace (`:` is not in a user
/// id, which is the whole scope of the HTTP service's records).
pub fn record_scope(user: &str) -> String {
    format!("charges:{user}")
}

/// The largest amount taken, as `POST /payments` takes it.
const MAX_AMOUNT: i64 = (1 << 53) - 1;

/// The consumer's configuration: the service's ([`Config`]: `DATABASE_URL`, `IDEM_STORE_URL`,
/// `PAYMENT_LATENCY_MS`, `SHUTDOWN_GRACE_MS`) and its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// The ledger, the records and the card network, as the HTTP service has them.
    pub service: Config,
    /// `AMQP_URL`: the broker.
    pub amqp_url: String,
    /// `CHARGE_QUEUE`: the queue consumed (declared durable if missing); dead letters go to this
    /// name plus `.dead`.
    pub queue: String,
    /// `CHARGE_LEASE_MS`: the lease of a message's claim.
    pub lease: Duration,
}

impl ConsumerConfig {
    /// Reads the environment.
    pub fn from_env() -> Result<Self, StartError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `lookup`; unset and empty variables take defaults.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, StartError> {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let lease = match var("CHARGE_LEASE_MS") {
            Some(v) => v
                .trim()
                .parse()
                .ok()
                .filter(|ms| *ms > 0)
                .map(Duration::from_millis)
                .ok_or_else(|| {
                    StartError::Config(format!(
                        "CHARGE_LEASE_MS must be a positive whole number of milliseconds, not `{v}`"
                    ))
                })?,
            None => DEFAULT_LEASE,
        };
        Ok(Self {
            service: Config::from_lookup(&lookup)?,
            amqp_url: var("AMQP_URL").unwrap_or_else(|| DEFAULT_AMQP_URL.to_owned()),
            queue: var("CHARGE_QUEUE").unwrap_or_else(|| DEFAULT_QUEUE.to_owned()),
            lease,
        })
    }

    /// The dead-letter queue: the queue's name plus `.dead`.
    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.queue)
    }
}

/// A charge request, the body of a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// The user charged: 1 to 4096 of `a-z`, `0-9`, `-` and `_` (as the HTTP service's bearer).
    pub user: String,
    /// In the currency's minor unit, from 1 to 2^53 - 1.
    pub amount: i64,
    /// ISO 4217 code: three capital letters.
    pub currency: String,
}

impl ChargeRequest {
    /// Reads and checks a message body; the error says what is wrong.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let request: Self =
            serde_json::from_slice(body).map_err(|e| format!("malformed body: {e}"))?;
        if !crate::auth::is_user_id(&request.user) {
            return Err("`user` must be 1 to 4096 of a-z, 0-9, - and _".to_owned());
        }
        if !(1..=MAX_AMOUNT).contains(&request.amount) {
            return Err("`amount` must be a whole number from 1 to 2^53 - 1".to_owned());
        }
        if request.currency.len() != 3 || !request.currency.bytes().all(|b| b.is_ascii_uppercase())
        {
            return Err("`currency` must be an ISO 4217 code such as \"KRW\"".to_owned());
        }
        Ok(request)
    }
}

/// What a message became: its record's stored output, returned to every redelivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charged {
    /// The payment in the ledger (`pay_…`).
    pub payment_id: String,
    /// The card network's charge (`ch_…`).
    pub charge_id: String,
}

/// What the consumer does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Settled (charged now, or earlier): ack.
    Ack {
        /// The outcome.
        charged: Charged,
        /// Whether this delivery ran the charge (`false`: the stored output was found).
        ran: bool,
    },
    /// Not settled, for a reason that may pass: nack with requeue.
    Requeue {
        /// Why.
        reason: String,
        /// Whether to pause first (the reason takes time to go away).
        pause: bool,
    },
    /// Never settles: publish to the dead-letter queue, then ack.
    DeadLetter {
        /// Why.
        reason: String,
    },
}

/// Why the consumer stopped other than by a stop signal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The broker connection failed.
    #[error("the broker connection failed: {0}")]
    Connection(#[from] lapin::Error),
    /// The broker ended the subscription (the queue was deleted, say).
    #[error("the broker cancelled the subscription (was the queue deleted?)")]
    Cancelled,
}

/// The part of the consumer that turns a delivery into a [`Verdict`]: the engine, the ledger and the
/// card network.
#[derive(Debug, Clone)]
pub struct Charger {
    engine: Engine,
    ledger: Ledger,
    card: CardNetwork,
    policy: Policy,
}

impl Charger {
    /// A charger over these parts, claiming each message for `lease`.
    pub fn new(engine: Engine, ledger: Ledger, card: CardNetwork, lease: Duration) -> Self {
        let policy = Policy::new()
            .ttl(Duration::from_secs(24 * 3600))
            .lease(lease)
            .wait(WAIT)
            .handler("charge-consumer");
        Self {
            engine,
            ledger,
            card,
            policy,
        }
    }

    /// Decides a message with `message_id` (its AMQP property) and `body`, charging it if it was not
    /// charged yet.
    pub async fn decide(&self, message_id: Option<&str>, body: &[u8]) -> Verdict {
        let dead = |reason: String| Verdict::DeadLetter { reason };
        let Some(message_id) = message_id.filter(|id| !id.is_empty()) else {
            return dead("no message_id".to_owned());
        };
        let request = match ChargeRequest::parse(body) {
            Ok(request) => request,
            Err(reason) => return dead(reason),
        };
        let fingerprint = match Fingerprint::of_input(&request) {
            Ok(fingerprint) => fingerprint,
            Err(e) => return dead(format!("could not fingerprint the body: {e}")),
        };
        let key = RecordKey::new(record_scope(&request.user), message_id);
        let ran = AtomicBool::new(false);
        let work = |attempt: Attempt| {
            ran.store(true, Ordering::Relaxed);
            self.charge(&request, attempt)
        };
        match self.engine.once(key, fingerprint, &self.policy, work).await {
            Ok(charged) => Verdict::Ack {
                charged,
                ran: ran.load(Ordering::Relaxed),
            },
            Err(CallError::Once(OnceError::Rejected(Rejection::Mismatch { .. }))) => {
                dead("mismatch: this message_id was used with another body".to_owned())
            }
            Err(CallError::Once(OnceError::Rejected(Rejection::Expired { .. }))) => {
                dead("expired: this message_id is past its ttl".to_owned())
            }
            // Still running elsewhere after the wait: the wait was the pause.
            Err(CallError::Once(OnceError::Rejected(Rejection::InFlight { .. }))) => {
                Verdict::Requeue {
                    reason: format!(
                        "in flight: this message_id still runs elsewhere after {WAIT:?}"
                    ),
                    pause: false,
                }
            }
            Err(e) if e.is_retryable() => Verdict::Requeue {
                reason: describe(&e),
                pause: true,
            },
            Err(e) => dead(describe(&e)),
        }
    }

    /// The work under the claim: the charge under the record's downstream key, then the payment of
    /// that charge (once per charge).
    async fn charge(
        &self,
        request: &ChargeRequest,
        attempt: Attempt,
    ) -> Result<Charged, sqlx::Error> {
        let ChargeRequest {
            user,
            amount,
            currency,
        } = request;
        if attempt.taken_over() {
            tracing::warn!(%user, "taking over a message whose first run stopped; the card network deduplicates its charge");
        }
        let charge_id = self
            .card
            .charge(user, *amount, currency, attempt.downstream_key())
            .await?;
        let payment = self
            .ledger
            .capture(user, *amount, currency, &charge_id)
            .await?;
        Ok(Charged {
            payment_id: payment.id,
            charge_id,
        })
    }
}

/// A [`CallError`] in a line, its causes included (each once: some say their cause themselves).
fn describe(e: &CallError<sqlx::Error>) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The consumer, connected and subscribed: ready to [`run`](Self::run).
pub struct ChargeConsumer {
    charger: Charger,
    connection: Connection,
    channel: Channel,
    dead_channel: Channel,
    consumer: lapin::Consumer,
    queue: String,
    dead_queue: String,
    grace: Duration,
    _background: Background,
}

impl std::fmt::Debug for ChargeConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChargeConsumer")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

fn broker(what: &str, e: lapin::Error) -> StartError {
    StartError::Broker(format!("AMQP_URL: {what}: {e}"))
}

impl ChargeConsumer {
    /// Opens the ledger, the idempotency store and the card network as the HTTP service does,
    /// connects to the broker, declares the queue and its dead-letter queue (durable) and
    /// subscribes with a prefetch of [`PREFETCH`].
    pub async fn connect(config: &ConsumerConfig) -> Result<Self, StartError> {
        let ledger = Ledger::open(&config.service.database_url).await?;
        let records = crate::store::open(config.service.idem_store_url.as_deref(), &ledger).await?;
        tracing::info!(records = %records.describe, "idempotency store ready");
        let background = Background::own([tokio::spawn(records.sweeper.run())]);
        let card = CardNetwork::new(ledger.database().clone(), config.service.payment_latency);
        let engine = Engine::from_arc(records.store);
        let charger = Charger::new(engine, ledger, card, config.lease);

        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current())
            .with_connection_name("charge-consumer".into());
        let connection = Connection::connect(&config.amqp_url, properties)
            .await
            .map_err(|e| broker("could not connect", e))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| broker("could not open a channel", e))?;
        let dead_channel = connection
            .create_channel()
            .await
            .map_err(|e| broker("could not open a channel", e))?;
        let dead_queue = config.dead_queue();
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        for queue in [&config.queue, &dead_queue] {
            channel
                .queue_declare(queue, durable, FieldTable::default())
                .await
                .map_err(|e| broker(&format!("could not declare the queue `{queue}`"), e))?;
        }
        dead_channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| broker("could not turn on publisher confirms", e))?;
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .map_err(|e| broker("could not set the prefetch", e))?;
        let consumer = channel
            .basic_consume(
                &config.queue,
                "",
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| broker(&format!("could not consume `{}`", config.queue), e))?;
        tracing::info!(queue = %config.queue, dead = %dead_queue, prefetch = PREFETCH, "consuming");
        Ok(Self {
            charger,
            connection,
            channel,
            dead_channel,
            consumer,
            queue: config.queue.clone(),
            dead_queue,
            grace: config.service.limits.shutdown_grace,
            _background: background,
        })
    }

    /// Consumes until `stop` resolves, then drains: cancels the subscription, finishes and acks the
    /// messages it was given, and closes the connection, within the shutdown grace period. An error
    /// if the broker connection failed, or the broker ended the subscription, first (the messages in
    /// progress are finished then too, within the grace period).
    pub async fn run(self, stop: impl Future<Output = ()>) -> Result<(), ConsumeError> {
        let Self {
            charger,
            connection,
            channel,
            dead_channel,
            mut consumer,
            queue,
            dead_queue,
            grace,
            _background,
        } = self;
        let settler = Arc::new(Settler {
            charger,
            dead_channel,
            dead_queue,
        });
        let mut tasks = JoinSet::new();
        // The end of the shutdown grace period, once the stop signal came.
        let mut deadline: Option<Instant> = None;
        let mut failed = None;
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop, if deadline.is_none() => {
                    deadline = Some(Instant::now() + grace);
                    tracing::info!(in_progress = tasks.len(), "stop signal received; cancelling the subscription and finishing the messages in progress");
                    let tag = consumer.tag();
                    if let Err(e) = channel.basic_cancel(tag.as_str(), BasicCancelOptions::default()).await {
                        tracing::error!(error = %e, "could not cancel the subscription");
                        break;
                    }
                }
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        let settler = settler.clone();
                        tasks.spawn(async move { settler.settle(delivery).await });
                    }
                    Some(Err(e)) => {
                        tracing::error!(error = %e, "the broker connection failed");
                        failed = Some(ConsumeError::Connection(e));
                        break;
                    }
                    // Cancelled: by us (the drain), or by the broker (the queue deleted, say).
                    None => {
                        if deadline.is_none() {
                            tracing::error!("the broker cancelled the subscription");
                            failed = Some(ConsumeError::Cancelled);
                        }
                        break;
                    }
                },
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Err(e) = joined {
                        tracing::error!(error = %e, "a message's task failed");
                    }
                }
                // The broker never confirmed the cancel: the grace period bounds the wait anyway.
                () = sleep_until(deadline), if deadline.is_some() => break,
            }
        }
        let deadline = deadline.unwrap_or_else(|| Instant::now() + grace);
        let drained = tokio::time::timeout_at(deadline, async {
            while let Some(joined) = tasks.join_next().await {
                if let Err(e) = joined {
                    tracing::error!(error = %e, "a message's task failed");
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(left = tasks.len(), "messages still running at the end of the shutdown grace period; the broker delivers them again, and their keys are taken over once their lease runs out");
            tasks.shutdown().await;
        }
        if connection.status().connected() {
            let _ = connection.close(200, "charge-consumer stopping").await;
        }
        tracing::info!(%queue, "stopped");
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Settles deliveries: decides each, then acks, requeues or dead-letters it.
struct Settler {
    charger: Charger,
    dead_channel: Channel,
    dead_queue: String,
}

impl Settler {
    async fn settle(&self, delivery: Delivery) {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned());
        let verdict = self
            .charger
            .decide(message_id.as_deref(), &delivery.data)
            .await;
        let id = message_id.as_deref().unwrap_or("");
        let settled = match verdict {
            Verdict::Ack { charged, ran } => {
                let outcome = if ran { "charged" } else { "replayed" };
                tracing::info!(message_id = %id, payment = %charged.payment_id, charge = %charged.charge_id, %outcome, "message settled");
                delivery.acker.ack(BasicAckOptions::default()).await
            }
            Verdict::Requeue { reason, pause } => {
                tracing::warn!(message_id = %id, %reason, "message requeued");
                if pause {
                    tokio::time::sleep(REQUEUE_PAUSE).await;
                }
                requeue(&delivery).await
            }
            Verdict::DeadLetter { reason } => match self.dead_letter(&delivery, &reason).await {
                Ok(()) => {
                    tracing::warn!(message_id = %id, %reason, dead = %self.dead_queue, "message dead-lettered");
                    delivery.acker.ack(BasicAckOptions::default()).await
                }
                Err(why) => {
                    tracing::error!(message_id = %id, %reason, error = %why, "could not dead-letter the message; requeued");
                    tokio::time::sleep(REQUEUE_PAUSE).await;
                    requeue(&delivery).await
                }
            },
        };
        if let Err(e) = settled {
            // The broker delivers it again; its record replays it, or takes it over.
            tracing::error!(message_id = %id, error = %e, "could not settle the message with the broker");
        }
    }

    /// Publishes a copy of `delivery` to the dead-letter queue, `reason` in its headers, and waits
    /// for the broker's confirm.
    async fn dead_letter(&self, delivery: &Delivery, reason: &str) -> Result<(), String> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        headers.insert(
            DEAD_REASON_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason.as_bytes().to_vec())),
        );
        let properties: BasicProperties = delivery.properties.clone().with_headers(headers);
        let options = BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        };
        let confirm = self
            .dead_channel
            .basic_publish("", &self.dead_queue, options, &delivery.data, properties)
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(format!("no queue `{}`", self.dead_queue)),
            Confirmation::Nack(_) => Err("the broker refused the dead letter".to_owned()),
            Confirmation::NotRequested => Err("publisher confirms are off".to_owned()),
        }
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn requeue(delivery: &Delivery) -> lapin::Result<bool> {
    let options = BasicNackOptions {
        requeue: true,
        ..BasicNackOptions::default()
    };
    delivery.acker.nack(options).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_runtime::store::memory::MemoryStore;

    fn config(vars: &[(&str, &str)]) -> Result<ConsumerConfig, StartError> {
        ConsumerConfig::from_lookup(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn the_environment_has_defaults_and_refuses_a_bad_lease() {
        let defaults = config(&[]).expect("defaults");
        assert_eq!(defaults.amqp_url, DEFAULT_AMQP_URL);
        assert_eq!(defaults.queue, "charges");
        assert_eq!(defaults.dead_queue(), "charges.dead");
        assert_eq!(defaults.lease, DEFAULT_LEASE);
        assert_eq!(defaults.service, Config::default());
        let set = config(&[("CHARGE_QUEUE", "q"), ("CHARGE_LEASE_MS", "1500")]).expect("set");
        assert_eq!(
            (set.dead_queue(), set.lease),
            ("q.dead".to_owned(), Duration::from_millis(1500))
        );
        for bad in ["0", "soon", "-1"] {
            assert!(config(&[("CHARGE_LEASE_MS", bad)]).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_record_scope_is_never_an_http_scope() {
        assert_eq!(record_scope("alice"), "charges:alice");
        assert!(!crate::auth::is_user_id(&record_scope("alice")));
    }

    #[test]
    fn a_body_is_read_as_the_http_service_reads_a_payment() {
        let ok = ChargeRequest::parse(
            br#"{"user": "alice", "amount": 1000, "currency": "KRW", "note": 1}"#,
        );
        assert_eq!(
            ok,
            Ok(ChargeRequest {
                user: "alice".into(),
                amount: 1000,
                currency: "KRW".into()
            })
        );
        for bad in [
            &br#"not json"#[..],
            br#"{"user": "alice", "amount": "ten", "currency": "KRW"}"#,
            br#"{"user": "Alice!", "amount": 1000, "currency": "KRW"}"#,
            br#"{"user": "alice", "amount": 0, "currency": "KRW"}"#,
            br#"{"user": "alice", "amount": 9007199254740992, "currency": "KRW"}"#,
            br#"{"user": "alice", "amount": 1000, "currency": "krw"}"#,
        ] {
            assert!(
                ChargeRequest::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    async fn charger() -> Charger {
        let ledger = Ledger::open_sqlite("sqlite::memory:")
            .await
            .expect("ledger");
        let card = CardNetwork::new(ledger.database().clone(), Duration::ZERO);
        Charger::new(Engine::new(MemoryStore::new()), ledger, card, DEFAULT_LEASE)
    }

    const ALICE_1000: &[u8] = br#"{"user": "alice", "amount": 1000, "currency": "KRW"}"#;

    #[tokio::test]
    async fn a_message_is_charged_once_and_its_redelivery_acked_with_the_same_outcome() {
        let charger = charger().await;
        let first = charger.decide(Some("m-1"), ALICE_1000).await;
        let again = charger.decide(Some("m-1"), ALICE_1000).await;
        let (
            Verdict::Ack { charged, ran: true },
            Verdict::Ack {
                charged: replayed,
                ran: false,
            },
        ) = (first, again)
        else {
            panic!("charged, then replayed")
        };
        assert_eq!(charged, replayed);
        assert_eq!(
            charger.card.charges("alice").await.expect("charges").len(),
            1
        );
        assert_eq!(
            charger.ledger.list("alice").await.expect("payments").len(),
            1
        );
    }

    #[tokio::test]
    async fn poison_and_mismatches_are_dead_letters_and_charge_nothing() {
        let charger = charger().await;
        let dead = |verdict: Verdict| match verdict {
            Verdict::DeadLetter { reason } => reason,
            other => panic!("not a dead letter: {other:?}"),
        };
        assert_eq!(
            dead(charger.decide(None, ALICE_1000).await),
            "no message_id"
        );
        assert_eq!(
            dead(charger.decide(Some(""), ALICE_1000).await),
            "no message_id"
        );
        assert!(dead(charger.decide(Some("m-1"), b"not json").await).starts_with("malformed body"));
        assert!(matches!(
            charger.decide(Some("m-1"), ALICE_1000).await,
            Verdict::Ack { .. }
        ));
        let other = br#"{"user": "alice", "amount": 2000, "currency": "KRW"}"#;
        assert!(dead(charger.decide(Some("m-1"), other).await).starts_with("mismatch"));
        assert_eq!(
            charger.card.charges("alice").await.expect("charges").len(),
            1
        );
    }
}
