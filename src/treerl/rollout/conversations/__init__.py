"""What the model reads: tokenizers (`tokenizer.py`), conversations as token ids through the chat template
(`chat.py`), images in prompts (`images.py`).

Step 1 (docs/architecture.md): the lowest of rollout's rooms; it imports no other.
"""
