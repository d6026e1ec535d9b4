"""`meshd sim-engine`: its parser, fleet configs, and a real process serving until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from loadtest.engine import ConfigError, fleet_from_dict, load_fleet_config
from loadtest.engine.cli import register, specs_from_args

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshd")
    register(parser.add_subparsers())
    return parser.parse_args(["sim-engine", *argv])


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for flag in (
        "--gpu",
        "--gpus",
        "--fleet",
        "--kv-events-endpoint",
        "--time-scale",
        "--config",
        "--kv-blocks",
        "--fault",
        "--seed",
        "--model",
    ):
        assert flag in out


def test_a_mixed_fleet_on_consecutive_ports() -> None:
    host, specs = specs_from_args(
        parse(
            "--fleet",
            "4",
            "--gpus",
            "H100,a100",
            "--port",
            "9000",
            "--kv-events-endpoint",
            "tcp://*:5600",
            "--kv-blocks",
            "128",
            "--fault",
            '{"kind": "slowdown", "factor": 2, "at": 5}',
        )
    )
    assert host == "127.0.0.1"
    assert [s.gpu for s in specs] == ["H100", "A100", "H100", "A100"]
    assert [s.port for s in specs] == [9000, 9001, 9002, 9003]
    assert [s.kv_events_endpoint for s in specs] == [f"tcp://*:{5600 + i}" for i in range(4)]
    assert all(s.kv_blocks == 128 and s.faults[0].factor == 2 for s in specs)
    with pytest.raises(ConfigError, match="--fault"):
        specs_from_args(parse("--fault", "{bad json"))


def test_config_files_expand_counts_and_name_bad_keys(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "host: 127.0.0.2\n"
        "defaults: {time_scale: 2.0, kv_blocks: 100}\n"
        "engines:\n"
        "  - {gpu: H100, port: 8001}\n"
        "  - {gpu: A100, port: 8002, count: 3, kv_events_endpoint: 'tcp://*:6000'}\n"
        "  - gpu: B200\n"
        "    faults: [{kind: hang, seconds: 3, at: 10}]\n"
    )
    cfg = load_fleet_config(path)
    assert cfg.host == "127.0.0.2"
    assert [(s.gpu, s.port) for s in cfg.engines] == [
        ("H100", 8001),
        ("A100", 8002),
        ("A100", 8003),
        ("A100", 8004),
        ("B200", 0),
    ]
    assert cfg.engines[3].kv_events_endpoint == "tcp://*:6002"
    assert all(s.time_scale == 2.0 and s.kv_blocks == 100 for s in cfg.engines)
    assert cfg.engines[-1].faults[0].kind == "hang"
    for doc, msg in [
        ({"engines": [{"gpu": "H100", "colour": "red"}]}, r"engines\[0\]: unknown keys colour"),
        ({"engines": [{"gpu": "V100"}]}, r"engines\[0\]\.gpu"),
        ({"engines": [{"faults": [{"kind": "x"}]}]}, r"engines\[0\]\.faults"),
        ({"engines": []}, "engines"),
        ({"engines": [{"count": 0}]}, "count"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            fleet_from_dict(doc)


async def test_the_command_serves_a_fleet_until_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from meshd.cli import main; raise SystemExit(main())",
        "sim-engine",
        "--port",
        "0",
        "--fleet",
        "2",
        "--gpus",
        "H200,B200",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    try:
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(2)]
        assert "gpu=H200" in lines[0] and "gpu=B200" in lines[1], lines
        urls = [line.split("url=")[1].split()[0] for line in lines]
        async with aiohttp.ClientSession() as s:
            for url in urls:
                async with s.post(
                    url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}
                ) as r:
                    assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 30)
    assert rc == 0, (await proc.stderr.read()).decode() if proc.stderr else ""


async def test_selfbench_measures_a_small_fleet() -> None:
    from loadtest.engine.selfbench import run_bench

    r = await run_bench(
        engines=2, streams=2, seconds=1.0, time_scale=20.0, max_tokens=20, prompt_words=10
    )
    assert r.tokens > 100 and r.requests > 5
    assert 0 < r.cpu_us_per_token < 10_000
    assert 0.5 < r.utilisation_mean <= 1.05
    assert "tokens/s=" in r.line()
