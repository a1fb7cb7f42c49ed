-- additive
-- Which applied migrations leave the database writable by older code (schema.py: rolling
-- upgrades). Older code never reads this column.

ALTER TABLE schema_version ADD COLUMN additive INTEGER NOT NULL DEFAULT 0;
