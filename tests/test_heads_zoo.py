"""Speculative heads (offsets, persistence, PEFT), head distillation and the offline policy zoo."""

import json
import os
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specroll_trl.adapt.distill import HeadDistillConfig, build_stream, head_hit_rates, train_heads_on_stream
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import zoo

from .conftest import make_model

VOCAB = 12


def cyclic_stream(model, length=60):
    """A deterministic sequence 2,3,...,11,2,3,...: x_{t+1+k} is a function of x_t."""
    seq = [2 + (i % (VOCAB - 2)) for i in range(length)]
    return build_stream(model, [(seq[:1], seq[1:])], temperature=1.0, topk=VOCAB)


def test_stream_targets_use_the_right_offsets():
    model = make_model(vocab=VOCAB, hidden=32)
    stream = cyclic_stream(model)
    anchors = torch.tensor([0, 5, 50])
    pos, token, valid = stream.targets(anchors, num_heads=3)
    assert pos.tolist() == [[1, 2, 3], [6, 7, 8], [51, 52, 53]]
    assert token.tolist() == [[stream.ids[a + 1 + k].item() for k in (1, 2, 3)] for a in anchors.tolist()]
    assert valid.all()
    pos, _, valid = stream.targets(torch.tensor([56]), num_heads=3)
    assert valid.tolist() == [[True, True, False]]  # x_{60} does not exist


def test_heads_learn_to_predict_exactly_x_t_plus_1_plus_k():
    model = make_model(vocab=VOCAB, hidden=64, seed=1)
    stream = cyclic_stream(model)
    heads = SpeculativeHeads.from_model(model, num_heads=3)
    config = HeadDistillConfig(steps=400, batch_size=64, lr=1e-2, kl_weight=0.0, nll_weight=1.0)
    train_heads_on_stream(heads, model.lm_head, stream, config, progress=False)
    rates, _ = head_hit_rates(heads, heads.projection(model.lm_head), stream, ks=(1,))
    assert [r[1] for r in rates] == [1.0, 1.0, 1.0]
    # and the prediction is exactly the token k places after the next one
    with torch.no_grad():
        top = heads.logits(stream.hidden[:10], model.lm_head).argmax(-1)
    for t in range(10):
        assert top[t].tolist() == [stream.ids[t + 1 + k].item() for k in (1, 2, 3)]


