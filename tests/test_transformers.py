"""attngen as a Hugging Face transformers attention implementation (attngen/integrations/transformers.py): tiny
models of the Llama, Mistral, Gemma 2 and gpt-oss architectures built from configs with random weights (no
download), whose logits and parameter gradients with attn_implementation="attngen" match "eager"'s."""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attngen.api.kvcache import attention_with_kvcache  # noqa: E402
from attngen.integrations.transformers import NAME, register  # noqa: E402
from attngen.runtime import autograd  # noqa: E402
from conftest import DEVICE, HAS_GPU  # noqa: E402

# Sliding windows, softcap and sinks run variant kernels, whose backward comes with issue 48's backward part.
VARIANT_BACKWARD = pytest.mark.skipif("tensors" not in inspect.signature(autograd.attention_forward).parameters,
                                      reason="needs the backward of variants (autograd.attention_forward(tensors=))")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def llama():
    return transformers.LlamaConfig(**TINY)


def mistral():
    return transformers.MistralConfig(**TINY, sliding_window=8)


def gemma2():
    # layer 0 slides (window 8), layer 1 is global; both soft-cap their scores
    return transformers.Gemma2Config(**TINY, sliding_window=8, attn_logit_softcapping=2.0, query_pre_attn_scalar=16)


def gpt_oss():
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    # every token takes every expert: a top-k choice could flip between the twins on rounding alone
    return transformers.GptOssConfig(**TINY, sliding_window=8, num_local_experts=2, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"])


MODELS = {"llama": llama, "mistral": pytest.param(mistral, marks=VARIANT_BACKWARD),
          "gemma2": pytest.param(gemma2, marks=VARIANT_BACKWARD),
          "gpt_oss": pytest.param(gpt_oss, marks=VARIANT_BACKWARD)}


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()


def twins(config, dtype=torch.float32, device=DEVICE):
    """The same randomly initialised causal LM twice: with eager attention and with attngen's."""
    torch.manual_seed(0)
    # (a model reads its config's attention implementation at each call: each twin needs its own config)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                                          dtype=dtype)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=NAME, dtype=dtype)
    ours.load_state_dict(eager.state_dict())
    assert (eager.config._attn_implementation, ours.config._attn_implementation) == ("eager", NAME)
    return eager.to(device), ours.to(device)


def run(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_close(eager, ours, ids, tolerance):
    """Logits and every parameter's gradient agree: |ours - eager| / |eager| (Frobenius norms) <= tolerance."""
    logits_e, grads_e = run(eager, ids)
    logits_o, grads_o = run(ours, ids)
    assert grads_o.keys() == grads_e.keys() and grads_e
    for name, got, expected in [("logits", logits_o, logits_e)] + [(n, grads_o[n], grads_e[n]) for n in grads_e]:
        error = ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
        assert error <= tolerance, (name, error)


@pytest.mark.parametrize("make", list(MODELS.values()), ids=list(MODELS))
def test_logits_and_gradients_match_eager(make):
    config = make()
    eager, ours = twins(config)
    # longer than the windows, not a multiple of a block
    ids = torch.randint(0, TINY["vocab_size"], (1, 21), device=DEVICE)
    # float32 both ways: the error is the sums' order (~1e-5 relative on a router bias's small gradient); a wrong
    # mask, cap or sink moves logits and gradients by 1e-2 and more
    assert_close(eager, ours, ids, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("make", list(MODELS.values()), ids=list(MODELS))
def test_logits_and_gradients_match_eager_at_real_sizes(make):
    config = make()
    config.sliding_window = 256 if getattr(config, "sliding_window", None) else None
    config.head_dim, config.num_attention_heads, config.num_key_value_heads = 64, 8, 2
    config.hidden_size = 512
    eager, ours = twins(config, torch.bfloat16, "cuda")
    exact = copy.deepcopy(eager).float()  # the same (bf16-rounded) weights, computed in float32: the reference
    ids = torch.randint(0, TINY["vocab_size"], (2, 1100), device="cuda")
    # bf16 rounds differently on each side (eager rounds the probabilities to bf16 before P @ V; a MoE router's
    # small bias gradients differ by a few percent between two bf16 runs): each of ours is held to the float32
    # model, within twice eager bf16's own error plus a floor, as the kernels' tests hold theirs to float64.
    logits_x, grads_x = run(exact, ids)
    logits_e, grads_e = run(eager, ids)
    logits_o, grads_o = run(ours, ids)
    assert grads_o.keys() == grads_e.keys() == grads_x.keys() and grads_x
    rel = lambda got, want: ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    for name in ["logits"] + list(grads_x):
        want = logits_x if name == "logits" else grads_x[name]
        got, eager_bf16 = (logits_o, logits_e) if name == "logits" else (grads_o[name], grads_e[name])
        assert rel(got, want) <= 2 * rel(eager_bf16, want) + 1e-2, (name, rel(got, want), rel(eager_bf16, want))


# Decoding a variant model runs attention_with_kvcache with its variant arguments (issue 48's decoding part).
VARIANT_DECODE = pytest.mark.skipif("window_size" not in inspect.signature(attention_with_kvcache).parameters,
                                    reason="needs attention_with_kvcache(window_size=, softcap=, sinks=)")
GENERATING = {"llama": llama, **{name: pytest.param(make.values[0], marks=make.marks + (VARIANT_DECODE,))
                                 for name, make in MODELS.items() if name != "llama"}}


@pytest.mark.parametrize("make", list(GENERATING.values()), ids=list(GENERATING))
def test_generation_matches_eager(make):
    eager, ours = twins(make())
    ids = torch.randint(0, TINY["vocab_size"], (1, 11), device=DEVICE)  # (the prompt outgrows the windows of 8)
    with torch.no_grad():
        expected = eager.generate(ids, max_new_tokens=4, do_sample=False)
        got = ours.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)


def test_padding_is_refused_with_a_clear_error():
    _, ours = twins(llama())
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        ours(input_ids=ids, attention_mask=mask)
    ours(input_ids=ids, attention_mask=torch.ones_like(ids))  # (all ones: no padding, the plain pattern)


def test_no_dense_mask_reaches_the_attention(monkeypatch):
    import attngen.integrations.transformers as integration

    seen = []
    real = integration.attention

    def spy(query, key, value, **kwargs):
        seen.append(kwargs)
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(integration, "attention", spy)
    _, ours = twins(llama())
    with torch.no_grad():
        ours(input_ids=torch.randint(0, TINY["vocab_size"], (1, 12), device=DEVICE))
    assert len(seen) == TINY["num_hidden_layers"]
    assert all(kw["is_causal"] and kw["enable_gqa"] for kw in seen)


def test_packed_sequences_are_refused():
    _, ours = twins(llama())
    ids = torch.randint(0, TINY["vocab_size"], (1, 10), device=DEVICE)
    # two sequences in one row
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]], device=DEVICE)
    with pytest.raises(ValueError, match="packed"):
        ours(input_ids=ids, position_ids=positions, use_cache=False)
