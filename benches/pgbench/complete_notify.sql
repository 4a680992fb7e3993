\set k random(1, 2000000000)
INSERT INTO idem.records (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until) VALUES ('pgb', :client_id || '-' || :k, '\x00', 1, 0, 9000000000000, 9000000000000, 'in_flight', 1) ON CONFLICT DO NOTHING;
WITH c AS (UPDATE idem.records SET state = 'completed', lease_until = NULL, status = 201, headers = '[]', body = '\x00' WHERE scope = 'pgb' AND key = :client_id || '-' || :k AND token = 1 AND state = 'in_flight' RETURNING 1) SELECT pg_notify('idem_bench_pgb', 'x') FROM c;
