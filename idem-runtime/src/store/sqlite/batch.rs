//! The SQLite store's batching front end: a reader task and a writer task, each on a connection of
//! its own, that answer everything queued with one statement per kind (see "Concurrency" in the
//! [module documentation](super)). The store's methods reach it only through [`Batcher`]'s `read`
//! and `write`; the statements it runs are in `statements.rs`.

use super::decode;
use super::statements::{apply, record_of, roll_back, select_many, Change, Kind, Values, Written};
use crate::record::{FencingToken, Record, RecordKey};
use crate::store::StoreError;
use sqlx::sqlite::{SqliteConnection, SqlitePool};
use sqlx::ConnectOptions;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The queues of a store's reader and writer tasks, which end when it is dropped.
#[derive(Debug)]
pub(super) struct Batcher {
    writes: mpsc::UnboundedSender<Write>,
    reads: mpsc::UnboundedSender<Read>,
    /// Set when anything grew the log since the checkpointer's last turn.
    wrote: Arc<AtomicBool>,
}

impl Batcher {
    /// Starts the reader and the writer on connections of their own to `pool`'s database; the
    /// writer takes `gate` for each batch.
    pub(super) fn spawn(pool: &SqlitePool, gate: Arc<tokio::sync::Mutex<()>>) -> Self {
        let (writes, queue) = mpsc::unbounded_channel();
        let wrote = Arc::new(AtomicBool::new(false));
        tokio::spawn(checkpoints(pool.clone(), Arc::downgrade(&wrote)));
        tokio::spawn(write_batches(pool.clone(), gate, queue, wrote.clone()));
        let (reads, queue) = mpsc::unbounded_channel();
        tokio::spawn(read_batches(pool.clone(), queue));
        Self {
            writes,
            reads,
            wrote,
        }
    }

    /// Tells the checkpointer that a write outside the writer (a purge) grew the log.
    pub(super) fn wrote(&self) {
        self.wrote.store(true, Ordering::Relaxed);
    }

