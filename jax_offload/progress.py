"""Progress reporting that never stalls the GPU."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
from tqdm import tqdm

PROGRESS_MIN_TOKENS = 4096  # shorter prompts prefill too fast for a progress bar to help


@contextlib.contextmanager
def prefill_bar(num_tokens: int, show: bool) -> Iterator[Callable[[float], None] | None]:
    """A bar over one prompt's prefill: its update function (told tokens done), or None where no bar helps."""
    if not show or num_tokens < PROGRESS_MIN_TOKENS:
        yield None
        return
    with tqdm(total=num_tokens, desc="prefill", unit="tok", unit_scale=True, leave=False) as bar:
        yield bar.update


class LaggedProgress:
    """Reports each step once its result is ready, one step behind dispatch: by the time we wait for step i,
    step i + 1 is already queued, so the wait never leaves the GPU idle (blocking on the step just
    dispatched would drain the queue every time)."""

    def __init__(self, report: Callable[[float], None] | None):
        self._report = report
        self._pending: tuple[jax.Array, float] | None = None

    def step(self, result: jax.Array, amount: float) -> None:
        if self._report is None:
            return
        self._flush()
        self._pending = (result, amount)

    def close(self) -> None:
        if self._report is not None:
            self._flush()

    def _flush(self) -> None:
        if self._pending is not None:
            result, amount = self._pending
            jax.block_until_ready(result)
            self._report(amount)
            self._pending = None
