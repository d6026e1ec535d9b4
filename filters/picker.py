"""The prefix-affinity picker: scores every eligible endpoint in seconds and dollars and
returns the primary plus ordered fallbacks, each with its reason. Sans-I/O: time comes in.

The model
---------
For a request with P prompt tokens (estimated), M max output tokens, priority p, and an
endpoint e (GPU profile from filters/gpu.py, `n` GPUs, the served model's `speed_scale`)::

    r          = running sequences on e        (max of reported and local)
    tps_e      = prefill_tps(gpu) * n * speed_scale * (1 - r / B)   B = max_num_batched_tokens
    cal_e      = EWMA of observed / predicted TTFT compute time on e, its thin evidence
                 filled in from its GPU class (below)
    step_e(b, K) = dcal_e * (base + per_seq * b + kv * K) / n     one engine iteration at
                 batch b holding K context tokens (GpuProfile.decode_step_parts: the KV
                 the step streams); dcal_e = EWMA of observed inter-token latency / this
                 prediction (EndpointState.decode_ratio); K_e the context held there
                 (prompts + half the outputs in flight, or the report's KV used)
    C_e        = expected cached prompt tokens: PrefixIndex match x tokens per block
                 (PickRequest.tokens_per_block for engine token blocks, else the config's),
                 approximate blocks x approx_confidence (1.0, below), x the endpoint's trust
                 (silence, demotion), plus for the task's previous endpoint its previous
                 output (see below)
    U_e        = P - C_e                                            tokens to prefill (>= 1)
    W_e        = U_e * (1 + a * (C_e + (U_e + 1) / 2))    the prefill's work in tokens of
                 the linear layers': each new token attends to all before it (a = 3.27e-5,
                 the reference model's; GpuProfile.prefill_work)
    queue_e    = cal_e * Q_e / tps_e + max(1, cal_e) * step_e + slot_wait_e
                 Q_e: uncached prompt tokens already waiting there (the step's floor:
                 below); slot_wait_e when running + waiting exceeds
                 max_num_seqs: the excess fraction of a request residence time
    kv_wait_e  = kv_wait_weight * max(0, U_e + M - free_kv_e) / kv_capacity_e * residence_e
                 (memory headroom: the engine admits us once that much KV has turned over;
                 kv_wait_weight 0 by default, below); free_kv_e = capacity less ours in
                 flight and the other clients' share of the last report's KV in use
    cold_e     = model_cold_load_s if the weights are not warm, + lora_cold_load_s if the
                 adapter is not loaded (an endpoint that cannot serve it is ineligible)
    TTFT_e     = cold_e + queue_e + kv_wait_e + cal_e * W_e / tps_e
    cost_e     = price_per_s(gpu) * n * (cal_e * W_e / tps_e + cold_e)
                 + price_per_s(gpu) * (min(M, S_e) * decode_step(gpu, b_e) / b_e
                                       + max(0, M - S_e) * decode_step(gpu, 1))
                 b_e = min(64, running + waiting + 1): the batch this request joins
                 S_e = the output tokens that batch lasts: the mean max_tokens of our
                       requests in flight there (inf when none are ours; 0 when idle)
    D_e        = M * step_e(r + 1, K_e + X) + r * min(M, S_e) * dstep_e
                 X = P + M / 2, dstep_e = dcal_e * (per_seq + kv * X) / n: the request's
                 own output at the step of the batch it joins, plus the delay it adds to
                 each of the r streams there, a slower step for as long as both decode
    I_e        = r * W_e * inv_e: the delay its prefill adds to those streams (the engine
                 interleaves its chunks with their steps; inv_e = cal_e / tps_e)
    J_e        = kappa * cost_e + lambda_r * TTFT_e + lambda(p) * decode_weight * D_e
                 + lambda(p) * prefill_delay_weight * I_e
                 lambda(p) = lambda_usd_per_s * base**(p - 5); kappa = 1 for an elastic
                 pool, FIXED_COST_WEIGHT (0.1) for a fixed fleet (the default)
    lambda_r   = lambda(p) * 2**-k,  k = floor(log2(knee / t0)) when t0 < knee, else 0
                 t0 = decode_step(H100, 1) + W(P, 0) / prefill_tps(H100): the request's best case
                 (an idle reference GPU, nothing cached); knee = lambda_knee_s

The prefill checked against the engine (2026-12-07, virtual clock; the engines' usage
and first tokens against Choice's prediction, agentic tasks on 4 H100s nobody described):
a follow-up step was predicted to prefill 2,182 tokens (p50) where the engine prefilled
272, so its TTFT was predicted 14x too long (actual / predicted p50 0.07). Two errors did
it. The text's ~3.2 characters a token make every prompt and every matched prefix ~1.26x
long in our 4-characters-a-token estimate (P 9,712 against the engine's 7,680), and the
approximate index counted a matched block at 0.8: that cancelled the length error in the
cached part (8,000 tokens predicted, ~7,400 cached) but left P - C_e at a fifth of the
prompt instead of a few per cent. At approx_confidence 1.0 the estimate errs by the text's
ratio alone (432 predicted against 272), and the cached-token feedback (observe_cached)
and LRU eviction against the learnt capacity, not a discount, answer for what the engine
dropped. And a prompt's prefill is not linear in its tokens: attention makes the
simulator's H100 prefill 2,048 tokens at 26.5k tok/s, 12,672 at 22.9k and 50,000 at
15.3k (the datasheet table's 27.7k is the linear part), so the prediction now prices W_e
(above), and the calibration learns the engine's speed, not the mix of lengths it saw.
Together, against the previous defaults on 8 matrix cells (one run, meshd given URLs only
/ the best peer, before -> after): Mooncake 8 H100 hit rate 0.91 -> 1.07, TTFT p90 0.91 ->
0.96, p99 0.97 -> 0.92; sessions 8 H100 TTFT p90 0.89 -> 0.79, E2E p50 0.83 -> 0.71, hit
rate 1.01 -> 1.06, next turns kept 0.95 -> 1.00, makespan p50 0.92 -> 0.84, wasted share
0.56 -> 0.30; sessions without headers at 1.5x load task success 17.3 -> 22.3x, wasted
0.50 -> 0.40; agentic 8 H100 TTFT p99 0.94 -> 0.78, E2E p50 0.95 -> 0.98; agentic on 4 H100
+ 4 A100 nobody described p99 1.03 -> 0.93, E2E p50 0.92 -> 0.99; shared-prefix p99 1.10
-> 1.06; Azure 8 H100 TTFT p90 1.01 -> 0.96, p99 1.04 -> 0.90; Azure mixed p90 1.15 ->
0.99, p99 0.88 -> 0.94, E2E p50 1.01 -> 1.02. The attention term alone: Azure 8 H100 p90
0.96, p99 0.90, E2E 1.00; mixed 0.99 / 0.94 / 1.02. Over the whole matrix (54 cells,
docs/routing-matrix.md): cells missing a target 154 -> 150, geometric means of meshd /
best peer new / old TTFT p90 x0.959, p99 x0.956, E2E p50 x0.953, hit rate x1.013, task
success x1.029, wasted share x0.703; worse: Mooncake on the mixed fleet's hit rate 1.23 ->
1.05 and agentic tasks on 4 H100 E2E p50 0.96 -> 1.03. Tried with them and dropped: counting
a calibration's evidence by the samples taken instead of the requests finished (follow-ups
give no sample, so an engine serving sessions keeps its class's prior): agentic 8 H100
TTFT p99 3.63 (13 "overloaded" departures instead of 2, each recomputing ~9k tokens,
once the learnt speed made the recompute look short), 0.84 with affinity_imbalance 5,
but Azure mixed E2E 1.09 and Mooncake hit rate 0.94; and, on top, no sample from a
prefill that fits inside the batch's memory-bound step (Mooncake hit 0.89).

The whole request (issue #27: "predict the whole request, not only its first token"):
D_e is what the request's output costs in seconds, its own and the streams' it joins,
from a step model that grows with the batch and with the context the batch holds (a
decode step streams every running sequence's KV: 52 ns per token on an H100, so eight
30k-token conversations add 12.5 ms to every step) and is calibrated per engine from the
streams it served (time from first to last token / (tokens - 1) against the step
predicted at dispatch, Choice.step_s), so a GPU nobody named, thermals or a noisy
neighbour show within a few streams. The split step model reproduces the simulator's
within 3% at contexts of 1k-20k (tests/test_picker.py). decode_weight values those
seconds against TTFT's, a value judgement with a measured price. Matrix cells on the
virtual clock (2026-12-06), meshd given URLs only / the best peer, at decode_weight 0 /
0.05 / 0.1 / 0.25: agentic tasks on 4 H100 + 4 A100 nobody named, E2E p50 1.28 / 0.93 /
0.92 / 0.92 (the A100s' slower decode, learnt, is priced); Azure's conversations on the
same fleet, TTFT p90 0.76 / 1.07 / 1.26 / 1.34 and E2E p50 0.97 / 1.01 / 1.07 / 1.06 (the
learnt ratios pull open-loop traffic onto the H100s past their prefill balance: the step
model has no term yet for the prefill chunks an engine interleaves, which its streams'
inter-token latency carries and the decode calibration learns only after the fact);
shared-prefix on that fleet TTFT p90 1.05 / 0.96 / 1.42 / 1.45; Mooncake on 8 H100 at 1.5x
load TTFT p90 0.68 / 0.74 / 0.74 / 1.02; sessions without headers on 8 H100 at 1.0x,
makespan p50 11.6 / 12.2 / 9.4 s / (1.24x) (noisy). Default 0.05. I_e (the prefill
stall, prefill_delay_weight) at 0.05 on top of that: Azure on the mixed fleet TTFT p90
1.07 -> 0.78, the sessions cell's makespan 12.2 -> 9.3 s, Azure 8 H100 TTFT p90 0.89; but
Mooncake 8 H100 at 1.0x load hit rate 0.051 -> 0.038 (TTFT p90 3.0 -> 3.6 s), at 1.5x
TTFT p90 0.74 -> 0.95, and over the whole matrix hit rate 0.70x at 4 engines (it pushes
a follow-up's partial match away from a holder with many streams). Off by default.

Fixed or elastic: a fixed fleet's GPUs are paid for busy or idle, so the GPU-seconds a
pick saves are not money; J weighs them at FIXED_COST_WEIGHT, so latency decides and cost
breaks near-ties. An elastic pool (`elastic`, an autoscaler hands idle GPUs back) weighs
them in full; the cost ledger reports both views (filters/cost_ledger.py).

Prefill owns the GPU (compute bound), so the request pays for all of it; decode is shared
by the batch (memory bound), so it pays its share of a step in the batch it joins, capped
at a healthy batch of 64, for as long as that batch lasts; past it the request decodes
alone and pays whole steps. Waking an idle engine pays its whole step, joining a running
batch a fraction of one: traffic packs into batches (busy GPU-seconds are what a fleet
pays for, or what an autoscaler can hand back) until the queueing it adds (in TTFT, valued
by lambda) or the bounded-load rule stops it. (`decode_pricing="reference"` prices every
endpoint at batch 64 instead: no packing pull.) The span S_e counts the partners' whole
max_tokens, not what they have left, so it errs toward the batch lasting; without it a
request joining an H100 whose one partner had 2 tokens to go was priced at half an H100
step a token for all its output (cheaper than a whole A100 step) and ran alone there. Time
spent queueing is paid by whoever is being served. lambda converts seconds into dollars:
at the default 1e-2 $/s a second of TTFT is worth a cent for a standard request, 16x that
at priority 9 and 1/32 at priority 0 (a batch job goes to the cheapest GPU). Measured on
the 16-engine bench (H100 + A100), virtual clock, 2026-12-05, with the knee (below) and
the decode span:

    lambda $/s   mooncake: $/ok task vs RR, TTFT p50/p90/p99 ms   demo seed 0: same
    1e-3         0.67, 11.5 / 40.7 / 107                           0.49, p90 56.7
    5e-3         0.69, 10.8 / 37.2 / 96.0                          0.56, p90 33.4
    1e-2         0.70,  7.5 / 36.9 / 95.9                          0.59, p90 24.8

Below 1e-2 the demo's TTFT p90 grows by a third to double for a few cents' saving, so
1e-2 is the default. (Earlier sweeps, before the knee, the TTL and calibration fixes, are
in git history.)

The knee: what a TTFT costs is judged by its tail, so a request whose first token comes
well inside the tail anyway loses little by waiting a few milliseconds more. The cost of a
TTFT T is taken as Huber-shaped, lambda * T**2 / (2 knee) under the knee and lambda * (T -
knee / 2) over it: a second is worth lambda * min(1, T / knee). The picker prices it at
the request's best case t0 (before the pick, so without its cached prefix: an
over-estimate, which errs toward lambda), rounded up to a power of two (never below that
marginal value). lambda is applied in the hot loop, not kept in the views' per-class
constants, so requests of every priority and best case share them (keyed by the class's
lambda, a 50/50 mix of 16- and 4,000-token prompts over 64 endpoints recomputed them on
every switch: pick p50 / p99 57 / 104-109 us against 44 / 86 without the knee; applied in
the loop, 44 / 84-87 with it). Over the knee nothing changes. Measured on the same bench,
virtual clock, 2026-12-05: the Mooncake trace's prompts of a few tokens (best case ~7.5
ms, lambda / 4) with a few dozen tokens to decode move to A100s (one more step to the
first token, ~4 ms, for 2/3 of the decode price): $ per successful task 0.794 -> 0.704 of
round robin, TTFT p50 / p90 7.5 / 36.9 ms (37.2 before); the demo, shared-prefix and
agentic workloads, whose prompts' best case is over knee / 2, are unchanged; live (the
sidecar over HTTP, same fleet and trace) 0.71, TTFT p50 / p90 / p99 12.0 / 41.0 / 101 ms.
The knee is a value judgement, like lambda: at 0.1 s the demo's ~700-token prompts (best
case ~33 ms) were discounted too, and its TTFT p90 went from 24.8 to 28.5-55.7 ms (seeds
0, 1).

The step has a floor: the first token waits for one engine step, a weight read at HBM
speed, so a calibration under 1 (prefill compute, or our estimate of the tokens left to
prefill, beat the datasheet) does not shorten it; one over 1 (a degraded engine is slow at
everything) lengthens it. Under 1 the step is fixed time in what calibration learns from
(Choice.fixed_s), over 1 calibrated work (nominal_s). Without the floor the H100s of the
16-engine Mooncake bench (calibrated to 0.36-0.62, mostly by prefix hits whose uncached
tokens the index overestimates) promised a 1-token prompt its first token in 5.8 ms
(8.3 observed; the A100s 11.8 for 12.6), so the trace's decode-heavy requests with almost
no prompt stayed on H100s, whose decode step at batch 1 costs 1.5x an A100's ($6.2e-6
against $4.2e-6 a token): $ per successful task 0.82 of round robin without the floor,
0.795 with it (TTFT p90 37.1 and 37.2 ms, virtual clock).

Decision
--------
1. Eligible: not draining, breaker closed, not ejected, reported healthy (when fresh),
   serves the model and adapter, passes the optional `eligible` hook.
2. Deadline (`x-meshd-deadline-ms`: the whole answer's, as a client or an agent's task
   budget means it): endpoints whose TTFT_e alone misses it are dropped (a necessary
   condition; dropping those whose TTFT plus max_tokens at their decode step missed it
   moved more sessions off their engine and measured worse on the matrix's 9 sessions
   cells, 2026-12-06: cells missing a target 29 -> 35, TTFT p99 x1.11, task success
   x0.96); if all miss, the answer is every eligible endpoint by TTFT, each with reason
   "deadline-unmeetable",
   the affinity holder (below) first: moving would recompute its prefix for a request
   that is late anyway (on the matrix's Mooncake sessions, 8 H100s at load 0.8, this
   took next turns kept 0.80 -> 0.92 and makespan p50 1.14x -> 0.97x cache_aware's).
3. Bounded load (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads",
   SODA 2018, arXiv:1608.01350): with loads L (requests or tokens in flight), capacity
   weights w_e = the requests e turns over, which its decode speed sets (the reference
   H100's prefill tok/s x the GPUs' decode step at a batch of 64 relative to the H100's:
   an A100 0.64) x ramp_e (the slow-start weight in (0, 1] of a newly healthy endpoint,
   EndpointState.ramp), and this request's load x, e may be primary
   only if L_e + x <= (1 + epsilon) * (1 + cached_headroom * C_e / P) * w_e * (sum L + x)
   / sum w, or L_e <= load_floor * its nominal prefill tok/s x ramp_e / the H100's (below
   the floor an engine just batches one more). If none may, the bound is ignored. The
   weights were the prefill datasheet's (an A100 0.32): told a mixed fleet, meshd held the
   A100s to a third of the H100s' requests (53 against ~197 each on Azure's conversations)
   while the H100s queued, though a request's time there is mostly decode, 1.7x faster on
   an H100, not 3x. Virtual clock, 2026-12-07, meshd told each GPU / the best peer, 4 H100
   + 4 A100, before -> after: Azure conversations TTFT p90 1.87 -> 1.27, p99 1.33 -> 0.97,
   E2E p50 0.97 -> 1.00; Mooncake p99 0.40 -> 0.37, E2E 0.75 -> 0.73, hit rate 0.65 ->
   0.57; sessions E2E 0.59 -> 0.56, makespan 0.31 -> 0.29, wasted 0.34 -> 0.30, TTFT p90
   0.09 -> 0.10; shared-prefix max/mean 2.31 -> 2.00; agentic unchanged. Fleets of one
   GPU class (and fleets nobody described) route as before, a weight common to all
   cancelling, up to a tie at the bound's edge (Azure on the mixed fleet not told: p99
   0.94 -> 0.88, the rest the same). An endpoint holding C_e of the prompt's P
   tokens has that much more headroom (cached_headroom 1): the work a request brings there
   is only its uncached part, and sending it elsewhere recomputes the prefix and copies it
   into another cache. On the matrix's shared-prefix cells (16 system prompts of 1,024
   tokens, each a hub that no one holder owns) the bound had sent a group's questions off
   the engines holding its prompt whenever those carried more than 1.25x the mean: 80 of
   2,000 requests missed on 16 H100s (cache_aware 16). With the headroom (virtual clock,
   2026-12-06, meshd / best peer): TTFT p99 1.64 -> 1.42 (16 H100), 1.06 -> 0.99 (4),
   1.15 -> 1.10 (8), 1.18 -> 0.72 (4 H100 + 4 A100), hit rate 0.94-0.97 -> 0.99 in each;
   the agentic cells' new tasks gather a little more behind their tool prompt: TTFT p90
   0.73 -> 0.77 (8 H100), 1.73 -> 1.81 (mixed, its p99 2.27 -> 2.78, E2E p50 0.96 ->
   0.93); Mooncake, Azure and the sessions cells unchanged. At 0.5: shared-prefix mixed
   p99 1.13, agentic mixed p99 2.27. Slow start yields while the pool queues: a ramping
   endpoint over its ramped share may still be primary, up to its full weight's share,
   once no endpoint at full weight could start this request's prefill within
   ramp_yield_s (0.1 s). The ramp shields a cold cache from a herd, not a queueing pool
   from the capacity it waits for (loadtest/rewarm_bench: 4 cold H100s joining 4
   overloaded ones, TTFT p99 after the scale-up 7.12 s with the ramp binding, 4.83 s
   without slow start, 4.81 s yielding; virtual clock, 2026-12-06).
4. Affinity (routing v2, below): the request's holder, the task's previous endpoint
   ("sticky") or else the endpoint with the longest cached prefix when that covers at
   least affinity_min_fraction of the prompt ("prefix-affinity"), is the primary unless
   it departs for a counted reason.
5. Otherwise, in order: for a hot prefix group whose demand exceeds what its holders
   serve, the best endpoint not yet holding it ("replicate", below); else weighted rendezvous
   hashing (Thaler & Ravishankar 1998; each endpoint draws -ln(u)/w_e from the hash of
   the group key and its name, the lowest wins, so each wins keys in proportion to w_e)
   over the endpoints within the bound whose J exceeds the best's by at most cold_tolerance
   x the best's J less its decode cost (the part a cached prefix changes), what a
   candidate's decode calibration adds to its decode cost over the best's forgiven when
   within decode_tolerance of it (learnt decode speeds that close are equals: the
   calibration's noise) ("cold-hash":
   distinct cold groups spread over comparable engines, and many clients agree on one
   engine without talking). A prefix cached somewhere takes part too: when what it saves
   is under the window (a shared chat-template header) the hash decides; when it saves
   more, the holder is alone in the window ("prefix-affinity"). Within the window the
   least loaded per unit of capacity weight goes first, its load counting home_weight
   (1) per cold prompt homed there lately, decaying over home_window_s (30 s): a new
   session's first step brings follow-ups later, and between steps a session has nothing
   in flight, so load alone sent new sessions where a dozen had just started (8 H100s,
   64 new sessions a second apart, none in flight: 8 an engine with homes, 3 to 16 by the
   hash alone; tests/test_picker_spread.py; over the whole robustness matrix, homes off:
   TTFT p90 x1.014 and 3 more cells missing it, sessions' makespan x0.970 and wasted
   x0.947, docs/routing-matrix.md). With no block hashes at all, the lowest J
   ("least-cost"). Fallbacks follow by J: within the bound
   ("fallback"), then over it ("over-load-bound"). Ties: lower J, then endpoint name.
6. Speculation: the primary is recorded in the PrefixIndex and the task map at pick time
   (with `record` false, when the driver dispatches there: a split request's prefill
   pool, whose decider may serve it elsewhere; Picker.order_decode's decode legs).

Affinity. Found from the outside (issue #27), on real multi-turn traffic this picker kept
43% of a conversation's next turns on the engine that served the previous one, where the
peers' cache_aware rule (filters/cache_aware.py) keeps them all: its J sent each turn to
whichever engine its prediction liked, and the prediction charged the holder a prefill
queue that never drained. A follow-up step is a prompt found in the prefix index: no
header is needed, a task id only names the holder when the index has let it go. A hub is
not a request's history: when more prompts extend the matched prefix than the pool has
endpoints (PrefixIndex.fan_out: a shared tool or system prompt), there is no holder and
the bounded-load rule and J place the request (on the matrix's agentic cells, new tasks
had gathered behind the 2,048-token tool prompt on the engines that saw it first: 4
H100s served 273 / 266 / 53 / 12 requests; A/B, meshd / best peer, TTFT p99 1.32 ->
0.85, E2E p50 1.02 -> 0.93, max/mean 2.45 -> 1.19; shared-prefix p99 0.99 -> 1.13; the
Mooncake and sessions cells unchanged. Without the fan-out bound, every branch point
dropped the holder and Mooncake's hit rate fell 0.92 -> 0.28x). Sessions start at a hub: a
new session's first step behind a hub (a task id the picker has not seen, or, with no
header, a prefix group whose picks mostly continue an earlier prompt from where it ended:
_Group.follow >= session_share, 0.5) is priced as if every candidate held the hub. Its
later steps stay where it starts and every engine will hold the hub anyway, so the engine
that saw the tool prompt first must not win every new task: load, homes and the rendezvous
hash choose (the prediction and the calibration keep what each engine holds). A standalone
question behind a shared system prompt (nothing in its group continues) still goes where
the prompt is, even with a task id of its own once its group has shown that its tasks do
not go on (FOLLOW_MIN_PICKS picks, a follow share under FOLLOW_NONE). Found on the
matrix's agentic tasks on 4 H100s: every task went to the two engines that first held the
tool prompt (308 and 296 requests, two engines idle; E2E p50 1.03x round robin's). Virtual
clock, 2026-12-07, meshd given URLs only / the best peer, before -> after: agentic 4 H100
E2E p50 1.03 -> 0.94, makespan p50 1.01 -> 0.95, max/mean 2.04 -> 1.38, TTFT p90 0.87 ->
0.82; 8 H100 E2E 0.98 -> 0.92, makespan 0.95 -> 0.92, max/mean 2.38 -> 1.80; 16 H100 E2E
0.89 -> 0.84; 4 H100 + 4 A100 nobody described E2E 0.99 -> 0.89, makespan 0.86 -> 0.77,
TTFT p99 0.93 -> 0.77, max/mean 2.89 -> 1.89; at load 0.5 makespan 1.00 -> 0.91, at 1.5
E2E 0.98 -> 0.92; the sessions, Mooncake and shared-prefix cells unchanged. Among
endpoints holding it equally, one within the bounded-load rule, then the lowest J. The
holder departs when, in order: a hot group replicates (the demand rule below); it misses
the deadline ("deadline"); its load exceeds affinity_imbalance (3.0) x its share of the
pool's load by capacity weight, above the load floor, and another endpoint is predicted
to end this request no later, its TTFT with the recompute plus its output at that
engine's decode step with one more sequence ("overloaded", the bounded-imbalance rule:
concentration only where it is faster for the request; as a hard cap it recomputed a
15k-token agent step beside a holder with five decoding streams, and the matrix's agentic
TTFT p99 went 1.18 / 2.49 / 3.86x -> 0.81 / 1.32 / 0.84x the best peer's at 8 engines / 4
engines / load 1.5, max/mean requests per engine 1.74 / 1.81 / 1.46 -> 1.84 / 2.45 /
1.75); or another endpoint's predicted TTFT beats the holder's by more than
max(affinity_margin_s, R x (affinity_redo_weight + W)), R the seconds that endpoint
would spend prefilling what the holder has cached and W the requests waiting there
("faster-elsewhere": the move's cost is paid by the request and, as delay, by the queue
behind it). Departures are counted (Picker.departures, the router's Route.departure).
The prediction's prefill queue drains with time: a view's queue is less the seconds
since the engine's queue head last changed (EndpointState.prefill_since). Measured on the
virtual clock, Mooncake conversations as closed-loop sessions without headers, 8 H100s
with ~20 prompts of KV each, no deadlines (2026-12-06, the sidecar's defaults: reference
decode pricing): next turns kept 0.47 -> 0.94, token hit rate 0.050 -> 0.120
(cache_aware 0.127), task makespan p50 7.1 -> 5.6 s (cache_aware 6.1), E2E p50 3.3 ->
3.0 s (cache_aware 3.6), TTFT p90 2.30 -> 2.12 s (cache_aware 2.11).
affinity_redo_weight 1 -> 2 on the matrix's sessions cell (load 0.8): kept 0.78 -> 0.88,
TTFT p90 3.99 -> 3.72 s. 2 -> 8 once the matrix's sessions came from the whole trace (a
third of the requests follow-ups; 8 H100s, small caches, load 0.8): kept 0.87 -> 0.98,
hit rate 0.481 -> 0.503, TTFT p90 2.47 -> 2.39 s, task success 0.809 -> 0.836 (cache_aware
1.00, 0.507, 2.15 s, 0.834): a departure that won this request a few tenths of a second
recomputed the session's prefix elsewhere, and the queue it then made, and the copy it
evicted, cost the requests after it more (TTFT p90 was worse, not better). Cold-prompt
homes on top (same cell): TTFT p90 2.39 -> 2.13 s, task success 0.836 -> 0.876, kept
0.96. Over 18 cells (the 9 sessions cells and one of each other workload, virtual clock,
2026-12-06), against the previous defaults, geometric means of meshd / best peer: TTFT
p90 x0.96, E2E p50 x0.96, hit rate x1.04, task success x1.07, makespan p50 x0.96 (redo
weight 8 alone: x1.00, x0.99, x1.01, x1.05, x1.00); cells missing a target 74 -> 57.

The prefix index's capacity is learnt (observe_cached): it starts at INDEX_CAPACITY_START
(4) x the capacity the engine (its /metrics, a report) or the config gives, else x the
default GPU's, x1.1 when the engine
answers with cached tokens for a prefix the index had dropped, x0.9 on a ghost (fewer
than half the predicted), within 0.25-8x. A ghost's entry is not cut: the request was just
prefilled there, so the engine holds it now. Measured (same bench, open loop, ~200
prompts of KV per engine): hit rate 0.076 -> 0.169 (cache_aware 0.172). Ghosts show on
every request routed on one; a prefix the index dropped too early shows only if some
request still goes where it is held, so the scale learns down far more than up, and a
told capacity starts as generous as a guess. Measured once the virtual clock read the
engines' /metrics as a live sidecar does (2026-12-07, the memory wait below still on;
meshd given URLs only / the best peer, hit rate at a told start of 1 / 2 / 4 / 8):
Mooncake 8 H100 0.78 / 0.94 / 1.07 / 1.03, 4 H100 0.71 / 0.78 / 0.82 / 0.92, 16 H100
0.83 / 0.91 / 0.89 / 0.86, at load 0.5 0.94 / 0.95 / 1.04 / 0.98 (TTFT p90 within 0.04
across them). The whole matrix at 4 with the memory wait off (docs/routing-matrix.md,
session 22): 8 H100 1.07, 4 H100 0.86, 16 H100 0.87, load 0.5 1.04.

An engine whose answers carry no cached tokens (a vLLM without
--enable-prompt-tokens-details; a streaming client that asked for no usage) gives the
per-answer rule nothing; its /metrics still counts them (vllm:prefix_cache_hits and
queries, read by the probe). observe_engine_hits holds the two pages' difference against
the hit rate the index predicted for the requests sent there meanwhile (each a rate in its
own tokens), once HIT_CHECK_MIN_REQUESTS went, and steps the capacity by the same factors
where the engine's rate is under HIT_CHECK_LOW x the predicted or over HIT_CHECK_HIGH x it
(plus HIT_CHECK_SLACK); the error (predicted - engine's) is meshd_prefix_index_hit_error
either way. It acts only for an engine that never detailed its cached tokens: stepping on
both sources (2026-12-07, answers with cached tokens, Mooncake 8 H100) took hit rate
1.075 -> 1.022 of the best peer, and 4 H100 stayed 0.864. Measured with the answers
stripped of usage (matrix --override '{"usage": "none"}', 11 cells, without / with the
check): Mooncake 8 H100 TTFT p90 0.98 -> 0.96, p99 1.06 -> 0.92, hit 1.03 -> 1.07 (with
usage: 0.94, 0.92, 1.075); load 0.5 p99 1.09 -> 1.00; load 1.5 p90 0.93 -> 0.86; geometric
means TTFT p90 x0.989, p99 x0.976, hit x1.004; cells missing a target 25 -> 23.

The memory wait (kv_wait_e) is off by default (kv_wait_weight 0). With the engines' real
capacity from /metrics (the matrix's small caches hold ~10-20 prompts) it priced our own
in-flight prompts and their whole max_tokens (4 characters a token: ~1.25x the engine's
count) against it, with the request's whole residence (queue included) as the turnover
time: 3-6x the memory actually waited for, so admission's knee gate (pool_wait) held new
tasks in meshd for up to 8.5 s while the engines had room. Virtual clock, Azure
conversations, TTFT p99 meshd / best peer at weight 1 / 0: 4 H100 2.67 / 1.23, 8 H100
1.16 / 0.90, at load 1 1.52 / 1.25, mixed 1.35 / 0.94 (at 0 the same figures as before
the probe); the turnover measured from the first token instead of the dispatch and half
the max_tokens as held still left 4 H100 at 2.06, and the knee without the memory term
(pick still pricing it) TTFT p90 1.10-1.19 where 0 gives 0.95-1.04.

Replication (after Preble, Srivatsa et al., "Preble: Efficient Distributed Prompt
Scheduling for LLM Serving", arXiv:2407.00023): requests are grouped by the hash of their
first `group_blocks` blocks; each group's demand is an exponentially weighted rate of the
GPU-seconds its requests need on a reference H100 (prefill of what the best holder has not
cached, plus decode at batch 64), time constant `demand_window_s`. Holders are endpoints
whose match covers the group prefix; they can serve replicate_utilisation x their speed
relative to the reference. When demand exceeds that, the next request of the group goes to
the best non-holder, which then holds it; so the group spreads one engine at a time, and
only while it is hot. The queueing term does the same reactively (a holder whose queue
outweighs the saved prefill loses on J), which is what stops the cache-aware "death
spiral" of piling every request onto the one engine with the cache.

Calibration pooling: cal_e learns only from requests e served, so an endpoint that turned
out faster than its datasheet would keep winning over identical peers never tried (they
stay at 1.0) and traffic would never spread. ttft_ratio is an EWMA from 1.0: after n
samples (requests dispatched there and finished) the start still weighs d = (1-alpha)**n.
The picker pools, per GPU class, the evidence-weighted mean of what the samples said,
prior = sum(ratio - d) / sum(1 - d), and uses cal_e = ratio_e + d_e * (min(1, prior) - 1):
an untried endpoint is expected to be as fast as its class has shown, and never slower
than its datasheet (one degraded peer does not condemn the rest untried).

Faults (issue #21's campaign, loadtest/chaos.py): what the picker believes of an engine
must not outlive the fault. (1) Evidence ages while an engine is shunned: a TTFT or
decode calibration with neither a sample nor a request sent there for
CALIBRATION_STALE_S (5 s) moves back toward 1.0, its log halving every
CALIBRATION_HALF_LIFE_S (5 s), and the next sample weighs up to 0.5 as the old evidence
fades (EndpointState.age_calibration): an engine 10x slow for 6 s was sent nothing in the
30 s after it recovered; now it is back ~22 s after (the calibration's 2.16 must fade
to within decode_tolerance of its peers'). (2) A refusal (429, or 503 before any byte)
holds the engine for its Retry-After, else 0.5 s doubling per refusal in a row up to
8 s, counted as queue (EndpointState.refused): a fast refusal looked idle and stayed the
first pick (one engine at 503: 1.23 -> 1.13 attempts per request during the fault; a
no retry when every endpoint left is held, Attempts._all_held). (3) A queue that has given no
first token for OVERDUE_FACTOR (3) x its predicted time plus OVERDUE_MIN_S (1 s) is late;
the lateness counts as queue (a hung engine's queue was taken to drain by the clock).

Workflow context: the task's previous step (per context key: workflow, session or task id;
a bounded LRU with a TTL) left its prompt's blocks in the index and its output in the
engine's cache; when this request's match on that endpoint covers the previous prompt,
the previous output (sticky_output_fraction x its max_tokens) counts as cached there too.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import Literal, NamedTuple

from filters.blockhash import xxh64
from filters.endpoint_state import (
    CALIBRATION_AGE_STEP_S,
    CALIBRATION_ALPHA,
    CALIBRATION_RANGE,
    EndpointState,
)
from filters.gpu import GPUS, GpuTable, normalise_gpu_name
from filters.prefix_index import PrefixIndex
from filters.request import CHARS_PER_TOKEN, InferenceRequest, estimate_prompt_tokens
from filters.routing_headers import RoutingHeaders

__all__ = ["Choice", "PickRequest", "Picker", "PickerConfig"]

_M64 = 0xFFFFFFFFFFFFFFFF
# The reference GPU for demand accounting (group replication).
_REF = GPUS["H100"]
# Bounded load's comparisons allow this relative slack: loads are counts, so a load at
# exactly its share is common (4 engines, 48 requests with this one, epsilon 0.25: a share
# of 15, computed 14.999999999999998 from H100 weights summed in float), and which side of
# it the float landed moved with the weights' scale. b23a00b's decode-speed weights moved
# that last bit for fleets nobody described, and with it the Mooncake cells (4 H100s: hit
# rate 0.94 -> 0.77x the best peer, 8: 1.07 -> 0.91x; virtual clock, 2026-12-07), where
# the commit meant a common weight to cancel.
_BOUND_TIE = 1.0 + 1e-9


def _fits(load: float, share: float) -> bool:
    """Bounded load's test: `load` within `share`, a load exactly at it included however the
    share's float rounded (_BOUND_TIE)."""
    return load <= share * _BOUND_TIE


