"""Rule-based reward functions for GSM8K-style answers, in TRL's reward-function signature.

TRL's ``GRPOTrainer`` calls each function as ``f(prompts=..., completions=..., completion_ids=...,
**dataset_columns)`` and expects one float per completion. Completions are plain strings (standard
datasets) or lists of ``{"role": "assistant", "content": ...}`` messages (conversational datasets);
both are accepted.

Final answers are read in the forms GSM8K and chat models write them (see ``extract_answer``): ``#### n``,
``The answer is: n`` / ``The answer is n`` and ``\boxed{n}``.

Annotations ``<<expr=value>>`` are checked with a small recursive-descent parser over numbers,
``+ - * /``, unary signs and parentheses. Nothing is ever passed to ``eval``/``exec``.
"""

from __future__ import annotations

import re
from fractions import Fraction

from .tasks import extract_final_answer

__all__ = [
    "REWARD_FUNCS",
    "ExpressionError",
    "calculator_reward",
    "completion_text",
    "correctness_reward",
    "extract_answer",
    "format_reward",
    "safe_eval",
]

MAX_EXPR_CHARS = 200
MAX_NUMBER_DIGITS = 15

_ANNOTATION_RE = re.compile(r"<<([^<>]*)>>")
_FINAL_LINE_RE = re.compile(r"####[ \t]*\$?[ \t]*[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)\.?")
_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
# Answer forms other than "####" (the last match wins). An "answer is" number must not start an expression
# ("The answer is 5 + 3 = 8" is no answer); \boxed{} must hold the number alone.
_ANSWER_RE = re.compile(
    rf"answer\s+is\s*[:=]?\s*(?:\*\*|\\\(|\\\[|\$)*\s*(?P<said>{_NUMBER})(?![\d,.]*[ \t]*(?:[-+/×=^]|\*(?!\*)))"
    rf"|\\boxed\{{\s*(?:\\\$|\$)?\s*(?P<boxed>{_NUMBER})\s*\}}",
    re.IGNORECASE,
)
_TOKEN_RE = re.compile(r"\s*(?:(\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+\.?\d*|\.\d+)|([-+*/()]))")


class ExpressionError(ValueError):
    """An annotation expression that is malformed, unsupported or too large."""


