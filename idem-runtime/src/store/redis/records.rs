//! What both Redis stores share: the scripts, and each operation on the records, sent on a
//! connection to one server or to a cluster (which routes each command by its one key).

use super::*;

/// What both Redis stores share: the key layout, the scripts, the local waiters, and each
/// operation, sent on a connection to one server or to a cluster (which routes each command by
/// its one key).
pub(super) struct Records {
    pub(super) prefix: String,
    pub(super) scripts: Scripts,
    pub(super) waiters: Arc<Waiters>,
    pub(super) durability: Option<Durability>,
    /// The clock the store judges time by instead of the server's `TIME` (tests move it).
    pub(super) clock: Option<Arc<dyn Clock>>,
}

/// A Lua script: its hash for `EVALSHA`, and its code for `EVAL` on a server that lacks it.
pub(super) struct Lua {
    pub(super) script: Script,
    pub(super) code: &'static str,
}

impl Lua {
    pub(super) fn new(code: &'static str) -> Self {
        Self {
            script: Script::new(code),
            code,
        }
    }
}

pub(super) struct Scripts {
    pub(super) claim: Lua,
    pub(super) get: Lua,
    pub(super) settle: Lua,
    pub(super) renew: Lua,
    pub(super) announce: Lua,
    pub(super) purge: Lua,
    pub(super) forget: Lua,
    pub(super) erase: Lua,
    pub(super) peek: Lua,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            claim: Lua::new(include_str!("claim.lua")),
            get: Lua::new(include_str!("get.lua")),
            settle: Lua::new(include_str!("settle.lua")),
            renew: Lua::new(include_str!("renew.lua")),
            announce: Lua::new(include_str!("announce.lua")),
            purge: Lua::new(include_str!("purge.lua")),
            forget: Lua::new(include_str!("forget.lua")),
            erase: Lua::new(include_str!("erase.lua")),
            peek: Lua::new(include_str!("peek.lua")),
        }
    }
}

impl Records {
    /// The time the scripts judge by: the given clock's now, or the server's.
    pub(super) fn script_now(&self) -> ScriptNow {
        ScriptNow(self.clock.as_ref().map(|clock| clock.now()))
    }

    pub(super) fn key<'a>(&'a self, key: &'a RecordKey) -> RedisKey<'a> {
        RedisKey {
            prefix: &self.prefix,
            key,
        }
    }

    pub(super) fn redis_key(&self, key: &RecordKey) -> String {
        let key = self.key(key);
        let mut out = String::with_capacity(key.max_len());
        // Writing to a String cannot fail.
        let _ = fmt::Write::write_fmt(&mut out, format_args!("{key}"));
        out
    }

