"""export-vllm: our heads as a vLLM Medusa speculator checkpoint.

The expectations below are written from vLLM's loader, not from our exporter:
- vllm/model_executor/models/medusa.py: ``ResidualBlock`` (``layers.{j}`` = ``nn.Linear(D, D, bias=medusa_fc_bias)``,
  ``x = x + SiLU(layer(x))``), ``Medusa.__init__`` (``blocks.{i}``; one shared ``lm_head`` when
  ``original_lm_head`` else ``lm_heads.{i}``), ``Medusa.load_weights`` (strips ``medusa_heads.``, maps
  ``lm_heads.0.weight`` to ``lm_head.weight`` under ``original_lm_head``, silently ignores any other unknown name);
- vllm/transformers_utils/configs/medusa.py: ``MedusaConfig`` (``model_type = "medusa"``, fields ``hidden_size``,
  ``vocab_size``, ``num_heads``, ``num_hidden_layers``, ``truncated_vocab_size``; ``from_pretrained`` renames any
  key containing "num" and "heads"/"layers").
"""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import Qwen2Config, Qwen2ForCausalLM

from specroll_trl import SpeculativeHeads
from specroll_trl.cli import main as cli_main
from specroll_trl.export import export_vllm

from .conftest import make_model

VOCAB, HIDDEN = 48, 32


def randomised(heads: SpeculativeHeads, seed: int = 1) -> SpeculativeHeads:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return heads


def read_export(folder):
    config = json.loads((folder / "config.json").read_text())
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return config, tensors


def vllm_config_view(raw: dict) -> dict:
    """What MedusaConfig.from_pretrained makes of config.json (key renaming + defaults)."""
    config = dict(raw)
    for key in list(config):
        if "num" in key:
            if "heads" in key:
                config["num_heads"] = config.pop(key)
            elif "layers" in key:
                config["num_hidden_layers"] = config.pop(key)
    if config.get("truncated_vocab_size") is None:
        config["truncated_vocab_size"] = config["vocab_size"]
    return config


def vllm_parameters(config: dict) -> dict[str, tuple]:
    """Parameter names and shapes vLLM's Medusa module registers for this config (lm heads unpadded)."""
    d, v = config["hidden_size"], config["truncated_vocab_size"]
    params = {}
    for i in range(config["num_heads"]):
        for j in range(config["num_hidden_layers"]):
            params[f"blocks.{i}.layers.{j}.weight"] = (d, d)
            if config.get("medusa_fc_bias", False):
                params[f"blocks.{i}.layers.{j}.bias"] = (d,)
    if config.get("original_lm_head", False):
        params["lm_head.weight"] = (v, d)
    else:
        params.update({f"lm_heads.{i}.weight": (v, d) for i in range(config["num_heads"])})
    return params


def vllm_load(config: dict, tensors: dict) -> tuple[dict, list]:
    """Medusa.load_weights' name resolution: (parameter -> tensor, names it would silently ignore)."""
    params, loaded, ignored = vllm_parameters(config), {}, []
    for name, tensor in tensors.items():
        name = name.replace("medusa_heads.", "")
        if name in params:
            loaded[name] = tensor
        elif config.get("original_lm_head", False) and name == "lm_heads.0.weight":
            loaded["lm_head.weight"] = tensor
        else:
            ignored.append(name)
    return loaded, ignored


