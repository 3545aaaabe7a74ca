"""Packed batches, token-budget micro-batching, target alignment and the scalar collectives.

The bottom layer of the algorithms package: it imports only torch (see DESIGN.md section 5).
"""

from shardforge.engine.batching.groups import SEQUENCE_GROUP, group_units, grouped_microbatches
from shardforge.engine.batching.microbatch import agree_max, ffd_bins, split_microbatches
from shardforge.engine.batching.packed import PackedBatch, pack_sequences, pad_to_multiple
from shardforge.engine.batching.prefix_sharing import share_prefixes, unshare_outputs
from shardforge.engine.batching.segments import (
    broadcast_to_tokens,
    check_cu_seqlens,
    check_finite,
    check_tokens,
    last_target_index,
    segment_ids,
    segment_sum,
    sequence_start_mask,
    target_aligned_values,
    target_counts,
)
from shardforge.mesh.collectives import (
    all_reduce_max,
    all_reduce_stats,
    all_reduce_sum,
    backend_device,
    broadcast_floats,
    stat_kind,
)

__all__ = [
    "SEQUENCE_GROUP",
    "PackedBatch",
    "agree_max",
    "all_reduce_max",
    "all_reduce_stats",
    "all_reduce_sum",
    "backend_device",
    "broadcast_floats",
    "broadcast_to_tokens",
    "check_cu_seqlens",
    "check_finite",
    "check_tokens",
    "ffd_bins",
    "group_units",
    "grouped_microbatches",
    "last_target_index",
    "pack_sequences",
    "pad_to_multiple",
    "segment_ids",
    "segment_sum",
    "sequence_start_mask",
    "share_prefixes",
    "split_microbatches",
    "stat_kind",
    "target_aligned_values",
    "target_counts",
    "unshare_outputs",
]
