"""treerl: RL post-training of language models that never computes a shared prefix twice.

The steps of training and the layers that do them: docs/architecture.md.
"""

__version__ = "0.1.0"
