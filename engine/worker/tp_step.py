"""The TP step broadcast: how the scheduler's rank (the driver) makes the other ranks of its TP group
run the same forward pass.

Only the driver runs a scheduler, samples and talks to the rest of the engine. Every other rank
(a follower) loops: receive a step, run the model on its shard (the layers' all-reduces meet the
driver's), repeat. A follower thus needs nothing of the scheduler but what the forward reads:

    header  int64[15]  command, forward mode, batch size, tokens, table updates, has future slots,
                       prompt-logprob spans, verify, state copies, state tracks, head primes, tree
                       parents, images, LoRA, LoRA ops' bytes (the payload's layout follows from these)
    payload int64[..]  input_ids | positions | req_pool_indices | seq_lens | out_cache_loc
                       [| extend_prefix_lens | extend_seq_lens]     (EXTEND)
                       [| next prompt ids]                          (EXTEND, a draft head)
                       [| future slots]                             (overlap loop)
                       | rows | cols | slots                        (req_to_token updates)
                       | span first rows | span row counts          (prompt logprobs)
                       | copy sources | copy destinations        (hybrid models' state work,
                       | track rows | offsets | slots               mem_cache/state_pool.StateOps)
                       | parents                                    (a verify step with tree drafts: every
                                                                    request's, a chain's as [-1, 0, 1, ..])
                       [| prime batch indices | prime candidates    (a verify step's VerifyInput.primes,
                        | their log-probabilities]                  topk each, -1 / 0 padded, the log-
                                                                    probabilities as float64 bits; their head
                                                                    outputs follow, broadcast in the
                                                                    model's dtype)
                       [| adapter slots]                            (LoRA: each row's, core/lora.py)

The LM head is split by vocabulary rows, and each of its calls all-gathers the logits: after the
forward a follower makes the driver's calls, on the same rows, in the same order. One on each
request's last position (on every row in a speculative verify step: its drafts' positions too), then
one per span of prompt positions whose logprobs a request asked for
(layers/logits_processor.py prompt_logprob_spans; the step carries the spans, since a follower has
no requests).

req_to_token: the attention reads each request's row of slot indices, and only the driver's
scheduler writes rows (admission, prefix hits, radix de-duplication, decode appends). The driver
keeps a mirror of what the followers' tables hold, compares the batch's rows with it before each
step and sends the entries that differ, so the followers' tables equal the driver's wherever this
pass reads them; a decode step sends one entry per request.

NEXTN / EAGLE (speculative/head_worker.py): every rank runs the draft head's passes, whose layers and LM head
are collectives too, in the driver's order: before a verify pass its chain steps (the drafts are the
argmax of all-gathered logits, the same on every rank), after every pass the head over its positions.
That one needs what only the driver knows: the sampled ids (broadcast as the overlap loop's are) and,
after a verify pass, how many drafts each request kept and the token after them (send_accepted).
Trees (any algorithm): the followers mask the step's trees as the driver does, and after acceptance
take the accepted nodes (send_accepted) to move their KV as the driver moves its own. A head's tree
grows best-first from its scores (the all-gathered logits' log-probabilities, the same on every rank):
the step carries the scheduler's placeholder shape, and each rank's drafter chooses the same tree.

Images (an EXTEND of a vision-language model): after the payload the batch's M-RoPE positions
[3, tokens]; then the model runner's embedder makes its exchange (ViT DP shares, the spliced
embeddings: model_executor/mm_embedder.py), which a follower's embedder mirrors before the forward.

Weights: besides a forward step (command FORWARD) or stop (STOP), the header's command may be
WEIGHTS, with the byte length of a pickled weight operation (worker/weights.py: an update, the
weight-update group, a read) in its second column; the operation's bytes follow as uint8, and each
follower runs it on its shard between steps. The driver sends one only with nothing in flight.
LoRA: a pass that loads adapters into the pool, or lets some go, sends its loads (slot, uid, path) and
drops last, pickled into an int64 tensor of the header's length (the paths are strings); each rank
reads an adapter from its path the first time it loads it.

Overlap loop: a batch's decode inputs may be placeholders for tokens the previous batch has not
sampled yet. Each follower keeps its own future map: after sampling, the driver broadcasts the
sampled ids over the device group (asynchronous on CUDA), and the followers store them at the
slots the step named.
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import torch

from baton.engine.core.lora import LoraStep

from baton.engine.core.forward_batch import ForwardMode
from baton.engine.distributed.parallel_state import TpGroup, resolve_group, shm_group_of
from baton.engine.mem_cache.state_pool import StateOps
from baton.engine.worker.future_map import FutureMap
from baton.engine.worker.weights import RankWeights, WeightOp

if TYPE_CHECKING:
    from baton.engine.core.schedule_batch import ModelWorkerBatch
    from baton.engine.core.spec_info import VerifyOutput
    from baton.engine.model_executor.model_runner import ModelRunner

_HEADER = 15
_STOP, _FORWARD, _WEIGHTS = 0, 1, 2


def _broadcast(t: torch.Tensor, group_name: str) -> None:
    import torch.distributed as dist

    shm = shm_group_of(group_name)  # a CPU group's shared memory segment, when it has one
    if shm is not None and t.device.type == "cpu":
        shm.broadcast(t)
    else:
        dist.broadcast(t, src=0, group=resolve_group(group_name))


class Step(NamedTuple):
    """What a follower runs: a ModelWorkerBatch's forward inputs (host tensors)."""

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: list[int]
    out_cache_loc: torch.Tensor
    extend_prefix_lens: Optional[list[int]]
    extend_seq_lens: Optional[list[int]]
    future_slots: Optional[torch.Tensor]  # [bs] where this batch's sampled ids go (overlap loop)
    logit_spans: list[tuple[int, int]]  # (first hidden row, rows) of each prompt-logprob LM head call
    state_ops: Optional[StateOps] = None  # a hybrid model's state copies and checkpoints this pass
    verify: bool = False  # a speculative verify step: the LM head runs over every row
    next_prompt_ids: Optional[list[int]] = None  # EXTEND with a draft head (ModelWorkerBatch.next_prompt_ids)
    # a verify step's first drafts, head outputs and the drafts' log-probabilities a PD prefill sent
    # (VerifyInput.primes)
    primes: Optional[dict[int, tuple[tuple[int, ...], torch.Tensor, tuple[float, ...]]]] = None
    # a verify step with tree drafts: every request's parents (a chain's given as [-1, 0, 1, ..])
    parents: Optional[list[list[int]]] = None
    mrope_positions: Optional[torch.Tensor] = None  # [3, tokens]: the batch has images
    lora: Optional[LoraStep] = None  # LoRA: each row's adapter slot, the pool's loads and drops


