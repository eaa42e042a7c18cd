"""The engine on the Llama architecture of the default policy: random-init tiny Llama configs with grouped-query
attention and tied embeddings (exact enumeration, chi-square, greedy identity), and, in the slow lane, the real
SmolLM2-135M-Instruct (greedy identity with ``generate`` on GSM8K chat prompts, one SpecGRPOTrainer step)."""

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specroll_trl.engine.generator import SpeculativeGenerator, final_hidden_of
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.engine.hooks import StepHook

from .conftest import cut_after_eos, left_padded, make_model
from .test_engine import PROMPTS, SAMPLING_SETTINGS, chi_square_pvalue, engine_samples, exact_completion_distribution


def make_llama(vocab=6, hidden=32, layers=2, seed=0, scale=1.0, eos=1, pad=0):
    """A random-init Llama with grouped-query attention (4 query / 2 KV heads) and tied embeddings."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=eos, pad_token_id=pad, bos_token_id=eos,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)  # sharper next-token distributions, embeddings left as they are
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def noisy(model, std=0.4, seed=1, draft_ids=None):
    heads = SpeculativeHeads.from_model(model, num_heads=3, draft_ids=draft_ids)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, std)
    return heads


@pytest.mark.parametrize("name", [pytest.param("t1.0", marks=pytest.mark.slow), "t0.7-minp-rep",
                                  pytest.param("t1.0-rep-topk-topp", marks=pytest.mark.slow)])
def test_sampling_distribution_is_exact_on_llama(name):
    model = make_llama(scale=3.0, seed=11)
    gc = GenerationConfig(do_sample=True, max_new_tokens=3, eos_token_id=1, pad_token_id=0, **SAMPLING_SETTINGS[name])
    samples, stats = engine_samples(model, noisy(model), gc, n_per_prompt=8000, seed=5)
    assert stats["accepted"] > 0.1 * stats["row_forwards"]  # drafts were really accepted
    for prompt, rows in zip(PROMPTS, samples):
        exact = exact_completion_distribution(model, prompt, gc)
        assert chi_square_pvalue(rows, exact) > 1e-3


@pytest.mark.parametrize("draft", [None, "half"])
def test_greedy_equals_generate_on_llama_with_gqa_and_tied_embeddings(draft):
    model = make_llama(vocab=64, hidden=64, layers=3, seed=2, scale=4.0)
    heads = noisy(model, std=0.2, draft_ids=None if draft is None else torch.arange(0, 64, 2))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (6,), generator=gen)
    prompts = [torch.randint(2, 64, (int(n),), generator=gen).tolist() for n in lengths]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, max_nodes=8).generate(ids, mask)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    assert out.completion_ids == cut_after_eos(ref, {1})


class FirstStepHidden(StepHook):
    def __init__(self):
        self.hidden = None

    def feedback(self, step):
        if self.hidden is None:
            self.hidden = step.hidden.clone()


@pytest.mark.parametrize("make", [make_llama, make_model])
def test_heads_read_the_targets_final_hidden_state_without_output_hidden_states(make):
    """The engine reads the final hidden states as the lm_head's input (no ``output_hidden_states``, which keeps
    every layer's): on Llama and Qwen2 that is what ``output_hidden_states`` gives last, for the prefill's last
    position and for every tree node."""
    model = make(vocab=64, hidden=32, seed=3)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10]])
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    reference = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                      output_hidden_states=True).hidden_states[-1]
    with final_hidden_of(model.get_output_embeddings()) as seen:
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids)
    assert torch.equal(seen[-1], reference)
    hook = FirstStepHidden()
    gc = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=1, pad_token_id=0)
    asked = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: asked.append(kwargs.get("output_hidden_states")) or forward(*args, **kwargs)
    SpeculativeGenerator(model, noisy(model), gc, hooks=[hook], max_nodes=4).generate(ids, mask)
    torch.testing.assert_close(hook.hidden, reference[:, -1], rtol=1e-5, atol=1e-5)
    assert asked and not any(asked)  # no forward kept every layer's states


# --------------------------------------------------------------------------------------- the real default policy
@pytest.fixture(scope="module")
def smollm(specroll_home):
    from specroll_trl.experiments import zoo

    model, tokenizer = zoo.load_policy("smollm2-135m", progress=False)
    return model, tokenizer


@pytest.mark.slow
def test_greedy_equals_generate_on_smollm2_gsm8k_chat_prompts(smollm):
    from specroll_trl.experiments import zoo

    model, tokenizer = smollm
    prompts = zoo.task_prompt_ids(tokenizer, "gsm8k", 4, seed=0, conversational=True)
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    gc = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=model.generation_config.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    heads = noisy(model, std=0.01, draft_ids=torch.arange(4096))  # any heads: the output must not depend on them
    out = SpeculativeGenerator(model, heads, gc, max_nodes=8).generate(ids, mask)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    assert out.completion_ids == cut_after_eos(ref, set(gc.eos_token_id))


@pytest.mark.slow
def test_one_specgrpo_step_on_smollm2(smollm, tmp_path):
    from specroll_trl import SpecGRPOConfig, SpecGRPOTrainer
    from specroll_trl.experiments import zoo
    from specroll_trl.experiments.rewards import correctness_reward, format_reward

    args = SpecGRPOConfig(output_dir=str(tmp_path), max_steps=1, num_generations=4, per_device_train_batch_size=4,
                          max_completion_length=24, logging_steps=1, report_to="none", bf16=False,
                          save_strategy="no", temperature=0.7, spec_init_heads="zeros", disable_tqdm=True)
    trainer = SpecGRPOTrainer(model=str(zoo.policy_dir("smollm2-135m")), reward_funcs=[correctness_reward,
                              format_reward], args=args, train_dataset=zoo.preset_dataset("smollm2-135m", 4))
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert row["spec/tau"] >= 1.0 and "spec/accept_head_1" in row and row["spec/tree_nodes_per_row"] > 0
