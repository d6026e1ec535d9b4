"""`meshd iptables` without touching the kernel: golden output, validation, a model of the
nat chains that checks what each plan redirects, and idempotent apply against a fake
iptables. tests/test_netns_interception.py applies the same rules for real."""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd import iptables as ipt
from meshd.iptables import (
    MULTIPORT_LIMIT,
    IptablesError,
    IptablesPlan,
    apply,
    build_cleanup,
    build_rules,
    format_save,
    format_shell,
    parse_cidrs,
    parse_ports,
)

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MESHD_UPDATE_GOLDEN") == "1"


def run_cli(
    capsys: pytest.CaptureFixture[str], *argv: str, runner: Any = subprocess.run
) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="meshd")
    ipt.register(parser.add_subparsers())
    args = parser.parse_args(["iptables", *argv])
    code = ipt.run(args, runner=runner)
    out, err = capsys.readouterr()
    return code, out, err


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with MESHD_UPDATE_GOLDEN=1"


GOLDEN_ARGS = (
    "--proxy-port", "15006", "--proxy-uid", "1337", "--proxy-gid", "1337",
    "--include-ports", "8000,8080", "--exclude-ports", "22,15000,15001",
    "--exclude-cidrs", "169.254.169.254/32,fd00:ec2::254/128",
    "--include-cidrs", "10.0.0.0/8,fd00::/8",
)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("iptables_shell.txt", ()),
        ("iptables_ipv6.txt", ("--ipv6",)),
        ("iptables_save.txt", ("--format", "save")),
        ("iptables_cleanup.txt", ("--cleanup",)),
    ],
)
def test_printed_rules_match_golden(
    capsys: pytest.CaptureFixture[str], name: str, extra: tuple[str, ...]
) -> None:
    code, out, err = run_cli(capsys, *GOLDEN_ARGS, *extra)
    assert (code, err) == (0, "")
    check_golden(name, out)


