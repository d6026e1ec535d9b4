"""`meshd picker` refuses a new task's request predicted to end after its deadline, as the
sidecar does (filters/deadline.py): an immediate 429 `deadline_unmeetable` to Envoy, nothing
routed; a step of a task under way, a request with time enough, or the flag off is routed."""

from __future__ import annotations

import json

import pytest

from filters.pool_router import make_router
from meshd.extproc import endpoint_spec
from meshd.extproc_picker import EndpointPicker, PickerSettings, _Stream

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4000}
).encode()


def _picker(**kw: object) -> EndpointPicker:
    specs = tuple(endpoint_spec(f"10.0.0.{i}:8000") for i in (1, 2))
    router = make_router("meshd", specs)
    ends = router.ends  # type: ignore[attr-defined]
    for i in range(16):  # the pool has finished enough answers to predict
        ends.dispatched(("warm", i), 4000)
        ends.finished(("warm", i), True, 4000)
    settings = PickerSettings(endpoints=specs, trust_routing_headers=True, **kw)  # type: ignore[arg-type]
    return EndpointPicker(settings, router=router)


def _decide(p: EndpointPicker, *headers: tuple[str, str]) -> tuple[_Stream, object]:
    s = _Stream(
        rid=1, path="/v1/chat/completions", headers=[("content-type", "application/json"), *headers]
    )
    return s, p._decide(s, BODY, "request_body")


def test_a_new_request_predicted_late_gets_429_and_is_not_routed() -> None:
    p = _picker()
    s, out = _decide(p, ("x-meshd-deadline-ms", "500"))
    assert out.HasField("immediate_response")  # type: ignore[attr-defined]
    imm = out.immediate_response  # type: ignore[attr-defined]
    assert imm.status.code == 429
    err = json.loads(imm.body)["error"]
    assert err["code"] == "deadline_unmeetable" and "deadline" in err["message"]
    assert s.decision is None and p.in_flight == 0 and p.rejected == {429: 1}


@pytest.mark.parametrize(
    ("why", "headers", "kw"),
    [
        (
            "a step of a task under way",
            [("x-meshd-deadline-ms", "500"), ("x-meshd-task-id", "t"), ("x-meshd-task-step", "3")],
            {},
        ),
        ("time enough", [("x-meshd-deadline-ms", "600000")], {}),
        ("switched off", [("x-meshd-deadline-ms", "500")], {"refuse_predicted_late": False}),
    ],
)
def test_otherwise_it_is_routed(why: str, headers: list[tuple[str, str]], kw: dict) -> None:
    p = _picker(**kw)
    s, out = _decide(p, *headers)
    assert not out.HasField("immediate_response"), why  # type: ignore[attr-defined]
    assert s.decision is not None and p.in_flight == 1
