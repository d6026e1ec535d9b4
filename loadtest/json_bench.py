"""Benchmark of the request-body JSON decode, stdlib json vs orjson vs msgspec, measured in
one run on OpenAI-shaped bodies with non-ASCII text: the decode alone (`loads`) and the
whole of parse_inference_request around it (`parse`). `python -m loadtest.json_bench
[--json PATH]`.

The `parse` row is what each choice costs exactly as filters/request.py must use it: the
same result as json.loads. msgspec needs nothing more (it refuses, and the stdlib decides,
where they would differ); orjson turns integers beyond 64 bits into floats, so its row
adds a guard that finds them (a run of 19 digits anywhere in the body sends the body to the
stdlib). The figures quoted in filters/request.py come from this script.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import orjson

from filters.request import RequestKind, _loads, _loads_stdlib, _parse, parse_inference_request
from loadtest.hotpath_bench import MIN_REPEAT_S, fmt_time, word_text

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BYTES_PER_TOKEN = 4
# One word in this many is non-ASCII: accents, CJK, Cyrillic, an emoji (outside the BMP,
# so a surrogate pair when escaped).
NON_ASCII_EVERY = 8
_NON_ASCII = ["café", "naïve", "数据", "日本語の", "Привет", "größer", "🙂", "señal", "東京"]

_DIGITS = bytes.maketrans(b"0123456789", b"0000000000")
_DIGIT_RUN = b"0" * 19  # 2**63 has 19 digits: shorter integers fit orjson's 64 bits


def text(n_bytes: int, seed: int) -> str:
    """Word-like text about `n_bytes` long in UTF-8, one word in NON_ASCII_EVERY not ASCII."""
    rnd = random.Random(seed)
    words = word_text(n_bytes, seed).split(" ")
    for i in range(0, len(words), NON_ASCII_EVERY):
        words[i] = rnd.choice(_NON_ASCII)
    out = " ".join(words)
    while len(out.encode()) > n_bytes:
        out = out[: -max(1, (len(out.encode()) - n_bytes) // 3)]
    return out


def small_chat() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Réponds brièvement, en français."},
            {"role": "user", "content": "Quelle est la capitale du Japon ? En 日本語 aussi."},
        ],
        "max_tokens": 64,
        "temperature": 0.2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def long_completion(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": text(tokens * BYTES_PER_TOKEN, seed=11),
        "max_tokens": 256,
        "temperature": 0.0,
        "stream": True,
    }


def token_ids_completion(tokens: int) -> dict[str, Any]:
    rnd = random.Random(12)
    return {"model": MODEL, "prompt": [rnd.randrange(128_256) for _ in range(tokens)]}


def multi_turn_chat(tokens: int) -> dict[str, Any]:
    """An agent's conversation: a long system prompt, then turns of user questions, assistant
    answers and, every fifth turn, a tool call and its result."""
    rnd = random.Random(13)
    target = tokens * BYTES_PER_TOKEN
    messages: list[dict[str, Any]] = [{"role": "system", "content": text(6000, seed=14)}]
    size = 6000
    turn = 0
    while size < target:
        turn += 1
        q = text(rnd.randint(100, 1200), seed=100 + turn)
        messages.append({"role": "user", "content": q})
        if turn % 5 == 0:
            call = {
                "id": f"call_{turn:04d}",
                "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"q": q[:60]})},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            result = text(rnd.randint(400, 2000), seed=200 + turn)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            size += len(result.encode())
        a = text(rnd.randint(200, 2400), seed=300 + turn)
        messages.append({"role": "assistant", "content": a})
        size += len(q.encode()) + len(a.encode())
    return {"model": MODEL, "messages": messages, "max_completion_tokens": 1024, "stream": True}


def bodies() -> list[tuple[str, RequestKind, bytes]]:
    """Raw UTF-8 as httpx >= 0.28 (the openai client) sends; the long chat also \\u-escaped,
    as json.dumps's default (and older httpx) sends."""
    chat = multi_turn_chat(30_000)

    def utf8(doc: dict[str, Any]) -> bytes:
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()

    return [
        ("chat, 2 messages", "chat", utf8(small_chat())),
        ("completion, 4k tokens", "completion", utf8(long_completion(4000))),
        ("completion, 4k ids", "completion", utf8(token_ids_completion(4000))),
        (f"chat, 30k tok, {len(chat['messages'])} msgs", "chat", utf8(chat)),
        ("  same, \\u-escaped", "chat", json.dumps(chat).encode()),
    ]


