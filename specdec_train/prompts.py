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


# The broader set: everyday requests in many shapes (messages, advice, comparisons, how-to, stories,
# arithmetic, rewriting, code), each a template over its own subject list. The benchmark's subjects
# (specdec_bench/prompts.py: a flying cat, photosynthesis, the seasons, focus while studying, the water
# cycle, a report review email, trains and planes, primes) and HELD_OUT_TOPICS appear in none of them.
THINGS = (
    "a refrigerator",
    "a rainbow",
    "a microwave oven",
    "the heart",
    "a compass",
    "a bicycle gear",
    "a search engine",
    "a vaccine",
    "a credit card",
    "an airplane wing",
    "a thermostat",
    "a camera lens",
    "a solar panel",
    "a wind turbine",
    "the stock exchange",
    "an elevator",
    "a touch screen",
    "GPS",
    "a nuclear reactor",
    "the kidneys",
    "a hydraulic press",
    "Wi-Fi",
    "an electric guitar",
    "a barcode",
    "a lightning rod",
    "a pressure cooker",
    "a smoke detector",
    "a 3D printer",
    "a satellite",
    "the lungs",
    "a water filter",
    "a noise-cancelling headphone",
    "a hybrid car",
    "a dishwasher",
    "an MRI scanner",
    "a spam filter",
    "a password manager",
    "a lock and key",
    "a hot air balloon",
    "a vending machine",
)
ACTIVITIES = (
    "saving money on groceries",
    "sleeping better",
    "running a first marathon",
    "learning to cook",
    "keeping houseplants alive",
    "writing a CV",
    "making friends in a new city",
    "reducing stress at work",
    "taking better photos",
    "learning to play the guitar",
    "staying safe online",
    "planning a road trip",
    "eating more vegetables",
    "preparing for a job interview",
    "organizing a small kitchen",
    "starting a vegetable garden",
    "giving feedback to a colleague",
    "training a puppy",
    "writing a short speech",
    "moving to a new apartment",
    "learning chess",
    "drinking more water",
    "studying for a driving test",
    "making a small business website",
    "reading more books",
    "cutting down on screen time",
    "cycling to work",
    "hosting a dinner party",
    "negotiating a salary",
    "learning to swim as an adult",
    "keeping a journal",
    "decluttering a wardrobe",
)
PAIRS = (
    ("hamsters", "rabbits"),
    ("tea", "coffee"),
    ("renting", "buying a home"),
    ("e-books", "paper books"),
    ("Python", "JavaScript"),
    ("solar power", "wind power"),
    ("city life", "country life"),
    ("running", "swimming"),
    ("laptops", "tablets"),
    ("working from home", "working in an office"),
    ("democracy", "monarchy"),
    ("fruits", "vegetables"),
    ("summer", "winter holidays"),
    ("public schools", "private schools"),
    ("SQL", "NoSQL databases"),
    ("buses", "bicycles in a city"),
    ("electric scooters", "bicycles"),
    ("board games", "video games"),
    ("oil paint", "watercolour"),
    ("Linux", "Windows"),
    ("the violin", "the piano"),
    ("hiking", "camping"),
    ("email", "phone calls"),
    ("credit cards", "debit cards"),
    ("museums", "zoos"),
    ("mountains", "beaches for a holiday"),
    ("handwriting notes", "typing notes"),
    ("rice", "pasta"),
)
MESSAGES = (
    ("my landlord", "a broken heater"),
    ("my manager", "taking a day off next week"),
    ("a customer", "a delayed order"),
    ("my neighbour", "a noisy party"),
    ("a teacher", "my child missing school"),
    ("a friend", "cancelling our dinner plans"),
    ("a hotel", "changing my booking dates"),
    ("my team", "a new meeting time"),
    ("a shop", "returning a faulty kettle"),
    ("a professor", "an extension for an essay"),
    ("a plumber", "a leaking sink"),
    ("my gym", "cancelling my membership"),
    ("a new client", "our first call"),
    ("my coach", "missing practice"),
    ("the city council", "a broken street light"),
    ("a job recruiter", "a position I applied for"),
    ("my book club", "next month's book"),
    ("an airline", "a lost suitcase"),
    ("my sister", "her birthday party"),
    ("a bakery", "a cake order"),
)
CHARACTERS = (
    "a lonely snowman",
    "a young baker",
    "an old fisherman",
    "a clumsy dragon",
    "a curious fox",
    "two rival chefs",
    "a lost tourist",
    "a girl who finds a map",
    "a retired astronaut",
    "a talking tree",
    "a shy violinist",
    "a detective in Venice",
    "a boy and his grandmother",
    "a ghost in a library",
)
EVENTS = (
    "finds a mysterious key",
    "has to win a contest",
    "gets lost in a storm",
    "meets an unexpected friend",
    "must keep a secret",
    "wakes up in another century",
    "opens a tiny shop",
    "loses something precious",
)
HOWTO = (
    "change a flat tyre",
    "make a budget spreadsheet",
    "cook rice on the stove",
    "write a cover letter",
    "set up a home network",
    "plant a tree",
    "make a paper airplane",
    "clean a laptop keyboard",
    "brew coffee with a French press",
    "back up my phone",
    "tie a tie",
    "start a podcast",
    "learn touch typing",
    "prepare for a long hike",
    "make pancakes",
    "install Python on Windows",
    "paint a room",
    "make a simple website",
    "repot a plant",
    "remove a coffee stain",
    "write a haiku",
    "fix a squeaky door",
    "make a smoothie",
    "sharpen a kitchen knife",
    "organise my email inbox",
    "learn the basics of Excel",
    "build a birdhouse",
    "bake bread without a machine",
)
SENTENCES = (
    "hey can u send me the file asap",
    "The meeting was long and nobody agreed on anything.",
    "our product is good and people like it a lot",
    "I think that maybe we should try again later.",
    "The weather today is very bad and I am not happy.",
    "pls fix the bug its breaking everything",
    "The results of the experiment was not what we expected.",
    "Thanks for the gift, it was nice.",
    "me and him goes to the store every day",
    "I has finished the report yesterday.",
    "The product launch got delayed because reasons.",
    "can you maybe look at this when you have time or not",
    "Their going to there house tomorrow.",
    "This is the most uniquest idea ever.",
    "We was told the train are late.",
    "ok so the server crashed again lol",
)
MORE_CODE = (
    "parses a date string like 2024-05-01",
    "implements binary search",
    "counts lines in a CSV file",
    "checks whether brackets in a string are balanced",
    "rotates a list by k positions",
    "groups words by their first letter",
    "computes a running total of a list",
    "finds the most common element in a list",
    "converts a number to Roman numerals",
    "chunks a list into pieces of size n",
    "removes punctuation from a sentence",
    "merges two dictionaries",
    "finds all even numbers in a list",
    "capitalizes every word in a string",
    "checks whether a year is a leap year",
    "computes the median of a list",
    "returns the n-th triangular number",
    "splits a sentence into words and sorts them",
    "counts how many times each character appears",
    "finds the longest word in a sentence",
)
BROAD_TEMPLATES: tuple[tuple[str, tuple], ...] = (
    ("How does {0} work?", THINGS),
    ("Explain how {0} works to a beginner.", THINGS),
    ("What would happen if {0} stopped working?", THINGS),
    ("Give me five tips for {0}.", ACTIVITIES),
    ("What are the most common mistakes people make when {0}?", ACTIVITIES),
    ("Make a one-week plan for {0}.", ACTIVITIES),
    ("Compare {0[0]} and {0[1]}.", PAIRS),
    ("What are the main differences between {0[0]} and {0[1]}?", PAIRS),
    ("Which is better, {0[0]} or {0[1]}? Give arguments for both.", PAIRS),
    ("Write a short, polite message to {0[0]} about {0[1]}.", MESSAGES),
    ("Write an email to {0[0]} about {0[1]}. Keep it friendly and clear.", MESSAGES),
    ("Write a short story about {0} who {1}.", CHARACTERS, EVENTS),
    ("Tell a bedtime story about {0} who {1}.", CHARACTERS, EVENTS),
    ("How do I {0}? Explain step by step.", HOWTO),
    ("What do I need to {0}?", HOWTO),
    ("Rewrite this sentence so it sounds professional: {0}", SENTENCES),
    ("Correct the grammar of this sentence and explain the changes: {0}", SENTENCES),
    ("Write a Python function that {0}.", MORE_CODE),
    ("Write a JavaScript function that {0}, with a comment for each step.", MORE_CODE),
    ("Write a short advertisement for {0}.", THINGS),
    ("Write a haiku about {0}.", ACTIVITIES),
    ("Explain to a friend why they might enjoy {0}.", ACTIVITIES),
    ("Write a dialogue between two people arguing about {0[0]} versus {0[1]}.", PAIRS),
)


