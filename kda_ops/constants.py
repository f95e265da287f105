"""Constants of the cache layout and the commit's rules, shared by every path
(docs/semantics.md)."""

# Block 0 of every cache is the null block: a row whose index is <= NULL_BLOCK
# (or >= the number of blocks) is padding, and nothing of it is read or written.
NULL_BLOCK = 0

# A deferred commit over fewer requests than this folds whatever is pending, as the
# immediate schedule does (docs/semantics.md#11-the-deferred-schedule): kept pending, the
# 16-layer step took 1.51x the immediate one at B = 1 and 0.95x at B = 8 (T = 4, H100).
DEFERRED_EAGER_FOLD_BELOW_BATCH = 8
