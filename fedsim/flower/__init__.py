"""Flower behind one door: every use of Flower's (and Ray's) non-public API (compat.py), the grids
fedsim wraps or provides (the stoppable grid, the in-process grid) and the options that say how
fedsim drives Flower's engine. Imports nothing of fedsim; everything above imports it."""
