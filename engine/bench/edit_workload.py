"""A workload that rewards lookup (speculative NGRAM): "rewrite this code with one change" prompts.

Each prompt holds a small Python module built from templates (random names and constants, so no two
prompts share more than the instruction) and asks for it back with one identifier renamed; the
prompt (in the model's chat template, as a user turn) ends where the rewritten code starts, so a
model answers by copying the module, changing the name as it goes: the shape of code-editing traffic,
where most output tokens are already in the prompt. The text goes to `/v1/completions` as it is.
"""
from __future__ import annotations

import random

_WORDS = ("alpha", "beta", "count", "total", "buffer", "record", "index", "window", "weight", "cache", "score",
          "limit", "offset", "label", "value", "item", "batch", "token", "node", "queue", "price", "level")

_TEMPLATES = (
    '''def {f}({a}, {b}={n}):
    """Return the {a} scaled by {b}, clipped to {m}."""
    result = {a} * {b}
    if result > {m}:
        result = {m}
    return result
''',
    '''def {f}(items):
    """Sum the {a} of every item whose {b} is at least {n}."""
    {c} = 0
    for item in items:
        if item["{b}"] >= {n}:
            {c} += item["{a}"]
    return {c}
''',
    '''class {F}:
    """Keeps the last {n} {a} values and their running {b}."""

    def __init__(self):
        self.{a}s = []
        self.{b} = 0

    def add(self, {a}):
        self.{a}s.append({a})
        self.{b} += {a}
        if len(self.{a}s) > {n}:
            self.{b} -= self.{a}s.pop(0)
        return self.{b}
''',
    '''def {f}(text, {a}={n}):
    """Split the text into chunks of at most {a} words."""
    words = text.split()
    {c} = []
    for start in range(0, len(words), {a}):
        {c}.append(" ".join(words[start:start + {a}]))
    return {c}
''',
    '''def {f}({a}, {b}):
    """Merge two sorted lists of {c} into one sorted list."""
    out = []
    i = j = 0
    while i < len({a}) and j < len({b}):
        if {a}[i] <= {b}[j]:
            out.append({a}[i])
            i += 1
        else:
            out.append({b}[j])
            j += 1
    return out + {a}[i:] + {b}[j:]
''',
)


def _module(rng: random.Random, num_functions: int) -> tuple[str, str]:
    """(source, the name of a function or class in it)."""
    parts, names = [], []
    for _ in range(num_functions):
        a, b, c = rng.sample(_WORDS, 3)
        f = f"{rng.choice(('get', 'compute', 'update', 'build', 'find'))}_{a}_{c}"
        template, cls = rng.choice(_TEMPLATES), f.title().replace("_", "")
        names.append(cls if template.startswith("class") else f)
        parts.append(template.format(f=f, F=cls, a=a, b=b, c=c, n=rng.randint(2, 99), m=rng.randint(100, 999)))
    return "\n\n".join(parts), rng.choice(names)


def _as_chat(tokenizer, request: str) -> str:
    """The request as the model's chat template puts a user turn, up to where the answer starts (an
    instruct model follows an instruction there); the plain request where the tokenizer has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        return request + "\n\n"
    return tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False,
                                         add_generation_prompt=True)


def build_edit_prompts(tokenizer, num_prompts: int, input_len: int, seed: int) -> list[tuple[str, list[int]]]:
    """`num_prompts` code-edit prompts (text, token ids) of about `input_len` tokens (whole functions:
    the length is approximate); workload.build_workload makes them BenchPrompts."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        functions, seed = 1, rng.random()
        while True:  # one function more until the prompt is long enough
            source, name = _module(random.Random(seed), functions)
            text = _as_chat(tokenizer, f"Copy this Python module exactly, renaming only {name} to {name}_v2."
                                       f"\n\n```python\n{source}```") + "```python\n"
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= input_len or functions >= 32:
                break
            functions += 1
        prompts.append((text, ids))
    return prompts
