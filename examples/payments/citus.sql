-- The example's tables in their Citus form, on the coordinator, in place
-- of the DDL in examples/payments/schema.py (which then finds them there
-- and leaves them alone), after `idempotency-asgi migrate --distribute`
-- has made and distributed the key tables. Every primary and foreign key
-- holds the distribution column, tenant_id.
CREATE TABLE payments (
    id              text        NOT NULL,
    tenant_id       text        NOT NULL,
    amount          bigint      NOT NULL CHECK (amount > 0),
    currency        text        NOT NULL,
    customer_id     text        NOT NULL,
    status          text        NOT NULL,
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, id)                             -- was: id PRIMARY KEY
);
CREATE INDEX payments_tenant_created_idx
    ON payments (tenant_id, created_at DESC, id DESC);

CREATE TABLE outbox (
    id              bigserial,
    tenant_id       text        NOT NULL,
    payment_id      text        NOT NULL,
    event_type      text        NOT NULL,
    idempotency_key text        NOT NULL,
    payload         bytea       NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz,
    PRIMARY KEY (tenant_id, id),                            -- was: id PRIMARY KEY
    FOREIGN KEY (tenant_id, payment_id)
        REFERENCES payments (tenant_id, id)                 -- was: payments (id)
);
CREATE INDEX outbox_pending_idx ON outbox (next_attempt_at) WHERE state = 'pending';

-- One co-location group with the key tables: a tenant's payments, outbox
-- events and keys are on one shard, so a request's transaction is one
-- worker's.
SELECT create_distributed_table('payments', 'tenant_id',
                                colocate_with => 'idempotency_keys');
SELECT create_distributed_table('outbox', 'tenant_id',
                                colocate_with => 'idempotency_keys');
