"""Configs of the paper's models (public facts only), so their short names plan offline.

``partitions/configs/`` in the repository holds the same files for reading; a test keeps the two
copies identical. Load one with ``hf_ftpipe.graph.sources.load_model_for_planning("t5-3b")``.
"""