def vllm_medusa_logits(config: dict, params: dict, hidden: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's Medusa forward + compute_logits (no token map, logit_scale 1) on the loaded tensors."""
    out = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            x = x + torch.nn.functional.silu(
                torch.nn.functional.linear(x, params[f"blocks.{i}.layers.{j}.weight"],
                                           params.get(f"blocks.{i}.layers.{j}.bias")))
        lm = params["lm_head.weight"] if config.get("original_lm_head", False) else params[f"lm_heads.{i}.weight"]
        out.append(x @ lm.T)
    return out


def check_loads_in_vllm(config: dict, tensors: dict) -> dict:
    config = vllm_config_view(config)
    loaded, ignored = vllm_load(config, tensors)
    assert ignored == [], f"vLLM would silently drop {ignored}"
    expected = vllm_parameters(config)
    assert sorted(loaded) == sorted(expected)
    for name, shape in expected.items():
        assert tuple(loaded[name].shape) == shape, name
    return loaded


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_layout_and_config_match_vllm_medusa(tmp_path, share, num_layers):
    model = make_model(vocab=VOCAB, hidden=HIDDEN)
    heads = randomised(SpeculativeHeads.from_model(model, num_heads=3, num_layers=num_layers))
    out = export_vllm(heads, model, tmp_path / "medusa", share_lm_head=share)
    config, tensors = read_export(out)
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["hidden_size"], config["vocab_size"], config["truncated_vocab_size"]) == (HIDDEN, VOCAB, VOCAB)
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, num_layers)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is share
    assert config["torch_dtype"] == "float32"
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    assert vllm_config_view(config) == config
    expected_names = {f"blocks.{i}.layers.{j}.{kind}" for i in range(3) for j in range(num_layers)
                      for kind in ("weight", "bias")}
    expected_names |= {"lm_heads.0.weight"} if share else {f"lm_heads.{i}.weight" for i in range(3)}
    assert set(tensors) == expected_names
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    check_loads_in_vllm(config, tensors)
    # one-to-one: our head i, layer j is vLLM's block i, layer j
    assert torch.equal(tensors[f"blocks.2.layers.{num_layers - 1}.weight"],
                       heads.heads[2][num_layers - 1].linear.weight)
    assert torch.equal(tensors["lm_heads.0.weight"], model.lm_head.weight)


@pytest.mark.parametrize("share", [True, False])
def test_vllm_forward_on_export_gives_our_head_logits(tmp_path, share):
    model = make_model(vocab=VOCAB, hidden=HIDDEN)
    heads = randomised(SpeculativeHeads.from_model(model, num_heads=4, num_layers=2))
    config, tensors = read_export(export_vllm(heads, model, tmp_path / "medusa", share_lm_head=share))
    params = check_loads_in_vllm(config, tensors)
    hidden = torch.randn(5, HIDDEN)
    theirs = vllm_medusa_logits(vllm_config_view(config), params, hidden)
    ours = heads.logits(hidden, model.lm_head)  # [5, H, V]; head k = index k - 1 predicts x_{t+1+k}
    assert len(theirs) == 4
    for i, logits in enumerate(theirs):
        torch.testing.assert_close(logits, ours[:, i], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs[0], theirs[1])  # the heads really differ, so an index shift would show


def test_dtype_is_the_targets_or_the_requested_one(tmp_path):
    model = make_model(vocab=VOCAB, hidden=HIDDEN).to(torch.bfloat16)
    heads = randomised(SpeculativeHeads.from_model(model, num_heads=2))
    config, tensors = read_export(export_vllm(heads, model, tmp_path / "bf16"))
    assert config["torch_dtype"] == "bfloat16" and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    config, tensors = read_export(export_vllm(heads, model, tmp_path / "fp16", dtype=torch.float16))
    assert config["torch_dtype"] == "float16" and {t.dtype for t in tensors.values()} == {torch.float16}


def test_folders_and_cli_give_the_same_export(tmp_path, capsys):
    model = make_model(vocab=VOCAB, hidden=HIDDEN)
    model.save_pretrained(tmp_path / "policy")
    heads = randomised(SpeculativeHeads.from_model(model, num_heads=3))
    heads.save_pretrained(tmp_path / "run" / "spec_heads")
    expected = read_export(export_vllm(heads, model, tmp_path / "from_modules"))
    assert cli_main(["export-vllm", "--heads", str(tmp_path / "run" / "spec_heads"), "--model",
                     str(tmp_path / "policy"), "--out", str(tmp_path / "from_cli")]) == 0
    config, tensors = read_export(tmp_path / "from_cli")
    assert config == expected[0]
    assert tensors.keys() == expected[1].keys() and all(torch.equal(tensors[k], expected[1][k]) for k in tensors)
    printed = capsys.readouterr().out
    spec = json.loads(printed.split("--speculative-config '")[1].rsplit("'", 1)[0])
    assert spec == {"method": "medusa", "model": str((tmp_path / "from_cli").resolve()), "num_speculative_tokens": 3}


def test_tied_embedding_model_folder(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path / "tied")
    heads = randomised(SpeculativeHeads.from_model(model, num_heads=2))
    _, tensors = read_export(export_vllm(heads, str(tmp_path / "tied"), tmp_path / "out"))
    assert torch.equal(tensors["lm_heads.0.weight"], model.get_input_embeddings().weight)


