-- The insert half of the claim (see `CLAIM` in src/store/postgres.rs), kept out of the claim
-- statement's own plan: PostgreSQL sets up an INSERT's executor state (the result relation, its
-- indexes, the ON CONFLICT arbiter, RETURNING) on every execution of a plan that holds one, even when
-- it inserts nothing; under pgbench that held replays at ~72% of a bare primary-key read. The claim
-- statement reads the record first and calls this only when it found none.
--
-- Inserts the fresh in-flight record and returns it with `inserted = true`; if an identical claim
-- inserted it first (it committed after the claim statement's snapshot, or was in flight and the
-- INSERT waited for it), returns that record with `inserted = false`, read under a new snapshot (a
-- VOLATILE PL/pgSQL function takes one per statement under READ COMMITTED). Returns nothing only if
-- that record was also deleted meanwhile (released or purged); the claim then runs again.
-- Keep it PARALLEL UNSAFE (the default): the claim statement relies on a plan without parallel
-- workers, whose Append runs the read before this call.
CREATE FUNCTION idem.insert_claim(
    p_scope TEXT, p_key TEXT, p_fingerprint BYTEA, p_token BIGINT, p_created_at BIGINT,
    p_expires_at BIGINT, p_retain_until BIGINT, p_lease_until BIGINT
)
RETURNS TABLE (
    inserted BOOLEAN, fingerprint BYTEA, token BIGINT, created_at BIGINT, expires_at BIGINT,
    retain_until BIGINT, state TEXT, lease_until BIGINT, status INTEGER, headers TEXT, body BYTEA
)
LANGUAGE plpgsql VOLATILE ROWS 1
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    INSERT INTO idem.records AS r
        (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
    VALUES (p_scope, p_key, p_fingerprint, p_token, p_created_at, p_expires_at, p_retain_until,
            'in_flight', p_lease_until)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING true, r.fingerprint, r.token, r.created_at, r.expires_at, r.retain_until, r.state,
              r.lease_until, r.status, r.headers, r.body;
    IF NOT FOUND THEN
        RETURN QUERY
        SELECT false, r.fingerprint, r.token, r.created_at, r.expires_at, r.retain_until, r.state,
               r.lease_until, r.status, r.headers, r.body
        FROM idem.records AS r
        WHERE r.scope = p_scope AND r.key = p_key;
    END IF;
END
$$;
