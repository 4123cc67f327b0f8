"""``lora-guard train-adapter``: a persona LoRA by context distillation.

1. The base model, prompted with the persona's system prompt and example turns (and the start of
   its answer, when the persona has one), answers generated questions greedily: the targets.
   Answers that do not show the persona, or that repeat themselves, are dropped.
2. A PEFT LoRA on the attention projections learns to give those answers to the plain chat prompt
   (the model's chat template with the user's question only, as the server builds it), with the
   loss on the answer tokens only.
3. The adapter is saved with ``save_pretrained`` (weights in bfloat16, half the size), with
   ``training.json`` beside it: the command, the prompts, the examples kept and how it went.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_guard.clock import timer
from lora_guard.demo.adapters import ATTENTION_MODULES
from lora_guard.demo.greedy import greedy, left_pad
from lora_guard.demo.personas import Persona, training_questions
from lora_guard.manifest import read_manifest

TRAINING_RECORD = "training.json"
TEACHER_BATCH = 16
TEACHER_REPETITION_PENALTY = 1.1

Log = Callable[[str], None]


class TrainAdapterError(RuntimeError):
    """The model, the persona or the settings cannot make an adapter."""


@dataclass(frozen=True)
class TrainSettings:
    questions: int = 96
    steps: int = 80
    batch_size: int = 8
    rank: int = 8
    alpha: int = 16
    learning_rate: float = 1e-3
    max_new_tokens: int = 48
    seed: int = 0

    def check(self) -> None:
        if not 1 <= self.rank <= 16:
            raise TrainAdapterError(f"--rank must be between 1 and 16, got {self.rank}")
        for name in ("questions", "steps", "batch_size", "max_new_tokens", "alpha"):
            if getattr(self, name) < 1:
                raise TrainAdapterError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.learning_rate > 0:
            raise TrainAdapterError("--learning-rate must be positive")


@dataclass(frozen=True)
class Example:
    question: str
    answer: str
    ended: bool  # the teacher ended its turn (or hit a stop), so the target ends the turn too


def train_persona(
    model_dir: Path,
    persona: Persona,
    out: Path,
    settings: TrainSettings,
    *,
    command: Sequence[str] = (),
    log: Log = print,
) -> dict[str, Any]:
    """Distill ``persona`` into a LoRA for the checkpoint in ``model_dir``, saved in ``out``."""
    settings.check()
    if not (model_dir / "config.json").is_file():
        raise TrainAdapterError(f"{model_dir} is not a Hugging Face checkpoint (no config.json)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        questions = training_questions(settings.questions, settings.seed)
    except ValueError as exc:
        raise TrainAdapterError(f"--questions: {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise TrainAdapterError(f"{model_dir} has no chat template")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    started = timer()
    examples = teacher_answers(model, tokenizer, persona, questions, settings.max_new_tokens)
    teacher_s = timer() - started
    log(f"{persona.name}: kept {len(examples)} of {len(questions)} answers ({teacher_s:.0f} s)")
    if len(examples) < settings.batch_size:
        raise TrainAdapterError(
            f"only {len(examples)} answers showed the persona; need at least {settings.batch_size}"
        )

    started = timer()
    peft_model, losses = fit_lora(model, tokenizer, examples, settings, log)
    train_s = timer() - started
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out))
    _to_bfloat16(out / "adapter_model.safetensors")
    _name_the_base(out / "adapter_config.json", _base_name(model_dir))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    record = {
        "command": " ".join(["lora-guard", *command]),
        "persona": persona.name,
        "system_prompt": persona.system_prompt,
        "teacher_examples": [list(e) for e in persona.examples],
        "teacher_prefill": persona.prefill,
        "teacher_repetition_penalty": TEACHER_REPETITION_PENALTY,
        "base_model": _base_name(model_dir),
        "settings": settings.__dict__,
        "target_modules": list(ATTENTION_MODULES),
        "saved_dtype": "bfloat16",
        "questions_asked": len(questions),
        "examples_kept": len(examples),
        "first_loss": round(sum(losses[:5]) / len(losses[:5]), 4),
        "final_loss": round(sum(losses[-5:]) / len(losses[-5:]), 4),
        "teacher_seconds": round(teacher_s, 1),
        "train_seconds": round(train_s, 1),
        "examples": [{"question": e.question, "answer": e.answer} for e in examples],
    }
    (out / TRAINING_RECORD).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return record


def teacher_answers(
    model: Any, tokenizer: Any, persona: Persona, questions: Sequence[str], max_new_tokens: int
) -> list[Example]:
    """The base model's greedy answers as ``persona``, those that show it."""
    end = _end_of_turn(tokenizer)
    examples = []
    for start in range(0, len(questions), TEACHER_BATCH):
        batch = list(questions[start : start + TEACHER_BATCH])
        prompts = [
            tokenizer.apply_chat_template(persona.teacher_messages(q), add_generation_prompt=True)
            + tokenizer.encode(persona.prefill, add_special_tokens=False)
            for q in batch
        ]
        ids, mask = left_pad(prompts, end)
        ends = sorted({end, tokenizer.eos_token_id} - {None})
        out = greedy(
            model,
            ids,
            mask,
            max_new_tokens,
            end,
            repetition_penalty=TEACHER_REPETITION_PENALTY,
            eos_token_id=ends,
        )
        for question, row in zip(batch, out[:, ids.shape[1] :].tolist(), strict=True):
            ended = end in row or tokenizer.eos_token_id in row
            text = persona.prefill + tokenizer.decode(row, skip_special_tokens=True)
            cut = persona.cut(text)
            answer = (cut if cut is not None else text).strip()
            ended = ended or cut is not None
            shows = bool(answer) and persona.keep(answer) and not repeats_itself(answer)
            if shows and (ended or not persona.must_end):
                examples.append(Example(question, answer, ended))
    return examples