    /// Sends `cmd`, followed on the same connection by `WAIT` if `durable` and the store waits for
    /// replicas. Returns the reply and whether the write is as durable as asked (always, without
    /// `WAIT`): the caller decides, from the reply, whether a write happened at all.
    pub(super) async fn send<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        cmd: Cmd,
        durable: bool,
    ) -> RedisResult<(T, bool)> {
        match self.durability.filter(|_| durable) {
            None => Ok((cmd.query_async(conn).await?, true)),
            Some(Durability {
                replicas,
                timeout_ms,
            }) => {
                let mut pipe = ::redis::Pipeline::with_capacity(2);
                pipe.add_command(cmd)
                    .cmd("WAIT")
                    .arg(replicas)
                    .arg(timeout_ms);
                let (reply, acked): (T, u32) = pipe.query_async(conn).await?;
                Ok((reply, acked >= replicas))
            }
        }
    }

    /// Runs `lua` on `key` with the arguments `args` appends (`bytes` bytes in all): as `EVALSHA`,
    /// or, on a server that does not know the script (restarted, flushed, or a cluster node that
    /// never ran it), as `EVAL`, which also caches it there. The command is built at its final size.
    pub(super) async fn eval<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        lua: &Lua,
        key: RedisKey<'_>,
        (count, bytes): (usize, usize),
        args: impl Fn(&mut Cmd),
        durable: bool,
    ) -> Result<(T, bool), StoreError> {
        let build = |code: bool| {
            let body = if code {
                lua.code
            } else {
                lua.script.get_hash()
            };
            let mut cmd = Cmd::with_capacity(4 + count, 32 + body.len() + key.max_len() + bytes);
            cmd.arg(if code { "EVAL" } else { "EVALSHA" })
                .arg(body)
                .arg(1)
                .arg(key);
            args(&mut cmd);
            cmd
        };
        match self.send(conn, build(false), durable).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                Box::pin(self.send(conn, build(true), durable)).await
            }
            found => found,
        }
        .map_err(redis_error)
    }

    /// Applies [`Claim::decide`] at the store's time in one script (`claim.lua`): inserts, takes
    /// over, resumes, or returns the record found, unchanged.
    pub(super) async fn claim<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        let key = self.key(claim.key);
        let token = blob::token(claim.token);
        let now = self.script_now();
        let retain = claim.retain.max(claim.ttl);
        let args = |cmd: &mut Cmd| {
            cmd.arg(&token[..])
                .arg(&claim.fingerprint.0[..])
                .arg(millis(claim.lease))
                .arg(millis(claim.ttl))
                .arg(millis(retain))
                .arg(now);
        };
        let ((rule, now, value), durable): ((i64, i64, Vec<u8>), bool) = self
            .eval(
                conn,
                &self.scripts.claim,
                key,
                (6, 8 + 32 + 3 * 20 + 20),
                args,
                true,
            )
            .await?;
        let now = Timestamp::from_millis(now);
        let record = blob::decode(value)?;
        let taken_over = match rule {
            KEPT => return Ok(ClaimOutcome::Existing(Found { record, now })),
            INSERTED | RESUMED => false,
            TAKEN_OVER => true,
            // A cluster client resent the script after a lost reply: the first one won. A fresh
            // record's lease ends exactly one lease after its creation.
            RESENT => !matches!(record.state, RecordState::InFlight { lease_until }
                if lease_until == record.created_at + claim.lease),
            other => {
                return Err(StoreError::corrupt(format!(
                    "claim.lua answered the unknown rule {other}"
                )))
            }
        };
        confirmed(durable)?;
        Ok(ClaimOutcome::Claimed(Claimed {
            taken_over,
            created_at: record.created_at,
            expires_at: record.expires_at,
        }))
    }

    /// Completes the claim with `response`, or releases it when `None` (`settle.lua`). Only a
    /// completion waits for replicas.
    pub(super) async fn settle<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
        token: FencingToken,
        response: Option<&StoredResponse>,
    ) -> Result<(), StoreError> {
        let tail = response.map(blob::Response::new).transpose()?;
        let args = |cmd: &mut Cmd| {
            cmd.arg(&blob::token(token)[..]);
            if let Some(tail) = tail {
                cmd.arg(tail);
            }
        };
        let sizes = (
            1 + usize::from(tail.is_some()),
            8 + tail.map_or(0, |t| t.len()),
        );
        let completing = response.is_some();
        let (reply, durable) = self
            .eval(
                conn,
                &self.scripts.settle,
                self.key(key),
                sizes,
                args,
                completing,
            )
            .await?;
        applied_or_fenced(reply)?;
        confirmed(durable)?;
        self.waiters.notify(key);
        Ok(())
    }

    pub(super) async fn renew<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let now = self.script_now();
        let args = |cmd: &mut Cmd| {
            cmd.arg(&blob::token(token)[..]).arg(millis(lease)).arg(now);
        };
        let (reply, _) = self
            .eval(
                conn,
                &self.scripts.renew,
                self.key(key),
                (3, 8 + 40),
                args,
                false,
            )
            .await?;
        applied_or_fenced(reply)
    }

    /// The record, unless past retention, with the store's time of the read (`get.lua`).
    pub(super) async fn get<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
    ) -> Result<Option<Found>, StoreError> {
        let now = self.script_now();
        let ((now, found), _): ((i64, Option<Vec<u8>>), bool) = self
            .eval(
                conn,
                &self.scripts.get,
                self.key(key),
                (1, 20),
                |cmd| {
                    cmd.arg(now);
                },
                false,
            )
            .await?;
        let now = Timestamp::from_millis(now);
        match found {
            Some(found) => Ok(Some(blob::decode(found)?)
                .filter(|r| !r.is_forgotten(now))
                .map(|record| Found { record, now })),
            None => Ok(None),
        }
    }

    /// Deletes the record if it still carries `token` in a state of kind `state` (`forget.lua`),
    /// and wakes its waiters here (the script publishes to the other instances).
    pub(super) async fn forget<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        let args = |cmd: &mut Cmd| {
            cmd.arg(&blob::token(token)[..]).arg(blob::state(state));
        };
        let (deleted, _): (i64, bool) = self
            .eval(
                conn,
                &self.scripts.forget,
                self.key(key),
                (2, 9),
                args,
                false,
            )
            .await?;
        if deleted == 1 {
            self.waiters.notify(key);
        }
        Ok(deleted == 1)
    }

    pub(super) async fn announce<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
    ) -> Result<(), StoreError> {
        let announce = &self.scripts.announce;
        let _marked: (i64, bool) = self
            .eval(conn, announce, self.key(key), (0, 0), |_| {}, false)
            .await?;
        Ok(())
    }

    /// Continues the `SCAN` pass at `cursor` over the store's keys on the server `conn` talks to,
    /// deleting records past retention at the store's time: at most `budget` records, in at most
    /// `steps` `SCAN` steps. Returns how many it deleted, the cursor to resume at (`None`: the pass
    /// is over) and the steps left.
    pub(super) async fn purge<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        mut cursor: u64,
        budget: u64,
        mut steps: usize,
    ) -> Result<(u64, Option<u64>, usize), StoreError> {
        let pattern = self.pattern(None);
        let mut deleted = 0u64;
        loop {
            steps = steps.saturating_sub(1);
            let (next, keys) = scan(conn, cursor, &pattern).await?;
            let mut done = 0;
            while done < keys.len() && deleted < budget {
                let take = usize::try_from(budget - deleted)
                    .unwrap_or(usize::MAX)
                    .min(keys.len() - done);
                let purged: Vec<i64> = self
                    .each(conn, &self.scripts.purge, &keys[done..done + take])
                    .await?;
                deleted += purged.iter().filter(|&&d| d == 1).count() as u64;
                done += take;
            }
            // SCAN cursors are stateless on the server: stopping inside a page means scanning that
            // page again next time (its deleted keys are gone), so nothing is skipped.
            if done == keys.len() && next == 0 {
                return Ok((deleted, None, steps));
            }
            cursor = if done < keys.len() { cursor } else { next };
            if deleted >= budget || steps == 0 {
                return Ok((deleted, Some(cursor), steps));
            }
        }
    }

    /// Runs `lua` once per key of `keys` (one pipelined round trip), with the store's time as its
    /// only argument for the scripts that take one; the replies in order.
    pub(super) async fn each<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        lua: &Lua,
        keys: &[Vec<u8>],
    ) -> Result<Vec<T>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.script_now();
        let mut pipe = ::redis::pipe();
        pipe.load_script(&lua.script).ignore();
        for key in keys {
            pipe.invoke_script(lua.script.key(key).arg(now));
        }
        pipe.query_async(conn).await.map_err(redis_error)
    }

    /// The `SCAN MATCH` pattern of every record, or of `scope`'s (as stored): the tag starts with
    /// the scope's length and the escaped scope, so the pattern matches that scope's keys and no
    /// other's.
    pub(super) fn pattern(&self, scope: Option<&str>) -> String {
        let mut pattern = format!("{}:{{", glob_escape(&self.prefix));
        if let Some(scope) = scope {
            let mut head = format!("{}:", escaped_len(scope));
            // Writing to a String cannot fail.
            let _ = escape(scope, &mut head);
            head.push(':');
            pattern.push_str(&glob_escape(&head));
        }
        pattern.push('*');
        pattern
    }

    /// The record key a Redis key of this store names.
    pub(super) fn record_key(&self, redis_key: &[u8]) -> Option<RecordKey> {
        let tag = redis_key
            .strip_prefix(self.prefix.as_bytes())?
            .strip_prefix(b":{")?
            .strip_suffix(b"}")?;
        decode_tag(tag)
    }

    /// Deletes at most `budget` records of the scope whose keys match `pattern`, in one whole
    /// `SCAN` pass over the server `conn` talks to (`erase.lua`), waking their waiters; returns how
    /// many. Less than `budget` means the pass found no more.
    pub(super) async fn erase<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        pattern: &str,
        budget: u64,
    ) -> Result<u64, StoreError> {
        let (mut cursor, mut erased) = (0, 0u64);
        while erased < budget {
            let (next, mut keys) = scan(conn, cursor, pattern).await?;
            keys.truncate(usize::try_from(budget - erased).unwrap_or(usize::MAX));
            let deleted: Vec<i64> = self.each(conn, &self.scripts.erase, &keys).await?;
            for (key, _) in keys.iter().zip(&deleted).filter(|(_, &d)| d == 1) {
                erased += 1;
                if let Some(key) = self.record_key(key) {
                    self.waiters.notify(&key);
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        Ok(erased)
    }

    /// Reads the header of every record on the server `conn` talks to (`SCAN`, then `peek.lua` per
    /// key), handing each page's records, decoded without their responses, to `page` with the
    /// server's time read before the pass, which judges them; returns that time. Keys that hold no
    /// record are skipped.
    pub(super) async fn scan_records<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        mut page: impl FnMut(Timestamp, Vec<(RecordKey, Record)>) + Send,
    ) -> Result<Timestamp, StoreError> {
        let now = match self.clock.as_ref() {
            Some(clock) => clock.now(),
            None => {
                let (secs, micros): (i64, i64) = ::redis::cmd("TIME")
                    .query_async(conn)
                    .await
                    .map_err(redis_error)?;
                Timestamp::from_millis(secs.saturating_mul(1000).saturating_add(micros / 1000))
            }
        };
        let pattern = self.pattern(None);
        let mut cursor = 0;
        loop {
            let (next, keys) = scan(conn, cursor, &pattern).await?;
            let headers: Vec<Option<Vec<u8>>> = self.each(conn, &self.scripts.peek, &keys).await?;
            let records = keys
                .iter()
                .zip(headers)
                .filter_map(|(key, header)| {
                    let record = blob::summary(header?).ok()?;
                    Some((self.record_key(key)?, record))
                })
                .collect();
            page(now, records);
            if next == 0 {
                return Ok(now);
            }
            cursor = next;
        }
    }
}

/// One `SCAN` step over the keys matching `pattern`: the next cursor (0: the pass is over) and the
/// keys.
pub(super) async fn scan<C: ConnectionLike + Send>(
    conn: &mut C,
    cursor: u64,
    pattern: &str,
) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
    ::redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_COUNT)
        .query_async(conn)
        .await
        .map_err(redis_error)
}

/// A duration as whole milliseconds for the scripts, at most [`MAX_TTL_MS`] (Redis refuses expiry
/// times that overflow its clock, and Lua's numbers are exact only below 2^53).
pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_TTL_MS)
}

/// `claim.lua`'s rules: what the claim did.
pub(super) const KEPT: i64 = 0;
pub(super) const INSERTED: i64 = 1;
pub(super) const TAKEN_OVER: i64 = 2;
pub(super) const RESUMED: i64 = 3;
pub(super) const RESENT: i64 = 4;

/// The scripts' time argument: the clock the store was given, or empty for the server's `TIME`.
#[derive(Clone, Copy)]
pub(super) struct ScriptNow(Option<Timestamp>);

impl ToRedisArgs for ScriptNow {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        match self.0 {
            Some(now) => now.as_millis().write_redis_args(out),
            None => "".write_redis_args(out),
        }
    }
}

/// A write `WAIT` did not confirm fails as unavailable: the caller must not count on it.
pub(super) fn confirmed(durable: bool) -> Result<(), StoreError> {
    if durable {
        Ok(())
    } else {
        Err(StoreError::unavailable(
            "the write was not confirmed by the replicas asked for in time (WAIT)",
        ))
    }
}
