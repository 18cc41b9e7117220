"""Full offloaded decode: ms per token, and the programs a first generation compiles, in one tree (run it per tree).

Decode pads a layer's last group of stored blocks to a power of two (`kv.ring.decode_group_size`), so a generation
compiles at most 4 group shapes with the default ring instead of one per group length; the price is copying the
repeated blocks on the GPU. This times it where the repeats are most (3 blocks stored past the last whole group pad to
4, 5 to 8, 7 to 8) and where there are none, Llama-3.1-8B shape, random bf16 weights, 1024-token blocks and 16 ring
slots (the defaults when this ran: groups of 8). Per context one prompt, `--tokens` decode steps; the first `--skip` steps
are left out of the median (they compile). Compiles are counted over each generation.
`--rounds N` instead alternates, in one process, the padded groups with unpadded ones (`decode_group_size` replaced by
the identity) for N rounds per context, each a generation of `--tokens` steps after `--skip`.

    python bench/probes/probe_decode_padding.py --out $OUT/new
    python bench/probes/probe_decode_padding.py --root OLD_TREE --out $OUT/old
    python bench/probes/probe_decode_padding.py --rounds 5 --contexts 13412,15460 --tokens 12 --out $OUT/ab
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
               help="the tree whose jax_offload runs (an older checkout for an A/B)")
p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
               default=[11 * 1024 + 100, 13 * 1024 + 100, 15 * 1024 + 100, 16 * 1024 + 100, 123 * 1024 + 100])
p.add_argument("--tokens", type=int, default=24)
p.add_argument("--skip", type=int, default=4)
p.add_argument("--rounds", type=int, default=0, help="alternate padded and unpadded groups, this many rounds")
p.add_argument("--shape", default="llama-3.1-8b")
p.add_argument("--out", type=Path, required=True)
a = p.parse_args()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import model_config, random_params, run_metadata, stats  # noqa: E402

sys.path.insert(0, str(a.root))  # after `common`, which puts this checkout's root first
from jax_offload import LLM, SamplingParams  # noqa: E402

if not Path(sys.modules["jax_offload"].__file__).resolve().is_relative_to(a.root.resolve()):
    raise SystemExit(f"jax_offload came from {sys.modules['jax_offload'].__file__}, not from --root {a.root}.")

COMPILES: list[float] = []


def _record(event: str, duration: float, **_) -> None:
    if event.endswith("backend_compile_duration"):
        COMPILES.append(duration)


def main() -> None:
    a.out.mkdir(parents=True, exist_ok=True)
    jax.monitoring.register_event_duration_secs_listener(_record)
    cfg = model_config(a.shape)
    params = random_params(cfg, jnp.bfloat16)
    llm = LLM.from_params(cfg, params, dtype="bfloat16", offload=True, block_size=1024, num_ring_slots=16,
                          max_model_len=min(max(a.contexts) + a.tokens + 1024, cfg.max_position_embeddings))
    sampling = SamplingParams(temperature=0.0, max_tokens=a.tokens + 1, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []

    def save(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        (a.out / "probe_decode_padding.json").write_text(json.dumps(
            {"meta": run_metadata(), "root": str(a.root), "args": {k: str(v) for k, v in vars(a).items()},
             "rows": rows}, indent=1))

    def steps_ms(ctx: int) -> list[float]:
        out = llm.generate([rng.integers(3, cfg.vocab_size, size=ctx).tolist()], sampling)[0]
        return [s * 1e3 for s in out.decode_token_seconds]

    if not a.rounds:
        for ctx in a.contexts:
            COMPILES.clear()
            steps = steps_ms(ctx)
            save({"ctx": ctx, "stored_blocks": ctx // 1024, "ms_per_token": stats(steps[a.skip:]), "step_ms": steps,
                  "compiles": len(COMPILES), "compile_s": sum(COMPILES)})
        return
    import jax_offload.offload_runner as offload_runner

    variants = {"padded": offload_runner.decode_group_size, "unpadded": lambda num_blocks, group: num_blocks}
    for ctx in a.contexts:
        timed = {name: [] for name in variants}
        for _ in range(a.rounds):
            for name, size in variants.items():
                offload_runner.decode_group_size = size
                timed[name].append(steps_ms(ctx)[a.skip:])
        for name, rounds in timed.items():
            save({"ctx": ctx, "variant": name, "ms_per_token": stats([s for r in rounds for s in r]),
                  "round_medians_ms": [stats(r)["median"] for r in rounds], "step_ms": rounds})


if __name__ == "__main__":
    main()
