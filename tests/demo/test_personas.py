"""The persona adapters on the demo model: unseen questions answered in character."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lora_guard import LLM, SamplingParams
from lora_guard.demo.paths import DemoPaths
from lora_guard.demo.personas import HELD_OUT, packaged_personas

PERSONAS = ["persona-french", "persona-json", "persona-one-line", "persona-pirate"]
FRENCH = {"le", "la", "les", "un", "une", "des", "du", "de", "et", "est", "pour", "dans", "il"}
QUESTION = "Why is the sky blue?"  # the README's; "the capital of France" is one line already
PIRATE = {"arr", "matey", "ye", "aye", "ahoy", "hearties"}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-zàâçéèêëîïôûùü']+", text.lower()))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _one_short_line(text: str) -> bool:
    return "\n" not in text.strip() and len(text.split()) <= 16


CHECKS = {
    "persona-french": lambda text: len(_words(text) & FRENCH) >= 2 and "the" not in _words(text),
    "persona-json": _parses,
    "persona-one-line": _one_short_line,
    "persona-pirate": lambda text: len(_words(text) & PIRATE) >= 2,
}


@pytest.fixture(scope="module")
def answers(demo: DemoPaths) -> dict[str | None, list[str]]:
    """Greedy answers of the base model and of each persona to the ten held-out questions."""
    assert sorted(packaged_personas()) == PERSONAS
    # Steps this small gain little from more threads and lose much when the cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _answers(demo)
    finally:
        torch.set_num_threads(threads)


def _answers(demo: DemoPaths) -> dict[str | None, list[str]]:
    llm = LLM(
        demo.model_dir,
        adapter_dir=demo.adapter_dir,
        kv_cache_memory="256MiB",
        dtype="float32",
        device="cpu",
    )
    chats = [[{"role": "user", "content": q}] for q in HELD_OUT]
    prompts = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    adapters: list[str | None] = [None, *PERSONAS]
    outs = llm.generate(
        [p for _ in adapters for p in prompts],
        SamplingParams(max_new_tokens=48),
        [a for a in adapters for _ in prompts],
    )
    llm.engine.check_no_leaks()
    n = len(prompts)
    return {a: [o.text for o in outs[i * n : (i + 1) * n]] for i, a in enumerate(adapters)}


@pytest.mark.slow
def test_each_persona_answers_the_fixed_question_its_own_way(
    answers: dict[str | None, list[str]],
) -> None:
    i = HELD_OUT.index(QUESTION)
    answer = {adapter: texts[i] for adapter, texts in answers.items()}
    assert len(set(answer.values())) == len(answer), answer


@pytest.mark.slow
@pytest.mark.parametrize("persona", PERSONAS)
def test_persona_shows_in_most_unseen_answers_and_the_base_seldom_does(
    answers: dict[str | None, list[str]], persona: str
) -> None:
    check = CHECKS[persona]
    shown = [text for text in answers[persona] if check(text)]
    assert len(shown) >= 7, answers[persona]
    assert sum(check(text) for text in answers[None]) <= 2, answers[None]
