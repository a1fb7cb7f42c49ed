"""The prefill job belongs to the router until `PrefillDone` (docs/request-flow.md).

Once the decode worker accepted a request, one background task per request sends the
`PrefillJob` to the chosen prefill worker and awaits `PrefillDone`, racing the reply against
the worker's heartbeats. A worker that answers no-responders or whose heartbeats stop gets the
job sent once to another prefill worker (`attempt` + 1, same decode worker, which keeps
waiting). When that fails too, or the error is not one a retry can fix, the router broadcasts
`CancelRequest` with the error code, and the decode worker ends the caller's stream with it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

import msgspec
from opentelemetry.trace import StatusCode

from services.router.metrics import RouterMetrics
from services.router.policy import Rejection, RequestFacts, RoutePolicy
from shared import telemetry
from shared.bus import Bus
from shared.load_table import InflightDelta, LoadTable
from shared.logging import get_logger
from shared.schema import Cancelled, NoResponders, ServiceError, Unavailable
from shared.schema.inference import CancelRequest, PrefillDone, PrefillJob
from shared.tasks import cancel_and_wait
from shared.telemetry import REQUEST_ID

log = get_logger(__name__)

# How often a job's worker is looked up in the load table: its heartbeats come every second
# and stop counting after `heartbeat_timeout_s` (3 s), so a quarter second adds little delay.
LIVENESS_POLL_S = 0.25

Record = Callable[[Sequence[InflightDelta]], Awaitable[None]]


class PrefillWorkerGone(Unavailable):
    """The job's prefill worker stopped heartbeating, or restarted, while it held the job."""


class PrefillWorkerRestarted(PrefillWorkerGone):
    """A new process heartbeats under the worker's id: it may take the job sent again."""