    /// The row of `key`, past retention or not, read with the lookups queued beside it.
    pub(super) async fn read(&self, key: &RecordKey) -> Found {
        let stopped = || StoreError::unavailable("the SQLite store's reader has stopped");
        let (reply, answer) = oneshot::channel();
        let read = Read {
            scope: key.scope().to_owned(),
            key: key.key().to_owned(),
            reply,
        };
        self.reads.send(read).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// Applies `values` to `key`'s record under `token` with the writes of its kind queued beside
    /// it; its answer, once committed.
    pub(super) async fn write(
        &self,
        key: &RecordKey,
        token: FencingToken,
        values: Values,
    ) -> Written {
        let stopped = || StoreError::unavailable("the SQLite store's writer has stopped");
        let (reply, answer) = oneshot::channel();
        let row = Change {
            scope: key.scope().to_owned(),
            key: key.key().to_owned(),
            token: token.0,
            values,
        };
        self.writes
            .send(Write { row, reply })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// At most this many lookups share one statement.
const MAX_READS: usize = 64;

pub(super) type Found = Result<Option<Record>, StoreError>;

/// One lookup by primary key for the reader, and where to send the record found.
struct Read {
    scope: String,
    key: String,
    reply: oneshot::Sender<Found>,
}

/// The reader task: on a connection of its own, takes every lookup queued (up to [`MAX_READS`]) and
/// answers them all with one `SELECT`. sqlx runs each statement on its connection's own thread, so
/// lookups sent one by one would each pay that hand-off, which costs far more than the lookup. Ends
/// when the store (the queue's sender) is gone.
async fn read_batches(pool: SqlitePool, mut queue: mpsc::UnboundedReceiver<Read>) {
    let mut conn: Option<SqliteConnection> = None;
    let mut batch = Vec::with_capacity(MAX_READS);
    // The statement for n lookups at index n - 1, made when first needed (sqlx keeps it prepared).
    let mut statements: Vec<String> = Vec::new();
    while queue.recv_many(&mut batch, MAX_READS).await > 0 {
        // Let the tasks that are ready run first (requests whose sockets have data): their
        // lookups join this batch instead of waiting for the next one.
        tokio::task::yield_now().await;
        take_queued(&mut queue, &mut batch, MAX_READS);
        batch.retain(|read| !read.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        while statements.len() < batch.len() {
            statements.push(select_many(statements.len() + 1));
        }
        let mut query = sqlx::query(&statements[batch.len() - 1]);
        for read in &batch {
            query = query.bind(read.scope.as_str()).bind(read.key.as_str());
        }
        let rows = match own_connection(&pool, &mut conn, None).await {
            Ok(conn) => query.fetch_all(conn).await,
            Err(error) => Err(error),
        };
        let rows = match rows {
            Ok(rows) => rows,
            Err(error) => {
                let error = Arc::new(error);
                for Read { reply, .. } in batch.drain(..) {
                    let _ = reply.send(Err(StoreError::unavailable(error.clone())));
                }
                conn = None;
                continue;
            }
        };
        for Read { scope, key, reply } in batch.drain(..) {
            let row = record_of(rows.iter(), &scope, &key);
            let _ = reply.send(row.map(decode).transpose());
        }
    }
}

/// Moves what is queued now into `batch`, up to `max` in all, without waiting.
fn take_queued<T>(queue: &mut mpsc::UnboundedReceiver<T>, batch: &mut Vec<T>, max: usize) {
    while batch.len() < max {
        match queue.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
}

/// The reader's, the writer's or the checkpointer's connection, opened with the pool's options
/// when first needed, then `setup` run on it. Closing the pool closes the store: the connection is
/// then dropped and every call fails.
async fn own_connection<'c>(
    pool: &SqlitePool,
    conn: &'c mut Option<SqliteConnection>,
    setup: Option<&str>,
) -> Result<&'c mut SqliteConnection, sqlx::Error> {
    if pool.is_closed() {
        *conn = None;
        return Err(sqlx::Error::PoolClosed);
    }
    if conn.is_none() {
        let mut opened = pool.connect_options().connect().await?;
        if let Some(setup) = setup {
            sqlx::query(setup).execute(&mut opened).await?;
        }
        *conn = Some(opened);
    }
    conn.as_mut().ok_or(sqlx::Error::PoolClosed)
}

/// How often the checkpointer copies what the writer committed from the write-ahead log into the
/// database, when it wrote anything since the last time.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// The writer's connection never checkpoints on its own: SQLite's automatic checkpoint runs inside
/// the commit that crosses its threshold (1,000 pages), flushing the log and the database to disk
/// while every write queued behind that batch waits; that was the writer's latency tail.
const WRITER_SETUP: &str = "PRAGMA wal_autocheckpoint = 0";

/// The checkpointer task: on a connection of its own, every [`CHECKPOINT_EVERY`] that the writer
/// wrote, a passive checkpoint (it never waits for readers or the writer, and the writer never
/// waits for it), so the log stays short without the writer paying for it; with `synchronous =
/// NORMAL` this is also when commits reach the disk. Ends when the writer does (`wrote` is gone)
/// or the pool is closed.
async fn checkpoints(pool: SqlitePool, wrote: Weak<AtomicBool>) {
    let mut conn: Option<SqliteConnection> = None;
    let mut ticker = tokio::time::interval(CHECKPOINT_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(wrote) = wrote.upgrade() else {
            return;
        };
        if !wrote.swap(false, Ordering::Relaxed) {
            continue;
        }
        drop(wrote);
        let done = match own_connection(&pool, &mut conn, None).await {
            Ok(conn) => sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                .execute(conn)
                .await
                .map(drop),
            Err(sqlx::Error::PoolClosed) => return,
            Err(error) => Err(error),
        };
        if let Err(error) = done {
            // The next commit's turn tries again, on a fresh connection.
            tracing::debug!(target: "idem", %error, "SQLite checkpoint failed");
            conn = None;
        }
    }
}

/// At most this many writes are taken from the queue at once.
const MAX_BATCH: usize = 128;

/// One write for the writer, and where to send its answer once it committed.
struct Write {
    row: Change,
    reply: oneshot::Sender<Written>,
}

/// The writer task: on a connection of its own and under the write gate, takes every write queued
/// (up to [`MAX_BATCH`]) and applies those of each kind together, answering each caller once they
/// committed, and tells the checkpointer it wrote. Ends when the store (the queue's sender) is
/// gone.
async fn write_batches(
    pool: SqlitePool,
    gate: Arc<tokio::sync::Mutex<()>>,
    mut queue: mpsc::UnboundedReceiver<Write>,
    wrote: Arc<AtomicBool>,
) {
    let mut conn: Option<SqliteConnection> = None;
    // Each kind's statement for n writes, made when first needed; sqlx keeps the statements it
    // used last prepared.
    let mut statements: HashMap<(Kind, usize), String> = HashMap::new();
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut next = Vec::new();
    loop {
        batch.append(&mut next);
        if batch.is_empty() && queue.recv_many(&mut batch, MAX_BATCH).await == 0 {
            return;
        }
        // As for lookups: the writes of tasks that are ready join this batch.
        tokio::task::yield_now().await;
        let _gate = gate.lock().await;
        // Whatever was queued while waiting for the gate joins this batch.
        take_queued(&mut queue, &mut batch, MAX_BATCH);
        // A write whose caller has gone is skipped.
        batch.retain(|write| !write.reply.is_closed());
        // A second write to one record under one token waits for the next batch, so that it sees
        // the first's effect (a second completion is fenced), as in queue order.
        let mut i = 0;
        while i < batch.len() {
            if batch[..i].iter().any(|w| w.row.repeats(&batch[i].row)) {
                next.push(batch.remove(i));
            } else {
                i += 1;
            }
        }
        let mut healthy = true;
        // By kind; releases and completions first, so that claims queued beside them find their
        // records released (to resume or replace) or completed.
        batch.sort_by_key(|write| write.row.kind());
        while let Some(kind) = batch.first().map(|write| write.row.kind()) {
            let n = batch.iter().take_while(|w| w.row.kind() == kind).count();
            let group: Vec<Write> = batch.drain(..n).collect();
            healthy &= match own_connection(&pool, &mut conn, Some(WRITER_SETUP)).await {
                Ok(conn) => run_group(conn, &mut statements, kind, group).await,
                Err(error) => answer_all(group, error),
            };
        }
        wrote.store(true, Ordering::Relaxed);
        if !healthy {
            // A fresh connection for the next batch, in case this one is broken.
            conn = None;
        }
    }
}

/// Applies `group` (writes of one `kind`) and answers each write; returns whether the connection is
/// still sound. The writes share one statement ([`Kind::transaction`]). If that fails on one
/// write's data (a trigger, a constraint), it is rolled back and each write runs alone, so that
/// only the failing one fails.
async fn run_group(
    conn: &mut SqliteConnection,
    statements: &mut HashMap<(Kind, usize), String>,
    kind: Kind,
    group: Vec<Write>,
) -> bool {
    let n = group.len();
    let rows: Vec<&Change> = group.iter().map(|write| &write.row).collect();
    let sql = statements
        .entry((kind, n))
        .or_insert_with(|| kind.transaction(n));
    let error = match apply(conn, sql, &rows).await {
        Ok(applied) => {
            for Write { row, reply } in group {
                let _ = reply.send(row.answer(&applied));
            }
            return true;
        }
        Err(error) => error,
    };
    if roll_back(conn).await.is_err() {
        answer_all(group, error);
        return false;
    }
    match error {
        sqlx::Error::Database(e) if n > 1 && !is_busy(&*e) => {
            let sql = statements
                .entry((kind, 1))
                .or_insert_with(|| kind.transaction(1));
            let mut writes = group.into_iter();
            while let Some(write) = writes.next() {
                match apply(conn, sql, &[&write.row]).await {
                    Ok(applied) => {
                        let answer = write.row.answer(&applied);
                        let _ = write.reply.send(answer);
                    }
                    Err(sqlx::Error::Database(e)) if !is_busy(&*e) => {
                        let _ = write.reply.send(Err(sqlx::Error::Database(e).into()));
                        if let Err(error) = roll_back(conn).await {
                            return answer_all(writes.collect(), error);
                        }
                    }
                    // Another connection's lock, or a broken connection: the writes left would
                    // each meet it too.
                    Err(error) => {
                        return answer_all(std::iter::once(write).chain(writes).collect(), error)
                    }
                }
            }
            true
        }
        error => answer_all(group, error),
    }
}

/// Answers every write of `group` with `error` (nothing of theirs committed); returns whether the
/// connection is still sound, which it is after an error of the statement itself.
fn answer_all(group: Vec<Write>, error: sqlx::Error) -> bool {
    let sound = matches!(error, sqlx::Error::Database(_));
    let error = Arc::new(error);
    for Write { reply, .. } in group {
        let _ = reply.send(Err(StoreError::unavailable(error.clone())));
    }
    sound
}

/// Whether SQLite failed for another connection's lock (`SQLITE_BUSY`, `SQLITE_LOCKED`) after
/// `busy_timeout`: running the writes one by one would wait that long for each.
fn is_busy(error: &dyn sqlx::error::DatabaseError) -> bool {
    let code = error.code().and_then(|code| code.parse::<i32>().ok());
    matches!(code.map(|code| code & 0xff), Some(5 | 6))
}

#[cfg(test)]
mod tests {
    use super::super::statements::Answer;
    use super::super::tests::{
        claim, claimed, is_completed, queue, response, temp_store, Boxed, Pending, NOW,
    };
    use super::*;
    use crate::clock::Clock;
    use crate::fingerprint::Fingerprint;
    use crate::record::{RecordState, StoredResponse};
    use crate::store::{Claim, ClaimOutcome, Claimed, Store, StoreErrorKind};
    use std::future::Future;
    use std::time::Duration;

    /// Writes queued while the writer waits share one statement: 16 completions commit together
    /// (the log grows by a page or two, not by a commit each), a fenced one among them is only its
    /// own answer, a caller that stopped waiting has its write skipped, and reads go on meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_writes_share_one_statement() {
        let (_dir, _url, store) = temp_store().await;
        let keys: Vec<RecordKey> = (0..17)
            .map(|i| RecordKey::new("batch", format!("k{i}")))
            .collect();
        let tokens = claimed(&store, &keys).await;
        // An empty log, so that its size afterwards counts this batch's pages alone. The store's
        // checkpointer may hold the checkpoint at that moment (then this one reports busy and
        // truncates nothing): again until it truncated.
        for attempt in 0.. {
            let (busy, log, _): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)")
                .fetch_one(store.pool())
                .await
                .expect("checkpoint");
            if busy == 0 && log == 0 {
                break;
            }
            assert!(attempt < 1000, "the log was never truncated");
            tokio::task::yield_now().await;
        }
        let response = response();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Pending<'_>> = (0..16)
            .map(|i| store.complete(&keys[i], tokens[i], &response))
            .collect();
        writes.push(store.complete(&keys[0], FencingToken::generate(), &response));
        let mut gone = vec![store.release(&keys[16], tokens[16])];
        queue(&mut writes);
        queue(&mut gone);
        drop(gone);
        assert!(!is_completed(&store, &keys[1]).await, "read while queued");
        drop(gate);

        let fenced = writes
            .pop()
            .expect("fenced write")
            .await
            .expect_err("fenced");
        assert_eq!(fenced.kind(), StoreErrorKind::Fenced);
        for write in writes {
            write.await.expect("completed");
        }
        for key in &keys[..16] {
            assert!(is_completed(&store, key).await, "{key}");
        }
        let skipped = store
            .get(&keys[16])
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get");
        assert!(
            skipped.is_some(),
            "the dropped caller's release was skipped"
        );
        let (_, frames, _): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_one(store.pool())
            .await
            .expect("checkpoint");
        assert!((1..16).contains(&frames), "{frames} pages logged");
    }

    /// What the writer commits reaches the database file without anyone checkpointing and far
    /// below SQLite's automatic threshold (1,000 pages): the checkpointer copies it there. The
    /// writer's own connection never checkpoints.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_checkpointer_copies_the_writers_commits_into_the_database() {
        let (dir, _url, store) = temp_store().await;
        let file = dir.path().join("idem.db");
        let size = || std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
        let before = size();
        let keys: Vec<RecordKey> = (0..20)
            .map(|i| RecordKey::new("checkpoint", format!("k{i}")))
            .collect();
        let tokens = claimed(&store, &keys).await;
        let body = bytes::Bytes::from(vec![b'x'; 8192]);
        let response = StoredResponse {
            status: 200,
            headers: vec![],
            body,
        };
        for (key, token) in keys.iter().zip(&tokens) {
            store
                .complete(key, *token, &response)
                .await
                .expect("complete");
        }
        // 20 records of 8 KiB: a few dozen pages, in the log until a checkpoint copies them.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while size() < before + 20 * 8192 {
            assert!(
                std::time::Instant::now() < deadline,
                "the database file stayed at {} bytes (from {before})",
                size()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for key in &keys {
            assert!(is_completed(&store, key).await, "{key}");
        }
    }

    /// Claims queued together share one statement: of three on one key exactly one wins and the
    /// others are answered with its record, read in the same call; a claim of another key beside
    /// them wins its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_queued_together_on_one_key_have_one_winner() {
        let (_dir, _url, store) = temp_store().await;
        let (shared, other) = (
            RecordKey::new("batch", "shared"),
            RecordKey::new("batch", "other"),
        );
        let claims: Vec<Claim<'_>> = [&shared, &shared, &shared, &other]
            .into_iter()
            .map(|key| claim(key, 1))
            .collect();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Boxed<'_, Written>> = claims
            .iter()
            .map(|c| {
                Box::pin(store.write(c.key, c.token, Values::claim(c, NOW))) as Boxed<'_, Written>
            })
            .collect();
        queue(&mut writes);
        drop(gate);
        let mut answers = Vec::new();
        for write in writes {
            answers.push(write.await.expect("claim"));
        }
        let won: Vec<bool> = answers
            .iter()
            .map(|answer| {
                matches!(
                    answer,
                    Answer::Won(Claimed {
                        taken_over: false,
                        created_at: NOW,
                        ..
                    })
                )
            })
            .collect();
        assert_eq!(won.iter().filter(|&&w| w).count(), 2, "{answers:?}");
        assert!(won[3], "the other key's claim won");
        let winner = won[..3].iter().position(|&w| w).expect("a winner");
        let record = store
            .get(&shared)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .expect("record");
        assert_eq!(record.token, claims[winner].token);
        assert!(matches!(record.state, RecordState::InFlight { .. }));
        for (i, answer) in answers[..3].iter().enumerate() {
            if i != winner {
                assert!(
                    matches!(answer, Answer::Stood(Some(stood)) if *stood == record),
                    "{answer:?}"
                );
            }
        }
    }

