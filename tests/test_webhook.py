"""meshd/webhook.py over real TLS: a self-signed certificate made here (cryptography), real
AdmissionReview v1 documents in, the uid and a base64 JSON Patch out."""

from __future__ import annotations

import base64
import copy
import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from meshd import webhook
from meshd.inject_config import InjectionConfig
from meshd.webhook import MalformedReview, WebhookServer, review

jsonpatch = pytest.importorskip("jsonpatch", reason="jsonpatch is not installed")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

REVIEW = Path(__file__).parent / "k8s" / "admission_review_pod.json"


def load_review() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(REVIEW.read_text())
    return data


def self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshd-webhook.meshd.svc")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("meshd-webhook.meshd.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp / "tls.crt", tmp / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    cert, key = self_signed(tmp_path)
    srv = WebhookServer(InjectionConfig(), str(cert), str(key), "127.0.0.1", 0)
    await srv.start()
    assert srv.address is not None
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        yield f"https://127.0.0.1:{srv.address[1]}", trust
    finally:
        await srv.stop()


async def post(
    base: str, trust: ssl.SSLContext, body: Any, query: str = ""
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{base}/mutate{query}",
            data=data,
            headers={"Content-Type": "application/json"},
            ssl=trust,
        ) as resp,
    ):
        return resp.status, await resp.json()


async def test_review_over_tls_answers_the_uid_with_a_json_patch(
    server: tuple[str, ssl.SSLContext],
) -> None:
    base, trust = server
    sent = load_review()
    status, answer = await post(base, trust, sent)
    assert status == 200
    assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    response = answer["response"]
    assert response["uid"] == sent["request"]["uid"]
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    pod = jsonpatch.apply_patch(sent["request"]["object"], patch)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [
        "meshd-init",
        "meshd-proxy",
        "migrate",
    ]
    kv.validate(pod, kv.latest_version(), strict=True)


async def test_namespace_opt_in_comes_from_the_webhook_path(
    server: tuple[str, ssl.SSLContext],
) -> None:
    base, trust = server
    sent = load_review()
    del sent["request"]["object"]["metadata"]["annotations"]["meshd.io/inject"]
    _, plain = await post(base, trust, sent)
    assert "patch" not in plain["response"] and plain["response"]["allowed"] is True
    _, opted = await post(base, trust, sent, "?namespace-opt-in=true")
    assert opted["response"]["patchType"] == "JSONPatch"


async def test_own_error_allows_the_pod_with_a_warning(
    server: tuple[str, ssl.SSLContext],
) -> None:
    base, trust = server
    sent = load_review()
    sent["request"]["object"]["metadata"]["annotations"]["meshd.io/exclude-ports"] = "ssh"
    status, answer = await post(base, trust, sent)
    assert status == 200 and answer["response"]["allowed"] is True
    assert "patch" not in answer["response"]
    assert "meshd.io/exclude-ports" in answer["response"]["warnings"][0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        ([1, 2], "JSON object"),
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}, "apiVersion"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "request"),
        (
            {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}},
            "request.uid",
        ),
    ],
)
async def test_malformed_review_is_400_with_the_reason(
    server: tuple[str, ssl.SSLContext], body: Any, message: str
) -> None:
    base, trust = server
    status, answer = await post(base, trust, body)
    assert status == 400
    assert message in answer["error"]


async def test_healthz_and_tls_is_real(server: tuple[str, ssl.SSLContext], tmp_path: Path) -> None:
    base, trust = server
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/healthz", ssl=trust) as resp:
            assert resp.status == 200
        (tmp_path / "other").mkdir()
        other, _ = self_signed(tmp_path / "other")
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await session.get(f"{base}/healthz", ssl=ssl.create_default_context(cafile=str(other)))


def test_non_pod_and_non_create_reviews_are_allowed_untouched() -> None:
    sent = load_review()
    update = copy.deepcopy(sent)
    update["request"]["operation"] = "UPDATE"
    deploy = copy.deepcopy(sent)
    deploy["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    for body in (update, deploy):
        outcome = review(body, InjectionConfig())
        assert outcome.review["response"] == {"uid": sent["request"]["uid"], "allowed": True}


def test_internal_error_never_blocks_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(webhook, "inject", broken)
    outcome = review(load_review(), InjectionConfig())
    response = outcome.review["response"]
    assert response["allowed"] is True and "boom" in response["warnings"][0]


def test_create_without_object_is_malformed() -> None:
    sent = load_review()
    del sent["request"]["object"]
    with pytest.raises(MalformedReview, match=r"request\.object"):
        review(sent, InjectionConfig())


def test_an_empty_certificate_file_is_named(tmp_path) -> None:
    import ssl

    import pytest as _pytest

    from meshd.inject_config import InjectionConfig
    from meshd.webhook import WebhookServer

    empty = tmp_path / "tls.crt"
    empty.write_text("")
    with _pytest.raises(ssl.SSLError, match=str(empty)):
        WebhookServer(InjectionConfig(), str(empty), str(empty), "127.0.0.1", 0)
