"""spec_kernels: the three ops of a speculative decoding step, and the model-side ops they run in (``linear``,
``decoder_layers``).

Glossary: a *tree* is one step's proposal for one sequence, T nodes in topological order with node 0
the root (the last emitted token). See docs/ARCHITECTURE.md for the contracts.

Importing this package never compiles anything; the C++ extension is built on first use.
"""

from spec_kernels.compact_kv import compact_kv_
from spec_kernels.compact_kv.ref import compact_kv_ref
from spec_kernels.decoder_layers import decoder_layers
from spec_kernels.decoder_layers.ref import decoder_layers_ref
from spec_kernels.linear import linear
from spec_kernels.linear.ref import linear_ref
from spec_kernels.tree_attention import DevicePlan, TreeAttentionPlan, plan_tree_attention, tree_attention
from spec_kernels.tree_attention.ref import tree_attention_ref
from spec_kernels.types import PAD_NODE, VerifyResult
from spec_kernels.verify_tree import verify_tree
from spec_kernels.verify_tree.ref import verify_tree_ref

__all__ = [
    "PAD_NODE",
    "DevicePlan",
    "TreeAttentionPlan",
    "VerifyResult",
    "compact_kv_",
    "compact_kv_ref",
    "decoder_layers",
    "decoder_layers_ref",
    "linear",
    "linear_ref",
    "plan_tree_attention",
    "tree_attention",
    "tree_attention_ref",
    "verify_tree",
    "verify_tree_ref",
]