def _pickled(obj: object) -> torch.Tensor:
    """An object as an int64 tensor (its pickle, zero-padded to whole int64s): the broadcasts move int64."""
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data + bytes(-len(data) % 8)), dtype=torch.int64)


def _unpickled(t: torch.Tensor) -> object:
    return pickle.loads(t.numpy().tobytes())  # pickle stops at its end: the padding is never read


def _logit_spans(mwb: "ModelWorkerBatch") -> list[tuple[int, int]]:
    """(first hidden row, rows) of each prompt-logprob LM head call the driver will make."""
    if not mwb.input_logprob_reqs:
        return []
    from baton.engine.layers.logits_processor import prompt_logprob_spans

    spans = prompt_logprob_spans(mwb.input_logprob_reqs, mwb.extend_prefix_lens_cpu, mwb.extend_seq_lens_cpu,
                                 mwb.seq_lens_cpu)
    return [(s.first_row, s.rows) for s in spans if s.rows]


class StepSender:
    """The driver's side. Call send() before each forward, in the thread that runs the forward."""

    def __init__(self, tp: TpGroup, req_to_token: torch.Tensor, head: bool = False, topk: int = 1) -> None:
        """`head`: speculation with a draft head (its passes read the next prompt ids); `topk`: its
        first-draft candidates per request (a prime carries up to that many)."""
        assert tp.is_driver and tp.size > 1
        self.tp, self.table, self.head, self.topk = tp, req_to_token, head, topk
        self.mirror = torch.zeros_like(req_to_token)  # what every follower's req_to_token holds

    def send(self, mwb: "ModelWorkerBatch") -> None:
        rows, cols, slots = self._table_updates(mwb.req_pool_indices, mwb.seq_lens_cpu)
        extend = mwb.forward_mode == ForwardMode.EXTEND
        parts = [mwb.input_ids, mwb.positions, mwb.req_pool_indices, torch.tensor(mwb.seq_lens_cpu),
                 mwb.out_cache_loc]
        if extend:
            parts += [torch.tensor(mwb.extend_prefix_lens_cpu), torch.tensor(mwb.extend_seq_lens_cpu)]
            if self.head:
                parts.append(torch.tensor(mwb.next_prompt_ids or [-1] * len(mwb.seq_lens_cpu), dtype=torch.int64))
        if mwb.future_indices is not None:
            parts.append(mwb.future_indices)
        spans = _logit_spans(mwb)
        parts += [rows, cols, slots, torch.tensor([s[0] for s in spans], dtype=torch.int64),
                  torch.tensor([s[1] for s in spans], dtype=torch.int64)]
        ops = mwb.state_ops or StateOps()
        tracks = [(row, off, slot) for row, t in ops.tracks.items() for off, slot in t]
        parts += [torch.tensor(ops.copies, dtype=torch.int64).reshape(-1, 2).T.reshape(-1),
                  torch.tensor(tracks, dtype=torch.int64).reshape(-1, 3).T.reshape(-1)]
        spec = mwb.spec_info
        parents = [] if spec is None or spec.parents is None else [
            q for i, n in enumerate(mwb.extend_seq_lens_cpu) for q in (spec.tree(i) or range(-1, n - 1))]
        parts.append(torch.tensor(parents, dtype=torch.int64))
        primes = (spec.primes if spec is not None else None) or {}
        if primes:  # each prime's first-draft candidates, padded with -1 to topk, and their log-probabilities
            parts += [torch.tensor(list(primes), dtype=torch.int64),
                      torch.tensor([(list(p[0]) + [-1] * self.topk)[:self.topk] for p in primes.values()]),
                      torch.tensor([(list(p[2]) + [0.0] * self.topk)[:self.topk] for p in primes.values()],
                                   dtype=torch.float64).view(torch.int64)]
        lora = mwb.lora
        if lora is not None:
            parts.append(torch.tensor(lora.slots, dtype=torch.int64))
        lora_ops = _pickled((lora.loads, lora.drops)) if lora is not None and (lora.loads or lora.drops) else None
        payload = torch.cat([t.to("cpu", torch.int64).reshape(-1) for t in parts])
        header = torch.tensor([_FORWARD, int(mwb.forward_mode), len(mwb.seq_lens_cpu), mwb.input_ids.numel(),
                               rows.numel(), mwb.future_indices is not None, len(spans), mwb.spec_info is not None,
                               len(ops.copies), len(tracks), len(primes), len(parents), mwb.mm is not None,
                               lora is not None, 0 if lora_ops is None else lora_ops.numel()],
                              dtype=torch.int64)
        _broadcast(header, self.tp.cpu_group)
        _broadcast(payload, self.tp.cpu_group)
        if primes:
            _broadcast(torch.stack([p[1] for p in primes.values()]).to(self.table.device).contiguous(),
                       self.tp.device_group)
        if mwb.mm is not None:
            _broadcast(mwb.mm.mrope_positions.to(torch.int64).contiguous(), self.tp.cpu_group)
        if lora_ops is not None:
            _broadcast(lora_ops, self.tp.cpu_group)

    def send_sampled(self, next_ids: torch.Tensor) -> None:
        """The ids this step sampled (device group): for the followers' future maps (overlap loop),
        and with a draft head for its pass after it."""
        _broadcast(next_ids.contiguous(), self.tp.device_group)

    def send_accepted(self, out: "VerifyOutput") -> None:
        """After a verify pass with a draft head or trees: per request the drafts it kept and the token
        after them, then with trees the accepted nodes (the head's pass and the KV move read them)."""
        _broadcast(torch.tensor([len(t) - 1 for t in out.tokens] + out.last_tokens, dtype=torch.int64),
                   self.tp.cpu_group)
        if out.accepted_nodes is not None and any(out.accepted_nodes):
            _broadcast(torch.tensor([n for nodes in out.accepted_nodes for n in nodes], dtype=torch.int64),
                       self.tp.cpu_group)

    def send_weights(self, op: WeightOp) -> None:
        """A weight operation every follower runs on its shard (nothing may be in flight)."""
        payload = pickle.dumps(op)
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _WEIGHTS, len(payload)
        _broadcast(header, self.tp.cpu_group)
        _broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.tp.cpu_group)

    def stop(self) -> None:
        """Let the followers leave their loop (engine shutdown)."""
        _broadcast(torch.zeros(_HEADER, dtype=torch.int64), self.tp.cpu_group)

    def _table_updates(self, req_pool_indices: torch.Tensor,
                       seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cols, slots) of the entries in the batch's rows, below each seq_len, where the
        driver's table differs from the followers'; the mirror takes them."""
        dev = self.table.device
        rows = req_pool_indices.to(dev, torch.int64)
        width = max(seq_lens)
        cols = torch.arange(width, device=dev)
        live = cols[None, :] < torch.tensor(seq_lens, device=dev)[:, None]  # [bs, width]
        now = self.table[rows[:, None], cols[None, :]]
        diff = (now != self.mirror[rows[:, None], cols[None, :]]) & live
        r, c = diff.nonzero(as_tuple=True)
        r, slots = rows[r], now[diff]  # both in row-major order
        self.mirror[r, c] = slots
        return r.cpu(), c.cpu(), slots.cpu()


class StepReceiver:
    """A follower's side: recv() blocks until the driver sends a step (None: stop)."""

    def __init__(self, tp: TpGroup, runner: "ModelRunner") -> None:
        assert not tp.is_driver
        self.tp, self.runner = tp, runner
        self.future_ids: Optional[torch.Tensor] = None  # this follower's future map, made on first use
        self.weights: Optional[RankWeights] = None  # this rank's side of weight operations, made on first use
        self.drafter = None  # NEXTN / EAGLE: this rank's share of the draft head's passes
        if runner.draft_head is not None:
            from baton.engine.speculative.head_worker import HeadDrafter

            args = runner.config
            self.drafter = HeadDrafter(runner, args.speculative_num_steps, args.speculative_eagle_topk)

    def recv(self) -> Optional[Union[Step, WeightOp]]:
        header = torch.empty(_HEADER, dtype=torch.int64)
        _broadcast(header, self.tp.cpu_group)
        (cmd, mode, bs, num_tokens, n_updates, has_future, n_spans, verify, n_copies, n_tracks, n_primes,
         n_parents, has_mm, has_lora, n_lora_ops) = header.tolist()
        if cmd == _STOP:
            return None
        if cmd == _WEIGHTS:
            payload = torch.empty(mode, dtype=torch.uint8)  # the second column: the operation's length
            _broadcast(payload, self.tp.cpu_group)
            return pickle.loads(payload.numpy().tobytes())  # the driver's own message
        mode = ForwardMode(mode)
        sizes = [num_tokens, num_tokens, bs, bs, num_tokens]
        head = self.drafter is not None and mode == ForwardMode.EXTEND
        if mode == ForwardMode.EXTEND:
            sizes += [bs, bs] + ([bs] if head else [])
        if has_future:
            sizes.append(bs)
        sizes += [n_updates] * 3 + [n_spans] * 2 + [2 * n_copies, 3 * n_tracks, n_parents]
        topk = self.drafter.topk if self.drafter is not None else 1
        if n_primes:
            sizes += [n_primes, n_primes * topk, n_primes * topk]
        if has_lora:
            sizes.append(bs)
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        _broadcast(payload, self.tp.cpu_group)
        fields = list(payload.split(sizes))
        lora_slots = fields.pop().tolist() if has_lora else None
        primes = None
        if n_primes:
            prime_idx, prime_tokens, prime_logps = fields[-3:]
            del fields[-3:]
            outs = torch.empty(n_primes, *self.drafter.hidden.shape[1:], dtype=self.drafter.hidden.dtype,
                               device=self.runner.device)
            _broadcast(outs, self.tp.device_group)
            candidates = [tuple(t for t in row if t >= 0) for row in prime_tokens.view(n_primes, topk).tolist()]
            logps = [tuple(row[:len(c)]) for c, row in
                     zip(candidates, prime_logps.view(torch.float64).view(n_primes, topk).tolist())]
            primes = dict(zip(prime_idx.tolist(), zip(candidates, outs, logps)))
        mrope = None
        if has_mm:
            mrope = torch.empty((3, num_tokens), dtype=torch.int64)
            _broadcast(mrope, self.tp.cpu_group)
        lora = None
        if has_lora:
            loads, drops = [], []
            if n_lora_ops:
                received = torch.empty(n_lora_ops, dtype=torch.int64)
                _broadcast(received, self.tp.cpu_group)
                loads, drops = _unpickled(received)
            lora = LoraStep(lora_slots, loads, drops)
        rows, cols, slots, span_rows, span_counts, copies, tracks, flat_parents = fields[-8:]
        parents = None
        if n_parents:  # per request its extend's length of them
            cut = flat_parents.split([int(n) for n in fields[6].tolist()])
            parents = [c.tolist() for c in cut]
        state_ops = None
        if n_copies or n_tracks:
            src, dst = copies.view(2, -1).tolist()
            state_ops = StateOps(list(zip(src, dst)))
            for row, off, slot in zip(*tracks.view(3, -1).tolist()):
                state_ops.tracks.setdefault(row, []).append((off, slot))
        table = self.runner.req_to_token_pool.req_to_token
        table[rows.to(table.device), cols.to(table.device)] = slots.to(table.device)
        extend = mode == ForwardMode.EXTEND
        after = 5 + (2 if extend else 0) + (1 if head else 0)  # the field after the mode's own
        return Step(mode, fields[0], fields[1], fields[2], fields[3].tolist(), fields[4],
                    fields[5].tolist() if extend else None, fields[6].tolist() if extend else None,
                    fields[after] if has_future else None,
                    list(zip(span_rows.tolist(), span_counts.tolist())), state_ops, bool(verify),
                    fields[7].tolist() if head else None, primes, parents, mrope, lora)

    @torch.inference_mode()  # every tensor it makes is an inference tensor, as the driver's batches
    def run(self) -> int:
        """The follower loop: run every step the driver sends until it says stop. Returns the
        number of steps run."""
        steps = 0
        while (step := self.recv()) is not None:
            if not isinstance(step, Step):
                if self.weights is None:
                    self.weights = RankWeights(self.runner, self.tp)
                with torch.inference_mode(False):  # as on the driver, whose scheduler thread writes them
                    self.weights.run(step)
                continue
            self._run_step(step)
            steps += 1
        return steps

    def _run_step(self, step: Step) -> None:
        from baton.engine.triton_ops.future_resolve import resolve_future_token_ids

        runner, dev = self.runner, self.runner.device
        fb = runner.make_forward_batch(
            step.mode, input_ids=step.input_ids.to(dev), positions=step.positions.to(dev),
            req_pool_indices=step.req_pool_indices.to(dev), seq_lens=torch.tensor(step.seq_lens, device=dev),
            out_cache_loc=step.out_cache_loc.to(dev), seq_lens_cpu=step.seq_lens,
            extend_prefix_lens_cpu=step.extend_prefix_lens, extend_seq_lens_cpu=step.extend_seq_lens)
        fb.state_ops = step.state_ops
        fb.spec_verify = step.verify  # as the driver's: the same verify graph, or the same eager pass
        fb.lora = step.lora
        if step.mrope_positions is not None:  # images: the driver's embedder exchange, mirrored
            fb.mrope_positions = step.mrope_positions.to(dev)
            fb.mm_embeds = runner.mm_embedder.follow()
        if step.future_slots is not None:  # the overlap loop: decode inputs may be placeholders
            resolve_future_token_ids(fb.input_ids, self._future_map())
        spec = None
        if step.verify:  # the drafts' shape, as the driver's (the head's drafts this rank computes alike)
            from baton.engine.core.spec_info import VerifyInput

            spec = VerifyInput([[0] * (n - 1) for n in step.extend_seq_lens], parents=step.parents,
                               primes=step.primes)
            fb.tree_parents = spec.parents
            if self.drafter is not None:
                self.drafter.draft(fb, spec)
        hidden = runner.forward(fb)
        # the driver's LM head calls (each all-gathers logits): last positions (every row of a verify
        # step), then prompt spans; an embedding engine's driver pools instead, on its own
        rows = None if step.verify else runner.last_token_rows(fb)
        if runner.pooler is None:
            runner.model.compute_logits(hidden if rows is None else hidden[rows])
            for first, count in step.logit_spans:
                runner.model.compute_logits(hidden[first:first + count])
        sampled = None
        if step.future_slots is not None or (self.drafter is not None and not step.verify):
            sampled = torch.empty(len(step.seq_lens), dtype=torch.int64, device=dev)
            _broadcast(sampled, self.tp.device_group)
            if step.future_slots is not None:
                self._future_map()[step.future_slots.to(dev)] = sampled
        if step.verify and (self.drafter is not None or spec.parents is not None):
            from baton.engine.speculative.accept_host import move_accepted_kv

            out = self._recv_accepted(len(step.seq_lens), spec.parents is not None)
            if self.drafter is not None:
                self.drafter.after_verify(fb, hidden, spec, out)
            if out.accepted_nodes is not None:
                move_accepted_kv(runner, fb, spec, out)
        elif self.drafter is not None:
            self.drafter.after_pass(fb, hidden, sampled, step.next_prompt_ids)

    def _recv_accepted(self, bs: int, tree: bool) -> "VerifyOutput":
        """StepSender.send_accepted's counts (and with trees the accepted nodes), as the VerifyOutput the
        head's pass and the KV move read."""
        from baton.engine.core.spec_info import VerifyOutput

        got = torch.empty(2 * bs, dtype=torch.int64)
        _broadcast(got, self.tp.cpu_group)
        kept, last = got[:bs].tolist(), got[bs:].tolist()
        out = VerifyOutput([[0] * k + [t] for k, t in zip(kept, last)])
        if tree:
            nodes = torch.empty(sum(kept), dtype=torch.int64)
            if nodes.numel():
                _broadcast(nodes, self.tp.cpu_group)
            out.accepted_nodes = [c.tolist() for c in nodes.split(kept)]
        return out

    def _future_map(self) -> torch.Tensor:
        if self.future_ids is None:
            self.future_ids = FutureMap(self.runner.pool_config.max_running_requests, self.runner.device).token_ids
        return self.future_ids
