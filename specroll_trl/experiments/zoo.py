"""Offline policy zoo: small Qwen2 policies trained by our own SFT, and pretrained models, as HF folders.

Nothing here touches a model hub. A toy preset (``PRESETS``) fixes the tokenizer size, architecture, task
and training steps; ``load_policy("tiny")`` builds it once under ``$SPECROLL_HOME/zoo/<preset>`` (default
``~/.cache/specroll_trl``) and afterwards loads it with ``AutoModelForCausalLM.from_pretrained``. A
pretrained preset (``PRETRAINED``, e.g. ``"smollm2-135m"``) is de-quantised once from a locally installed
wheel (see ``pretrained.py``) and then loads the same way. Any HF causal LM folder can stand in for a preset.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..files import atomic_folder, specroll_home
from .pretrained import (  # noqa: F401  (PretrainedPackageMissing: re-exported for callers)
    PRETRAINED,
    PRETRAINED_VERSION,
    PretrainedPackageMissing,
    PretrainedPreset,
    build_pretrained,
    pretrained_dir,
)
from .tasks import arithmetic_examples, format_prompt, gsm8k_examples

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ZOO_VERSION = 1


@dataclass(frozen=True)
class PolicyPreset:
    """Everything that determines a zoo policy (the cache key is ``name`` + ``ZOO_VERSION``).

    Args:
        name: preset name, also the cache folder name.
        task: ``"arithmetic"`` (procedural multi-step word problems, GSM8K format) or ``"gsm8k"``.
        vocab_size: BPE vocabulary size including special tokens.
        hidden_size / num_layers / num_heads / num_kv_heads / intermediate_size: Qwen2 shape.
        train_examples: SFT examples generated (arithmetic) or taken (gsm8k).
        steps / batch_size / lr: SFT optimisation.
        max_position_embeddings: context length written into the config.
        seed: seeds data generation, initialisation and batching.
    """

    name: str
    task: str = "arithmetic"
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    train_examples: int = 60000
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    max_position_embeddings: int = 2048
    seed: int = 0


PRESETS: dict[str, PolicyPreset] = {
    "nano": PolicyPreset(
        name="nano", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=192, train_examples=20000, steps=500, batch_size=32, lr=4e-3,
    ),
    "tiny": PolicyPreset(
        name="tiny", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=384, train_examples=40000, steps=950, batch_size=32, lr=3e-3,
    ),
    "tiny-gsm8k": PolicyPreset(
        name="tiny-gsm8k", task="gsm8k", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, intermediate_size=384, train_examples=7473, steps=1500, batch_size=16, lr=3e-3,
    ),
}
DEFAULT_PRESET = "tiny"
# PRETRAINED (from .pretrained): pretrained policies built from an installed wheel, not trained here; their
# prompts are conversational (chat template). ``preset_task`` gives any preset's task.


def preset_task(preset: str) -> str:
    """The task a toy or pretrained preset is meant for (``"arithmetic"`` or ``"gsm8k"``); ``"arithmetic"`` for a
    model folder."""
    if preset in PRESETS:
        return PRESETS[preset].task
    if preset in PRETRAINED:
        return PRETRAINED[preset].task
    return "arithmetic"


def preset_dataset(preset: str, n: int, seed: int = 321, task: str | None = None):
    """``n`` GRPO prompts of ``task`` (default: the preset's) in the form the policy reads: conversational
    (``[{"role": "user", ...}]``, as TRL users pass them) for a pretrained chat model, the plain prompt for a toy."""
    from .tasks import chat_task_dataset, task_dataset

    task = task or preset_task(preset)
    return chat_task_dataset(task, n, seed=seed) if preset in PRETRAINED else task_dataset(task, n, seed=seed)


def preset_temperature(preset: str) -> float:
    """The sampling temperature a preset's heads are distilled at, so the runs that use them sample at it too
    (1.0 for a model folder)."""
    return preset_distill_config(preset).temperature if preset in PRESETS or preset in PRETRAINED else 1.0


def preset_heads(preset: str, progress: bool = True, kind: str = "path") -> str | None:
    """The cached heads folder of a zoo preset (built on first use); ``None`` for a model folder. ``kind``: which
    of a pretrained preset's head kinds (a toy preset has independent heads only)."""
    if preset not in PRESETS and preset not in PRETRAINED:
        return None
    return str(build_heads(preset, progress=progress, kind=kind))


def zoo_home() -> Path:
    """Root of the local cache (``$SPECROLL_HOME`` or ``~/.cache/specroll_trl``)."""
    return specroll_home()


def policy_dir(preset: str) -> Path:
    if preset in PRETRAINED:
        return pretrained_dir(preset)
    return zoo_home() / "zoo" / f"{preset}-v{ZOO_VERSION}"


def task_examples(task: str, n: int, seed: int, split: str = "train") -> list[dict]:
    """``n`` examples (question, solution, answer) of a task; ``split="test"`` gives held-out ones."""
    if task == "arithmetic":
        return arithmetic_examples(n, seed=seed if split == "train" else seed + 10_000)
    if task == "gsm8k":
        return gsm8k_examples(split, limit=n)
    raise ValueError(f"unknown task {task!r}: expected 'arithmetic' or 'gsm8k'")


# Qwen2's pre-tokenisation (digits split one by one): AutoTokenizer rebuilds a Qwen2 folder's tokenizer with
# it, so training with anything else would make the reloaded tokenizer disagree with the trained model.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (Qwen2 pre-tokenisation) with eos, pad and chat tokens, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE,
        padding_side="left", model_max_length=4096,
    )


