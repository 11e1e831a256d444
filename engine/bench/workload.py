"""The benchmark workload: deterministic random-token prompts of a given token length.

Prompts are sent as text (OpenAI `/v1/completions`), so each is built from random token ids,
decoded, and re-encoded until the text tokenizes back to about `input_len` tokens (decoding random
ids and encoding the text again merges or splits some tokens; a few rounds settle it).

With `shared_prefix_len` P every prompt starts with the same P-token text. The server tokenizes the
whole prompt, so a merge across the prefix/suffix seam can change the last prefix token or two; the
radix cache still matches everything before that.

With `images_per_request` N > 0 each prompt also carries N pictures (image_workload.py) and goes to
`/v1/chat/completions` as one user message: the prompt's text, then its image parts. Text first, so
the prefix cache cannot cover a picture (every prompt's text differs at its start) and a request's
encoder work is saved only by the vision embeddings' cache.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass

from baton.engine.bench.image_workload import IMAGE_REUSE, image_urls, parse_image_size

_SETTLE_ROUNDS = 8
DATASETS = ("random", "code-edit")


@dataclass(frozen=True)
class WorkloadConfig:
    num_prompts: int
    input_len: int
    output_len: int
    shared_prefix_len: int = 0
    seed: int = 0
    # SGLang bench_serving semantics: each prompt's input and output lengths are drawn uniformly
    # from [max(1, ratio * len), len]; 1.0 makes every request the same length, 0.0 (SGLang's
    # default) draws from [1, len].
    random_range_ratio: float = 1.0
    # how every request samples, engines and HF alike: 0 is greedy
    temperature: float = 0.0
    top_p: float = 1.0
    # random: random-token text (below); code-edit: "rename a function in this module" prompts whose
    # answers copy the prompt (edit_workload.py; what speculative NGRAM decoding is for)
    dataset: str = "random"
    # pictures per request (0: a text workload), their (width, height), and whether every request
    # sends the same ones ("shared") or its own ("distinct"); image_workload.py
    images_per_request: int = 0
    image_size: tuple[int, int] = (448, 448)
    image_reuse: str = "shared"

    def __post_init__(self) -> None:
        assert self.dataset in DATASETS, f"--dataset must be one of {DATASETS}"
        assert self.num_prompts >= 1 and self.input_len >= 1 and self.output_len >= 1
        assert 0.0 <= self.random_range_ratio <= 1.0, "--random-range-ratio must be in [0, 1]"
        assert self.temperature >= 0.0 and 0.0 < self.top_p <= 1.0, "--temperature >= 0, --top-p in (0, 1]"
        assert 0 <= self.shared_prefix_len < self.input_len, "--shared-prefix-len must be < --input-len"
        assert self.images_per_request >= 0, "--images-per-request must be >= 0"
        assert self.image_reuse in IMAGE_REUSE, f"--image-reuse must be one of {IMAGE_REUSE}"
        assert min(self.image_size) >= 1, "--image-size must be at least 1x1"


@dataclass(frozen=True)
class BenchPrompt:
    text: str
    token_ids: tuple[int, ...]  # the text encoded without special tokens
    output_len: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    images: tuple[str, ...] = ()  # data URLs; a prompt with images is sent as a chat completion


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--num-prompts", type=int, default=32)
    a("--input-len", type=int, default=128, help="prompt length in tokens (approximate, see workload.py)")
    a("--output-len", type=int, default=64, help="tokens generated per request (EOS ignored)")
    a("--shared-prefix-len", type=int, default=0, help="tokens every prompt shares at its start")
    a("--seed", type=int, default=0)
    a("--random-range-ratio", type=float, default=1.0,
      help="draw each prompt's input/output length uniformly from [ratio*len, len] (SGLang bench_serving)")
    a("--temperature", type=float, default=0.0, help="sampling temperature of every request (0: greedy)")
    a("--top-p", type=float, default=1.0, help="top-p of every request (with --temperature)")
    a("--dataset", default="random", choices=DATASETS,
      help="random: random-token prompts; code-edit: 'rename a function in this module' prompts, answered by "
           "copying the prompt (rewards speculative NGRAM decoding)")
    a("--images-per-request", type=int, default=0,
      help="random RGB PNGs sent with every request as data: URLs in chat completions image_url parts (after "
           "the prompt's text); 0: the text workload on /v1/completions")
    a("--image-size", type=parse_image_size, default=(448, 448), metavar="WxH", help="each picture's size (448x448)")
    a("--image-reuse", default="shared", choices=IMAGE_REUSE,
      help="shared: every request sends the same picture(s), so the vision embeddings' cache hits; distinct: a "
           "different picture per request (and per round)")


def workload_config_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                          shared_prefix_len=args.shared_prefix_len, seed=args.seed,
                          random_range_ratio=args.random_range_ratio, temperature=args.temperature, top_p=args.top_p,
                          dataset=args.dataset, images_per_request=args.images_per_request,
                          image_size=tuple(args.image_size), image_reuse=args.image_reuse)


def build_workload(tokenizer, config: WorkloadConfig) -> list[BenchPrompt]:
    """`config.num_prompts` prompts; the same seed and tokenizer give the same prompts (and pictures)."""
    prompts = _text_prompts(tokenizer, config)
    if not config.images_per_request:
        return prompts
    urls = image_urls(config.num_prompts, config.images_per_request, config.image_size, config.image_reuse,
                      config.seed)
    return [dataclasses.replace(p, images=u) for p, u in zip(prompts, urls)]


def _text_prompts(tokenizer, config: WorkloadConfig) -> list[BenchPrompt]:
    if config.dataset == "code-edit":
        from baton.engine.bench.edit_workload import build_edit_prompts

        return [BenchPrompt(text=text, token_ids=tuple(ids), output_len=config.output_len,
                            temperature=config.temperature, top_p=config.top_p)
                for text, ids in build_edit_prompts(tokenizer, config.num_prompts, config.input_len, config.seed)]
    rng = random.Random(config.seed)
    candidates = _plain_token_ids(tokenizer)
    prefix = _settled_text(tokenizer, rng, candidates, config.shared_prefix_len)
    prompts = []
    lens = random.Random(config.seed + 1)  # lengths drawn apart from token choices
    for _ in range(config.num_prompts):
        in_len = _draw(lens, config.input_len, config.random_range_ratio)
        out_len = _draw(lens, config.output_len, config.random_range_ratio)
        suffix = max(in_len - config.shared_prefix_len, 1)
        text = prefix + _settled_text(tokenizer, rng, candidates, suffix)
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        prompts.append(BenchPrompt(text=text, token_ids=ids, output_len=out_len, temperature=config.temperature,
                                   top_p=config.top_p))
    return prompts


def _draw(rng: random.Random, length: int, ratio: float) -> int:
    return length if ratio >= 1.0 else rng.randint(max(1, int(length * ratio)), length)


def _plain_token_ids(tokenizer) -> list[int]:
    """Ids to sample from: every id but special and added tokens (a random `<|im_end|>` in the
    middle of a prompt would make the prompt mean something else to a chat model)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = [i for i in range(len(tokenizer)) if i not in special]
    assert ids, "the tokenizer has no plain tokens"
    return ids


def _settled_text(tokenizer, rng: random.Random, candidates: list[int], length: int) -> str:
    """Text that encodes back to about `length` tokens."""
    if length <= 0:
        return ""
    ids = [rng.choice(candidates) for _ in range(length)]
    text = tokenizer.decode(ids)
    for _ in range(_SETTLE_ROUNDS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + [rng.choice(candidates) for _ in range(length - len(ids))]
        text = tokenizer.decode(ids)
    return text
