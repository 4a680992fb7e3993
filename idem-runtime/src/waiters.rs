//! Waking duplicates when the original completes: a per-key wake-up registry.
//!
//! Each store owns a [`Waiters`]. A duplicate request subscribes to its key before re-reading the
//! record; the store calls [`Waiters::notify`] after completing or releasing a key, and shared stores
//! also call it when another process announces a change (PostgreSQL `NOTIFY`, Redis pub/sub). Entries
//! exist only while someone waits, so the map stays as small as the number of waiting keys.

use crate::record::RecordKey;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use tokio::sync::watch;

/// The per-key wake-up registry of one store.
#[derive(Debug, Default)]
pub struct Waiters {
    map: Arc<Mutex<HashMap<RecordKey, Weak<watch::Sender<()>>>>>,
}

impl Waiters {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Subscribes to `key`: the returned subscription resolves on the next [`notify`](Self::notify)
    /// of `key` after this call.
    pub fn subscribe(&self, key: &RecordKey) -> Subscription {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        let sender = match map.get(key).and_then(Weak::upgrade) {
            Some(sender) => sender,
            None => {
                let sender = Arc::new(watch::Sender::new(()));
                map.insert(key.clone(), Arc::downgrade(&sender));
                sender
            }
        };
        let receiver = sender.subscribe();
        Subscription {
            inner: Some(Inner {
                sender,
                receiver,
                key: key.clone(),
                map: Arc::downgrade(&self.map),
            }),
        }
    }

    /// Wakes every subscriber of `key`. Cheap when nobody waits: one map lookup.
    pub fn notify(&self, key: &RecordKey) {
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = map.get(key).and_then(Weak::upgrade) {
            sender.send_replace(());
        }
    }

    /// Wakes every subscriber of every key. Shared stores call it when they may have missed a
    /// notification (their listener connected or reconnected): each waiter then re-reads its record.
    pub fn notify_all(&self) {
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        for sender in map.values().filter_map(Weak::upgrade) {
            sender.send_replace(());
        }
    }

    /// How many keys have subscribers (for tests and metrics).
    pub fn waiting_keys(&self) -> usize {
        self.map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// A pending wake-up for one key; see [`Waiters::subscribe`].
#[derive(Debug)]
pub struct Subscription {
    inner: Option<Inner>,
}

#[derive(Debug)]
struct Inner {
    sender: Arc<watch::Sender<()>>,
    receiver: watch::Receiver<()>,
    key: RecordKey,
    map: Weak<Mutex<HashMap<RecordKey, Weak<watch::Sender<()>>>>>,
}

impl Subscription {
    /// A subscription that never fires (for stores that cannot notify; waiters then wake at the lease
    /// end or their deadline).
    pub fn never() -> Self {
        Self { inner: None }
    }

    /// Resolves when the key was notified after subscribing (or after the previous `changed`).
    pub async fn changed(&mut self) {
        match &mut self.inner {
            Some(inner) => {
                if inner.receiver.changed().await.is_err() {
                    // The sender lives as long as this subscription, so this is unreachable; never spin.
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let Some(map) = inner.map.upgrade() else {
            return;
        };
        let mut map = map.lock().unwrap_or_else(PoisonError::into_inner);
        // The map holds a weak reference; if ours is the last strong one, the entry goes with us.
        if Arc::strong_count(&inner.sender) == 1 {
            map.remove(&inner.key);
        }
        drop(inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn notify_wakes_subscribers_of_that_key_only() {
        let w = Waiters::new();
        let a = RecordKey::new("s", "a");
        let mut sub_a = w.subscribe(&a);
        let mut sub_b = w.subscribe(&RecordKey::new("s", "b"));
        w.notify(&a);
        sub_a.changed().await;
        let woke_b = tokio::time::timeout(std::time::Duration::ZERO, sub_b.changed()).await;
        assert!(woke_b.is_err(), "b was not notified");
    }

    #[test]
    fn entries_live_only_while_someone_waits() {
        let w = Waiters::new();
        let k = RecordKey::new("s", "k");
        let s1 = w.subscribe(&k);
        let s2 = w.subscribe(&k);
        assert_eq!(w.waiting_keys(), 1);
        drop(s1);
        assert_eq!(w.waiting_keys(), 1);
        drop(s2);
        assert_eq!(w.waiting_keys(), 0);
    }
}
