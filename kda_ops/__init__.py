"""kda_ops: speculative decoding kernels for Kimi Delta Attention (KDA).

Every op is a `torch.library.triton_op` (`torch.ops.kda_ops.<name>`), called
through the functions below. What each computes: docs/semantics.md; the
float64 reference: `kda_ops.naive`; a reference model: `kda_ops.models`; the
host-side batch planner for engines: `kda_ops.planner`.
"""

__version__ = "0.1.0"

from .api import (CommitPlan, aligned_state_indices, commit, commit_plan, conv_update,
                  conv_verify, flush, stage_spec_decode_metadata, verify)
from .constants import NULL_BLOCK
from .value_checks import value_checks
from . import models, naive, planner  # noqa: E402  (modules built on the API above)

__all__ = ["verify", "commit", "flush", "commit_plan", "CommitPlan", "conv_update",
           "conv_verify", "aligned_state_indices", "stage_spec_decode_metadata", "value_checks",
           "NULL_BLOCK", "models", "naive", "planner", "__version__"]
