//! Waking duplicates when the original completes: a per-key wake-up registry.
//!
//! Each store owns a [`Waiters`]. A duplicate request subscribes to its key before re-reading the
//! record; the store calls [`Waiters::notify`] after completing or releasing a key, and shared stores
//! also call it when another process announces a change (PostgreSQL `NOTIFY`, Redis pub/sub). Entries
//! exist only while someone waits, so the map stays as small as the number of waiting keys.
//!
//! The primitive is small on purpose, so that `tests/loom.rs` can check it under every interleaving:
//! one mutex over a map from key to entry; an entry holds a generation (bumped by every notify), the
//! number of live subscriptions (the entry goes when the last one drops) and the wakers of pending
//! [`Subscription::changed`] futures. A subscription remembers the generation it last saw, so a
//! notify between subscribing and awaiting is not lost: `changed` then resolves at once.
//!
//! Beside the mutex, a count of the keys that have an entry lets a notify return without taking the
//! mutex when no key has a waiter (for nearly every completion), so completions of different keys
//! do not all meet on it. A `SeqCst` fence on each side keeps that from losing a wake-up; see
//! [`Waiters::notify`].

use crate::record::RecordKey;
use crate::sync::{fence, Arc, AtomicUsize, Mutex, MutexGuard};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::task::{Context, Poll, Waker};

/// The per-key wake-up registry of one store.
pub struct Waiters {
    shared: Arc<Shared>,
}

/// What the registry and its subscriptions share.
struct Shared {
    registry: Mutex<Registry>,
    /// How many keys have an entry: changed only under the lock, with the entry's insertion or
    /// removal; read without it by [`Waiters::notify`], so that while no key has a waiter (nearly
    /// always) a completion does not take the one lock every key of the store shares.
    keys: AtomicUsize,
}

#[derive(Default)]
struct Registry {
    entries: HashMap<RecordKey, Entry>,
    /// Identifies each subscription's waker within its entry.
    next_id: u64,
}

#[derive(Default)]
struct Entry {
    /// Bumped by every notify; a subscription that saw an older one has been notified.
    generation: u64,
    /// Live subscriptions to this key. The entry is removed when the last one drops, never before.
    subscribers: usize,
    /// The wakers of pending `changed()` futures, by subscription id (at most one each).
    wakers: Vec<(u64, Waker)>,
}

impl Entry {
    /// Marks the key notified and takes the wakers to wake (outside the lock: a waker may run
    /// arbitrary code).
    fn bump(&mut self) -> Vec<Waker> {
        self.generation = self.generation.wrapping_add(1);
        std::mem::take(&mut self.wakers)
            .into_iter()
            .map(|(_, waker)| waker)
            .collect()
    }

    fn register(&mut self, id: u64, waker: &Waker) {
        match self.wakers.iter_mut().find(|(owner, _)| *owner == id) {
            Some((_, registered)) => registered.clone_from(waker),
            None => self.wakers.push((id, waker.clone())),
        }
    }

    fn deregister(&mut self, id: u64) {
        self.wakers.retain(|(owner, _)| *owner != id);
    }
}

/// Every critical section is a few map and vector operations that leave the registry consistent at
/// each step, so a panic elsewhere while the lock was held (a waker's `clone`) cannot leave it half
/// written and the poison can be ignored.
fn lock(shared: &Shared) -> MutexGuard<'_, Registry> {
    shared
        .registry
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

fn wake(wakers: Vec<Waker>) {
    for waker in wakers {
        waker.wake();
    }
}

impl Waiters {
    /// An empty registry.
    pub fn new() -> Self {
        Self {
            shared: Arc::new(Shared {
                registry: Mutex::new(Registry::default()),
                keys: AtomicUsize::new(0),
            }),
        }
    }

    /// Subscribes to `key`: the returned subscription resolves on the next [`notify`](Self::notify)
    /// of `key` after this call.
    pub fn subscribe(&self, key: &RecordKey) -> Subscription {
        let mut registry = lock(&self.shared);
        let id = registry.next_id;
        registry.next_id += 1;
        let entry = registry.entries.entry(key.clone()).or_insert_with(|| {
            self.shared.keys.fetch_add(1, Ordering::Relaxed);
            Entry::default()
        });
        entry.subscribers += 1;
        let seen = entry.generation;
        drop(registry);
        // Pairs with the fence in `notify`: whatever the caller reads next (the record it re-checks)
        // comes after this subscription in the fences' single order. See `notify`.
        fence(Ordering::SeqCst);
        Subscription {
            inner: Some(Inner {
                shared: self.shared.clone(),
                key: key.clone(),
                id,
                seen,
            }),
        }
    }

