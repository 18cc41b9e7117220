import sys
from pathlib import Path

import jax

# Tests compare float32 results against float64/PyTorch references: no reduced-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, str(Path(__file__).parent))
