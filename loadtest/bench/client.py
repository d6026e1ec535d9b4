"""The benchmark's load client: open-loop by planned arrival time, plus dependency chains.

Independent requests go out at their `at_s`; a chain (agentic task, chat session) runs its
steps in order, each sent `think_s` after the previous one completed, with the text built
by `loadtest.workloads.render` from what was actually sent and answered. Every request
streams (`stream_options.include_usage`) and is measured by `StreamMeter`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.bench.stream import StreamMeter, StreamSummary
from loadtest.workloads import Message, PlannedRequest, render
from meshd.tasks import cancel_and_wait

# Bytes of an error body kept for the report: enough for an OpenAI error message.
_ERROR_BODY_BYTES = 2048
_ERROR_TEXT_CHARS = 200

# The body's model when the engines name none: the runner asks an engine's /v1/models.
DEFAULT_MODEL = "default"

# Failure kinds, as RequestOutcome.error spells them.
HTTP_PREFIX = "http_"
SSE_ERROR = "sse_error"
TRUNCATED = "truncated"
EMPTY = "empty"
TIMEOUT = "timeout"
CONNECT = "connect"
CANCELLED = "cancelled"  # still running when the run's time ran out


# What the client times requests with. Not the loop's clock: under uvloop (the bench's loop)
# loop.time() moves in whole milliseconds, a 1 ms grain on TTFTs of 10-20 ms.
_clock = time.monotonic


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """How the client sends.

    timeout_s: budget of one request, send to last byte. max_concurrency: requests in
    flight at once (a request over the cap waits, and `queued_s` says how long).
    duration_s: no request is sent later than this after the start (None: no cap).
    drain_s: with a cap, how long after it requests still running may take before they
    are cancelled. model: the `model` field of every body.
    """

    timeout_s: float = 120.0
    max_concurrency: int = 256
    duration_s: float | None = None
    drain_s: float = 60.0
    model: str = DEFAULT_MODEL
    ignore_eos: bool = True
    # Send x-meshd-task-id / x-meshd-session-id (False: a client that names no session,
    # so a router must find the conversation from the prompt).
    context_headers: bool = True
    progress: bool = False
    progress_desc: str = ""


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One sent request and what came back. Times are seconds; `*_at_s` from the run start.

    error: None on success, else `http_<status>`, `sse_error`, `truncated` (no [DONE]),
    `empty` (no token), `timeout`, `connect` or `cancelled`. itl_s: gaps between token
    events (for ITL percentiles; not written to the JSON results).
    """

    request_id: str
    workload: str
    tenant: str
    task_key: str
    step: int | None
    planned_at_s: float
    sent_at_s: float
    queued_s: float
    ok: bool
    error: str | None
    status: int
    ttft_s: float | None
    e2e_s: float
    output_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    detail: str = ""
    itl_s: tuple[float, ...] = field(default=(), repr=False)
    # The engine that served it, where the run knows (the virtual clock does, and meshd
    # says in x-meshd-endpoint to a trusted client; "" unknown).
    endpoint: str = ""

    @property
    def end_at_s(self) -> float:
        return self.sent_at_s + self.e2e_s

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "workload": self.workload,
            "tenant": self.tenant,
            "task": self.task_key,
            "step": self.step,
            "planned_at_s": round(self.planned_at_s, 4),
            "sent_at_s": round(self.sent_at_s, 4),
            "queued_s": round(self.queued_s, 4),
            "ok": self.ok,
            "error": self.error,
            "status": self.status,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 5),
            "e2e_s": round(self.e2e_s, 5),
            "tpot_s": None if not self.itl_s else round(sum(self.itl_s) / len(self.itl_s), 6),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class LoadRun:
    """Everything the client saw in one run. `not_sent`: planned requests never sent
    (after the duration cap, or after an earlier step of their chain failed)."""

    outcomes: tuple[RequestOutcome, ...]
    not_sent: tuple[str, ...]
    wall_s: float


def task_key(request: PlannedRequest) -> str:
    """The task a request belongs to: its chain, or itself when it is independent."""
    return request.chain_id if request.chain_id is not None else request.request_id


def plan_starts(
    requests: Sequence[PlannedRequest],
) -> tuple[list[PlannedRequest | list[PlannedRequest]], list[str]]:
    """What starts when, by `at_s`: lone requests, and chains (a task's steps in order,
    each sent when the one before it ends); plus the ids of dependent steps whose first
    step is not in the list (cut by a cap: nothing to extend)."""
    chains: dict[str, list[PlannedRequest]] = defaultdict(list)
    starts: list[PlannedRequest | list[PlannedRequest]] = []
    orphans: list[str] = []
    for r in requests:
        if r.depends_on_previous:
            if r.chain_id is not None and r.chain_id in chains:
                chains[r.chain_id].append(r)
            else:
                orphans.append(r.request_id)
        elif r.chain_id is not None and (r.step or 0) == 0:
            chain = chains[r.chain_id] = [r]
            starts.append(chain)
        else:
            starts.append(r)
    for chain in chains.values():
        chain.sort(key=lambda r: r.step or 0)
    starts.sort(key=lambda s: s[0].at_s if isinstance(s, list) else s.at_s)
    return starts, orphans