_MSGSPEC = msgspec.json.Decoder()


def orjson_exact(body: bytes) -> Any:
    """orjson with what it takes to match json.loads: integers of 19 digits or more (maybe
    beyond 64 bits, which orjson would return as floats) and refusals go to the stdlib."""
    if body.translate(_DIGITS).find(_DIGIT_RUN) < 0:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return _loads_stdlib(body)


DECODERS: dict[str, tuple[Callable[[bytes], Any], Callable[[bytes], Any]]] = {
    # name: (the bare decode, the decode exactly as json.loads)
    "json": (json.loads, _loads_stdlib),
    "orjson": (orjson.loads, orjson_exact),
    "msgspec": (_MSGSPEC.decode, _loads),  # _loads: filters/request.py's own
}


@dataclass(frozen=True, slots=True)
class Result:
    body: str
    size: int  # bytes
    step: str  # "loads" or "parse"
    seconds: dict[str, float]  # decoder -> median seconds per call
    ratios: dict[str, float]  # decoder -> json's seconds / its seconds


def check_equal(kind: RequestKind, body: bytes) -> None:
    """Refuse to time decoders that disagree on the benchmark inputs."""
    ref = json.loads(body)
    for name, (bare, exact) in DECODERS.items():
        if repr(bare(body)) != repr(ref) or repr(exact(body)) != repr(ref):
            raise SystemExit(f"{name} decodes the body differently from json.loads")
    a, b = parse_inference_request(kind, body), _parse(kind, body, _loads_stdlib)
    if a != b or repr(a.doc) != repr(b.doc):
        raise SystemExit("parse_inference_request differs from its stdlib path")


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, timed in turns (one batch of >= 20 ms each,
    `repeats` rounds), so a burst of load elsewhere on the machine falls on all of them."""
    number = {}
    for name, fn in fns.items():
        fn()  # warm caches, the allocator
        t0 = time.perf_counter()
        fn()
        number[name] = max(1, int(MIN_REPEAT_S / max(time.perf_counter() - t0, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / number[name])
    return {name: statistics.median(v) for name, v in samples.items()}


def call(step: str, kind: RequestKind, body: bytes, decoder: str) -> Callable[[], Any]:
    bare, exact = DECODERS[decoder]
    if step == "loads":
        return lambda: bare(body)
    return lambda: _parse(kind, body, exact)


def run(repeats: int) -> tuple[list[Result], dict[str, Any]]:
    results = []
    for label, kind, body in bodies():
        check_equal(kind, body)
        for step in ("loads", "parse"):
            secs = time_interleaved({n: call(step, kind, body, n) for n in DECODERS}, repeats)
            ratios = {n: secs["json"] / s for n, s in secs.items() if n != "json"}
            results.append(Result(label, len(body), step, secs, ratios))
    meta = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "repeats": repeats,
        "orjson": orjson.__version__,
        "msgspec": msgspec.__version__,
    }
    return results, meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.json_bench", description=__doc__)
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per case (median)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    results, meta = run(args.repeats)
    print(
        f"request body decode: json vs orjson {meta['orjson']} vs msgspec {meta['msgspec']} "
        f"(median of {args.repeats}, Python {meta['python']}, {meta['machine']})"
    )
    names = list(DECODERS)
    head = f"{'body':<27} {'size':>9} {'step':<5}"
    head += "".join(f" {n:>10}" for n in names)
    head += "".join(f" {'json/' + n:>13}" for n in names[1:])
    print(head)
    for r in results:
        line = f"{r.body:<27} {r.size:>7,} B {r.step:<5}"
        line += "".join(f" {fmt_time(r.seconds[n]):>10}" for n in names)
        line += "".join(f" {r.ratios[n]:>12.2f}x" for n in names[1:])
        print(line)
    print("parse: the whole parse_inference_request, its decode exactly as json.loads's")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