def _encode_examples(tokenizer, examples: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + eos); prompt and completion tokenised apart, as TRL does."""
    prompts = tokenizer([format_prompt(e["question"]) for e in examples], add_special_tokens=False)["input_ids"]
    completions = tokenizer([" " + e["solution"] for e in examples], add_special_tokens=False)["input_ids"]
    return [(p, c + [tokenizer.eos_token_id]) for p, c in zip(prompts, completions)]


def _batch(pairs, pad_id: int):
    length = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), length), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), length), dtype=torch.long)
    for i, (p, c) in enumerate(pairs):
        seq = torch.tensor(p + c)
        ids[i, : len(seq)] = seq
        labels[i, len(p) : len(seq)] = seq[len(p) :]
        mask[i, : len(seq)] = 1
    return ids, mask, labels


def build_policy(preset: str | PolicyPreset = DEFAULT_PRESET, force: bool = False, progress: bool = True) -> Path:
    """Train (tokenizer + SFT) and cache a zoo policy; returns its folder. Cached builds are reused.

    A ``PRETRAINED`` name is built by ``pretrained.build_pretrained`` instead (de-quantised, not trained).
    """
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if isinstance(preset, PretrainedPreset) or preset in PRETRAINED:
        return build_pretrained(preset, dest=policy_dir(getattr(preset, "name", preset)), force=force,
                                progress=progress)
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown zoo preset {preset!r}; available: {sorted(PRESETS) + sorted(PRETRAINED)}")
    spec = PRESETS[preset] if isinstance(preset, str) else preset
    out = policy_dir(spec.name)
    if (out / "build_info.json").is_file() and not force:
        return out
    start = time.time()
    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    examples = task_examples(spec.task, spec.train_examples, spec.seed)
    texts = [format_prompt(e["question"]) + " " + e["solution"] for e in examples]
    with atomic_folder(out) as tmp:
        # Train on exactly what users will load: a reloaded tokenizer can merge differently from the in-memory one.
        train_tokenizer(texts, spec.vocab_size).save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        pairs = _encode_examples(tokenizer, examples)

        config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0,
        )
        model = Qwen2ForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.98))
        warmup = max(1, spec.steps // 20)

        def lr_at(step):
            if step < warmup:
                return (step + 1) / warmup
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, spec.steps - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
        rng = random.Random(spec.seed)
        model.train()
        bar = tqdm(range(spec.steps), desc=f"SFT {spec.name} ({n_params / 1e6:.2f}M params)", disable=not progress)
        for _ in bar:
            ids, mask, labels = _batch(rng.sample(pairs, spec.batch_size), tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        model.eval()

        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CHAT_TOKENS[1])],
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        )
        model.save_pretrained(tmp)
        info = {
            "preset": asdict(spec), "zoo_version": ZOO_VERSION, "parameters": n_params,
            "build_seconds": round(time.time() - start, 1), "final_train_loss": round(loss.item(), 4),
        }
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    reloaded = AutoTokenizer.from_pretrained(out)
    if _encode_examples(reloaded, examples[:64]) != pairs[:64]:
        raise RuntimeError(f"the tokenizer saved in {out} does not reproduce the training tokenisation")
    return out


def resolve_policy(name_or_path: str, progress: bool = True) -> Path:
    """A toy or pretrained preset name (built on first use) or an existing HF model folder.

    Raises ``PretrainedPackageMissing`` (with the install command) for a pretrained preset that is not
    cached yet and whose wheel is not installed.
    """
    if name_or_path in PRESETS or name_or_path in PRETRAINED:
        return build_policy(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a zoo preset ({sorted(PRESETS) + sorted(PRETRAINED)}) nor a folder "
            f"with a config.json"
        )
    return path


def load_policy(name_or_path: str = DEFAULT_PRESET, progress: bool = True, dtype=torch.float32):
    """``(model, tokenizer)`` for a preset or a local HF folder; the model is in eval mode, in ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_policy(name_or_path, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tokenizer


@torch.no_grad()
def evaluate_policy(model, tokenizer, examples: list[dict], temperature: float = 1.0, max_new_tokens: int = 160,
                    batch_size: int = 32, seed: int = 0) -> dict:
    """Held-out loss of gold solutions, mean per-token entropy of sampled completions, and accuracy."""
    from .rewards import correctness_reward

    pad = tokenizer.pad_token_id
    pairs = _encode_examples(tokenizer, examples)
    nll, n_tok = 0.0, 0
    for i in range(0, len(pairs), batch_size):
        ids, mask, labels = _batch(pairs[i : i + batch_size], pad)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        nll += torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="sum").item()
        n_tok += int((target != -100).sum())

    torch.manual_seed(seed)
    entropy_sum, entropy_tokens, correct = 0.0, 0, 0
    eos_ids = model.generation_config.eos_token_id
    eos = torch.tensor(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        enc = tokenizer([format_prompt(e["question"]) for e in chunk], return_tensors="pt", padding=True,
                        add_special_tokens=False)
        out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True)
        completion = out.sequences[:, enc["input_ids"].shape[1]:]
        alive = torch.ones(len(chunk), dtype=torch.bool)
        for step, scores in enumerate(out.scores):
            logp = torch.log_softmax(scores.float(), dim=-1)
            ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
            entropy_sum += ent[alive].sum().item()
            entropy_tokens += int(alive.sum())
            alive &= ~torch.isin(completion[:, step], eos)
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
        correct += sum(correctness_reward(texts, [e["answer"] for e in chunk]))
    return {
        "heldout_loss": nll / max(1, n_tok),
        "entropy": entropy_sum / max(1, entropy_tokens),
        "accuracy": correct / max(1, len(examples)),
        "temperature": temperature,
        "num_prompts": len(examples),
    }


