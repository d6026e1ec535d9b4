"""`meshd webhook`: the mutating admission webhook that injects meshd into pods.

Serves AdmissionReview v1 over TLS (aiohttp): POST /mutate answers with the request's uid
and a base64 JSON Patch built by meshd/inject.py; GET /healthz for probes. The review shape
is the one in kubernetes.io/docs/reference/config-api/apiserver-admission.v1/ (repo
kubernetes/api, admission/v1/types.go): request {uid, kind, resource, subResource, name,
namespace, operation, userInfo, object, oldObject, dryRun, options}; response {uid, allowed,
status, patch, patchType, auditAnnotations, warnings}.

Failure policy: a review we cannot read is answered HTTP 400 with the reason (the API server
then applies the webhook's failurePolicy). Any error of our own while injecting a readable
review is answered `allowed: true` without a patch and with a warning: meshd never blocks pod
creation by itself. Whether an unreachable webhook blocks pods is the cluster's choice, the
MutatingWebhookConfiguration's failurePolicy (the chart defaults to Ignore).

Namespace opt-in needs no API access: the chart registers two webhooks, one whose
namespaceSelector matches `meshd.io/inject: "true"` and calls /mutate?namespace-opt-in=true,
and one for the remaining namespaces that injects only pods opted in by annotation or label.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import signal
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from meshd import __version__
from meshd.inject import inject
from meshd.inject_config import (
    InjectionConfig,
    InjectionError,
    config_from_mapping,
    config_to_mapping,
    load_config_file,
)

log = logging.getLogger("meshd.webhook")

API_VERSION = "admission.k8s.io/v1"
# etcd refuses objects above 1.5 MiB; a review carries object and oldObject, plus slack.
MAX_REVIEW_BYTES = 8 * 1024 * 1024


class MalformedReview(ValueError):
    """The body is not an AdmissionReview v1 request; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ReviewOutcome:
    """The AdmissionReview to send back, and what was decided (for the log)."""

    review: dict[str, Any]
    injected: bool
    reason: str


def _response(uid: str, **fields: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "AdmissionReview",
        "response": {"uid": uid, **fields},
    }


