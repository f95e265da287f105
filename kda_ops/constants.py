"""Constants of the cache layout and the commit's rules, shared by every path
(docs/semantics.md)."""

# Block 0 of every cache is the null block: a row whose index is <= NULL_BLOCK
# (or >= the number of blocks) is padding, and nothing of it is read or written.
NULL_BLOCK = 0

# A deferred commit over fewer requests than this folds whatever is pending, as the
# immediate schedule does (docs/semantics.md#11-the-deferred-schedule): kept pending, the
# 16-layer step took 1.31-1.56x the immediate one at B = 1, 1.12x at B = 4, 0.90-1.05x at
# B = 8 and 0.81x at B = 16 (H100, T = 2 to 8, acceptance 0.7 and 1; B = 4, 16: T = 4, 0.7).
DEFERRED_EAGER_FOLD_BELOW_BATCH = 16
