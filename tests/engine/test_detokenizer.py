"""The detokenizer's incremental decoding, with the offline byte-level BPE of the tiny models: split
multi-byte characters, special tokens, stop strings, several requests per step, and the batched
Rust decode against transformers' own `decode`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from baton.engine.detokenizer import Detokenizer
from baton.engine.io_struct import BatchTokenIDOut, FinishReason

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import save_tiny_tokenizer  # noqa: E402

TEXT = "héllo 🚀 wörld <|im_end|> done, naïve café 日本語 ok"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("detok-tokenizer")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


class PerCallTokenizer:
    """The tokenizer seen only through `decode` (as a slow tokenizer is): no batched Rust decode."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def _out(items: list[tuple[str, list[int], FinishReason | None, bool, list[str]]]) -> BatchTokenIDOut:
    """items: (rid, new ids, finish, skip_special_tokens, stop strings)."""
    n = len(items)
    return BatchTokenIDOut(
        rids=[i[0] for i in items], finished_reasons=[i[2] for i in items], new_token_ids=[i[1] for i in items],
        output_offsets=[0] * n, skip_special_tokens=[i[3] for i in items], spaces_between_special_tokens=[True] * n,
        stop_strs=[i[4] for i in items], no_stop_trim=[False] * n, meta=[(1, len(i[1]), 0) for i in items],
        output_token_logprobs=[None] * n, output_top_logprobs=[None] * n, input_token_logprobs=[None] * n,
        input_top_logprobs=[None] * n)


def _stream(detok: Detokenizer, ids: list[int], chunks: list[int], skip: bool = True, stops=(),
            finish: FinishReason | None = None) -> list[str]:
    """Feed `ids` in pieces of the given sizes; the last piece carries `finish` (length by default)."""
    deltas, pos = [], 0
    for k, size in enumerate(chunks):
        piece, pos = ids[pos:pos + size], pos + size
        last = k == len(chunks) - 1
        reason = (finish or FinishReason("length")) if last else None
        deltas.append(detok.handle(_out([("r", piece, reason, skip, list(stops))])).texts[0])
    assert pos == len(ids)
    return deltas


