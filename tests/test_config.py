"""Config loading: precedence, and errors that name the offending key."""

from __future__ import annotations

import pytest

from meshd.cli import main
from meshd.config import EXAMPLE, ConfigError, load_config

GOOD = """
pools:
  - name: default
    endpoints: ["http://127.0.0.1:8000", {url: "http://127.0.0.1:8001", gpu: H100}]
"""


def test_defaults_file_env_and_overrides_in_that_order(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD + "limits: {max_body_bytes: 4096}\n")
    cfg = load_config(f, env={})
    assert cfg.limits.max_body_bytes == 4096
    assert cfg.listeners.admin.host == "127.0.0.1"  # loopback by default
    assert cfg.pools[0].endpoints[1].gpu == "H100"
    cfg = load_config(f, env={"MESHD_LIMITS__MAX_BODY_BYTES": "8192"})
    assert cfg.limits.max_body_bytes == 8192
    cfg = load_config(
        f, env={"MESHD_LIMITS__MAX_BODY_BYTES": "8192"}, overrides=["limits.max_body_bytes=16384"]
    )
    assert cfg.limits.max_body_bytes == 16384


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        (GOOD + "listeners: {admin: {port: 70000}}", "listeners.admin.port", "less than or equal"),
        (GOOD + "limits: {max_body_bytes: lots}", "limits.max_body_bytes", "integer"),
        (GOOD + "limitz: {}", "limitz", "unknown key"),
        ("pools: [{name: p, endpoints: [ftp://x:1]}]", "pools[0].endpoints[0].url", "http://"),
        ("pools: [{name: p, endpoints: []}]", "pools[0].endpoints", "at least 1"),
        ("listeners: {}", "pools", "required"),
        (
            GOOD + "transparent: {services: [{address: 10.0.0.1:80, pool: nope}]}",
            "transparent.services[0].pool",
            "unknown pool",
        ),
        (
            GOOD + "trust: {routing_header_sources: [not-a-net]}",
            "trust.routing_header_sources",
            "not an IP network",
        ),
    ],
)
def test_errors_name_the_key_and_the_reason(tmp_path, text, key, reason):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(f, env={})
    rendered = err.value.render()
    assert key in rendered, rendered
    assert reason in rendered, rendered


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    f = tmp_path / "c.yaml"
    f.write_text("pools: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f, env={})
    f.write_text("- a list")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f, env={})


def test_the_example_is_a_valid_config(tmp_path):
    f = tmp_path / "example.yaml"
    f.write_text(EXAMPLE)
    cfg = load_config(f, env={})
    assert cfg.listeners.outbound.port == 15001


def test_config_check_command(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    assert main(["config", "check", str(f)]) == 0
    assert "ok (1 pool(s), 2 endpoint(s))" in capsys.readouterr().out
    f.write_text(GOOD + "upstream: {connect_timeout_s: -1}")
    assert main(["config", "check", str(f)]) == 1
    assert "upstream.connect_timeout_s: Input should be greater than 0" in capsys.readouterr().err


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("sidecar", "config", "version"):
        assert command in out
