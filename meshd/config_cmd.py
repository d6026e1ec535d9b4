"""`meshd config`: check a config file, show the effective config, print an example."""

from __future__ import annotations

import argparse
import json
import sys

from meshd.config import EXAMPLE, ConfigError, load_config


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "config",
        help="check a config file, show the effective config, or print an example",
        description="Work with meshd's YAML configuration. Values are taken from the "
        "defaults, then the file, then MESHD_* environment variables (MESHD_A__B=1 sets "
        "a.b), then --set KEY.PATH=VALUE overrides.",
    )
    sub = p.add_subparsers(title="actions", metavar="ACTION")
    check = sub.add_parser(
        "check",
        help="validate FILE; on error, name each offending key",
        description="Validate FILE and exit 0 if it is a valid meshd configuration; "
        "otherwise print each problem with the key it concerns and exit 1.",
    )
    check.add_argument("file", help="the YAML config file")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    check.set_defaults(func=_check)
    show = sub.add_parser(
        "show",
        help="print the effective config (defaults filled in) as JSON",
        description="Print the configuration meshd would run with, as JSON.",
    )
    show.add_argument("file", nargs="?", help="the YAML config file")
    show.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    show.set_defaults(func=_show)
    example = sub.add_parser(
        "example",
        help="print a commented example with every key and its default",
        description="Print a commented example configuration listing every key.",
    )
    example.set_defaults(func=_example)

    def _usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=_usage)


def _check(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file, overrides=args.set)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    endpoints = sum(len(p.endpoints) for p in cfg.pools)
    print(f"{args.file}: ok ({len(cfg.pools)} pool(s), {endpoints} endpoint(s))")
    return 0


def _show(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file, overrides=args.set)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def _example(args: argparse.Namespace) -> int:
    sys.stdout.write(EXAMPLE)
    return 0
