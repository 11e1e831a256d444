#!/usr/bin/env python3
"""A Qwen3.5-shaped random hybrid checkpoint whose MTP head (`mtp.*`) is trained on the model's own
greedy text, for measuring NEXTN speculation where no real checkpoint can be downloaded.

    .venv/bin/python scripts/mtp_head_train.py --out /tmp/mtp-bench
    .venv/bin/python scripts/spec_bench.py --model-path /tmp/mtp-bench --dtype float32 \\
        --spec-args "--speculative-algorithm NEXTN" --concurrency 1,4 --rounds 2

The target is random (tests/engine/tiny_models.py, the hybrids' small initializer range, whose greedy
text falls into loops, as an n-gram-friendly workload does); the head is trained as EAGLE/MTP heads are,
to predict token p + 2 from (the embedding of token p + 1, the target's final hidden state at p), on
continuations the target itself generated from random prompts, with the target's embedding and LM head
frozen. It prints the head's held-out top-1 accuracy (the first draft's acceptance under greedy).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "engine"))
from tiny_models import MtpReference, make_tiny_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="three linear-attention layers per full one")
    p.add_argument("--sequences", type=int, default=48, help="training continuations (8 more held out)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=160)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    h = args.hidden
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    path = make_tiny_model("qwen3_5", args.out, seed=args.seed, mtp=True, hidden_size=h, intermediate_size=3 * h,
                           num_hidden_layers=args.layers, layer_types=types, num_attention_heads=h // 32,
                           num_key_value_heads=2, head_dim=32, linear_num_key_heads=h // 64,
                           linear_num_value_heads=h // 32, linear_key_head_dim=32, linear_value_head_dim=32,
                           max_position_embeddings=4096, initializer_range=0.02)
    head = MtpReference.load(path)
    model = head._model[0]
    gen = torch.Generator().manual_seed(args.seed)
    n = args.sequences + 8
    prompts = torch.randint(6, model.config.vocab_size, (n, args.prompt_len), generator=gen)
    t0 = time.perf_counter()
    with torch.no_grad():
        seqs = torch.cat([model.generate(prompts[i:i + 8], max_new_tokens=args.gen_len, do_sample=False,
                                         min_new_tokens=args.gen_len, pad_token_id=0)
                          for i in range(0, n, 8)])  # [n, prompt + gen]
        hidden = torch.cat([model.model(input_ids=seqs[i:i + 8]).last_hidden_state for i in range(0, n, 8)])
    print(f"generated {n} x {seqs.shape[1]} tokens in {time.perf_counter() - t0:.0f} s")
    # position p: (token p + 1, hidden p) -> token p + 2
    ids, states, targets = seqs[:, 1:-1], hidden[:, :-2], seqs[:, 2:]
    train, held = slice(0, args.sequences), slice(args.sequences, n)
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for name, p in head.named_parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    head.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = torch.randint(0, args.sequences, (8,), generator=gen)
        logits = model.lm_head(head._run(ids[train][batch], states[train][batch]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[train][batch].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    head.eval()
    with torch.no_grad():
        guess = model.lm_head(head._run(ids[held], states[held])).argmax(-1)
        gen_part = slice(args.prompt_len, None)  # what the engine drafts for: generated text
        acc = (guess[:, gen_part] == targets[held][:, gen_part]).float().mean().item()
    print(f"held-out top-1 accuracy of the head on generated text: {acc:.3f}")
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update({f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, file, metadata={"format": "pt"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
