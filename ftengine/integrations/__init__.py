"""Adapters for frameworks that drive ftengine (each needs its own optional extra)."""
