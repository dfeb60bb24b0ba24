"""The trainer's prompts, generated from topic and template lists so the set is large, diverse and
reproducible. None of them is a benchmark prompt (specdec_bench/prompts.py): the topics used for the
held-out evaluation and the benchmark are kept out of the training topics."""

from __future__ import annotations

import random

TOPICS = (
    "volcanoes",
    "the French Revolution",
    "black holes",
    "honey bees",
    "the immune system",
    "electric cars",
    "the Roman Empire",
    "climate change",
    "machine learning",
    "the stock market",
    "coral reefs",
    "sleep",
    "the printing press",
    "quantum computers",
    "the Amazon rainforest",
    "vaccines",
    "the internet",
    "ancient Egypt",
    "renewable energy",
    "dinosaurs",
    "the human heart",
    "coffee",
    "chess",
    "the Moon landing",
    "earthquakes",
    "recycling",
    "the Great Wall of China",
    "meditation",
    "bread baking",
    "jazz music",
    "the Olympic Games",
    "rainbows",
    "penguins",
    "the Industrial Revolution",
    "smartphones",
    "tea",
    "the solar system",
    "friendship",
    "time management",
    "public speaking",
    "gardening",
    "bicycles",
    "the ocean tides",
    "birds migrating",
    "the Renaissance",
    "antibiotics",
    "batteries",
    "democracy",
    "the desert",
    "elephants",
    "music theory",
    "budgeting money",
    "learning a language",
    "glaciers",
    "3D printing",
    "cloud computing",
    "the printing of money",
    "wolves",
    "mountains",
    "kindness",
)
HELD_OUT_TOPICS = ("lighthouses", "submarines", "origami", "the Arctic", "cheese making", "robots")

TEMPLATES = (
    "Explain {t} in simple terms.",
    "Write a short story about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a brief history of {t}.",
    "Why is {t} important? Answer in a few sentences.",
    "Write a short poem about {t}.",
    "Describe {t} to a child.",
    "What are the pros and cons of {t}?",
    "Write a paragraph for a school report on {t}.",
    "Summarize what everyone should know about {t}.",
    "Tell me a fun fact about {t} and explain it.",
    "How would you teach a beginner about {t}?",
)
CODE_TASKS = (
    "reverses a string",
    "computes the factorial of n",
    "finds the largest number in a list",
    "counts the vowels in a string",
    "checks whether a word is a palindrome",
    "sorts a list with bubble sort",
    "returns the Fibonacci numbers up to n",
    "merges two sorted lists",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "computes the average of a list",
    "finds the second smallest number",
    "counts word frequencies in a text",
    "checks whether two strings are anagrams",
    "flattens a nested list",
    "computes the greatest common divisor",
    "reads a file and counts its lines",
    "validates an email address",
    "returns the sum of the digits of a number",
    "transposes a matrix",
)
CODE_TEMPLATES = ("Write a Python function that {t}.", "Show me Python code that {t}, with a short explanation.")
OPENINGS = (
    "Once upon a time, in a small village by the sea,",
    "The history of science is full of surprises.",
    "In the year 2050, cities will",
    "The best way to start the morning is",
    "Scientists recently discovered",
    "My favourite place in the world is",
    "The key to a healthy life is",
    "When the storm finally ended,",
    "There are many reasons why people travel.",
    "The old library at the end of the street",
)


def training_prompts(seed: int = 0) -> list[tuple[str, bool]]:
    """(text, is_chat) pairs, shuffled with `seed`."""
    prompts = [(tpl.format(t=t), True) for t in TOPICS for tpl in TEMPLATES]
    prompts += [(tpl.format(t=t), True) for t in CODE_TASKS for tpl in CODE_TEMPLATES]
    prompts += [(text, False) for text in OPENINGS]
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts() -> list[str]:
    """Chat prompts on topics the head never saw, for the model card's acceptance figures."""
    return [tpl.format(t=t) for t, tpl in zip(HELD_OUT_TOPICS, TEMPLATES, strict=False)]
