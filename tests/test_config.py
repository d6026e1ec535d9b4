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
        (
            GOOD + "routing: {picker: {prefix_ttl_s: 0}}",
            "routing.picker.prefix_ttl_s",
            "greater than 0",
        ),
        (
            GOOD + "routing: {picker: {lambda_knee_s: -1}}",
            "routing.picker.lambda_knee_s",
            "greater than 0",
        ),
        (
            GOOD + "routing: {learn_chars_per_token: 1}",
            "routing.learn_chars_per_token",
            "boolean",
        ),
        (
            GOOD + "listeners: {yield_after_first_byte: maybe}",
            "listeners.yield_after_first_byte",
            "boolean",
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


# ---------------------------------------------------------------- telemetry.metrics


@pytest.mark.parametrize(
    ("override", "key", "reason"),
    [
        (
            "telemetry.metrics.max_tenant_labels=-1",
            "telemetry.metrics.max_tenant_labels",
            "greater than or equal to 0",
        ),
        (
            "telemetry.metrics.max_model_labels=10001",
            "telemetry.metrics.max_model_labels",
            "less than or equal to 10000",
        ),
        (
            "telemetry.metrics.max_model_labels=many",
            "telemetry.metrics.max_model_labels",
            "integer",
        ),
        ("telemetry.metrics.max_labels=3", "telemetry.metrics.max_labels", "unknown key"),
    ],
)
def test_label_cap_errors_name_the_key(tmp_path, override, key, reason):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    with pytest.raises(ConfigError) as info:
        load_config(f, env={}, overrides=[override])
    (problem,) = info.value.problems
    assert problem.startswith(key + ":") and reason in problem


def test_label_caps_default_to_the_observers_and_reach_it(tmp_path):
    """telemetry.metrics caps bound the labels RequestObserver.from_config makes: the first N
    tenants (models) keep their name, later ones read "other", configured ones always keep
    theirs; the edges 0 and 10000 load."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from filters.hotpath import parse_routing_headers
    from filters.request import parse_inference_request
    from meshd import observe
    from meshd.metrics import DataPlaneMetrics

    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    cfg = load_config(f, env={})
    assert (cfg.telemetry.metrics.max_tenant_labels, cfg.telemetry.metrics.max_model_labels) == (
        observe.DEFAULT_MAX_TENANT_LABELS,
        observe.DEFAULT_MAX_MODEL_LABELS,
    )
    edges = load_config(
        f,
        env={"MESHD_TELEMETRY__METRICS__MAX_TENANT_LABELS": "0"},
        overrides=["telemetry.metrics.max_model_labels=10000"],
    )
    assert (
        edges.telemetry.metrics.max_tenant_labels,
        edges.telemetry.metrics.max_model_labels,
    ) == (
        0,
        10000,
    )

    f.write_text(
        "pools: [{name: p, models: [served], endpoints: ['http://127.0.0.1:8000']}]\n"
        "reliability: {admission: {tenants: {gold: {weight: 2}}}}\n"
        "telemetry: {metrics: {max_tenant_labels: 2, max_model_labels: 1}}\n"
    )
    metrics = DataPlaneMetrics()
    observer = observe.RequestObserver.from_config(load_config(f, env={}), metrics)
    sent = [("t1", "m1"), ("t2", "m2"), ("t3", "served"), ("gold", "m3"), ("t1", "m1")]
    for i, (tenant, model) in enumerate(sent):
        body = f'{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}'.encode()
        routing, _ = parse_routing_headers([("x-meshd-tenant", tenant)], True)
        req = observer.begin("chat", "p", parse_inference_request("chat", body), routing, "r", i)
        req.attempt("http://127.0.0.1:8000", None, i).first_token(i + 0.1)
        req.finish("ok", None, i + 0.2)
    seen: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            if s.name == "meshd_time_to_first_token_seconds_count":
                key = (s.labels["tenant"], s.labels["model"])
                seen[key] = seen.get(key, 0) + s.value
    assert seen == {
        ("t1", "m1"): 2,  # first tenant, first model: both keep their names
        ("t2", "other"): 1,  # second tenant fits the cap of 2; a second model does not
        ("other", "served"): 1,  # a third tenant is over the cap; the pool's model is kept
        ("gold", "other"): 1,  # an admission tenant is kept over the cap
    }


def test_slow_start_and_slow_abandon_settings_reach_the_guard() -> None:
    from meshd.sidecar import guard_config

    base = {"pools": [{"name": "p", "endpoints": ["http://a:1"]}]}
    on = guard_config(load_config(None, base=base, env={}))
    assert on.slow_start is not None and on.slow_start.window_s == 60.0
    assert on.slow_abandon_factor == 3.0
    off = guard_config(
        load_config(
            None,
            base=base,
            env={},
            overrides=[
                "reliability.slow_start.enabled=false",
                "reliability.slow_abandon_factor=null",
            ],
        )
    )
    assert off.slow_start is None and off.slow_abandon_factor is None
    with pytest.raises(ConfigError, match=r"reliability\.slow_start\.window_s"):
        load_config(None, base=base, env={}, overrides=["reliability.slow_start.window_s=0"])


def test_prefix_ttl_reaches_the_routers_index(tmp_path):
    from meshd.sidecar import build_routers

    f = tmp_path / "c.yaml"
    f.write_text(GOOD + "routing: {policy: meshd}\n")
    (router,) = build_routers(load_config(f, env={})).values()
    assert router.picker.index.ttl_s == float("inf")  # default: KV capacity LRU only
    f.write_text(GOOD + "routing: {policy: meshd, picker: {prefix_ttl_s: 45}}\n")
    (router,) = build_routers(load_config(f, env={})).values()
    assert router.picker.index.ttl_s == 45


def test_lambda_knee_reaches_the_routers_picker(tmp_path):
    from meshd.sidecar import build_routers

    f = tmp_path / "c.yaml"
    f.write_text(GOOD + "routing: {policy: meshd}\n")
    (router,) = build_routers(load_config(f, env={})).values()
    assert router.picker.config.lambda_knee_s == 0.05
    f.write_text(GOOD + "routing: {policy: meshd, picker: {lambda_knee_s: null}}\n")
    (router,) = build_routers(load_config(f, env={})).values()
    assert router.picker.config.lambda_knee_s is None


def test_learn_chars_per_token_defaults_off_and_env_turns_it_on(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    assert load_config(f, env={}).routing.learn_chars_per_token is False
    on = load_config(f, env={"MESHD_ROUTING__LEARN_CHARS_PER_TOKEN": "true"})
    assert on.routing.learn_chars_per_token is True


def test_admission_slots_scale_with_the_pool_unless_set() -> None:
    from meshd.config import ADMISSION_SLOTS_PER_ENDPOINT
    from meshd.sidecar import guard_config

    base = {"pools": [{"name": "p", "endpoints": ["http://a:1"]}]}
    cfg = load_config(None, base=base, env={})
    one, many = guard_config(cfg, 1).admission, guard_config(cfg, 64).admission
    assert one is not None and many is not None
    assert one.max_in_flight == ADMISSION_SLOTS_PER_ENDPOINT
    assert many.max_in_flight == 64 * ADMISSION_SLOTS_PER_ENDPOINT
    assert one.knee_wait_s == 2.0 and one.knee_max_wait_s == 10.0
    fixed = load_config(
        None,
        base=base,
        env={},
        overrides=[
            "reliability.admission.max_in_flight=100",
            "reliability.admission.knee_wait_s=null",
        ],
    )
    adm = guard_config(fixed, 64).admission
    assert adm is not None and adm.max_in_flight == 100 and adm.knee_wait_s is None


def test_a_bad_value_names_where_it_came_from_and_a_missing_key_is_one_problem() -> None:
    # Issue #21's item 8: a bad --set or environment value was reported as coming from
    # the file ("defaults"); a missing endpoint url added "pools: ... at least 1 item".
    from meshd.config import ConfigError, load_config

    pools = {"pools": [{"name": "a", "endpoints": ["http://x:1"]}]}
    with pytest.raises(ConfigError) as err:
        load_config(None, base=pools, env={}, overrides=["limits.max_body_bytes=abc"])
    assert err.value.problems[0].endswith("(from --set limits.max_body_bytes=abc)")
    with pytest.raises(ConfigError) as err:
        load_config(None, base=pools, env={"MESHD_LIMITS__MAX_BODY_BYTES": "abc"})
    env_name = "MESHD_LIMITS__MAX_BODY_BYTES"
    assert err.value.problems[0].endswith(f"(from environment variable {env_name})")
    broken = {"pools": [{"name": "a", "endpoints": [{"weight": 2}]}]}
    with pytest.raises(ConfigError) as err:
        load_config(None, base=broken, env={})
    assert err.value.problems == ["pools[0].endpoints[0].url: Field required"]
    with pytest.raises(ConfigError) as err:
        load_config(None, base={"pools": []}, env={})  # empty on its own: still said
    assert err.value.problems[0].startswith("pools:")
