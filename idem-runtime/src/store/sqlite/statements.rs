//! The SQLite store's statements: the writes of each kind for any number of rows, the lookups, and
//! the operator's statements. Each is one statement, or a claim's upsert and its read. A write is
//! a [`Change`] (its record and values) and its statement's rows are read back as an [`Answer`],
//! whether it ran alone or in a batch.

use super::decode;
use crate::clock::Timestamp;
use crate::record::Record;
use crate::store::{Claim, Claimed, StoreError};
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqliteRow};
use sqlx::Row;

/// The claim, for each row of `(scope, key, token, fingerprint, now, expires_at, retain_until,
/// lease_until)`: [`Claim::decide`] in SQL. A row's `now` is stored as `created_at`, so
/// `excluded.created_at` is the claim's `now`. The `DO UPDATE` applies to a record the claim
/// replaces ([`FRESH`]: past retention, or released by another request; every column from the
/// claim, as a fresh record), to one it takes over (in flight past its lease, the same request, not
/// expired) and to one it resumes (released by the same request, not expired): those two get the
/// new token and lease and keep `created_at`, `expires_at` and `retain_until` (so they apply only
/// if those are [`INTACT`]). `claimed_by` says which, for the answer. All `SET` expressions read
/// the row as it was before the update. A second claim of a key within one statement finds the
/// first's fresh record, which it takes only as it would in a statement of its own (past that
/// record's lease or retention at its own `now`).
pub(super) const CLAIM: &str = r#"
INSERT INTO idem_records
    (scope, key, token, fingerprint, created_at, expires_at, retain_until, state, lease_until,
     takeovers, claimed_by)
VALUES {rows}
ON CONFLICT (scope, key) DO UPDATE SET
    claimed_by   = CASE WHEN {fresh} THEN 'insert'
                        WHEN idem_records.state = 'released' THEN 'resume'
                        ELSE 'take_over' END,
    takeovers    = CASE WHEN {fresh} THEN 0
                        WHEN idem_records.state = 'released' THEN idem_records.takeovers
                        ELSE idem_records.takeovers + 1 END,
    fingerprint  = excluded.fingerprint,
    token        = excluded.token,
    state        = 'in_flight',
    lease_until  = excluded.lease_until,
    created_at   = CASE WHEN {fresh} THEN excluded.created_at ELSE idem_records.created_at END,
    expires_at   = CASE WHEN {fresh} THEN excluded.expires_at ELSE idem_records.expires_at END,
    retain_until = CASE WHEN {fresh} THEN excluded.retain_until ELSE idem_records.retain_until END,
    status       = NULL,
    headers      = NULL,
    body         = NULL
WHERE {fresh}
   OR ({same} AND {intact}
       AND (idem_records.state = 'released'
            OR (idem_records.state = 'in_flight'
                AND idem_records.lease_until <= excluded.created_at)))
RETURNING scope, key, token, claimed_by, created_at, expires_at
"#;

/// The record a claim finds is the same request's, and not expired at the claim's `now`.
pub(super) const SAME: &str = "(idem_records.fingerprint = excluded.fingerprint
        AND excluded.created_at < idem_records.expires_at)";

/// The times a takeover or a resumption keeps are integers, as every store writes them: a row
/// damaged otherwise is left as it is, and its read answers the claim as corrupt.
pub(super) const INTACT: &str = "(typeof(idem_records.created_at) = 'integer'
        AND typeof(idem_records.expires_at) = 'integer'
        AND typeof(idem_records.retain_until) = 'integer')";

/// The record a claim finds counts as absent: past retention, or released by another request
/// ([`ClaimRule::Insert`]).
pub(super) const FRESH: &str = "(idem_records.retain_until <= excluded.created_at
        OR (idem_records.state = 'released' AND NOT {same}))";

/// The completion of each in-flight record still held by the row's token.
pub(super) const COMPLETE: &str = r#"
WITH v (scope, key, token, status, headers, body) AS (VALUES {rows})
UPDATE idem_records
SET state = 'completed', lease_until = NULL, status = v.status, headers = v.headers, body = v.body
FROM v
WHERE idem_records.scope = v.scope AND idem_records.key = v.key AND idem_records.token = v.token
  AND idem_records.state = 'in_flight'
