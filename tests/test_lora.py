"""Parameter-efficient fine-tuning through the front door: a frozen (random-init) transformers GPT-2 with peft LoRA
adapters on its HF ``Conv1D`` layers. Per-example work is on the adapters only (frozen layers record nothing), and
the released noiseless sum equals the per-example gradients of the adapters, clipped and summed, from torch.func in
float64."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from fastdp import PrivacyEngine
from fastdp.ops.summation import clip_bound

B, T, V, CLIP = 6, 12, 50, 0.05


def _lora_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=T, tie_word_embeddings=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: fan_in_fan_out set for Conv1D targets, as it should be
        model = get_peft_model(
            GPT2LMHeadModel(config),
            LoraConfig(r=4, target_modules=["c_attn", "c_proj"], lora_dropout=0.0, init_lora_weights=False),
        )
    return model.double()


def _per_example_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    per_token = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return per_token.mean(1)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand(ids.shape[0], ids.shape[1])


def test_lora_gpt2_releases_the_clipped_sum_of_the_adapters_per_example_gradients():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    reference = _lora_gpt2()
    trainable = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in reference.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    def loss(params, x):
        out = functional_call(reference, {**frozen, **params}, (x.unsqueeze(0),), {"position_ids": _positions(x[None])})
        return _per_example_losses(out.logits, x.unsqueeze(0))[0]

    per_example = vmap(grad(loss), in_dims=(None, 0))(trainable, ids)
    norms = torch.sqrt(sum(g.reshape(B, -1).pow(2).sum(1) for g in per_example.values()))
    factors = (clip_bound(CLIP, B * 10) / (norms + 1e-6)).clamp(max=1.0)  # C' = C / (1 + s): fastdp.ops.summation
    expected = {n: (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) / B for n, g in per_example.items()}

    model = _lora_gpt2()
    params = [p for p in model.parameters() if p.requires_grad]
    engine = PrivacyEngine(accountant="rdp")
    loader = DataLoader(TensorDataset(torch.zeros(B * 10, T, dtype=torch.long)), batch_size=B)
    private, optimizer, criterion, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(params, lr=0.0),
                                                           data_loader=loader, noise_multiplier=0.0,
                                                           max_grad_norm=CLIP, allow_large_delta=True,
                                                           criterion=_per_example_losses,
                                                           grad_sample_mode="ghost")  # fmt: skip
    optimizer.zero_grad()
    criterion(private(input_ids=ids, position_ids=_positions(ids)).logits, ids).backward()  # the batch's mean loss
    optimizer.step()
    assert factors.max() < 1  # every example clipped: the comparison checks the norms, not only the sum
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-13, msg=name)
        else:
            assert p.grad is None  # frozen: nothing formed, nothing released


@pytest.mark.parametrize("variant", ["dpsgd", "jl"])
def test_frozen_layers_record_nothing(variant):
    """Only the adapters' DP layers are recorded in the forward: the frozen base layers add no per-example work."""
    from fastdp.nn import GhostClipping

    model = _lora_gpt2().float()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(torch.zeros(60, T, dtype=torch.long)), batch_size=B)
    engine = PrivacyEngine(accountant="pld" if variant == "jl" else "rdp")
    engine.make_private(module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad]),
                        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, variant=variant)  # fmt: skip
    with GhostClipping() as ctx:
        model(input_ids=ids, position_ids=_positions(ids))
    owners = {id(p) for r in ctx.records for p in r.layer.dp_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == owners & {id(p) for p in model.parameters()}
    assert all(any(p.requires_grad for p in r.layer.dp_parameters()) for r in ctx.records)
