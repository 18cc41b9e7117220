"""`python -m jax_offload.serve`: an OpenAI-compatible server (completions, chat completions, models, metrics)
over the engine, every engine option named as in `jax_offload.generate`. Many clients share one running batch."""
from __future__ import annotations

import argparse
import functools
import os
import sys

from jax_offload.generate import _ArgumentParser, add_engine_options, load_llm


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(prog="python -m jax_offload.serve", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    p.add_argument("--api-key", default=os.environ.get("JAX_OFFLOAD_API_KEY"),
                   help="requests to /v1 need 'Authorization: Bearer KEY' (default: $JAX_OFFLOAD_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the model directory's name)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests waiting for their first token beyond which new ones get 503 (1024)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the engine's steps (every batch size and prefill length) before serving (on)")
    add_engine_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    if args.max_waiting < 1:
        print(f"error: --max-waiting must be >= 1, got {args.max_waiting}", file=sys.stderr)
        return 2
    import uvicorn

    from jax_offload.serving.api_server import create_app, freeze_startup_heap
    from jax_offload.serving.async_engine import EngineProcess

    # The engine runs in a process of its own: its Python and the event loop's per-token work then do not share
    # one interpreter lock (bench/results/runs/h200_serve).
    engine = EngineProcess(functools.partial(load_llm, args))
    try:
        engine.start(args.warm_up)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name = args.served_model_name or (args.model.name if args.model is not None else "SmolLM2-135M-Instruct")
    app = create_app(engine, name, args.api_key, args.max_waiting)
    freeze_startup_heap()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
