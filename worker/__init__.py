"""The workers' machinery: the engines, what a prefill or decode worker is built of around
them, the SSD store and KV transfer. Built on `shared/`, never importing `services`
(docs/design.md, 'Code layout')."""
