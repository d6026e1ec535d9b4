"""The planned request: one value per request a benchmark run will send.

Also the contract for dependent steps (multi-turn turns, agentic steps): their text can't
be known in advance because it includes the previous answer, so the runner builds it with
`render` (or `extend` / `extend_messages`) from what it actually sent and received.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from loadtest.workloads.text import join_text

Role = Literal["system", "user", "assistant"]
Kind = Literal["completion", "chat"]


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message (OpenAI chat-completions shape)."""

    role: Role
    content: str

    def to_openai(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a workload, planned before the run.

    Fields:
      request_id: unique within a workload (and within a `mix`), e.g. "agentic-0-task3-step1"
        or "synthetic_trace:17" (trace file stem : line number).
      workload: name of the generator or trace stem that produced it (for breakdowns).
      at_s: planned send time, seconds from the start of the run. For an independent request
        this is when the runner sends it (open loop). For a dependent step
        (`depends_on_previous`) it is a lower bound: predecessor's at_s + think_s, i.e. the
        send time if every response were instant; the runner sends it at
        predecessor_completed + think_s, which is never earlier.
      kind: "completion" (/v1/completions, uses `prompt`) or "chat" (/v1/chat/completions,
        uses `messages`); exactly one of prompt/messages is set.
      prompt: completion text this request contributes. Independent: the whole prompt.
        Dependent: only the new turn; the prompt to send is
        extend(previous_sent_prompt, previous_answer, prompt).
      messages: chat messages this request contributes. Independent: the whole list.
        Dependent: only the new messages; send
        extend_messages(previous_sent_messages, previous_answer, messages).
      max_tokens: the request's max_tokens (>= 1).
      prompt_tokens: word-level tokens (`count_tokens`) of this request's own text: `prompt`,
        or the sum over `messages` contents. For a dependent step the sent prompt is longer
        (previous context + answer + this).
      tenant, priority: tenant name and its priority, 0..9, higher is more important.
      session_id: chat session this turn belongs to (multi-turn), else None.
      task_id: agentic task this step belongs to, else None.
      step: index of this request within its chain (task or session), 0-based, else None.
      steps_in_task: number of requests in that chain, else None.
      deadline_ms: latency budget of this request, from its send, else None.
      task_deadline_ms: latency budget of the whole task, from the send of its step 0; the
        runner should pass the remaining budget when it sends a later step. None if none.
      depends_on_previous: the runner MUST wait until the previous step of the same chain
        (same task_id/session_id, step - 1) has completed, then wait think_s, then send
        the text built by `render`.
      think_s: for a dependent step, the pause (user think time or tool run time) between
        the previous step's completion and this send; 0.0 otherwise.
      block_ids: ids of the prompt's blocks in order, for the cache hit-rate bounds: trace
        hash ids (Mooncake), or generated ids. For a dependent step, the blocks of the
        whole context except the previous answers (unknown in advance): the previous step's
        block_ids followed by this request's own blocks.
    """

    request_id: str
    workload: str
    at_s: float
    kind: Kind
    prompt: str | None
    messages: tuple[Message, ...] | None
    max_tokens: int
    prompt_tokens: int
    tenant: str = "default"
    priority: int = 5
    session_id: str | None = None
    task_id: str | None = None
    step: int | None = None
    steps_in_task: int | None = None
    deadline_ms: int | None = None
    task_deadline_ms: int | None = None
    depends_on_previous: bool = False
    think_s: float = 0.0
    block_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Cheap structural checks only: counting tokens here would cost a split of every
        # (possibly 100k-token) prompt; tests check prompt_tokens instead.
        where = f"planned request {self.request_id!r}"
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"{where}: at_s must be finite and >= 0, got {self.at_s}")
        if self.kind == "completion":
            if self.prompt is None or self.messages is not None:
                raise ValueError(f"{where}: a completion has a prompt and no messages")
        elif self.kind == "chat":
            if self.messages is None or not self.messages or self.prompt is not None:
                raise ValueError(f"{where}: a chat request has messages and no prompt")
        else:
            raise ValueError(f"{where}: unknown kind {self.kind!r}")
        if self.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.prompt_tokens < 0:
            raise ValueError(f"{where}: prompt_tokens must be >= 0")
        if not 0 <= self.priority <= 9:
            raise ValueError(f"{where}: priority must be 0..9, got {self.priority}")
        if (self.step is None) != (self.steps_in_task is None):
            raise ValueError(f"{where}: step and steps_in_task are set together")
        if (
            self.step is not None
            and self.steps_in_task is not None
            and not 0 <= self.step < self.steps_in_task
        ):
            raise ValueError(f"{where}: step {self.step} not in 0..{self.steps_in_task - 1}")
        if self.depends_on_previous and (self.chain_id is None or not self.step):
            raise ValueError(f"{where}: a dependent request needs a chain id and step >= 1")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"{where}: think_s must be finite and >= 0")
        for name in ("deadline_ms", "task_deadline_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{where}: {name} must be > 0, got {value}")

    @property
    def chain_id(self) -> str | None:
        """The task id, else the session id: the chain whose steps depend on each other."""
        return self.task_id if self.task_id is not None else self.session_id

    @property
    def own_text(self) -> str:
        """This request's own text (prompt, or message contents joined by spaces)."""
        if self.prompt is not None:
            return self.prompt
        return join_text(m.content for m in self.messages or ())


def extend(previous_prompt: str, previous_answer: str, new_turn: str) -> str:
    """The prompt of a dependent completion step: previous prompt + answer + new turn.

    Joined by single spaces; the answer's outer whitespace is stripped. Token counts add:
    count_tokens(result) == sum of the three counts.
    """
    return join_text((previous_prompt, previous_answer.strip(), new_turn))


def extend_messages(
    previous_messages: tuple[Message, ...],
    previous_answer: str,
    new_messages: tuple[Message, ...],
) -> tuple[Message, ...]:
    """The messages of a dependent chat turn: previous messages + assistant answer + new."""
    return (*previous_messages, Message("assistant", previous_answer), *new_messages)


def render(
    request: PlannedRequest,
    previous_sent: str | tuple[Message, ...] | None = None,
    previous_answer: str = "",
) -> str | tuple[Message, ...]:
    """What to send for `request`: a prompt (completion) or messages (chat).

    `previous_sent` is what `render` returned for the previous step of the same chain and
    `previous_answer` the text that step generated; both are ignored for an independent
    request and required for a dependent one.
    """
    if not request.depends_on_previous:
        if request.prompt is not None:
            return request.prompt
        assert request.messages is not None  # guaranteed by __post_init__
        return request.messages
    if previous_sent is None:
        raise ValueError(
            f"{request.request_id} depends on step {request.step - 1 if request.step else 0} "
            "of its chain: pass what was sent for it and its answer"
        )
    if request.prompt is not None:
        if not isinstance(previous_sent, str):
            raise TypeError(f"{request.request_id}: previous_sent of a completion is a str")
        return extend(previous_sent, previous_answer, request.prompt)
    assert request.messages is not None
    if isinstance(previous_sent, str):
        raise TypeError(f"{request.request_id}: previous_sent of a chat turn is messages")
    return extend_messages(previous_sent, previous_answer, request.messages)
