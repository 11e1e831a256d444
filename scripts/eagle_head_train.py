#!/usr/bin/env python3
"""An EAGLE draft head for a model served here (SmolLM2-135M-Instruct by default), trained on the
model's own greedy answers, for measuring EAGLE speculation where no published draft can be downloaded.

    .venv/bin/python scripts/eagle_head_train.py --model-path models/SmolLM2-135M-Instruct --out /tmp/smol-eagle
    .venv/bin/python scripts/spec_bench.py --model-path models/SmolLM2-135M-Instruct --concurrency 1,4 \\
        --spec-args "--speculative-algorithm EAGLE --speculative-draft-model-path /tmp/smol-eagle"

The head is the published EAGLE-3 architecture (or EAGLE-1 with --kind EAGLE; tests/engine/tiny_models.py
EagleReference: fc over three layers' states, one Llama layer, its own LM head over a draft vocabulary of
the answers' most frequent tokens), trained as EAGLE-3 heads are to predict token p + 2 from (the
embedding of token p + 1, the model's states at p), unrolled over the chain's steps so later drafts read
the head's own outputs (its "training-time test", without its attention over the unrolled steps'
keys), with the model frozen (the classification loss only). On a small model the LM head is a large
share of a step (SmolLM2: 49k x 576 of 135M parameters), which EAGLE-3's reduced vocabulary cuts. The data: the model's greedy answers to
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
    p.add_argument("--kind", choices=("EAGLE", "EAGLE3"), default="EAGLE3")
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="EAGLE3: the draft vocabulary's size; EAGLE: the token map's (token_map.pt)")
    p.add_argument("--unroll", type=int, default=3, help="chain steps trained (the head reading its own outputs)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def answers(model_path: str, tokenizer, n: int, input_len: int, gen_len: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy answer, prompt length) for n code-edit prompts (seeds 90000+: spec_bench draws
    with 1000 * round + concurrency), answered by the engine itself (bfloat16, as spec_bench serves)."""
    import asyncio

    import httpx

    from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
    from baton.engine.bench.workload import WorkloadConfig, build_workload

    prompts = build_workload(tokenizer, WorkloadConfig(num_prompts=n, input_len=input_len, output_len=gen_len,
                                                       seed=90000 + seed, dataset="code-edit"))
    port = free_port()
    with EngineProcess(engine_command(model_path, port, ["--dtype", "bfloat16"]), port) as engine:
        engine.wait_healthy(600, "waiting for the engine")

        async def run() -> list[dict]:
            async with httpx.AsyncClient(timeout=600) as client:
                async def one(p):
                    body = {"input_ids": list(p.token_ids), "sampling_params": {"max_new_tokens": gen_len, "temperature": 0}}
                    r = await client.post(f"{engine.base_url}/generate", json=body)
                    r.raise_for_status()
                    return r.json()
                return await asyncio.gather(*[one(p) for p in prompts])

        outs = asyncio.run(run())
    return [(list(p.token_ids) + o["output_ids"], len(p.token_ids)) for p, o in zip(prompts, outs)]


def main() -> int:
    from collections import Counter

    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args()
    torch.manual_seed(args.seed)
    clock = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    target = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval().requires_grad_(False)
    data = answers(args.model_path, tokenizer, args.prompts + 8, args.input_len, args.gen_len, args.seed)
    print(f"{len(data)} answers generated in {time.perf_counter() - clock:.0f} s", flush=True)
    n = target.config.num_hidden_layers
    aux_ids = (1, n // 2 - 1, n - 4)  # the outputs of these layers: SGLang's default inputs 2, N/2, N-3
    eagle3 = args.kind == "EAGLE3"
    if eagle3:
        head = EagleReference(target, "EAGLE3", args.draft_vocab, aux_ids, intermediate_size=target.config.intermediate_size)
    else:
        head = EagleReference(target, "EAGLE", intermediate_size=target.config.intermediate_size)
    head.randomize(0.02, args.seed)
    to_draft = None
    # the hot vocabulary: the answers' most frequent tokens, ids in order (EAGLE-3's d2t; for EAGLE a
    # --speculative-token-map file)
    counts = Counter(t for seq, plen in data[:args.prompts] for t in seq)
    hot = torch.tensor(sorted(t for t, _ in counts.most_common(args.draft_vocab)), dtype=torch.int64)
    hot = torch.cat([hot, torch.tensor(sorted(set(range(target.config.vocab_size)) - set(hot.tolist()))[
        :args.draft_vocab - len(hot)], dtype=torch.int64)]).sort().values
    if eagle3:
        head.d2t.copy_(hot - torch.arange(args.draft_vocab))
        to_draft = torch.full((target.config.vocab_size,), -100, dtype=torch.int64)
        to_draft[hot] = torch.arange(args.draft_vocab)
    feats = []
    with torch.no_grad():
        for seq, plen in data:
            out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            f = (torch.cat([out.hidden_states[i + 1][0] for i in aux_ids], dim=-1) if eagle3
                 else out.last_hidden_state[0])
            feats.append((torch.tensor(seq), f, plen))
    train, held = feats[:args.prompts], feats[args.prompts:]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    rng = random.Random(args.seed)

    def losses(seq, f, plen):
        """Over the answer's positions (from the prompt's last), each chain step k: the head at p reads
        t[p+1] and (k = 0) the model's features at p or (k > 0) its own step k - 1 output at p - 1, as a
        chain's later drafts do, and predicts t[p+2]. Returns (loss summed over steps, top-1 per step)."""
        ids, labels = seq[1:-1], seq[2:]
        start = max(plen - 2, 0)
        if eagle3:
            labels = to_draft[labels]
        states = head.fc(f[:-2]) if eagle3 else f[:-2]
        total, hits, prev = 0.0, [], None
        for k in range(args.unroll):
            st = states if prev is None else torch.cat([states[:1], prev[:-1]])
            out = head._run(ids[None], st[None])[0]
            logits = head.lm_head(head.norm(out[start:])) if eagle3 else target.lm_head(out[start:])
            total = total + torch.nn.functional.cross_entropy(logits, labels[start:], ignore_index=-100)
            hits.append(float((logits.argmax(-1) == labels[start:]).float().mean()))
            prev = out
        return total, hits

    for step in range(args.steps):
        loss = sum(losses(*rng.choice(train))[0] for _ in range(args.batch)) / args.batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad():
                acc = [sum(x) / len(held) for x in zip(*(losses(*f)[1] for f in held))]
            print(f"step {step}: loss {float(loss.detach()):.3f}, held-out top-1 per chain step "
                  f"{' '.join(f'{a:.3f}' for a in acc)} ({time.perf_counter() - clock:.0f} s)", flush=True)
    head.save(args.out)
    if not eagle3:
        torch.save(hot, os.path.join(args.out, "token_map.pt"))
    print(f"saved {args.out}" + ("" if eagle3 else f" (and token_map.pt: {args.draft_vocab} tokens)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