def heads_dir(preset: str, kind: str = "path") -> Path:
    """Where a preset's heads are cached: ``spec_heads_<kind>/`` for a pretrained preset (it ships a set of each
    kind), ``spec_heads/`` for a toy (one set, of the kind its distillation recipe fits)."""
    return policy_dir(preset) / (f"spec_heads_{kind}" if preset in PRETRAINED else "spec_heads")


def preset_distill_config(preset: str):
    """Head self-distillation settings for a zoo preset (smaller for ``nano`` so tests stay quick). A pretrained
    preset gets the on-policy recipe of its shipped heads (``onpolicy_heads.onpolicy_distill_config``)."""
    from ..adapt.distill import HeadDistillConfig

    if preset in PRETRAINED:
        from .onpolicy_heads import onpolicy_distill_config

        return onpolicy_distill_config()
    if preset == "nano":
        return HeadDistillConfig(num_samples=320, max_new_tokens=128, steps=300, batch_size=512)
    return HeadDistillConfig(num_samples=1536, max_new_tokens=192, steps=2400, batch_size=1024)


def teacher_forced_text(tokenizer, n: int, offset: int = 0,
                        restyle: Callable[[str], str] | None = None) -> list[tuple[list[int], list[int]]]:
    """``n`` GSM8K training solutions (rows from ``offset`` on, each through ``restyle`` if given) as chat replies
    to their questions, ``(prompt, reply)`` token ids: text the heads can learn from with one forward each instead
    of sampling it, or an SFT set."""
    from .tasks import chat_prompt

    pairs = []
    for example in gsm8k_examples("train", limit=offset + n)[offset:]:
        prompt = tokenizer.apply_chat_template(chat_prompt(example["question"]), tokenize=False,
                                               add_generation_prompt=True)
        reply = (restyle or str)(example["solution"]) + tokenizer.eos_token
        pairs.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                      tokenizer(reply, add_special_tokens=False)["input_ids"]))
    return pairs


