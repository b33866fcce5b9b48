"""SFT on branching conversations: the loop (`loop`) and the data format (`data`).

Steps 2 to 6 (docs/architecture.md) on conversations: no sampling, no advantages.
"""
