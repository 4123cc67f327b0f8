"""Small commands that keep the code base in shape (``python -m lora_guard.tools.layers``)."""