    /// Wakes every subscriber of `key`. When no key has a subscriber, which is the common case, it
    /// reads one counter and takes no lock.
    ///
    /// The contract: a waiter subscribes, then re-reads the state it waits on; the store writes that
    /// state, then notifies. Whatever the write and the re-read synchronise with (a lock, an atomic
    /// with `Release` and `Acquire`, a database round trip), either the re-read sees the write or
    /// this notify wakes the subscription.
    ///
    /// Skipping the lock keeps that contract because of two `SeqCst` fences: one at the end of
    /// [`subscribe`](Self::subscribe), after the count includes the key, and one here, before the
    /// count is read. The count changes only under the lock, together with the entries, so from a
    /// key's first subscription until its last drops, every value it takes is at least 1. The
    /// fences are totally ordered (C++20's rule, which Rust follows: a fence that happens before an
    /// operation, and one that happens after an operation coherence-ordered after it, come in that
    /// order).
    ///
    /// - If `subscribe`'s fence comes first, the count read here is the one the subscription made
    ///   (or joined: the increment happened before its fence, through the lock) or a later one made
    ///   while the subscription lives (a waiter this notify would wake has not dropped it), so it is
    ///   not 0, and the lock is taken. The critical section that follows comes after the
    ///   subscription's (had it come before, the write would happen before the re-read, through the
    ///   lock, and the re-read would have seen it), so it finds the entry and wakes it.
    /// - If this fence comes first, the write made before it is visible to the re-read made after
    ///   `subscribe`'s fence.
    ///
    /// Without the fences (the count read with `Acquire`, say) each side could miss the other's
    /// write, as in the store-buffering litmus test. `tests/loom.rs` checks a locked store (the
    /// memory store) and a lock-free flag, with one waiter under every interleaving and with two
    /// under those of at most three preemptions; loom's `SeqCst` fence is stronger than C++20's, so
    /// what loom proves is that each fence is needed, and the argument above that they suffice.
    pub fn notify(&self, key: &RecordKey) {
        fence(Ordering::SeqCst);
        if self.shared.keys.load(Ordering::Relaxed) == 0 {
            return;
        }
        let wakers = match lock(&self.shared).entries.get_mut(key) {
            Some(entry) => entry.bump(),
            None => return,
        };
        wake(wakers);
    }

    /// Wakes every subscriber of every key. Shared stores call it when they may have missed a
    /// notification (their listener connected or reconnected): each waiter then re-reads its record.
    pub fn notify_all(&self) {
        let wakers: Vec<Waker> = lock(&self.shared)
            .entries
            .values_mut()
            .flat_map(Entry::bump)
            .collect();
        wake(wakers);
    }

    /// How many keys have subscribers (for tests and metrics).
    pub fn waiting_keys(&self) -> usize {
        lock(&self.shared).entries.len()
    }
}

impl Default for Waiters {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Waiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not locking: formatting must never wait for, or deadlock with, a notify.
        f.debug_struct("Waiters").finish_non_exhaustive()
    }
}

/// A pending wake-up for one key; see [`Waiters::subscribe`].
pub struct Subscription {
    inner: Option<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    key: RecordKey,
    id: u64,
    /// The entry's generation when this subscription was made or last resolved `changed`.
    seen: u64,
}

impl Subscription {
    /// A subscription that never fires (for stores that cannot notify; waiters then wake at the lease
    /// end or their deadline).
    pub fn never() -> Self {
        Self { inner: None }
    }

