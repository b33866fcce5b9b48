"""Agents: a user's episode written with the OpenAI SDK (`agent.py`), played through the proxy that records every
model call token for token (`proxy.py`), serving the Chat Completions (`chat_api.py`) and Responses
(`responses_api.py`) APIs and parsing tool calls per model family (`tool_parsers.py`).

Steps 1 and 2 (docs/architecture.md): imports `workflows` and the rooms below it.
"""
