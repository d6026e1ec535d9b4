"""`meshd iptables`: the nat rules that send an app's outbound TCP to the transparent listener.

A pure plan builder (`IptablesPlan` -> argv lists) plus a small, idempotent applier. Meant to
run once per pod network namespace, from an init container with NET_ADMIN, like Istio's
istio-iptables and Linkerd's proxy-init.

Shape of the rules, learned from istio/istio tools/istio-iptables/pkg/capture/run.go (and its
testdata/*.golden) and linkerd/linkerd2-proxy-init iptables/iptables.go:

- Two dedicated chains in the nat table, `<PREFIX>_OUTPUT` (the decisions) and
  `<PREFIX>_REDIRECT` (the one REDIRECT target), and a single `-A OUTPUT -p tcp -j
  <PREFIX>_OUTPUT` hook, installed last so a half-built chain is never live.
- The proxy's own traffic returns first (`-m owner --uid-owner/--gid-owner`): its upstream
  connections must leave untouched or they would be redirected back into it forever.
- Loopback (`-o lo`, which also covers the pod's own addresses) is left alone unless asked,
  as Linkerd does, so an app talking to itself or to the sidecar's explicit port is untouched.
- Excluded ports and CIDRs return before the include rules; multiport matches carry at most
  15 ports per rule (the xt_multiport limit, as Linkerd's IptablesMultiportLimit).
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Family = Literal["ipv4", "ipv6"]
Wildcard = Literal["*"]
Runner = Callable[..., "subprocess.CompletedProcess[str]"]

TABLE = "nat"
# xt_multiport accepts at most 15 ports in one match.
MULTIPORT_LIMIT = 15
# Chain names are at most 28 characters (XT_EXTENSION_MAXNAMELEN - 1).
MAX_CHAIN_NAME = 28
_CHAIN_SUFFIXES = ("_OUTPUT", "_REDIRECT")
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
# Upper bound on deleting one duplicated rule, so a runner that always reports "present"
# cannot spin forever.
_MAX_DUPLICATE_DELETES = 64
_LOOPBACK = {"ipv4": "127.0.0.0/8", "ipv6": "::1/128"}


class IptablesError(RuntimeError):
    """An iptables command failed; carries the exact command so the operator can rerun it."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        detail = stderr.strip() or "no error output"
        super().__init__(
            f"`{shlex.join(self.argv)}` failed with exit status {returncode}: {detail}"
        )


@dataclass(frozen=True, slots=True)
class IptablesPlan:
    """What to capture: every field is validated on construction, errors name the value.

    include_ports / include_cidrs: "*" (everything) or the only ports / destinations to
    redirect. exclude_*: never redirected, checked before the includes. capture_loopback:
    also redirect traffic leaving through `lo` (off by default; the proxy's own traffic is
    excluded by owner either way).
    """

    proxy_port: int
    proxy_uid: int | None
    proxy_gid: int | None = None
    include_ports: tuple[int, ...] | Wildcard = "*"
    exclude_ports: tuple[int, ...] = ()
    exclude_cidrs: tuple[str, ...] = ()
    include_cidrs: tuple[str, ...] | Wildcard = "*"
    capture_loopback: bool = False
    chain_prefix: str = "MESHD"

    def __post_init__(self) -> None:
        _check_port(self.proxy_port, "proxy_port")
        if self.proxy_uid is None and self.proxy_gid is None:
            raise ValueError(
                "proxy_uid or proxy_gid is required: without an owner exclusion the proxy's "
                "own upstream connections are redirected back into it (a loop)"
            )
        for name, ident in (("proxy_uid", self.proxy_uid), ("proxy_gid", self.proxy_gid)):
            if ident is not None and not (
                isinstance(ident, int) and not isinstance(ident, bool) and 0 <= ident < 2**32 - 1
            ):
                raise ValueError(f"{name} must be an integer in 0..4294967294, got {ident!r}")
        if self.include_ports != "*":
            if not isinstance(self.include_ports, tuple):
                raise ValueError(
                    f"include_ports must be '*' or a tuple, got {self.include_ports!r}"
                )
            if not self.include_ports:
                raise ValueError("include_ports is empty: nothing would be redirected (use '*')")
            for port in self.include_ports:
                _check_port(port, "include_ports")
        for port in self.exclude_ports:
            _check_port(port, "exclude_ports")
        for cidr in self.exclude_cidrs:
            _parse_cidr(cidr, "exclude_cidrs")
        if self.include_cidrs != "*":
            if not isinstance(self.include_cidrs, tuple):
                raise ValueError(
                    f"include_cidrs must be '*' or a tuple, got {self.include_cidrs!r}"
                )
            if not self.include_cidrs:
                raise ValueError("include_cidrs is empty: nothing would be redirected (use '*')")
            for cidr in self.include_cidrs:
                _parse_cidr(cidr, "include_cidrs")
        if not _PREFIX_RE.match(self.chain_prefix):
            raise ValueError(
                f"chain_prefix {self.chain_prefix!r} must start with a letter and contain only "
                "letters, digits, '_' and '-'"
            )
        longest = self.chain_prefix + max(_CHAIN_SUFFIXES, key=len)
        if len(longest) > MAX_CHAIN_NAME:
            raise ValueError(
                f"chain_prefix {self.chain_prefix!r} is too long: chain {longest!r} exceeds "
                f"{MAX_CHAIN_NAME} characters"
            )

    @property
    def output_chain(self) -> str:
        return f"{self.chain_prefix}_OUTPUT"

    @property
    def redirect_chain(self) -> str:
        return f"{self.chain_prefix}_REDIRECT"


