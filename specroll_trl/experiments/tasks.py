"""Task datasets: bundled GSM8K and a procedurally generated GSM8K-style arithmetic task.

Every dataset has the columns ``prompt`` (standard string or a one-message conversation),
``answer`` (the final number as a string, e.g. ``"72"``) and ``solution`` (GSM8K-style worked
solution with ``<<expr=value>>`` annotations, ending with ``#### <answer>``).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets

__all__ = [
    "ANSWER_INSTRUCTION",
    "GSM8K_DIR",
    "GSM8K_SPLITS",
    "PROMPT_TEMPLATE",
    "arithmetic_examples",
    "chat_prompt",
    "chat_task_dataset",
    "extract_final_answer",
    "format_prompt",
    "gsm8k_examples",
    "load_gsm8k",
    "make_arithmetic_task",
]

GSM8K_DIR = Path(__file__).parent / "data" / "gsm8k"
GSM8K_SPLITS = ("train", "test")

# No trailing whitespace: a completion is expected to start with " " (SFT: " " + solution).
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

_FINAL_ANSWER_RE = re.compile(r"^\s*\$?\s*([-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+))")


def format_prompt(question: str, conversational: bool = False) -> str | list[dict[str, str]]:
    """Prompt for one question: ``PROMPT_TEMPLATE`` text, or a single user message."""
    if conversational:
        return [{"role": "user", "content": question}]
    return PROMPT_TEMPLATE.format(question=question)


def extract_final_answer(text: str) -> str | None:
    """Number after the last ``####`` with commas, ``$`` and a trailing ``.`` removed; None if absent."""
    if not isinstance(text, str) or "####" not in text:
        return None
    match = _FINAL_ANSWER_RE.match(text.rsplit("####", 1)[1])
    if match is None:
        return None
    return match.group(1).replace(",", "").lstrip("+")


def _to_dataset(examples: list[dict], conversational: bool) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "prompt": [format_prompt(ex["question"], conversational) for ex in examples],
            "answer": [ex["answer"] for ex in examples],
            "solution": [ex["solution"] for ex in examples],
        }
    )


def gsm8k_examples(split: str = "train", limit: int | None = None) -> list[dict[str, str]]:
    """Bundled GSM8K rows as dicts with ``question``, ``solution`` and ``answer``."""
    if split not in GSM8K_SPLITS:
        raise ValueError(f"Unknown GSM8K split {split!r}; expected one of {GSM8K_SPLITS}.")
    examples = []
    with open(GSM8K_DIR / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            answer = extract_final_answer(row["answer"])
            if answer is None:
                raise ValueError(f"GSM8K {split} row {len(examples)} has no '####' final answer.")
            examples.append({"question": row["question"], "solution": row["answer"], "answer": answer})
    return examples


def load_gsm8k(
    split: str = "train", conversational: bool = False, limit: int | None = None
) -> datasets.Dataset:
    """Bundled GSM8K (MIT licence) as a ``datasets.Dataset``; ``limit`` keeps the first rows."""
    return _to_dataset(gsm8k_examples(split, limit), conversational)


# Procedural multi-step arithmetic word problems.

MAX_VALUE = 200
# Share of "hard" problems (operands up to 60, values up to 999): mixing difficulty keeps a small policy's
# accuracy and per-token entropy in a realistic range instead of all-or-nothing.
HARD_SHARE = 0.35
HARD_MAX_OPERAND, HARD_MAX_VALUE = 60, 999
_OPENERS = [
    "", "", "", "Let's solve it step by step.", "We work it out one step at a time.",
    "First, let's see what we know.", "Let's think about it.", "We can solve this in steps.",
]
_CLOSERS = ["", "", "The answer is {a}.", "So the final answer is {a}.", "That means the answer is {a}."]


class _ProblemRng(random.Random):
    """``random.Random`` that also knows the current problem's operand and value limits."""

    max_operand = 20
    max_value = MAX_VALUE

    def operand(self) -> int:
        return self.randint(2, self.max_operand)

_PEOPLE = [  # (name, subject, possessive), alternating he / she
    (name, *(("he", "his") if i % 2 == 0 else ("she", "her")))
    for i, name in enumerate(["Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Jack", "Emma", "Leo", "Zoe", "Max", "Ella"])
]
_ITEMS = ["apples", "pencils", "marbles", "stickers", "cards", "shells", "books", "stamps", "toys", "coins"]
_CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("jar", "jars")]
_GOODS = [("notebook", "notebooks"), ("pen", "pens"), ("cup", "cups"), ("ball", "balls"), ("hat", "hats")]
_EXTRAS = ["a bag", "a book", "a toy", "a lamp", "a game"]
_FOODS = ["cookies", "muffins", "cupcakes", "rolls"]
_RELATIVES = ["brother", "sister", "cousin", "friend"]


