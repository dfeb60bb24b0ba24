"""Subject lists of the broad training conversations (specdec_train/conversations.py).

None names a held-out topic (prompts.HELD_OUT_TOPICS) or a benchmark subject (specdec_bench/prompts.py);
conversations.BANNED is the guard that checks every generated prompt against both.
"""

from __future__ import annotations

# fmt: off
SUBJECTS = (
    # science and nature
    "plate tectonics", "the periodic table", "DNA", "evolution", "gravity", "magnetism", "electricity",
    "the speed of light", "atoms", "chemical reactions", "the human brain", "the digestive system",
    "bacteria", "viruses", "fungi", "the carbon cycle", "ocean currents", "hurricanes", "tornadoes",
    "thunderstorms", "snowflakes", "clouds", "the ozone layer", "the Milky Way", "comets", "Mars",
    "Jupiter", "the Sun", "eclipses", "telescopes", "microscopes", "genetics", "the nervous system",
    "blood types", "bones and muscles", "the five senses", "memory", "dreams", "allergies", "nutrition",
    "vitamins", "exercise", "hydration", "the skin", "insects", "spiders", "octopuses", "whales", "sharks",
    "frogs", "owls", "butterflies", "ants", "trees", "mushrooms", "deserts", "rivers", "lakes", "caves",
    "islands", "forests", "wetlands", "soil", "fossils", "minerals", "diamonds", "gold", "salt", "sound",
    "heat", "friction", "magnets", "lasers", "radio waves", "nuclear energy", "hydropower",
    # history and society
    "ancient Greece", "the Vikings", "the Silk Road", "the Maya civilization", "the Ottoman Empire",
    "the Middle Ages", "castles", "knights", "the samurai", "the Aztecs", "the Cold War",
    "the first airplanes", "the telephone", "the steam engine", "the invention of writing", "money",
    "banks", "taxes", "elections", "the United Nations", "human rights", "libraries", "museums",
    "newspapers", "the postal service", "maps", "calendars", "clocks", "the alphabet", "universities",
    "hospitals", "the police", "firefighters", "farming", "fishing", "trade", "cities", "villages",
    "immigration", "languages", "dialects", "philosophy", "ethics", "law", "economics", "inflation",
    "unemployment", "supply and demand", "advertising", "marketing", "startups", "leadership",
    "teamwork", "negotiation", "customer service", "project management", "remote work",
    # technology
    "computers", "operating systems", "programming", "algorithms", "databases", "encryption",
    "passwords", "computer viruses", "social media", "video games", "virtual reality", "drones",
    "self-driving cars", "artificial intelligence", "neural networks", "open source software",
    "version control", "web browsers", "email", "the cloud", "data centers", "microchips",
    "semiconductors", "USB", "Bluetooth", "5G networks", "fiber optics", "printers", "keyboards",
    "spreadsheets", "search algorithms", "compression", "cybersecurity", "blockchain", "APIs",
    # arts, culture, everyday life
    "painting", "sculpture", "photography", "film making", "theatre", "opera", "ballet", "hip hop",
    "classical music", "rock music", "the guitar", "the piano", "drums", "poetry", "novels",
    "comic books", "fairy tales", "myths", "architecture", "fashion", "interior design", "pottery",
    "knitting", "woodworking", "cooking", "baking", "spices", "chocolate", "pizza", "sushi", "rice",
    "pasta", "soup", "breakfast", "vegetarian food", "street food", "wine", "juice", "water",
    "football", "basketball", "tennis", "swimming", "running", "cycling", "yoga", "hiking", "camping",
    "skiing", "surfing", "board games", "puzzles", "magic tricks", "birthdays", "weddings", "holidays",
    "travel", "airports", "hotels", "trains", "ships", "bridges", "tunnels", "skyscrapers", "houses",
    "furniture", "pets", "dogs", "horses", "parrots", "goldfish", "parenting", "grandparents",
    "school", "homework", "exams", "teachers", "friendship", "kindness", "courage", "patience",
    "happiness", "stress", "habits", "motivation", "creativity", "curiosity", "boredom", "shopping",
    "saving money", "credit scores", "insurance", "retirement", "volunteering", "charity",
)

FIELDS = (
    "history", "biology", "physics", "chemistry", "geography", "mathematics", "economics",
    "computer science", "psychology", "literature", "art", "music", "medicine", "engineering",
    "astronomy", "ecology", "sociology", "statistics", "nutrition", "architecture",
)

