"""What each agent session has used of the cluster, and the queue level that puts a request
in (docs/services.md, 'queue policy'). Pure and synchronous.

A session's work is the prefill work the router sent for it: each job's compute, replay and
the read of its hit in compute-token equivalents (`RoutePolicy.work_tokens`, the unit of a
prefill queue). A
request's level is that of its session's work with the request's own added, so one huge cold
prompt is ranked by its size on its first turn already, and a session moves down a level each
time its work grows fourfold: a multilevel feedback queue over sessions, as FastServe and
Tiresias keep one over jobs. A worker with `--queue-policy fair` serves lower levels first
(worker/serving/fair_queue.py); the router's admission counts only the work queued at or
below a request's level (`RoutePolicy`), so under overload the heaviest sessions are refused
first.

Keys are `GenerateRequest.session`: a digest of the account and the client's session id
(`shared.client.session_digest`), never the id itself. A request without one is a session of
one request (its own size decides its level) and is not remembered. The ledger is bounded:
`max_sessions` entries, least recently routed out first (a forgotten session starts again at
level 0, like a new one). Each router replica keeps its own; a session spread over N replicas
looks up to N times lighter: one level at most with four replicas or fewer.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

from worker.serving.fair_queue import NUM_QUEUE_LEVELS

# Level boundaries in compute-token equivalents, fourfold apart. A short agent session (a
# few turns of a few thousand tokens) stays under the first; a 77K-token conversation's cold
# first turn starts at level 2; ~500K tokens of work in one session reach the last level.
LEVEL_TOKENS = (8_192, 32_768, 131_072, 524_288)
assert len(LEVEL_TOKENS) + 1 == NUM_QUEUE_LEVELS  # the levels workers report and accept
MAX_SESSIONS = 65_536  # ~100 bytes each: under 7 MB however many sessions come and go


def queue_level(num_tokens: int) -> int:
    """The level of `num_tokens` of work: 0 below the first boundary, one more per boundary."""
    return bisect.bisect_right(LEVEL_TOKENS, num_tokens)


class SessionLedger:
    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._tokens: OrderedDict[str, int] = OrderedDict()  # session -> work, oldest first

    def __len__(self) -> int:
        return len(self._tokens)

    def num_tokens(self, session: str) -> int:
        """The work routed for `session` so far (0: new, forgotten, or no session)."""
        return self._tokens.get(session, 0) if session else 0

    def level(self, session: str, num_job_tokens: int) -> int:
        """The queue level of a job of `num_job_tokens` for `session`."""
        return queue_level(self.num_tokens(session) + num_job_tokens)

    def charge(self, session: str, num_job_tokens: int) -> None:
        """Count a job routed for `session`; the least recently routed session goes when the
        ledger is full."""
        if not session:
            return
        self._tokens[session] = self._tokens.pop(session, 0) + num_job_tokens
        if len(self._tokens) > self.max_sessions:
            self._tokens.popitem(last=False)
