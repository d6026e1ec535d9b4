# cython: language_level=3, boundscheck=False, wraparound=False, infer_types=False
"""Compiled twin of filters/cost_ledger.py's per-record path: `CostLedger.attempt_costs`,
`track` and `record` (the references, `*_reference` there), with
`TimingModel.gpu_seconds` inlined.
The same Python operations in the same order, on the same objects (floats stay Python
floats, so every sum is the reference's IEEE double), without the interpreter's frames:
the price, the GPU profile and its decode step, AttemptCost, the shared slices and a lone
request's answer are worked out here instead of through five Python calls an attempt.
A PriceTable, TimingModel, GpuTable or GpuProfile that is a subclass goes through its
methods, as the reference does.

What it speeds up: every finished request is priced and recorded through these (meshd/
observe.py, off the request's path but on its CPU). `python -m loadtest.sidecar_instructions
--tokens 1` (400 one-token streamed requests, callgrind), with RequestTrace.attempts a slot
and _Figures moved through its slots: 0.667-0.677 -> 0.641-0.651 M instructions a request,
of the ~0.11 M a request's accounting took (issue #22). tests/test_h47_cost_ledger_twin.py checks that the two give equal costs,
closed tasks and summaries over random records.
"""

from cpython.object cimport PyObject

from filters._slots cimport slot as _slot, slot_offset as _slot_offset, store as _store

__all__ = ["attempt_costs", "bind", "record", "track"]

# The reference module's names (`bind`).
cdef object _AttemptCost = None
cdef object _TaskResult = None
cdef object _OpenTask = None
cdef type _CostLedger = None
cdef type _PriceTable = None
cdef type _TimingModel = None
cdef type _GpuTable = None
cdef type _GpuProfile = None
cdef object _normalise = None  # filters.gpu.normalise_gpu_name
cdef dict _normalised = None  # its answers (a cache: a stale one only misses)
cdef object _answer_usd = None
cdef object _task_key_of = None
cdef object _NO_WORK_OUTCOMES = None
cdef object _ABANDONED_OUTCOMES = None
cdef str _OK = "ok"
cdef str _PREFILL = "prefill"
cdef str _REPORTED = "reported"
cdef str _MEASURED = "measured"
cdef str _ESTIMATED = "estimated"
cdef str _NO_WORK = "none"
cdef object _NO_WORK_COST = None

# _Figures' slots a record moves, read and written through their offsets (filters/_slots.pxd)
# where a figures object is exactly _Figures; None (-1 offsets) where they are not plain
# object slots, and the attributes are used.
cdef enum:
    F_REQUESTS, F_OK_REQUESTS, F_INPUT_TOKENS, F_OUTPUT_TOKENS, F_GPU_SECONDS, F_COST_USD,
    F_MODELLED_USD, F_RETRIES, F_PENDING_USD, F_ABANDONED_STREAMS, F_FAILED_REQUESTS,
    F_USEFUL_USD, F_TASKS_SUCCEEDED, F_TASKS_FAILED, N_FIGURES
_FIGURE_NAMES = (
    "requests", "ok_requests", "input_tokens", "output_tokens", "gpu_seconds", "cost_usd",
    "modelled_usd", "retries", "pending_usd", "abandoned_streams", "failed_requests",
    "useful_usd", "tasks_succeeded", "tasks_failed",
)
cdef Py_ssize_t _foff[N_FIGURES]
cdef type _Figures = None  # None: the attributes are used


