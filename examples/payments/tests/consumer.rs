//! The charge consumer (`charge-consumer`) against RabbitMQ: each message_id charged once and
//! recorded once, however often it is published or delivered, whichever consumer gets it, and
//! however often a consumer is killed; poison goes to `<queue>.dead` once, and the rest goes on; a
//! store outage requeues without charging; `SIGTERM` finishes and acks what the consumer holds.
//! Charges are counted at the card network and payments in the ledger, through the HTTP service on
//! the same stores (`GET /charges`, `GET /payments`), on three record stores: SQLite and PostgreSQL
//! (records in the ledger's database) and Redis (`IDEM_STORE_URL`, a SQLite ledger).
//!
//! Each test has queues of its own (`CHARGE_QUEUE`), deleted when it ends.

use crate::support::{amount, fresh_user, until, Effects, Instance, Stores};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::io::{BufRead, BufReader, Read, Seek};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Bounds start-up, only to fail instead of hanging.
const START_BOUND: Duration = Duration::from_secs(120);

/// Bounds every wait on the queue and the ledger, only to fail instead of hanging.
const SETTLE_BOUND: Duration = Duration::from_secs(90);

/// A running `charge-consumer` process, killed when dropped (its log printed if the test failed).
struct Consumer {
    child: Child,
    log: std::fs::File,
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- log of a charge-consumer ---\n{}", self.log());
        }
    }
}

impl Consumer {
    /// Starts one consumer per entry of `extras` at once, on `stores` and `queue`, and waits until
    /// each says it consumes.
    fn start_all(stores: &Stores, queue: &str, extras: &[&[(&str, &str)]]) -> Vec<Self> {
        let spawned: Vec<_> = extras
            .iter()
            .map(|extra| Self::spawn(stores, queue, extra))
            .collect();
        spawned
            .into_iter()
            .map(|(mut consumer, ready)| {
                match ready.recv_timeout(START_BOUND) {
                    Ok(line) if line == "charge-consumer ready" => {}
                    Ok(line) => panic!(
                        "charge-consumer did not start: {line:?}\n{}",
                        consumer.log()
                    ),
                    Err(_) => panic!(
                        "charge-consumer did not start within {START_BOUND:?}\n{}",
                        consumer.log()
                    ),
                }
                consumer
            })
            .collect()
    }

    fn start(stores: &Stores, queue: &str, extra: &[(&str, &str)]) -> Self {
        Self::start_all(stores, queue, &[extra])
            .pop()
            .expect("one consumer")
    }

    fn spawn(
        stores: &Stores,
        queue: &str,
        extra: &[(&str, &str)],
    ) -> (Self, mpsc::Receiver<String>) {
        let log = tempfile::tempfile().expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_charge-consumer"));
        command
            .env_remove("IDEM_STORE_URL")
            .env_remove("PAYMENT_LATENCY_MS")
            .env_remove("SHUTDOWN_GRACE_MS")
            .env_remove("CHARGE_LEASE_MS")
            .env("AMQP_URL", idem_tests::services::amqp_url())
            .env("CHARGE_QUEUE", queue)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.try_clone().expect("log file"));
        for name in ["DATABASE_URL", "IDEM_STORE_URL"] {
            if let Some(value) = stores.var(name) {
                command.env(name, value);
            }
        }
        for (name, value) in extra {
            command.env(name, value);
        }
        let mut child = command.spawn().expect("spawn the charge-consumer binary");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, ready) = mpsc::channel();
        // The first line says it consumes; the thread then drains the pipe until the process exits.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next().and_then(Result::ok).unwrap_or_default());
            for _ in lines {}
        });
        (Self { child, log }, ready)
    }

    fn log(&mut self) -> String {
        let mut text = String::new();
        let _ = self.log.rewind();
        let _ = self.log.read_to_string(&mut text);
        text
    }

    /// Kills the process with `SIGKILL`: a crash, nothing runs after it.
    fn kill(&mut self) {
        self.child.kill().expect("kill the consumer");
        self.child.wait().expect("reap the consumer");
    }

    /// Sends `SIGTERM`.
    fn terminate(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed: {sent}");
    }

    async fn exit_status(&mut self, bound: Duration) -> ExitStatus {
        let child = &mut self.child;
        until("the consumer to exit", bound, || {
            let exited = child.try_wait().expect("poll the consumer");
            async move { exited }
        })
        .await
    }

    /// Stops it with `SIGTERM` and asserts that it drained and exited 0.
    async fn stop(&mut self) {
        self.terminate();
        let status = self.exit_status(Duration::from_secs(30)).await;
        assert!(status.success(), "{status}\n{}", self.log());
    }

    /// How many messages its log says it settled with `outcome` (`charged`, `replayed`).
    fn settled(&mut self, outcome: &str) -> usize {
        self.log_lines(&format!("outcome={outcome}"))
    }

    /// How many lines of its log contain `needle`.
    fn log_lines(&mut self, needle: &str) -> usize {
        self.log().lines().filter(|l| l.contains(needle)).count()
    }
}