PROFESSIONS = (
    "a nurse", "a pilot", "a chef", "a carpenter", "a software engineer", "a farmer", "a librarian",
    "an architect", "a journalist", "a dentist", "a firefighter", "a mechanic", "an electrician",
    "a lawyer", "a teacher", "an astronaut", "a veterinarian", "a photographer", "a translator",
    "a data scientist", "an accountant", "a park ranger", "a game designer", "a marine biologist",
)

AUDIENCES = (
    "a five-year-old", "a high school student", "a grandparent", "a busy manager", "a beginner",
    "an expert", "a tourist", "a new employee", "a university student", "someone who hates maths",
)

PLACES = (
    "Japan", "Brazil", "Kenya", "Norway", "Italy", "Mexico", "India", "Australia", "Egypt", "Canada",
    "Peru", "Vietnam", "Iceland", "Morocco", "New Zealand", "Spain", "Scotland", "Thailand", "Chile",
    "Greece", "Turkey", "Portugal", "Indonesia", "Argentina", "Ireland", "South Korea", "Poland",
)

LANGUAGES = ("Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "Bash", "SQL")

CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a string is a valid IPv4 address",
    "counts the words in a text file", "finds duplicate values in a list", "computes a moving average",
    "converts a temperature from Fahrenheit to Celsius", "generates a random password",
    "parses a CSV line into fields", "flattens a nested dictionary", "finds the intersection of two lists",
    "implements a stack with push and pop", "implements a queue with two stacks", "sorts a list with merge sort",
    "sorts a list with quicksort", "computes the power set of a list", "checks whether a number is even",
    "computes the sum of a list without using sum", "finds the maximum depth of a nested list",
    "converts a decimal number to binary", "counts the occurrences of each word", "validates a phone number",
    "returns the first non-repeating character", "compresses a string like aaabb into a3b2",
    "computes the distance between two points", "checks whether a list is sorted", "shuffles a list",
    "reads a JSON file and prints its keys", "computes compound interest", "finds all divisors of a number",
    "computes the least common multiple of two numbers", "removes the vowels from a string",
    "converts a list of pairs into a dictionary", "splits a list into even and odd numbers",
    "implements a simple linked list", "computes the area of a circle", "formats a number with commas",
    "returns the last n lines of a file", "checks whether two rectangles overlap", "counts uppercase letters",
    "implements a binary search tree insert", "computes the edit distance between two strings",
    "finds the longest common prefix of a list of strings", "memoizes a slow function",
    "retries a function call up to three times", "measures how long a function takes",
)

SQL_TASKS = (
    "lists all customers from a given city", "finds the ten most expensive products",
    "counts orders per customer", "finds employees who earn more than their manager",
    "computes the total sales per month", "finds customers who never placed an order",
    "deletes duplicate rows from a table", "joins orders with customers and products",
    "finds the second highest salary", "lists products that are out of stock",
)

FOLLOW_UPS = (
    "Can you give me an example?", "Can you make that shorter?", "Explain that in simpler words.",
    "Can you put that in a table?", "Turn that into a numbered list.", "What is the most important point?",
    "Can you explain the second point in more detail?", "What are some common misconceptions about this?",
    "Thanks! Can you summarize it in one sentence?", "How would I explain this to a child?",
    "What should I read next to learn more?", "Can you write that more formally?",
    "Can you add a short conclusion?", "What are the pros and cons?", "Give me three more ideas.",
    "Can you make it funnier?", "Why is that?", "Is there anything you left out?",
    "Write a short quiz with three questions about this.", "Can you rewrite it as an email?",
)

CODE_FOLLOW_UPS = (
    "Can you add comments to the code?", "How would I test this function?", "Can you make it faster?",
    "What happens if the input is empty?", "Can you rewrite it without a loop?",
    "Add type hints and a docstring.", "Explain the code line by line.", "What is its time complexity?",
    "Write two unit tests for it.", "Can you handle invalid input too?",
)

SYSTEM_PROMPTS = (
    "You are a concise assistant. Answer briefly.",
    "You are a friendly teacher who explains things step by step.",
    "You are an expert software engineer. Answer with code when useful.",
    "You are a helpful assistant. Use Markdown formatting.",
    "You are a patient tutor for children.",
    "You are a professional writer who writes clear, well-structured text.",
)

OPENINGS = (
    "The history of", "A beginner's guide to", "Ten things you did not know about", "Why I love",
    "The future of", "How to get started with", "The science behind", "A short introduction to",
    "Everything you need to know about", "Common mistakes with",
)
# fmt: on