def bind(ns):
    """Give the module the reference module's namespace (its globals)."""
    global _AttemptCost, _TaskResult, _OpenTask, _CostLedger, _PriceTable, _TimingModel, _GpuTable
    global _GpuProfile, _normalise, _normalised, _answer_usd, _task_key_of
    global _NO_WORK_OUTCOMES, _ABANDONED_OUTCOMES, _OK, _PREFILL, _REPORTED, _MEASURED
    global _ESTIMATED, _NO_WORK, _NO_WORK_COST
    import filters.gpu as gpu_module

    _AttemptCost = ns["AttemptCost"]
    _TaskResult = ns["TaskResult"]
    _OpenTask = ns["_OpenTask"]
    _CostLedger = ns["CostLedger"]
    _PriceTable = ns["PriceTable"]
    _TimingModel = ns["TimingModel"]
    _GpuTable = gpu_module.GpuTable
    _GpuProfile = gpu_module.GpuProfile
    _normalise = gpu_module.normalise_gpu_name
    _normalised = gpu_module._normalised
    _answer_usd = ns["answer_usd"]
    _task_key_of = ns["task_key_of"]
    _NO_WORK_OUTCOMES = ns["NO_WORK_OUTCOMES"]
    _ABANDONED_OUTCOMES = ns["ABANDONED_OUTCOMES"]
    _OK = ns["OK_OUTCOME"]
    _PREFILL = ns["PREFILL_REASON"]
    _REPORTED = ns["REPORTED"]
    _MEASURED = ns["MEASURED"]
    _ESTIMATED = ns["ESTIMATED"]
    _NO_WORK = ns["NO_WORK"]
    _NO_WORK_COST = tuple.__new__(_AttemptCost, (0.0, 0.0, _NO_WORK, 0.0, 0.0, 0.0, 0, 0))
    global _Figures
    _Figures = None
    figures = ns["_Figures"]
    if figures.__getattribute__ is not object.__getattribute__:
        return
    if figures.__setattr__ is not object.__setattr__:
        return
    for i, name in enumerate(_FIGURE_NAMES):
        _foff[i] = _slot_offset(figures, name, True)
        if _foff[i] < 0:
            return
    _Figures = figures


cdef inline int _add(object f, int field, object amount) except -1:
    """`f.<field> += amount` on a _Figures, through its slot."""
    cdef PyObject *held = _slot(f, _foff[field])
    if held == NULL:
        raise AttributeError(_FIGURE_NAMES[field])
    value = <object>held
    value += amount
    _store(f, _foff[field], value)
    return 0


cdef inline int _sub(object f, int field, object amount) except -1:
    """`f.<field> -= amount` on a _Figures, through its slot."""
    cdef PyObject *held = _slot(f, _foff[field])
    if held == NULL:
        raise AttributeError(_FIGURE_NAMES[field])
    value = <object>held
    value -= amount
    _store(f, _foff[field], value)
    return 0


cdef int _move(object f, bint ok, bint abandoned, bint lone, object ok_obj,
               object prompt_tokens, object completion_tokens, object seconds, object usd,
               object modelled_usd, object final_usd, object settle) except -1:
    """`record`'s moves of one _Figures, in its order."""
    _add(f, F_REQUESTS, 1)
    _add(f, F_OK_REQUESTS, ok_obj)
    _add(f, F_INPUT_TOKENS, prompt_tokens)
    _add(f, F_OUTPUT_TOKENS, completion_tokens)
    _add(f, F_GPU_SECONDS, seconds)
    _add(f, F_COST_USD, usd)
    _add(f, F_MODELLED_USD, modelled_usd)
    if ok:
        _add(f, F_RETRIES, usd - final_usd)
        _add(f, F_PENDING_USD, final_usd)
    elif abandoned:
        _add(f, F_ABANDONED_STREAMS, usd)
    else:
        _add(f, F_FAILED_REQUESTS, usd)
    if lone:
        if ok:
            _sub(f, F_PENDING_USD, settle)
            _add(f, F_USEFUL_USD, settle)
            _add(f, F_TASKS_SUCCEEDED, 1)
        else:
            _add(f, F_TASKS_FAILED, 1)
    return 0


cdef inline object _name(object gpu):
    """filters.gpu.normalise_gpu_name(gpu), its remembered answer looked up here."""
    if not gpu:
        return "unknown"
    if type(gpu) is str:
        key = _normalised.get(gpu)
        if key is not None:
            return key
    return _normalise(gpu)


cdef inline object _per_second(object prices, object gpu):
    """prices.per_second(gpu)."""
    if type(prices) is not _PriceTable:
        return prices.per_second(gpu)
    table = <dict>prices._prices
    return table.get(_name(gpu), table["unknown"]) / 3600.0


cdef inline object _profile(object gpus, object gpu):
    """gpus.get(gpu) for a GpuTable."""
    table = <dict>gpus._table
    return table.get(_name(gpu), table["unknown"])


