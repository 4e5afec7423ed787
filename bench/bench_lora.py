"""DP fine-tuning with LoRA: a frozen (random-init) transformers GPT-2 with peft LoRA adapters (r = 8 on the
attention and projection ``Conv1D`` layers), one step through ``fastdp.PrivacyEngine`` (DP-SGD on the adapters,
per-example work on the adapters only) beside the same non-private LoRA step, interleaved, medians
(``harness.compare``). The issue's question: what does DP cost over the LoRA step itself?

    python bench/bench_lora.py                        # GPT-2 2 x 128 (vocabulary 1000), B 32, T 128
    python bench/bench_lora.py --layers 12 --width 768 --vocab 50257 --batch 8 --seq 512   # GPT-2 124M-shaped

Results go to bench/results/<device>-lora.csv.
"""

from __future__ import annotations

import argparse
import warnings

import harness
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastdp import PrivacyEngine


def lora_gpt2(layers: int, width: int, vocab: int, seq: int, rank: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab, n_positions=seq,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=rank, target_modules=["c_attn", "c_proj"]))


def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token loss (a per-example loss)."""
    per_token = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return per_token.mean(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    info = harness.run_info(device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)

    def nonprivate():
        torch.manual_seed(0)
        model = lora_gpt2(args.layers, args.width, args.vocab, args.seq, args.rank).to(device)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)

        def step():
            optimizer.zero_grad(set_to_none=True)
            token_losses(model(input_ids=ids).logits, ids).mean().backward()
            optimizer.step()

        return step

    def private():
        torch.manual_seed(0)
        model = lora_gpt2(args.layers, args.width, args.vocab, args.seq, args.rank).to(device)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        loader = DataLoader(TensorDataset(torch.zeros(100 * args.batch, 1)), batch_size=args.batch)
        model, optimizer, criterion, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            criterion=token_losses, grad_sample_mode="ghost",
        )  # fmt: skip

        def step():
            optimizer.zero_grad(set_to_none=True)
            criterion(model(input_ids=ids).logits, ids).backward()  # the batch's mean loss (fastdp.engine.DPLoss)
            optimizer.step()

        return step

    results = harness.compare({"nonprivate-lora": nonprivate, "fastdp-lora": private}, device, args.repeats)
    base = results["nonprivate-lora"][0]
    rows = []
    for name, (median, p20, p80, peak) in results.items():
        print(f"{name:16s} {median:9.2f} ms ({p20:.2f}, {p80:.2f})  x {median / base:.2f} non-private LoRA")
        rows.append(dict(workload=f"gpt2-lora-L{args.layers}-D{args.width}-V{args.vocab}-B{args.batch}-T{args.seq}",
                         provider=name, rank=args.rank, median_ms=round(median, 3), p20_ms=round(p20, 3),
                         p80_ms=round(p80, 3), ratio=round(median / base, 3), peak_mb=peak, **info))  # fmt: skip
    harness.write_rows(rows, None, f"{harness.device_name(device)}-lora")


if __name__ == "__main__":
    main()
