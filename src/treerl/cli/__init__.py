"""Command-line entry points: thin wrappers that parse options and call the library.

Beside the steps (docs/architecture.md): the commands that start them.
"""
