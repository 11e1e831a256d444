"""The detokenizer process: token ids -> text increments, per request, incrementally.

Incremental decoding keeps two offsets per request (as vLLM and SGLang do): text is emitted only
once the tokens after `prefix_offset` decode to something longer than before and do not end in a
partial UTF-8 character. With stop strings, the last (longest stop - 1) characters are held back
while streaming so a client never sees the beginning of a stop string that is later trimmed.

Each step's windows are decoded in one call to the Rust tokenizer (`decode_batch`, as SGLang batches
its detokenization) whenever that gives exactly what transformers' `decode` gives: a fast tokenizer
whose decode applies no Python clean-up. Measured on the benchmark's and the demo's tokenizers:
`handle` for 32 requests x 64 one-token steps takes 17-20 ms instead of 39-40 ms.

The process takes every message already queued when it wakes (each DP rank sends one per step) and
sends the texts of consecutive token batches as one message: under load the HTTP server then
receives, wakes and writes less often (a request's two queued steps leave as one SSE chunk, as its
queue merges them anyway). Measured with two DP ranks, 32 x 256 tokens: the HTTP server's CPU per
token 30-33 -> 17-21 us, 9.1-10.5k -> 12.2-12.5k tok/s (docs/benchmarks.md, 2026-11-26).
"""
from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

import zmq

from baton.engine.io_struct import BatchStrOut, BatchTokenIDOut

logger = logging.getLogger(__name__)

# decode this many tokens before the read offset again, so merges across the boundary are seen
_PREFIX_WINDOW = 5


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent: int = 0  # characters of `text` already sent


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}
        self._batch_decode = _rust_batch_decoder(tokenizer)

    def _decode_all(self, jobs: list[tuple[list[int], bool, bool]]) -> list[str]:
        """Texts of (ids, skip_special_tokens, spaces_between_special_tokens) windows, in order."""
        if self._batch_decode is None:
            return [self.tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                    for ids, skip, spaces in jobs]
        texts: list[str] = [""] * len(jobs)
        for skip in (False, True):  # fast tokenizers ignore spaces_between_special_tokens
            idx = [j for j, job in enumerate(jobs) if job[1] == skip]
            if idx:
                for j, text in zip(idx, self._batch_decode([jobs[j][0] for j in idx], skip_special_tokens=skip)):
                    texts[j] = text
        return texts

    def handle(self, out: BatchTokenIDOut) -> BatchStrOut:
        # one pass to collect every window to decode, one batched decode, one pass to apply it
        states, jobs = [], []
        for i, rid in enumerate(out.rids):
            st = self.states.setdefault(rid, DecodeState())
            st.ids.extend(out.new_token_ids[i])
            states.append(st)
            flags = (out.skip_special_tokens[i], out.spaces_between_special_tokens[i])
            finished = out.finished_reasons[i]
            if finished is not None:  # exact, whatever the offsets held back; without the stop token
                trim = (finished.kind == "stop" and isinstance(finished.matched, int) and not out.no_stop_trim[i]
                        and st.ids[-1:] == [finished.matched])  # as SGLang: its text is not part of the answer
                jobs.append((st.ids[:-1] if trim else st.ids, *flags))
            else:
                jobs.append((st.ids[st.prefix_offset:st.read_offset], *flags))
                jobs.append((st.ids[st.prefix_offset:], *flags))
        decoded = iter(self._decode_all(jobs))
        texts = []
        for i, rid in enumerate(out.rids):
            st, finished, stops = states[i], out.finished_reasons[i], out.stop_strs[i]
            if finished is not None:
                st.text = next(decoded)
                if finished.kind == "stop" and isinstance(finished.matched, str) and not out.no_stop_trim[i]:
                    cut = st.text.find(finished.matched)
                    st.text = st.text[:cut] if cut >= 0 else st.text
                end = len(st.text)
            else:
                prefix, full = next(decoded), next(decoded)
                if len(full) > len(prefix) and not full.endswith("\ufffd"):
                    st.text += full[len(prefix):]
                    st.prefix_offset = max(len(st.ids) - _PREFIX_WINDOW, st.read_offset)
                    st.read_offset = len(st.ids)
                end = len(st.text) - (max(map(len, stops)) - 1 if stops else 0)
            end = max(end, st.sent)
            texts.append(st.text[st.sent:end])
            st.sent = end
            if finished is not None:
                del self.states[rid]
        return BatchStrOut(out.rids, texts, out.finished_reasons, out.new_token_ids, out.meta,
                           out.output_token_logprobs, out.output_top_logprobs, out.input_token_logprobs,
                           out.input_top_logprobs, out.embeddings or [None] * len(out.rids))


def _rust_batch_decoder(tokenizer: Any) -> Optional[Callable[..., list[str]]]:
    """`tokenizers.Tokenizer.decode_batch` when transformers' `decode` is exactly the Rust decode for
    this tokenizer (a fast tokenizer, no clean-up of tokenization spaces); None otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend.decode_batch


def run_detokenizer_process(tokenizer_path: str, recv_addr: str, send_addr: str, log_level: str,
                            ready_pipe: Any, cpu_plan: Any = None) -> None:
    from transformers import AutoTokenizer

    from baton.engine.utils.cpu_affinity import bind_frontend
    from baton.engine.utils.gc_freeze import freeze_gc
    from baton.engine.utils.logging import configure_logging
    from baton.engine.utils.process import die_with_parent

    die_with_parent()
    bind_frontend(cpu_plan)
    configure_logging(log_level, prefix="detokenizer")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        detok = Detokenizer(AutoTokenizer.from_pretrained(tokenizer_path))
        ctx = zmq.Context(1)
        recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        recv.bind(recv_addr)
        send.connect(send_addr)
    except Exception:
        ready_pipe.send(("error", traceback.format_exc()))
        return
    freeze_gc("detokenizer")
    ready_pipe.send(("ready", None))
    while True:
        msgs = [recv.recv_pyobj()]
        while len(msgs) < _MAX_MERGED:  # what else is queued (each DP rank sends a message per step)
            try:
                msgs.append(recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                break
        for out in _outputs(detok, msgs):
            try:
                send.send_pyobj(out)
            except Exception:  # one bad message must not take the server down
                logger.error("detokenizer failed to send a message:\n%s", traceback.format_exc())


# at most this many queued messages are handled at once
_MAX_MERGED = 8


def _outputs(detok: Detokenizer, msgs: list[Any]) -> list[Any]:
    """The messages to send for `msgs`, in order: the texts of consecutive token batches as one
    BatchStrOut (one message, not one per DP rank and step, for the HTTP server to receive; a request
    may appear in it more than once, in order), anything else as it came."""
    outs: list[Any] = []
    for msg in msgs:
        try:
            out = detok.handle(msg) if isinstance(msg, BatchTokenIDOut) else msg
        except Exception:  # one bad message must not take the server down
            logger.error("detokenizer failed on a message:\n%s", traceback.format_exc())
            continue
        if isinstance(out, BatchStrOut) and outs and isinstance(outs[-1], BatchStrOut):
            outs[-1] = _concat(outs[-1], out)
        else:
            outs.append(out)
    return outs


def _concat(a: BatchStrOut, b: BatchStrOut) -> BatchStrOut:
    return BatchStrOut(*(getattr(a, f.name) + getattr(b, f.name) for f in fields(BatchStrOut)))
