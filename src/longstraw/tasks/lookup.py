"""``lookup``: an agent task over a long directory, answered with a lookup tool.

The prompt is a long directory of people (``name -> id``, one line each) and a question about a field that is not
in it: "What is the phone number of Ana Lopez?" (``hops=1``) or "... of Ana Lopez's manager?" (``hops=2``). The
model writes ``<lookup>3817</lookup>``, the environment (``observe``, a pure function of the example and the response
so far) appends ``<result>phone: 5521, manager: 6120</result>``, and the model answers with ``<answer>5521</answer>``.
Two hops need a second lookup with the manager's id from the first result.

Length is set by ``n_people`` or by ``prompt_tokens`` (the largest directory whose prompt fits; + tokenizer). Ids
have 4 digits up to 9,000 people and one more digit each time the directory outgrows them; names are drawn from ~19
million, and directories are capped at ``MAX_PEOPLE`` (refused beyond it when the task is built).

Reward: 1.0 when the first ``<answer>…</answer>`` holds the phone number, else 0.0; plus ``format_reward`` (default 0)
for each well-formed lookup of an id that exists, at most ``hops`` of them (a denser signal for small models).

A call is a match of ``<lookup> DIGITS </lookup>`` (spaces optional) on the decoded text, for the reward and the
environment alike; it ends the response when no letter or digit follows it (`ends_call`, `CallEnd`: the tokenizer
splits the closing tag in many ways, so no one tuple of ids marks it). ``gold(example)``: the protocol followed
correctly, which the trainer's warm start trains on."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from longstraw.tasks.base import Example, Task, count_tokens

CALL_OPEN, CALL_CLOSE = "<lookup>", "</lookup>"
_CALL = re.compile(r"<lookup>\s*(\d+)\s*</lookup>")
_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")
_AFTER_CALL = re.compile(r"\W*")  # what may follow a call that ends the response: no letters or digits
_SYLLABLES = ("ka", "lo", "mi", "ra", "ne", "to", "sa", "vi", "do", "pe", "lu", "ri", "an", "el", "os", "ta")
# Names are two parts of 2-3 syllables: 4,352 parts, ~19 million names. Up to a million people, redrawing a name
# already taken stays rare (< 6%); the prompt is then ~10 million tokens, beyond any model's context.
MAX_PEOPLE = 1_000_000
_LONGEST_ID = 18  # digits: longer ids (the directory's have at most 7) are no one's, and never converted to int

INSTRUCTIONS = (
    "You are an agent with one tool. To read the record of a person, write <lookup>ID</lookup> with the person's id "
    "from the directory; the record follows as <result>...</result>. Records hold a phone number and the id of the "
    "person's manager. When you know the answer, write <answer>PHONE</answer>.\n\nDirectory:\n"
)


def _name(rng: random.Random) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize() for _ in range(2))


def _people(rng: random.Random, n: int) -> list[tuple[str, int, int, int]]:
    """n people (name, id, phone, manager id), distinct names and ids; managers are other people of the list. Ids
    have the fewest digits (at least 4) whose range holds n of them."""
    names: set[str] = set()
    digits = 4
    while 9 * 10 ** (digits - 1) < n:
        digits += 1
    ids = rng.sample(range(10 ** (digits - 1), 10**digits), n)
    people = []
    for k in range(n):
        name = _name(rng)
        while name in names:
            name = _name(rng)
        names.add(name)
        j = rng.randrange(n - 1)  # another person: skip k
        manager = ids[j + 1 if j >= k else j]
        people.append((name, ids[k], rng.randint(1000, 9999), manager))
    return people


def _id(digits: str) -> int | None:
    """A written id as the directory's int, or None when it is too long to be anyone's."""
    return int(digits) if len(digits) <= _LONGEST_ID else None


def ends_call(text: str, before: str) -> bool:
    """Whether the response `text` ends with a call that `before` (the same response without its last token) had
    not completed: the environment's turn. The call counts for the reward too."""
    calls = list(_CALL.finditer(text))
    return (bool(calls) and _AFTER_CALL.fullmatch(text, calls[-1].end()) is not None
            and len(calls) > len(_CALL.findall(before)))


@dataclass(frozen=True)
class CallEnd:
    """``SamplingConfig.call_end`` for the lookup task: True when the response so far (token ids) ends a call, on
    the decoded text (`ends_call`). `decode`: the tokenizer's ids -> text."""

    decode: Callable[[list[int]], str]

    def __call__(self, ids: Any) -> bool:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if not ids or ">" not in self.decode(ids[-1:]):  # a call ends with the '>' of its closing tag
            return False
        return ends_call(self.decode(ids), self.decode(ids[:-1]))


def _prompt(people: list[tuple[str, int, int, int]], asked: int, hops: int) -> str:
    lines = "".join(f"{name} -> id {pid}\n" for name, pid, _, _ in people)
    whose = people[asked][0] + ("" if hops == 1 else "'s manager")
    return f"{INSTRUCTIONS}{lines}\nQuestion: What is the phone number of {whose}?"


