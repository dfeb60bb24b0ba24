"""The broad training set: conversations of many shapes, generated from families of templates over subject
lists, so the set is large, diverse and reproducible from a seed.

Families: long answers, explanations, lists, Markdown tables, code in several languages (and SQL), roles and
places, arithmetic, the first heads' topic and everyday prompts (specdec_train/prompts.py), plain-text
openings (no chat template), and multi-turn conversations (a first request, then one or two follow-ups the
target answers in turn). Some chat conversations carry a system prompt instead of the template's default.
No prompt names a held-out topic or a benchmark subject: `BANNED` is checked on every one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from specdec_train import prompts as first
from specdec_train import subjects as s

# Held-out topics (prompts.HELD_OUT_TOPICS) and the benchmark's subjects (specdec_bench/prompts.py).
BANNED = re.compile(
    r"lighthouse|submarine|origami|arctic|cheese|robot|photosynth|water cycle|season|prime|cat who|flying cat"
    r"|focus(ed)? while study|review my report|trains and planes|planes and trains",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Conversation:
    turns: tuple[str, ...]  # the user's messages; the target answers each in turn
    family: str
    max_new_tokens: int  # per answer
    system: str | None = None  # None: the chat template's default system prompt
    chat: bool = True  # False: turns[0] is plain text the target continues (one turn)


def _fill(template: str, *lists: tuple) -> list[str]:
    if len(lists) == 1:
        return [template.format(a) for a in lists[0]]
    return [template.format(a, b) for a in lists[0] for b in lists[1]]


def _pairs(items: tuple[str, ...], rng: random.Random, count: int) -> tuple[tuple[str, str], ...]:
    return tuple(tuple(rng.sample(items, 2)) for _ in range(count))  # type: ignore[misc]


def _families(rng: random.Random) -> dict[str, tuple[float, int, list[str]]]:
    """family -> (weight, max new tokens, prompts)."""
    subj, aud, lang = s.SUBJECTS, s.AUDIENCES, s.LANGUAGES
    pairs = _pairs(subj, rng, 400)
    long = [
        *_fill("Write a detailed essay about {}, with an introduction, three sections and a conclusion.", subj),
        *_fill("Give me a thorough explanation of {}: its history, how it works today and why it matters.", subj),
        *_fill("Write a long, detailed guide to {} for {}.", subj, aud),
        *_fill("Write a blog post titled 'Everything you need to know about {}'.", subj),
        *_fill("Explain {} in depth, as if you were giving a university lecture.", subj),
        *_fill("Tell me everything you know about {}.", subj),
    ]
    explain = [
        *_fill("What is {}?", subj),
        *_fill("Explain {} to {}.", subj, aud),
        *_fill("How does {} affect everyday life?", subj),
        *_fill("Why does {} matter? Answer in a few paragraphs.", subj),
        *_fill("Describe {} in three paragraphs.", subj),
        *_fill("What would the world be like without {}?", subj),
        *_fill("Give me a short history of {}.", subj),
        *_fill("What is the connection between {} and {}?", subj, s.FIELDS),
        *_fill("What does {} study, and why is it useful?", s.FIELDS),
    ]
    lists = [
        *_fill("List ten interesting facts about {}.", subj),
        *_fill("Give me a numbered list of the key ideas in {}.", subj),
        *_fill("What are five common myths about {}? List them and say why each is wrong.", subj),
        *_fill("Make a checklist for someone getting started with {}.", subj),
        *_fill("List the pros and cons of {} as bullet points.", subj),
        *_fill("Give me a glossary of ten terms related to {}.", subj),
        *_fill("List eight questions a student might ask about {}, with short answers.", subj),
    ]
    tables = [
        *[f"Make a Markdown table comparing {a} and {b} on five criteria." for a, b in pairs],
        *_fill("Create a table of five important dates in the history of {}.", subj),
        *_fill("Make a table with three columns (term, definition, example) about {}.", subj),
        *_fill("Create a weekly study plan as a Markdown table for learning about {}.", subj),
        *_fill("Make a table of the pros and cons of {}.", subj),
        *_fill("Make a table of the top five sights in {}, with a short note for each.", s.PLACES),
    ]
    code = [
        *_fill("Write a {} function that {}.", lang, s.CODE_TASKS),
        *_fill("Write a {} program that {}, and explain how it works.", lang, s.CODE_TASKS),
        *_fill("Write a Python function that {}. Include error handling and a usage example.", s.CODE_TASKS),
        *_fill("Write a SQL query that {}. Explain each clause.", s.SQL_TASKS),
        *_fill(
            "Explain {} in {} with a short example.",
            (
                "loops",
                "recursion",
                "classes",
                "error handling",
                "closures",
                "generators",
                "interfaces",
                "async functions",
                "modules",
                "unit tests",
                "string formatting",
                "maps",
                "regular expressions",
            ),
            lang,
        ),  # fmt: skip
        *[f"Write a Python function that {t}." for t in first.MORE_CODE + first.CODE_TASKS],
    ]
    roles = [
        *_fill("Describe a typical day of {}.", s.PROFESSIONS),
        *_fill("What skills does {} need, and how can someone learn them?", s.PROFESSIONS),
        *_fill("Write a job advertisement for {}.", s.PROFESSIONS),
        *_fill("Write five interview questions for {}, with good answers.", s.PROFESSIONS),
        *_fill("Plan a {}-day trip to {}.", ("three", "five", "seven"), s.PLACES),
        *_fill("What food should I try in {}? Describe each dish.", s.PLACES),
        *_fill("Tell me about the history and culture of {}.", s.PLACES),
        *_fill("Write a short travel diary entry about a day in {}.", s.PLACES),
    ]
    everyday = [text for text, _ in first.broad_prompts(10_000, rng.randrange(1 << 30))]
    topics = [tpl.format(t=t) for t in first.TOPICS for tpl in first.TEMPLATES]
    plain = _fill("{} {}", s.OPENINGS, subj)
    return {
        "long": (0.14, 512, long),
        "explain": (0.12, 384, explain),
        "lists": (0.11, 384, lists),
        "tables": (0.07, 384, tables),
        "code": (0.14, 384, code),
        "roles": (0.06, 384, roles),
        "everyday": (0.10, 384, everyday),
        "topics": (0.04, 384, topics),
        "plain": (0.04, 320, plain),
        "multi": (0.18, 256, []),  # first turns drawn from the other chat families
    }


def conversation_set(seed: int, count: int) -> list[Conversation]:
    """`count` conversations, deterministic for `seed`; families drawn by weight, each without repeats."""
    rng = random.Random(seed)
    families = _families(rng)
    pools = {name: [p for p in texts if not BANNED.search(p)] for name, (_, _, texts) in families.items()}
    for pool in pools.values():
        rng.shuffle(pool)
    names = list(families)
    weights = [families[n][0] for n in names]
    chat_families = [n for n in names if n not in ("plain", "multi")]
    out: list[Conversation] = []
    while len(out) < count:
        name = rng.choices(names, weights)[0]
        max_new = families[name][1]
        if name == "multi":
            base = rng.choice([n for n in chat_families if pools[n]])
            follow = s.CODE_FOLLOW_UPS if base == "code" else s.FOLLOW_UPS
            turns = (pools[base].pop(), *rng.sample(follow, rng.choice((1, 1, 2))))
        elif pools[name]:
            turns = (pools[name].pop(),)
        elif not any(pools[n] for n in chat_families):
            turns = (first._arithmetic(rng),)
        else:
            continue
        if name == "plain":
            out.append(Conversation(turns, name, max_new, chat=False))
            continue
        system = rng.choice(s.SYSTEM_PROMPTS) if rng.random() < 0.15 else None
        out.append(Conversation(turns, name, max_new, system))
    return out


HELD_OUT_TEMPLATES = (
    "Explain {} in simple terms.",
    "Write a detailed essay about {}, with an introduction, three sections and a conclusion.",
    "List ten interesting facts about {}.",
    "Make a Markdown table of the pros and cons of {}.",
    "Write a short story about {}.",
    "Give me a short history of {}.",
    "How would you teach a beginner about {}?",
    "What are five common myths about {}? List them and say why each is wrong.",
)
HELD_OUT_CODE = (
    "Write a Python function that simulates a robot moving on a grid from a string of commands.",
    "Write a Python class that stores lighthouses with their heights and returns the tallest one.",
    "Write a JavaScript function that scales a cheese recipe to n servings.",
    "Write a Python function that converts Arctic temperatures from Celsius to Kelvin for a list of readings.",
    "Write a SQL query that lists the submarines in a fleet table ordered by their maximum depth.",
    "Write a Python function that counts how many origami cranes each student folded, from a list of names.",
)


def held_out_conversations() -> list[Conversation]:
    """The fixed held-out set of the evaluation and the trainer's selection: every topic of
    prompts.HELD_OUT_TOPICS (absent from the training set, as BANNED guarantees) under eight templates of the
    training families, and six code requests about them. One turn each."""
    texts = [tpl.format(t) for t in first.HELD_OUT_TOPICS for tpl in HELD_OUT_TEMPLATES] + list(HELD_OUT_CODE)
    return [Conversation((text,), "held-out", 256) for text in texts]
