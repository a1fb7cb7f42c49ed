-- The ledger: one row per request (the primary key is the deduplication), the same DDL in
-- SQLite and PostgreSQL. Money is BIGINT pico-CNY (1e-12 CNY): one request's total fits
-- with room to spare (2^63 pico-CNY is 9.2 million CNY; a 1M-token output at CNY 8/M is
-- 8e12). Sums over many rows may not fit: reports split them (see ledger/base.py).
-- Prices are micro-CNY per million tokens, as applied when the request was priced.
-- `price_window` (not `window`: a reserved word in PostgreSQL) is the window's name.

CREATE TABLE usage_ledger (
    request_id TEXT PRIMARY KEY,
    account TEXT NOT NULL,
    api_key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    finish_reason TEXT,
    source TEXT NOT NULL CHECK (source IN ('decode', 'ingress')),
    num_cache_hit_tokens BIGINT NOT NULL CHECK (num_cache_hit_tokens >= 0),
    num_cache_miss_tokens BIGINT NOT NULL CHECK (num_cache_miss_tokens >= 0),
    num_output_tokens BIGINT NOT NULL CHECK (num_output_tokens >= 0),
    price_window TEXT NOT NULL,
    hit_price_micro_cny_per_m BIGINT NOT NULL CHECK (hit_price_micro_cny_per_m >= 0),
    miss_price_micro_cny_per_m BIGINT NOT NULL CHECK (miss_price_micro_cny_per_m >= 0),
    output_price_micro_cny_per_m BIGINT NOT NULL CHECK (output_price_micro_cny_per_m >= 0),
    hit_pico_cny BIGINT NOT NULL CHECK (hit_pico_cny >= 0),
    miss_pico_cny BIGINT NOT NULL CHECK (miss_pico_cny >= 0),
    output_pico_cny BIGINT NOT NULL CHECK (output_pico_cny >= 0),
    total_pico_cny BIGINT NOT NULL
        CHECK (total_pico_cny = hit_pico_cny + miss_pico_cny + output_pico_cny),
    started_ms BIGINT NOT NULL,
    finished_ms BIGINT NOT NULL,
    recorded_ms BIGINT NOT NULL,
    prefill_worker_id TEXT NOT NULL,
    decode_worker_id TEXT NOT NULL
);

-- Reports filter by time and group by account, model or hour.
CREATE INDEX usage_ledger_finished ON usage_ledger (finished_ms);
CREATE INDEX usage_ledger_account ON usage_ledger (account, finished_ms);
