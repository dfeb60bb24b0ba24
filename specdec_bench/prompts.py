"""The fixed prompts of the engine benchmark: 8 general chat prompts and 8 that quote their input.

The quoting prompts ask for an answer that repeats large parts of the prompt (code edits, summaries with
quotations): the case prompt-lookup (n-gram) drafting is built for. All are sent through the target's
chat template.
"""

from __future__ import annotations

GENERAL_PROMPTS: tuple[str, ...] = (
    "Write a short story about a cat who learns to fly.",
    "Explain how photosynthesis works, step by step.",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "What are the main causes of the seasons on Earth?",
    "Give me five tips for staying focused while studying.",
    "Describe the water cycle to a ten-year-old.",
    "Write a polite email asking a colleague to review my report by Friday.",
    "Compare trains and planes for a 500 km trip: cost, time and comfort.",
)

_FUNC_AREA = '''def area(w, h):
    """Return the area of a rectangle."""
    x = w * h
    if x < 0:
        raise ValueError("negative area")
    return x'''

_FUNC_MEAN = """def mean(values):
    total = 0
    count = 0
    for v in values:
        total = total + v
        count = count + 1
    if count == 0:
        return 0
    return total / count"""

_FUNC_WORDS = """def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower().strip(".,!?")
        if word in counts:
            counts[word] = counts[word] + 1
        else:
            counts[word] = 1
    return counts"""

_FUNC_FIND = """def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None


def add_user(users, name, age):
    user = {"name": name, "age": age}
    users.append(user)
    return user"""

_PASSAGE_BEES = (
    "Honey bees live in colonies of up to sixty thousand workers. Each worker has a job that changes with "
    "her age: young bees clean cells and feed larvae, middle-aged bees build comb and guard the entrance, "
    "and the oldest bees fly out to collect nectar and pollen. A forager that finds a good patch of flowers "
    "returns to the hive and performs a waggle dance, which tells her sisters the direction and distance "
    "of the food. The queen lays up to two thousand eggs a day, and the colony survives the winter by "
    "clustering together and eating the honey it stored in summer."
)

_PASSAGE_RAIL = (
    "The first public railway to use steam locomotives, the Stockton and Darlington Railway, opened in "
    "1825. Its engine, Locomotion No. 1, pulled a train of coal wagons and a passenger coach at about "
    "fifteen miles per hour. Five years later the Liverpool and Manchester Railway opened as the first "
    "line to run scheduled passenger trains entirely by steam. Railways spread quickly: by 1850 Britain had "
    "more than six thousand miles of track, and journeys that had taken days by coach took hours by train."
)

QUOTING_PROMPTS: tuple[str, ...] = (
    f"Here is a function:\n\n{_FUNC_AREA}\n\nRename the variable x to result. Reply with the whole function.",
    f"Here is a function:\n\n{_FUNC_MEAN}\n\nAdd type hints to it. Reply with the whole function.",
    f"Here is a function:\n\n{_FUNC_WORDS}\n\nRename counts to frequencies. Reply with the whole function.",
    f"Here is some code:\n\n{_FUNC_FIND}\n\nAdd type hints and a docstring to both functions. Reply with the code.",
    f'Summarise this passage, quoting its key sentences word for word in quotes:\n\n"{_PASSAGE_BEES}"',
    f'Summarise this passage, quoting its key sentences word for word in quotes:\n\n"{_PASSAGE_RAIL}"',
    f"Here is a function:\n\n{_FUNC_MEAN}\n\nRename values to numbers and v to n. Reply with the whole function.",
    f"Repeat the following passage, then list its three main facts:\n\n{_PASSAGE_BEES}",
)
