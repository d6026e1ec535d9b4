"""The benchmark runner behind `meshd bench` and `meshd demo`.

Per policy: a fresh fleet of engines (the vLLM simulator, or stubs), the router under test
(meshd's sidecar, Envoy, sglang-router, vllm-router), an open-loop streaming load client,
engine-metric scrapes; then a JSON + Markdown report with plots. Modules: client, stream,
fleet, policies, scrape, results, report, runner, cli (`register`, `register_demo`,
`run_demo`, `demo_main`). Nothing is imported here: `meshd --help` loads cli.py only.
"""
