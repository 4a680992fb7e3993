-- The payments ledger and the simulated card network's charges on MySQL 8 / MariaDB 10.11, in the
-- connection's database beside idem's `idem_…` tables. Owners are caller ids of any length: indexed
-- by a prefix, which serves the equality lookups by owner.
CREATE TABLE IF NOT EXISTS payments (
    seq       BIGINT       NOT NULL AUTO_INCREMENT,
    id        VARCHAR(64)  NOT NULL,
    owner     LONGTEXT     NOT NULL,
    amount    BIGINT       NOT NULL,
    currency  VARCHAR(255) NOT NULL,
    status    VARCHAR(16)  NOT NULL,
    charge_id VARCHAR(64)  NULL,
    PRIMARY KEY (seq),
    UNIQUE KEY payments_id (id),
    UNIQUE KEY payments_charge_id (charge_id),
    KEY payments_owner (owner(255), seq)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS card_charges (
    seq             BIGINT       NOT NULL AUTO_INCREMENT,
    idempotency_key VARCHAR(255) NOT NULL,
    id              VARCHAR(64)  NOT NULL,
    owner           LONGTEXT     NOT NULL,
    amount          BIGINT       NOT NULL,
    currency        VARCHAR(255) NOT NULL,
    attempts        BIGINT       NOT NULL,
    refunded        BOOLEAN      NOT NULL DEFAULT FALSE,
    PRIMARY KEY (seq),
    UNIQUE KEY card_charges_key (idempotency_key),
    UNIQUE KEY card_charges_id (id),
    KEY card_charges_owner (owner(255), seq)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
