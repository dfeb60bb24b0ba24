"""The fixed prompts of the engine benchmark: 8 general chat prompts and 8 that quote their input.

The quoting prompts ask for an answer that repeats large parts of the prompt (a passage to repeat or quote,
code to return with a small edit): the case prompt-lookup (n-gram) drafting is built for. A request to
quote only counts if the model does quote, so these were kept from a larger set because the default
135M target's greedy answer really copies its input for most of its first 128 tokens (measured with
n-gram k = 4: 2.5 to 4.4 tokens per target forward, against ~1.4 for a prompt it paraphrases instead).
Passages run ~150 tokens so that the copy is not over before the benchmark's 128 new tokens are. All are
sent through the target's chat template.
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

_FUNC_STATS = '''def summarize(values):
    """Return the count, total, mean, smallest and largest of a list of numbers."""
    count = 0
    total = 0
    smallest = None
    largest = None
    for value in values:
        count = count + 1
        total = total + value
        if smallest is None or value < smallest:
            smallest = value
        if largest is None or value > largest:
            largest = value
    if count == 0:
        return {"count": 0, "total": 0, "mean": None, "smallest": None, "largest": None}
    mean = total / count
    return {"count": count, "total": total, "mean": mean, "smallest": smallest, "largest": largest}'''
_FUNC_FIND = """def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None


def add_user(users, name, age):
    user = {"name": name, "age": age}
    users.append(user)
    return user


def remove_user(users, name):
    user = find_user(users, name)
    if user is not None:
        users.remove(user)
    return user"""
_FUNC_PARSE = """def parse_config(text):
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        key = key.strip()
        value = value.strip()
        if value.isdigit():
            value = int(value)
        elif value.lower() in ("true", "false"):
            value = value.lower() == "true"
        config[key] = value
    return config"""
_PASSAGE_BEES = (
    "Honey bees live in colonies of up to sixty thousand workers. Each worker has a job that changes with "
    "her age: young bees clean cells and feed larvae, middle-aged bees build comb and guard the entrance, "
    "and the oldest bees fly out to collect nectar and pollen. A forager that finds a good patch of flowers "
    "returns to the hive and performs a waggle dance, which tells her sisters the direction and distance "
    "of the food. The queen lays up to two thousand eggs a day, and the colony survives the winter by "
    "clustering together and eating the honey it stored in summer. In spring, when the hive grows crowded, "
    "the old queen leaves "
    "with about half of the workers to found a new colony, and the bees that stay behind raise a new queen "
    "from one of the young larvae. A strong colony can make more than thirty kilograms of surplus honey in a "
    "good year."
)
_PASSAGE_RAIL = (
    "The first public railway to use steam locomotives, the Stockton and Darlington Railway, opened in "
    "1825. Its engine, Locomotion No. 1, pulled a train of coal wagons and a passenger coach at about "
    "fifteen miles per hour. Five years later the Liverpool and Manchester Railway opened as the first "
    "line to run scheduled passenger trains entirely by steam. Railways spread quickly: by 1850 Britain had "
    "more than six thousand miles of track, and journeys that had taken days by coach took hours by train. "
    "The railways also changed how people "
    "measured time: towns that had kept their own local time agreed on a single railway time so that "
    "timetables made sense, and in 1880 it became the legal time for the whole of Great Britain. Cheap "
    "excursion trains let ordinary families visit the seaside for the first time."
)
_PASSAGE_OCEAN = (
    "The ocean covers about seventy-one percent of the Earth's surface and holds about ninety-seven percent "
    "of its water. Sunlight reaches only the top two hundred metres, the sunlit zone, where almost all "
    "marine plants and most fish live. Below it lies the twilight zone, down to about one thousand metres, "
    "and then the midnight zone, where the only light comes from animals that make their own. The deepest "
    "point, the Challenger Deep in the Mariana Trench, is almost eleven thousand metres below the surface. "
    "Ocean currents carry warm water from the tropics "
    "towards the poles and cold water back again, which keeps the climate of many coasts milder than it "
    "would otherwise be. The ocean also absorbs about a quarter of the carbon dioxide that people release "
    "into the air each year."
)
QUOTING_PROMPTS: tuple[str, ...] = (
    f"Repeat the following passage word for word:\n\n{_PASSAGE_RAIL}",
    f"Repeat the following passage, then list its three main facts:\n\n{_PASSAGE_OCEAN}",
    f"Quote the following passage word for word, then say in one sentence what it is about:\n\n{_PASSAGE_BEES}",
    f"Repeat the following passage, then list its three main facts:\n\n{_PASSAGE_BEES}",
    f"Here is a function:\n\n{_FUNC_PARSE}\n\nCopy the function exactly and add a docstring. "
    "Reply with the complete function.",
    f"Here is some code:\n\n{_FUNC_FIND}\n\nReply with the same code, unchanged, inside a Markdown code block.",
    f"Here is a function:\n\n{_FUNC_STATS}\n\nRename the variable count to n. "
    "Reply with the complete updated function.",
    "Correct the spelling mistakes in this passage and return the whole corrected passage:\n\n"
    + _PASSAGE_RAIL.replace("locomotives", "locomotivs").replace("passenger", "pasenger", 1),
)

# A file rewritten twice with different small edits, by two sessions (the suffix decoding benchmark's agent-like
# workload): the second rewrite is the repeat, its answer mostly the first one's.
REWRITE_TASKS: tuple[tuple[str, str, str], ...] = (
    (_FUNC_STATS, "Rename the variable total to s.", "Rename the variable count to n."),
    (_FUNC_FIND, "Rename the function find_user to get_user.", "Rename the parameter users to people."),
    (_FUNC_PARSE, "Add a docstring.", "Rename the variable config to settings."),
)


def rewrite_prompt(code: str, edit: str) -> str:
    return f"Here is a function:\n\n{code}\n\n{edit} Reply with the complete updated function."
