"""The `meshd` command line: one entry point, one subcommand per job.

Each subcommand lives in the module that does the job and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`.
`main` imports only the module of the command it runs: a sidecar process does
not carry the control plane's, the picker's or the bench's imports (grpc, the
Envoy protos, the simulator), which keeps its resident memory down. `--help`
and an unknown command build the full parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (command, module that registers it), in the order `meshd --help` lists them.
# tests/test_cli.py checks that each module registers exactly its command.
SUBCOMMANDS: tuple[tuple[str, str], ...] = (
    ("sidecar", "meshd.sidecar"),
    ("config", "meshd.config_cmd"),
    ("iptables", "meshd.iptables"),
    ("control-plane", "xds.cli"),
    ("agent", "meshd.agent_cmd"),
    ("picker", "meshd.extproc"),
    ("inject", "meshd.inject"),
    ("webhook", "meshd.webhook"),
    ("cost", "meshd.cost_cmd"),
    ("demo", "meshd.demo"),
    ("bench", "loadtest.bench.cli"),
    ("sim-engine", "loadtest.engine.cli"),
    ("version", "meshd.version_cmd"),
)

DESCRIPTION = """\
meshd routes LLM inference requests (OpenAI-compatible HTTP) to the engine
where they are served cheapest and fastest, and keeps streams alive when
engines fail. Run `meshd COMMAND --help` for the options of each command.
"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `meshd` parser; with `only`, just that command's module is imported."""
    parser = argparse.ArgumentParser(
        prog="meshd",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command, name in SUBCOMMANDS:
        if only is not None and command != only:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A subcommand whose module is not part of this build (an optional
            # part still being written) is left out rather than breaking the CLI.
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = args_list[0] if args_list else None
    known = {command for command, _ in SUBCOMMANDS}
    parser = build_parser(only=first if first in known else None)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    result: int = func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
