"""Write the two local lm-eval data sets (seeded, deterministic): bench/lm_eval/data/{facts_mc,short_gen}.jsonl.

facts_mc  (loglikelihood, multiple_choice): 40 "a + b =" sums and 40 country -> capital questions, 4 choices each.
short_gen (generate_until): 30 few-shot sums and 30 few-shot word copies; the answer is the first line.
Run from anywhere: `python bench/lm_eval/make_data.py`; the .jsonl files are committed beside it.
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Canada": "Ottawa", "Greece": "Athens",
    "Portugal": "Lisbon", "Austria": "Vienna", "Poland": "Warsaw", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Ireland": "Dublin", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago",
    "Cuba": "Havana", "Thailand": "Bangkok", "Turkey": "Ankara", "Iran": "Tehran", "Hungary": "Budapest",
    "Denmark": "Copenhagen", "Belgium": "Brussels", "Argentina": "Buenos Aires", "Mexico": "Mexico City",
    "India": "New Delhi", "England": "London", "Australia": "Canberra", "Brazil": "Brasilia",
    "Colombia": "Bogota", "Vietnam": "Hanoi", "Nigeria": "Abuja", "Ukraine": "Kyiv", "Ethiopia": "Addis Ababa",
    "Morocco": "Rabat", "Indonesia": "Jakarta",
}
WORDS = ("apple river window garden pencil orange silver planet candle rabbit forest mirror bottle "
         "yellow engine island jacket market number pillow rocket saddle tunnel violin wallet button "
         "camera dragon feather guitar hammer kettle ladder meadow nickel oyster parrot").split()


def facts_mc(rng: random.Random) -> list[dict]:
    docs = []
    for i in range(40):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        s = a + b
        wrong = rng.sample([x for x in range(max(0, s - 5), s + 6) if x != s], 3)
        choices = [str(x) for x in [s] + wrong]
        rng.shuffle(choices)
        docs.append({"id": f"sum{i}", "question": f"{a} + {b} =", "choices": choices, "label": choices.index(str(s))})
    for i, country in enumerate(rng.sample(sorted(CAPITALS), 40)):
        right = CAPITALS[country]
        choices = [right] + rng.sample([c for c in CAPITALS.values() if c != right], 3)
        rng.shuffle(choices)
        docs.append({"id": f"cap{i}", "question": f"The capital of {country} is", "choices": choices,
                     "label": choices.index(right)})
    return docs


def short_gen(rng: random.Random) -> list[dict]:
    docs = []
    for i in range(30):
        (a1, b1), (a2, b2), (a, b) = [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(3)]
        prompt = f"Q: {a1} + {b1}\nA: {a1 + b1}\nQ: {a2} + {b2}\nA: {a2 + b2}\nQ: {a} + {b}\nA:"
        docs.append({"id": f"add{i}", "prompt": prompt, "answer": str(a + b)})
    for i in range(30):
        w1, w2, w = rng.sample(WORDS, 3)
        prompt = f"Copy the word.\nInput: {w1}\nOutput: {w1}\nInput: {w2}\nOutput: {w2}\nInput: {w}\nOutput:"
        docs.append({"id": f"copy{i}", "prompt": prompt, "answer": w})
    return docs


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, make in (("facts_mc", facts_mc), ("short_gen", short_gen)):
        docs = make(random.Random(f"jax_offload-lm_eval-{name}"))
        with open(OUT / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
        print(f"{OUT / name}.jsonl: {len(docs)} items")


if __name__ == "__main__":
    main()
