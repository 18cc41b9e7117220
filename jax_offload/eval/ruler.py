"""RULER needle-in-a-haystack prompts (the eight NIAH tasks), generated offline and reproducibly.

Follows NVIDIA/RULER's `scripts/synthetic.yaml` task table and `scripts/data/synthetic/niah.py`:
needle `One of the special magic {numbers|uuids} for {key} is: {value}.`, haystacks `repeat`,
`essay` and `needle`, and the plural template with its answer prefix (RULER's singular rewrite
for one-answer tasks is not applied; the template is the one in DESIGN.md). Differences:

- The essay is Jane Austen's *Persuasion* (public domain, `data/persuasion.txt`), cycled when a
  prompt needs more words than it has; RULER ships Paul Graham's essays.
- Every sample's haystack size is fitted to `target_len` on its own (RULER fits once and shrinks
  on overflow), in sentences for `repeat` and words for `essay` and `needle` (RULER sizes
  `repeat` and `needle` in whole blocks and needles), so every prompt is <= `target_len` tokens
  and within a few tokens of it; the last block stops early, and the last sentence or distractor
  needle may be cut short, as RULER cuts its essay.
- Depths are spread evenly instead of sampled: sample `i` of `N` has offset `u = i / (N - 1)`
  and its `k` needles sit at depths `(j + u) / k`, `j = 0..k-1` (one needle: `u` itself, so
  depths 0 and 1 are both covered). Each needle goes to the unit boundary (between sentences,
  blocks or distractor needles) nearest its depth.
- Distractor keys never equal a key of the sample, so the expected answer is unambiguous.

Chat template: off by default, i.e. RULER's `base` model template (the default of its
`prepare.py`): the prompt is `task + answer_prefix`, tokenized with the tokenizer's own special
tokens (e.g. BOS). `chat_template=True` does what RULER does for chat models:
`apply_chat_template([user: task], add_generation_prompt=True) + answer_prefix`, so greedy
decoding continues the answer prefix inside the assistant turn. Why off: the evaluation exists to
catch wrong KV, so its baseline should be near 100%. SmolLM2-135M-Instruct with transformers'
greedy generate at 1K tokens scored niah_single_1 90% bare vs 50% in its chat template (10
samples; 100% vs 60% on 5 others) -- in the template it starts reciting the repeat haystack --
and niah_single_2 100% either way; dropping the answer prefix's leading space changed nothing.
"""

from __future__ import annotations

import math
import random
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
)

