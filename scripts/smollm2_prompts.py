"""The prompts SmolLM2's reference ids are computed on (scripts/smollm2_reference.py,
tests/data/smollm2_reference_ids.json), which the GPU parity run starts from too
(scripts/gguf_parity.py)."""

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "In 1492, Christopher Columbus",
    "My favorite food is",
    "import numpy as np\n",
]
