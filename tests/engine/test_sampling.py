"""Sampling parameters and the sampler, through the real engine and on hand-made logits."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lora_guard import LLM, SamplingParams
from lora_guard.engine import InvalidParams
from lora_guard.engine.sampling import SamplerInput, sample

PROMPT = "Hello"  # three tokens: shorter than a KV block, so no run reuses another's cache


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Iterator[LLM]:
    engine = LLM(tiny_model, kv_cache_memory="4MiB")
    yield engine
    engine.engine.shutdown()


def greedy(max_new_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def row(
    params: SamplingParams, history: list[int] | None = None, seed: int | None = None
) -> SamplerInput:
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return SamplerInput(params, generator, history or [])


# seeds


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_new_tokens=16, do_sample=True, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0]

    batch = llm.generate(
        ["The quick brown fox", PROMPT, "Numbers: 0 1 2", PROMPT],
        [
            greedy(max_new_tokens=3),
            seeded,
            SamplingParams(max_new_tokens=9, temperature=1.5, seed=99, ignore_eos=True),
            SamplingParams(max_new_tokens=16, do_sample=True, seed=7, ignore_eos=True),
        ],
    )
    shuffled = llm.generate(
        [PROMPT, "A LoRA adapter", PROMPT],
        [
            SamplingParams(max_new_tokens=5, top_k=20, seed=3, ignore_eos=True),
            greedy(max_new_tokens=11),
            seeded,
        ],
    )

    assert len(alone.token_ids) == 16
    assert batch[1].token_ids == alone.token_ids
    assert shuffled[2].token_ids == alone.token_ids
    assert batch[1].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    llm.engine.check_no_leaks()


def test_different_seeds_give_different_tokens(llm: LLM) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)

    first, second, again = llm.generate([PROMPT] * 3, [params(1), params(2), params(1)])

    assert first.token_ids != second.token_ids
    assert again.token_ids == first.token_ids
    llm.engine.check_no_leaks()


def test_seeded_sampler_rows_are_reproducible_and_independent_of_their_neighbours() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=True, temperature=2.0)

    alone = [sample(logits[1:2], [row(params, seed=5)])[0][0] for _ in range(3)]
    in_batch, _ = sample(logits, [row(SamplingParams()), row(params, seed=5), row(params, seed=6)])

    assert alone == [alone[0]] * 3
    assert in_batch[1] == alone[0]
    assert in_batch[0] == int(logits[0].argmax())


# greedy-equivalent settings


def test_top_k_one_samples_the_greedy_tokens(llm: LLM) -> None:
    expected = llm.generate(PROMPT, greedy())[0]
    top_k = llm.generate(
        PROMPT, SamplingParams(max_new_tokens=16, do_sample=True, top_k=1, seed=0, ignore_eos=True)
    )[0]

    assert top_k.token_ids == expected.token_ids
    llm.engine.check_no_leaks()


def test_tiny_top_p_samples_the_greedy_tokens(llm: LLM) -> None:
    expected = llm.generate(PROMPT, greedy())[0]
    top_p = llm.generate(
        PROMPT,
        SamplingParams(max_new_tokens=16, do_sample=True, top_p=0.01, seed=0, ignore_eos=True),
    )[0]

    assert top_p.token_ids == expected.token_ids
    llm.engine.check_no_leaks()


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, -5.0, -6.0, -7.0]])
    params_k = SamplingParams(do_sample=True, top_k=2)
    params_p = SamplingParams(do_sample=True, top_p=0.5)

    picked_k = {sample(logits, [row(params_k, seed=s)])[0][0] for s in range(40)}
    picked_p = {sample(logits, [row(params_p, seed=s)])[0][0] for s in range(40)}

    assert picked_k == {0, 1}
    # 0 alone holds about 36% of the mass and 0 + 1 about 69%: top_p=0.5 keeps both.
    assert picked_p == {0, 1}


# temperature


def test_temperature_alone_switches_sampling_on() -> None:
    assert SamplingParams().sampling is False
    assert SamplingParams(temperature=0.7).sampling is True
    assert SamplingParams(temperature=1.0).sampling is False
    assert SamplingParams(top_k=5).sampling is True
    assert SamplingParams(top_p=0.9).sampling is True
    assert SamplingParams(top_p=1.0).sampling is False
    assert SamplingParams(do_sample=True).sampling is True


def test_temperature_alone_samples_in_the_engine(llm: LLM) -> None:
    expected = llm.generate(PROMPT, greedy())[0]
    hot = SamplingParams(max_new_tokens=16, temperature=5.0, seed=0, ignore_eos=True)
    first, second = llm.generate([PROMPT, PROMPT], [hot, hot])

    assert first.token_ids != expected.token_ids
    assert second.token_ids == first.token_ids  # same seed, same tokens
    llm.engine.check_no_leaks()


# repetition penalty


def test_repetition_penalty_divides_a_seen_positive_logit() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])

    tokens, logprobs = sample(logits, [row(SamplingParams(repetition_penalty=2.0), [0])])

    assert tokens == [1]
    penalized = torch.tensor([1.5, 2.5, 0.0, -1.0])
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(penalized, dim=-1)[1]))


def test_repetition_penalty_multiplies_a_seen_negative_logit() -> None:
    logits = torch.tensor([[-1.0, -1.5, -3.0, -4.0]])

    tokens, logprobs = sample(logits, [row(SamplingParams(repetition_penalty=2.0), [0, 0])])

    assert tokens == [1]
    penalized = torch.tensor([-2.0, -1.5, -3.0, -4.0])
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(penalized, dim=-1)[1]))


def test_repetition_penalty_leaves_unseen_tokens_alone() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])

    tokens, logprobs = sample(logits, [row(SamplingParams(repetition_penalty=2.0), [2, 3])])
    neutral, neutral_logprobs = sample(logits, [row(SamplingParams(repetition_penalty=1.0), [0])])

    assert tokens == [0]
    penalized = torch.tensor([3.0, 2.5, 0.0, -2.0])
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(penalized, dim=-1)[0]))
    assert neutral == [0]
    assert neutral_logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], dim=-1)[0]))


def test_strong_repetition_penalty_stops_the_model_repeating_itself(llm: LLM) -> None:
    prompt = "Numbers: 0 1 2"
    plain = llm.generate(prompt, greedy())[0]
    penalized = llm.generate(
        prompt, SamplingParams(max_new_tokens=16, repetition_penalty=100.0, ignore_eos=True)
    )[0]

    assert len(set(plain.token_ids)) < len(plain.token_ids)  # greedy repeats itself here
    assert len(set(penalized.token_ids)) == len(penalized.token_ids)
    assert not set(penalized.token_ids) & set(penalized.prompt_token_ids)
    llm.engine.check_no_leaks()


# length, EOS and stop sequences


def test_max_new_tokens_is_respected_exactly(llm: LLM) -> None:
    lengths = [1, 3, 7]
    outs = llm.generate(
        [PROMPT, "The quick brown fox", PROMPT],
        [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths],
    )

    for out, n in zip(outs, lengths, strict=True):
        assert out.finished
        assert out.finish_reason == "length"
        assert len(out.token_ids) == n
        assert len(out.logprobs) == n
    llm.engine.check_no_leaks()


def test_eos_token_ends_the_request_unless_ignored(llm: LLM) -> None:
    eos_ids = llm.engine.eos_token_ids
    vocab = llm.engine.model.spec.vocab_size
    # Find one-token prompts after which the tiny model emits EOS greedily.
    search = llm.generate([[t] for t in range(vocab)], greedy(max_new_tokens=3))
    hits = [o for o in search if set(o.token_ids) & eos_ids]
    assert hits, "the tiny checkpoint should emit EOS greedily after some one-token prompt"
    hit = hits[0]
    eos_at = next(i for i, t in enumerate(hit.token_ids) if t in eos_ids)

    stopped, ignored = llm.generate(
        [hit.prompt_token_ids, hit.prompt_token_ids],
        [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, ignore_eos=True)],
    )

    assert stopped.finish_reason == "eos_token"
    assert stopped.token_ids == hit.token_ids[: eos_at + 1]
    assert stopped.token_ids[-1] in eos_ids
    assert len(stopped.logprobs) == len(stopped.token_ids)
    assert llm.tokenizer.eos_token not in stopped.text
    assert ignored.finish_reason == "length"
    assert ignored.token_ids == hit.token_ids
    llm.engine.check_no_leaks()


def test_stop_sequence_ends_the_request_early(llm: LLM) -> None:
    prompt = "The capital of France is"
    full = llm.generate(prompt, greedy())[0]
    decode = llm.tokenizer.decode
    # A stop string the greedy output holds well before its end.
    match = re.search(r"[A-Za-z]{2,}", decode(full.token_ids[:12], skip_special_tokens=True))
    assert match, "the greedy output should hold some letters"
    stop = match.group()
    # The engine checks the stop strings after each token: it ends at the first prefix holding one.
    k = next(
        k for k in range(1, 17) if stop in decode(full.token_ids[:k], skip_special_tokens=True)
    )
    expected_text = decode(full.token_ids[:k], skip_special_tokens=True)
    expected_text = expected_text[: expected_text.index(stop)]

    out = llm.generate(
        prompt, SamplingParams(max_new_tokens=16, stop=["never seen here", stop], ignore_eos=True)
    )[0]

    assert out.finished
    assert out.finish_reason == "stop_sequence"
    assert out.stop_sequence == stop
    assert out.token_ids == full.token_ids[:k]
    assert len(out.token_ids) < 16
    assert stop not in out.text
    assert out.text == expected_text
    llm.engine.check_no_leaks()


def test_stop_sequence_never_seen_runs_to_length(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_new_tokens=8))[0]
    out = llm.generate(
        PROMPT, SamplingParams(max_new_tokens=8, stop=["\u2603 no such text"], ignore_eos=True)
    )[0]

    assert out.finish_reason == "length"
    assert out.stop_sequence is None
    assert out.token_ids == full.token_ids
    assert out.text == full.text
    llm.engine.check_no_leaks()


# invalid parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"temperature": -0.5}, "`temperature` must be strictly positive"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"top_k": -3}, "`top_k` must be strictly positive"),
        ({"top_p": 0.0}, "`top_p` must be > 0.0 and <= 1.0"),
        ({"top_p": 1.5}, "`top_p` must be > 0.0 and <= 1.0"),
        ({"top_p": -0.1}, "`top_p` must be > 0.0 and <= 1.0"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
        ({"repetition_penalty": -1.0}, "`repetition_penalty` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"max_new_tokens": -4}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["ok", ""]}, "`stop` sequences must not be empty"),
        ({"seed": -1}, "`seed` must be a non-negative 64-bit integer"),
        ({"seed": 2**70}, "`seed` must be a non-negative 64-bit integer"),
        ({"temperature": float("nan")}, "`temperature` must be a finite number"),
        ({"repetition_penalty": float("inf")}, "`repetition_penalty` must be a finite number"),
    ],
)
def test_invalid_params_are_refused_with_tgi_messages(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidParams, match=re.escape(message)) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]

    assert isinstance(info.value, ValueError)


def test_boundary_params_are_accepted() -> None:
    params = SamplingParams(
        max_new_tokens=1, temperature=1e-3, top_k=1, top_p=1.0, repetition_penalty=1e-3, seed=0
    )

    assert params.sampling is True


# log-probabilities


def test_logprobs_come_with_every_generated_token(llm: LLM) -> None:
    vocab = llm.engine.model.spec.vocab_size
    greedy_out, sampled_out = llm.generate(
        [PROMPT, PROMPT],
        [greedy(), SamplingParams(max_new_tokens=16, temperature=1.5, seed=11, ignore_eos=True)],
    )

    for out in (greedy_out, sampled_out):
        assert len(out.logprobs) == len(out.token_ids) == 16
        assert all(lp <= 0.0 for lp in out.logprobs)
        assert all(math.isfinite(lp) for lp in out.logprobs)
    # The greedy token is the most likely one, so its probability is at least 1 / vocab.
    assert all(lp >= -math.log(vocab) - 1e-5 for lp in greedy_out.logprobs)
    llm.engine.check_no_leaks()


def test_greedy_logprobs_are_the_log_softmax_maximum() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 3.5, 0.0, -2.0], [0.0, 0.0, 0.0, 9.0]])

    tokens, logprobs = sample(logits, [row(SamplingParams()) for _ in range(3)])

    reference = torch.log_softmax(logits, dim=-1)
    assert tokens == [1, 1, 3]
    assert logprobs == pytest.approx(reference.max(dim=-1).values.tolist())
    assert all(lp <= 0.0 for lp in logprobs)


def test_greedy_logprobs_match_in_a_batch_mixed_with_sampling() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 3.5, 0.0, -2.0]])

    tokens, logprobs = sample(
        logits,
        [row(SamplingParams()), row(SamplingParams(do_sample=True), seed=0)],
    )

    reference = torch.log_softmax(logits, dim=-1)
    assert tokens[0] == 1
    assert logprobs[0] == pytest.approx(float(reference[0].max()))
    assert logprobs[1] == pytest.approx(float(reference[1, tokens[1]]))
    assert all(lp <= 0.0 for lp in logprobs)


def test_sampled_logprobs_are_under_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])

    _, top_k_one = sample(logits, [row(SamplingParams(do_sample=True, top_k=1), seed=0)])
    token, hot = sample(logits, [row(SamplingParams(temperature=2.0), seed=0)])

    assert top_k_one[0] == pytest.approx(0.0)
    expected = torch.log_softmax(logits[0] / 2.0, dim=-1)[token[0]]
    assert hot[0] == pytest.approx(float(expected))


def test_greedy_takes_the_first_of_equal_largest_logits_with_its_logprob() -> None:
    logits = torch.full((3, 70_000), -1.0)
    logits[0, [3, 60_000]] = 2.0
    logits[1, 69_999] = 3.0
    logits[2, [0, 69_999]] = 5.0
    rows = [SamplerInput(greedy(), None, []) for _ in range(3)]
    tokens, logprobs = sample(logits, rows)
    assert tokens == [3, 69_999, 0]
    want = torch.log_softmax(logits, dim=-1)[[0, 1, 2], [3, 69_999, 0]]
    assert logprobs == pytest.approx(want.tolist())