def request_headers(
    request: PlannedRequest, deadline_ms: int | None, context: bool = True
) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        "x-request-id": request.request_id,
        "x-meshd-tenant": request.tenant,
        "x-meshd-priority": str(request.priority),
    }
    if context and request.task_id is not None:
        headers["x-meshd-task-id"] = request.task_id
    if context and request.session_id is not None:
        headers["x-meshd-session-id"] = request.session_id
    if deadline_ms is not None:
        headers["x-meshd-deadline-ms"] = str(deadline_ms)
    return headers


def request_body(
    request: PlannedRequest,
    sent: str | tuple[Message, ...],
    model: str,
    ignore_eos: bool = True,
) -> bytes:
    """The JSON body of a streamed completion or chat request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        # vLLM's extension: generate max_tokens, so every policy gets the same work.
        body["ignore_eos"] = True
    if isinstance(sent, str):
        body["prompt"] = sent
    else:
        body["messages"] = [m.to_openai() for m in sent]
    return json.dumps(body, separators=(",", ":")).encode()


class LoadClient:
    """Sends one workload to one base URL. Use `run(requests)` once per instance."""

    def __init__(
        self,
        base_url: str,
        settings: ClientSettings,
        *,
        on_done: Callable[[RequestOutcome], None] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.settings = settings
        self._on_done = on_done
        self._outcomes: list[RequestOutcome] = []
        self._not_sent: list[str] = []
        self._t0 = 0.0
        self._sem = asyncio.Semaphore(settings.max_concurrency)
        self._session: aiohttp.ClientSession | None = None
        self._progress: Any = None

    def _now(self) -> float:
        return _clock() - self._t0

    def _may_send(self, at_s: float) -> bool:
        cap = self.settings.duration_s
        return cap is None or at_s <= cap

    async def run(self, requests: Sequence[PlannedRequest]) -> LoadRun:
        starts, orphans = plan_starts(requests)
        self._not_sent.extend(orphans)
        self._progress = progress_bar(len(requests) - len(orphans), self.settings)
        connector = aiohttp.TCPConnector(
            limit=self.settings.max_concurrency, limit_per_host=0, enable_cleanup_closed=False
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._t0 = _clock()
        tasks: set[asyncio.Task[None]] = set()
        try:
            for item in starts:
                at_s = item[0].at_s if isinstance(item, list) else item.at_s
                if not self._may_send(at_s):
                    for r in item if isinstance(item, list) else [item]:
                        self._not_sent.append(r.request_id)
                    continue
                delay = at_s - self._now()
                if delay > 0:
                    await asyncio.sleep(delay)
                coro = self._chain(item) if isinstance(item, list) else self._single(item)
                task = asyncio.create_task(coro)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(set(tasks), timeout=self._drain_budget())
            wall = self._now()
        finally:
            # Past the drain budget, or the run itself was cancelled: what still runs is
            # cancelled and records itself as such.
            await cancel_and_wait(tasks)
            await self._session.close()
            if self._progress is not None:
                self._progress.close()
        return LoadRun(tuple(self._outcomes), tuple(self._not_sent), wall)

    def _drain_budget(self) -> float | None:
        s = self.settings
        if s.duration_s is None:
            # No cap: every request is bounded by its timeout and every chain is finite.
            return None
        return max(0.0, s.duration_s + s.drain_s - self._now())

    def _record(self, outcome: RequestOutcome) -> None:
        self._outcomes.append(outcome)
        if self._progress is not None:
            self._progress.update(1)
        if self._on_done is not None:
            self._on_done(outcome)

    def _skip(self, requests: Sequence[PlannedRequest]) -> None:
        for r in requests:
            self._not_sent.append(r.request_id)
            if self._progress is not None:
                self._progress.update(1)

    async def _single(self, request: PlannedRequest) -> None:
        outcome, _ = await self._send(request, render(request), request.deadline_ms, False)
        self._record(outcome)

    async def _chain(self, chain: list[PlannedRequest]) -> None:
        # Steps accounted for: recorded, or recording themselves if cancelled mid-send.
        position = [0]
        try:
            await self._steps(chain, position)
        finally:
            self._skip(chain[position[0] :])

    async def _steps(self, chain: list[PlannedRequest], position: list[int]) -> None:
        """Send the chain's steps in order, stopping at the first failure."""
        previous_sent: str | tuple[Message, ...] | None = None
        previous_answer = ""
        task_started: float | None = None
        for i, r in enumerate(chain):
            if i > 0:
                await asyncio.sleep(r.think_s)
                if not self._may_send(self._now()):
                    return
            sent = render(r, previous_sent, previous_answer) if i > 0 else render(r)
            now = self._now()
            if task_started is None:
                task_started = now
            deadline = r.deadline_ms
            if r.task_deadline_ms is not None:
                # The task's budget counts from step 0's send; a step past it still goes
                # out with the smallest budget, so a deadline-aware router can shed it.
                left = max(1, round(r.task_deadline_ms - (now - task_started) * 1000))
                deadline = left if deadline is None else min(deadline, left)
            keep_text = i + 1 < len(chain)
            position[0] = i + 1
            outcome, summary = await self._send(r, sent, deadline, keep_text)
            self._record(outcome)
            if not outcome.ok:
                return  # an agent whose step failed does not go on
            previous_sent = sent
            previous_answer = summary.text

    async def _send(
        self,
        request: PlannedRequest,
        sent: str | tuple[Message, ...],
        deadline_ms: int | None,
        keep_text: bool,
    ) -> tuple[RequestOutcome, StreamSummary]:
        assert self._session is not None
        s = self.settings
        path = "/v1/completions" if request.kind == "completion" else "/v1/chat/completions"
        body = request_body(request, sent, s.model, s.ignore_eos)
        headers = request_headers(request, deadline_ms, s.context_headers)
        queued_at = _clock()
        status = 0
        meter = StreamMeter(keep_text=keep_text)
        error: str | None = None
        detail = ""
        endpoint = ""
        async with self._sem:
            started = _clock()
            try:
                async with asyncio.timeout(s.timeout_s):
                    async with self._session.post(
                        self.base_url + path, data=body, headers=headers
                    ) as resp:
                        status = resp.status
                        # meshd names the engine that served a trusted client.
                        endpoint = resp.headers.get("x-meshd-endpoint", "")
                        if status != 200:
                            raw = await resp.content.read(_ERROR_BODY_BYTES)
                            error = f"{HTTP_PREFIX}{status}"
                            detail = _error_detail(raw)
                        else:
                            async for chunk in resp.content.iter_any():
                                meter.feed(chunk, _clock())
            except TimeoutError:
                error, detail = TIMEOUT, f"no complete answer within {s.timeout_s:g} s"
            except asyncio.CancelledError:
                error, detail = CANCELLED, "still running when the run's time ran out"
                self._record(
                    self._outcome(
                        request,
                        queued_at,
                        started,
                        _clock(),
                        status,
                        meter,
                        error,
                        detail,
                        endpoint,
                    )[0]
                )
                raise
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                error, detail = CONNECT, _describe(exc)
            except (aiohttp.ClientError, ConnectionError) as exc:
                error = TRUNCATED if status else CONNECT
                detail = _describe(exc)
            ended = _clock()
        return self._outcome(
            request, queued_at, started, ended, status, meter, error, detail, endpoint
        )

    def _outcome(
        self,
        request: PlannedRequest,
        queued_at: float,
        started: float,
        ended: float,
        status: int,
        meter: StreamMeter,
        error: str | None,
        detail: str,
        endpoint: str = "",
    ) -> tuple[RequestOutcome, StreamSummary]:
        summary = meter.summary()
        if error is None:
            if summary.error is not None:
                error, detail = SSE_ERROR, summary.error[:_ERROR_TEXT_CHARS]
            elif not summary.done:
                error, detail = TRUNCATED, "the stream ended without data: [DONE]"
            elif summary.token_events == 0 and not summary.usage_completion_tokens:
                error, detail = EMPTY, "the stream carried no token"
        first = summary.first_token_at
        outcome = RequestOutcome(
            request_id=request.request_id,
            workload=request.workload,
            tenant=request.tenant,
            task_key=task_key(request),
            step=request.step,
            planned_at_s=request.at_s,
            sent_at_s=started - self._t0,
            queued_s=started - queued_at,
            ok=error is None,
            error=error,
            status=status,
            ttft_s=None if first is None else first - started,
            e2e_s=ended - started,
            output_tokens=summary.output_tokens,
            prompt_tokens=summary.usage_prompt_tokens,
            cached_tokens=summary.usage_cached_tokens,
            detail=detail,
            itl_s=summary.gaps,
            endpoint=endpoint,
        )
        return outcome, summary


def _error_detail(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:_ERROR_TEXT_CHARS]
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_ERROR_TEXT_CHARS]
        if obj.get("message"):
            return str(obj["message"])[:_ERROR_TEXT_CHARS]
    return raw.decode(errors="replace")[:_ERROR_TEXT_CHARS]


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:_ERROR_TEXT_CHARS]


def progress_bar(total: int, settings: ClientSettings, desc: str = "requests") -> Any:
    """A tqdm bar over `total` requests (None: progress off, or no tqdm); `desc` unless
    settings.progress_desc says otherwise."""
    if not settings.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=total,
        desc=settings.progress_desc or desc,
        unit="req",
        file=sys.stderr,
        mininterval=0.5,
        dynamic_ncols=True,
        leave=False,
        disable=None,  # tqdm's "only on a terminal": a log file gets no \r frames
    )


async def run_load(
    base_url: str,
    requests: Sequence[PlannedRequest],
    settings: ClientSettings | None = None,
    *,
    on_done: Callable[[RequestOutcome], None] | None = None,
) -> LoadRun:
    """Send `requests` to `base_url` (an OpenAI-compatible server) and measure each."""
    return await LoadClient(base_url, settings or ClientSettings(), on_done=on_done).run(requests)