def _cap(word: str) -> str:
    return word[:1].upper() + word[1:]


def _op(rng: _ProblemRng, a: int, op: str, b: int) -> tuple[str, int | None]:
    """``a op b=<<a op b=v>>v`` and its value v, or None when v is negative, too large or inexact."""
    if op == "+":
        value = a + b
    elif op == "-":
        value = a - b
    elif op == "*":
        value = a * b
    elif b != 0 and a % b == 0:
        value = a // b
    else:
        return "", None
    if not 0 <= value <= rng.max_value:
        return "", None
    expr = f"{a}{op}{b}"
    return f"{expr}=<<{expr}={value}>>{value}", value


def _extra_step(rng: _ProblemRng, value: int, op: str, question: list, lines: list, ask, say) -> int | None:
    """One more step ``value op operand`` (a fresh operand): ``ask(operand)`` joins the question and one of
    ``say(step)`` the solution. Returns the new value, or None (nothing appended) when it is out of range."""
    operand = rng.operand()
    step, value = _op(rng, value, op, operand)
    if value is None:
        return None
    question.append(ask(operand))
    lines.append(rng.choice(say(step)))
    return value


def _inventory(rng):
    (name, he, _), (friend, _, _) = rng.sample(_PEOPLE, 2)
    item = rng.choice(_ITEMS)
    count = rng.operand()
    question = [rng.choice([f"{name} has {count} {item}.", f"{name} starts with {count} {item}."])]
    lines = []
    for _ in range(rng.randint(2, 3)):
        action = rng.choice(["buy", "give", "find", "lose"])
        n = rng.operand()
        op = "+" if action in ("buy", "find") else "-"
        step, new = _op(rng, count, op, n)
        if new is None:
            return None
        if action == "buy":
            question.append(f"{_cap(he)} buys {n} more {item}.")
            lines.append(
                rng.choice(
                    [
                        f"{_cap(he)} buys {n} more, so {he} has {step} {item}.",
                        f"After buying {n} more, {name} has {step} {item}.",
                    ]
                )
            )
        elif action == "find":
            question.append(f"Then {he} finds {n} more.")
            lines.append(
                rng.choice(
                    [
                        f"{_cap(he)} finds {n} more, so {he} has {step} {item}.",
                        f"After finding {n} more, {name} has {step} {item}.",
                    ]
                )
            )
        elif action == "give":
            question.append(f"{_cap(he)} gives {n} {item} to {friend}.")
            lines.append(
                rng.choice(
                    [
                        f"{_cap(he)} gives {n} to {friend}, so {he} has {step} {item} left.",
                        f"After giving {n} away, {name} has {step} {item}.",
                    ]
                )
            )
        else:
            question.append(f"{_cap(he)} loses {n} of them.")
            lines.append(
                rng.choice(
                    [
                        f"{_cap(he)} loses {n}, so {he} has {step} {item} left.",
                        f"After losing {n}, {name} has {step} {item}.",
                    ]
                )
            )
        count = new
    question.append(f"How many {item} does {name} have now?")
    return question, lines, count


def _groups(rng):
    name, he, _ = rng.choice(_PEOPLE)
    item = rng.choice(_ITEMS)
    box, boxes = rng.choice(_CONTAINERS)
    a, b, c = rng.randint(2, 10), rng.operand(), rng.operand()
    step1, total = _op(rng, a, "*", b)
    if total is None:
        return None
    question = [f"{name} has {a} {boxes} of {item}.", f"Each {box} holds {b} {item}."]
    lines = [
        rng.choice([f"There are {step1} {item} in the {boxes}.", f"{_cap(he)} has {step1} {item} in total."])
    ]
    if rng.random() < 0.5:
        step2, value = _op(rng, total, "-", c)
        question.append(f"{_cap(he)} gives away {c} {item}.")
        lines.append(
            rng.choice(
                [
                    f"After giving away {c}, {he} has {step2} {item}.",
                    f"{_cap(he)} gives away {c}, so {he} has {step2} {item} left.",
                ]
            )
        )
    else:
        step2, value = _op(rng, total, "+", c)
        question.append(f"{_cap(he)} gets {c} more {item} from a friend.")
        lines.append(
            rng.choice(
                [
                    f"With {c} more, {he} has {step2} {item}.",
                    f"{_cap(he)} gets {c} more, so {he} has {step2} {item}.",
                ]
            )
        )
    if value is None:
        return None
    if rng.random() < 0.4:
        divisors = [k for k in range(2, 11) if value % k == 0]
        if value == 0 or not divisors:
            return None
        d = rng.choice(divisors)
        step3, share = _op(rng, value, "/", d)
        question.append(f"{_cap(he)} puts them equally into {d} piles.")
        lines.append(
            rng.choice([f"Each pile has {step3} {item}.", f"There are {step3} {item} in each pile."])
        )
        value = share
        question.append(f"How many {item} are in each pile?")
    else:
        question.append(f"How many {item} does {he} have now?")
    return question, lines, value


