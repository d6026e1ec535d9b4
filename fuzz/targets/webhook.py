"""The admission webhook's POST /mutate (meshd/webhook.py WebhookServer._mutate): the
request body as the API server sends it, through the handler itself (a stand-in for
aiohttp's request, so no TLS server runs), with and without namespace opt-in.

Documented outcomes: 200 with an AdmissionReview response carrying the request's uid, or
400 with the reason (not JSON, a malformed review). Any exception out of the handler is a
finding (aiohttp would answer 500 and the API server apply failurePolicy), and so is an
"internal error" warning: review() catches an injector bug so that pod creation is not
blocked, but the bug is still one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fuzz.common import Finding, signature

INCLUDE = ["meshd"]
INJECTOR = "an injector error on a malformed pod object, caught by review()"
# Found by this target, reported, not fixed yet (corpus: known-*).
KNOWN: dict[str, str] = {}  # findings fixed: their reproducers are fixed-* seeds now


class _Request:
    """What _mutate reads of an aiohttp request: the body as JSON and the query."""

    def __init__(self, body: bytes, opt_in: bool) -> None:
        self._body = body
        self.query = {"namespace-opt-in": "true"} if opt_in else {}

    async def json(self, *, loads: Callable[[str], Any] = json.loads) -> Any:
        return loads(self._body.decode("utf-8"))  # as aiohttp's Request.json()


def setup() -> Callable[[bytes], None]:
    import logging

    from meshd.inject_config import InjectionConfig
    from meshd.webhook import WebhookServer

    class _Keep(logging.Handler):
        """Keeps the exception review() logs when it catches an injector bug."""

        exc: BaseException | None = None

        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                self.exc = record.exc_info[1]

    kept = _Keep(logging.ERROR)
    log = logging.getLogger("meshd.webhook")
    log.propagate = False  # one info line per review otherwise
    log.handlers[:] = [kept]
    server = WebhookServer.__new__(WebhookServer)  # no certificates: the handler only
    server.cfg = InjectionConfig()

    def call(data: bytes, opt_in: bool) -> Any:
        coro = server._mutate(_Request(data, opt_in))  # type: ignore[arg-type]
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value
        raise AssertionError("the handler awaited something real")

    def one_input(data: bytes) -> None:
        kept.exc = None
        for opt_in in (False, True):
            response = call(data, opt_in)
            answer = json.loads(response.body)
            if response.status == 400:
                assert isinstance(answer["error"], str), answer
                continue
            assert response.status == 200, (response.status, answer)
            uid = json.loads(data)["request"]["uid"]
            assert answer["response"]["uid"] == uid, answer
            assert answer["response"]["allowed"] is True, answer
            for warning in answer["response"].get("warnings", []):
                if "internal error" in warning and kept.exc is not None:
                    where = signature(kept.exc)
                    if " in meshd/inject" in where:
                        raise Finding(INJECTOR, f"{INJECTOR}: {where}") from kept.exc
                    raise kept.exc  # a bug elsewhere, by its own signature
                assert "internal error" not in warning, warning

    return one_input
