-- additive
-- What a request's pin (a cache_control breakpoint, docs/ingress.md) wrote to the cache and
-- keeps there, at what prices, and what that cost (total_pico_cny includes it). Free (0)
-- unless the price file says otherwise; 0 for a request without a pin and for rows older
-- code writes.

ALTER TABLE usage_ledger ADD COLUMN num_cache_write_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN pin_ttl_s BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN cache_write_price_micro_cny_per_m BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN storage_price_micro_cny_per_m_hour BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN write_pico_cny BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_ledger ADD COLUMN storage_pico_cny BIGINT NOT NULL DEFAULT 0;
