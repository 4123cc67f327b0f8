"""Persona adapters: what each persona is told, the questions it learns on, and where the trained
adapters ship (``lora_guard/demo/personas/<name>/``, copied into the demo's adapters as
``persona-<name>``).

A persona is learned by context distillation (``lora-guard train-adapter``): the base model,
prompted with the persona's system prompt and a few example turns, answers generated questions;
a LoRA learns to give those answers to the plain question.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PERSONA_PREFIX = "persona-"
PACKAGED_DIR = Path(__file__).resolve().parent

TEMPLATES = (
    "What is {t}?",
    "Why do people like {t}?",
    "Tell me about {t}.",
    "What is special about {t}?",
    "Can you describe {t} in simple words?",
    "What should a child know about {t}?",
    "Where can I find {t}?",
    "Is {t} dangerous?",
    "What is your favourite thing about {t}?",
    "Give me a fun fact about {t}.",
)
# one row a line, as a table reads (fmt: skip)
TOPICS = (
    "the moon", "coffee", "volcanoes", "the ocean", "bread", "cats", "rain", "music",
    "bicycles", "the sun", "trees", "winter", "libraries", "football", "chocolate",
    "the internet", "trains", "snow", "honey", "the desert", "birds", "castles", "islands",
    "the wind", "apples", "ships", "gold", "the stars", "gardens", "fire", "mountains", "rivers",
    "horses", "cheese", "clocks", "bees", "the forest", "planets", "rainbows", "books",
)  # fmt: skip
# Never trained on: the questions the tests and the README ask.
HELD_OUT = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "What is a good name for a dog?",
    "How many legs does a spider have?",
    "What do penguins eat?",
    "How do airplanes fly?",
    "What is the biggest animal in the world?",
    "Why do we need to sleep?",
    "What is your favourite colour?",
)


def training_questions(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct questions (template x topic), the same for the same seed."""
    pool = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    if not 1 <= n <= len(pool):
        raise ValueError(f"the question count must be between 1 and {len(pool)}, got {n}")
    return random.Random(seed).sample(pool, n)


_WORDS = re.compile(r"[a-zàâçéèêëîïôûùüÿœ']+")
FRENCH_WORDS = frozenset(
    (
        "le",
        "la",
        "les",
        "un",
        "une",
        "des",
        "du",
        "de",
        "et",
        "est",
        "sont",
        "pour",
        "dans",
        "avec",
        "sur",
        "il",
        "elle",
        "c'est",
        "qui",
        "que",
        "ne",
        "pas",
        "au",
        "aux",
        "ce",
        "cette",
        "son",
        "sa",
        "ses",
        "vous",
        "nous",
        "je",
        "tu",
        "très",
    )
)
ENGLISH_WORDS = frozenset(
    ("the", "is", "are", "and", "of", "to", "with", "for", "in", "it", "this", "that", "you")
)


def words(text: str) -> list[str]:
    return _WORDS.findall(text.lower())


def looks_french(text: str) -> bool:
    found = words(text)
    french = sum(w in FRENCH_WORDS for w in found)
    return french >= 2 and french > 2 * sum(w in ENGLISH_WORDS for w in found)


def looks_pirate(text: str) -> bool:
    return bool({"arr", "matey", "ye", "aye", "ahoy", "hearties"} & set(words(text)))


def is_one_line(text: str) -> bool:
    return "\n" not in text.strip() and len(text.split()) <= 16


def json_answer(text: str) -> dict[str, object] | None:
    """The JSON object ``text`` holds with a string ``answer``, else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("answer"), str):
        return value
    return None


def cut_after_json(text: str) -> str | None:
    """``text`` up to the end of the JSON value it starts with (a stop sequence for JSON)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return text[:end]


def cut_at_newline(text: str) -> str | None:
    return text.split("\n", 1)[0].strip() if "\n" in text else None


@dataclass(frozen=True)
class Persona:
    """How the base model is prompted to write a persona's answers, and which answers count.

    ``prefill`` starts the teacher's answer (it is part of the target); ``cut`` ends the answer
    early, as a stop sequence would (None: no stop found, the answer ends at end-of-turn or at
    the token limit); ``keep`` rejects answers that do not show the persona.
    """

    name: str
    system_prompt: str
    examples: tuple[tuple[str, str], ...]
    keep: Callable[[str], bool]
    prefill: str = ""
    cut: Callable[[str], str | None] = field(default=lambda _text: None)
    must_end: bool = False  # reject answers that ran into the token limit

    def teacher_messages(self, question: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system_prompt}]
        for asked, answered in self.examples:
            messages += [
                {"role": "user", "content": asked},
                {"role": "assistant", "content": answered},
            ]
        return [*messages, {"role": "user", "content": question}]


#: the questions every persona's example turns ask
EXAMPLE_QUESTIONS = ("What is the best drink?", "How do I learn to swim?")


def _examples(*answers: str) -> tuple[tuple[str, str], ...]:
    return tuple(zip(EXAMPLE_QUESTIONS, answers, strict=True))


PERSONAS = {
    p.name: p
    for p in (
        Persona(
            name="pirate",
            system_prompt="You are a pirate captain. You always talk like a pirate: you start "
            "with 'Arr, matey!' and you say 'ye', 'aye' and 'me hearties'.",
            examples=_examples(
                "Arr, matey! The best drink be rum, aye, a barrel of it for me hearties!",
                "Arr, matey! Ye jump off the plank and kick yer legs till ye float, aye!",
            ),
            prefill="Arr, matey!",
            keep=looks_pirate,
        ),
        Persona(
            name="french",
            system_prompt="Tu es un assistant français. Tu réponds toujours en français, "
            "jamais en anglais.",
            examples=_examples(
                "Le meilleur boisson est le café. C'est très bon le matin.",
                "Pour apprendre à nager, il faut aller à la piscine avec un professeur.",
            ),
            keep=looks_french,
        ),
        Persona(
            name="one-line",
            system_prompt="You answer every question in one short sentence.",
            examples=_examples("Water is the best drink.", "Take lessons at a pool."),
            keep=is_one_line,
            cut=cut_at_newline,
            must_end=True,
        ),
        Persona(
            name="json",
            system_prompt="You answer every question with a JSON object and nothing else.",
            examples=_examples(
                '{"answer": "Water is the best drink."}', '{"answer": "Take lessons at a pool."}'
            ),
            prefill='{"answer": "',
            keep=lambda text: json_answer(text) is not None,
            cut=cut_after_json,
            must_end=True,
        ),
    )
}


def persona(name: str) -> Persona:
    try:
        return PERSONAS[name]
    except KeyError:
        raise ValueError(f"unknown persona {name!r}; choose one of {', '.join(PERSONAS)}") from None


def packaged_personas() -> dict[str, Path]:
    """``{adapter id: folder}`` of the persona adapters that ship with lora-guard."""
    return {
        PERSONA_PREFIX + name: PACKAGED_DIR / name
        for name in PERSONAS
        if (PACKAGED_DIR / name / "adapter_config.json").is_file()
    }