# Decode is priced at this batch size: a healthy engine's steady state.
DECODE_REF_BATCH = 64
_REF_DECODE_64 = _REF.decode_step_s(DECODE_REF_BATCH)
_REF_DECODE_TOKEN_S = _REF_DECODE_64 / DECODE_REF_BATCH
# A request's best case first token: one step of an idle reference GPU, plus its prompt
# at the reference prefill speed (lambda_knee_s).
_REF_STEP_S = _REF.decode_step_s(1)
# Prefill of `uncached` tokens after `cached` ones in tokens of linear work, attention
# included: the reference model's (a model property, not the GPU's).
_work = _REF.prefill_work
_ATTN_PAIR = _REF.attn_pair_tokens  # _work's own, for its copies in line
_REF_PREFILL_TPS = _REF.prefill_tokens_per_s


# Bound on remembered (model, adapter) classes: model names come from clients.
MAX_REQUEST_CLASSES = 1024
# Bound on remembered rendezvous draws (one float per group key x endpoint name).
RENDEZVOUS_CACHE_SIZE = 65_536
# ttft_ratio is an EWMA from 1.0: after n samples the start still weighs _CAL_KEEP ** n.
_CAL_KEEP = 1.0 - CALIBRATION_ALPHA
# A GPU class's pooled calibration counts once its endpoints hold this much evidence
# (sum of 1 - _CAL_KEEP ** n: about three samples).
CAL_MIN_EVIDENCE = 0.25
# An endpoint whose own evidence weighs less than 1 - this is "unsettled": its view is
# rebuilt when its class's pooled calibration moves by more than CAL_PUSH_STEP.
_CAL_SETTLED = 0.02
CAL_PUSH_STEP = 0.02
# The prefix index's capacity per endpoint is learnt from the engine's cached-token
# counts (Picker.observe_cached): x1.1 on a hit the index had dropped, x0.9 on a ghost,
# within these factors of the assumed KV capacity. An engine whose capacity nobody gave
# (config, report) starts high: a ghost is found out by the next request that goes there,
# an entry dropped too early never is.
INDEX_CAPACITY_GROW = 1.1
INDEX_CAPACITY_SHRINK = 0.9
INDEX_CAPACITY_SCALE_RANGE = (0.25, 8.0)
INDEX_CAPACITY_START = 4.0
# An engine that does not detail cached tokens per answer (vLLM without
# --enable-prompt-tokens-details, a client that did not ask for usage) still counts them
# on its /metrics (vllm:prefix_cache_hits / queries): Picker.observe_engine_hits compares
# that hit rate with the one the index predicted for the requests sent there, once the
# window holds HIT_CHECK_MIN_REQUESTS of them, and scales the index capacity by the step
# above when the engine's rate is under HIT_CHECK_LOW x the predicted (ghosts) or over
# HIT_CHECK_HIGH x it plus HIT_CHECK_SLACK (entries dropped that the engine kept); a
# difference under HIT_CHECK_SLACK either way is no verdict.
HIT_CHECK_MIN_REQUESTS = 8
HIT_CHECK_LOW = 0.75
HIT_CHECK_HIGH = 1.33
HIT_CHECK_SLACK = 0.02
# A prompt whose blocks some endpoint holds at least this share of continues a task under
# way (Picker.follow_up: admission lets it past the knee before new tasks).
FOLLOW_UP_FRACTION = 0.5
# An endpoint whose queue has given no first token for OVERDUE_FACTOR x its predicted
# queue, plus OVERDUE_MIN_S, is late; the lateness counts as queue (Picker._view), and
# its view is looked at again every OVERDUE_STEP_S while it lasts. (Issue #21's hung
# engine: its queue was taken to drain by the clock, so it stayed a first pick and each
# request there waited for the first-byte timeout.)
OVERDUE_FACTOR = 3.0
OVERDUE_MIN_S = 1.0
OVERDUE_STEP_S = 0.5
# The weight of one pick in a prefix group's share of picks that continue a session
# (_Group.follow: an EWMA over about ten picks).
FOLLOW_ALPHA = 0.1
# After FOLLOW_MIN_PICKS picks a group whose follow share is under FOLLOW_NONE has shown
# that its tasks do not go on: a new task id there no longer starts a session at a hub.
FOLLOW_MIN_PICKS = 20
FOLLOW_NONE = 0.1
# A fixed fleet's cost weight in J (PickerConfig.elastic false): its GPUs are paid for
# whether busy or idle, so a dollar of GPU time counts this much against latency.
FIXED_COST_WEIGHT = 0.1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit score for rendezvous hashing."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class PickerConfig:
    lambda_usd_per_s: float = 1e-2  # value of one second of TTFT at priority 5
    lambda_priority_base: float = 2.0  # lambda multiplies by this per priority step
    # TTFT under which a second is worth less, in proportion (module docstring; None: off).
    lambda_knee_s: float | None = 0.05
    default_priority: int = 5
    tenant_priority: Mapping[str, int] = field(default_factory=dict)
    load_metric: Literal["requests", "tokens"] = "requests"
    epsilon: float = 0.25
    # Bounded load's extra headroom for an endpoint holding part of this prompt: x the
    # share it holds (module docstring, Decision 3).
    cached_headroom: float = 1.0
    load_floor: float | None = None  # per H100-equivalent; default 8 requests / 16,384 tokens
    cold_tolerance: float = 0.1  # relative J window for rendezvous hashing of cold prefixes
    # ...widened by this share of the best's decode cost (learnt decode speeds this close
    # are equals: the calibration's noise; PickerConfig docstring of _cold_hash).
    decode_tolerance: float = 0.1
    # Affinity (module docstring): a prompt this much cached at one endpoint (a follow-up
    # step) stays there, unless that endpoint's load is over affinity_imbalance x its fair
    # share of the pool's, or another is predicted faster by more than the margin:
    # max(affinity_margin_s, the seconds the other would spend recomputing the prefix, x
    # (affinity_redo_weight + the requests waiting there), since they wait for it too).
    affinity_min_fraction: float = 0.3
    affinity_imbalance: float = 3.0
    affinity_margin_s: float = 0.05
    affinity_redo_weight: float = 8.0
    # Cold-prompt homes (module docstring, 5): a cold prompt (a new session's first step)
    # counts against its endpoint for the rendezvous window's load order, this weight per
    # home, decaying with this time constant: the follow-ups it brings later.
    home_weight: float = 1.0
    home_window_s: float = 30.0
    sticky_output_fraction: float = 0.5
    tokens_per_block: float = 64 / CHARS_PER_TOKEN  # 64-byte blocks, ~4 chars per token
    group_blocks: int = 4
    demand_window_s: float = 10.0
    replicate_utilisation: float = 0.7
    # Slow start yields (module docstring, 3): a ramping endpoint takes up to its full
    # share once every endpoint at full weight queues a new prefill longer than this
    # (None: the ramp always binds, Envoy's rule).
    ramp_yield_s: float | None = 0.1
    # Decode's price per output token: "batch", the share of a step in the batch it joins
    # (running + waiting + 1, at most DECODE_REF_BATCH), or "reference", the share at a
    # batch of DECODE_REF_BATCH wherever it goes.
    decode_pricing: Literal["batch", "reference"] = "batch"
    # A second of decode (the request's own output, and the delay it adds to the streams
    # already running where it goes) valued as this many seconds of TTFT; 0: J prices
    # the first token only.
    decode_weight: float = 0.05
    # The delay a request's prefill adds to the streams decoding where it goes (the engine
    # interleaves its chunks with their steps), valued as this many seconds of TTFT; off
    # by default (module docstring: it cost the Mooncake cells hit rate).
    prefill_delay_weight: float = 0.0
    # kv_wait_e's weight (module docstring): 1.0 prices the turnover of KV past the engine's
    # capacity in TTFT, the pool's wait (admission's knee) included; 0 leaves memory to the
    # engine's own queue.
    kv_wait_weight: float = 0.0
    # Whether GPU-seconds saved are money: an elastic pool (an autoscaler hands idle GPUs
    # back) weighs cost fully in J; a fixed fleet, the default, pays for its GPUs anyway,
    # so J weighs latency first and cost at FIXED_COST_WEIGHT (between near-equals).
    elastic: bool = False
    model_cold_load_s: float = 20.0  # weights not resident (sleeping engine, swapped model)
    lora_cold_load_s: float = 0.5  # adapter load from local disk
    default_residence_s: float = 10.0  # request duration before any is observed
    stale_trust: float = 0.5  # index entries of an endpoint whose reports went stale
    silent_drop_s: float = 60.0  # ...and after this much more silence, not at all
    task_map_size: int = 65_536
    task_ttl_s: float = 900.0
    group_map_size: int = 4_096
    # Primary + fallbacks returned (None: every candidate). Each costs ~1-3 us to build; a
    # retry budget rarely allows more than two or three attempts.
    max_choices: int | None = 4
    # Age limit of the approximate prefix entries (PrefixIndex ttl_s; None: none, the
    # engine's KV capacity LRU and the cached-token feedback evict them).
    prefix_ttl_s: float | None = None
    # What an approximate prefix entry (what we routed where, not the engine's KV events)
    # counts of a matched block (PrefixIndex approx_confidence).
    approx_confidence: float = 1.0
    # A new session's first step at a hub (module docstring, "Sessions start at a hub"):
    # priced as if every engine held the hub when it brings a new task id, or when at
    # least this share of the pool's recent picks continued a session (0 < share; 1.0 or
    # more: only with a task id).
    session_share: float = 0.5

    def __post_init__(self) -> None:
        if self.epsilon < 0 or self.lambda_usd_per_s < 0 or self.tokens_per_block <= 0:
            raise ValueError("epsilon and lambda must be >= 0, tokens_per_block > 0")
        if self.group_blocks < 1 or self.demand_window_s <= 0:
            raise ValueError("group_blocks must be >= 1 and demand_window_s > 0")
        if self.max_choices is not None and self.max_choices < 1:
            raise ValueError("max_choices must be >= 1 or None")
        if self.prefix_ttl_s is not None and not self.prefix_ttl_s > 0:
            raise ValueError("prefix_ttl_s must be > 0 or None")
        if self.lambda_knee_s is not None and not self.lambda_knee_s > 0:
            raise ValueError("lambda_knee_s must be > 0 or None")
        if not 0.0 < self.affinity_min_fraction <= 1.0 or self.affinity_imbalance < 1.0:
            raise ValueError("affinity_min_fraction must be in (0, 1], affinity_imbalance >= 1")
        if self.affinity_margin_s < 0 or self.affinity_redo_weight < 0:
            raise ValueError("affinity_margin_s and affinity_redo_weight must be >= 0")
        if self.home_weight < 0 or not self.home_window_s > 0:
            raise ValueError("home_weight must be >= 0 and home_window_s > 0")
        if self.decode_weight < 0 or self.prefill_delay_weight < 0:
            raise ValueError("decode_weight and prefill_delay_weight must be >= 0")
        if not 0.0 < self.approx_confidence <= 1.0:
            raise ValueError(f"approx_confidence must be in (0, 1], got {self.approx_confidence}")
        if not self.cached_headroom >= 0:
            raise ValueError(f"cached_headroom must be >= 0, got {self.cached_headroom}")

    def new_index(self, *, track_blocks: bool = False) -> PrefixIndex:
        """A prefix index with this config's age limit."""
        ttl = _INF if self.prefix_ttl_s is None else self.prefix_ttl_s
        return PrefixIndex(
            ttl_s=ttl, track_blocks=track_blocks, approx_confidence=self.approx_confidence
        )


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the picker needs to know about one request. `block_hashes` are the chained
    prefix hashes: meshd's text blocks (filters.hotpath.block_hashes, whose block size
    must match PickerConfig.tokens_per_block), or the engine's own token-block hashes
    (filters/vllm_blocks.py), in which case `tokens_per_block` says how many tokens each
    covers (the engine's block_size) and overrides the config's estimate for this request;
    `deadline_s` is absolute, on the same clock as `now`; `context_key` names the
    workflow/session/task for stickiness."""

    model: str
    block_hashes: Sequence[int] = ()
    prompt_tokens: int = 1
    max_tokens: int = 256
    adapter: str | None = None
    tenant: str | None = None
    priority: int | None = None
    deadline_s: float | None = None
    context_key: str | None = None
    tokens_per_block: float | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_block is not None and not self.tokens_per_block > 0:
            raise ValueError(f"tokens_per_block must be > 0, got {self.tokens_per_block}")

    @classmethod
    def build(
        cls,
        req: InferenceRequest,
        headers: RoutingHeaders,
        now: float,
        *,
        block_hashes: Sequence[int],
        adapter: str | None = None,
        default_max_tokens: int = 256,
        tokens_per_block: float | None = None,
        chars_per_token: float | None = None,
    ) -> PickRequest:
        """`chars_per_token`: the model's learnt ratio (filters/chars_per_token.py) for the
        prompt's token estimate, else CHARS_PER_TOKEN."""
        prompt_tokens = estimate_prompt_tokens(req.prompt_text, chars_per_token)
        deadline = None if headers.deadline_ms is None else now + headers.deadline_ms / 1000.0
        return cls(
            model=req.model,
            block_hashes=block_hashes,
            prompt_tokens=prompt_tokens,
            max_tokens=(req.max_tokens or default_max_tokens) * max(1, req.n),
            adapter=adapter,
            tenant=headers.tenant,
            priority=headers.priority,
            deadline_s=deadline,
            context_key=headers.workflow_id or headers.session_id or headers.task_id,
            tokens_per_block=tokens_per_block,
        )


class Choice(NamedTuple):
    """One endpoint in the answer. `rank` 0 is the primary. `nominal_s` (TTFT compute at
    the GPU's nominal speed) and `fixed_s` (cold loads, waits for slots or KV) are what
    `Picker.dispatch` hands to EndpointState for its calibration.

    A NamedTuple rather than a frozen dataclass: building one took ~0.9 us against ~4.8 us
    for the frozen dataclass (11 fields, CPython 3.11, timeit on the 2-core dev box), and a
    pick builds up to max_choices of them.
    """

    endpoint: str
    url: str
    predicted_ttft_s: float
    predicted_cost_usd: float
    cached_tokens: int
    reason: str
    score: float
    rank: int
    nominal_s: float
    fixed_s: float
    state: EndpointState
    step_s: float = 0.0  # predicted decode step it joins, uncalibrated (the decode sample)
    # A primary picked without being recorded (pick's `record` false) whose prompt makes
    # its home there (a cold prompt's): dispatch notes the home with the prompt.
    home: bool = False


# (model, adapter): the request class a view's J constants were computed for.
_KKey = tuple[str, str | None]


class _View:
    """The request-independent part of the model for one endpoint, cached per version."""

    __slots__ = (
        "adapters",
        "budget",
        "c0",
        "c1",
        "cal",
        "cal_key",
        "cal_seen",
        "cap_blocks",
        "cold",
        "cold_now",
        "dcal",
        "decode_extra",
        "decode_span",
        "floor_load",
        "free_kv",
        "full_weight",
        "inv",
        "inv_nominal",
        "kc",
        "kkey",
        "kkey_cold",
        "kv_cap",
        "kv_used",
        "kv_wait_per_token",
        "load",
        "name",
        "others_span",
        "picker",
        "price_s",
        "q",
        "q_fixed",
        "q_nominal",
        "r_kv_ctx",
        "r_kv_used",
        "r_requests",
        "r_running",
        "r_tokens",
        "r_waiting",
        "running",
        "s0",
        "salt",
        "slots",
        "stamp",
        "state",
        "static_version",
        "step",
        "step1",
        "step_base",
        "step_kv",
        "step_seq",
        "step_slope",
        "tps0",
        "trust",
        "until",
        "url",
        "usd_per_out_tok",
        "version",
        "weight",
        "why",
    )

    adapters: dict[str, float | None]
    cap_blocks: int
    cold: dict[str, float | None]
    floor_load: float  # below this load the bounded-load rule does not bite
    free_kv: float  # KV tokens free
    inv: float  # calibrated seconds per prefill token
    inv_nominal: float  # at the GPU's nominal speed
    kv_wait_per_token: float
    load: float  # for the bounded-load rule
    name: str
    picker: Picker
    price_s: float
    q: float  # calibrated queueing delay, seconds
    q_fixed: float  # its part that does not scale (slot waits)
    q_nominal: float  # its compute part at nominal speed
    salt: int  # rendezvous-hash salt of the name
    stamp: int  # >= a pick's base: a candidate of that pick, at slot stamp - base
    state: EndpointState
    trust: float  # silence discount for index entries
    until: float  # the view is stale from then on
    url: str
    usd_per_out_tok: float  # decode share of a step in the batch it joins, in dollars
    decode_span: float  # output tokens that batch lasts (inf: for all of ours)
    decode_extra: float  # per output token beyond decode_span: alone, less the share
    version: int
    weight: float  # full_weight x slow-start ramp: the capacity weight
    full_weight: float  # the reference's prefill tok/s x this GPU's decode speed vs its
    cal_key: str  # GPU class for calibration pooling
    cal: float  # the calibration the load part used
    # (samples, ttft_ratio, class, class's pushed prior) it was computed from, or None.
    cal_seen: tuple[int, float, _CalClass, float] | None
    why: str | None
    # Per request class (model, adapter), recomputed after any change.
    kkey: _KKey | None
    # J's constants for the class, dollars (c) apart from seconds (s, valued by lambda):
    # J = c0 + lambda * s0 + U * (c1 + lambda * inv) + decode + kv wait.
    c0: float  # price x cold-load time
    s0: float  # cold-load time + queueing
    c1: float  # price x seconds per prefilled token
    # (c0, s0, c1, inv, usd_per_out_tok, decode_span, decode_extra, free_kv,
    # kv_wait_per_token, load, weight, name, step, dcal x step_seq, dcal x step_kv,
    # running, others_span), the dollars scaled by the cost weight, or
    # None when this endpoint cannot serve the class.
    kc: tuple[object, ...] | None
    cold_now: float
    kkey_cold: _KKey | None  # the class cold_now was computed for (static, like `cold`)
    # Static part (rebuilt on a report, a flag, a failure or a freshness deadline).
    static_version: int
    tps0: float  # nominal prefill tok/s, unloaded
    budget: float  # max_num_batched_tokens
    step1: float  # decode step at batch 1 (per engine, so / GPUs)
    step_slope: float  # its growth per extra sequence
    slots: int  # max_num_seqs
    kv_cap: float  # KV capacity, tokens
    r_running: int  # from the fresh report, else 0
    r_waiting: int
    r_requests: int
    r_tokens: int
    r_kv_used: float  # the last report's KV in use that was not ours (below)
    r_kv_ctx: float  # ...and the context it holds beyond ours (the decode step's K)
    step: float  # decode step at the current batch and context held, calibrated
    kv_used: float  # KV tokens held: ours in flight and the report's others' share
    # The decode step model, per engine: base + step_seq x batch + step_kv x context
    # tokens held (GpuProfile.decode_step_parts), x dcal (EndpointState.decode_ratio).
    step_base: float
    step_seq: float
    step_kv: float
    dcal: float
    running: float  # sequences decoding (ours or reported, the larger)
    others_span: float  # output tokens they have left, on average (inf: unknown)

    def decode_usd(self, max_tokens: int) -> float:
        """The decode part of cost_e for `max_tokens` output tokens."""
        usd = max_tokens * self.usd_per_out_tok
        if max_tokens > self.decode_span:
            usd += (max_tokens - self.decode_span) * self.decode_extra
        return usd


_new_choice = tuple.__new__
_INF = float("inf")
_TWO_M53 = 2.0**-53
# Picker._view's fast paths (the calibration's common case in line, the last request
# class's constants built with the view); false: the general path each time, which they
# must equal (tests/test_picker_view_fast.py).
_FAST_VIEW = True
# Picker._match's reuse of the last prefix match (follow_up's, for the pick of the same
# request); false: the index is walked each time (tests/test_picker_pick_fast.py).
_FAST_MATCH = True

# Picker._matched: (request, index, its version, until, the index's answer).
_Matched = tuple[PickRequest | None, PrefixIndex | None, int, float, dict[str, tuple[int, float]]]

# (J, name, view): sorts by J, then name (names are unique).
_Cand = tuple[float, str, _View]


def _always(t: _Cand) -> bool:
    return True


# Picker.pick's bounded-load terms for one request (_within): (cap, headroom, cached_of, x,
# yield_q, pool_q, cands, now); pool_q holds the least queue at full weight once computed.
_Bound = tuple[float, float, dict[str, float], float, float | None, list[float], list[_Cand], float]
_first = itemgetter(0)


def _within(bound: _Bound, t: _Cand) -> bool:
    """Bounded load (Picker.pick): t's load plus this request's within cap x its capacity
    weight (x 1 + headroom x its cached tokens where it holds part of the prompt), or its
    load under its floor. Slow start gives way while the pool queues: a ramping endpoint
    over its ramped share is still within, up to its full share, once no endpoint at full
    weight could start this prefill within yield_q (module docstring, 3)."""
    cap, headroom, cached_of, x, yield_q, pool_q, cands, now = bound
    v = t[2]
    top = cap
    if headroom:
        held = cached_of.get(t[1])
        if held:
            top = cap * (1.0 + headroom * held)
    load = v.load
    # _fits in line, as it compares.
    if load <= v.floor_load or load + x <= top * v.weight * _BOUND_TIE:
        return True
    if (
        yield_q is None
        or v.weight >= v.full_weight
        or not load + x <= cap * v.full_weight * _BOUND_TIE
    ):
        return False
    if not pool_q:
        pool_q.append(
            min(
                (_queue_now(u[2], now) for u in cands if u[2].weight >= u[2].full_weight),
                default=_INF,
            )
        )
    return pool_q[0] > yield_q


def _queue_now(v: _View, now: float) -> float:
    """The view's queueing delay at `now`: its prefill queue less what the engine worked
    off since its queue head last changed (EndpointState.prefill_since), never below the
    part that does not drain (slot waits, the step floor)."""
    if v.state.waiting:
        return max(v.q_fixed, v.q - (now - v.state.prefill_since))
    return v.q


def _step(v: _View, context: float) -> float:
    """The view's engine's decode step with one more sequence of `context` tokens in its
    batch (the GPU's step model, per engine, filters/gpu.py, x the decode calibration)."""
    return v.step + v.dcal * (v.step_seq + v.step_kv * context)


def _decode_s(v: _View, max_tokens: int, context: float) -> float:
    """The decode seconds J values for a request of `max_tokens` output tokens and
    `context` tokens held (prompt + half its output): its own output at the step of the
    batch it joins, plus the delay it adds to each running stream for as long as both
    decode (the module docstring's D_e)."""
    if max_tokens <= 0:
        return 0.0
    so = v.others_span
    if max_tokens < so:
        so = max_tokens
    inc = v.dcal * (v.step_seq + v.step_kv * context)
    return max_tokens * (v.step + inc) + v.running * so * inc


def _j_cached(
    v: _View,
    cached: float,
    big_p: int,
    big_m: int,
    lam: float,
    lam_d: float,
    lam_i: float,
    kappa: float,
    ctx: float,
) -> float:
    """J of a request of `big_p` prompt tokens, `cached` of them held at v's engine
    (Picker.pick's re-pricing of the candidates holding a prefix; the hot loop prices U = P)."""
    unc = big_p - min(cached, big_p - 1.0)
    w = _work(unc, big_p - unc)
    j = v.c0 + lam * v.s0 + w * (v.c1 + lam * v.inv) + kappa * v.decode_usd(big_m)
    if unc + big_m > v.free_kv:
        j += (unc + big_m - v.free_kv) * (v.kv_wait_per_token * lam)
    return j + lam_d * _decode_s(v, big_m, ctx) + lam_i * v.running * w * v.inv


def price_candidates(
    endpoints: Sequence[EndpointState],
    kkey: _KKey,
    base: int,
    big_p: int,
    big_m: int,
    lam: float,
    lam_d: float,
    lam_i: float,
    refresh: Callable[[EndpointState, _View | None, _KKey, float], _View],
    hook: Callable[[EndpointState, PickRequest, float], bool] | None,
    req: PickRequest,
    now: float,
    big_w: float | None = None,
) -> tuple[list[_Cand], float, float]:
    """The hot loop of Picker.pick: every eligible endpoint priced as if nothing were
    cached (U = P), at this request's lambda (lam_d for its decode seconds, _decode_s;
    lam_i for the delay its prefill adds to the streams running there), in endpoint
    order, each view stamped with
    base + its slot (a view stamped >= base already is a duplicate), plus the sums of load
    and capacity weight.
    `big_w`: the prompt's prefill in tokens of linear work (_work; None: big_p).
    The reference for the compiled twin in filters/_picker_c.pyx, which must agree exactly
    (tests/test_picker_twins.py)."""
    wp = big_p if big_w is None else big_w
    pm = big_p + big_m
    x = big_p + 0.5 * big_m
    cands: list[_Cand] = []
    append = cands.append
    slot = base
    load_sum = 0.0
    weight_sum = 0.0
    for e in endpoints:
        v = e._pick_view
        if v is None or v.kkey is not kkey:
            v = refresh(e, v, kkey, now)
        kc = v.kc
        if kc is None or v.stamp >= base:
            continue
        if hook is not None and not hook(e, req, now):
            continue
        v.stamp = slot
        slot += 1
        c0, s0, c1, s1, u, span, extra, free, kvw, load, weight, name, a, ds, dk, r, so = kc
        j = c0 + lam * s0 + wp * (c1 + lam * s1) + big_m * u
        if big_m > span:
            j += (big_m - span) * extra
        if pm > free:
            j += (pm - free) * (kvw * lam)
        if big_m > 0:
            if big_m < so:
                so = big_m
            j += lam_d * (big_m * a + (big_m + r * so) * (ds + dk * x))
        j += lam_i * r * wp * s1
        append((j, name, v))
        load_sum += load
        weight_sum += weight
    return cands, load_sum, weight_sum


def sort_candidates(cands: list[_Cand]) -> None:
    """By J, then name (names are unique). The reference for the compiled twin."""
    cands.sort()


# The compiled twins (filters/_picker_c.pyx) when built, unless MESHD_PURE_PYTHON is set.
_price = price_candidates
_sort = sort_candidates
IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        from filters import _picker_c  # type: ignore[attr-defined]
    except ImportError:
        IMPLEMENTATION = "python (compiled extension not built)"
    else:
        _price = _picker_c.price_candidates
        _sort = _picker_c.sort_candidates
        IMPLEMENTATION = "cython"
        # Its loop reads these classes' slots directly (other types go through getattr).
        if hasattr(_picker_c, "bind_slots"):
            _picker_c.bind_slots(EndpointState, _View)


@dataclass(slots=True)
class _CalClass:
    """The TTFT calibration pooled over the endpoints of one GPU class: sums of
    (ttft_ratio - d) and of (1 - d), d = _CAL_KEEP ** samples, i.e. the evidence-weighted
    mean of what their samples said, and the members whose own evidence is thin."""

    key: str
    num: float = 0.0
    den: float = 0.0
    pushed: float = 1.0  # the prior the unsettled members' views were built with
    unsettled: dict[str, EndpointState] = field(default_factory=dict)

    def prior(self) -> float:
        # Optimistic: never slower than the datasheet for an endpoint that has not shown
        # it, so that one degraded peer does not condemn the rest untried.
        if self.den < CAL_MIN_EVIDENCE:
            return 1.0
        return min(1.0, max(CALIBRATION_RANGE[0], self.num / self.den))


class _CalOf(NamedTuple):
    """One endpoint's contribution to its class: at n samples and this ratio."""

    cls: _CalClass
    n: int
    ratio: float
    d: float
    num: float


@dataclass(slots=True)
class _Group:
    rate: float  # reference GPU-seconds per second, exponentially weighted
    at: float
    # The share of its picks that continued a session (a follow-up step: Picker.pick), an
    # EWMA over picks (FOLLOW_ALPHA).
    follow: float = 0.0
    picks: int = 0  # picks in the group (its follow share means something after a few)


@dataclass(slots=True)
class _Task:
    endpoint: str
    prompt_tokens: int
    max_tokens: int
    at: float


class Picker:
    """Chooses endpoints for requests. One instance per pool; not thread-safe.

    The driver's protocol (sidecar, ext_proc picker, simulator alike)::

        choices = picker.pick(req, endpoints, now)   # the primary is recorded speculatively
        for c in choices:                            # primary, then fallbacks
            picker.dispatch(c, req, request_id, now) # local accounting (+ record a fallback)
            ...connect; on failure: c.state.finish(request_id, now, ok=False)
                                    c.state.connect_failure(now); try the next
        c.state.first_token(request_id, now)         # feeds the TTFT calibration
        c.state.finish(request_id, now)
        picker.observe_cached(c, req, usage_cached_tokens, now)   # optional ghost check

    Engine reports go to `endpoint.report(ReportedState(...), now)`, flags to
    `endpoint.set_flags(...)`; an endpoint leaving the pool to `picker.forget(name)`.
    EndpointState names must be unique within a pool; a state object is meant for one
    picker (two pickers sharing one state still work, each rebuilding its cached view).
    """

    def __init__(
        self,
        config: PickerConfig | None = None,
        *,
        index: PrefixIndex | None = None,
        gpus: GpuTable | None = None,
        eligible: Callable[[EndpointState, PickRequest, float], bool] | None = None,
    ) -> None:
        self.config = c = config or PickerConfig()
        self.index = index if index is not None else c.new_index()
        self.gpus = gpus or GpuTable()
        self._eligible = eligible
        self._lambda = [c.lambda_usd_per_s * c.lambda_priority_base ** (p - 5) for p in range(10)]
        self._batch_pricing = c.decode_pricing == "batch"
        self._kappa = 1.0 if c.elastic else FIXED_COST_WEIGHT
        self._decode_tol = c.decode_tolerance
        self._load_requests = c.load_metric == "requests"
        self._kv_wait = c.kv_wait_weight
        self._residence = c.default_residence_s
        floor = c.load_floor
        if floor is None:
            floor = 8.0 if c.load_metric == "requests" else 16_384.0
        self._floor = floor
        self._tasks: OrderedDict[str, _Task] = OrderedDict()
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._stamp = 0
        self._kkeys: dict[_KKey, _KKey] = {}
        self._min_until = _INF  # earliest freshness deadline among the views
        self._by_name: dict[str, _View] = {}
        self._draws: dict[int, float] = {}  # key ^ salt -> -ln(u), see _cold_hash
        # Calibration pooling: requests dispatched per endpoint (its samples, once they
        # finish), each endpoint's (class, d, ratio - d) contribution, and the classes.
        self._dispatched: dict[str, int] = {}
        self._cal_of: dict[str, _CalOf] = {}
        self._cal: dict[str, _CalClass] = {}
        # Affinity departures by reason ("deadline", "overloaded", "faster-elsewhere"):
        # follow-up steps sent away from the endpoint holding their prefix.
        self.departures: dict[str, int] = {}
        # Cold-prompt homes per endpoint: (count, when), decaying by home_window_s.
        self._homes: dict[str, tuple[float, float]] = {}
        self.last_departure: str | None = None  # the last pick's, if any
        # Learnt factor on each endpoint's prefix-index capacity (observe_cached).
        self._cap_scale: dict[str, float] = {}
        # Each endpoint's last KV capacity from the engine, and those still on a guess.
        self._cap_known: dict[str, int] = {}
        self._cap_guessed: set[str] = set()
        # The last prefix match (_match): (request, index, its version, until, answer).
        self._matched: _Matched = (None, None, -1, -_INF, {})
        # The hit-rate check against each engine's counters (observe_engine_hits): per
        # endpoint [predicted prompt tokens, predicted cached, requests] sent since the
        # last verdict, and [queries, hits] the engine counted meanwhile; endpoints whose
        # answers detail their cached tokens (observe_cached learns from those instead);
        # and each endpoint's last error (predicted hit rate - the engine's).
        self._hit_sent: dict[str, list[float]] = {}
        self._hit_seen: dict[str, list[float]] = {}
        self._cached_answers: set[str] = set()
        self.hit_error: dict[str, float] = {}

    # -- the decision -------------------------------------------------------------------------

    def pick(
        self,
        req: PickRequest,
        endpoints: Sequence[EndpointState],
        now: float,
        *,
        record: bool = True,
    ) -> list[Choice]:
        """Ordered choices for `req` among `endpoints` (names must be unique); empty when
        none is eligible. With `record`, the primary is noted in the index and task map."""
        c = self.config
        self.last_departure = None
        prio = req.priority
        if prio is None:
            prio = c.tenant_priority.get(req.tenant or "", c.default_priority)
        # min() and max() as they compare, in line here and below (a builtin call each).
        if not prio > 0:
            prio = 0
        lam = self._lambda[prio if prio < 9 else 9]
        # Decode seconds at the request's lambda (the knee below discounts TTFT only).
        lam_d = lam * c.decode_weight
        lam_i = lam * c.prefill_delay_weight
        big_p = req.prompt_tokens
        if not big_p > 1:
            big_p = 1
        big_w = big_p * (1.0 + _ATTN_PAIR * (0.0 + 0.5 * (big_p + 1.0)))  # _work(big_p, 0.0)
        knee = c.lambda_knee_s
        if knee is not None:
            # The TTFT cost linearised at the request's best case t0: lambda x t0 / knee
            # under the knee, rounded up to a power of two (module docstring).
            t0 = _REF_STEP_S + big_w / _REF_PREFILL_TPS
            while t0 + t0 <= knee:
                lam *= 0.5
                t0 += t0
        model = req.model
        adapter = req.adapter
        # One key object per (model, adapter), so views compare it with `is`. lambda is
        # not part of it: the hot loop applies it, so requests of other priorities or best
        # cases (the knee) share the views' constants.
        kkeys = self._kkeys
        kkey = kkeys.get((model, adapter))
        if kkey is None:
            if len(kkeys) >= MAX_REQUEST_CLASSES:  # model names come from clients
                kkeys.clear()
            kkey = kkeys[(model, adapter)] = (model, adapter)
        hashes = req.block_hashes
        nb = len(hashes)
        big_m = req.max_tokens
        if not big_m > 0:
            big_m = 0
        pm = big_p + big_m
        hook = self._eligible

        # Stamps: a view's stamp >= base marks it a candidate of this pick, and its value
        # minus base is its slot in `cands` (one attribute store for both).
        base = self._stamp + 1
        self._stamp = base + len(endpoints)
        # The hot loop: every endpoint priced as if nothing were cached (U = P); the few
        # with a prefix match or the task's stickiness are re-priced below.
        if now >= self._min_until:
            self._expire_views(now)
        cands, load_sum, weight_sum = _price(
            endpoints,
            kkey,
            base,
            big_p,
            big_m,
            lam,
            lam_d,
            lam_i,
            self._refresh,
            hook,
            req,
            now,
            big_w,
        )
        if not cands:
            return []

        by_name = self._by_name
        cached_of: dict[str, float] = {}
        tpb = req.tokens_per_block or c.tokens_per_block
        # The index's match as follow_up found it for this request, where nothing changed
        # since (_match in line: a call costs ~1-2 us with cold caches).
        if nb:
            m = self._matched
            if (
                m[0] is req
                and m[1] is (index := self.index)
                and m[2] == index.version
                and now < m[3]
                and _FAST_MATCH
            ):
                matched = m[4]
            else:
                matched = self._match(req, now)
        else:
            matched = {}
        for name, mt in matched.items():
            v = by_name.get(name)
            if v is not None and v.stamp >= base:
                cached = mt[1] * tpb * v.trust
                if cached > 0.0:
                    cached_of[name] = cached
        task = None
        sticky = None
        if req.context_key is not None:
            task = self._tasks.get(req.context_key)
            if task is not None and now - task.at <= c.task_ttl_s:
                sticky = task.endpoint
                v = by_name.get(sticky)
                if v is not None and v.stamp >= base:
                    had = cached_of.get(sticky, 0.0)
                    bonus = self._sticky_bonus(task, matched.get(sticky), v, big_p, had, tpb)
                    if bonus > 0.0:
                        cached_of[sticky] = had + bonus
                else:
                    sticky = None
        ctx = big_p + 0.5 * big_m
        kappa = self._kappa
        for name, cached in cached_of.items():
            v = by_name[name]
            j = _j_cached(v, cached, big_p, big_m, lam, lam_d, lam_i, kappa, ctx)
            cands[v.stamp - base] = (j, name, v)
        gk = c.group_blocks
        if nb < gk:
            gk = nb
        group_key = hashes[gk - 1] if gk else None
        # The affinity holder: the task's previous endpoint, else the endpoint holding the
        # most of this prompt when that is at least affinity_min_fraction of it.
        # Among endpoints that hold it equally, one within the bounded-load rule, then the
        # lowest J (chosen below).
        holders: list[_Cand] = []
        # A follow-up step: the task's next, or a prompt that extends an earlier one from
        # where it ended (no other prompt goes on from there).
        follow_up = sticky is not None
        if sticky is not None:
            holders = [cands[by_name[sticky].stamp - base]]
        elif cached_of:
            most = max(cached_of.values())
            if most >= c.affinity_min_fraction * big_p:
                # (Loops, not comprehensions, here and below: a comprehension's names
                # from pick would be cells, one object each, made on every pick.)
                for n, cached in cached_of.items():
                    if cached == most:
                        holders.append(cands[by_name[n].stamp - base])
                # A hub (more prompts extend this prefix than there are endpoints to hold
                # it: a shared tool or system prompt) is not this request's history.
                fan = self.index.fan_out(hashes, matched[holders[0][1]][0])
                follow_up = fan == 0
                if fan >= len(cands):
                    holders = []
                    g = self._groups.get(group_key) if group_key is not None else None
                    if g is None:
                        starts = req.context_key is not None and task is None
                    elif g.follow >= c.session_share:
                        starts = True
                    else:
                        # A new task id, unless the group has shown that its tasks do not
                        # go on (one-step tasks, each with an id of its own).
                        starts = (
                            req.context_key is not None
                            and task is None
                            and (g.picks < FOLLOW_MIN_PICKS or g.follow >= FOLLOW_NONE)
                        )
                    if starts:
                        # A session starts here (a new task id, or a pool whose picks
                        # mostly continue sessions): its later steps stay where it
                        # starts, and every engine will hold the hub, so the hub does
                        # not choose its home: J as if every candidate held it (the
                        # prediction and the calibration keep what each holds).
                        for i, t in enumerate(cands):
                            if cached_of.get(t[1], 0.0) < most:
                                j = _j_cached(
                                    t[2], most, big_p, big_m, lam, lam_d, lam_i, kappa, ctx
                                )
                                cands[i] = (j, t[1], t[2])
        _sort(cands)

        limit = len(cands) if c.max_choices is None else c.max_choices
        if req.deadline_s is not None:
            budget = req.deadline_s - now
            meet = []
            for t in cands:
                if self._ttft(t, big_p, big_m, cached_of, now) <= budget:
                    meet.append(t)
            if not meet:
                # Late anywhere: the holder first (moving would recompute its prefix for a
                # request that misses anyway), then by predicted TTFT (a stable sort by
                # these keys, as list.sort with them as its key).
                late = min(holders) if holders else None
                keyed = []
                for t in cands:
                    key = (t is not late, self._ttft(t, big_p, big_m, cached_of, now), t[1])
                    keyed.append((key, t))
                keyed.sort(key=_first)
                out = []
                for i, kt in enumerate(keyed[:limit]):
                    out.append(self._choice(kt[1], req, cached_of, "deadline-unmeetable", i))
                if record:
                    self._commit(req, out[0], now)
                return out
        else:
            meet = cands

        # Bounded load: the cap per unit of weight; below its floor nobody is hot.
        x = 1.0 if self._load_requests else float(pm)
        cap = (1.0 + c.epsilon) * (load_sum + x) / weight_sum

        # Slow start gives way while the pool queues: a ramping endpoint over its ramped
        # share is still within the bound, up to its full share, once no endpoint at full
        # weight could start this prefill within ramp_yield_s (module docstring, 3).
        yield_q = c.ramp_yield_s
        pool_q: list[float] = []

        headroom = c.cached_headroom / big_p if cached_of else 0.0
        # The bounded-load rule for a candidate: _within(bound, t), or within(t) where the
        # prefix group's and the holder's steps ask for a callable (a partial, not a
        # closure over pick's names: each would be a cell, an object made on every pick;
        # only those steps call it).
        bound: _Bound = (cap, headroom, cached_of, x, yield_q, pool_q, cands, now)
        within: Callable[[_Cand], bool] = _always
        if group_key is not None or holders:
            within = partial(_within, bound)

        home = False
        demand = 0.0
        if group_key is not None:
            # The group's work is what its holders would still compute: the prompt beyond
            # the best holder's cached part (or beyond the group prefix), and the decode.
            held = max(cached_of.values()) if cached_of else gk * tpb
            demand = self._demand(group_key, big_p - held, big_m, follow_up, now)

        holder_t = None
        if holders:  # min(holders, key=(not within, t)): the first least
            hk = None
            for t in holders:
                k = (not within(t), t)
                if hk is None or k < hk:
                    holder_t, hk = t, k
        everyone = meet
        # A hot group outgrowing its holders spreads (replication, below) before affinity
        # keeps its requests where they are.
        target = None
        if group_key is not None and cached_of:
            target = self._replica_target(meet, cached_of, matched, gk, demand, within)
        if holder_t is not None:
            departure = (
                "replicate"
                if target is not None
                else self._departure(
                    holder_t, meet, big_p, big_m, cached_of, load_sum + x, weight_sum, now, within
                )
            )
            if departure is None:
                why = "sticky" if holder_t[1] == sticky else "prefix-affinity"
                out = [self._choice(holder_t, req, cached_of, why, 0)]
                self._fallbacks(out, holder_t, meet, bound, limit, req, cached_of)
                if record:
                    self._commit(req, out[0], now)
                return out
            self.departures[departure] = self.departures.get(departure, 0) + 1
            self.last_departure = departure
            if len(meet) > 1:  # the holder is not the primary: it stays a fallback
                rest = []
                for t in meet:
                    if t is not holder_t:
                        rest.append(t)
                meet = rest

        best = None
        for t in meet:
            if _within(bound, t):
                best = t
                break
        bound_ok = best is not None
        if best is None:
            best = meet[0]
            within = _always
        primary = best
        reason = "prefix-affinity" if best[1] in cached_of else "least-cost"
        if group_key is not None:
            if target is not None and target in meet:
                primary = target
                reason = "replicate"
            else:
                # Nowhere cached, or cached where it saves less than the window (a shared
                # chat-template header): consistent hashing among the comparable endpoints.
                top = self._cold_hash(
                    meet, best, group_key, c.cold_tolerance, big_m, big_p, lam_d, within, now
                )
                if top is not best or best[1] not in cached_of:
                    primary = top
                    reason = "cold-hash"
                # The prompt makes its home here (a new session's first step); unrecorded,
                # when the request goes there (dispatch).
                home = True
                if record:
                    self._add_home(primary[1], now)
        if not bound_ok:
            reason = "over-load-bound"

        out = [self._choice(primary, req, cached_of, reason, 0)]
        self._fallbacks(out, primary, everyone, bound if bound_ok else None, limit, req, cached_of)
        if record:
            if nb or req.context_key is not None:  # (else _commit has nothing to note)
                self._commit(req, out[0], now)
        elif home:
            out[0] = out[0]._replace(home=True)
        return out

    def order_decode(
        self,
        req: PickRequest,
        endpoints: Sequence[EndpointState],
        now: float,
        *,
        lead_s: float = 0.0,
    ) -> list[Choice]:
        """The decode leg of a split request (prefill/decode disaggregation, issue #25), best
        first. Its prompt's KV arrives by transfer, so where the prefix is cached does not
        matter: what the stream will see is the engine's decode. For each eligible endpoint
        that serves the model (pick's step 1), with P prompt and M output tokens::

            H_e   = free_kv_e - (P + M)                the KV headroom the whole stream needs
            ITL_e = step_e(r_e + 1, K_e + P + M / 2)   the decode step with this stream
                                                       added (_step: the GPU's step model at
                                                       the batch and the context held there,
                                                       x the engine's decode calibration)
            W_e   = cold_e + queue_e + max(0, -H_e) x kv_wait_per_token_e
                                                       its wait to start there: weights not
                                                       loaded, the queue ahead of it (slot
                                                       waits, a refusal hold, the step;
                                                       _queue_now) and, short of KV, the
                                                       turnover of the shortfall

        The rule: first the endpoints where the stream fits (H_e >= 0, reason "decode"),
        then the rest ("decode-kv-short", a shortfall waits or preempts); within each, by
        W_e + M x ITL_e, when the stream would end there; then by name. No bounded-load
        rule and no hashing: every stream dispatched raises the step (batch and context)
        of the engine it went to, so the next one weighs that load by what it does to
        inter-token latency. Nothing is recorded (prefix, task, home, demand): dispatch
        (recorded false) notes the prompt where the stream went, whose engine holds its KV
        once it has landed. Each choice predicts TTFT = lead_s (the KV's way there: the
        transfer, and under SGLang's protocol the prefill beside it) + W_e; its cached
        tokens are P - 1 (the prompt comes as KV: no prefill queued there); nominal_s 0 (no
        TTFT calibration sample: its first token times the transfer, not the engine), and
        the step, uncalibrated, as the decode calibration's sample."""
        kkeys = self._kkeys
        kkey = kkeys.get((req.model, req.adapter))
        if kkey is None:
            if len(kkeys) >= MAX_REQUEST_CLASSES:
                kkeys.clear()
            kkey = kkeys[(req.model, req.adapter)] = (req.model, req.adapter)
        if now >= self._min_until:
            self._expire_views(now)
        big_p = max(1, req.prompt_tokens)
        big_m = max(0, req.max_tokens)
        need = big_p + big_m
        ctx = big_p + 0.5 * big_m
        hook = self._eligible
        rows: list[tuple[bool, float, str, _View, float, float]] = []
        for e in endpoints:
            v = e._pick_view
            if v is None or v.kkey is not kkey:
                v = self._refresh(e, v, kkey, now)
            if v.kc is None or (hook is not None and not hook(e, req, now)):
                continue
            itl = _step(v, ctx)
            short = need - v.free_kv
            wait = v.cold_now + _queue_now(v, now)
            if short > 0.0:
                wait += short * v.kv_wait_per_token
            rows.append((short > 0.0, wait + big_m * itl, v.name, v, itl, wait))
        rows.sort(key=lambda r: r[:3])
        limit = self.config.max_choices or len(rows)
        return [
            _new_choice(
                Choice,
                (
                    name,
                    v.url,
                    lead_s + wait,
                    v.decode_usd(big_m),
                    big_p - 1,
                    "decode-kv-short" if short else "decode",
                    end,
                    rank,
                    0.0,
                    0.0,
                    v.state,
                    itl / v.dcal,
                    False,
                ),
            )
            for rank, (short, end, name, v, itl, wait) in enumerate(rows[:limit])
        ]

    def _fallbacks(
        self,
        out: list[Choice],
        primary: _Cand,
        meet: list[_Cand],
        bound: _Bound | None,
        limit: int,
        req: PickRequest,
        cached_of: dict[str, float],
    ) -> None:
        """After the primary: the rest by J, within the bound ("fallback"; _within, bound
        None: all), then over it."""
        n = len(out)
        if n >= limit:
            return
        over: list[_Cand] | None = None  # (made only when one is over)
        for t in meet:
            if t is primary:
                continue
            if bound is None or _within(bound, t):
                out.append(self._choice(t, req, cached_of, "fallback", n))
                n += 1
                if n >= limit:
                    return
            elif over is None:
                over = [t]
            else:
                over.append(t)
        if over is not None:
            for t in over:
                out.append(self._choice(t, req, cached_of, "over-load-bound", n))
                n += 1
                if n >= limit:
                    return

    def dispatch(
        self,
        choice: Choice,
        req: PickRequest,
        request_id: Hashable,
        now: float,
        *,
        recorded: bool = True,
    ) -> None:
        """The driver sent `req` to `choice`: account it on the endpoint (and, for a
        fallback, note it in the index and task map as pick() did for the primary).
        `recorded` false: the choice came from a pick that recorded nothing (pick's
        `record`, order_decode), so the primary is noted now, with its home if it makes one."""
        # The fields at once (one unpacking, not a descriptor call each).
        name, _, _, _, cached, _, _, rank, nominal, fixed, state, step, home = choice
        if rank or not recorded:
            self._commit(req, choice, now)
            if home and not recorded:
                self._add_home(name, now)
        self._dispatched[name] = self._dispatched.get(name, 0) + 1
        prompt = req.prompt_tokens
        uncached = prompt - cached
        if not uncached > 1:  # max(1, ...), max() as it compares
            uncached = 1
        sent = self._hit_sent.get(name)
        if sent is not None and not choice.reason.startswith("decode"):
            # (A decode leg's cached tokens are its transfer's, not the index's.)
            sent[0] += prompt if prompt > 1 else 1
            sent[1] += cached
            sent[2] += 1.0
        # A prediction that counted on more cached tokens than it left to prefill measures
        # the index (its confidence discount, characters per token) more than the engine:
        # on the Mooncake bench such picks predicted 273 tokens to prefill where the engine
        # computed 43, and their samples pinned the H100s' calibration at its floor. They
        # feed no calibration sample (nominal_s 0).
        if not cached <= uncached:
            nominal = 0.0
        big_m = req.max_tokens
        state.start(
            request_id,
            now,
            prompt_tokens=prompt if prompt > 1 else 1,
            uncached_tokens=uncached,
            max_tokens=big_m if big_m > 0 else 0,
            nominal_s=nominal,
            fixed_s=fixed,
            step_s=step,
        )

    def pool_wait(
        self, endpoints: Sequence[EndpointState], now: float, stop_below: float = -_INF
    ) -> float | None:
        """The least predicted queueing delay, seconds, before a new request's prefill could
        start on any eligible endpoint: the view's queue (prefill queue less what the
        engine worked off since its head started, slot waits, one step), as in the
        prediction, plus the turnover of KV past the engine's capacity for a request of
        its usual size. How far past its knee the pool is (filters/admission.py); None
        when no endpoint is eligible. The first endpoint found under `stop_below` ends the
        scan (the knee gate only asks whether one is: O(1) while the pool has room)."""
        best = _INF
        for e in endpoints:
            v = e._pick_view
            if v is None or v.picker is not self or now >= v.until:
                v = self._view(e, now)
            if v.why is not None:
                continue
            # _queue_now in line (a call costs ~5 us with cold caches; the knee asks this
            # for every new task's request), max() as max() compares.
            q = v.q
            if e.waiting:
                q -= now - e.prefill_since
                if not q > v.q_fixed:
                    q = v.q_fixed
            # Memory, as kv_wait_e prices it, for a request of the engine's usual size:
            # past its KV capacity a new stream waits for (or preempts) the running ones
            # until the excess has turned over.
            n = e.outstanding
            typical = e.prompt_tokens_avg + (e.output_tokens_in_flight / n if n else 0.0)
            excess = v.kv_used + typical - v.kv_cap
            if excess > 0.0:
                q += excess * v.kv_wait_per_token
            if q < best:
                best = q
                if q < stop_below:
                    break
        return None if best == _INF else best

    def follow_up(self, req: PickRequest, now: float) -> bool:
        """Whether `req` continues a task under way: its context key names a task seen
        within task_ttl_s, or some endpoint holds at least FOLLOW_UP_FRACTION of its
        prompt's blocks in the prefix index (a prompt that extends one routed before: the
        next turn of a conversation, the next step of an agent). No header is needed."""
        key = req.context_key
        if key is not None:
            task = self._tasks.get(key)
            if task is not None and now - task.at <= self.config.task_ttl_s:
                return True
        hashes = req.block_hashes
        if not hashes:
            return False
        need = FOLLOW_UP_FRACTION * len(hashes)
        # A loop, not any() over a generator: no generator object and frame a request.
        for m in self._match(req, now).values():  # noqa: SIM110
            if m[0] >= need:
                return True
        return False

    def _match(self, req: PickRequest, now: float) -> dict[str, tuple[int, float]]:
        """The index's match_detail of req's block hashes at `now`: the last one found, if
        for this request and it still holds (the index unchanged since, no expiry due:
        PrefixIndex.match_keyed), else found and kept. Admission's follow_up and the pick
        of one request ask in turn: one walk of the index serves both."""
        m = self._matched
        index = self.index
        if (
            m[0] is not req
            or m[1] is not index
            or m[2] != index.version
            or not now < m[3]
            or not _FAST_MATCH
        ):
            version, until, out = index.match_keyed(req.block_hashes, now)
            m = self._matched = (req, index, version, until, out)
        return m[4]

    def observe_cached(
        self, choice: Choice, req: PickRequest, cached_tokens: int, now: float
    ) -> None:
        """The engine reported how many prompt tokens it had cached (usage.prompt_tokens_
        details.cached_tokens). Fewer than half the predicted means the index had a ghost
        there, and more than twice (plus two blocks) that it had dropped what the engine
        still held: the endpoint's index capacity is learnt from both (_scale_capacity).
        The entry itself stays: the request was just prefilled there."""
        tpb = req.tokens_per_block or self.config.tokens_per_block
        predicted = choice.cached_tokens
        self._cached_answers.add(choice.endpoint)
        if cached_tokens >= 0.5 * predicted:
            if cached_tokens > 2.0 * predicted + 2.0 * tpb:
                # The engine still had what the index had let go: it holds more than the
                # capacity we assumed (an engine nobody described).
                self._scale_capacity(choice.endpoint, INDEX_CAPACITY_GROW)
            return
        self._scale_capacity(choice.endpoint, INDEX_CAPACITY_SHRINK)

    def observe_engine_hits(
        self, name: str, queries: float, hits: float, now: float
    ) -> float | None:
        """The engine counted `queries` prompt tokens looked up in its prefix cache and
        `hits` found there since its last scrape (vllm:prefix_cache_queries / hits). Held
        against the hit rate the index predicted for the requests sent there meanwhile;
        once HIT_CHECK_MIN_REQUESTS went, the verdict: the index's error (predicted rate -
        the engine's, also in `hit_error`), returned, and, for an engine whose answers
        never detail their cached tokens (observe_cached learns from those), the index
        capacity scaled down where the engine found clearly fewer hits than predicted
        (ghosts), up where it found clearly more (entries the index dropped too early).
        Token units cancel: each side is a rate in its own tokens."""
        sent = self._hit_sent.get(name)
        if sent is None:
            # The first window: what was sent before it, the engine may have counted in an
            # earlier one; compare from here on.
            self._hit_sent[name] = [0.0, 0.0, 0.0]
            self._hit_seen[name] = [0.0, 0.0]
            return None
        seen = self._hit_seen[name]
        seen[0] += max(0.0, queries)
        seen[1] += max(0.0, hits)
        if sent[2] < HIT_CHECK_MIN_REQUESTS or seen[0] <= 0.0:
            return None
        predicted = sent[1] / sent[0]
        engine = min(1.0, seen[1] / seen[0])
        sent[0] = sent[1] = sent[2] = 0.0
        seen[0] = seen[1] = 0.0
        err = self.hit_error[name] = predicted - engine
        if name not in self._cached_answers:
            if engine < HIT_CHECK_LOW * predicted and predicted - engine > HIT_CHECK_SLACK:
                self._scale_capacity(name, INDEX_CAPACITY_SHRINK)
            elif engine > HIT_CHECK_HIGH * predicted + HIT_CHECK_SLACK:
                self._scale_capacity(name, INDEX_CAPACITY_GROW)
        return err

    def _scale_capacity(self, name: str, factor: float) -> None:
        """Learn an endpoint's prefix-index capacity from the engine's cached-token counts:
        up where the engine kept what the index dropped, down where it had ghosts."""
        lo, hi = INDEX_CAPACITY_SCALE_RANGE
        old = self._cap_scale.get(name, 1.0)
        scale = self._cap_scale[name] = min(hi, max(lo, old * factor))
        v = self._by_name.get(name)
        if v is not None and scale != old:
            v.cap_blocks = int(v.kv_cap * scale / self.config.tokens_per_block)
            self.index.set_capacity(name, v.cap_blocks)

    def index_capacity_scale(self, name: str) -> float:
        """The learnt factor on the endpoint's assumed KV capacity (1.0: as assumed)."""
        return self._cap_scale.get(name, 1.0)

    def forget(self, endpoint: str) -> None:
        """An endpoint left the pool: drop its index entries, cached view and calibration."""
        self.index.forget(endpoint)
        self._dispatched.pop(endpoint, None)
        self._cap_scale.pop(endpoint, None)
        self._cap_known.pop(endpoint, None)
        self._cap_guessed.discard(endpoint)
        self._hit_sent.pop(endpoint, None)
        self._hit_seen.pop(endpoint, None)
        self._cached_answers.discard(endpoint)
        self.hit_error.pop(endpoint, None)
        self._homes.pop(endpoint, None)
        old = self._cal_of.pop(endpoint, None)
        if old is not None:
            k = old.cls
            k.num -= old.num
            k.den -= 1.0 - old.d
            k.unsettled.pop(endpoint, None)
        v = self._by_name.pop(endpoint, None)
        if v is not None:
            if v.state._pick_view is v:
                v.state._pick_view = None
            if v.state._pick_stale is v:
                v.state._pick_stale = None

    # -- internals -----------------------------------------------------------------------------

    def _expire_views(self, now: float) -> None:
        """A freshness deadline passed somewhere: rebuild the views it affects, so that the
        hot loop need only test each view for None."""
        nxt = _INF
        for v in list(self._by_name.values()):
            if now >= v.until:
                v = self._view(v.state, now)
            if v.until < nxt:
                nxt = v.until
        self._min_until = nxt

    def _refresh(self, e: EndpointState, v: _View | None, kkey: _KKey, now: float) -> _View:
        """The hot loop found e's view changed (None) or priced for another request class."""
        if v is None:
            v = self._view(e, now)
        if v.kkey is not kkey:
            self._constants(v, e, kkey, now)  # (also adopts another picker's view)
            v = e._pick_view
        return v

    def _view(self, e: EndpointState, now: float) -> _View:
        """The endpoint's view, rebuilt: the static part (GPU, report, eligibility) only when
        a report, flag or failure changed it or a freshness deadline passed; the load part
        (local counters) on every version change. With the request-class constants of
        the class last priced here (_constants), so that the next pick of that class finds
        the view whole: no call back from the hot loop."""
        if not now < e.calibration_aged_at + CALIBRATION_AGE_STEP_S:  # (its early return)
            e.age_calibration(now)
        v = e._pick_view
        if v is None:
            v = e._pick_stale
        if (
            v is None
            or v.picker is not self
            or v.static_version != e.static_version
            or now >= v.until
        ):
            v = self._static_view(e, now, v)
        local_running = e.outstanding - e.waiting
        r_running = v.r_running
        running = local_running if local_running > r_running else r_running
        waiting = e.waiting
        r_waiting = v.r_waiting
        queued = waiting if waiting > r_waiting else r_waiting
        pending = float(e.pending_prefill_tokens)
        if r_waiting and r_waiting * e.prompt_tokens_avg > pending:
            pending = r_waiting * e.prompt_tokens_avg
        tps = 1.0 - running / v.budget
        tps = v.tps0 * (tps if tps > 0.1 else 0.1)
        step1 = v.step1
        step_slope = v.step_slope
        if self._batch_pricing:
            # This request's share of a decode step in the batch it joins (capped at the
            # healthy batch): joining a running batch is nearly free, waking an idle engine
            # pays its whole step, so traffic packs into batches until queueing outweighs it.
            b = running + queued + 1
            if b > DECODE_REF_BATCH:
                b = DECODE_REF_BATCH
            share = v.usd_per_out_tok = (
                v.price_s * e.decode_ratio * (step1 + step_slope * (b - 1)) / b
            )
            # ...for as long as that batch lasts: the requests we sent there have this many
            # output tokens each on average (at most: some are already decoded), and past
            # them this one decodes alone. Partners we know nothing about (reported, none
            # of ours) are taken to outlast it.
            known = e.outstanding
            if b > 1 and known > 0:
                v.decode_span = e.output_tokens_in_flight / known
                v.decode_extra = v.price_s * e.decode_ratio * step1 - share
            else:
                v.decode_span = _INF
                v.decode_extra = 0.0
        # The calibration, unchanged since this view last computed it unless a sample
        # finished, the ratio moved or the class's pooled prior was pushed (_calibration).
        name = e.name
        n = self._dispatched.get(name, 0) - e.outstanding
        ratio = e.ttft_ratio
        cv = v.cal_seen
        if cv is not None and cv[0] == n and cv[1] == ratio and cv[2].pushed == cv[3]:
            cal = v.cal
        elif (
            _FAST_VIEW
            and (old := self._cal_of.get(name)) is not None
            and (k := old.cls).key == v.cal_key
            and (old.n != n or old.ratio != ratio)
        ):
            # _calibration's common case in line (a sample finished at an endpoint that
            # stays in its class; the calls cost ~5 us each with cold caches): the same
            # operations in the same order, min/max/abs as they compare.
            d = _CAL_KEEP**n if n > 0 else 1.0
            num = ratio - d
            k.num -= old.num
            k.den -= 1.0 - old.d
            k.num += num
            k.den += 1.0 - d
            self._cal_of[name] = _new_choice(_CalOf, (k, n, ratio, d, num))
            unsettled = k.unsettled
            if d > _CAL_SETTLED:
                unsettled[name] = e
            elif name in unsettled:
                del unsettled[name]
            prior = 1.0  # _CalClass.prior
            if not k.den < CAL_MIN_EVIDENCE:
                prior = k.num / k.den
                if not prior > CALIBRATION_RANGE[0]:
                    prior = CALIBRATION_RANGE[0]
                if not prior < 1.0:
                    prior = 1.0
            pushed = k.pushed
            moved = prior - pushed
            if moved > CAL_PUSH_STEP * pushed or -moved > CAL_PUSH_STEP * pushed:
                k.pushed = prior
                for m in unsettled.values():  # their views used the old prior: rebuild
                    mv = m._pick_view
                    if m is not e and mv is not None:
                        m._pick_stale = mv
                        m._pick_view = None
            cal = ratio + d * (k.pushed - 1.0)
            if not cal > CALIBRATION_RANGE[0]:
                cal = CALIBRATION_RANGE[0]
            v.cal = cal
            v.cal_seen = (n, ratio, k, k.pushed)
        else:
            cal = v.cal = self._calibration(v, e)
            k = self._cal_of[name].cls
            v.cal_seen = (n, ratio, k, k.pushed)
        # The decode step at this batch and the context it holds (prompts, and half the
        # outputs on average), x the engine's decode calibration.
        dcal = v.dcal = e.decode_ratio
        ctx = e.tokens_in_flight - 0.5 * e.output_tokens_in_flight + v.r_kv_ctx
        step = v.step_base + v.step_seq * running + v.step_kv * ctx
        v.step = dcal * step
        v.running = float(running)
        n_out = e.outstanding
        v.others_span = e.output_tokens_in_flight / n_out if n_out else _INF
        residence = e.residence_s
        if residence is None:
            residence = self._residence
        inv_nominal = 1.0 / tps
        v.inv_nominal = inv_nominal
        v.inv = cal / tps
        q_nominal = pending / tps
        slots = v.slots
        excess = running + queued + 1 - slots
        q_fixed = excess / slots * residence if excess > 0 else 0.0
        # The step's floor (module docstring): a weight read at HBM speed, which a
        # calibration under 1 (prefill compute beat the datasheet) does not shorten. The
        # model's step, not the decode calibration's: what streams see between tokens
        # includes the prefill chunks the engine interleaves, which the queue counts.
        floor = step + v.step_seq  # the batch with this request in it
        if cal < 1.0:
            q_fixed += floor
        else:
            q_nominal += floor
        hold = e.refused_until - now
        if hold > 0.0:
            q_fixed += hold  # it said it is full: no prefill starts there before then
        if waiting:
            # Overdue: no first token there for OVERDUE_FACTOR x the queue predicted then
            # (and OVERDUE_MIN_S): a hung or stalled engine, whose queue the prediction
            # would otherwise take as drained, so that it looked idle. What it is late by
            # counts as queue, growing until a first token comes (view rebuilt each
            # OVERDUE_STEP_S meanwhile).
            q_then = cal * q_nominal + q_fixed
            due = e.prefill_since + OVERDUE_FACTOR * q_then + OVERDUE_MIN_S
            if now >= due:
                q_fixed += now - due
                due = now + OVERDUE_STEP_S
            if due < v.until:
                v.until = due
                if due < self._min_until:
                    self._min_until = due
        v.q_nominal = q_nominal
        v.q_fixed = q_fixed
        v.q = cal * q_nominal + q_fixed
        used = e.tokens_in_flight + v.r_kv_used
        v.kv_used = used
        kv_cap = v.kv_cap
        free = kv_cap - used
        v.free_kv = free if free > 0.0 else 0.0
        v.kv_wait_per_token = self._kv_wait * residence / kv_cap if kv_cap > 0 else 0.0
        if self._load_requests:
            load = e.outstanding
            if v.r_requests > load:
                load = v.r_requests
        else:
            load = e.tokens_in_flight
            if v.r_tokens > load:
                load = v.r_tokens
        v.load = float(load)
        v.version = e.version
        # The request-class constants depend on the load part: recomputed here for the
        # class last priced on this view, as _constants computes them from its static
        # cold-load cost (`cold_now` for `kkey_cold`), so that the next pick of that class
        # finds the view whole and the hot loop calls nothing back (_refresh, _constants:
        # ~5 us a call with cold caches); another class's pick computes its own.
        v.kkey = v.kkey_cold if _FAST_VIEW else None
        if v.kkey is not None:
            kappa = self._kappa
            cold = v.cold_now
            price_s = v.price_s * kappa
            inv = v.inv
            v.c0 = c0 = price_s * cold
            v.s0 = s0 = cold + v.q
            v.c1 = c1 = inv * price_s
            v.kc = (
                c0,
                s0,
                c1,
                inv,
                v.usd_per_out_tok * kappa,
                v.decode_span,
                v.decode_extra * kappa,
                v.free_kv,
                v.kv_wait_per_token,
                v.load,
                v.weight,
                v.name,
                v.step,
                dcal * v.step_seq,
                dcal * v.step_kv,
                v.running,
                v.others_span,
            )
        e._pick_view = v
        self._by_name[name] = v
        return v

    def _calibration(self, v: _View, e: EndpointState) -> float:
        """e's TTFT calibration, its thin evidence filled in from its GPU class.

        ttft_ratio is an EWMA that starts at 1.0: after n samples it is d + (1 - d) x (their
        mean), d = (1 - alpha) ** n. Taking the class's pooled mean where e's own evidence is
        missing gives ratio + d x (prior - 1). Without it an endpoint that has served a few
        requests and turned out faster than its datasheet keeps winning over identical peers
        that were never tried (they keep 1.0), and traffic never spreads to them."""
        name = e.name
        n = self._dispatched.get(name, 0) - e.outstanding
        ratio = e.ttft_ratio
        key = v.cal_key
        old = self._cal_of.get(name)
        if old is not None and old.n == n and old.ratio == ratio and old.cls.key == key:
            k = old.cls  # a start() or a report: nothing new about the speed
            d = old.d
        else:
            d = _CAL_KEEP**n if n > 0 else 1.0
            num = ratio - d
            if old is not None:
                was = old.cls
                was.num -= old.num
                was.den -= 1.0 - old.d
                if was.key != key:
                    was.unsettled.pop(name, None)
            k = self._cal.get(key) or self._cal.setdefault(key, _CalClass(key))
            k.num += num
            k.den += 1.0 - d
            # tuple.__new__ directly, as for Choice: the generated __new__ is one more call.
            self._cal_of[name] = _new_choice(_CalOf, (k, n, ratio, d, num))
            if d > _CAL_SETTLED:
                k.unsettled[name] = e
            elif old is not None:
                k.unsettled.pop(name, None)
            prior = k.prior()
            if abs(prior - k.pushed) > CAL_PUSH_STEP * k.pushed:
                k.pushed = prior
                for m in k.unsettled.values():  # their views used the old prior: rebuild
                    mv = m._pick_view
                    if m is not e and mv is not None:
                        m._pick_stale = mv
                        m._pick_view = None
        cal = ratio + d * (k.pushed - 1.0)
        lo = CALIBRATION_RANGE[0]
        return cal if cal > lo else lo

    def _static_view(self, e: EndpointState, now: float, old: _View | None) -> _View:
        c = self.config
        mine = old is not None and old.picker is self
        v = _View()
        v.picker = self
        v.state = e
        v.static_version = e.static_version
        v.name = e.name
        v.url = e.url
        v.stamp = old.stamp if old is not None and mine else 0
        v.salt = old.salt if old is not None and mine else xxh64(e.name.encode("utf-8"))
        v.cold = {}
        v.adapters = {}
        v.kkey = None
        v.kkey_cold = None
        v.cal_seen = None
        v.why = e.ineligible_reason(now)
        v.cal_key = normalise_gpu_name(e.gpu_name(now))
        until = e.next_change(now)
        silent = e.silent_for(now)
        if e.reported is None or silent <= 0.0:
            v.trust = 1.0
        elif silent <= c.silent_drop_s:
            v.trust = c.stale_trust
            until = min(until, e.reported_at + e.report_ttl_s + c.silent_drop_s)
        else:
            v.trust = 0.0
        v.until = until
        if until < self._min_until:
            self._min_until = until

        r = e.fresh_report(now)
        gpu = self.gpus.get(e.gpu_name(now))
        n = max(1, e.gpus(now))
        v.tps0 = gpu.prefill_tokens_per_s * n * max(1e-6, e.speed_scale)
        v.budget = float(gpu.max_num_batched_tokens)
        v.step1 = gpu.decode_step_s(1) / n
        v.step_slope = (gpu.decode_step_s(2) - gpu.decode_step_s(1)) / n
        base, per_seq, kv = gpu.decode_step_parts()
        v.step_base = base / n
        v.step_seq = per_seq / n
        v.step_kv = kv / n
        v.slots = gpu.max_num_seqs
        v.price_s = gpu.price_per_s * n
        # The "reference" pricing (see _view for "batch", the default).
        v.usd_per_out_tok = gpu.price_per_s * gpu.decode_step_s(DECODE_REF_BATCH) / DECODE_REF_BATCH
        v.decode_span = _INF
        v.decode_extra = 0.0
        cap = e.kv_capacity(now)
        name = e.name
        if cap is not None:
            self._cap_known[name] = cap
            if name in self._cap_guessed or name not in self._cap_scale:
                # The engine told (config, report, its /metrics): what the index learnt
                # against a guess goes, and it starts over from the engine's own figure.
                # At INDEX_CAPACITY_START x that figure, as a guess does: the index learns
                # its capacity down from ghosts, which every request routed on one shows,
                # and hardly up (a prefix the index dropped draws no request to the engine
                # that still holds it), so it starts generous (module docstring).
                self._cap_guessed.discard(name)
                self._cap_scale[name] = INDEX_CAPACITY_START
        else:
            # The last figure the engine gave (a report gone stale), else a guess.
            cap = self._cap_known.get(name)
            if cap is None:
                cap = gpu.kv_tokens * n
                if name not in self._cap_scale:
                    self._cap_scale[name] = INDEX_CAPACITY_START
                    self._cap_guessed.add(name)
        v.kv_cap = float(cap)
        # Slow start: a newly healthy endpoint takes its share of load gradually.
        ramp = getattr(e, "ramp", 1.0)
        if not 0.0 < ramp < 1.0:
            ramp = 1.0
        # The capacity weight: the requests it turns over, which its decode speed sets (a
        # request spends most of its time there decoding), in the reference GPU's prefill
        # tok/s (Decision 3); the load floor stays its prefill's share of the reference's.
        v.full_weight = (
            _REF.prefill_tokens_per_s
            * n
            * max(1e-6, e.speed_scale)
            * _REF_DECODE_64
            / gpu.decode_step_s(DECODE_REF_BATCH)
        )
        v.weight = v.full_weight * ramp
        v.floor_load = self._floor * v.tps0 * ramp / _REF.prefill_tokens_per_s
        v.r_running = r.requests_running if r is not None else 0
        v.r_waiting = r.requests_waiting if r is not None else 0
        v.r_requests = v.r_running + v.r_waiting
        v.r_tokens = r.tokens_in_flight if r is not None else 0
        v.r_kv_used = v.r_kv_ctx = 0.0
        if r is not None:
            kv = float(r.tokens_in_flight)
            if r.kv_usage is not None and r.kv_capacity_tokens is not None:
                kv = max(kv, r.kv_usage * r.kv_capacity_tokens)
            # The report's KV in use counts our requests of that moment too, and lags ours
            # by up to a scrape interval: what is not ours then is the other clients' (other
            # sidecars, direct callers), added to ours now (_view). A fleet that only we
            # call reads as our own exact count, not as the scrape before our answers ended
            # (measured: Azure 4 H100 TTFT p99 1.23 -> 2.65x the best peer with the raw
            # figure, virtual clock with the probe).
            ours = e.tokens_at_report
            v.r_kv_used = max(0.0, kv - ours)
            v.r_kv_ctx = max(0.0, kv - (ours - 0.5 * e.outputs_at_report))

        # Keep the index in step with the endpoint: its capacity, and a restart.
        cap_blocks = int(cap * self._cap_scale.get(e.name, 1.0) / c.tokens_per_block)
        if old is None or not mine or old.cap_blocks != cap_blocks:
            self.index.set_capacity(e.name, cap_blocks)
        v.cap_blocks = cap_blocks
        if r is not None and self.index.observe_epoch(e.name, r.epoch):
            # Restarted: its calibration starts over (EndpointState.report), and so does the
            # count of evidence behind it.
            self._dispatched[e.name] = e.outstanding
        e._pick_view = v
        self._by_name[e.name] = v
        return v

    def _constants(self, v: _View, e: EndpointState, kkey: _KKey, now: float) -> None:
        """The request-class constants of J (see the module docstring): with U uncached
        tokens, M output tokens and the request's lambda, J = c0 + lambda * s0 +
        U * (c1 + lambda * inv) + M * usd_per_out_tok (+ the decode past its span), plus
        (U + M - free_kv) * kv_wait_per_token * lambda when that is positive, the dollars
        at the fleet's cost weight, plus lambda_d * D_e (_decode_s) from the step model's
        terms. Packed into one tuple (`kc`, None when the endpoint cannot serve the class)
        for the hot loop."""
        if v.picker is not self:
            v = self._view(e, now)
        model, adapter = kkey
        v.kkey = kkey
        if v.kkey_cold is kkey:  # a load change: the class's cold-load cost is static
            cold = v.cold_now
        else:
            v.kc = None
            if v.why is not None:
                return
            if model in v.cold:
                found = v.cold[model]
            else:
                if len(v.cold) >= MAX_REQUEST_CLASSES:
                    v.cold.clear()
                    v.adapters.clear()
                found = v.cold[model] = self._model_cold(e, model, now)
            if found is None:
                return
            cold = found
            if adapter is not None:
                if adapter in v.adapters:
                    ac = v.adapters[adapter]
                else:
                    ac = v.adapters[adapter] = self._adapter_cold(e, adapter, now)
                if ac is None:
                    return
                cold += ac
            v.cold_now = cold
            v.kkey_cold = kkey
        # J = c0 + lambda * s0 + U * (c1 + lambda * inv) + ...: dollars and seconds apart,
        # so one set serves every lambda; the dollars at the fleet's cost weight.
        kappa = self._kappa
        price_s = v.price_s * kappa
        v.c0 = c0 = price_s * cold
        v.s0 = s0 = cold + v.q
        v.c1 = c1 = v.inv * price_s
        dcal = v.dcal
        v.kc = (
            c0,
            s0,
            c1,
            v.inv,
            v.usd_per_out_tok * kappa,
            v.decode_span,
            v.decode_extra * kappa,
            v.free_kv,
            v.kv_wait_per_token,
            v.load,
            v.weight,
            v.name,
            v.step,
            dcal * v.step_seq,
            dcal * v.step_kv,
            v.running,
            v.others_span,
        )

    def _ttft(
        self,
        t: _Cand,
        prompt: int,
        max_tokens: int,
        cached_of: dict[str, float],
        now: float | None = None,
    ) -> float:
        """Predicted TTFT at t's endpoint; with `now`, its prefill queue less what the
        engine has worked off since its head started (EndpointState.prefill_since)."""
        v = t[2]
        unc = prompt - min(cached_of.get(t[1], 0.0), prompt - 1.0)
        q = v.q if now is None else _queue_now(v, now)
        ttft = v.cold_now + q + _work(unc, prompt - unc) * v.inv
        if unc + max_tokens > v.free_kv:
            ttft += (unc + max_tokens - v.free_kv) * v.kv_wait_per_token
        return ttft

    def _model_cold(self, e: EndpointState, model: str, now: float) -> float | None:
        warm = e.model_warm(model, now)
        if warm is None:
            return None
        return 0.0 if warm else self.config.model_cold_load_s

    def _adapter_cold(self, e: EndpointState, adapter: str, now: float) -> float | None:
        warm = e.adapter_warm(adapter, now)
        if warm is None:
            return None
        return 0.0 if warm else self.config.lora_cold_load_s

    def _sticky_bonus(
        self,
        task: _Task,
        match: tuple[int, float] | None,
        v: _View,
        prompt: int,
        cached: float,
        tpb: float,
    ) -> float:
        c = self.config
        held = 0 if match is None else match[0]
        # The previous output is cached only where the previous prompt still is.
        if held * tpb + tpb < task.prompt_tokens:
            return 0.0
        bonus = task.max_tokens * c.sticky_output_fraction
        bonus *= self.index.approx_confidence * v.trust
        return max(0.0, min(bonus, prompt - 1 - cached))

    def _departure(
        self,
        holder: _Cand,
        meet: list[_Cand],
        prompt: int,
        max_tokens: int,
        cached_of: dict[str, float],
        load_total: float,
        weight_sum: float,
        now: float,
        within: Callable[[_Cand], bool],
    ) -> str | None:
        """Why the affinity holder does not get this request (None: it does). In order: it
        misses the deadline (not in `meet`); its load is over affinity_imbalance x its fair
        share (weight-proportional) and over the load floor and some other endpoint is
        predicted no slower for this request: its TTFT (the recompute of the holder's
        prefix included) plus its output at each engine's decode step with this request
        in the batch (the bound sends a request elsewhere only where it ends no later), or
        it is ramping up (slow start) and outside the bounded-load rule; another
        endpoint's predicted TTFT beats its own by more than max(affinity_margin_s, the
        seconds that endpoint would spend recomputing what the holder has cached)."""
        c = self.config
        if holder not in meet:
            return "deadline"
        hv = holder[2]
        fair = load_total * hv.weight / weight_sum
        if getattr(hv.state, "ramp", 1.0) < 1.0 and not within(holder):
            return "overloaded"  # slow start: a ramping endpoint keeps the tighter bound
        over = hv.load > hv.floor_load and hv.load >= c.affinity_imbalance * fair
        ttft_h = self._ttft(holder, prompt, max_tokens, cached_of, now)
        ctx = prompt + 0.5 * max_tokens
        end_h = ttft_h + max_tokens * _step(hv, ctx)
        have = cached_of.get(holder[1], 0.0)
        faster = False
        for t in meet:
            if t is holder:
                continue
            ttft = self._ttft(t, prompt, max_tokens, cached_of, now)
            if over and ttft + max_tokens * _step(t[2], ctx) <= end_h:
                return "overloaded"
            # The prefix it would recompute, paid by this request and, as a delay, by
            # each request waiting there behind it.
            theirs = cached_of.get(t[1], 0.0)
            redo = _work(have - theirs, theirs) * t[2].inv if have > theirs else 0.0
            redo *= c.affinity_redo_weight + t[2].state.waiting
            if ttft_h > ttft + max(c.affinity_margin_s, redo):
                faster = True
        return "faster-elsewhere" if faster else None

    def _demand(
        self, key: int, uncached: float, max_tokens: int, follow_up: bool, now: float
    ) -> float:
        c = self.config
        work = max(0.0, uncached) / _REF.prefill_tokens_per_s
        work += max_tokens * _REF_DECODE_TOKEN_S
        g = self._groups.get(key)
        tau = c.demand_window_s
        if g is None:
            g = _Group(0.0, now)
            self._groups[key] = g
            if len(self._groups) > c.group_map_size:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(key)
        dt = now - g.at
        if dt > 0.0:
            g.rate *= math.exp(-dt / tau)
            g.at = now
        g.rate += work / tau
        g.follow += FOLLOW_ALPHA * ((1.0 if follow_up else 0.0) - g.follow)
        g.picks += 1
        return g.rate

    def _replica_target(
        self,
        meet: list[_Cand],
        cached_of: dict[str, float],
        matched: dict[str, tuple[int, float]],
        gk: int,
        demand: float,
        within: Callable[[_Cand], bool],
    ) -> _Cand | None:
        util = self.config.replicate_utilisation / _REF.prefill_tokens_per_s
        capacity = 0.0
        holders: set[str] = set()
        by_name = self._by_name
        for name in cached_of:
            m = matched.get(name)
            if m is not None and m[0] >= gk:
                capacity += util * by_name[name].weight
                holders.add(name)
        if not holders or demand <= capacity:
            return None
        for t in meet:  # sorted by J: the first non-holder within the bound is the best
            if t[1] not in holders and within(t):
                return t
        return None

    def _cold_hash(
        self,
        meet: list[_Cand],
        best: _Cand,
        key: int,
        tolerance: float,
        max_tokens: int,
        prompt: int,
        lam_d: float,
        within: Callable[[_Cand], bool],
        now: float,
    ) -> _Cand:
        """The least loaded per unit of capacity weight (its load plus home_weight per cold
        prompt homed there lately, _homes_now), then weighted rendezvous hashing
        (Thaler & Ravishankar; the weighted form: each endpoint draws -ln(u) / w_e from the
        key's hash and the lowest wins, so an endpoint wins a share of keys proportional to
        its capacity weight) among equals, over the endpoints within the
        bound whose J exceeds the best's by at most `tolerance` x the best's prefill-and-wait
        part (J less its decode: what a cached prefix can change)."""
        bv = best[2]
        kappa = self._kappa
        ctx = prompt + 0.5 * max_tokens
        decode = kappa * bv.decode_usd(max_tokens) + lam_d * _decode_s(bv, max_tokens, ctx)
        window = best[0] + abs(best[0] - decode) * tolerance
        # Learnt decode speeds within decode_tolerance of each other are equals: the
        # calibration's noise (an EWMA of inter-token gaps in batches that change under
        # it) is of that order, and at short prompts the decode term is most of J, so a
        # 5% difference would otherwise send every cold prompt to one engine (issue #21's
        # engine-slow run: a recovered engine at 1.05x was sent nothing). Only the part of
        # a candidate's decode cost that its calibration adds over the best's is forgiven
        # (decode cost scales with it), never its load, queue or prefill.
        bcal = bv.dcal
        top_cal = bcal * (1.0 + self._decode_tol)
        reach = window * (1.0 + self._decode_tol)  # forgiven <= J x tol / (1 + tol)
        top = best
        top_score = (_INF, _INF)
        draws = self._draws
        home_w = self.config.home_weight
        for t in meet:
            if t[0] > window:
                tv = t[2]
                if t[0] > reach:
                    break
                if not bcal < tv.dcal <= top_cal:
                    continue
                d = kappa * tv.decode_usd(max_tokens) + lam_d * _decode_s(tv, max_tokens, ctx)
                if t[0] - d * (1.0 - bcal / tv.dcal) > window:
                    continue
            if not within(t):
                continue
            v = t[2]
            x = key ^ v.salt
            draw = draws.get(x)
            if draw is None:
                # -ln(u), a pure function of the key and the name: the 64-bit mixing costs
                # ~1 us in Python integers, a hot group's picks meet the same few again.
                if len(draws) >= RENDEZVOUS_CACHE_SIZE:
                    draws.clear()
                draw = draws[x] = -math.log(((_mix(x) >> 11) + 0.5) * _TWO_M53)
            # Least loaded per unit of capacity first (a cold prompt gains nothing from
            # any one of them), the rendezvous draw among equals: idle or equally loaded
            # fleets, and so sidecars that see little of each other's load, still agree.
            s = ((v.load + home_w * self._homes_now(t[1], now)) / v.weight, draw / v.weight)
            if s < top_score:
                top, top_score = t, s
        return top

    def _choice(
        self, t: _Cand, req: PickRequest, cached_of: dict[str, float], reason: str, rank: int
    ) -> Choice:
        score, name, v = t
        # As floats once (the same values: token counts are exact doubles), so that the
        # arithmetic below is float's own, not int-with-float each time.
        prompt = float(req.prompt_tokens) if req.prompt_tokens > 1 else 1.0
        big_m = float(req.max_tokens) if req.max_tokens > 0 else 0.0
        cached = cached_of.get(name, 0.0) if cached_of else 0.0
        if cached > prompt - 1.0:
            cached = prompt - 1.0
        unc = prompt - cached
        # _work, _View.decode_usd and _step in line (a call each, ~1-2 us with cold
        # caches, up to max_choices times a pick): the same operations in the same order.
        w = unc * (1.0 + _ATTN_PAIR * (cached + 0.5 * (unc + 1.0)))
        pre = w * v.inv
        cold = v.cold_now
        fixed = cold + v.q_fixed
        ttft = cold + v.q + pre
        if unc + big_m > v.free_kv:
            kv_wait = (unc + big_m - v.free_kv) * v.kv_wait_per_token
            ttft += kv_wait
            fixed += kv_wait
        usd = big_m * v.usd_per_out_tok
        if big_m > v.decode_span:
            usd += (big_m - v.decode_span) * v.decode_extra
        cost = v.price_s * (pre + cold) + usd
        nominal = v.q_nominal + w * v.inv_nominal
        dcal = v.dcal
        step = v.step + dcal * (v.step_seq + v.step_kv * (prompt + 0.5 * big_m))
        step /= dcal  # uncalibrated: the decode sample
        # tuple.__new__ directly: the NamedTuple's generated __new__ is one more call.
        return _new_choice(
            Choice,
            (
                name,
                v.url,
                ttft,
                cost,
                int(cached),
                reason,
                score,
                rank,
                nominal,
                fixed,
                v.state,
                step,
                False,
            ),
        )

    def _add_home(self, name: str, now: float) -> None:
        self._homes[name] = (self._homes_now(name, now) + 1.0, now)

    def _homes_now(self, name: str, now: float) -> float:
        """Cold prompts homed at `name`, each weighing exp(-age / home_window_s)."""
        h = self._homes.get(name)
        if h is None:
            return 0.0
        return h[0] * math.exp((h[1] - now) / self.config.home_window_s)

    def _commit(self, req: PickRequest, choice: Choice, now: float) -> None:
        if req.block_hashes:
            self.index.record(choice.endpoint, req.block_hashes, now)
        key = req.context_key
        if key is not None:
            tasks = self._tasks
            t = tasks.get(key)
            if t is None:
                tasks[key] = _Task(choice.endpoint, req.prompt_tokens, req.max_tokens, now)
                if len(tasks) > self.config.task_map_size:
                    tasks.popitem(last=False)
            else:
                t.endpoint = choice.endpoint
                t.prompt_tokens = req.prompt_tokens
                t.max_tokens = req.max_tokens
                t.at = now
                tasks.move_to_end(key)
