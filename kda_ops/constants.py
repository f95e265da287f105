"""Constants of the cache layout, shared by every path (docs/semantics.md#1-cache-layout)."""

# Block 0 of every cache is the null block: a row whose index is <= NULL_BLOCK
# (or >= the number of blocks) is padding, and nothing of it is read or written.
NULL_BLOCK = 0
