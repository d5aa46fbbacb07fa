"""Multi-turn workloads whose prompts share prefixes, for prefix-cache routing.

``Conversations`` draws sessions of three kinds, mixed:

* **chat**: a conversation under one of a few shared system prompts; each turn's prompt is the
  system prompt, every earlier user message and answer, and the new message (the way chat
  clients send them), a few turns apart;
* **agent**: a tool loop: many short steps, each appending the model's last output and a tool's
  result (long, growing contexts) under its own system prompt;
* **single**: an unrelated one-off request (nothing to share).

Sessions start as a Poisson process at ``rate`` for ``duration_s``; a session's next turn
arrives its think time after the previous turn's answer would have ended at a nominal
``answer_s_per_token`` (the trace is drawn ahead, so a slow fleet may see a turn before the
previous answer is done, as an impatient client). Token ids are random per segment; a later
turn repeats the earlier ones exactly, so its prompt's leading blocks are the earlier turn's.
Every draw comes from ``seed``.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from shoal_protos.prefix import chain_hashes


@dataclass(frozen=True)
class Conversations:
    rate: float
    """Sessions started per second."""
    duration_s: float
    """Sessions start until then, and turns that would come later are not sent: the load is
    steady once the first sessions have ended."""
    system_prompts: int = 8
    system_tokens: int = 1024
    chat_turns: float = 5.0
    """Mean turns of a chat session (geometric)."""
    agent_share: float = 0.25
    agent_steps: float = 10.0
    """Mean steps of an agent session (geometric)."""
    tool_tokens: float = 384
    """Median tokens a tool's result adds to an agent's context (lognormal)."""
    single_share: float = 0.2
    user_tokens: float = 96
    """Median tokens of a user message (lognormal)."""
    output_tokens: float = 192
    """Median tokens of an answer (lognormal); an agent's steps answer a quarter of it."""
    think_s: float = 8.0
    """Mean time between an answer and the next turn of a chat (exponential); a fifth of it
    for an agent's next step."""
    answer_s_per_token: float = 0.02
    max_model_len: int = 16384
    vocab: int = 32_000
    seed: int = 0

    @functools.cached_property
    def _drawn(self) -> list[tuple[float, list[int], int]]:
        rng = random.Random(self.seed)
        systems = [self._tokens(rng, self.system_tokens) for _ in range(self.system_prompts)]
        requests: list[tuple[float, list[int], int]] = []
        start = rng.expovariate(self.rate)
        while start < self.duration_s:
            kind = rng.random()
            if kind < self.single_share:
                prompt = self._tokens(rng, self._length(rng, 4 * self.user_tokens))
                requests.append((start, prompt, self._output(rng, 1.0, len(prompt))))
            elif kind < self.single_share + self.agent_share:
                requests += self._session(rng, start, self._tokens(rng, self.system_tokens), agent=True)
            else:
                requests += self._session(rng, start, systems[rng.randrange(len(systems))], agent=False)
            start += rng.expovariate(self.rate)
        requests = [request for request in requests if request[0] < self.duration_s]
        requests.sort(key=lambda request: request[0])
        return requests

    def _session(
        self, rng: random.Random, start: float, system: list[int], agent: bool
    ) -> list[tuple[float, list[int], int]]:
        turns = self._geometric(rng, self.agent_steps if agent else self.chat_turns)
        context, now = list(system), start
        out: list[tuple[float, list[int], int]] = []
        for _ in range(turns):
            added = self._length(rng, self.tool_tokens if agent and out else self.user_tokens)
            context += self._tokens(rng, added)
            output = self._output(rng, 0.25 if agent else 1.0, len(context))
            if output < 4:
                break  # the context is full: the session ends
            out.append((now, list(context), output))
            context += self._tokens(rng, output)  # the answer, as the next turn sends it back
            think = rng.expovariate(1.0 / (self.think_s / 5 if agent else self.think_s))
            now += output * self.answer_s_per_token + think
        return out

    def _tokens(self, rng: random.Random, count: int) -> list[int]:
        return [rng.randrange(self.vocab) for _ in range(count)]

    def _length(self, rng: random.Random, median: float) -> int:
        return max(4, round(rng.lognormvariate(math.log(median), 0.8)))

    def _output(self, rng: random.Random, scale: float, context: int) -> int:
        return min(max(4, round(self._length(rng, self.output_tokens * scale))), self.max_model_len - context)

    @staticmethod
    def _geometric(rng: random.Random, mean: float) -> int:
        return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean)) if mean > 1 else 1

    # ---- what the fleet simulation reads (as ``shoal_sim.fleet.Workload``) --------------------

    @property
    def requests(self) -> int:
        return len(self._drawn)

    def draw(self) -> list[tuple[float, int, int]]:
        """(arrival time, prompt tokens, output tokens) of each request, by arrival."""
        return [(arrival, len(prompt), output) for arrival, prompt, output in self._drawn]

    def prompts(self) -> list[list[int]]:
        """Each request's prompt token ids, by arrival."""
        return [prompt for _, prompt, _ in self._drawn]

    def priorities(self) -> list[bool]:
        return [False] * self.requests

    def shared_tokens(self, block_size: int = 16) -> float:
        """The share of all prompt tokens that are full blocks repeating an earlier prompt's
        leading ones: what a prefix cache that never evicts could skip."""
        seen: set[int] = set()
        total = shared = 0
        for _, prompt, _ in self._drawn:
            total += len(prompt)
            hashes = chain_hashes(prompt, block_size)
            for block in hashes:
                if block not in seen:
                    break
                shared += block_size
            seen.update(hashes)
        return shared / total if total else 0.0
