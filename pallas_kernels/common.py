"""Values every kernel and its reference share, each defined once."""

# The mask value of every attention kernel and its reference: finite, so a fully masked
# (padding) row gives a uniform softmax, not NaN.
NEG_INF = -1e30

# Programs per step a split grid aims for: two per SM of an H100 (132).
TARGET_PROGRAMS = 264
