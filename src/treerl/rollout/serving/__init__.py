"""`treerl serve`: the embedded sampler behind vLLM's or SGLang's HTTP protocol (`server.py`), what both protocols
share (`served.py`) and each one's routes (`vllm_protocol.py`, `sglang_protocol.py`).

Beside the steps (docs/architecture.md): step 1's sampling served to other processes; imports `sampling` below it.
"""
