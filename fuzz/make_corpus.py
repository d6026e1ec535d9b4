"""Writes the seed corpora, fuzz/corpus/<target>/<name>: `python -m fuzz.make_corpus`.

Real-looking inputs, a few per target: vLLM's SSE streams, HTTP requests and responses as
clients and engines send them, W3C traceparents, msgpack resources made with meshd's own
encoders, AdmissionReviews like tests/k8s/, configs like `meshd config example`. Files
already there (crash reproducers added by hand) are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "corpus"
TESTS_K8S = Path(__file__).resolve().parent.parent / "tests" / "k8s"

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chat_stream(words: list[str], usage: bool = True) -> bytes:
    out = b""
    for i, w in enumerate(words):
        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": w}
        out += _event(
            {
                "id": "chatcmpl-9f1c",
                "object": "chat.completion.chunk",
                "created": 1733500000,
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
            }
        )
    out += _event(
        {
            "id": "chatcmpl-9f1c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        }
    )
    if usage:
        out += _event(
            {
                "id": "chatcmpl-9f1c",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {"prompt_tokens": 21, "total_tokens": 25, "completion_tokens": 4},
            }
        )
    return out + b"data: [DONE]\n\n"


def _chunked(body: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(body), size):
        piece = body[i : i + size]
        out += b"%x\r\n%b\r\n" % (len(piece), piece)
    return out + b"0\r\n\r\n"


def _sse() -> dict[str, bytes]:
    completion = b"".join(
        _event({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": t}]})
        for t in ("Once", " upon", " a", " time")
    ) + _event({"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    return {
        "vllm_chat_stream": _chat_stream(["", "Hello", ",", " world", "!"]),
        "vllm_completion_stream": completion + b"data: [DONE]\n\n",
        "vllm_error_midstream": _chat_stream(["", "Hi"], usage=False).replace(
            b"data: [DONE]",
            b'data: {"error":{"object":"error","message":"engine died",'
            b'"type":"InternalServerError","param":null,"code":500}}',
        ),
        "crlf_bom_comments": b"\xef\xbb\xbf: keep-alive\r\nevent: message\r\nid: 7\r\n"
        + b"retry: 1000\r\n"
        + b'data: {"choices":[{"delta":{"reasoning_content":"think"}}]}\r\n\r\n'
        + b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1"}]}}]}\r\r'
        + b"data\ndata: [DONE]\n\n",
        "multiline_data": b'data: {"choices":\ndata: [{"text":"a\\u00e9\xf0\x9f\x98\x80"}]}\n\n'
        + b'data:{"id":5,"usage":{"prompt_tokens":1e2},"choices":[{"index":1,"text":"x"}]}\n\n',
        # EVENT (0xFF SLOT)*: the target also reads it as EVENT repeated with each SLOT
        "templated_chat": b'{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index"'
        + b':0,"delta":{"content":"a"},"logprobs":null,"finish_reason":"stop"}],"usage":null}'
        + b'\xff"b"\xff""\xff"\\n\\u00e9"\xff"\\q"\xff"c\xff7',
    }


def _http_request() -> dict[str, bytes]:
    chat = json.dumps(
        {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: meshd\r\nContent-Type: application/json\r\n"
        b"x-meshd-tenant: acme\r\ntraceparent: " + TP.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(chat), chat)
    )
    return {
        "get_models": b"GET /v1/models HTTP/1.1\r\nHost: meshd\r\nAccept: */*\r\n\r\n",
        "post_chat": post,
        "post_chunked_stream": b"POST /stream HTTP/1.1\r\nHost: x\r\n"
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + _chunked(chat, 17),
        "pipelined_keepalive": b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        + post
        + b"GET /b?q=1 HTTP/1.0\r\n\r\n",
        "expect_continue_upgrade": b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Expect: 100-continue\r\n"
        b"Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\nContent-Length: 5\r\n\r\nhello"
        b"CONNECT engine:443 HTTP/1.1\r\nHost: engine:443\r\n\r\n",
    }


def _http_response() -> dict[str, bytes]:
    sse = _chat_stream(["", "Hi", " there"])
    js = b'{"id":"cmpl-2","object":"text_completion","choices":[{"text":"ok"}]}'
    return {
        "chunked_sse": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\ndate: Sun, 06 Dec 2026 13:00:00 GMT\r\n"
        b"server: uvicorn\r\n\r\n" + _chunked(sse, 97),
        "content_length_json": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(js), js),
        "continue_then_error": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\n"
        b"Content-Length: 21, 21\r\nRetry-After: 2\r\nConnection: close\r\n\r\n"
        b'{"error":"overloaded"}',
        "http10_until_close_obsfold": b"HTTP/1.0 200 OK\r\nX-Long: a\r\n  folded\r\n"
        b"Content-Type: text/plain\r\n\r\nbody until the connection closes",
        "chunked_ext_trailers": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\nA \t;x\r\n0123456789\r\n0\r\nx-usage: 12\r\n\r\n",
    }


def _resources() -> dict[str, dict[str, bytes]]:
    from filters.autoscale import PoolDemand, ScalingPolicy
    from xds.resources import EndpointState, PoolDemandReport, PrefixDigest

    full = EndpointState(
        address="10.0.0.7:8000",
        pool="h100",
        model="meta-llama/Llama-3.1-8B-Instruct",
        adapters={"sql-lora": True, "chat-lora": False},
        gpu="H100",
        gpu_count=2,
        memory_total_bytes=160 * 2**30,
        memory_used_bytes=150 * 2**30,
        kv_block_size=16,
        kv_capacity_blocks=120000,
        kv_usage=0.42,
        requests_running=12,
        requests_waiting=3,
        tokens_in_flight=48000,
        ttft_s=0.21,
        tpot_s=0.018,
        healthy=True,
        draining=False,
        epoch="a1b2c3",
    )
    states = {
        "state_full": full.encode(),
        "state_minimal": EndpointState(address="engine-0.vllm:8000").encode(),
        "state_draining_unknowns": EndpointState(
            address="http://10.0.0.9:8000", gpu=None, kv_usage=None, healthy=False, draining=True
        ).encode(),
    }
    digests = {
        "digest_full": PrefixDigest(
            "engine-0", "a1b2c3", 7, 7, True, 16, (1, 2**63, 2**64 - 1)
        ).encode(),
        "digest_delta": PrefixDigest("engine-0", "a1b2c3", 9, 7, False, 16, (5,), (1,)).encode(),
    }
    demand = PoolDemandReport(
        "h100",
        "sidecar-a",
        PoolDemand(requests_per_s=12.5, predicted_ttft_s=0.4, ttft_samples=30, replicas=2),
        ScalingPolicy(slo_ttft_s=1.0, target_utilization=0.7, min_replicas=1, max_replicas=8),
    )
    return {
        "endpoint_state": states,
        "xds_resources": {**states, **digests, "pool_demand": demand.encode()},
    }


def _delta_response() -> dict[str, bytes]:
    """Responses as the control plane sends a sidecar, each after the byte that says what
    the subscriber wants (fuzz/targets/delta_response.py: two bits a type)."""
    from envoy.service.discovery.v3 import discovery_pb2 as pb

    from xds.resources import ENDPOINT_STATE_TYPE, EndpointState

    def response(resources: list[tuple[str, str, bytes]], removed: tuple[str, ...] = ()) -> bytes:
        m = pb.DeltaDiscoveryResponse(type_url=ENDPOINT_STATE_TYPE, nonce="b17")
        for name, type_url, body in resources:
            r = m.resources.add(name=name, version=f"{len(body):x}-{name}")
            r.resource.type_url = type_url
            r.resource.value = body
        m.removed_resources.extend(removed)
        return m.SerializeToString()

    state = EndpointState(address="10.0.0.9:8000", pool="p", kv_usage=0.5, epoch="a1")
    two = [
        ("e0", ENDPOINT_STATE_TYPE, state.encode()),
        ("engine-0", ENDPOINT_STATE_TYPE, EndpointState(address="e:1").encode()),
    ]
    wildcard, named = b"\x01", b"\x02"
    return {
        "wildcard_two_states_removed": wildcard + response(two, ("e2",)),
        "named_one_of_two": named + response(two),
        "refused_body": wildcard + response([("e1", ENDPOINT_STATE_TYPE, b"\x80")]),
        "other_any_type": wildcard + response([("e1", "type.googleapis.com/x", b"")]),
        "not_subscribed": b"\x00" + response(two),
    }


def _webhook() -> dict[str, bytes]:
    out = {p.stem: p.read_bytes() for p in sorted(TESTS_K8S.glob("admission_review_*.json"))}
    base = json.loads(out["admission_review_pod"])
    delete = json.loads(json.dumps(base))
    delete["request"].update(
        operation="DELETE",
        name="research-agent-7d9f8b6c5d-x2x9z",
        object=None,
        oldObject=base["request"]["object"],
    )
    out["admission_review_delete"] = json.dumps(delete).encode()
    svc = json.loads(json.dumps(base))
    svc["request"]["kind"] = {"group": "", "version": "v1", "kind": "Service"}
    svc["request"]["object"] = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}
    out["admission_review_service"] = json.dumps(svc).encode()
    return out


def _config() -> dict[str, bytes]:
    from meshd.config_example import EXAMPLE

    return {
        "example": EXAMPLE.encode(),
        "small": b"pools:\n  - name: default\n    models: ['*']\n    endpoints: [http://127.0.0.1:8000]\n"
        b"listeners:\n  outbound: {port: 15001}\n",
        "set_override": b"listeners.outbound.port=15002\n",
        "bad_key": b"pools:\n  - name: a\n"
        b"    endpoints: [{url: 'http://e:1', gpu: H100, wieght: 2}]\n",
    }


def corpora() -> dict[str, dict[str, bytes]]:
    sse = _sse()
    chat_body = json.dumps(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Résumé in 3 words"}]},
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 64,
        }
    ).encode()
    return {
        "chunked": {
            "vllm_sse_chunked": _chunked(sse["vllm_chat_stream"], 61),
            "one_chunk_upper_hex_ext": b'1A ; ext="v"\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\n',
            "trailers_then_unused": b"3\r\nabc\r\n0\r\nx-trailer: 1\r\nother:2\r\n\r\nHTTP/1.1 200",
            "empty_body": b"0\r\n\r\n",
        },
        "sse": sse,
        "routing_headers": {
            "traceparent_tracestate": f"traceparent: {TP}\ntracestate: rojo=00f067aa0ba902b7,"
            "congo=t61rcWkgMzE\ntracestate: foo@bar=1 ,  , z=2\n".encode(),
            "meshd_all": b"x-meshd-tenant: acme\r\nX-Meshd-Priority: high\r\n"
            b"x-meshd-deadline-ms: 30000\r\n"
            b"x-meshd-session-id: s-1\r\nx-meshd-workflow-id: wf/42\r\nx-meshd-task-id: t:1\r\n"
            b"x-meshd-task-step: 2\r\nx-meshd-task-steps: 5\r\nx-meshd-task-final: false\r\n"
            b"x-meshd-unknown: ?\r\ncontent-type: application/json",
            "traceparent_future_version": b"traceparent: cc-4bf92f3577b34da6a3ce929d0e0e4736-"
            b"00f067aa0ba902b7-09-extra\nx-meshd-priority: 7\nx-meshd-priority: 1",
            "traceparent_bare": TP.encode(),
        },
        "blockhash": {
            "prompt_16": b"\x0f" + b"You are a helpful assistant. " * 8,
            "prompt_64_utf8": b"\x3f" + "Résumé: 数据 ✓ ".encode() * 12,
            "invalid_utf8": b"\x07abc\xed\xa0\x80\xffdefgh" * 4,
        },
        "http_request": _http_request(),
        "http_response": _http_response(),
        "request_json": {
            "chat": chat_body,
            "completion_token_ids": b'{"model":"m","prompt":[[1,2,3],[4,5]],"max_tokens":7,"n":2}',
            "embedding_list": b'{"model":"e5","input":["a","b\\u00e9"],"encoding_format":"float"}',
            "nan_bom": b'\xef\xbb\xbf{"model":"m","prompt":"x","temperature":NaN}',
        },
        "request_parse": {
            "chat": chat_body,
            "chat_parts_tools": json.dumps(
                {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": None},
                        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
                        {"role": "tool", "content": "caf\u00e9"},
                    ],
                    "max_completion_tokens": 9,
                    "stream_options": {"include_usage": 1},
                }
            ).encode(),
            "completion_stream": b'{"model":"m","prompt":"hi","stream":true,"max_tokens":1}',
            "completion_token_ids": b'{"model":"m","prompt":[[1,2,3],[4,5]],"max_tokens":7,"n":2}',
            "embedding_list": b'{"model":"e5","input":["a","b\\u00e9"],"encoding_format":"float"}',
            "bad_role": b'{"model":"m","messages":[{"role":"user","content":"a"},{"role":7}]}',
            "surrogate": b'{"model":"m","prompt":"\\ud800","input":"\\udfff"}',
        },
        **_resources(),
        "delta_response": _delta_response(),
        "webhook": _webhook(),
        "config": _config(),
    }


def main() -> None:
    for target, files in corpora().items():
        d = ROOT / target
        d.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (d / name).write_bytes(data)
        print(f"{target}: {len(files)} seeds")


if __name__ == "__main__":
    main()