cdef object _gpu_seconds(object timing, object gpu, object prompt_tokens, object cached_tokens,
                         object completion_tokens):
    """timing.gpu_seconds(gpu, prompt_tokens, cached_tokens, completion_tokens)."""
    if type(timing) is not _TimingModel:
        return timing.gpu_seconds(gpu, prompt_tokens, cached_tokens, completion_tokens)
    gpus = timing.gpus
    if type(gpus) is _GpuTable:
        profile = _profile(gpus, gpu)
    else:
        profile = gpus.get(gpu)
    if not cached_tokens > 0:
        cached_tokens = 0
    uncached = prompt_tokens - cached_tokens
    prefill = (uncached if uncached > 0 else 0) / profile.prefill_tokens_per_s
    batch = timing.decode_batch
    if not batch > 1:
        batch = 1
    if type(profile) is _GpuProfile:
        # GpuProfile.decode_step_s(batch), batch > 1 already
        b1 = profile.decode_step_s_b1
        slope = (profile.decode_step_s_b64 - b1) / 63.0
        step = b1 + slope * ((batch if batch > 1 else 1) - 1)
    else:
        step = profile.decode_step_s(batch)
    decode = (completion_tokens if completion_tokens > 0 else 0) * step / batch
    return prefill + decode


cdef tuple _modelled(object timing, object gpu, object prompt, object cached, object tokens):
    """(prefill, modelled): timing.gpu_seconds(gpu, prompt, cached, 0), and it plus
    timing.gpu_seconds(gpu, 0, 0, tokens), the GPU's profile, batch and decode step looked
    up once for the two (the same objects each call would find)."""
    if type(timing) is not _TimingModel or type(timing.gpus) is not _GpuTable:
        prefill = _gpu_seconds(timing, gpu, prompt, cached, 0)
        return prefill, prefill + _gpu_seconds(timing, gpu, 0, 0, tokens)
    profile = _profile(timing.gpus, gpu)
    if type(profile) is not _GpuProfile:
        prefill = _gpu_seconds(timing, gpu, prompt, cached, 0)
        return prefill, prefill + _gpu_seconds(timing, gpu, 0, 0, tokens)
    rate = profile.prefill_tokens_per_s
    batch = timing.decode_batch
    if not batch > 1:
        batch = 1
    b1 = profile.decode_step_s_b1
    slope = (profile.decode_step_s_b64 - b1) / 63.0
    step = b1 + slope * ((batch if batch > 1 else 1) - 1)
    # the first call: (prompt, cached, 0)
    if not cached > 0:
        cached = 0
    uncached = prompt - cached
    prefill = (uncached if uncached > 0 else 0) / rate + 0 * step / batch
    # the second: (0, 0, tokens)
    second = 0 / rate + (tokens if tokens > 0 else 0) * step / batch
    return prefill, prefill + second


cdef inline object _cost(seconds, price, reading, modelled, prefill, prompt, tokens):
    return tuple.__new__(
        _AttemptCost,
        (seconds, seconds * price, reading, modelled, modelled * price, prefill, prompt, tokens),
    )


