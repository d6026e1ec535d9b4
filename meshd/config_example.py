"""The commented example that `meshd config example` prints: every key with its default
(tests/test_config.py loads it). Keep it in step with meshd/config_schema.py.
"""

EXAMPLE = """\
# meshd sidecar configuration. Every key is optional except pools.
listeners:
  outbound: {host: 127.0.0.1, port: 15001}     # explicit proxy port for apps
  transparent: {enabled: false, host: 0.0.0.0, port: 15006}  # iptables REDIRECT target
  admin: {host: 127.0.0.1, port: 15000}        # /healthz /readyz /metrics /config /endpoints
  probes: {enabled: false, host: 0.0.0.0, port: 15021, metrics: false}  # /healthz /readyz
                                               # (+ /metrics) for probes of the pod IP
  yield_after_first_byte: true  # let a client on meshd's CPU read its first token at once
pools:
  - name: default
    models: ["*"]                              # glob patterns of model names served
    endpoints:
      - http://127.0.0.1:8000
      - {url: "http://127.0.0.1:8001", gpu: H100, weight: 1.0, kv_capacity_tokens: 500000}
      # The engine's KV events (vLLM --kv-events-config), for routing.tokenizers' models:
      # - {url: "http://10.0.0.7:8000", kv_events: {endpoint: "tcp://10.0.0.7:5557",
      #    replay: "tcp://10.0.0.7:5558", topic: "", bind: false}}
    response_cache: deterministic  # replayable answers (response_cache.enabled): also
                                   # opt-in (Cache-Control opt-in only) or off
    fallbacks: []              # e.g. [{pool: small, model: llama-8b}, eu-west]: when this
                               # pool cannot serve a request in time, the next one does
    max_cost_usd: null         # predicted $ over which a request goes to the first fallback
    role: both                 # or prefill (runs decode pools' prefill steps), or decode:
    disaggregation: null       # {prefill_pool: p, min_prefill_tokens: 256, kv_link_gb_per_s: 50,
                               #  kv_bytes_per_token: null (the GPU profile's, 131072),
                               #  faster_whole_margin_s: 0.1, faster_whole_stall_weight: 0.2
                               #  (whole when that is sooner: filters/disagg.py rule 4)} for a
                               #  decode pool; protocol: vllm-nixl (default) or sglang
                               #  (SGLang's bootstrap rooms, every request split; the port a
                               #  prefill engine's /server_info says, else bootstrap_port:
                               #  8998, or per prefill endpoint: {url: .., bootstrap_port: ..})
    autoscaling:               # meshd_pool_desired_replicas (docs/autoscaling.md)
      slo_ttft_s: null         # the TTFT p90 to keep (null: demand and queue alone)
      target_utilization: 0.7  # busy share of a replica's capacity aimed at
      min_replicas: 1
      max_replicas: 100
upstream:
  connect_timeout_s: 5
  first_byte_timeout_s: 120    # per try: time to the response headers (504 after)
  idle_timeout_s: 60           # longest silence between bytes of a response
  request_timeout_s: 900       # whole request, all tries
  max_connections_per_endpoint: 512
  keepalive_timeout_s: 30
  max_attempts: 3              # tries per request, each on another endpoint
limits:
  max_body_bytes: 8388608      # 413 above
  max_header_count: 100        # 431 above
  max_header_bytes: 16384      # 431 above (all header names and values)
  max_concurrent_streams: 1024 # 503 above
  client_header_timeout_s: 30  # 408 when a request head takes longer to arrive
  client_body_timeout_s: 30    # 408 when a client sends its body slower
  keepalive_timeout_s: 75      # an idle client connection is closed after this
trust:
  routing_header_sources: ["127.0.0.0/8", "::1/128"]  # x-meshd-* stripped from others
routing:
  block_size_bytes: 64         # prefix block for hashing (about 16 tokens)
  cache_salt: ""
  policy: meshd                # prefix-aware picker; or least-request, round-robin,
                               # cache-aware (sglang-router's rule, filters/cache_aware.py)
  picker:
    lambda_usd_per_s: 0.01     # $ one second of TTFT is worth at priority 5 (lower: cheaper)
    lambda_knee_s: 0.05        # best-case TTFT under which a second is worth less (null: off)
    epsilon: 0.25              # bounded load: no endpoint above (1+epsilon) x mean
    cached_headroom: 1.0       # ...x (1 + this x the share of the prompt it holds)
    load_metric: requests      # or tokens
    decode_pricing: reference  # fixed fleet; batch packs running batches (elastic pools)
    decode_weight: 0.05        # a second of decode (own + added to others) vs one of TTFT
    prefill_delay_weight: 0    # its prefill's delay to the streams running there (0: off)
    elastic: false             # true: GPU-seconds saved are money (an autoscaled pool)
    prefix_ttl_s: null         # age limit of learnt prefix entries (null: KV capacity LRU only)
    affinity_min_fraction: 0.3 # a prompt this much cached at one endpoint stays there...
    affinity_imbalance: 3.0    # ...unless its load is over 3x its fair share,
    affinity_margin_s: 0.05    # ...or another is faster by more than this or than the
    affinity_redo_weight: 8.0  # recompute x (this + requests waiting there)
    home_weight: 1.0           # a new session's first step counts as this much load...
    home_window_s: 30          # ...on its endpoint, decaying over this (its follow-ups)
  unhealthy_after_failures: 3  # consecutive connect failures before an endpoint rests
  unhealthy_cooldown_s: 10
  learn_chars_per_token: false # learn chars per prompt token per model from usage (else 4)
  tokenizers: {}               # model -> precise prefix path (needs meshd[precise]), e.g.
  #  llama: {path: /models/llama, hash_algo: sha256, hash_seed: null, block_size: 16}
  engine_metrics:              # each endpoint's own /metrics: KV capacity, usage, restarts
    enabled: true              # (only without a control plane, whose agents report them)
    path: /metrics
    interval_s: 2
    timeout_s: 1
    max_backoff_s: 60          # an endpoint without the page is asked again this rarely
transparent:
  services: []                 # e.g. [{address: "10.0.0.5:8000", pool: default}]
  passthrough_connect_timeout_s: 5
reliability:
  retry:                       # retries on connect failure or 429/502/503/504 before the first byte
    ratio: 0.2                 # at most this share of the last window's requests...
    min_retries_per_s: 10      # ...plus this floor
    window_s: 10
    backoff_base_s: 0.025      # full-jitter exponential backoff; Retry-After honoured
    backoff_max_s: 1.0
  breaker:                     # token-aware circuit breaker, per endpoint
    enabled: true
    max_tokens_per_endpoint: 262144   # prompt + expected output tokens in flight...
    max_tokens_kv_factor: 2.0         # ...or this x the engine's KV capacity, where known
    max_requests_per_endpoint: 256
    max_pending_per_endpoint: 128     # sent, no first token yet
    consecutive_failures: 5    # open after this many failures in a row...
    error_rate: 0.5            # ...or this error rate over error_window_s
    error_window_s: 10
    error_min_requests: 20
    open_base_s: 5             # open for base x 2^k, up to open_max_s
    open_max_s: 120
    half_open_successes: 2
    ttft_outlier_factor: 5     # a first token this many x slower than the median is a failure
    ttft_outlier_min_s: 1
  outlier:                     # Envoy's outlier ejection
    enabled: true
    consecutive_5xx: 5
    interval_s: 10
    base_ejection_time_s: 30
    max_ejection_time_s: 300
    max_ejection_percent: 10
    always_eject_one_host: true
  admission:                   # per pool: in-flight slots, then a priority/deadline queue
    enabled: true
    max_in_flight: null        # per pool; null: 256 per endpoint (vLLM's default max_num_seqs)
    max_queued: 1024           # 429 with Retry-After beyond
    max_queued_per_tenant: 256
    queue_timeout_s: 30        # longest wait of a request with no deadline
    knee_wait_s: 2.0           # past it (every engine this far behind) new tasks wait here
    knee_max_wait_s: 10        # ...for at most this long, then 429 with Retry-After
    refuse_predicted_late: true  # 429 before any attempt when the best endpoint is
                               #  predicted to finish after the request's deadline
    tenants: {}                # e.g. {batch: {weight: 0.5, max_priority: 3,
                               #  max_cost_usd: 0.002}}
  failover:                    # resume a broken stream on another endpoint
    enabled: true
    max_resumes: 2
  throttle:                    # client-side adaptive throttling (SRE book)
    enabled: true
    k: 2.0
    window_s: 120
  slow_start:                  # recovered / new endpoints ramp up (Envoy's slow start)
    enabled: true
    window_s: 60
    aggression: 1.0
    min_weight_percent: 10
    yield_queue_s: 0.1         # ...but a ramp gives way once the others queue this long
  slow_abandon_factor: 3.0     # abandoned at > 3x the pool's s/token: counts as a failure
telemetry:
  tracing:
    otlp_endpoint: null        # e.g. otel-collector:4317
    insecure: true
    sample_ratio: 1.0
    service_name: meshd-sidecar
    headers: {}
  access_log:
    path: null                 # JSON lines for `meshd cost`
    max_bytes: 104857600
    backups: 5
  metrics:                     # label caps: later tenants/models read "other"
    max_tenant_labels: 16      # configured admission tenants are kept over the cap
    max_model_labels: 32       # the pools' models are kept over the cap
  prices_usd_per_gpu_hour: {}  # e.g. {H100: 2.5}
control_plane:
  addresses: []                # host:port of each `meshd control-plane` replica
  shards: []                   # or [[shard-0 replicas...], [shard-1 ...]]: followed all
  node_id: ""                  # default: the host name
  tls: null                    # {ca_file, cert_file, key_file} for mTLS
  stale_after_s: 10
  ack_pace_s: 0.02             # engine state ACKed at most this often (0: each at once)
  frames: true                 # over the advertised frames port, not gRPC, where it answers
drain:
  grace_period_s: 30           # SIGTERM: streams get this long to finish
response_cache:               # exact-match answers (README: Response cache)
  enabled: false
  store: memory                # or redis (shared by every sidecar; down = bypassed)
  max_bytes: 67108864          # memory store: LRU over this many bytes
  max_entry_bytes: 1048576     # larger answers are not stored
  ttl_s: 600
  coalesce: true               # identical requests in flight: one goes to the engine
  max_waiters: 64              # ...and at most this many wait for its answer
  partition_headers: [authorization]  # besides the tenant, part of the key
  redis: null                  # {url: "redis://cache:6379/0", key_prefix: "meshd:rc:",
                               #  timeout_s: 0.05, retry_after_s: 5}
log_level: info
"""