fn tokio_properties() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// The test's side of the broker: its queue (and dead-letter queue), deleted when dropped.
struct Broker {
    _connection: Connection,
    channel: Channel,
    queue: String,
}

impl Broker {
    async fn new() -> Self {
        let url = idem_tests::services::amqp_broker().await;
        let connection = Connection::connect(&url, tokio_properties())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("publisher confirms");
        let queue = format!("idem-test-charges-{}", uuid::Uuid::new_v4().simple());
        let broker = Self {
            _connection: connection,
            channel,
            queue,
        };
        // Declared as the consumer declares them, so that what is published before it starts waits.
        for queue in [broker.queue.clone(), broker.dead_queue()] {
            broker.declare(&queue, false).await;
        }
        broker
    }

    fn dead_queue(&self) -> String {
        format!("{}.dead", self.queue)
    }

    async fn declare(&self, queue: &str, passive: bool) -> u32 {
        let options = QueueDeclareOptions {
            durable: true,
            passive,
            ..QueueDeclareOptions::default()
        };
        self.channel
            .queue_declare(queue, options, FieldTable::default())
            .await
            .expect("declare the queue")
            .message_count()
    }

    /// Publishes `body` with `message_id`, and waits for the broker's confirm.
    async fn publish(&self, message_id: Option<&str>, body: &str) {
        let mut properties = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = message_id {
            properties = properties.with_message_id(id.into());
        }
        let confirm = self
            .channel
            .basic_publish(
                "",
                &self.queue,
                BasicPublishOptions::default(),
                body.as_bytes(),
                properties,
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert_eq!(confirm, Confirmation::Ack(None));
    }

    /// The messages waiting in the queue (not the ones delivered and not yet acked).
    async fn ready(&self) -> u32 {
        self.declare(&self.queue, true).await
    }

    /// The messages in the dead-letter queue.
    async fn dead(&self) -> u32 {
        self.declare(&self.dead_queue(), true).await
    }

    /// Takes every dead letter: its message_id and its `x-dead-reason`.
    async fn take_dead(&self) -> Vec<(Option<String>, String)> {
        let mut letters = Vec::new();
        let options = BasicGetOptions { no_ack: true };
        while let Some(message) = self
            .channel
            .basic_get(&self.dead_queue(), options)
            .await
            .expect("basic.get")
        {
            let properties = &message.delivery.properties;
            let id = properties.message_id().as_ref().map(|id| id.to_string());
            let reason = properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get("x-dead-reason").cloned());
            let reason = match reason {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => panic!("a dead letter without its reason: {other:?}"),
            };
            letters.push((id, reason));
        }
        letters
    }
}

impl Drop for Broker {
    /// Deletes the test's queues, on a connection of its own (Drop cannot await).
    fn drop(&mut self) {
        let queues = [self.queue.clone(), self.dead_queue()];
        let deleted = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let url = idem_tests::services::amqp_url();
                let connection = Connection::connect(&url, tokio_properties())
                    .await
                    .map_err(|e| e.to_string())?;
                let channel = connection
                    .create_channel()
                    .await
                    .map_err(|e| e.to_string())?;
                for queue in &queues {
                    channel
                        .queue_delete(queue, QueueDeleteOptions::default())
                        .await
                        .map_err(|e| e.to_string())?;
                }
                let _ = connection.close(200, "test done").await;
                Ok::<(), String>(())
            })
        })
        .join();
        if !matches!(deleted, Ok(Ok(()))) {
            eprintln!(
                "could not delete the test queue {}: {deleted:?}",
                self.queue
            );
        }
    }
}

/// The body of message number `i` for `user`: its own amount, so that charges and payments can be
/// told apart by amount.
fn message(user: &str, i: usize) -> String {
    format!(
        r#"{{"user": "{user}", "amount": {}, "currency": "KRW"}}"#,
        amount(i)
    )
}

