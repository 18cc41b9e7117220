"""bench/eval_sparse.py's Quest mass pass: Quest's and the oracle's shares against a float64 reference, the
oracle holding at least Quest's mass summed over each GQA group, the report's mass table with and without the
oracle's columns (files written before it lack them), and the whole pass on a tiny model."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_models
from test_quest import quest_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import eval_sparse  # noqa: E402


def shares_reference(q, k, length, block_size, page_size, budget_pages):
    """float64 -> (Quest's, the oracle's) share [Hq] of the last query's softmax mass on their pages plus the
    tail; the oracle keeps page 0 and the budget_pages - 1 stored pages of highest group-summed mass."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    t, hkv, d = k.shape
    s = np.einsum("ngd,tnd->ngt", q.reshape(hkv, -1, d), k) / np.sqrt(d)
    s[..., length:] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [Hkv, G, T]
    stored = length // block_size * block_size
    num_pages = stored // page_size
    group = p.sum(1)[:, :stored].reshape(hkv, num_pages, page_size).sum(-1)  # [Hkv, pages]
    oracle = [[0] + sorted(range(1, num_pages), key=lambda j: (-group[h, j], j))[: budget_pages - 1]
              for h in range(hkv)]
    quest = quest_reference(q, k, num_pages, budget_pages, page_size)

    def share(pages):
        attended = np.zeros((hkv, t), bool)
        attended[:, stored:length] = True
        for h in range(hkv):
            for j in pages[h]:
                if j < num_pages:
                    attended[h, j * page_size:(j + 1) * page_size] = True
        return (p * attended[:, None]).sum(-1).reshape(-1)

    return share(quest), share(oracle)


@pytest.mark.parametrize("hq,hkv,t,length,block_size,budgets", [
    (9, 3, 640, 600, 64, (1, 4, 8, 40)),  # budget 40 > the 36 stored pages: all of them
    (8, 2, 512, 512, 128, (2, 6)),        # no tail
    (6, 1, 384, 350, 32, (3, 10)),        # one KV head for six query heads
    (4, 4, 320, 300, 32, (5,)),           # no GQA
])
def test_quest_and_oracle_shares_match_float64(hq, hkv, t, length, block_size, budgets):
    seed = 700 + hq * 10 + hkv
    rng = np.random.default_rng(seed)
    page_size, d = 16, 32
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    q = (2.0 * rng.standard_normal((hq, d))).astype(np.float32)  # peaked attention: pages differ in mass
    shares = jax.jit(eval_sparse._quest_shares, static_argnums=(3, 4, 5))  # as in the mass pass: length traced
    got = np.asarray(shares(q, k, jnp.int32(length), block_size, page_size, budgets))  # [2, B, Hq]
    want = np.stack([shares_reference(q, k, length, block_size, page_size, b) for b in budgets], 1)
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"seed {seed}")
    # The oracle is optimal for the mass summed over a GQA group, not for each query head on its own.
    quest_group, oracle_group = got.reshape(2, len(budgets), hkv, -1).sum(-1)
    assert np.all(oracle_group >= quest_group - 1e-6), f"seed {seed}"
    ref_quest_group, ref_oracle_group = want.reshape(2, len(budgets), hkv, -1).sum(-1)
    assert np.all(ref_oracle_group >= ref_quest_group - 1e-12), f"seed {seed}"
    stored_pages = length // block_size * block_size // page_size
    below = [i for i, b in enumerate(budgets) if 1 < b < stored_pages]
    if below:  # the comparison is not vacuous: the oracle finds more mass than Quest somewhere
        assert np.max(oracle_group[below] - quest_group[below]) > 1e-3, f"seed {seed}"


def _mass_file(oracle: bool) -> dict:
    budget = {"mean": [1.0, 0.5, 0.7], "p5": [1.0, 0.25, 0.4]}
    if oracle:
        budget |= {"oracle_mean": [1.0, 0.75, 0.9], "oracle_p5": [1.0, 0.5, 0.6]}
    return {"block_size": 256, "page_size": 16, "dense_layers": 1, "prompts": [{}] * 2, "num_heads": 9,
            "dtype": "float32", "budgets": {"512": budget}}


def test_mass_table_shows_the_oracle_where_the_file_has_it():
    with_oracle = eval_sparse._mass_section(4096, _mass_file(oracle=True))
    assert "| layer | 512 Quest mean | 512 Quest p5 | 512 oracle mean | 512 oracle p5 |" in with_oracle
    assert "| **sparse layers** | 0.6000 | 0.2500 (min) | 0.8250 | 0.5000 (min) |" in with_oracle
    without = eval_sparse._mass_section(4096, _mass_file(oracle=False))
    assert "| layer | 512 Quest mean | 512 Quest p5 |" in without
    assert "| **sparse layers** | 0.6000 | 0.2500 (min) |" in without
    assert not any("oracle" in line for line in without)


