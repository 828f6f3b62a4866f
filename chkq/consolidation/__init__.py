"""Consolidation: a checkpointed run's HDF5 files into one verified output.

Modules follow the canvas: discovery, prepare (the plan step: checks, scans,
the skeleton), plan (the plan's data and its units of work), copy_rows,
merge, verify_rows, output_check (the whole-output check), link (and cleanup).
"""