def attempt_costs(self, record):
    """CostLedger.attempt_costs."""
    prompt = record.prompt_tokens or 0
    timing = self.timing
    prices = self.prices
    attempts = record.attempts
    if not attempts:
        gpu = record.gpu
        price = _per_second(prices, gpu)
        completion = record.completion_tokens or 0
        work = record.outcome not in _NO_WORK_OUTCOMES
        if not work:
            prompt = completion = 0
        prefill, modelled = _modelled(timing, gpu, prompt, record.cached_tokens or 0, completion)
        seconds, reading = record.gpu_seconds, _REPORTED
        if seconds is None:
            seconds, reading = modelled, _ESTIMATED if work else _NO_WORK
        return [_cost(seconds, price, reading, modelled, prefill, prompt, completion)]
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t last = len(attempts) - 1
    out = []
    earlier_tokens = 0
    if last:
        # Tokens earlier attempts sent the client (a prefill step's one token never is).
        earlier_tokens = sum(
            [a.completion_tokens or 0 for a in attempts[:last] if not (a.reason == _PREFILL)]
        )
    busy = self.busy
    for a in attempts:
        gpu = a.gpu or record.gpu
        price = _per_second(prices, gpu)
        seconds = a.gpu_seconds
        if a.outcome in _NO_WORK_OUTCOMES and seconds is None:
            out.append(_NO_WORK_COST)
            i += 1
            continue
        if i == last:
            cached = a.cached_tokens
            if cached is None:
                cached = record.cached_tokens
            tokens = a.completion_tokens
            if tokens is None:  # the rest of what the client got
                tokens = (record.completion_tokens or 0) - earlier_tokens
                if not tokens > 0:  # max(0, ...)
                    tokens = 0
        else:
            cached, tokens = a.cached_tokens, a.completion_tokens
        prefill, modelled = _modelled(timing, gpu, prompt, cached or 0, tokens or 0)
        if seconds is not None:
            reading = _MEASURED if a.gpu_seconds_source == _MEASURED else _REPORTED
        else:
            factor = busy.factor(a.endpoint) if busy is not None else None
            if factor is None:
                seconds, reading = modelled, _ESTIMATED
            else:
                seconds, reading = modelled * factor, _MEASURED
        out.append(_cost(seconds, price, reading, modelled, prefill, prompt, tokens or 0))
        i += 1
    return out


def track(self, record, costs):
    """CostLedger.track."""
    busy = self.busy
    if busy is None:
        return None
    e2e = record.e2e_s or 0.0
    ts = record.ts
    end = ts + (e2e if e2e > 0.0 else 0.0)
    attempts = record.attempts
    # An apportioner with no engine's reading answers None to every `work` (nothing else
    # happens in it): the same answers without its call and the attempts' times.
    idle = busy.endpoints == 0
    if not attempts:
        c = costs[0]
        endpoint = record.endpoint
        if not endpoint or c[2] == _NO_WORK or idle:
            return [None]
        return [
            busy.work(
                endpoint, ts, end,
                prefill_s=c[5], decode_s=c[3] - c[5],
                prompt_tokens=c[6], output_tokens=c[7],
                tracked=False,
            )
        ]  # fmt: skip
    if idle and len(attempts) == len(costs):
        return [None] * len(attempts)
    out = []
    for a, c in zip(attempts, costs, strict=True):
        start, stop = a.started_ts, a.ended_ts
        out.append(
            busy.work(
                a.endpoint,
                ts if start is None else start,
                end if stop is None else stop,
                prefill_s=c[5],
                decode_s=c[3] - c[5],
                prompt_tokens=c[6],
                output_tokens=c[7],
                first_token=a.first_token_ts,
                tracked=start is not None,
            )
        )
    return out


cdef _see_endpoints(self, record, attempts):
    """CostLedger._see_endpoints."""
    cdef dict seen = self._seen
    if attempts:
        for a in attempts:
            _see(self, seen, a.endpoint, a.gpu or record.gpu)
    else:
        _see(self, seen, record.endpoint, record.gpu)


cdef inline _see(self, dict seen, endpoint, gpu):
    if not endpoint:
        return
    if endpoint in seen:
        if gpu:  # the latest GPU it reported
            seen[endpoint] = gpu
    elif len(seen) < self.max_fleet_endpoints:
        seen[endpoint] = gpu
    else:
        self._untracked += 1