def parse_request(body: Any) -> Mapping[str, Any]:
    """Check the envelope and return `request`; MalformedReview names the first problem."""
    if not isinstance(body, Mapping):
        raise MalformedReview("the body must be a JSON object (an AdmissionReview)")
    if body.get("apiVersion") != API_VERSION:
        raise MalformedReview(
            f"apiVersion must be {API_VERSION!r}, got {body.get('apiVersion')!r} "
            "(set admissionReviewVersions: [v1] in the webhook configuration)"
        )
    if body.get("kind") != "AdmissionReview":
        raise MalformedReview(f"kind must be 'AdmissionReview', got {body.get('kind')!r}")
    request = body.get("request")
    if not isinstance(request, Mapping):
        raise MalformedReview("request is missing or not an object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise MalformedReview("request.uid is missing or not a non-empty string")
    kind = request.get("kind")
    if not isinstance(kind, Mapping) or not isinstance(kind.get("kind"), str):
        raise MalformedReview("request.kind must be an object with a 'kind' string")
    if not isinstance(request.get("operation"), str):
        raise MalformedReview("request.operation is missing or not a string")
    if request.get("operation") in ("CREATE", "UPDATE") and not isinstance(
        request.get("object"), Mapping
    ):
        raise MalformedReview(f"request.object is missing for a {request['operation']}")
    return request


def review(body: Any, cfg: InjectionConfig, *, namespace_opt_in: bool = False) -> ReviewOutcome:
    """Answer one AdmissionReview. Raises MalformedReview only; never denies a pod."""
    request = parse_request(body)
    uid: str = request["uid"]
    kind = request["kind"]
    if (
        kind.get("kind") != "Pod"
        or kind.get("group", "") != ""
        or request.get("operation") != "CREATE"
        or request.get("subResource")
    ):
        what = f"{kind.get('kind')} {request.get('operation')}"
        return ReviewOutcome(_response(uid, allowed=True), False, f"not a pod creation ({what})")
    try:
        result = inject(request["object"], cfg, namespace_opt_in=namespace_opt_in)
    except InjectionError as exc:
        reason = f"meshd did not inject this pod: {exc}"
        return ReviewOutcome(_response(uid, allowed=True, warnings=[reason]), False, reason)
    except Exception as exc:  # an injector bug must not block pod creation
        log.exception("injection failed for review %s", uid)
        reason = f"meshd did not inject this pod: internal error {type(exc).__name__}: {exc}"
        return ReviewOutcome(_response(uid, allowed=True, warnings=[reason]), False, reason)
    if not result.patch:
        return ReviewOutcome(_response(uid, allowed=True), False, result.reason)
    patch = base64.b64encode(json.dumps(result.patch, separators=(",", ":")).encode()).decode()
    answer = _response(uid, allowed=True, patchType="JSONPatch", patch=patch)
    return ReviewOutcome(answer, True, result.reason)


class WebhookServer:
    """The HTTPS server: one ssl context, reloadable when cert-manager rotates the files."""

    def __init__(
        self,
        cfg: InjectionConfig,
        cert_file: str,
        key_file: str,
        host: str = "0.0.0.0",
        port: int = 9443,
    ) -> None:
        self.cfg = cfg
        self.cert_file = cert_file
        self.key_file = key_file
        self.host = host
        self.port = port
        self.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.reload_certificates()
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] | None = None

    def reload_certificates(self) -> None:
        """Load the pair again (on the live context it takes effect for new handshakes).
        An ssl.SSLError names the files: OpenSSL's own message ("[SSL] PEM lib") does not."""
        try:
            self.ssl_context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ssl.SSLError(
                exc.errno,
                f"cannot load the TLS certificate {self.cert_file} and key {self.key_file} "
                f"(not PEM, empty, or not a pair): {exc}",
            ) from None

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REVIEW_BYTES)
        app.router.add_post("/mutate", self._mutate)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._healthz)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.build_app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        # Works on asyncio and uvloop servers alike (port 0 resolved to the bound port).
        sockname = self._runner.addresses[0]
        self.address = (sockname[0], sockname[1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _mutate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError) as exc:
            return _bad_request(f"the body is not JSON: {exc}")
        except web.HTTPRequestEntityTooLarge:
            return _bad_request(f"the review is larger than {MAX_REVIEW_BYTES} bytes", 413)
        opt_in = request.query.get("namespace-opt-in", "").lower() == "true"
        try:
            outcome = review(body, self.cfg, namespace_opt_in=opt_in)
        except MalformedReview as exc:
            return _bad_request(f"malformed AdmissionReview: {exc}")
        req = body["request"]
        obj = req.get("object")
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        log.info(
            "review %s %s/%s: %s",
            req["uid"],
            req.get("namespace", ""),
            req.get("name") or (meta.get("generateName") if isinstance(meta, dict) else None),
            outcome.reason,
        )
        return web.json_response(outcome.review)


def _bad_request(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "webhook",
        help="serve the sidecar-injection admission webhook (AdmissionReview v1, TLS)",
        description="Serve POST /mutate (AdmissionReview admission.k8s.io/v1) and GET "
        "/healthz over TLS. Pods opted in by namespace label (the webhook configured with "
        "?namespace-opt-in=true) or by the meshd.io/inject annotation get meshd injected; "
        "meshd never denies a pod: its own errors are answered allowed with a warning.",
    )
    p.add_argument("--cert", required=True, help="TLS certificate chain (PEM)")
    p.add_argument("--key", required=True, help="TLS private key (PEM)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=9443, help="port to bind (default 9443)")
    p.add_argument("--config", help="injection settings (inject.yaml)")
    p.add_argument(
        "--sidecar-config",
        metavar="FILE",
        help="meshd sidecar config delivered inline to each pod (annotation + downward API)",
    )
    p.add_argument(
        "--cert-reload-s",
        type=float,
        default=60.0,
        help="how often to re-read the certificate files (rotation); 0 = never",
    )
    p.set_defaults(func=_run)


def _load(args: argparse.Namespace) -> InjectionConfig:
    cfg = load_config_file(args.config)
    if args.sidecar_config:
        with open(args.sidecar_config, encoding="utf-8") as fh:
            text = fh.read()
        cfg = config_from_mapping({**config_to_mapping(cfg), "sidecar_config": text})
    return cfg


async def serve(server: WebhookServer, reload_s: float) -> int:
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    assert server.address is not None
    print(
        json.dumps(
            {
                "event": "ready",
                "version": __version__,
                "webhook": f"{server.address[0]}:{server.address[1]}",
            }
        ),
        flush=True,
    )
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=reload_s if reload_s > 0 else None)
            break
        except TimeoutError:
            try:
                server.reload_certificates()
            except (OSError, ssl.SSLError) as exc:
                # Keep serving with the old pair: a half-written rotation must not stop us.
                log.warning("certificate reload failed, keeping the old one: %s", exc)
    await server.stop()
    return 0


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = _load(args)
        server = WebhookServer(cfg, args.cert, args.key, args.host, args.port)
    except (OSError, InjectionError, ssl.SSLError) as exc:
        print(f"meshd webhook: {exc}", file=sys.stderr)
        return 1
    import uvloop

    return uvloop.run(serve(server, args.cert_reload_s))