@pytest.mark.parametrize("batched", [True, False], ids=["rust-batch", "per-call"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_streamed_deltas_add_up_to_the_full_decode(tokenizer, batched, skip):
    detok = Detokenizer(tokenizer if batched else PerCallTokenizer(tokenizer))
    assert (detok._batch_decode is not None) == batched
    ids = tokenizer.encode(TEXT)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in full) == (not skip)
    for chunks in ([1] * len(ids), [3, 1, 4, 1, 5, len(ids) - 14], [len(ids)]):
        deltas = _stream(detok, ids, chunks, skip=skip)
        assert "".join(deltas) == full
        # mid-stream a split multi-byte character is held back, never sent as a replacement char
        assert not any("\ufffd" in d for d in deltas)
    # one token at a time, each step sends everything decodable so far: streaming, not one final blob
    deltas = _stream(detok, ids, [1] * len(ids), skip=skip)
    for k in range(len(ids)):
        so_far = tokenizer.decode(ids[:k + 1], skip_special_tokens=skip)
        if not so_far.endswith("\ufffd"):
            assert "".join(deltas[:k + 1]) == so_far, f"after token {k}"
    assert detok.states == {}  # finished requests leave no state behind


def test_split_emoji_arrives_whole(tokenizer):
    ids = tokenizer.encode("a 🚀 b")
    assert sum(tokenizer.decode([i]) == "\ufffd" for i in ids) >= 2  # the rocket spans several byte tokens
    deltas = _stream(Detokenizer(tokenizer), ids, [1] * len(ids))
    assert any("🚀" in d for d in deltas)
    assert "".join(deltas) == "a 🚀 b"


def test_stop_string_is_held_back_and_trimmed(tokenizer):
    """While streaming, the characters that could start the stop string are held back, so no client
    ever sees a prefix of "wörld" that the final text trims."""
    ids = tokenizer.encode(TEXT)
    stop = "wörld"
    # the scheduler ends the request with the token that completes the stop string
    n = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
    ids = ids[:n]
    deltas = _stream(Detokenizer(tokenizer), ids, [1] * len(ids), stops=[stop],
                     finish=FinishReason("stop", matched=stop))
    text = "".join(deltas)
    assert text == TEXT[:TEXT.index(stop)]
    sent = ""
    for d in deltas[:-1]:
        sent += d
        assert "w" not in sent[len("héllo 🚀 "):]  # nothing of the stop string went out early


def test_many_requests_in_one_step_each_get_their_own_text(tokenizer):
    """One step carries requests with different flags and lengths; the batched decode must hand
    each its own windows back in order."""
    texts = ["first request ✓", "zweite Anfrage äöü <|im_end|>", "third 🚀🚀", "4"]
    encoded = [tokenizer.encode(t) for t in texts]
    skips = [True, False, True, False]
    detok = Detokenizer(tokenizer)
    sent = ["", "", "", ""]
    for step in range(max(map(len, encoded))):
        items = []
        for r, ids in enumerate(encoded):
            if step < len(ids):
                finish = FinishReason("length") if step == len(ids) - 1 else None
                items.append((f"r{r}", [ids[step]], finish, skips[r], []))
        out = detok.handle(_out(items))
        for rid, delta in zip(out.rids, out.texts):
            sent[int(rid[1:])] += delta
    assert sent == [tokenizer.decode(ids, skip_special_tokens=s) for ids, s in zip(encoded, skips)]
    assert detok.states == {}


def test_batch_decoder_is_not_used_when_transformers_would_clean_up(tokenizer, monkeypatch):
    """transformers' decode may post-process (clean_up_tokenization_spaces); then the detokenizer
    keeps calling it rather than the raw Rust decode."""
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert Detokenizer(tokenizer)._batch_decode is None


@pytest.mark.parametrize("skip", [True, False])
def test_a_matched_stop_token_is_not_part_of_the_text(tokenizer, skip):
    """As SGLang: the stop token that ended a request (EOS, or one of stop_token_ids, special or
    not) is trimmed from its text; with special tokens kept, EOS would otherwise show as <|eos|>."""
    for stop_text in ("<|eos|>", "!"):
        body = tokenizer.encode("héllo wörld", add_special_tokens=False)
        stop_id = tokenizer.encode(stop_text, add_special_tokens=False)
        assert len(stop_id) == 1, stop_id
        ids = body + stop_id
        deltas = _stream(Detokenizer(tokenizer), ids, [len(body), 1], skip=skip,
                         finish=FinishReason("stop", matched=stop_id[0]))
        assert "".join(deltas) == tokenizer.decode(body, skip_special_tokens=skip)
        kept = _stream(Detokenizer(tokenizer), ids, [len(ids)], skip=skip, finish=FinishReason("length"))
        assert "".join(kept) == tokenizer.decode(ids, skip_special_tokens=skip)  # ended by length: kept


def test_queued_messages_go_out_as_one(tokenizer):
    """What the process loop found queued: consecutive token batches (two DP ranks' steps, or two steps
    of one rank) leave as one BatchStrOut whose entries are those of handling each in turn, a request
    twice in order; any other message goes out as it came, between them."""
    from baton.engine.detokenizer import _outputs
    from baton.engine.io_struct import BatchStrOut

    ids = tokenizer.encode(TEXT)
    steps = [_out([("a", ids[0:3], None, True, []), ("b", ids[5:7], None, True, [])]),
             _out([("c", ids[2:4], None, True, [])]),
             _out([("a", ids[3:5], None, True, []), ("b", ids[7:9], FinishReason("length"), True, [])]),
             "abort-marker",
             _out([("a", ids[5:6], FinishReason("length"), True, [])])]
    reference = Detokenizer(tokenizer)
    one_by_one = [reference.handle(m) if isinstance(m, BatchTokenIDOut) else m for m in steps]
    merged = _outputs(Detokenizer(tokenizer), steps)
    assert [type(m) for m in merged] == [BatchStrOut, str, BatchStrOut] and merged[1] == "abort-marker"
    first = merged[0]
    assert first.rids == ["a", "b", "c", "a", "b"]
    assert first.texts == [t for m in one_by_one[:3] for t in m.texts]
    assert first.new_token_ids == [t for m in one_by_one[:3] for t in m.new_token_ids]
    assert first.finished_reasons[-1].kind == "length" and first.meta == [(1, 3, 0), (1, 2, 0), (1, 2, 0), (1, 2, 0),
                                                                          (1, 2, 0)]
    assert merged[2].texts == one_by_one[4].texts
    assert "".join(t for m in (first, merged[2]) for r, t in zip(m.rids, m.texts) if r == "a") == \
        tokenizer.decode(ids[0:6], skip_special_tokens=True)
