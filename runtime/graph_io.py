"""The names every target-style graph is exported with and run by (export/onnx_export.py writes
them, runtime/backends/ read them): one place, imported by both sides.

    inputs   input_ids [batch, new_tokens] i64, position_ids [batch, new_tokens] i64,
             seqlens_k [batch] i32, query_seqlens [batch] i32, total_sequence_length [] i32,
             logits_index [batch, num_logits] i64, (drafter steps: hidden_states
             [batch, new_tokens, H]), past_key_values.{i}.key / .value, (ORT targets:
             attention_min_rows [] i32)
    outputs  logits [batch, num_logits, V], per-token outputs [batch, new_tokens, D],
             present.{i}.key / .value (the same buffers as the past: written in place)
"""

from __future__ import annotations

# The step inputs every target-style graph takes, in the order the export modules take them.
STEP_INPUTS = ("input_ids", "position_ids", "seqlens_k", "query_seqlens",
               "total_sequence_length", "logits_index")
HIDDEN_INPUT = "hidden_states"  # drafter steps only, after input_ids in the module's order
PAST, PRESENT = "past_key_values", "present"
# ORT targets exported with export/attention_rows.py: the fewest query rows each request's
# attention runs with (2: exact decoding inside the graph).
ATTENTION_MIN_ROWS = "attention_min_rows"


def kv_names(num_layers: int, prefix: str) -> list[str]:
    """`{prefix}.{i}.key`, `{prefix}.{i}.value` for every layer, in graph order."""
    return [f"{prefix}.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def is_cache(name: str) -> bool:
    return name.startswith((PAST + ".", PRESENT + "."))
