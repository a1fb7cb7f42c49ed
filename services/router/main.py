"""router: picks a prefill and a decode worker for each request (cache-, load- and
SLO-aware) and forwards the job. docs/design.md, 'Services' and 'One request, end to end';
docs/request-flow.md.

Serves (pooled in queue group `router`, and on `<subject>.<instance_id>`):
  <root>.router.generate      GenerateRequest -> RouteDecision, once the decode worker accepted
                              the job; errors: NOT_FOUND (a model no worker serves, naming
                              the served ones), BAD_REQUEST (empty prompt, no stream inbox,
                              block hashes that do not match the tokens), OVERLOADED with a
                              retry-after (TTFT objective, full queues, no free decode pages),
                              UNAVAILABLE (no worker serving). Workers are chosen among those
                              serving the request's model (their heartbeats name it).
Asks: kv-index match (every shard; no answer within `match_timeout_s` = routed cold). Which
  nodes hold the hit's boundary snapshot is a lookup in the router's own map (`swa_map.py`),
  not a question: no request to any swa-memcache per generate.
Sends: DecodeJob to <root>.decode.run.<id> (-> JobAccepted), then in the background
  PrefillJob to <root>.prefill.run.<id> (-> PrefillDone), sent once more to another prefill
  worker when the first answers no-responders or its heartbeats stop; on a final failure
  CancelRequest with the error code on <root>.request.cancel. SwaResync on
  <root>.swa-memcache.resync: to every memcache at start (each answers with its full state),
  to one after a gap in its event sequence or a first batch from it that is not full.
Listens: LoadReport heartbeats on <root>.load.> (prefill, decode, swa-memcache; an instance
  silent for `heartbeat_timeout_s` is dropped), InflightNotice on <root>.router.inflight
  (work the other replicas just sent, published for ours), CancelRequest (stops awaiting
  that request's prefill), SwaHeld on <root>.swa-memcache.events.* (what each memcache
  started or stopped holding, seq-numbered per instance; a memcache dropped for silent
  heartbeats is dropped from the map too).
Plus what every service has: registration, `$SRV` discovery, heartbeats, drain on SIGTERM.
"""

from __future__ import annotations

from services.router.config import RouterConfig
from services.router.handler import Router
from shared.runtime import ServiceRuntime, service_main
from shared.subjects import ROUTER


async def setup(runtime: ServiceRuntime) -> None:
    config = runtime.config
    assert isinstance(config, RouterConfig)  # service_main built it from RouterConfig
    router = Router(runtime.bus, config, metrics=runtime.metrics)
    # One heartbeat period: every worker has reported once before the first request.
    await router.start(warmup_s=config.heartbeat_s)
    runtime.every(config.heartbeat_timeout_s / 2, router.prune)
    runtime.on_stop(router.stop)
    runtime.load_fields = router.load_fields


def main(argv: list[str] | None = None) -> int:
    return service_main(ROUTER, RouterConfig, setup, argv, description=__doc__ or "")
