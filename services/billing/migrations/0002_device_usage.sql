-- Device time from the workers' heartbeats (services/billing/uptime.py): per worker and UTC
-- hour, the first and the last heartbeat billing saw and the devices the worker holds. The
-- device time of a row is (last_ms - first_ms) x num_devices; replicas merge spans with
-- min / max, so the order they write in does not matter.

CREATE TABLE device_usage (
    hour_ms BIGINT NOT NULL,
    instance_id TEXT NOT NULL,
    service TEXT NOT NULL,
    model TEXT NOT NULL,
    num_devices INTEGER NOT NULL CHECK (num_devices > 0),
    first_ms BIGINT NOT NULL,
    last_ms BIGINT NOT NULL CHECK (last_ms >= first_ms),
    PRIMARY KEY (hour_ms, instance_id)
);