    /// Resolves when the key was notified after subscribing (or after the previous `changed`).
    ///
    /// Cancel-safe: dropping the future before it resolves deregisters its waker and loses no
    /// notification (the next `changed` resolves at once if one came in meanwhile).
    pub async fn changed(&mut self) {
        match &mut self.inner {
            Some(inner) => {
                Changed {
                    inner,
                    registered: false,
                }
                .await
            }
            None => std::future::pending().await,
        }
    }
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("key", &self.inner.as_ref().map(|inner| &inner.key))
            .finish_non_exhaustive()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Some(inner) = &self.inner else {
            return;
        };
        let mut registry = lock(&inner.shared);
        let last = match registry.entries.get_mut(&inner.key) {
            Some(entry) => {
                entry.subscribers -= 1;
                // Only a leaked (`mem::forget`) `changed` future can have left a waker here.
                entry.deregister(inner.id);
                entry.subscribers == 0
            }
            None => false,
        };
        if last && registry.entries.remove(&inner.key).is_some() {
            inner.shared.keys.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The future behind [`Subscription::changed`].
struct Changed<'a> {
    inner: &'a mut Inner,
    /// Whether this future's waker may be in the entry (so dropping it must take it out).
    registered: bool,
}

impl Future for Changed<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut registry = lock(&this.inner.shared);
        let Some(entry) = registry.entries.get_mut(&this.inner.key) else {
            // Unreachable: the entry lives as long as this subscription. Leave the wake-up to the
            // caller's timers rather than spin.
            return Poll::Pending;
        };
        if entry.generation != this.inner.seen {
            this.inner.seen = entry.generation;
            entry.deregister(this.inner.id);
            this.registered = false;
            return Poll::Ready(());
        }
        entry.register(this.inner.id, cx.waker());
        this.registered = true;
        Poll::Pending
    }
}

impl Drop for Changed<'_> {
    fn drop(&mut self) {
        if !self.registered {
            return;
        }
        if let Some(entry) = lock(&self.inner.shared).entries.get_mut(&self.inner.key) {
            entry.deregister(self.inner.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn wakers(w: &Waiters, key: &RecordKey) -> usize {
        lock(&w.shared)
            .entries
            .get(key)
            .map_or(0, |entry| entry.wakers.len())
    }

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

    #[test]
    fn the_key_count_follows_the_entries() {
        let w = Waiters::new();
        let keys = |w: &Waiters| w.shared.keys.load(Ordering::Relaxed);
        let (a, b) = (RecordKey::new("s", "a"), RecordKey::new("s", "b"));
        let a1 = w.subscribe(&a);
        let a2 = w.subscribe(&a);
        let b1 = w.subscribe(&b);
        assert_eq!(keys(&w), 2, "one per key, not per subscription");
        drop(a1);
        assert_eq!(keys(&w), 2);
        drop(a2);
        assert_eq!(keys(&w), 1);
        // With `b` still waited for, a notify of `a` takes the lock and finds nothing to wake.
        w.notify(&a);
        drop(b1);
        assert_eq!(keys(&w), 0);
        assert_eq!(w.waiting_keys(), 0);
    }

    #[test]
    fn a_cancelled_changed_deregisters_its_waker_and_loses_nothing() {
        let w = Waiters::new();
        let k = RecordKey::new("s", "k");
        let mut sub = w.subscribe(&k);
        let counter = std::sync::Arc::new(CountingWaker::default());
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        {
            let mut changed = std::pin::pin!(sub.changed());
            assert!(changed.as_mut().poll(&mut cx).is_pending());
            // Polling again with the same waker does not register it twice.
            assert!(changed.as_mut().poll(&mut cx).is_pending());
            assert_eq!(wakers(&w, &k), 1);
        }
        assert_eq!(wakers(&w, &k), 0, "the dropped future took its waker out");
        w.notify(&k);
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            0,
            "nobody woke a dropped future"
        );
        // The notification that came after the cancellation is still this subscription's.
        let mut changed = std::pin::pin!(sub.changed());
        assert!(changed.as_mut().poll(&mut cx).is_ready());
    }

    #[test]
    fn notify_all_wakes_every_key_and_each_notification_is_seen_once() {
        let w = Waiters::new();
        let counter = std::sync::Arc::new(CountingWaker::default());
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        let mut subs: Vec<_> = ["a", "b"]
            .iter()
            .map(|k| w.subscribe(&RecordKey::new("s", *k)))
            .collect();
        let mut pending: Vec<_> = subs.iter_mut().map(|sub| Box::pin(sub.changed())).collect();
        for changed in &mut pending {
            assert!(changed.as_mut().poll(&mut cx).is_pending());
        }
        w.notify_all();
        assert_eq!(counter.0.load(Ordering::SeqCst), 2);
        for changed in &mut pending {
            assert!(changed.as_mut().poll(&mut cx).is_ready());
        }
        drop(pending);
        for sub in &mut subs {
            // Consumed: the next `changed` waits for the next notification.
            assert!(std::pin::pin!(sub.changed()).poll(&mut cx).is_pending());
        }
    }
}