def lora_heads(model, base_dir=None, seed: int = 2):
    """Random heads (saved to ``base_dir`` first, if given) wrapped by PEFT LoRA with non-zero adapters."""
    heads = randomised(SpeculativeHeads.from_model(model, num_heads=2))
    if base_dir is not None:
        heads.save_pretrained(base_dir)
    wrapped = get_peft_model(heads, LoraConfig(r=4, lora_alpha=8, target_modules=["linear"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn_like(p))
    return wrapped


def test_peft_lora_heads_are_merged_and_left_untouched(tmp_path):
    model = make_model(vocab=VOCAB, hidden=HIDDEN)
    wrapped = lora_heads(model, base_dir=tmp_path / "base_heads")
    hidden = torch.randn(4, HIDDEN)
    with torch.no_grad():
        ours = model.lm_head(wrapped(hidden))  # LoRA active
        with wrapped.disable_adapter():
            unadapted = model.lm_head(wrapped(hidden))
    assert not torch.allclose(ours, unadapted)
    config, tensors = read_export(export_vllm(wrapped, model, tmp_path / "merged"))
    theirs = vllm_medusa_logits(vllm_config_view(config), check_loads_in_vllm(config, tensors), hidden)
    for i, logits in enumerate(theirs):
        torch.testing.assert_close(logits, ours[:, i], rtol=1e-5, atol=1e-5)
    assert any("lora_A" in n for n, _ in wrapped.named_parameters())  # the caller's PEFT model keeps its adapters
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(wrapped(hidden)), ours)

    # from folders: base heads + the saved adapter, through the CLI
    wrapped.save_pretrained(tmp_path / "adapter")
    assert cli_main(["export-vllm", "--heads", str(tmp_path / "base_heads"), "--model", str(_saved(model, tmp_path)),
                     "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "from_adapter")]) == 0
    config2, tensors2 = read_export(tmp_path / "from_adapter")
    assert config2 == config
    for name in tensors:
        torch.testing.assert_close(tensors2[name], tensors[name])
    with pytest.raises(ValueError, match="PEFT adapter"):
        export_vllm(tmp_path / "adapter", model, tmp_path / "wrong")


def _saved(model, tmp_path):
    folder = tmp_path / "policy"
    if not folder.is_dir():
        model.save_pretrained(folder)
    return folder


def test_bad_inputs_are_refused_with_clear_errors(tmp_path, capsys):
    model = make_model(vocab=VOCAB, hidden=HIDDEN)
    heads = SpeculativeHeads.from_model(model, num_heads=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_vllm(tmp_path / "no_such_heads", model, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="config.json"):
        export_vllm(heads, tmp_path / "no_such_model", tmp_path / "out")
    wider = make_model(vocab=VOCAB, hidden=2 * HIDDEN)
    with pytest.raises(ValueError, match="hidden size 32 but the model's lm_head takes 64"):
        export_vllm(heads, wider, tmp_path / "out")
    bigger_vocab = make_model(vocab=VOCAB + 16, hidden=HIDDEN)
    with pytest.raises(ValueError, match="vocab size 48 but the model's lm_head has 64"):
        export_vllm(heads, bigger_vocab, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(TypeError, match="SpeculativeHeads"):
        export_vllm(torch.nn.Linear(2, 2), model, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        export_vllm(heads, model, tmp_path / "out", adapter=tmp_path)

    export_vllm(heads, model, tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_vllm(heads, model, tmp_path / "out")
    export_vllm(heads, model, tmp_path / "out", overwrite=True)
    (tmp_path / "out" / "other.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="other files"):
        export_vllm(heads, model, tmp_path / "out", overwrite=True)

    biased = make_model(vocab=VOCAB, hidden=HIDDEN)
    biased.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with pytest.raises(ValueError, match="bias"):
        export_vllm(heads, biased, tmp_path / "biased")

    assert cli_main(["export-vllm", "--heads", str(tmp_path / "nope"), "--model", str(_saved(model, tmp_path)),
                     "--out", str(tmp_path / "cli_out")]) == 2
    assert "error: heads folder" in capsys.readouterr().err
