"""Moved policies for the adaptation benchmarks: the SFT answer style, the in-run policy switch, the KL and the
shift measurement."""

import pytest
import torch
from transformers import TrainerControl, TrainerState

from specroll_trl.experiments.ablation import PolicySwitch
from specroll_trl.experiments.shift import mean_token_kl, perturbed_policy, restyle_solution

from .conftest import make_model


def test_restyle_solution_numbers_steps_drops_annotations_and_keeps_the_answer():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 in all.\n#### 72"
    assert restyle_solution(solution) == ("Step 1: Natalia sold 48/2 = 24 clips in May.\n"
                                          "Step 2: She sold 48+24 = 72 in all.\n#### 72")


def test_policy_switch_loads_the_moved_weights_after_its_step_only(tmp_path):
    model, moved = make_model(seed=0), make_model(seed=1)
    moved.save_pretrained(tmp_path / "moved")
    switch = PolicySwitch(str(tmp_path / "moved"), at_step=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = TrainerState()
    state.global_step = 1
    switch.on_step_end(None, state, TrainerControl(), model=model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    state.global_step = 2
    switch.on_step_end(None, state, TrainerControl(), model=model)
    assert all(torch.equal(v, moved.state_dict()[k]) for k, v in model.state_dict().items())
    other = make_model(hidden=64)
    with pytest.raises(RuntimeError, match="size mismatch"):
        switch.on_step_end(None, state, TrainerControl(), model=other)


def test_mean_token_kl_is_zero_for_the_same_policy_and_grows_with_the_shift():
    model = make_model(seed=0, scale=4.0)
    ids = torch.randint(2, 32, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    completion = torch.zeros_like(ids)
    completion[:, 6:] = 1
    assert mean_token_kl(model, model, ids, mask, completion) == pytest.approx(0.0, abs=1e-6)
    small = mean_token_kl(perturbed_policy(model, scale=0.5), model, ids, mask, completion)
    large = mean_token_kl(perturbed_policy(model, scale=4.0), model, ids, mask, completion)
    assert 0 < small < large


@pytest.mark.slow
def test_measure_shift_reports_kl_and_the_heads_acceptance_on_both_policies(nano, tmp_path, monkeypatch):
    from specroll_trl.experiments import zoo
    from specroll_trl.experiments.shift import measure_shift

    model, tokenizer, heads = nano
    grad_modes = []

    def load_heads(*args, **kwargs):  # on an empty cache this distils: it must run with gradients on
        grad_modes.append(torch.is_grad_enabled())
        return heads

    monkeypatch.setattr(zoo, "load_heads", load_heads)
    perturbed_policy(model, scale=2.0).save_pretrained(tmp_path / "moved")
    record = measure_shift("nano", str(tmp_path / "moved"), num_prompts=4, max_new_tokens=32, progress=False)
    assert record["kl_moved_base"] > 0.01
    assert record["base_tau"] > record["moved_tau"] >= 1.0  # the base's heads lose acceptance on the moved policy
    assert record["tau_drop"] == pytest.approx(1 - record["moved_tau"] / record["base_tau"])
    assert len(record["moved_candidate_regret"]) == len(record["base_accept_per_head"]) == 4
    assert record["completion_tokens"] > 0
    assert grad_modes == [True]


def test_ablation_refuses_bad_shift_settings_before_loading_anything():
    from specroll_trl.experiments.ablation import bench_ablation

    with pytest.raises(ValueError, match="unknown shift"):
        bench_ablation("smollm2-135m", shift="rlhf")
    with pytest.raises(ValueError, match="pretrained chat preset"):
        bench_ablation("tiny", shift="sft")
    with pytest.raises(ValueError, match="shift_at"):
        bench_ablation("smollm2-135m", steps=4, shift="sft-capitals", shift_at=4)
    with pytest.raises(ValueError, match="unknown ablation variants"):
        bench_ablation("smollm2-135m", variants=("static", "turbo"))


def test_moved_policy_and_sft_refuse_unknown_moves_and_styles():
    from specroll_trl.experiments.shift import STYLES, moved_policy, sft_policy

    with pytest.raises(ValueError, match="unknown move"):
        moved_policy("smollm2-135m", "dpo")
    with pytest.raises(ValueError, match="pretrained chat preset"):
        moved_policy("nano", "sft")
    with pytest.raises(ValueError, match="unknown SFT style"):
        sft_policy("smollm2-135m", style="haiku")
    assert STYLES["capitals"]("A <<1+1=2>>2.\n#### 2") == "STEP 1: A 2.\n#### 2"