/// The message_id of message number `i`.
fn message_id(i: usize) -> String {
    format!("msg-{i}")
}

/// How many payments `user` has, through the HTTP service.
async fn payment_count(client: &reqwest::Client, http: &Instance, user: &str) -> usize {
    crate::support::payments(client, http, user).await.len()
}

/// Waits until `user` has `count` payments and nothing waits in the queue.
async fn until_settled(
    client: &reqwest::Client,
    http: &Instance,
    broker: &Broker,
    user: &str,
    count: usize,
) {
    until(
        &format!("{count} payments and an empty queue"),
        SETTLE_BOUND,
        || async {
            let paid = payment_count(client, http, user).await;
            (paid >= count && broker.ready().await == 0).then_some(())
        },
    )
    .await;
}

/// 200 messages, each published twice (a producer's retry), two consumers competing for them: one
/// charge and one payment per message_id, all 200 there, every delivery acked.
async fn duplicates_across_two_consumers(stores: Stores) {
    const MESSAGES: usize = 200;
    let broker = Broker::new().await;
    let (client, user) = (crate::support::client(), fresh_user());
    let http = stores.start(&[]);
    let mut consumers = Consumer::start_all(&stores, &broker.queue, &[&[], &[]]);
    for i in 0..MESSAGES {
        for _ in 0..2 {
            broker
                .publish(Some(&message_id(i)), &message(&user, i))
                .await;
        }
    }
    until_settled(&client, &http, &broker, &user, MESSAGES).await;
    for consumer in &mut consumers {
        consumer.stop().await;
    }
    // The drain acked everything it was given: nothing went back to the queue.
    assert_eq!(broker.ready().await, 0);
    assert_eq!(broker.dead().await, 0);
    let effects = Effects::of(&client, &http, &user).await;
    let attempts = effects.assert_each_once(MESSAGES);
    let (charged, replayed): (usize, usize) = consumers
        .iter_mut()
        .map(|c| (c.settled("charged"), c.settled("replayed")))
        .fold((0, 0), |(a, b), (c, r)| (a + c, b + r));
    assert_eq!(charged, MESSAGES, "one run per message_id");
    assert_eq!(
        charged + replayed,
        2 * MESSAGES,
        "every delivery settled once"
    );
    eprintln!(
        "attempts per charge: {:?}",
        crate::support::histogram(&attempts)
    );
}

/// A consumer killed (`SIGKILL`) mid-message, three times, each time once some payments were
/// recorded and others were at the card network; restarted until the queue is empty. Every
/// message charged once and paid once, none lost: the killed ones were taken over after their
/// lease, with the same downstream key.
async fn killed_mid_message(stores: Stores) {
    const MESSAGES: usize = 80;
    let broker = Broker::new().await;
    let (client, user) = (crate::support::client(), fresh_user());
    let http = stores.start(&[]);
    for i in 0..MESSAGES {
        broker
            .publish(Some(&message_id(i)), &message(&user, i))
            .await;
    }
    let env: &[(&str, &str)] = &[("PAYMENT_LATENCY_MS", "150"), ("CHARGE_LEASE_MS", "1000")];
    for _ in 0..3 {
        let before = payment_count(&client, &http, &user).await;
        let mut consumer = Consumer::start(&stores, &broker.queue, env);
        until("some payments recorded", SETTLE_BOUND, || async {
            (payment_count(&client, &http, &user).await >= before + 5).then_some(())
        })
        .await;
        consumer.kill();
    }
    let mut last = Consumer::start(&stores, &broker.queue, env);
    until_settled(&client, &http, &broker, &user, MESSAGES).await;
    last.stop().await;
    assert_eq!(broker.ready().await, 0);
    let effects = Effects::of(&client, &http, &user).await;
    let attempts = effects.assert_each_once(MESSAGES);
    assert!(
        attempts.iter().any(|a| *a > 1),
        "a kill landed while a message was at the card network, and its takeover called it again \
         with the same key: {:?}",
        crate::support::histogram(&attempts)
    );
}

