#!/usr/bin/env python3
"""An EAGLE draft head for a model served here (SmolLM2-135M-Instruct by default), trained on the
model's own greedy answers, for measuring EAGLE speculation where no published draft can be downloaded.

    .venv/bin/python scripts/eagle_head_train.py --model-path models/SmolLM2-135M-Instruct --out /tmp/smol-eagle
    .venv/bin/python scripts/spec_bench.py --model-path models/SmolLM2-135M-Instruct --concurrency 1,4 \\
        --spec-args "--speculative-algorithm EAGLE --speculative-draft-model-path /tmp/smol-eagle"

The head is the published EAGLE-1 architecture (tests/engine/tiny_models.py EagleReference: fc over
[embedding ; final hidden state], one Llama layer, the model's LM head), trained as EAGLE heads are to
predict token p + 2 from (the embedding of token p + 1, the model's final hidden state at p), with the
model frozen (the EAGLE authors' classification loss only). The data: the model's greedy answers to
code-edit prompts (engine/bench/edit_workload.py, what spec_bench measures) drawn with seeds spec_bench
never uses, so the benchmark's prompts are held out. It prints the held-out top-1 accuracy of the first
draft (its acceptance under greedy) and saves the head in the published layout (pytorch_model.bin).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "engine"))
from tiny_models import EagleReference  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=40, help="training answers (8 more held out)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="answers per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def answers(model, tokenizer, n: int, input_len: int, gen_len: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer, prompt length) for n code-edit prompts (seeds 90000+: spec_bench draws
    with 1000 * round + concurrency)."""
    from baton.engine.bench.workload import WorkloadConfig, build_workload

    prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=n, input_len=input_len, output_len=gen_len,
                                                       seed=90000 + seed, dataset="code-edit"))
    out = []
    for p in prompts:
        ids = torch.tensor([list(p.token_ids)])
        gen = model.generate(ids, max_new_tokens=gen_len, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        out.append((gen[0].tolist(), ids.shape[1]))
    return out


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args()
    torch.manual_seed(args.seed)
    clock = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    target = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval().requires_grad_(False)
    data = answers(target, tokenizer, args.prompts + 8, args.input_len, args.gen_len, args.seed)
    print(f"{len(data)} answers generated in {time.perf_counter() - clock:.0f} s", flush=True)
    feats = []
    with torch.no_grad():
        for seq, plen in data:
            hidden = target.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            feats.append((torch.tensor(seq), hidden, plen))
    train, held = feats[:args.prompts], feats[args.prompts:]
    head = EagleReference(target, "EAGLE", intermediate_size=target.config.intermediate_size)
    head.randomize(0.02, args.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    rng = random.Random(args.seed)

    def loss_and_hits(seq, hidden, plen):
        """Over the answer's positions (from the prompt's last): the head at p predicts token p + 2."""
        out = head._run(seq[1:-1][None], hidden[:-2][None])[0]  # position p: (t[p+1], h[p]) -> t[p+2]
        start = max(plen - 2, 0)
        logits = target.lm_head(out[start:])
        labels = seq[start + 2:]
        return torch.nn.functional.cross_entropy(logits, labels), (logits.argmax(-1) == labels).float().mean()

    for step in range(args.steps):
        loss = sum(loss_and_hits(*rng.choice(train))[0] for _ in range(args.batch)) / args.batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                acc = sum(float(loss_and_hits(*f)[1]) for f in held) / len(held)
            print(f"step {step}: loss {float(loss):.3f}, held-out top-1 {acc:.3f} "
                  f"({time.perf_counter() - clock:.0f} s)", flush=True)
    head.save(args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