def _sharing(rng):
    (name, he, _), (friend, _, _) = rng.sample(_PEOPLE, 2)
    item = rng.choice(_ITEMS)
    k, q = rng.randint(2, 10), rng.operand()
    total = k * q
    if rng.random() < 0.5:
        a = rng.operand()
        b = total - a
        if not 2 <= b <= 20:
            return None
        step1, _ = _op(rng, a, "+", b)
        question = [f"{name} has {a} {item} and gets {b} more from {friend}."]
        lines = [
            rng.choice([f"{_cap(he)} has {step1} {item} in total.", f"Together {he} has {step1} {item}."])
        ]
    else:
        packs = [p for p in range(2, 11) if total % p == 0 and 2 <= total // p <= 20]
        if not packs:
            return None
        a = rng.choice(packs)
        b = total // a
        step1, _ = _op(rng, a, "*", b)
        question = [f"{name} buys {a} packs of {item} with {b} {item} in each pack."]
        lines = [rng.choice([f"{_cap(he)} buys {step1} {item}.", f"{_cap(he)} has {step1} {item} in total."])]
    step2, share = _op(rng, total, "/", k)
    question.append(f"{_cap(he)} shares them equally among {k} friends.")
    lines.append(rng.choice([f"Each friend gets {step2} {item}.", f"So each friend gets {step2} {item}."]))
    if rng.random() < 0.35:
        c = rng.randint(1, share - 1)
        step3, share = _op(rng, share, "-", c)
        question.append(f"Each friend then uses {c} of them.")
        lines.append(
            rng.choice(
                [
                    f"Each friend has {step3} {item} left.",
                    f"After using {c}, each friend has {step3} {item} left.",
                ]
            )
        )
        question.append(f"How many {item} does each friend have left?")
    else:
        question.append(f"How many {item} does each friend get?")
    return question, lines, share


def _prices(rng):
    name, he, _ = rng.choice(_PEOPLE)
    _, goods = rng.choice(_GOODS)
    extra = rng.choice(_EXTRAS)
    a, b, c = rng.randint(2, 10), rng.operand(), rng.operand()
    step1, cost = _op(rng, a, "*", b)
    step2, total = _op(rng, cost, "+", c) if cost is not None else ("", None)
    if total is None:
        return None
    question = [f"{name} buys {a} {goods} for ${b} each and {extra} for ${c}."]
    lines = [
        rng.choice([f"The {goods} cost {step1} dollars.", f"{_cap(he)} spends {step1} dollars on {goods}."]),
        rng.choice(
            [f"In total {he} spends {step2} dollars.", f"Adding {extra[2:]}, {he} spends {step2} dollars."]
        ),
    ]
    bills = [x for x in (20, 50, 100, 200) if x >= total]
    if rng.random() < 0.5 and bills:
        paid = rng.choice(bills)
        step3, change = _op(rng, paid, "-", total)
        question.append(f"{_cap(he)} pays with ${paid}. How much change does {he} get?")
        lines.append(
            rng.choice([f"{_cap(he)} gets {step3} dollars in change.", f"The change is {step3} dollars."])
        )
        return question, lines, change
    question.append(f"How many dollars does {he} spend?")
    return question, lines, total


def _ages(rng):
    name, _, his = rng.choice(_PEOPLE)
    relative = rng.choice(_RELATIVES)
    age, diff, times = rng.randint(4, 16), rng.randint(2, 9), rng.randint(2, 4)
    if rng.random() < 0.5:
        step1, rel_age = _op(rng, age, "+", diff)
        question = [f"{name} is {age} years old.", f"{_cap(his)} {relative} is {diff} years older."]
    else:
        step1, rel_age = _op(rng, age, "-", diff)
        question = [f"{name} is {age} years old.", f"{_cap(his)} {relative} is {diff} years younger."]
    if rel_age is None or rel_age < 2:
        return None
    step2, uncle = _op(rng, rel_age, "*", times)
    if uncle is None or uncle > 90:
        return None
    question.append(f"Their uncle is {times} times as old as the {relative}.")
    lines = [
        rng.choice(
            [f"The {relative} is {step1} years old.", f"{_cap(his)} {relative} is {step1} years old."]
        ),
        rng.choice([f"The uncle is {step2} years old.", f"So the uncle is {step2} years old."]),
    ]
    if rng.random() < 0.4:
        later = rng.randint(2, 10)
        step3, uncle = _op(rng, uncle, "+", later)
        question.append(f"How old will the uncle be in {later} years?")
        lines.append(
            rng.choice(
                [f"In {later} years he will be {step3} years old.", f"The uncle will be {step3} years old."]
            )
        )
    else:
        question.append("How old is the uncle?")
    return question, lines, uncle


def _savings(rng):
    name, he, his = rng.choice(_PEOPLE)
    a, b, c = rng.operand(), rng.randint(2, 10), rng.operand()
    step1, saved = _op(rng, a, "*", b)
    if saved is None:
        return None
    step2, left = _op(rng, saved, "-", c)
    if left is None:
        return None
    thing = rng.choice(_EXTRAS)
    question = [f"{name} saves ${a} every week for {b} weeks.", f"Then {he} spends ${c} on {thing}."]
    lines = [
        rng.choice([f"{_cap(he)} saves {step1} dollars.", f"In {b} weeks {he} saves {step1} dollars."]),
        rng.choice(
            [f"{_cap(he)} has {step2} dollars left.", f"After buying {thing[2:]}, {he} has {step2} dollars."]
        ),
    ]
    if rng.random() < 0.4:
        left = _extra_step(rng, left, "+", question, lines, lambda d: f"{_cap(his)} grandma gives {name} ${d}.",
                           lambda s: [f"Now {he} has {s} dollars.", f"With the gift, {he} has {s} dollars."])
        if left is None:
            return None
    question.append(f"How many dollars does {name} have now?")
    return question, lines, left


def _together(rng):
    (name, _, _), (friend, _, _), (third, _, _) = rng.sample(_PEOPLE, 3)
    item = rng.choice(_ITEMS)
    a, b = rng.operand(), rng.randint(2, 5)
    if rng.random() < 0.5:
        step1, other = _op(rng, a, "*", b)
        relation = f"{b} times as many {item} as {name}"
    else:
        b = rng.operand()
        step1, other = _op(rng, a, "+", b)
        relation = f"{b} more {item} than {name}"
    if other is None:
        return None
    question = [f"{name} has {a} {item}.", f"{friend} has {relation}."]
    lines = [rng.choice([f"{friend} has {step1} {item}.", f"So {friend} has {step1} {item}."])]
    if rng.random() < 0.4:
        value = _extra_step(rng, other, "-", question, lines,
                            lambda c: f"{third} has {c} fewer {item} than {friend}. How many {item} does {third} have?",
                            lambda s: [f"{third} has {s} {item}.", f"So {third} has {s} {item}."])
        if value is None:
            return None
    else:
        step2, value = _op(rng, a, "+", other)
        if value is None:
            return None
        question.append(f"How many {item} do {name} and {friend} have together?")
        lines.append(
            rng.choice([f"Together they have {step2} {item}.", f"They have {step2} {item} in total."])
        )
    return question, lines, value


def _baking(rng):
    name, he, _ = rng.choice(_PEOPLE)
    food = rng.choice(_FOODS)
    trays, per, eaten, bag = rng.randint(2, 10), rng.operand(), rng.operand(), rng.randint(2, 10)
    step1, baked = _op(rng, trays, "*", per)
    if baked is None:
        return None
    step2, rest = _op(rng, baked, "-", eaten)
    if rest is None or rest == 0 or rest % bag:
        return None
    step3, bags = _op(rng, rest, "/", bag)
    question = [
        f"{name} bakes {trays} trays of {food} with {per} {food} on each tray.",
        f"{_cap(he)} gives {eaten} {food} to neighbours and puts the rest into bags of {bag}.",
        f"How many bags does {he} fill?",
    ]
    lines = [
        rng.choice([f"{_cap(he)} bakes {step1} {food}.", f"There are {step1} {food} in total."]),
        rng.choice(
            [f"{_cap(he)} has {step2} {food} left.", f"After giving {eaten} away, {step2} {food} are left."]
        ),
        rng.choice([f"{_cap(he)} fills {step3} bags.", f"So {he} fills {step3} bags."]),
    ]
    return question, lines, bags


_TEMPLATES = [_inventory, _groups, _sharing, _prices, _ages, _savings, _together, _baking]


def arithmetic_examples(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` GSM8K-style word problems with 2-3 steps, each ``{"question", "solution", "answer"}``.

    Deterministic for a given seed. Easy problems draw operands in 2..20 with every value in 0..200;
    a ``HARD_SHARE`` of them go up to 60 and 999. Division is always exact. Solutions may open and close
    with a short free-text sentence.
    """
    rng = _ProblemRng(seed)
    examples = []
    while len(examples) < n:
        hard = rng.random() < HARD_SHARE
        rng.max_operand, rng.max_value = (HARD_MAX_OPERAND, HARD_MAX_VALUE) if hard else (20, MAX_VALUE)
        template = rng.choice(_TEMPLATES)
        made = template(rng)
        if made is None:
            continue
        question, lines, answer = made
        opener, closer = rng.choice(_OPENERS), rng.choice(_CLOSERS).format(a=answer)
        body = [line for line in (opener, *lines, closer) if line]
        solution = "\n".join([*body, f"#### {answer}"])
        examples.append({"question": " ".join(question), "solution": solution, "answer": str(answer)})
    return examples


def make_arithmetic_task(n: int, seed: int = 0, conversational: bool = False) -> datasets.Dataset:
    """Procedural arithmetic task as a dataset with columns ``prompt``, ``answer``, ``solution``."""
    return _to_dataset(arithmetic_examples(n, seed), conversational)


def task_dataset(task: str, n: int, seed: int = 321) -> datasets.Dataset:
    """``n`` GRPO prompts of ``task``: ``arithmetic`` (procedural, seeded) or ``gsm8k`` (the first ``n`` train rows)."""
    if task == "arithmetic":
        return make_arithmetic_task(n, seed=seed)
    if task == "gsm8k":
        return load_gsm8k("train", limit=n)
    raise ValueError(f"unknown task {task!r}: expected 'arithmetic' or 'gsm8k'")


# Chat-form (conversational) tasks, for pretrained instruct policies such as the zoo's ``smollm2-135m``.

# Appended to each question: asks for the GSM8K final line that ``format_reward`` scores 1.0.
ANSWER_INSTRUCTION = 'Solve it step by step. End your answer with a line "#### <number>".'


def chat_prompt(question: str, instruction: str | None = ANSWER_INSTRUCTION) -> list[dict[str, str]]:
    """One user message: the question, then ``instruction`` on a new line (none when falsy)."""
    content = f"{question}\n{instruction}" if instruction else question
    return [{"role": "user", "content": content}]


def chat_task_dataset(
    task: str, n: int | None = None, seed: int = 321, split: str = "train",
    instruction: str | None = ANSWER_INSTRUCTION,
) -> datasets.Dataset:
    """A task as a TRL conversational dataset: ``prompt`` (``[{"role": "user", "content": ...}]``), ``answer``,
    ``solution``.

    ``arithmetic``: ``n`` procedural problems from ``seed`` (``split="test"``: from ``seed + 10_000``, held out
    from the train seed as in ``zoo.task_examples``). ``gsm8k``: the first ``n`` rows (all with ``None``) of
    the bundled ``split``. ``instruction`` is appended to every question (``None`` for the bare question).
    """
    if split not in GSM8K_SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {GSM8K_SPLITS}")
    if task == "arithmetic":
        if n is None:
            raise ValueError("the arithmetic task is procedural: pass n")
        examples = arithmetic_examples(n, seed=seed if split == "train" else seed + 10_000)
    elif task == "gsm8k":
        examples = gsm8k_examples(split, limit=n)
    else:
        raise ValueError(f"unknown task {task!r}: expected 'arithmetic' or 'gsm8k'")
    return datasets.Dataset.from_dict(
        {
            "prompt": [chat_prompt(ex["question"], instruction) for ex in examples],
            "answer": [ex["answer"] for ex in examples],
            "solution": [ex["solution"] for ex in examples],
        }
    )