@dataclass
class LookupTask(Task):
    """Answer a question about a directory with ``<lookup>ID</lookup>`` calls; give ``n_people`` or
    ``prompt_tokens`` (+ tokenizer). ``hops``: lookups the answer needs (1 or 2)."""

    tokenizer: Any = None
    prompt_tokens: int | None = None
    n_people: int | None = None
    hops: int = 1
    format_reward: float = 0.0

    def __post_init__(self) -> None:
        if (self.prompt_tokens is None) == (self.n_people is None):
            raise ValueError("give exactly one of prompt_tokens (with a tokenizer) or n_people")
        if self.prompt_tokens is not None and self.tokenizer is None:
            raise ValueError("prompt_tokens needs a tokenizer to count tokens with")
        if self.n_people is not None and not 2 <= self.n_people <= MAX_PEOPLE:
            raise ValueError(f"n_people must be >= 2 (a person and a manager) and <= {MAX_PEOPLE:,} (the lookup "
                             f"task's largest directory), got {self.n_people}")
        if self.hops not in (1, 2):
            raise ValueError(f"hops must be 1 or 2 (lookups the answer needs), got {self.hops}")
        if not 0.0 <= self.format_reward <= 1.0:
            raise ValueError(f"format_reward must be in [0, 1], got {self.format_reward}")
        if self.prompt_tokens is not None:
            base, per_line = self._sizes()
            if (self.prompt_tokens - base) // per_line + 2 > MAX_PEOPLE:
                largest = base + (MAX_PEOPLE - 2) * per_line
                raise ValueError(f"--prompt-tokens {self.prompt_tokens} asks the lookup task for a directory of about "
                                 f"{(self.prompt_tokens - base) // per_line + 2:,} people, more than its "
                                 f"{MAX_PEOPLE:,}: use --prompt-tokens {largest} or less with this tokenizer")

    def _sizes(self) -> tuple[int, int]:
        """(tokens of a two-person prompt, tokens per directory line rounded up)."""
        base = count_tokens(self.tokenizer, _prompt(_people(random.Random(0), 2), 0, self.hops))
        sample = _people(random.Random(1), 64)
        per_line = max(1, (count_tokens(self.tokenizer, "".join(f"{n} -> id {i}\n" for n, i, _, _ in sample)) + 63)
                       // 64)
        return base, per_line

    def _fit(self, rng: random.Random) -> list[tuple[str, int, int, int]]:
        """The largest directory whose prompt fits ``prompt_tokens`` (one line is ~8-12 tokens)."""
        assert self.prompt_tokens is not None
        base, per_line = self._sizes()
        if base > self.prompt_tokens:
            raise ValueError(f"prompt_tokens={self.prompt_tokens} is too small: two people already take {base} tokens")
        n = min(MAX_PEOPLE, max(2, 2 + (self.prompt_tokens - base) // per_line))
        state = rng.getstate()
        while True:
            rng.setstate(state)
            people = _people(rng, n)
            if n == 2 or count_tokens(self.tokenizer, _prompt(people, 0, self.hops)) <= self.prompt_tokens:
                return people
            n = max(2, n - max(1, n // 50))

    def sample(self, rng: random.Random) -> Example:
        people_rng = random.Random(rng.getrandbits(64))  # the count depends on the tokenizer; keep rng's stream fixed
        people = _people(people_rng, self.n_people) if self.n_people is not None else self._fit(people_rng)
        asked = people_rng.randrange(len(people))
        records = {pid: (phone, manager) for _, pid, phone, manager in people}
        target = people[asked][1] if self.hops == 1 else people[asked][3]
        prompt = _prompt(people, asked, self.hops)
        n_tok = count_tokens(self.tokenizer, prompt) if self.tokenizer is not None else None
        meta = {"task": "lookup", "hops": self.hops, "asked": people[asked][0], "asked_id": people[asked][1],
                "records": records, "people": len(people), "prompt_tokens": n_tok}
        return Example(prompt, str(records[target][0]), meta)

    def observe(self, response: str, example: Example) -> str | None:
        """The environment: the result of the response's last lookup call, or None when the response holds an
        answer (the episode is over) or ends with no call."""
        if _ANSWER.search(response):
            return None
        calls = list(_CALL.finditer(response))
        if not calls or _AFTER_CALL.fullmatch(response, calls[-1].end()) is None:
            return None  # no call, or one followed by more than punctuation: not the environment's turn
        written = calls[-1].group(1)
        pid = _id(written)
        record = None if pid is None else example.meta["records"].get(pid)
        if record is None:
            shown = written if pid is not None else f"{written[:12]}... ({len(written)} digits)"
            return f"\n<result>no person has id {shown}</result>\n"
        return f"\n<result>phone: {record[0]}, manager: {record[1]}</result>\n"

    def gold(self, example: Example) -> list[tuple[str, bool]]:
        """The protocol followed correctly, as (text, True where the policy writes it) pieces: the asked person's
        directory line (the one to read the id from, copied: a small model finds the id by continuing the line it
        copies), each lookup, the environment's result (False: an observation), then the answer."""
        pieces: list[tuple[str, bool]] = []
        response, pid = "", example.meta["asked_id"]
        for hop in range(self.hops):
            call = f"{CALL_OPEN}{pid}{CALL_CLOSE}"
            if hop == 0:
                call = f"{example.meta['asked']} -> id {pid}\n{call}"
            result = self.observe(response + call, example)
            assert result is not None  # the asked person and managers exist
            pieces += [(call, True), (result, False)]
            response += call + result
            pid = example.meta["records"][pid][1]
        pieces.append((f"<answer>{example.answer}</answer>", True))
        return pieces

    def reward(self, completion: str, example: Example) -> float:
        found = _ANSWER.search(completion)
        score = float(found is not None and found.group(1) == example.answer)
        if self.format_reward:
            valid = [m for m in _CALL.finditer(completion) if _id(m.group(1)) in example.meta["records"]]
            score += self.format_reward * min(len(valid), self.hops)
        return score