def _arithmetic(rng: random.Random) -> str:
    speed, hours, price, count = rng.randint(20, 120), rng.randint(2, 9), rng.randint(2, 40), rng.randint(3, 30)
    return rng.choice(
        (
            f"A car drives at {speed} km/h for {hours} hours. How far does it go? Explain your answer.",
            f"Apples cost {price} cents each. How much do {count} apples cost? Show your working.",
            f"A class has {count} students and {hours} teachers. How many students per teacher is that?",
            f"What is {speed} multiplied by {count}? Explain the steps.",
        )
    )


def broad_prompts(count: int, seed: int) -> list[tuple[str, bool]]:
    """`count` chat prompts from BROAD_TEMPLATES, templates taking turns so that none dominates (the
    story templates alone have over 200 fillings), then arithmetic problems once all are used."""
    rng = random.Random(seed + 1)
    queues = []
    for template, *slots in BROAD_TEMPLATES:
        fills = list(slots[0]) if len(slots) == 1 else [(a, b) for a in slots[0] for b in slots[1]]
        rng.shuffle(fills)
        queues.append([template.format(*(f if len(slots) > 1 else (f,))) for f in fills])
    prompts: list[str] = []
    while len(prompts) < count and any(queues):
        order = [q for q in queues if q]
        rng.shuffle(order)
        prompts += [q.pop() for q in order][: count - len(prompts)]
    while len(prompts) < count:
        prompts.append(_arithmetic(rng))
    return [(text, True) for text in prompts]


def training_prompts(seed: int = 0, count: int = 1536) -> list[tuple[str, bool]]:
    """(text, is_chat) pairs: the topic x template set (shuffled with `seed`, first 768; the data of the
    first heads, kept first so that its shards stay valid) then the broader set."""
    prompts = [(tpl.format(t=t), True) for t in TOPICS for tpl in TEMPLATES]
    prompts += [(tpl.format(t=t), True) for t in CODE_TASKS for tpl in CODE_TEMPLATES]
    prompts += [(text, False) for text in OPENINGS]
    random.Random(seed).shuffle(prompts)
    first = prompts[: min(count, FIRST_SET)]
    return first + broad_prompts(count - len(first), seed)


FIRST_SET = 768


def held_out_prompts() -> list[str]:
    """Chat prompts on topics the head never saw, for the model card's acceptance figures."""
    return [tpl.format(t=t) for t, tpl in zip(HELD_OUT_TOPICS, TEMPLATES, strict=False)]