RETURNING scope, key, token
"#;

pub(super) const RENEW: &str = r#"
WITH v (scope, key, token, lease_until) AS (VALUES {rows})
UPDATE idem_records SET lease_until = v.lease_until
FROM v
WHERE idem_records.scope = v.scope AND idem_records.key = v.key AND idem_records.token = v.token
  AND idem_records.state = 'in_flight'
RETURNING scope, key, token
"#;

/// The release of each in-flight record still held by the row's token: kept, as released, with its
/// times, for its request's retry to resume.
pub(super) const RELEASE: &str = r#"
WITH v (scope, key, token) AS (VALUES {rows})
UPDATE idem_records SET state = 'released', lease_until = NULL
FROM v
WHERE idem_records.scope = v.scope AND idem_records.key = v.key AND idem_records.token = v.token
  AND idem_records.state = 'in_flight'
RETURNING scope, key, token
"#;

/// At most `?2` records past retention at `?1`, oldest first, found through the `retain_until` index.
pub(super) const PURGE: &str = r#"
DELETE FROM idem_records
WHERE rowid IN (
    SELECT rowid FROM idem_records WHERE retain_until <= ?1 ORDER BY retain_until LIMIT ?2
)
"#;

/// The record of `(?1, ?2)` if it still carries token `?3` in state `?4`.
pub(super) const FORGET: &str =
    "DELETE FROM idem_records WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = ?4";

/// At most `?2` records of scope `?1`, found through the primary key; their keys.
pub(super) const ERASE: &str = r#"
DELETE FROM idem_records
WHERE rowid IN (SELECT rowid FROM idem_records WHERE scope = ?1 LIMIT ?2)
RETURNING key
"#;

/// In-flight records not past retention at `?1` created at or before `?2`, oldest first, at most
/// `?3`, through the in-flight index.
pub(super) const IN_FLIGHT: &str = "state = 'in_flight' AND retain_until > ?1 AND created_at <= ?2
    ORDER BY created_at, scope, key LIMIT ?3";

/// The records by state at `?1`, as [`Stats::count`] counts them.
pub(super) const STATS: &str = r#"
SELECT
    sum(retain_until <= ?1) AS forgotten,
    sum(retain_until > ?1 AND state = 'released') AS released,
    sum(retain_until > ?1 AND state <> 'released' AND ?1 >= expires_at) AS expired,
    sum(retain_until > ?1 AND state = 'completed' AND ?1 < expires_at) AS completed,
    sum(retain_until > ?1 AND state = 'in_flight' AND ?1 < expires_at) AS in_flight,
    min(CASE WHEN retain_until > ?1 AND state = 'in_flight' AND ?1 < expires_at
             THEN created_at END) AS oldest
FROM idem_records
"#;

/// The lookup of `n` records by primary key, bound as `scope, key` pairs in order. Records past
/// retention are returned too; [`SqliteStore::fetch`] hides them by the caller's clock.
pub(super) fn select_many(n: usize) -> String {
    select_where(&repeat(n, "(scope = ? AND key = ?)", " OR "))
}

/// How many columns [`select_where`] reads.
pub(super) const RECORD_COLUMNS: usize = 12;

/// The records that match `condition`, every column.
pub(super) fn select_where(condition: &str) -> String {
    format!(
        "SELECT scope, key, fingerprint, token, created_at, expires_at, retain_until, state,
                lease_until, status, headers, body
         FROM idem_records WHERE {condition}"
    )
}

/// `n` copies of `item`, joined by `separator`.
pub(super) fn repeat(n: usize, item: &str, separator: &str) -> String {
    vec![item; n].join(separator)
}

/// The kinds of write, in the order a batch applies them.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub(super) enum Kind {
    Release,
    Complete,
    Renew,
    Claim,
}

