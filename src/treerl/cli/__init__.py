"""Command-line entry points: thin wrappers that parse options and call the library."""
