"""Many simulated engines in one process and one event loop, on distinct ports.

    async with EngineFleet([EngineSpec(gpu="H100"), EngineSpec(gpu="A100")]) as fleet:
        fleet.urls          # ["http://127.0.0.1:41233", "http://127.0.0.1:40117"]
        fleet[0].inject(parse_fault({"kind": "slowdown", "factor": 4}))

Engines share one tokenizer when their specs name the same one (its memo is the only
sizeable state), and nothing else: each has its own scheduler, KV cache and driver task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from types import TracebackType

from loadtest.engine.config import EngineSpec
from loadtest.engine.faults import FaultSpec
from loadtest.engine.server import SimEngine
from loadtest.engine.tokenizer import Tokenizer, load_tokenizer


class EngineFleet:
    def __init__(self, specs: Sequence[EngineSpec], *, host: str = "127.0.0.1") -> None:
        if not specs:
            raise ValueError("a fleet needs at least one engine")
        tokenizers: dict[str | None, Tokenizer] = {}
        self.engines: list[SimEngine] = []
        for i, spec in enumerate(specs):
            tok = tokenizers.get(spec.tokenizer)
            if tok is None:
                tok = tokenizers[spec.tokenizer] = load_tokenizer(spec.tokenizer)
            self.engines.append(SimEngine(spec, index=i, host=host, tokenizer=tok))
        self.host = host
        self._started = False

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> SimEngine:
        return self.engines[i]

    def __iter__(self) -> Iterator[SimEngine]:
        return iter(self.engines)

    def inject(self, index: int, fault: FaultSpec) -> None:
        self.engines[index].schedule(fault)

    async def start(self) -> None:
        try:
            for e in self.engines:
                await e.start()
        except BaseException:
            await self.stop()
            raise
        self._started = True

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.engines), return_exceptions=True)
        self._started = False

    async def __aenter__(self) -> EngineFleet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
