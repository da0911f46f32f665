"""The reference backend (numpy_ops.py is its op interface): plain NumPy, by op family."""