def _check_port(port: object, what: str) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"{what}: port {port!r} is out of range 1..65535")


def _parse_cidr(text: str, what: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "host bits set" in str(exc):
            loose = ipaddress.ip_network(text, strict=False)
            raise ValueError(
                f"{what}: {text!r} has host bits set; did you mean {loose.compressed!r}?"
            ) from None
        raise ValueError(f"{what}: {text!r} is not an IP address or CIDR") from None


def _cidrs_of(cidrs: Iterable[str], family: Family, what: str) -> list[str]:
    version = 4 if family == "ipv4" else 6
    nets = (_parse_cidr(c, what) for c in cidrs)
    return [n.compressed for n in nets if n.version == version]


def _port_groups(ports: Sequence[int]) -> list[str]:
    unique = list(dict.fromkeys(ports))
    return [
        ",".join(str(p) for p in unique[i : i + MULTIPORT_LIMIT])
        for i in range(0, len(unique), MULTIPORT_LIMIT)
    ]


def _comment(text: str) -> list[str]:
    return ["-m", "comment", "--comment", f"meshd: {text}"]


def _nat(*args: str) -> list[str]:
    return ["-t", TABLE, *args]


def build_rules(plan: IptablesPlan, family: Family = "ipv4") -> list[list[str]]:
    """The argv lists (without the iptables binary) that install `plan` for one family.

    CIDRs of the other family are skipped; with include_cidrs set and none of this family,
    the chains exist but redirect nothing.
    """
    return [
        *_chain_rules(plan),
        *_owner_rules(plan),
        _loopback_rule(plan, family),
        *_exclude_rules(plan, family),
        *_capture_rules(plan, family),
        _nat("-A", "OUTPUT", "-p", "tcp", *_comment("outbound capture"), "-j", plan.output_chain),
    ]


def _chain_rules(plan: IptablesPlan) -> list[list[str]]:
    """The two chains, and the one REDIRECT to the transparent listener."""
    redirect = plan.redirect_chain
    return [
        _nat("-N", redirect),
        _nat("-N", plan.output_chain),
        _nat(
            "-A",
            redirect,
            "-p",
            "tcp",
            *_comment("to the transparent listener"),
            "-j",
            "REDIRECT",
            "--to-ports",
            str(plan.proxy_port),
        ),
    ]


def _owner_rules(plan: IptablesPlan) -> list[list[str]]:
    """The proxy's own traffic returns first, by UID and by GID."""
    owners = (("--uid-owner", plan.proxy_uid), ("--gid-owner", plan.proxy_gid))
    return [
        _nat(
            "-A",
            plan.output_chain,
            "-m",
            "owner",
            flag,
            str(ident),
            *_comment("sidecar traffic"),
            "-j",
            "RETURN",
        )
        for flag, ident in owners
        if ident is not None
    ]


def _loopback_rule(plan: IptablesPlan, family: Family) -> list[str]:
    out = plan.output_chain
    if not plan.capture_loopback:
        return _nat("-A", out, "-o", "lo", *_comment("loopback"), "-j", "RETURN")
    # Loopback destinations are captured, but never the proxy's own port.
    return _nat(
        "-A",
        out,
        "-d",
        _LOOPBACK[family],
        "-p",
        "tcp",
        "--dport",
        str(plan.proxy_port),
        *_comment("the transparent listener itself"),
        "-j",
        "RETURN",
    )


def _exclude_rules(plan: IptablesPlan, family: Family) -> list[list[str]]:
    out = plan.output_chain
    rules = [
        _nat(
            "-A",
            out,
            "-p",
            "tcp",
            "-m",
            "multiport",
            "--dports",
            group,
            *_comment("excluded ports"),
            "-j",
            "RETURN",
        )
        for group in _port_groups(plan.exclude_ports)
    ]
    for cidr in _cidrs_of(plan.exclude_cidrs, family, "exclude_cidrs"):
        rules.append(_nat("-A", out, "-d", cidr, *_comment("excluded CIDR"), "-j", "RETURN"))
    return rules


def _capture_rules(plan: IptablesPlan, family: Family) -> list[list[str]]:
    """One REDIRECT jump per included destination x port group (one each for "*")."""
    dests: list[list[str]] = (
        [[]]
        if plan.include_cidrs == "*"
        else [["-d", c] for c in _cidrs_of(plan.include_cidrs, family, "include_cidrs")]
    )
    ports: list[list[str]] = (
        [[]]
        if plan.include_ports == "*"
        else [
            ["-p", "tcp", "-m", "multiport", "--dports", g]
            for g in _port_groups(plan.include_ports)
        ]
    )
    return [
        _nat("-A", plan.output_chain, *dest, *port, *_comment("capture"), "-j", plan.redirect_chain)
        for dest in dests
        for port in ports
    ]


def build_cleanup(plan: IptablesPlan, family: Family = "ipv4") -> list[list[str]]:
    """The argv lists that remove what `build_rules` installs (the hook first, then chains)."""
    out, redirect = plan.output_chain, plan.redirect_chain
    hook = build_rules(plan, family)[-1]
    return [
        ["-t", TABLE, "-D", *hook[3:]],
        ["-t", TABLE, "-F", out],
        ["-t", TABLE, "-F", redirect],
        ["-t", TABLE, "-X", out],
        ["-t", TABLE, "-X", redirect],
    ]


def format_shell(rules: Iterable[Sequence[str]], iptables: str = "iptables") -> str:
    """One shell command per rule, quoted so it can be pasted or piped to `sh -e`."""
    return "".join(shlex.join([iptables, *rule]) + "\n" for rule in rules)


def format_save(rules: Iterable[Sequence[str]]) -> str:
    """The rules in iptables-save format, for `iptables-restore --noflush`.

    A chain declaration flushes that chain under --noflush, so the own chains are replaced,
    but the OUTPUT hook is appended again on every restore; `--apply` avoids that.
    """
    lines: list[str] = []
    table: str | None = None
    for rule in rules:
        if len(rule) < 4 or rule[0] != "-t":
            raise ValueError(f"rule must start with '-t TABLE': {list(rule)}")
        if table is None:
            table = rule[1]
            lines.append(f"*{table}")
        elif rule[1] != table:
            raise ValueError(f"format_save handles one table, got {table!r} and {rule[1]!r}")
        body = list(rule[2:])
        if body[0] == "-N":
            lines.append(f":{body[1]} - [0:0]")
        elif body[0] in ("-A", "-I"):
            lines.append(" ".join(_save_quote(arg) for arg in body))
        else:
            raise ValueError(f"format_save cannot express {body[0]!r}: {list(rule)}")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def _save_quote(arg: str) -> str:
    # iptables-restore splits on whitespace and understands double quotes only.
    if '"' in arg or "\\" in arg:
        raise ValueError(f"iptables-restore cannot quote {arg!r}")
    return f'"{arg}"' if (not arg or any(c.isspace() for c in arg)) else arg


def apply(
    rules: Sequence[Sequence[str]],
    iptables: str = "iptables",
    runner: Runner = subprocess.run,
    *,
    wait: bool = True,
) -> list[list[str]]:
    """Run `rules` with `iptables`, idempotently; returns the commands actually run.

    Idempotence: `-N` of an existing chain flushes it instead; `-A`/`-I` into a chain this
    batch does not create (OUTPUT) is skipped when `-C` finds it; `-D` deletes every copy
    and is skipped when absent; `-F`/`-X` of a missing chain are skipped. So applying twice
    gives one hook, and cleanup after cleanup succeeds. Raises IptablesError naming the
    failing command.
    """
    base = [iptables, "-w"] if wait else [iptables]

    def call(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        argv = [*base, *args]
        try:
            return runner(argv, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise IptablesError(argv, 127, f"{iptables}: command not found") from None

    def must(args: Sequence[str]) -> None:
        done = call(args)
        if done.returncode != 0:
            raise IptablesError([*base, *args], done.returncode, done.stderr or "")
        ran.append([*base, *args])

    def chain_exists(table: str, chain: str) -> bool:
        return call(["-t", table, "-S", chain]).returncode == 0

    def rule_exists(table: str, chain: str, spec: Sequence[str]) -> bool:
        return call(["-t", table, "-C", chain, *spec]).returncode == 0

    ran: list[list[str]] = []
    created = {r[3] for r in rules if len(r) >= 4 and r[0] == "-t" and r[2] == "-N"}
    for rule in rules:
        if len(rule) < 4 or rule[0] != "-t":
            raise ValueError(f"rule must start with '-t TABLE VERB CHAIN': {list(rule)}")
        table, verb, chain, spec = rule[1], rule[2], rule[3], rule[4:]
        if verb == "-N":
            if chain_exists(table, chain):
                must(["-t", table, "-F", chain])
            else:
                must(rule)
        elif verb in ("-A", "-I") and chain not in created:
            if not rule_exists(table, chain, spec):
                must(rule)
        elif verb == "-D":
            for _ in range(_MAX_DUPLICATE_DELETES):
                if not rule_exists(table, chain, spec):
                    break
                must(rule)
        elif verb in ("-F", "-X"):
            if chain_exists(table, chain):
                must(rule)
        else:
            must(rule)
    return ran


# ---------------------------------------------------------------- command line


def parse_ports(text: str, what: str, *, allow_wildcard: bool) -> tuple[int, ...] | Wildcard:
    """'8000,8080' -> (8000, 8080); '*' -> '*' where allowed; '' -> ()."""
    text = text.strip()
    if text == "*":
        if not allow_wildcard:
            raise ValueError(f"{what}: '*' is not allowed here")
        return "*"
    ports: list[int] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if not item.isdigit():
            raise ValueError(f"{what}: {item!r} is not a port number")
        port = int(item)
        _check_port(port, what)
        ports.append(port)
    return tuple(ports)


def parse_cidrs(text: str, what: str, *, allow_wildcard: bool) -> tuple[str, ...] | Wildcard:
    """'10.0.0.0/8,fd00::/8' -> ('10.0.0.0/8', 'fd00::/8'); '*' -> '*' where allowed."""
    text = text.strip()
    if text == "*":
        if not allow_wildcard:
            raise ValueError(f"{what}: '*' is not allowed here")
        return "*"
    cidrs = tuple(filter(None, (part.strip() for part in text.split(","))))
    for cidr in cidrs:
        _parse_cidr(cidr, what)
    return cidrs


HELP = """\
Redirect this network namespace's outbound TCP to meshd's transparent listener, the way
Istio's istio-iptables and Linkerd's proxy-init do, so an unmodified app's requests to an
inference service reach the sidecar (which reads the original destination with
SO_ORIGINAL_DST and passes everything that is not an inference service through as TCP).

Rules go in the nat table, in two chains of their own (PREFIX_OUTPUT, PREFIX_REDIRECT)
hooked from OUTPUT. The proxy's own UID/GID is excluded so its upstream connections are
never re-intercepted; loopback is left alone unless --capture-loopback.

By default the rules are printed as shell commands and nothing is changed. --apply runs
them (needs NET_ADMIN; re-applying replaces meshd's chains, never duplicates the hook).
--cleanup prints, or with --apply runs, the commands that remove them.

example:
  meshd iptables --proxy-port 15006 --proxy-uid 1337 --include-ports '*' \\
      --exclude-ports 22,15000 --exclude-cidrs 169.254.169.254/32 --apply
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "iptables",
        help="print or apply the iptables rules for transparent interception",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--proxy-port",
        type=int,
        default=15006,
        help="the transparent listener's port (default 15006)",
    )
    p.add_argument(
        "--proxy-uid",
        type=int,
        default=None,
        help="UID the sidecar runs as; its traffic is never redirected",
    )
    p.add_argument(
        "--proxy-gid",
        type=int,
        default=None,
        help="GID the sidecar runs as; its traffic is never redirected",
    )
    p.add_argument(
        "--include-ports",
        default="*",
        help="comma-separated destination ports to redirect, or '*' (default)",
    )
    p.add_argument(
        "--exclude-ports",
        default="",
        help="comma-separated destination ports never redirected (e.g. 22)",
    )
    p.add_argument(
        "--include-cidrs",
        default="*",
        help="comma-separated destination CIDRs to redirect, or '*' (default)",
    )
    p.add_argument(
        "--exclude-cidrs", default="", help="comma-separated destination CIDRs never redirected"
    )
    p.add_argument(
        "--capture-loopback",
        action="store_true",
        help="also redirect connections that leave through lo",
    )
    p.add_argument("--chain-prefix", default="MESHD", help="name prefix of meshd's chains")
    p.add_argument(
        "--ipv6",
        action="store_true",
        help="also write the IPv6 rules with ip6tables (listener must bind '::')",
    )
    p.add_argument(
        "--format",
        choices=("shell", "save"),
        default="shell",
        help="how to print: shell commands (default) or iptables-save text",
    )
    p.add_argument("--apply", action="store_true", help="run the commands instead of printing")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="the commands that remove meshd's rules instead of installing them",
    )
    p.add_argument("--iptables-bin", default="iptables", help="iptables binary (default: iptables)")
    p.add_argument(
        "--ip6tables-bin", default="ip6tables", help="ip6tables binary (default: ip6tables)"
    )
    p.set_defaults(func=run)


def plan_from_args(args: argparse.Namespace) -> IptablesPlan:
    exclude_ports = parse_ports(args.exclude_ports, "--exclude-ports", allow_wildcard=False)
    exclude_cidrs = parse_cidrs(args.exclude_cidrs, "--exclude-cidrs", allow_wildcard=False)
    assert exclude_ports != "*" and exclude_cidrs != "*"
    return IptablesPlan(
        proxy_port=args.proxy_port,
        proxy_uid=args.proxy_uid,
        proxy_gid=args.proxy_gid,
        include_ports=parse_ports(args.include_ports, "--include-ports", allow_wildcard=True),
        exclude_ports=exclude_ports,
        exclude_cidrs=exclude_cidrs,
        include_cidrs=parse_cidrs(args.include_cidrs, "--include-cidrs", allow_wildcard=True),
        capture_loopback=args.capture_loopback,
        chain_prefix=args.chain_prefix,
    )


def run(args: argparse.Namespace, runner: Runner = subprocess.run) -> int:
    try:
        plan = plan_from_args(args)
        if args.cleanup and args.format == "save":
            raise ValueError("--format save cannot express --cleanup; use --format shell")
    except ValueError as exc:
        print(f"meshd iptables: error: {exc}", file=sys.stderr)
        return 2
    build = build_cleanup if args.cleanup else build_rules
    families: list[tuple[Family, str]] = [("ipv4", args.iptables_bin)]
    if args.ipv6:
        families.append(("ipv6", args.ip6tables_bin))
    for family, binary in families:
        rules = build(plan, family)
        if not args.apply:
            text = format_save(rules) if args.format == "save" else format_shell(rules, binary)
            sys.stdout.write(text)
            continue
        try:
            ran = apply(rules, iptables=binary, runner=runner)
        except IptablesError as exc:
            print(f"meshd iptables: error: {exc}", file=sys.stderr)
            return 1
        for argv in ran:
            print(shlex.join(argv))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m meshd.iptables ...`: the same command without loading the rest of meshd."""
    parser = argparse.ArgumentParser(prog="meshd")
    register(parser.add_subparsers())
    args = parser.parse_args(["iptables", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