def record(self, record, costs=None, *, tracked=False):
    """CostLedger.record."""
    closed = self.close_idle(record.ts) if self._open else []
    ts = record.ts
    if ts > self._now:
        self._now = ts
    if ts < self._first_start:
        self._first_start = ts
    e2e = record.e2e_s or 0.0
    end = ts + (e2e if e2e > 0.0 else 0.0)
    if end > self._last_end:
        self._last_end = end
    attempts = record.attempts
    if self._fleet is None:
        if type(self) is _CostLedger:
            _see_endpoints(self, record, attempts)
        else:
            self._see_endpoints(record, attempts)
    tenant = record.tenant or "-"
    model = record.model or "-"
    pool = record.pool or "-"
    if costs is None:
        costs = self.attempt_costs(record)
    readings = self._readings
    estimated = False
    seconds = usd = modelled_usd = 0.0
    for c in costs:
        seconds += c.seconds
        usd += c.usd
        modelled_usd += c.modelled_usd
        reading = c.reading
        if reading == _NO_WORK:
            continue
        estimated = estimated or reading == _ESTIMATED
        tally = readings.get(reading)
        if tally is None:
            tally = readings[reading] = [0, 0.0, 0.0, 0.0]
        tally[0] += 1
        tally[1] += c.seconds
        tally[2] += c.usd
        tally[3] += c.modelled_usd
    if estimated:
        self._estimated += 1
    if self.busy is not None and not tracked:
        self.track(record, costs)
    outcome = record.outcome
    ok = outcome == _OK
    # The answer's cost: its final attempt, and a prefill step that served it.
    if len(costs) == 1 and len(attempts) <= 1:
        final_usd = costs[0].usd + 0
    else:
        final_usd = _answer_usd(attempts, costs)
    prompt_tokens = record.prompt_tokens or 0
    completion_tokens = record.completion_tokens or 0
    abandoned = not ok and outcome in _ABANDONED_OUTCOMES
    task_id = record.task_id
    lone = not task_id and not record.workflow_id
    settle = 0.0 + final_usd
    one = self._one
    if type(self) is _CostLedger and one is not None and tenant == one[0] and model == one[1]:
        slices = self._one_slices  # CostLedger._slices's first answer
    else:
        slices = self._slices(tenant, model)
    for figures in slices:
        if _Figures is not None and type(figures) is _Figures:
            _move(figures, ok, abandoned, lone, ok, prompt_tokens, completion_tokens, seconds,
                  usd, modelled_usd, final_usd, settle)
            continue
        figures.requests += 1
        figures.ok_requests += ok
        figures.input_tokens += prompt_tokens
        figures.output_tokens += completion_tokens
        figures.gpu_seconds += seconds
        figures.cost_usd += usd
        figures.modelled_usd += modelled_usd
        if ok:
            figures.retries += usd - final_usd
            figures.pending_usd += final_usd
        elif abandoned:
            figures.abandoned_streams += usd
        else:
            figures.failed_requests += usd
        if lone:
            if ok:
                figures.pending_usd -= settle
                figures.useful_usd += settle
                figures.tasks_succeeded += 1
            else:
                figures.tasks_failed += 1
    if lone:
        closed.append(
            tuple.__new__(
                _TaskResult,
                (
                    "request:" + record.request_id, tenant, model, ok, 1, 0.0 + usd,
                    0.0 + (usd - final_usd) if ok else 0.0 + usd + 0, ts, ts,
                    "final_ok" if ok else "final", pool, 0 + settle if ok else 0,
                ),
            )
        )  # fmt: skip
        return closed

    key = _task_key_of(record)
    open_tasks = self._open
    task = open_tasks.get(key)
    if task is None:
        task = _OpenTask(tenant, model, pool, record.ts, record.ts)
        open_tasks[key] = task
    else:
        open_tasks.move_to_end(key)
    r_ts = record.ts
    last_ts = task.last_ts
    task.last_ts = r_ts if r_ts > last_ts else last_ts  # max(), as the builtin picks
    task.pool = pool
    task.requests += 1
    task.cost_usd += usd
    task.wasted_usd += usd - final_usd if ok else usd
    task.last_ok = ok
    if ok:
        task.pending[(tenant, model)] = task.pending.get((tenant, model), 0.0) + final_usd
    final = record.final
    if final is not None:
        is_final = final
    else:
        step = record.step
        steps_in_task = record.steps_in_task
        is_final = step is not None and steps_in_task is not None and step >= steps_in_task - 1
    task.knows_final = task.knows_final or final is not None or record.steps_in_task is not None
    if is_final and ok:
        task.model = model
        closed.append(self._close(key, succeeded=ok, reason="final_ok" if ok else "final"))
    while len(open_tasks) > self.max_open_tasks:
        oldest = next(iter(open_tasks))
        self._evicted += 1
        closed.append(self._close_judged(oldest, "evicted"))
    return closed