NEEDLE = "One of the special magic {type} for {key} is: {value}."
TEMPLATE = (
    "Some special magic {type} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type} afterwards.\n{context}\n"
    "What are all the special magic {type} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type} for {query} mentioned in the provided text are"
REPEAT_BLOCK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
REPEAT_SENTENCES = tuple(s + "." for s in REPEAT_BLOCK.rstrip(".").split(". "))

DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class TaskConfig:
    """One row of RULER's synthetic.yaml for the niah task."""

    haystack: str  # "repeat" | "essay" | "needle"
    key_type: str  # "words" | "uuids"
    value_type: str  # "numbers" | "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


TASK_CONFIGS = {
    "niah_single_1": TaskConfig("repeat", "words", "numbers"),
    "niah_single_2": TaskConfig("essay", "words", "numbers"),
    "niah_single_3": TaskConfig("essay", "words", "uuids"),
    "niah_multikey_1": TaskConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": TaskConfig("needle", "words", "numbers"),
    "niah_multikey_3": TaskConfig("needle", "uuids", "uuids"),
    "niah_multivalue": TaskConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": TaskConfig("essay", "words", "numbers", num_keys=4, num_queries=4),
}


@dataclass
class NiahSample:
    """One prompt. `depths[i]` is where the needle holding `answers[i]` sits, as the fraction of
    haystack words before it (0 = start of the context, 1 = end)."""

    task: str
    index: int
    prompt_ids: list[int]
    prompt_text: str
    answers: list[str]
    depths: list[float]
    length: int


@lru_cache(maxsize=None)
def essay_sentences() -> tuple[tuple[str, ...], ...]:
    """The essay as sentences, each a tuple of words."""
    text = re.sub(r"\s+", " ", (DATA_DIR / "persuasion.txt").read_text(encoding="utf-8")).strip()
    # A sentence ends at . ! or ? (maybe followed by a closing quote or bracket) before a space and
    # a capital or an opening quote.
    sentences = re.split(r"(?:(?<=[.!?])|(?<=[.!?][\"')]))\s+(?=[A-Z\"'(])", text)
    return tuple(tuple(s.split(" ")) for s in sentences if s)


@lru_cache(maxsize=None)
def _key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    read = lambda name: tuple((DATA_DIR / name).read_text(encoding="utf-8").split())
    return read("adjectives.txt"), read("nouns.txt")


def fresh_value(kind: str, rng: random.Random, taken: set[str]) -> str:
    """A random value of `kind` that is not in `taken`."""
    while True:
        if kind == "numbers":
            value = str(rng.randint(10**6, 10**7 - 1))
        elif kind == "uuids":
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            adjectives, nouns = _key_words()
            value = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if value not in taken:
            return value


def _distinct(kind: str, rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """`count` fresh values of `kind`, none in `taken`; `taken` is extended with them."""
    out = []
    for _ in range(count):
        out.append(fresh_value(kind, rng, taken))
        taken.add(out[-1])
    return out


class _Distractors:
    """An endless, prefix-stable stream of distractor needles (as word tuples), so a longer
    haystack only appends to a shorter one."""

    def __init__(self, cfg: TaskConfig, rng: random.Random, forbidden: set[str]):
        self._cfg, self._rng, self._forbidden = cfg, rng, forbidden
        self._needles: list[tuple[str, ...]] = []

    def __getitem__(self, i: int) -> tuple[str, ...]:
        while len(self._needles) <= i:
            key = fresh_value(self._cfg.key_type, self._rng, self._forbidden)
            value = fresh_value(self._cfg.value_type, self._rng, self._forbidden)
            self._needles.append(tuple(NEEDLE.format(type=self._cfg.value_type, key=key, value=value).split(" ")))
        return self._needles[i]


def _take_words(sentence: Callable[[int], tuple[str, ...]], n: int) -> tuple[list[str], list[int]]:
    """The first `n` words of a sentence stream, as whole sentences and a last one cut short
    (as RULER cuts its essay), with their word counts."""
    units, counts, left, i = [], [], n, 0
    while left > 0:
        words = sentence(i)[:left]
        units.append(" ".join(words))
        counts.append(len(words))
        left -= len(words)
        i += 1
    return units, counts


def _haystack_units(cfg: TaskConfig, n: int, distractors: _Distractors) -> tuple[list[str], list[int], str]:
    """A haystack of size `n` as (units, word counts, separator); needles go between units.

    Units are RULER's: 5-sentence blocks for `repeat`, sentences for `essay`, distractor needles
    for `needle`. Size is in sentences for `repeat` (the last block may stop early) and in words
    for the others (the last unit may be cut short, as RULER cuts its essay); RULER sizes `repeat`
    and `needle` in whole units, too coarse to land within a few tokens of the target."""
    if cfg.haystack == "repeat":
        blocks = [REPEAT_BLOCK] * (n // len(REPEAT_SENTENCES))
        if n % len(REPEAT_SENTENCES):
            blocks.append(" ".join(REPEAT_SENTENCES[: n % len(REPEAT_SENTENCES)]))
        return blocks, [len(b.split(" ")) for b in blocks], "\n"
    if cfg.haystack == "needle":
        return (*_take_words(distractors.__getitem__, n), "\n")
    sentences = essay_sentences()
    return (*_take_words(lambda i: sentences[i % len(sentences)], n), " ")


def _insert_needles(units: list[str], counts: list[int], needles: list[str], depths: list[float]) -> tuple[list[str], list[float]]:
    """Place each needle at the unit boundary nearest its depth (by word count); returns the new
    unit list and each needle's realised depth."""
    cumulative = [0]
    for c in counts:
        cumulative.append(cumulative[-1] + c)
    total = cumulative[-1]
    slots: list[int] = []
    for depth in depths:
        target = depth * total
        slots.append(min(range(len(cumulative)), key=lambda b: (abs(cumulative[b] - target), b)))
    out: list[str] = []
    order = sorted(range(len(needles)), key=lambda j: (slots[j], depths[j]))
    k = 0
    for boundary in range(len(units) + 1):
        while k < len(order) and slots[order[k]] == boundary:
            out.append(needles[order[k]])
            k += 1
        if boundary < len(units):
            out.append(units[boundary])
    realised = [cumulative[s] / total if total else 0.0 for s in slots]
    return out, realised


def _render(tokenizer, task_text: str, answer_prefix: str, chat_template: bool) -> tuple[str, list[int]]:
    if chat_template:
        head = tokenizer.apply_chat_template([{"role": "user", "content": task_text}], tokenize=False, add_generation_prompt=True)
        text = head + answer_prefix
        # The template already holds every special token the model expects.
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = task_text + answer_prefix
    return text, list(tokenizer(text)["input_ids"])


def _fit(length_of: Callable[[int], int], target: int, hint: int) -> int:
    """Largest n with length_of(n) <= target, for a length that grows about linearly with n.

    Interpolation search inside a bracket (a handful of tokenizations instead of ~log2(n)), with a
    bisection step whenever an interpolation step failed to halve the bracket."""
    base = length_of(0)
    lo, f_lo, hi, f_hi = 0, base, None, None
    n, last_width = max(hint, 1), None
    while True:
        f_n = length_of(n)
        if f_n <= target:
            lo, f_lo = n, f_n
        else:
            hi, f_hi = n, f_n
        if hi is None:
            per_unit = (f_lo - base) / lo
            # Aim a little past the target so the next probe brackets it.
            n = 2 * lo if per_unit <= 0 else lo + math.ceil((target - f_lo) / per_unit * 1.02) + 1
            continue
        width = hi - lo
        if width <= 1:
            return lo
        if last_width is not None and width > last_width // 2:
            n, last_width = (lo + hi) // 2, None
        else:
            guess = lo + round((target - f_lo) * width / (f_hi - f_lo))
            n, last_width = min(max(guess, lo + 1), hi - 1), width


def _build_sample(task: str, cfg: TaskConfig, tokenizer, target_len: int, index: int, num_samples: int, seed: int,
                  chat_template: bool, hint: int) -> tuple[NiahSample, int]:
    rng = random.Random(f"{seed}:{task}:{index}")
    taken: set[str] = set()
    keys = _distinct(cfg.key_type, rng, max(cfg.num_keys, cfg.num_queries), taken)
    values = [_distinct(cfg.value_type, rng, cfg.num_values, taken) for _ in keys]
    needles = [(NEEDLE.format(type=cfg.value_type, key=k, value=v), v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queries = rng.sample(keys, cfg.num_queries)
    answers = [v for q in queries for v in values[keys.index(q)]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]

    offset = 0.5 if num_samples == 1 else index / (num_samples - 1)
    nominal = [(j + offset) / len(needles) for j in range(len(needles))]
    distractors = _Distractors(cfg, random.Random(f"{seed}:{task}:{index}:haystack"), taken)
    answer_prefix = ANSWER_PREFIX.format(type=cfg.value_type, query=query)
    cache: dict[int, tuple[str, list[int], list[float]]] = {}

    def render(n: int) -> tuple[str, list[int], list[float]]:
        if n not in cache:
            units, counts, sep = _haystack_units(cfg, n, distractors)
            parts, realised = _insert_needles(units, counts, [t for t, _ in needles], nominal)
            task_text = TEMPLATE.format(type=cfg.value_type, context=sep.join(parts), query=query)
            cache[n] = (*_render(tokenizer, task_text, answer_prefix, chat_template), realised)
        return cache[n]

    if len(render(0)[1]) > target_len:
        raise ValueError(
            f"target_len {target_len} is too short for {task}: the prompt without haystack already has "
            f"{len(render(0)[1])} tokens."
        )
    n = _fit(lambda m: len(render(m)[1]), target_len, hint)
    text, ids, realised = render(n)
    depth_of = {v: d for (_, v), d in zip(needles, realised)}
    sample = NiahSample(task, index, ids, text, answers, [depth_of[a] for a in answers], len(ids))
    return sample, n


def make_samples(task: str, tokenizer, target_len: int, num_samples: int, seed: int, chat_template: bool = False) -> list[NiahSample]:
    """`num_samples` prompts of `task`, each <= `target_len` tokens of `tokenizer` and close to it.

    The same (task, seed, index) gives the same keys and values at every target length."""
    if task not in TASK_CONFIGS:
        raise ValueError(f"Unknown NIAH task {task!r}; valid tasks are: {', '.join(TASKS)}.")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but the tokenizer has no chat template; use chat_template=False.")
    cfg = TASK_CONFIGS[task]
    samples, hint = [], 64
    for index in range(num_samples):
        sample, hint = _build_sample(task, cfg, tokenizer, target_len, index, num_samples, seed, chat_template, hint)
        samples.append(sample)
    return samples


def score_string_match_all(outputs: list[str], answers: list[list[str]]) -> float:
    """RULER's string_match_all: per sample, the fraction of expected values found (case-insensitive
    substring) in the output; the mean over samples, times 100."""
    if len(outputs) != len(answers):
        raise ValueError(f"Got {len(outputs)} outputs for {len(answers)} answer lists; they must be the same length.")
    if not outputs:
        raise ValueError("Cannot score zero samples.")
    per_sample = [sum(a.lower() in out.lower() for a in ans) / len(ans) for out, ans in zip(outputs, answers)]
    return 100.0 * sum(per_sample) / len(per_sample)
