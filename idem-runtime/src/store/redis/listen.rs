//! Waking waiters across instances: the store's pub/sub task (see the module documentation of
//! the Redis store).

use super::*;

/// How often the pub/sub connection is pinged to detect a connection that died silently.
pub(super) const PING_EVERY: Duration = Duration::from_secs(15);

/// The pub/sub task's reconnection backoff.
pub(super) const MIN_BACKOFF: Duration = Duration::from_millis(100);
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The store's pub/sub task, and whether it is subscribed right now. Dropping it stops the task.
pub(super) struct Subscriber {
    pub(super) task: AbortHandle,
    pub(super) subscribed: watch::Receiver<bool>,
}

impl Subscriber {
    pub(super) fn is_subscribed(&self) -> bool {
        *self.subscribed.borrow()
    }

    pub(super) async fn wait_for(&self, subscribed: bool) {
        let mut state = self.subscribed.clone();
        // The listener lives as long as the store, so the sender is never dropped while we wait.
        let _ = state.wait_for(|now| *now == subscribed).await;
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(super) async fn subscribe(
    client: &Client,
    channel: &str,
    timeout: Duration,
) -> RedisResult<PubSub> {
    let connect = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok(pubsub)
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result,
        Err(_) => Err(RedisError::from((
            ErrorKind::IoError,
            "timed out subscribing to the idem channel",
        ))),
    }
}

/// What the store's pub/sub task needs.
pub(super) struct Listener {
    /// The servers to subscribe on, tried in turn (a cluster's every node receives every message).
    pub(super) clients: Vec<Client>,
    pub(super) channel: String,
    pub(super) waiters: Arc<Waiters>,
    pub(super) state: watch::Sender<bool>,
    pub(super) connection_timeout: Duration,
    pub(super) response_timeout: Duration,
}

/// The store's pub/sub task: wakes local waiters for every tag published on the channel, and
/// reconnects with backoff, to the next server, whenever the connection fails. Runs until the
/// store aborts it.
pub(super) async fn listen(l: Listener, mut initial: Option<PubSub>) {
    let channel = &l.channel;
    let mut backoff = MIN_BACKOFF;
    for client in l.clients.iter().cycle() {
        let pubsub = match initial.take() {
            Some(pubsub) => pubsub,
            None => match subscribe(client, channel, l.connection_timeout).await {
                Ok(pubsub) => {
                    tracing::debug!(target: "idem", %channel, "subscribed to completions");
                    pubsub
                }
                Err(error) => {
                    tracing::warn!(
                        target: "idem", %channel, %error,
                        "cannot subscribe to completions; retrying"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            },
        };
        backoff = MIN_BACKOFF;
        // Completions published while we were not subscribed are lost: every local waiter re-reads
        // its record (and waits again if it is still in flight), as PostgreSQL's listener does.
        l.waiters.notify_all();
        l.state.send_replace(true);
        let (mut sink, mut stream) = pubsub.split();
        let mut ping =
            tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                message = stream.next() => match message {
                    Some(message) => match decode_tag(message.get_payload_bytes()) {
                        Some(key) => l.waiters.notify(&key),
                        None => tracing::debug!(
                            target: "idem", %channel, "ignored a malformed completion message"
                        ),
                    },
                    None => break,
                },
                _ = ping.tick() => {
                    let pong = tokio::time::timeout(
                        l.response_timeout,
                        sink.ping::<::redis::Value>(),
                    )
                    .await;
                    if !matches!(pong, Ok(Ok(_))) {
                        break;
                    }
                }
            }
        }
        l.state.send_replace(false);
        tracing::warn!(target: "idem", %channel, "lost the completions subscription; reconnecting");
    }
}