def test_mass_pass_runs_end_to_end_and_its_report_reads_it(tmp_path, monkeypatch):
    """The whole --mass pass on a tiny 3-layer checkpoint (layer 2 sparse), then --report: catches a broken call
    into the engine's loaders and layers, which the share tests above do not reach. The prompts are random ids:
    RULER's haystack needs a real tokenizer, the tiny models' knows 256 words."""
    rng = np.random.default_rng(704)
    prompts = [SimpleNamespace(task=t, index=0, prompt_ids=rng.integers(3, 256, 300).tolist(), length=300)
               for t in ("niah_single_1", "niah_multikey_1")]
    monkeypatch.setattr(eval_sparse, "build_prompts", lambda model_dir, targets, samples, seed: {300: prompts})
    monkeypatch.setitem(tiny_models.COMMON, "num_hidden_layers", 3)
    model, mass, out = tmp_path / "model", tmp_path / "mass", tmp_path / "report"
    tiny_models.build("qwen2", model, seed=703)
    assert eval_sparse.main(["--model", str(model), "--lengths", "300", "--samples", "1", "--configs",
                             "quest32,quest64", "--base", "block_size=64", "--mass", "--out", str(mass)]) == 0
    result = json.loads((mass / "quest_mass_300.json").read_text())
    assert set(result["budgets"]) == {"32", "64"}
    for budget in result["budgets"].values():
        quest, oracle = np.asarray(budget["shares"]), np.asarray(budget["oracle_shares"])  # [prompts, layers, Hq]
        assert quest.shape == oracle.shape == (2, 3, 4)
        assert np.all(quest[:, :2] == 1) and np.all(oracle[:, :2] == 1)  # dense layers
        assert np.all(quest[:, 2] < 0.99)  # layer 2 reads 2 or 4 of 16 stored pages plus a 44-key tail
        assert np.all((quest > 0) & (quest <= 1 + 1e-5)) and np.all((oracle > 0) & (oracle <= 1 + 1e-5))
        # 2 query heads per KV head; shares are rounded to 5 decimals in the file.
        assert np.all(oracle.reshape(2, 3, 2, 2).sum(-1) >= quest.reshape(2, 3, 2, 2).sum(-1) - 2e-5)
    assert eval_sparse.main(["--report", str(mass), "--out", str(out)]) == 0
    assert "| layer | 32 Quest mean | 32 Quest p5 | 32 oracle mean | 32 oracle p5 |" in (out / "sparse_niah.md").read_text()


def test_prompts_run_together_give_the_records_of_prompts_run_alone(tmp_path, monkeypatch):
    """--together 3 (the offloaded batch engine runs 3 prompts, then the last one alone) gives --together 1's
    outputs, scores and XAttention densities in float32 on a tiny 3-layer checkpoint, XAttention prefill and Quest
    decode (layer 2) in one config, and each file records its value; the second run, given the first's folder as
    `--reference`, records that all 4 outputs equal it."""
    rng = np.random.default_rng(705)
    prompts = [SimpleNamespace(task=t, index=i, prompt_ids=rng.integers(3, 256, 300).tolist(), length=300,
                               depths=[0.5], answers=["w5"])
               for t in ("niah_single_1", "niah_multikey_1") for i in (0, 1)]
    monkeypatch.setattr(eval_sparse, "build_prompts", lambda model_dir, targets, samples, seed: {300: prompts})
    monkeypatch.setitem(tiny_models.COMMON, "num_hidden_layers", 3)
    model = tmp_path / "model"
    tiny_models.build("qwen2", model, seed=706)
    results = {}
    for together in (1, 3):
        out = tmp_path / f"together{together}"
        reference = ["--reference", str(tmp_path / "together1")] if together == 3 else []
        assert eval_sparse.main(["--model", str(model), "--lengths", "300", "--samples", "2", "--max-tokens", "6",
                                 "--configs", "xattn0.5+quest32", "--together", str(together), "--out", str(out),
                                 *reference]) == 0
        results[together] = json.loads((out / "sparse_niah_300_xattn0.5-quest32.json").read_text())
    alone, batched = results[1], results[3]
    assert (alone["together"], batched["together"]) == (1, 3)
    assert "reference" not in alone and (batched["reference"]["same"], batched["reference"]["total"]) == (4, 4)
    assert batched["scores"] == alone["scores"]
    keys = ("task", "index", "output", "output_token_ids", "score", "finish_reason")
    assert [{k: r[k] for k in keys} for r in batched["records"]] == [{k: r[k] for k in keys} for r in alone["records"]]
    assert all(len(r["output_token_ids"]) == 6 for r in alone["records"])  # no EOS cut the comparison short
    for a, b in zip(alone["records"], batched["records"]):
        np.testing.assert_allclose(b["prefill_density"], a["prefill_density"], atol=1e-6)
    assert min(min(r["prefill_density"]) for r in alone["records"]) < 1  # threshold 0.5 drops blocks