def test_zero_initialised_heads_reproduce_the_base_distribution():
    model = make_model(vocab=VOCAB)
    heads = SpeculativeHeads.from_model(model, num_heads=4)
    h = torch.randn(5, 32)
    with torch.no_grad():
        logits = heads.logits(h, model.lm_head)
    for k in range(4):
        torch.testing.assert_close(logits[:, k], model.lm_head(h))
    assert not any("lm_head" in name for name in heads.state_dict())


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = make_model(vocab=VOCAB)
    heads = SpeculativeHeads.from_model(model, num_heads=3, num_layers=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    heads.save_pretrained(tmp_path / "h")
    assert sorted(os.listdir(tmp_path / "h")) == ["config.json", "model.safetensors"]
    loaded = SpeculativeHeads.from_pretrained(tmp_path / "h")
    assert loaded.config == heads.config
    for (n1, a), (n2, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b)


def test_mismatched_heads_are_refused():
    model = make_model(vocab=VOCAB, hidden=32)
    with pytest.raises(ValueError, match="hidden size"):
        SpeculativeHeads.from_model(make_model(vocab=VOCAB, hidden=64)).check_compatible(model)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeHeads.from_model(make_model(vocab=VOCAB + 4)).check_compatible(model)
    with pytest.raises(ValueError, match="num_heads"):
        SpeculativeHeads.from_model(model, num_heads=0)


def saved_heads(tmp_path, model=None) -> Path:
    model = model or make_model(vocab=16)
    folder = tmp_path / "heads"
    SpeculativeHeads.from_model(model, 2).save_pretrained(folder)
    return folder


def test_heads_path_that_is_missing_or_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SpeculativeHeads.from_pretrained(tmp_path / "missing")
    folder = saved_heads(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a file, not a heads folder"):
        SpeculativeHeads.from_pretrained(folder / "model.safetensors")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_heads_folder_missing_a_file(tmp_path, name):
    folder = saved_heads(tmp_path)
    (folder / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {name}"):
        SpeculativeHeads.from_pretrained(folder)


@pytest.mark.parametrize(
    "config_text,match",
    [
        (lambda cfg: "{not json", "not a valid heads config"),
        (lambda cfg: json.dumps({"num_heads": 2, "hidden_size": 0, "vocab_size": 16}),
         "hidden_size must be a positive int"),
        (lambda cfg: json.dumps({"num_heads": "2", "hidden_size": 32, "vocab_size": 16}),
         "num_heads must be a positive int"),
        (lambda cfg: json.dumps([1, 2]), "not a valid heads config"),
        (lambda cfg: json.dumps({**cfg, "num_heads": 3}), "does not match its config"),  # weights hold 2 heads
    ],
    ids=["not-json", "hidden-0", "num-heads-str", "a-list", "disagrees-with-weights"],
)
def test_heads_folder_with_a_bad_config(tmp_path, config_text, match):
    folder = saved_heads(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(config_text(cfg))
    with pytest.raises(ValueError, match=match):
        SpeculativeHeads.from_pretrained(folder)


def test_heads_with_unreadable_non_finite_or_misshapen_weights(tmp_path):
    folder = saved_heads(tmp_path)
    weights = folder / "model.safetensors"
    state = {k: v.clone() for k, v in load_file(str(weights)).items()}  # copies: the file is rewritten below
    name = sorted(state)[0]
    poisoned = dict(state)
    poisoned[name] = state[name].clone()
    poisoned[name].view(-1)[0] = float("nan")
    save_file(poisoned, str(weights))
    with pytest.raises(ValueError, match="contains NaN or inf"):
        SpeculativeHeads.from_pretrained(folder)
    reshaped = dict(state)
    reshaped[name] = torch.zeros(3, 3)
    save_file(reshaped, str(weights))
    with pytest.raises(ValueError, match="has shape"):
        SpeculativeHeads.from_pretrained(folder)
    save_file(state, str(weights))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="safetensors"):
        SpeculativeHeads.from_pretrained(folder)
    weights.write_bytes(b"\x80\x04\x95 not safetensors, e.g. a pickle")
    with pytest.raises(ValueError, match="safetensors"):
        SpeculativeHeads.from_pretrained(folder)
    weights.write_bytes(b"")  # empty file
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        SpeculativeHeads.from_pretrained(folder)


def test_lora_wrapped_heads_train_and_save_only_adapters(tmp_path):
    model = make_model(vocab=VOCAB, hidden=32, seed=2)
    stream = cyclic_stream(model)
    heads = SpeculativeHeads.from_model(model, num_heads=2)
    base = {k: v.clone() for k, v in heads.state_dict().items()}
    lora = get_peft_model(heads, LoraConfig(r=4, lora_alpha=8, target_modules=["linear"]))
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    train_heads_on_stream(lora, model.lm_head, stream, HeadDistillConfig(steps=20, batch_size=32), progress=False)
    changed = {n for n, p in lora.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    frozen = {n: p for n, p in lora.named_parameters() if "lora_" not in n}
    for name, p in frozen.items():
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(p, base[key])
    lora.save_pretrained(tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    reloaded = PeftModel.from_pretrained(SpeculativeHeads.from_model(model, num_heads=2), tmp_path / "adapter")
    h = stream.hidden[:7]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.logits(h, model.lm_head), lora.logits(h, model.lm_head))


def test_zoo_builds_and_reloads_offline(nano, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = zoo.policy_dir("nano")
    info = json.loads((folder / "build_info.json").read_text())
    assert info["parameters"] > 50_000 and info["preset"]["name"] == "nano"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert zoo.build_policy("nano") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # cached: not rebuilt
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tokenizer.eos_token == zoo.EOS_TOKEN and tokenizer.pad_token == zoo.PAD_TOKEN
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    text = " So Tom has 17+11=<<17+11=28>>28 toys.\n#### 28"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    # the nano policy learned its task format: a greedy completion ends with a final answer line
    prompt = tokenizer(zoo.format_prompt(zoo.task_examples("arithmetic", 1, 5, "test")[0]["question"]),
                       return_tensors="pt", add_special_tokens=False)
    out = model.generate(**prompt, do_sample=False, max_new_tokens=120)
    assert "####" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])


def test_zoo_refuses_unknown_presets_and_paths(specroll_home, tmp_path):
    with pytest.raises(ValueError, match="unknown zoo preset"):
        zoo.build_policy("huge")
    with pytest.raises(FileNotFoundError, match="neither a zoo preset"):
        zoo.resolve_policy(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="unknown task"):
        zoo.task_examples("chess", 3, 0)


def test_distilled_nano_heads_hit_often(nano):
    report = json.loads((zoo.heads_dir("nano") / "distill_report.json").read_text())
    top1 = [float(r["1"]) for r in report["hit_rates"]]
    top5 = [float(r["5"]) for r in report["hit_rates"]]
    assert top1[0] > 0.4 and all(a >= b - 0.02 for a, b in zip(top1, top1[1:]))  # farther heads are harder
    assert all(t5 >= t1 for t1, t5 in zip(top1, top5))