def completion_text(completion) -> str:
    """Text of a completion given as a string or as a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = []
    for message in completion or []:
        content = message.get("content", "") if isinstance(message, dict) else message
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(content if isinstance(content, str) else "")
    return "\n".join(parts)


def _tokenize(expr: str) -> list[tuple[str, object]]:
    if len(expr) > MAX_EXPR_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPR_CHARS} characters")
    if "**" in expr:
        raise ExpressionError("exponentiation is not supported")
    tokens: list[tuple[str, object]] = []
    pos = 0
    expr = expr.rstrip()
    while pos < len(expr):
        match = _TOKEN_RE.match(expr, pos)
        if match is None:
            raise ExpressionError(f"unexpected character {expr[pos:].lstrip()[:1]!r}")
        number, op = match.groups()
        if number is not None:
            digits = number.replace(",", "").replace(".", "")
            if len(digits) > MAX_NUMBER_DIGITS:
                raise ExpressionError(f"number with more than {MAX_NUMBER_DIGITS} digits")
            tokens.append(("num", Fraction(number.replace(",", "").rstrip(".") or "0")))
        else:
            tokens.append(("op", op))
        pos = match.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*;  term := unary (('*'|'/') unary)*;
    unary := ('+'|'-') unary | atom;  atom := NUMBER | '(' expr ')'."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.pos = 0

    def _peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

    def _take_op(self, *ops):
        kind, value = self._peek()
        if kind == "op" and value in ops:
            self.pos += 1
            return value
        return None

    def parse(self) -> Fraction:
        if not self.tokens:
            raise ExpressionError("empty expression")
        value = self._expr()
        if self.pos != len(self.tokens):
            raise ExpressionError("trailing tokens")
        return value

    def _expr(self) -> Fraction:
        value = self._term()
        while (op := self._take_op("+", "-")) is not None:
            rhs = self._term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self) -> Fraction:
        value = self._unary()
        while (op := self._take_op("*", "/")) is not None:
            rhs = self._unary()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ExpressionError("division by zero")
            else:
                value = value / rhs
        return value

    def _unary(self) -> Fraction:
        if (op := self._take_op("+", "-")) is not None:
            value = self._unary()
            return -value if op == "-" else value
        return self._atom()

    def _atom(self) -> Fraction:
        kind, value = self._peek()
        if kind == "num":
            self.pos += 1
            return value
        if self._take_op("(") is not None:
            inner = self._expr()
            if self._take_op(")") is None:
                raise ExpressionError("unbalanced parenthesis")
            return inner
        raise ExpressionError("expected a number or '('")


def safe_eval(expr: str) -> Fraction:
    """Exact value of an arithmetic expression (numbers, + - * /, unary signs, parentheses).

    Raises ``ExpressionError`` for anything else, including names, calls, ``**``, expressions
    longer than 200 characters and numbers with more than 15 digits.
    """
    return _Parser(_tokenize(expr)).parse()


def _decimals(text: str) -> int:
    text = text.strip().replace(",", "")
    if re.fullmatch(r"[-+]?\$?\d*\.\d+", text):
        return len(text.split(".")[1])
    return 0


def _annotation_holds(annotation: str) -> bool:
    """Whether ``expr=value`` is arithmetically right.

    The sides must agree within a relative 1e-6. A value written with d >= 1 decimal places may
    also be the exact result rounded or truncated to d places (GSM8K writes ``10/3=3.33``).
    """
    expr, sep, value_text = annotation.rpartition("=")
    if not sep:
        return False
    value_text = value_text.strip().lstrip("$")
    try:
        lhs = safe_eval(expr)
        rhs = safe_eval(value_text)
    except (ExpressionError, RecursionError, ValueError, ZeroDivisionError):
        return False
    if abs(lhs - rhs) <= Fraction(1, 10**6) * max(1, abs(rhs)):
        return True
    decimals = _decimals(value_text)
    if decimals == 0:
        return False
    scale = 10**decimals
    rounded = abs(lhs - rhs) <= Fraction(1, 2 * scale)
    truncated = rhs == Fraction(int(lhs * scale), scale)
    return rounded or truncated


def _to_number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(str(text).replace(",", "").replace("$", "").strip().rstrip("."))
    except ValueError:
        return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, commas and a leading ``+`` removed; None if there is none.

    A text with ``####`` is read as GSM8K does (``extract_final_answer``: the number after the last
    ``####``, None if it is not a number). Otherwise the last "answer is n" (any case, optional ``:``,
    ``$``, ``**``; e.g. "The answer is: 18", "So the final answer is $18.") or ``\boxed{n}`` counts.
    """
    if not isinstance(text, str):
        return None
    if "####" in text:
        return extract_final_answer(text)
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None
    number = matches[-1].group("said") or matches[-1].group("boxed")
    return number.replace(",", "").lstrip("+")


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer (``extract_answer``: the last ``#### n``, "The answer is: n" or
    ``\boxed{n}``) equals the reference answer numerically, else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        predicted = _to_number(extract_answer(completion_text(completion)))
        gold = _to_number(reference)
        ok = (
            predicted is not None and gold is not None and abs(predicted - gold) <= 1e-6 * max(1.0, abs(gold))
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def _format_score(text: str) -> float:
    if extract_final_answer(text) is None:
        return 0.5 if extract_answer(text) is not None else 0.0
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasoning = lines[:-1]
    if reasoning and _FINAL_LINE_RE.fullmatch(lines[-1]) and not any("####" in line for line in reasoning):
        return 1.0
    return 0.5


def format_reward(completions, **kwargs) -> list[float]:
    """GSM8K answer layout: reasoning lines, then a final ``#### <number>`` line.

    1.0: the text ends (up to whitespace) with a ``#### <number>`` line, has at least one non-empty
    reasoning line before it and no other ``####``. 0.5: a final answer can be extracted (see
    ``extract_answer``: ``####``, "The answer is: n" or ``\boxed{n}``) but the layout is off: text after
    the number, no reasoning line, several ``####``, or another answer form than ``####``. 0.0: no final
    answer at all.
    """
    return [_format_score(completion_text(c)) for c in completions]


def calculator_reward(completions, **kwargs) -> list[float]:
    """Share of ``<<expr=value>>`` annotations whose arithmetic holds; 0.0 when there are none."""
    rewards = []
    for completion in completions:
        annotations = _ANNOTATION_RE.findall(completion_text(completion))
        if not annotations:
            rewards.append(0.0)
            continue
        rewards.append(sum(_annotation_holds(a) for a in annotations) / len(annotations))
    return rewards


REWARD_FUNCS = [correctness_reward, format_reward, calculator_reward]