def task_prompt_ids(tokenizer, task: str, n: int, seed: int, conversational: bool = False) -> list[list[int]]:
    """Tokenised prompts of a task, unpadded: standard form (no special tokens), or with ``conversational``
    ``tasks.chat_prompt`` messages (with its answer instruction) through the tokenizer's chat template, as TRL
    renders conversational prompts."""
    examples = task_examples(task, n, seed)
    if conversational:
        from .tasks import chat_prompt

        rendered = [
            tokenizer.apply_chat_template(chat_prompt(e["question"]), tokenize=False, add_generation_prompt=True)
            for e in examples
        ]
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer([format_prompt(e["question"]) for e in examples], add_special_tokens=False)["input_ids"]


def build_heads(preset: str = DEFAULT_PRESET, force: bool = False, progress: bool = True,
                kind: str = "path") -> Path:
    """Speculative heads for a zoo preset, cached inside the policy's folder (``heads_dir``); returns that folder.
    A pretrained preset gets its shipped heads of ``kind`` when they were fitted to these exact weights, else the
    on-policy recipe runs (``onpolicy_heads``); a toy preset's (independent) heads are distilled once. A build that
    fails leaves no temporary folder behind."""
    from ..adapt.distill import REPORT_FILE, distill_heads, save_distilled

    out = heads_dir(preset, kind)
    if (out / REPORT_FILE).is_file() and not force and not _replaced_since(preset, out, kind):
        return out
    model, tokenizer = load_policy(preset, progress=progress)
    if preset in PRETRAINED:
        from .onpolicy_heads import install_heads

        return install_heads(preset, model, tokenizer, out, policy_dir(preset) / "onpolicy_samples", kind, progress)
    config = preset_distill_config(preset)
    prompts = task_prompt_ids(tokenizer, preset_task(preset), config.num_samples, seed=PRESETS[preset].seed + 20_000)
    heads, report = distill_heads(model, prompts, tokenizer.pad_token_id, config, progress=progress)
    with atomic_folder(out) as tmp:
        save_distilled(heads, report, tmp)
    return out


def _replaced_since(preset: str, cached: Path, kind: str) -> bool:
    """Whether ``cached`` holds a pretrained preset's shipped heads that this version of the package ships others
    in place of (same policy, another report): the cached copy is then installed again."""
    if preset not in PRETRAINED:
        return False
    from ..adapt.distill import REPORT_FILE
    from .onpolicy_heads import shipped_folder

    shipped = shipped_folder(preset, kind) / REPORT_FILE
    if not shipped.is_file():
        return False
    old, new = json.loads((cached / REPORT_FILE).read_text()), json.loads(shipped.read_text())
    return old.get("policy_sha256") == new.get("policy_sha256") and old != new


def load_heads(preset: str = DEFAULT_PRESET, progress: bool = True, kind: str = "path"):
    """Cached heads of a zoo preset (built on first use; ``kind``: as in :func:`build_heads`)."""
    from ..engine.heads import SpeculativeHeads

    return SpeculativeHeads.from_pretrained(build_heads(preset, progress=progress, kind=kind))


def trl_generation_config(model, tokenizer, max_new_tokens: int, temperature: float = 1.0):
    """The ``GenerationConfig`` TRL 1.16's GRPOTrainer builds with GRPOConfig defaults."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    eos = sorted({tokenizer.eos_token_id, *eos})
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, temperature=temperature, top_p=1.0, top_k=0,
        min_p=None, repetition_penalty=1.0, cache_implementation=None, disable_compile=True,
    )


def policy_heads_and_config(preset: str, max_new_tokens: int, temperature: float = 1.0):
    """A preset's policy, tokenizer, shipped heads and TRL's ``GenerationConfig``: what a side-by-side script runs."""
    model, tokenizer = load_policy(preset, progress=False)
    heads = load_heads(preset, progress=False)
    return model, tokenizer, heads, trl_generation_config(model, tokenizer, max_new_tokens, temperature)