/// A message redelivered while its first delivery still runs on another consumer (the card network
/// slow): the second waits for the first and acks its stored output. One charge, one payment.
async fn redelivered_while_running(stores: Stores) {
    let broker = Broker::new().await;
    let (client, user) = (crate::support::client(), fresh_user());
    let http = stores.start(&[]);
    let slow: &[(&str, &str)] = &[("PAYMENT_LATENCY_MS", "1500")];
    let mut consumers = Consumer::start_all(&stores, &broker.queue, &[slow, slow]);
    for _ in 0..2 {
        broker
            .publish(Some(&message_id(0)), &message(&user, 0))
            .await;
    }
    until_settled(&client, &http, &broker, &user, 1).await;
    until("both deliveries settled", SETTLE_BOUND, || {
        let settled: usize = consumers
            .iter_mut()
            .map(|c| c.settled("charged") + c.settled("replayed"))
            .sum();
        async move { (settled >= 2).then_some(()) }
    })
    .await;
    for consumer in &mut consumers {
        consumer.stop().await;
    }
    assert_eq!(broker.ready().await, 0);
    let effects = Effects::of(&client, &http, &user).await;
    assert_eq!(effects.assert_each_once(1), [1], "the network called once");
    let charged: usize = consumers.iter_mut().map(|c| c.settled("charged")).sum();
    let replayed: usize = consumers.iter_mut().map(|c| c.settled("replayed")).sum();
    assert_eq!((charged, replayed), (1, 1));
}

