"""A multi-document QA set, generated offline and deterministically, for KV reuse across prompts (CacheBlend).

A pool of documents, each a few sentences of the RULER essay with two facts in RULER's needle form ("One of the
special magic numbers for {key} is: {value}."); each question shows `docs_per_question` documents of the pool in
a random order and asks for the value of one fact in one of them. Documents come back across questions in other
orders and company, which is what segment reuse has to survive. A prompt is given in parts: the chat template's
head with the instruction, one part per document, and the question with the template's tail and the answer
prefix; their token ids, concatenated, are the whole prompt, so full prefill and reuse see the same tokens.
Scores: exact match and token F1 of the answer (SQuAD's normalisation) on the output's first line.
"""
from __future__ import annotations

import collections
import dataclasses
import random
import re
import string

from jax_offload.engine import template_ends
from jax_offload.eval.ruler import essay_sentences, fresh_value

INSTRUCTION = "Read the documents below and answer the question about them.\n\n"


@dataclasses.dataclass
class Question:
    index: int
    docs: list[int]  # pool indices, in prompt order
    key: str
    answer: str
    parts: list[list[int]]  # token ids: head, one per document, question


def make_qa_set(tokenizer, num_questions: int = 200, num_docs: int = 60, docs_per_question: int = 4,
                sentences_per_doc: int = 6, seed: int = 0) -> tuple[list[str], list[Question]]:
    """(document texts, questions) of the set."""
    rng = random.Random(seed)
    essay = essay_sentences()
    taken: set[str] = set()
    docs, facts = [], []
    for _ in range(num_docs):
        start = rng.randrange(len(essay) - sentences_per_doc)
        sentences = [" ".join(s) for s in essay[start:start + sentences_per_doc]]
        pairs = [(fresh_value("words", rng, taken), fresh_value("numbers", rng, taken)) for _ in range(2)]
        taken.update(k for pair in pairs for k in pair)
        for slot, (key, value) in zip(sorted(rng.sample(range(1, sentences_per_doc), 2)), pairs):
            sentences.insert(slot, f"One of the special magic numbers for {key} is: {value}.")
        docs.append(" ".join(sentences))
        facts.append(pairs)
    head, tail = template_ends(tokenizer)
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
    doc_ids = [encode(f"Document: {d}\n\n") for d in docs]
    head_ids = encode(head + INSTRUCTION)
    questions = []
    for i in range(num_questions):
        shown = rng.sample(range(num_docs), docs_per_question)
        key, answer = rng.choice(facts[rng.choice(shown)])
        ask = (f"Question: What is the special magic number for {key} mentioned in the documents?{tail}"
               f"The special magic number for {key} mentioned in the documents is")
        questions.append(Question(i, shown, key, answer, [head_ids, *(doc_ids[d] for d in shown), encode(ask)]))
    return docs, questions


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, articles or extra whitespace."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(output: str, answer: str) -> float:
    return float(normalize(_first_line(output)) == normalize(answer))


def f1(output: str, answer: str) -> float:
    predicted, gold = normalize(_first_line(output)).split(), normalize(answer).split()
    common = sum((collections.Counter(predicted) & collections.Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""
