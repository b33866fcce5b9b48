"""treerl: RL post-training of language models that never computes a shared prefix twice."""

__version__ = "0.1.0"