impl Kind {
    /// What the writer sends for `n` writes of this kind: [`statement`](Self::statement), in a
    /// transaction if it is several writes (a statement that fails part-way, as a trigger's
    /// `RAISE(FAIL)` can make it, keeps its earlier rows) or a claim (whose read must not fail
    /// after its upsert committed, or a claim that won would be told it failed).
    pub(super) fn transaction(self, n: usize) -> String {
        let statement = self.statement(n);
        match (self, n) {
            (Kind::Claim, _) | (_, 2..) => format!("BEGIN IMMEDIATE;{statement};COMMIT"),
            _ => statement,
        }
    }

    /// The statement that applies `n` writes of this kind.
    pub(super) fn statement(self, n: usize) -> String {
        let (sql, tuple, separator) = match self {
            Kind::Claim => (
                CLAIM,
                "(?, ?, ?, ?, ?, ?, ?, 'in_flight', ?, 0, 'insert')",
                ", ",
            ),
            Kind::Complete => (COMPLETE, "(?, ?, ?, ?, ?, ?)", ", "),
            Kind::Renew => (RENEW, "(?, ?, ?, ?)", ", "),
            Kind::Release => (RELEASE, "(?, ?, ?)", ", "),
        };
        let statement = sql
            .replace("{rows}", &repeat(n, tuple, separator))
            .replace("{fresh}", FRESH)
            .replace("{same}", SAME)
            .replace("{intact}", INTACT);
        match self {
            // In the same call, each claim's record unless it is the claim's own in-flight one
            // (a claim that won), for the claims that did not win.
            Kind::Claim => {
                let record = "(scope = ? AND key = ? AND (token <> ? OR state <> 'in_flight'))";
                let lost = repeat(n, record, " OR ");
                format!("{statement};{}", select_where(&lost))
            }
            _ => statement,
        }
    }
}

/// The row of record (`scope`, `key`) among rows that start with `scope, key`. Rows match a lookup's
/// text exactly (the statement compared them), so a row whose scope or key does not read as text is
/// no lookup's.
pub(super) fn record_of<'r>(
    mut rows: impl Iterator<Item = &'r SqliteRow>,
    scope: &str,
    key: &str,
) -> Option<&'r SqliteRow> {
    rows.find(|row| {
        row.try_get::<&str, _>(0).is_ok_and(|s| s == scope)
            && row.try_get::<&str, _>(1).is_ok_and(|k| k == key)
    })
}

/// A write's answer, once its statement committed.
pub(super) type Written = Result<Answer, StoreError>;

/// What a write's statement did.
#[derive(Debug)]
pub(super) enum Answer {
    /// A completion, release or renewal applied to its record.
    Applied,
    /// A claim won its record (inserted, took it over or resumed it).
    Won(Claimed),
    /// It found nothing to apply to. For a claim, the record that stood, read in the same call
    /// (none if it was gone by then).
    Stood(Option<Record>),
}

/// A write's row in its kind's statement: the record it applies to, the token it holds or claims
/// with, and its values.
pub(super) struct Change {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) token: i64,
    pub(super) values: Values,
}

pub(super) enum Values {
    Claim {
        fingerprint: [u8; 32],
        now: i64,
        expires_at: i64,
        retain_until: i64,
        lease_until: i64,
    },
    Complete {
        status: i64,
        headers: String,
        body: bytes::Bytes,
    },
    Renew {
        lease_until: i64,
    },
    Release,
}

impl Values {
    /// The row of `claim` made at the store's time `now`: the fresh record's instants.
    pub(super) fn claim(claim: &Claim<'_>, now: Timestamp) -> Self {
        let fresh = claim.record(now);
        Values::Claim {
            fingerprint: claim.fingerprint.0,
            now: now.as_millis(),
            expires_at: fresh.expires_at.as_millis(),
            retain_until: fresh.retain_until.as_millis(),
            lease_until: (now + claim.lease).as_millis(),
        }
    }
}