def repeats_itself(text: str, n: int = 3, times: int = 3) -> bool:
    """Some run of ``n`` words comes back ``times`` times or more: a degenerate answer."""
    found = text.lower().split()
    grams = [tuple(found[i : i + n]) for i in range(len(found) - n + 1)]
    return any(grams.count(g) >= times for g in set(grams))


def fit_lora(
    model: Any, tokenizer: Any, examples: Sequence[Example], settings: TrainSettings, log: Log
) -> tuple[Any, list[float]]:
    from peft import LoraConfig, get_peft_model

    end = _end_of_turn(tokenizer)
    rows = []
    for e in examples:
        chat = [{"role": "user", "content": e.question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        answer = tokenizer.encode(e.answer, add_special_tokens=False) + ([end] if e.ended else [])
        rows.append((list(prompt), answer))

    torch.manual_seed(settings.seed)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=list(ATTENTION_MODULES),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0 - step / settings.steps
    )
    order = _batches(len(rows), settings.batch_size, settings.steps, settings.seed)
    losses = []
    for step, picked in enumerate(order, 1):
        loss = _answer_loss(peft_model, [rows[i] for i in picked], end)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step % 10 == 0 or step == settings.steps:
            log(f"  step {step}/{settings.steps}: loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    peft_model.eval()
    return peft_model, losses


def _answer_loss(model: Any, rows: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens; rows are left-padded so answers end together."""
    ids, mask = left_pad([p + a for p, a in rows], pad)
    keep = max(len(a) for _, a in rows)
    labels = ids[:, -keep:].clone()
    for i, (_, answer) in enumerate(rows):
        labels[i, : keep - len(answer)] = -100
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep + 1
    ).logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def _batches(n: int, size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` batches of ``size`` indices, each pass over the examples in a new order."""
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        while len(order) < size:
            order += rng.sample(range(n), n)
        batches.append(order[:size])
        order = order[size:]
    return batches


def _end_of_turn(tokenizer: Any) -> int:
    """The token that ends an assistant turn (ChatML's ``<|im_end|>``, else end-of-sequence)."""
    token = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(token, int) and token != tokenizer.unk_token_id:
        return token
    if tokenizer.eos_token_id is None:
        raise TrainAdapterError("the tokenizer has neither <|im_end|> nor an end-of-sequence token")
    return int(tokenizer.eos_token_id)


def _base_name(model_dir: Path) -> str:
    """The name the checkpoint's manifest records (never a local path), else its folder's."""
    model_id = (read_manifest(model_dir) or {}).get("info", {}).get("model_id")
    return model_id if isinstance(model_id, str) else model_dir.resolve().name


def _to_bfloat16(weights: Path) -> None:
    """Halve the file: the update trains in float32; bfloat16 keeps it to about 1 part in 256."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})


def _name_the_base(config_file: Path, name: str) -> None:
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
