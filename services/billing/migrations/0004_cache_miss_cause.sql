-- additive
-- Why each request's prompt missed the cache past its hit (services/ingress/diagnosis.py):
-- none, never_seen, system_changed, ...; '' for a request sent with no diagnosis (a client
-- of the router's API rather than ingress). Older code leaves it at its default.

ALTER TABLE usage_ledger ADD COLUMN cache_miss_cause TEXT NOT NULL DEFAULT '';
