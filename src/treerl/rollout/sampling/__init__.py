"""Samplers: the interface every sampler implements (`sampler.py`); the embedded sampler (`embedded.py`), its
generation over shared prefixes (`prefix_sharing.py`) and prefix cache (`prefix_cache.py`); the client of inference
servers (vLLM, SGLang, `treerl serve`), which also pushes the trainer's weights to them (`client.py`).

Step 1 (docs/architecture.md): sampling; imports `tasks` (a prompt's seed) below it.
"""
