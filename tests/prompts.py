"""Prompts shared by the exactness tests and the end-to-end tests: chat-template and plain."""

CHAT_PROMPTS = [
    "Write a short story about a cat who learns to swim.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying focused while studying?",
    "Summarise this passage in one sentence: 'The river rose for three days. On the fourth day the "
    "villagers moved their animals to the hill, and the old bridge, which had stood for a century, "
    "finally gave way.'",
    "Rename the variable x to count in this code: def f(x):\n    x = x + 1\n    return x * x",
    "Give me a recipe for pancakes.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue?",
]

PLAIN_PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She",
    "Machine learning is a field of computer science that",
    "def fibonacci(n):\n",
    "The capital of France is",
    "In 1492, Christopher Columbus",
    "Here is a list of fruits: apple, banana, cherry, apple, banana,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "import numpy as np\n\ndef mean(values):\n",
    "Dear Sir or Madam,\n\nI am writing to",
    "The three laws of thermodynamics are",
]


def encode_prompts(tokenizer) -> list[list[int]]:
    chat = [
        _ids(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True))
        for p in CHAT_PROMPTS
    ]
    plain = [list(tokenizer(p).input_ids) for p in PLAIN_PROMPTS]
    return chat + plain


def _ids(encoded) -> list[int]:
    # transformers 5 may return a BatchEncoding from apply_chat_template
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)
