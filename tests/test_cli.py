"""The `meshd` entry point: each command's module registers exactly that command, and
running a command imports only its module (a sidecar does not carry grpc or the bench)."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from meshd.cli import SUBCOMMANDS, build_parser


def _registered(module_name: str) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    importlib.import_module(module_name).register(sub)
    return set(sub.choices)


@pytest.mark.parametrize(("command", "module"), SUBCOMMANDS)
def test_each_module_registers_exactly_its_command(command, module):
    assert _registered(module) == {command}


def test_the_full_parser_lists_every_command_in_order():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == [command for command, _ in SUBCOMMANDS]


def test_build_parser_only_imports_and_lists_one_command():
    parser = build_parser(only="version")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["version"]


def test_running_a_command_imports_only_its_module():
    # In a fresh interpreter: `meshd config example` must not pull in grpc, the xDS
    # plane, the ext_proc picker or the bench.
    code = (
        "import json, sys\n"
        "from meshd.cli import main\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['config', 'example'])\n"
        "print(json.dumps({'rc': rc, 'mods': sorted(sys.modules)}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["rc"] == 0
    mods = set(doc["mods"])
    assert "meshd.config_cmd" in mods
    for heavy in ("grpc", "xds.cli", "meshd.extproc", "loadtest.bench.cli", "meshd.webhook"):
        assert heavy not in mods, f"{heavy} imported for `meshd config example`"


def test_unknown_command_still_gets_the_full_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        from meshd.cli import main

        main(["no-such-command"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "sidecar" in err and "sim-engine" in err


def test_a_sidecar_that_cannot_start_says_why_in_one_line(tmp_path):
    import socket
    import subprocess
    import sys

    bad = tmp_path / "tls.yaml"
    bad.write_text(
        "pools: [{name: d, endpoints: ['http://127.0.0.1:9']}]\n"
        "listeners: {outbound: {port: 0}, admin: {port: 0}}\n"
        "control_plane: {addresses: ['127.0.0.1:1'], tls: {ca_file: /nope/ca.crt}}\n"
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        runs = {
            "tls": ["--config", str(bad)],
            "port": [
                "--config",
                str(bad),
                "--set",
                "control_plane.tls=null",
                "--listen",
                f"127.0.0.1:{port}",
            ],
        }
        said: dict[str, str] = {}
        for name, args in runs.items():
            r = subprocess.run(
                [sys.executable, "-m", "meshd.cli", "sidecar", *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 1, (name, r.stderr)
            assert "Traceback" not in r.stderr, (name, r.stderr)
            said[name] = r.stderr
    assert "control_plane.tls.ca_file: cannot read /nope/ca.crt" in said["tls"]
    assert "cannot start" in said["port"] and "address already in use" in said["port"]


def test_version_names_every_compiled_twins_implementation(capsys):
    from filters import cost_ledger, endpoint_state, hotpath, picker
    from meshd.cli import main
    from xds import delta_response, engine_report

    assert main(["version"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines()[2:])
    assert lines == {
        "hot path": hotpath.IMPLEMENTATION,
        "picker loop": picker.IMPLEMENTATION,
        "xds EndpointState decode": engine_report.IMPLEMENTATION,
        "xds response read": delta_response.IMPLEMENTATION,
        "endpoint state report": endpoint_state.IMPLEMENTATION,
        "cost ledger": cost_ledger.IMPLEMENTATION,
    }