/// Poison (no message_id, a body that is no JSON, JSON of another shape, a message_id reused with
/// another body) reaches `<queue>.dead` once each, with its reason; the valid messages around it
/// are charged once each.
async fn poison_is_dead_lettered_once(stores: Stores) {
    let broker = Broker::new().await;
    let (client, user) = (crate::support::client(), fresh_user());
    let http = stores.start(&[]);
    let mut consumer = Consumer::start(&stores, &broker.queue, &[]);
    broker.publish(None, &message(&user, 0)).await;
    broker.publish(Some("poison-text"), "not json").await;
    let shape = format!(r#"{{"user": "{user}", "amount": "ten"}}"#);
    broker.publish(Some("poison-shape"), &shape).await;
    for i in 0..5 {
        broker
            .publish(Some(&message_id(i)), &message(&user, i))
            .await;
    }
    until_settled(&client, &http, &broker, &user, 5).await;
    // msg-0 again, with another amount: a mismatch.
    broker
        .publish(Some(&message_id(0)), &message(&user, 9))
        .await;
    for i in 5..8 {
        broker
            .publish(Some(&message_id(i)), &message(&user, i))
            .await;
    }
    until_settled(&client, &http, &broker, &user, 8).await;
    until("4 dead letters", SETTLE_BOUND, || async {
        (broker.dead().await >= 4).then_some(())
    })
    .await;
    consumer.stop().await;
    assert_eq!(broker.ready().await, 0);
    let mut dead = broker.take_dead().await;
    dead.sort();
    let reasons: Vec<(Option<&str>, bool)> = dead
        .iter()
        .map(|(id, reason)| {
            let expected = match id.as_deref() {
                None => "no message_id",
                Some("msg-0") => "mismatch",
                Some(_) => "malformed body",
            };
            (id.as_deref(), reason.starts_with(expected))
        })
        .collect();
    assert_eq!(
        reasons,
        [
            (None, true),
            (Some("msg-0"), true),
            (Some("poison-shape"), true),
            (Some("poison-text"), true)
        ],
        "each poison message dead-lettered once, with its reason: {dead:?}"
    );
    Effects::of(&client, &http, &user).await.assert_each_once(8);
}

/// `SIGTERM` while a full prefetch of messages is at the (slow) card network: the consumer takes no
/// more, finishes and acks those it has, and exits 0; the rest waits in the queue, uncharged.
#[tokio::test]
#[cfg_attr(skip_amqp, ignore = "needs RabbitMQ, skipped by IDEM_TEST_SKIP")]
async fn sigterm_finishes_and_acks_the_messages_in_progress() {
    const MESSAGES: usize = 20;
    let in_hand = usize::from(payments::consumer::PREFETCH);
    let stores = Stores::sqlite().await;
    let broker = Broker::new().await;
    let (client, user) = (crate::support::client(), fresh_user());
    let http = stores.start(&[]);
    for i in 0..MESSAGES {
        broker
            .publish(Some(&message_id(i)), &message(&user, i))
            .await;
    }
    let mut consumer = Consumer::start(&stores, &broker.queue, &[("PAYMENT_LATENCY_MS", "4000")]);
    // The network records a charge as the call arrives, and answers 4 s later.
    crate::support::until_charged(&client, &http, &user, in_hand).await;
    assert_eq!(
        payment_count(&client, &http, &user).await,
        0,
        "still at the network"
    );
    consumer.stop().await;
    let effects = Effects::of(&client, &http, &user).await;
    assert_eq!(effects.charges.len(), in_hand, "{effects:?}");
    assert_eq!(
        effects.payments.len(),
        in_hand,
        "each finished: {effects:?}"
    );
    assert!(effects.charges.values().all(|c| c == &[1]));
    // Those it had were acked; the others were never delivered, and wait.
    assert_eq!(broker.ready().await as usize, MESSAGES - in_hand);
    assert_eq!(consumer.settled("charged"), in_hand);
}

/// The idempotency store (Redis, through a proxy the test cuts) stops answering: every message is
/// requeued and none charged, since none can be claimed; once the store is back each is charged
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[cfg_attr(skip_amqp, ignore = "needs RabbitMQ, skipped by IDEM_TEST_SKIP")]
async fn a_store_outage_requeues_and_charges_nothing() {
    const MESSAGES: usize = 5;
    let stores = Stores::redis_records().await;
    let records = stores.var("IDEM_STORE_URL").expect("records in Redis");
    let (server, prefix) = records.split_once('?').expect("a key prefix");
    let proxy = idem_tests::proxy::Proxy::redis(server).await;
    let proxied = format!("{}?{prefix}", proxy.url());
    let broker = Broker::new().await;
    let (client, user) = (crate::support::client(), fresh_user());
    let http = stores.start(&[]);
    let mut consumer = Consumer::start(&stores, &broker.queue, &[("IDEM_STORE_URL", &proxied)]);
    proxy.cut();
    for i in 0..MESSAGES {
        broker
            .publish(Some(&message_id(i)), &message(&user, i))
            .await;
    }
    until("each message requeued", SETTLE_BOUND, || {
        let requeued = consumer.log_lines("message requeued");
        async move { (requeued >= MESSAGES).then_some(()) }
    })
    .await;
    let effects = Effects::of(&client, &http, &user).await;
    assert!(
        effects.charges.is_empty() && effects.payments.is_empty(),
        "nothing charged without a claim: {effects:?}"
    );
    proxy.restore();
    until_settled(&client, &http, &broker, &user, MESSAGES).await;
    consumer.stop().await;
    assert_eq!(broker.ready().await, 0);
    assert_eq!(broker.dead().await, 0);
    Effects::of(&client, &http, &user)
        .await
        .assert_each_once(MESSAGES);
}

/// The four scenarios on one store mode, each a test of its own.
macro_rules! on_store {
    ($store:ident, $constructor:ident $(, $cfg:meta)?) => {
        mod $store {
            use super::*;

            #[tokio::test]
            $(#[$cfg])?
            #[cfg_attr(skip_amqp, ignore = "needs RabbitMQ, skipped by IDEM_TEST_SKIP")]
            async fn duplicates_across_two_consumers_charge_once() {
                duplicates_across_two_consumers(Stores::$constructor().await).await;
            }

            #[tokio::test]
            $(#[$cfg])?
            #[cfg_attr(skip_amqp, ignore = "needs RabbitMQ, skipped by IDEM_TEST_SKIP")]
            async fn a_consumer_killed_mid_message_loses_nothing_and_charges_once() {
                killed_mid_message(Stores::$constructor().await).await;
            }

            #[tokio::test]
            $(#[$cfg])?
            #[cfg_attr(skip_amqp, ignore = "needs RabbitMQ, skipped by IDEM_TEST_SKIP")]
            async fn a_redelivery_while_the_first_runs_waits_and_charges_once() {
                redelivered_while_running(Stores::$constructor().await).await;
            }

            #[tokio::test]
            $(#[$cfg])?
            #[cfg_attr(skip_amqp, ignore = "needs RabbitMQ, skipped by IDEM_TEST_SKIP")]
            async fn poison_reaches_the_dead_letter_queue_once() {
                poison_is_dead_lettered_once(Stores::$constructor().await).await;
            }
        }
    };
}

on_store!(sqlite, sqlite);
on_store!(
    postgres,
    postgres,
    cfg_attr(
        skip_postgres,
        ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP"
    )
);
on_store!(
    redis,
    redis_records,
    cfg_attr(
        skip_redis,
        ignore = "needs Redis, skipped by IDEM_TEST_SKIP"
    )
);