def test_default_plan_captures_everything_but_the_proxy_and_loopback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "--proxy-uid", "1337")
    assert code == 0
    check_golden("iptables_default.txt", out)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"proxy_port": 0}, "proxy_port: port 0 is out of range"),
        ({"proxy_port": 65536}, "proxy_port: port 65536 is out of range"),
        ({"proxy_port": True}, "proxy_port: port True is out of range"),
        ({"proxy_uid": None}, "proxy_uid or proxy_gid is required"),
        ({"proxy_uid": -1}, "proxy_uid must be an integer"),
        ({"proxy_gid": 2**32}, "proxy_gid must be an integer"),
        ({"include_ports": ()}, "include_ports is empty"),
        ({"include_ports": (80, 0)}, "include_ports: port 0 is out of range"),
        ({"exclude_ports": (70000,)}, "exclude_ports: port 70000 is out of range"),
        ({"exclude_cidrs": ("10.0.0.0/33",)}, "exclude_cidrs: '10.0.0.0/33' is not an IP"),
        ({"exclude_cidrs": ("not-a-cidr",)}, "exclude_cidrs: 'not-a-cidr' is not an IP"),
        ({"include_cidrs": ("10.1.2.3/8",)}, "did you mean '10.0.0.0/8'"),
        ({"include_cidrs": ()}, "include_cidrs is empty"),
        ({"chain_prefix": "1BAD"}, "must start with a letter"),
        ({"chain_prefix": "A" * 20}, "exceeds 28 characters"),
    ],
)
def test_invalid_plans_are_rejected_naming_the_value(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {"proxy_port": 15006, "proxy_uid": 1337}
    with pytest.raises(ValueError) as info:
        IptablesPlan(**{**base, **kwargs})
    assert message in str(info.value)


def test_gid_alone_is_enough_to_exclude_the_proxy() -> None:
    rules = build_rules(IptablesPlan(proxy_port=15006, proxy_uid=None, proxy_gid=1337))
    assert any("--gid-owner" in r for r in rules)
    assert not any("--uid-owner" in r for r in rules)


def test_parse_ports_and_cidrs() -> None:
    assert parse_ports(" 8000, 8080 ,", "x", allow_wildcard=False) == (8000, 8080)
    assert parse_ports("", "x", allow_wildcard=False) == ()
    assert parse_ports("*", "x", allow_wildcard=True) == "*"
    with pytest.raises(ValueError, match="'\\*' is not allowed"):
        parse_ports("*", "--exclude-ports", allow_wildcard=False)
    with pytest.raises(ValueError, match="--include-ports: 'http' is not a port number"):
        parse_ports("80,http", "--include-ports", allow_wildcard=True)
    with pytest.raises(ValueError, match="--include-ports: port 99999 is out of range"):
        parse_ports("99999", "--include-ports", allow_wildcard=True)
    assert parse_cidrs("10.0.0.0/8, ::1", "x", allow_wildcard=False) == ("10.0.0.0/8", "::1")
    with pytest.raises(ValueError, match=r"--exclude-cidrs: '10\.0\.0\.300' is not an IP"):
        parse_cidrs("10.0.0.300", "--exclude-cidrs", allow_wildcard=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "proxy_uid or proxy_gid is required"),
        (("--proxy-uid", "1", "--exclude-ports", "22,ssh"), "'ssh' is not a port number"),
        (("--proxy-uid", "1", "--proxy-port", "0"), "proxy_port: port 0"),
        (("--proxy-uid", "1", "--exclude-cidrs", "10.0.0.1/8"), "did you mean '10.0.0.0/8'"),
        (("--proxy-uid", "1", "--cleanup", "--format", "save"), "cannot express --cleanup"),
    ],
)
def test_cli_reports_bad_input_with_exit_2(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("meshd iptables: error: ") and message in err


def test_many_ports_are_split_at_the_multiport_limit() -> None:
    ports = tuple(range(1000, 1000 + MULTIPORT_LIMIT + 5))
    plan = IptablesPlan(proxy_port=15006, proxy_uid=1, exclude_ports=ports, include_ports=ports)
    groups = [r[r.index("--dports") + 1] for r in build_rules(plan) if "--dports" in r]
    assert [len(g.split(",")) for g in groups] == [MULTIPORT_LIMIT, 5, MULTIPORT_LIMIT, 5]


def test_cidrs_of_the_other_family_are_left_out() -> None:
    plan = IptablesPlan(
        proxy_port=15006, proxy_uid=1, exclude_cidrs=("10.0.0.0/8", "fd00::/8"),
        include_cidrs=("192.168.0.0/16",),
    )  # fmt: skip
    v4 = [a for r in build_rules(plan, "ipv4") for a in r]
    v6 = [a for r in build_rules(plan, "ipv6") for a in r]
    assert "10.0.0.0/8" in v4 and "fd00::/8" not in v4
    assert "fd00::/8" in v6 and "10.0.0.0/8" not in v6
    # Only IPv4 destinations are included, so nothing IPv6 jumps to the redirect chain.
    assert not [r for r in build_rules(plan, "ipv6") if r[2] == "-A" and r[-1] == "MESHD_REDIRECT"]


def test_save_format_quotes_for_iptables_restore() -> None:
    text = format_save(build_rules(IptablesPlan(proxy_port=15006, proxy_uid=7)))
    assert text.startswith("*nat\n:MESHD_REDIRECT - [0:0]\n:MESHD_OUTPUT - [0:0]\n")
    assert '--comment "meshd: loopback"' in text and text.endswith("COMMIT\n")
    with pytest.raises(ValueError, match="cannot express"):
        format_save(build_cleanup(IptablesPlan(proxy_port=15006, proxy_uid=7)))


# ---------------------------------------------------------------- what the rules mean


@dataclass(frozen=True)
class Packet:
    uid: int
    gid: int
    dst: str
    dport: int
    out_iface: str


def redirected(rules: Sequence[Sequence[str]], pkt: Packet) -> int | None:
    """Walks the nat OUTPUT hook as the kernel would; returns the REDIRECT port or None."""
    chains: dict[str, list[list[str]]] = {"OUTPUT": []}
    for r in rules:
        if r[2] == "-N":
            chains[r[3]] = []
        elif r[2] == "-A":
            chains[r[3]].append(list(r[4:]))

    tests: dict[str, Any] = {
        "--uid-owner": lambda v: pkt.uid == int(v),
        "--gid-owner": lambda v: pkt.gid == int(v),
        "-o": lambda v: pkt.out_iface == v,
        "-d": lambda v: ipaddress.ip_address(pkt.dst) in ipaddress.ip_network(v),
        "--dport": lambda v: pkt.dport == int(v),
        "--dports": lambda v: str(pkt.dport) in v.split(","),
    }

    def matches(spec: list[str]) -> bool:
        # Options come in (name, value) pairs; "-p tcp", "-m MODULE", "--comment" always match.
        pairs = zip(spec[::2], spec[1::2], strict=True)
        return all(tests[opt](value) for opt, value in pairs if opt in tests)

    def walk(chain: str) -> int | str:
        for spec in chains[chain]:
            j = spec.index("-j")
            if not matches(spec[:j]):
                continue
            target = spec[j + 1]
            if target == "RETURN":
                return "return"
            if target == "REDIRECT":
                return int(spec[spec.index("--to-ports") + 1])
            result = walk(target)
            if result != "return":
                return result
        return "return"

    result = walk("OUTPUT")
    return None if result == "return" else int(result)


ports = st.integers(1, 65535)
v4_nets = st.builds(
    lambda a, p: str(ipaddress.ip_network(f"{a}/{p}", strict=False)),
    st.ip_addresses(v=4), st.integers(8, 32),
)  # fmt: skip


port_lists = st.lists(ports, min_size=1, max_size=20).map(tuple)
cidr_lists = st.lists(v4_nets, min_size=1, max_size=3).map(tuple)


@st.composite
def plans(draw: st.DrawFn) -> IptablesPlan:
    return IptablesPlan(
        proxy_port=draw(ports),
        proxy_uid=draw(st.one_of(st.none(), st.just(1337))),
        proxy_gid=draw(st.just(1338)),
        include_ports=draw(st.one_of(st.just("*"), port_lists)),
        exclude_ports=tuple(draw(st.lists(ports, max_size=20))),
        exclude_cidrs=tuple(draw(st.lists(v4_nets, max_size=3))),
        include_cidrs=draw(st.one_of(st.just("*"), cidr_lists)),
        capture_loopback=draw(st.booleans()),
    )  # fmt: skip


@st.composite
def packets(draw: st.DrawFn) -> Packet:
    return Packet(
        uid=draw(st.sampled_from([0, 1000, 1337])),
        gid=draw(st.sampled_from([0, 1338])),
        dst=str(draw(st.ip_addresses(v=4))),
        dport=draw(ports),
        out_iface=draw(st.sampled_from(["eth0", "lo"])),
    )


def expected(plan: IptablesPlan, pkt: Packet) -> int | None:
    dst = ipaddress.ip_address(pkt.dst)
    if pkt.uid == plan.proxy_uid or pkt.gid == plan.proxy_gid:
        return None
    if pkt.out_iface == "lo" and not plan.capture_loopback:
        return None
    loopback = dst in ipaddress.ip_network("127.0.0.0/8")
    if plan.capture_loopback and loopback and pkt.dport == plan.proxy_port:
        return None
    if pkt.dport in plan.exclude_ports:
        return None
    if any(dst in ipaddress.ip_network(c) for c in plan.exclude_cidrs):
        return None
    if plan.include_ports != "*" and pkt.dport not in plan.include_ports:
        return None
    if plan.include_cidrs != "*" and not any(
        dst in ipaddress.ip_network(c) for c in plan.include_cidrs
    ):
        return None
    return plan.proxy_port


@settings(max_examples=300)
@given(plans(), st.lists(packets(), min_size=1, max_size=10))
def test_rules_redirect_exactly_what_the_plan_says(plan: IptablesPlan, pkts: list[Packet]) -> None:
    rules = build_rules(plan)
    assert rules[-1][2:4] == ["-A", "OUTPUT"]  # the hook goes in last
    for pkt in pkts:
        assert redirected(rules, pkt) == expected(plan, pkt), pkt


def test_the_proxys_own_traffic_is_never_redirected_even_to_included_ports() -> None:
    plan = IptablesPlan(proxy_port=15006, proxy_uid=1337, include_ports=(8000,))
    rules = build_rules(plan)
    app = Packet(uid=0, gid=0, dst="10.231.0.2", dport=8000, out_iface="eth0")
    proxy = Packet(uid=1337, gid=1337, dst="10.231.0.2", dport=8000, out_iface="eth0")
    assert redirected(rules, app) == 15006
    assert redirected(rules, proxy) is None


# ---------------------------------------------------------------- applying


class FakeIptables:
    """The nat table as iptables presents it: enough to check apply's idempotence."""

    BUILTIN = ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")

    def __init__(self, fail_on: str | None = None) -> None:
        self.chains: dict[str, list[list[str]]] = {c: [] for c in self.BUILTIN}
        self.calls: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert kwargs == {"capture_output": True, "text": True, "check": False}
        self.calls.append(argv)
        args = argv[1:]
        if args[0] == "-w":
            args = args[1:]
        assert args[:2] == ["-t", "nat"], argv
        verb, chain, spec = args[2], args[3], args[4:]

        def done(rc: int = 0, err: str = "") -> subprocess.CompletedProcess[str]:
            return subprocess.CompletedProcess(argv, rc, "", err)

        if self.fail_on is not None and self.fail_on in argv and verb not in ("-C", "-S"):
            return done(2, "iptables v1.8.9 (nf_tables): unknown option")
        missing = "iptables: No chain/target/match by that name.\n"
        if verb == "-N":
            if chain in self.chains:
                return done(1, "iptables: Chain already exists.\n")
            self.chains[chain] = []
        elif chain not in self.chains:
            return done(1, missing)
        elif verb == "-S":
            pass
        elif verb == "-F":
            self.chains[chain] = []
        elif verb == "-X":
            if self.chains[chain] or any(
                r[-1] == chain for rules in self.chains.values() for r in rules
            ):
                return done(1, "iptables: Directory not empty.\n")
            del self.chains[chain]
        elif verb == "-A":
            target = spec[spec.index("-j") + 1]
            if target not in self.chains and target not in ("RETURN", "REDIRECT"):
                return done(2, "iptables: no chain/target/match by that name.\n")
            self.chains[chain].append(spec)
        elif verb in ("-C", "-D"):
            if spec not in self.chains[chain]:
                return done(1, "iptables: Bad rule (does a matching rule exist?).\n")
            if verb == "-D":
                self.chains[chain].remove(spec)
        else:
            raise AssertionError(argv)
        return done()

    def own(self) -> dict[str, list[list[str]]]:
        return {k: v for k, v in self.chains.items() if v or k not in self.BUILTIN}


PLAN = IptablesPlan(proxy_port=15006, proxy_uid=1337, exclude_ports=(22,))


def test_apply_installs_then_reapplies_without_duplicates() -> None:
    fake = FakeIptables()
    ran = apply(build_rules(PLAN), runner=fake)
    assert [r[:2] for r in ran] == [["iptables", "-w"]] * len(build_rules(PLAN))
    first = fake.own()
    assert len(first["OUTPUT"]) == 1
    apply(build_rules(PLAN), runner=fake)
    assert fake.own() == first  # chains flushed and refilled, hook not duplicated
    # A new plan replaces meshd's chains.
    wider = IptablesPlan(proxy_port=15006, proxy_uid=1337, exclude_ports=(22, 2222))
    apply(build_rules(wider), runner=fake)
    assert len(fake.chains["OUTPUT"]) == 1
    dports = [r[r.index("--dports") + 1] for r in fake.chains["MESHD_OUTPUT"] if "--dports" in r]
    assert dports == ["22,2222"]


def test_cleanup_removes_everything_and_is_idempotent() -> None:
    fake = FakeIptables()
    apply(build_rules(PLAN), runner=fake)
    fake.chains["OUTPUT"].append(build_rules(PLAN)[-1][4:])  # a duplicate hook from elsewhere
    apply(build_cleanup(PLAN), runner=fake)
    assert fake.own() == {}
    assert apply(build_cleanup(PLAN), runner=fake) == []  # nothing left to do


@settings(max_examples=50)
@given(plans())
def test_apply_then_cleanup_leaves_the_table_as_it_was(plan: IptablesPlan) -> None:
    fake = FakeIptables()
    fake.chains["OUTPUT"].append(["-j", "RETURN"])  # someone else's rule survives
    apply(build_rules(plan), runner=fake)
    apply(build_rules(plan), runner=fake)
    apply(build_cleanup(plan), runner=fake)
    assert fake.own() == {"OUTPUT": [["-j", "RETURN"]]}


def test_a_failing_rule_is_reported_with_its_command() -> None:
    fake = FakeIptables(fail_on="--uid-owner")
    with pytest.raises(IptablesError) as info:
        apply(build_rules(PLAN), runner=fake)
    message = str(info.value)
    assert message.startswith("`iptables -w -t nat -A MESHD_OUTPUT -m owner --uid-owner 1337")
    assert "exit status 2: iptables v1.8.9 (nf_tables): unknown option" in message
    assert info.value.returncode == 2


def test_a_missing_binary_is_reported() -> None:
    def runner(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    with pytest.raises(IptablesError, match="/nope/iptables: command not found"):
        apply(build_rules(PLAN), iptables="/nope/iptables", runner=runner)


def test_cli_apply_runs_through_the_runner(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeIptables()
    code, out, err = run_cli(capsys, "--proxy-uid", "1337", "--apply", runner=fake)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "iptables -w -t nat -N MESHD_REDIRECT"
    assert "MESHD_OUTPUT" in fake.chains
    failing = FakeIptables(fail_on="REDIRECT")
    code, out, err = run_cli(capsys, "--proxy-uid", "1337", "--apply", runner=failing)
    assert code == 1
    assert "meshd iptables: error: `iptables -w -t nat -A MESHD_REDIRECT" in err


def test_format_shell_quotes_arguments() -> None:
    text = format_shell([["-t", "nat", "-A", "X", "--comment", "meshd: a b"]], "ip6tables")
    assert text == "ip6tables -t nat -A X --comment 'meshd: a b'\n"
