"""Pallas kernels: attention with its LSE or online-softmax state (dense, paged, block-sparse, streamed), XAttention's
estimate, sketch scoring, a batch-invariant matmul, a top-k without a sort and a row copy that reads pinned host
memory in place; Triton on NVIDIA GPUs, Mosaic GPU on Hopper for prefill attention and sketch scoring, interpret
mode elsewhere.

See README.md in this directory for semantics, layouts and tuning notes.
"""

from pallas_kernels.attention import (
    attention_state,
    attention_state_xla,
    attention_with_lse,
    attention_with_lse_xla,
    default_attention_config,
)
from pallas_kernels.block_sparse import (
    block_sparse_attention_with_lse,
    block_sparse_attention_with_lse_xla,
    mask_to_block_lists,
)
from pallas_kernels.copy_rows import copy_rows
from pallas_kernels.decode import (
    DECODE_SPLIT_MAX,
    decode_attention_with_lse,
    decode_attention_with_lse_xla,
    decode_split_len,
    decode_split_lens,
    decode_state,
    max_decode_splits,
    default_decode_config,
)
from pallas_kernels.fold import fold_splits
from pallas_kernels.matmul import matmul
from pallas_kernels.merge import merge_states, merge_states_n
from pallas_kernels.paged_decode import (
    paged_decode_attention_kv_with_lse,
    paged_decode_attention_kv_with_lse_xla,
    paged_decode_attention_with_lse,
    paged_decode_attention_with_lse_xla,
    paged_decode_state,
    paged_decode_state_kv,
)
from pallas_kernels.sketch import SKETCH_TILE_PAGES, sketch_page_lse, sketch_page_lse_requests
from pallas_kernels.state import AttentionState, empty_state, finish_state, merge_into_state
from pallas_kernels.top_k import top_k_ascending
from pallas_kernels.xattn import (
    antidiagonal_scores,
    default_xattn_config,
    merge_softmax_stats,
    select_blocks,
    softmax_normalize_block_sum,
    softmax_partial_stats,
    xattn_estimate,
)

__all__ = [
    "AttentionState",
    "antidiagonal_scores",
    "attention_state",
    "attention_state_xla",
    "attention_with_lse",
    "attention_with_lse_xla",
    "block_sparse_attention_with_lse",
    "block_sparse_attention_with_lse_xla",
    "copy_rows",
    "DECODE_SPLIT_MAX",
    "decode_attention_with_lse",
    "decode_attention_with_lse_xla",
    "decode_split_len",
    "decode_split_lens",
    "decode_state",
    "max_decode_splits",
    "default_attention_config",
    "default_decode_config",
    "default_xattn_config",
    "empty_state",
    "finish_state",
    "fold_splits",
    "mask_to_block_lists",
    "matmul",
    "merge_into_state",
    "merge_softmax_stats",
    "merge_states",
    "merge_states_n",
    "paged_decode_attention_kv_with_lse",
    "paged_decode_attention_kv_with_lse_xla",
    "paged_decode_attention_with_lse",
    "paged_decode_attention_with_lse_xla",
    "paged_decode_state",
    "paged_decode_state_kv",
    "select_blocks",
    "SKETCH_TILE_PAGES",
    "sketch_page_lse",
    "sketch_page_lse_requests",
    "softmax_normalize_block_sum",
    "softmax_partial_stats",
    "top_k_ascending",
    "xattn_estimate",
]
