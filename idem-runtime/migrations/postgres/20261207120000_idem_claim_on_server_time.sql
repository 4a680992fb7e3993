-- The store contract's "Time is the store's" and released records (see src/store/postgres.rs).
--
-- A released claim is now kept as `state = 'released'` (its times kept, no lease, no response), so
-- that the same request's retry resumes it as the same record. Every existing row satisfied the
-- stricter check it replaces, so the new one is added NOT VALID: no scan of the table under the
-- ALTER's exclusive lock, and every row written from now on is checked.
ALTER TABLE idem.records DROP CONSTRAINT records_state_check;
ALTER TABLE idem.records ADD CONSTRAINT records_state_check
    CHECK (state IN ('in_flight', 'completed', 'released')) NOT VALID;

-- The write half of the claim, as `Claim::decide` rules, at the store's time `p_now` (milliseconds
-- since the Unix epoch: the server's `clock_timestamp()` unless the store was given a clock). The
-- claim statement calls it only when its own read did not find a record to keep (a replay writes
-- nothing). Durations come in milliseconds; `p_retain` is already at least `p_ttl`.
--
-- Returns one row: `rule` ('insert', 'take_over', 'resume' or 'keep') and the record as it stands
-- afterwards. The record's latest version is locked before it is judged, so the decision and the
-- write are one atomic step whatever commits meanwhile (a VOLATILE PL/pgSQL function takes a new
-- snapshot per statement under READ COMMITTED). Returns nothing only if a record that blocked the
-- insert was deleted before it could be locked; the claim then runs again.
--
-- Lock waits (a row held by a stalled transaction) end after `p_lock_timeout_ms` with SQLSTATE
-- 55P03, a retryable error; the setting is local to the transaction, which for an autocommit
-- claim is the claim statement itself.
CREATE FUNCTION idem.claim(
    p_scope TEXT, p_key TEXT, p_fingerprint BYTEA, p_token BIGINT, p_lease BIGINT, p_ttl BIGINT,
    p_retain BIGINT, p_now BIGINT, p_lock_timeout_ms BIGINT
)
RETURNS TABLE (
    rule TEXT, store_now BIGINT, fingerprint BYTEA, token BIGINT, created_at BIGINT,
    expires_at BIGINT, retain_until BIGINT, state TEXT, lease_until BIGINT, status INTEGER,
    headers TEXT, body BYTEA
)
LANGUAGE plpgsql VOLATILE ROWS 1
AS $$
#variable_conflict use_column
DECLARE
    old idem.records%ROWTYPE;
    decided TEXT;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_timeout_ms::text || 'ms', true);
    -- A new key: the fresh record.
    RETURN QUERY
    INSERT INTO idem.records AS r
        (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
    VALUES (p_scope, p_key, p_fingerprint, p_token, p_now, p_now + p_ttl, p_now + p_retain,
            'in_flight', p_now + p_lease)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 'insert'::text, p_now, r.fingerprint, r.token, r.created_at, r.expires_at,
              r.retain_until, r.state, r.lease_until, r.status, r.headers, r.body;
    IF FOUND THEN
        RETURN;
    END IF;
    -- The key has a record, perhaps committed after the caller's snapshot: its latest version,
    -- locked until the claim ends.
    SELECT * INTO old FROM idem.records AS r
    WHERE r.scope = p_scope AND r.key = p_key
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    decided := CASE
        WHEN old.retain_until <= p_now THEN 'insert'
        WHEN old.state = 'released' AND old.fingerprint = p_fingerprint
             AND p_now < old.expires_at THEN 'resume'
        WHEN old.state = 'released' THEN 'insert'
        WHEN old.state = 'in_flight' AND old.fingerprint = p_fingerprint
             AND p_now < old.expires_at AND old.lease_until <= p_now THEN 'take_over'
        ELSE 'keep'
    END;
    IF decided = 'keep' THEN
        RETURN QUERY
        SELECT 'keep'::text, p_now, old.fingerprint, old.token, old.created_at, old.expires_at,
               old.retain_until, old.state, old.lease_until, old.status, old.headers, old.body;
        RETURN;
    END IF;
    -- Insert replaces the record (a new one under the key); take over and resume keep its times.
    RETURN QUERY
    UPDATE idem.records AS r
    SET token = p_token,
        state = 'in_flight',
        lease_until = p_now + p_lease,
        status = NULL,
        headers = NULL,
        body = NULL,
        fingerprint = CASE WHEN decided = 'insert' THEN p_fingerprint ELSE r.fingerprint END,
        created_at = CASE WHEN decided = 'insert' THEN p_now ELSE r.created_at END,
        expires_at = CASE WHEN decided = 'insert' THEN p_now + p_ttl ELSE r.expires_at END,
        retain_until = CASE WHEN decided = 'insert' THEN p_now + p_retain ELSE r.retain_until END
    WHERE r.scope = p_scope AND r.key = p_key
    RETURNING decided, p_now, r.fingerprint, r.token, r.created_at, r.expires_at, r.retain_until,
              r.state, r.lease_until, r.status, r.headers, r.body;
END
$$;