class PrefillJobs:
    """The background tasks that see prefill jobs through, one per routed request."""

    def __init__(
        self,
        bus: Bus,
        table: LoadTable,
        policy: RoutePolicy,
        counts: RouterMetrics,
        record: Record,
        *,
        prefill_timeout_s: float,
        liveness_poll_s: float = LIVENESS_POLL_S,
    ) -> None:
        self.bus = bus
        self.table = table
        self.policy = policy
        self.counts = counts
        self.record = record  # counts (and announces) work sent to a worker
        self.prefill_timeout_s = prefill_timeout_s
        self.liveness_poll_s = liveness_poll_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._by_request: dict[str, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, job: PrefillJob, facts: RequestFacts, swa_node_ids: Collection[str]) -> None:
        request_id = job.request.request_id
        task = asyncio.create_task(self._drive(job, facts, frozenset(swa_node_ids)))
        self._tasks.add(task)
        self._by_request[request_id] = task

        def forget(done: asyncio.Task[None]) -> None:
            self._tasks.discard(done)
            if self._by_request.get(request_id) is done:
                del self._by_request[request_id]

        task.add_done_callback(forget)

    def cancel(self, request_id: str) -> bool:
        """Stop seeing a request's prefill through (its caller cancelled it)."""
        task = self._by_request.pop(request_id, None)
        if task is None:
            return False
        task.cancel()
        return True

    async def stop(self) -> None:
        """Cancel every job still awaited (their retry window closes with the router)."""
        tasks = list(self._tasks)
        if tasks:
            log.warning("prefill jobs abandoned at shutdown", num_jobs=len(tasks))
        await cancel_and_wait(*tasks)

    async def _drive(
        self, job: PrefillJob, facts: RequestFacts, swa_node_ids: frozenset[str]
    ) -> None:
        request_id = job.request.request_id
        with telemetry.span("router prefill job") as span:
            try:
                while True:
                    worker_id = job.decision.prefill_worker_id
                    if span.is_recording():
                        span.set_attributes(
                            {
                                REQUEST_ID: request_id,
                                "kvfabric.attempt": job.attempt,
                                "kvfabric.prefill_worker_id": worker_id,
                            }
                        )
                    try:
                        await self._attempt(job)
                        return
                    except Cancelled as exc:
                        log.info("prefill job cancelled", request_id=request_id, error=exc.message)
                        return
                    except (NoResponders, PrefillWorkerGone) as exc:
                        log.warning(
                            "prefill worker gone",
                            request_id=request_id,
                            prefill_worker_id=worker_id,
                            attempt=job.attempt,
                            error=exc.message,
                        )
                        restarted = isinstance(exc, PrefillWorkerRestarted)
                        if not restarted:
                            self.table.remove(worker_id)
                        retried = await self._retried(job, facts, swa_node_ids, restarted)
                    except ServiceError as exc:
                        retried = exc
                    if isinstance(retried, ServiceError):
                        await self._fail(job, retried)
                        return
                    job = retried
            except Exception:
                log.exception("prefill job crashed", request_id=request_id)

    async def _attempt(self, job: PrefillJob) -> None:
        """Send `job`; return at `PrefillDone`, raise the worker's error or `PrefillWorkerGone`."""
        worker_id = job.decision.prefill_worker_id
        subjects = self.bus.subjects
        deadline_ms = job.request.deadline_ms
        reply = asyncio.create_task(
            self.bus.request(
                subjects.instance(subjects.prefill_run, worker_id),
                job,
                PrefillDone,
                # With a deadline the bus waits until it, however long that is.
                timeout_s=self.prefill_timeout_s if deadline_ms is None else math.inf,
                request_id=job.request.request_id,
                deadline_ms=deadline_ms,
            )
        )
        gone = asyncio.create_task(self._until_gone(worker_id))
        try:
            await asyncio.wait({reply, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reply, gone):
                task.cancel()
            await asyncio.gather(reply, gone, return_exceptions=True)
        if reply.done() and not reply.cancelled():
            reply.result()  # PrefillDone, or the typed error the worker (or the bus) raised
            return
        if self.table.incarnation(worker_id, time.monotonic()) is not None:
            raise PrefillWorkerRestarted(f"prefill worker {worker_id} restarted")
        raise PrefillWorkerGone(f"prefill worker {worker_id} stopped heartbeating")

    async def _until_gone(self, worker_id: str) -> None:
        # A draining worker still finishes what it holds: only a missing heartbeat counts, or
        # a new process beating under its id (restarted within the heartbeat timeout, as a
        # supervisor does: the job died with the old one, and nothing would answer it).
        process = self.table.incarnation(worker_id, time.monotonic())
        while (
            process is not None and self.table.incarnation(worker_id, time.monotonic()) is process
        ):
            await asyncio.sleep(self.liveness_poll_s)

    async def _retried(
        self,
        job: PrefillJob,
        facts: RequestFacts,
        swa_node_ids: frozenset[str],
        restarted: bool = False,
    ) -> PrefillJob | ServiceError:
        """The job for another prefill worker (or the restarted one), or why there is none."""
        target = self.policy.retry_target(
            job.decision,
            facts,
            self.table,
            swa_node_ids,
            time.monotonic(),
            job.attempt,
            restarted=restarted,
        )
        if isinstance(target, Rejection):
            return target.to_error()
        if target.decode_worker_id != job.decision.decode_worker_id:
            # A new decode worker would need a new DecodeJob and the caller's stream moved.
            return Unavailable(
                f"prefill worker {job.decision.prefill_worker_id} and decode worker "
                f"{job.decision.decode_worker_id} are both gone"
            )
        prefill_delta, _ = self.policy.inflight_deltas(self.table.router_id, target, facts)
        await self.record((prefill_delta,))
        self.counts.prefill_retries.inc()
        log.info(
            "prefill job sent again",
            request_id=job.request.request_id,
            prefill_worker_id=target.prefill_worker_id,
            attempt=job.attempt + 1,
        )
        return msgspec.structs.replace(job, decision=target, attempt=job.attempt + 1)

    async def _fail(self, job: PrefillJob, error: ServiceError) -> None:
        request_id = job.request.request_id
        self.counts.prefill_failures.inc()
        span = telemetry.current_span()
        if span.is_recording():
            span.set_status(StatusCode.ERROR, f"{error.code.value}: {error.message}")
        log.error(
            "prefill failed: cancelling the request",
            request_id=request_id,
            prefill_worker_id=job.decision.prefill_worker_id,
            attempt=job.attempt,
            code=error.code.value,
            error=error.message,
        )
        # Our own broadcast comes back to us: by then this task must not be found by it.
        if self._by_request.get(request_id) is asyncio.current_task():
            del self._by_request[request_id]
        await self.bus.publish(
            self.bus.subjects.cancel,
            CancelRequest(
                request_id=request_id,
                reason="prefill failed",
                error_code=error.code.value,
                error_message=error.message,
            ),
        )
