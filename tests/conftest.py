import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# XLA's CPU backend compiling for speed of compilation: the suite compiles hundreds of tiny programs and runs each a
# few times, so compiling dominates. LLVM at optimisation level 0 (of 3): the whole suite in 472 s against 586 s at
# level 1 and 662-685 s at the default 3 (2026-11-26, the 2-core machine). The older elemental emitters instead of
# the MLIR fusion emitters, where this XLA still has them (jax 0.10; 0.11 has only the fusion emitters): the whole
# suite in 512.82 s against 12 min 39 s wall the same morning (2026-11-27, the same machine), the same results.
# Set before JAX starts its backend, once for the run (xdist's workers and the tests' subprocesses inherit
# XLA_FLAGS); a setting already in XLA_FLAGS is kept.
COMPILE_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
FLAGS_SET_VAR = "JAX_OFFLOAD_TEST_XLA_FLAGS_SET"


def _xla_knows(flag: str) -> bool:
    """Whether this XLA accepts `flag` in XLA_FLAGS (an unknown one stops the process when XLA starts)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True).returncode == 0


if not os.environ.get(FLAGS_SET_VAR):
    for flag, value in COMPILE_FLAGS.items():
        if flag not in os.environ.get("XLA_FLAGS", "") and _xla_knows(f"{flag}={value}"):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={value}".strip()
    os.environ[FLAGS_SET_VAR] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

# Tests compare float32 results against float64/PyTorch references: no reduced-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, str(Path(__file__).parent))

# The two xdist workers build the same tiny models and compile many of the same programs: one compilation cache
# for the run (made by the controller, fresh each run, removed at its end) lets a worker load what the other
# compiled. Every program goes in: compiling dominates the suite, and most programs compile in under 0.5 s.
CACHE_VAR = "JAX_OFFLOAD_TEST_COMPILE_CACHE"
if os.environ.get(CACHE_VAR):
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VAR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None) and CACHE_VAR not in os.environ:
        config.made_compile_cache = os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix="jax_offload_tests_")
    # With --dist loadfile, pytest-xdist (>= 3.6) hands files out by their number of tests, most first, which put
    # the tensor-parallel file (7 tests, the longest) in the middle of the run; the order below is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    made = getattr(config, "made_compile_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[CACHE_VAR]


# Seconds each file took on the 2-core machine under `make test` (2026-11-29, `--durations=0` at caaf42c, less this
# session's trims of test_quest.py and test_sketch.py), for the order in which xdist hands the files out: longest
# first, so the two workers end close together. A file not listed counts as short.
FILE_SECONDS = {
    "test_quest.py": 290, "test_batching.py": 180, "test_tp.py": 140, "test_offload.py": 105,
    "test_real_model.py": 95, "test_batch_invariance.py": 105, "test_offload_bf16.py": 72, "test_serve.py": 61,
    "test_kernels_attention.py": 60, "test_kv_fp8.py": 46, "test_blend.py": 45, "test_prefix_caching.py": 35,
    "test_eval_oracle.py": 32, "test_sketch.py": 30, "test_gguf_convert.py": 30, "test_models.py": 30,
    "test_kernels_mgpu_block_sparse.py": 28, "test_xattention.py": 26, "test_pallas_engine.py": 24,
    "test_kernels_mgpu.py": 23, "test_kernels_mgpu_matmul.py": 25, "test_kernels_xattn.py": 18,
    "test_kernels_paged_decode.py": 16, "test_errors.py": 15,
    "test_kernels_block_sparse.py": 10, "test_kernels_merge.py": 9, "test_default_model.py": 5,
    "test_eval_sparse.py": 12, "test_niah.py": 4,
}


def pytest_collection_modifyitems(items):
    """Files longest first (see FILE_SECONDS), a file's tests in their own order, except that the virtual-device
    tensor-parallel check, a subprocess of about two minutes, starts the run: it runs beside the other tests
    instead of after them (xdist hands tests out in this order)."""
    items.sort(key=lambda item: (item.name != "test_tp_on_virtual_devices_equals_tp1",
                                 -FILE_SECONDS.get(item.path.name, 1)))


@pytest.fixture
def unoptimised_compiles():
    """For Mosaic GPU's interpreted kernels (`pytestmark = pytest.mark.usefixtures(...)` in their files): their
    programs run for milliseconds but take seconds to compile at XLA's full optimisation, so they compile
    unoptimised (half the time), and the setting is left as it was for other files."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_the_file():
    """Each worker drops its compiled programs after a test file (another file that needs one loads it from the
    run's compilation cache): a worker kept every program of the run, and late in a run two workers and the
    tests' subprocesses left ~3 of 24 GiB free, when three runs lost a worker to a segfault inside XLA:CPU
    (bench/results/suite_time.md)."""
    yield
    jax.clear_caches()
    gc.collect()