    /// A write whose data fails its batch's statement (a trigger here) gets the error alone: the
    /// others queued with it are applied one by one and told so. With `RAISE(FAIL)`, which keeps
    /// what a statement changed before failing, the batch's transaction is what keeps them from
    /// being applied twice (and then told they were fenced).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_write_fails_alone() {
        for action in ["ABORT", "FAIL"] {
            let (_dir, _url, store) = temp_store().await;
            let keys: Vec<RecordKey> = (0..9)
                .map(|i| RecordKey::new("batch", format!("k{i}")))
                .collect();
            let tokens = claimed(&store, &keys).await;
            sqlx::query(&format!(
                "CREATE TRIGGER poison BEFORE UPDATE ON idem_records WHEN NEW.key = 'k4'
                 BEGIN SELECT RAISE({action}, 'poisoned'); END"
            ))
            .execute(store.pool())
            .await
            .expect("trigger");
            let response = response();
            let gate = store.shared.write_gate.lock().await;
            let mut writes: Vec<Pending<'_>> = keys
                .iter()
                .zip(&tokens)
                .map(|(key, token)| store.complete(key, *token, &response))
                .collect();
            queue(&mut writes);
            drop(gate);
            for (i, write) in writes.into_iter().enumerate() {
                match write.await {
                    Ok(()) => assert_ne!(i, 4, "{action}"),
                    Err(e) => {
                        assert_eq!(i, 4, "{action}: {e}");
                        assert_eq!(e.kind(), StoreErrorKind::Unavailable);
                    }
                }
            }
            for (i, key) in keys.iter().enumerate() {
                assert_eq!(is_completed(&store, key).await, i != 4, "{action}: {key}");
            }
        }
    }

    /// Likewise for claims, which run in a transaction even alone (their read follows the upsert):
    /// a claim that fails alone is rolled back, and the writer's next transaction starts cleanly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_claim_fails_alone() {
        let (_dir, _url, store) = temp_store().await;
        sqlx::query(
            "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'k4'
             BEGIN SELECT RAISE(ABORT, 'poisoned'); END",
        )
        .execute(store.pool())
        .await
        .expect("trigger");
        let keys: Vec<RecordKey> = (0..10)
            .map(|i| RecordKey::new("batch", format!("k{i}")))
            .collect();
        let claims: Vec<Claim<'_>> = keys[..9].iter().map(|key| claim(key, 1)).collect();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Boxed<'_, Result<ClaimOutcome, StoreError>>> = claims
            .iter()
            .map(|c| Box::pin(store.claim(c)) as Boxed<'_, _>)
            .collect();
        queue(&mut writes);
        drop(gate);
        for (i, write) in writes.into_iter().enumerate() {
            match write.await {
                Ok(outcome) => {
                    assert_ne!(i, 4);
                    assert!(matches!(
                        outcome,
                        ClaimOutcome::Claimed(Claimed {
                            taken_over: false,
                            ..
                        })
                    ));
                }
                Err(e) => assert_eq!(i, 4, "{e}"),
            }
        }
        // Alone, then a claim of another key on the same connection.
        assert!(store.claim(&claim(&keys[4], 1)).await.is_err());
        let last = store.claim(&claim(&keys[9], 1)).await.expect("claim");
        assert!(matches!(
            last,
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        let stored: Vec<String> = sqlx::query_scalar("SELECT key FROM idem_records ORDER BY key")
            .fetch_all(store.pool())
            .await
            .expect("keys");
        assert_eq!(
            stored,
            ["k0", "k1", "k2", "k3", "k5", "k6", "k7", "k8", "k9"]
        );
    }

    /// Two writes to one record under one token queued together go in turn, as in queue order:
    /// the first completion is stored and the second is fenced, not both told `Ok`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeated_write_waits_for_the_next_batch() {
        let (_dir, _url, store) = temp_store().await;
        let keys = [RecordKey::new("batch", "k0"), RecordKey::new("batch", "k1")];
        let tokens = claimed(&store, &keys).await;
        let response = response();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Pending<'_>> = vec![
            store.complete(&keys[0], tokens[0], &response),
            store.complete(&keys[0], tokens[0], &response),
            store.complete(&keys[1], tokens[1], &response),
        ];
        queue(&mut writes);
        drop(gate);
        let mut outcomes = Vec::new();
        for write in writes {
            outcomes.push(write.await);
        }
        assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
        let fenced = outcomes[1].as_ref().expect_err("the repeat is fenced");
        assert_eq!(fenced.kind(), StoreErrorKind::Fenced);
        assert!(outcomes[2].is_ok(), "{:?}", outcomes[2]);
        for key in &keys {
            assert!(is_completed(&store, key).await, "{key}");
        }
    }

    /// Lookups made together share the reader's statements, and each gets its own key's record:
    /// completed and in-flight ones as stored, absent ones none, a key asked twice the same record
    /// twice, and a record past retention at the caller's clock none, though its row is still there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookups_made_together_each_get_their_own_record() {
        let (_dir, _url, store) = temp_store().await;
        let keys: Vec<RecordKey> = (0..12)
            .map(|i| RecordKey::new("read", format!("k{i}")))
            .collect();
        let tokens = claimed(&store, &keys[..8]).await;
        for (i, key) in keys[..4].iter().enumerate() {
            let response = StoredResponse {
                status: 200 + i as u16,
                headers: vec![],
                body: bytes::Bytes::from(format!("body {i}")),
            };
            store
                .complete(key, tokens[i], &response)
                .await
                .expect("complete");
        }
        let mut asked: Vec<&RecordKey> = keys.iter().collect();
        asked.push(&keys[2]);
        // Each lookup polled once, which queues it for the reader, before any is awaited.
        let mut lookups: Vec<_> = asked
            .iter()
            .map(|key| Box::pin(store.fetch(key, NOW)))
            .collect();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for lookup in &mut lookups {
            let _ = lookup.as_mut().poll(&mut cx);
        }
        let mut found = Vec::new();
        for lookup in lookups {
            found.push(lookup.await);
        }
        for (key, found) in asked.iter().zip(found) {
            let found = found.expect("read");
            let i: usize = key.key()[1..].parse().expect("k<i>");
            match (i, found) {
                (0..4, Some(record)) => assert_eq!(
                    record.state,
                    RecordState::Completed {
                        response: StoredResponse {
                            status: 200 + i as u16,
                            headers: vec![],
                            body: bytes::Bytes::from(format!("body {i}")),
                        }
                    },
                    "{key}"
                ),
                (4..8, Some(record)) => {
                    assert_eq!(record.token, tokens[i], "{key}");
                    assert!(
                        matches!(record.state, RecordState::InFlight { .. }),
                        "{key}"
                    );
                }
                (8.., None) => {}
                (_, other) => panic!("{key}: {other:?}"),
            }
        }
        let later = NOW + Duration::from_secs(7200);
        assert!(store.fetch(&keys[0], later).await.expect("read").is_none());
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(rows, 8, "hidden, not deleted");
    }

    /// A release and a claim of its request queued together: the release goes first, and the
    /// claim resumes the record in the same batch (not a takeover, its times kept); another
    /// request's claim beside a release replaces the record. A record taken over, released and
    /// resumed is not told a takeover again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_queued_beside_a_release_resume_or_replace_it() {
        let clock = crate::clock::ManualClock::new(NOW);
        let (_dir, _url, store) = temp_store().await;
        let store = store.with_clock(clock.clone());
        let (same, other) = (RecordKey::new("q", "same"), RecordKey::new("q", "other"));
        // Claimed through the writer alone, so that the claims below are not known to this
        // process and go to the writer too, queued behind the releases (not read first).
        let mut tokens = Vec::new();
        for key in [&same, &other] {
            let first = claim(key, 1);
            let won = store
                .write(key, first.token, Values::claim(&first, NOW))
                .await;
            assert!(matches!(won, Ok(Answer::Won(_))), "{won:?}");
            tokens.push(first.token);
        }
        clock.advance(Duration::from_secs(1));
        let later = clock.now();
        let resume = claim(&same, 1);
        let replace = claim(&other, 2);
        let gate = store.shared.write_gate.lock().await;
        let mut releases: Vec<Pending<'_>> = vec![
            store.release(&same, tokens[0]),
            store.release(&other, tokens[1]),
        ];
        let mut claims: Vec<Boxed<'_, Result<ClaimOutcome, StoreError>>> = vec![
            Box::pin(store.claim(&resume)),
            Box::pin(store.claim(&replace)),
        ];
        queue(&mut releases);
        queue(&mut claims);
        drop(gate);
        for release in releases {
            release.await.expect("release");
        }
        let outcomes: Vec<ClaimOutcome> = {
            let mut outcomes = Vec::new();
            for claim in claims {
                outcomes.push(claim.await.expect("claim"));
            }
            outcomes
        };
        let hour = Duration::from_secs(3600);
        assert_eq!(
            outcomes,
            [
                ClaimOutcome::Claimed(Claimed {
                    taken_over: false,
                    created_at: NOW,
                    expires_at: NOW + hour,
                }),
                ClaimOutcome::Claimed(Claimed {
                    taken_over: false,
                    created_at: later,
                    expires_at: later + hour,
                }),
            ]
        );
        let record = store.get(&other).await.expect("get").expect("record");
        assert_eq!(
            (record.record.fingerprint, record.record.token),
            (Fingerprint([2; 32]), replace.token)
        );

        // Taken over past its lease, released, resumed: the resumption is no takeover.
        clock.advance(Duration::from_secs(31));
        let heir = claim(&same, 1);
        match store.claim(&heir).await.expect("claim") {
            ClaimOutcome::Claimed(c) => assert!(c.taken_over && c.created_at == NOW),
            other => panic!("{other:?}"),
        }
        store.release(&same, heir.token).await.expect("release");
        match store.claim(&claim(&same, 1)).await.expect("claim") {
            ClaimOutcome::Claimed(c) => assert!(!c.taken_over && c.created_at == NOW),
            other => panic!("{other:?}"),
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(rows, 2, "resumed and replaced in place");
    }
}
