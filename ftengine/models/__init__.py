"""Model layer sequences, written once against the ops interface (backends/numpy_ops.py)."""