impl Change {
    pub(super) fn kind(&self) -> Kind {
        match self.values {
            Values::Claim { .. } => Kind::Claim,
            Values::Complete { .. } => Kind::Complete,
            Values::Renew { .. } => Kind::Renew,
            Values::Release => Kind::Release,
        }
    }

    pub(super) fn bind<'q>(&'q self, query: SqliteQuery<'q>) -> SqliteQuery<'q> {
        let query = query.bind(&self.scope).bind(&self.key).bind(self.token);
        match &self.values {
            Values::Claim {
                fingerprint,
                now,
                expires_at,
                retain_until,
                lease_until,
            } => query
                .bind(&fingerprint[..])
                .bind(now)
                .bind(expires_at)
                .bind(retain_until)
                .bind(lease_until),
            Values::Complete {
                status,
                headers,
                body,
            } => query.bind(status).bind(headers).bind(&body[..]),
            Values::Renew { lease_until } => query.bind(lease_until),
            Values::Release => query,
        }
    }

    /// This write's answer in the rows its statement returned (`scope, key, token`, and for claims
    /// `claimed_by, created_at, expires_at`), followed for claims by the rows of the records read
    /// after it.
    pub(super) fn answer(&self, rows: &[SqliteRow]) -> Written {
        // Returned rows have at most six columns, records read all of theirs.
        let mut returned = rows.iter().filter(|row| row.len() < RECORD_COLUMNS);
        let row = returned.find(|row| {
            row.try_get::<i64, _>(2)
                .is_ok_and(|token| token == self.token)
                && row.try_get::<&str, _>(1).is_ok_and(|key| key == self.key)
                && row
                    .try_get::<&str, _>(0)
                    .is_ok_and(|scope| scope == self.scope)
        });
        match row {
            Some(row) if self.kind() == Kind::Claim => won(row).map(Answer::Won),
            Some(_) => Ok(Answer::Applied),
            None => {
                let read = rows.iter().filter(|row| row.len() >= RECORD_COLUMNS);
                let stood = record_of(read, &self.scope, &self.key);
                stood.map(decode).transpose().map(Answer::Stood)
            }
        }
    }

    /// Whether `other` is a write to the same record under the same token.
    pub(super) fn repeats(&self, other: &Change) -> bool {
        self.token == other.token && self.key == other.key && self.scope == other.scope
    }
}

/// A won claim's returned row (`scope, key, token, claimed_by, created_at, expires_at`).
fn won(row: &SqliteRow) -> Result<Claimed, StoreError> {
    let claimed_by: &str = row.try_get(3).map_err(StoreError::corrupt)?;
    let millis = |i: usize| -> Result<Timestamp, StoreError> {
        row.try_get::<i64, _>(i)
            .map(Timestamp::from_millis)
            .map_err(StoreError::corrupt)
    };
    Ok(Claimed {
        taken_over: claimed_by == "take_over",
        created_at: millis(4)?,
        expires_at: millis(5)?,
    })
}

pub(super) type SqliteQuery<'q> = Query<'q, sqlx::Sqlite, SqliteArguments<'q>>;

/// Runs `sql` for `rows` and returns the rows it returned.
pub(super) async fn apply(
    conn: &mut SqliteConnection,
    sql: &str,
    rows: &[&Change],
) -> Result<Vec<SqliteRow>, sqlx::Error> {
    let mut query = sqlx::query(sql);
    for row in rows {
        query = row.bind(query);
    }
    // Claims are followed by the read of the records they did not win.
    if rows.first().is_some_and(|row| row.kind() == Kind::Claim) {
        for row in rows {
            query = query.bind(&row.scope).bind(&row.key).bind(row.token);
        }
    }
    query.fetch_all(conn).await
}

/// Ends the transaction a failed statement may have left open (with none open, `ROLLBACK` fails
/// harmlessly). An error means the connection could not, and is not to be used again.
pub(super) async fn roll_back(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    match sqlx::query("ROLLBACK").execute(conn).await {
        Ok(_) | Err(sqlx::Error::Database(_)) => Ok(()),
        Err(error) => Err(error),
    }
}
