"""`baton bench kv-transfer`: our per-request KV transfer vs Mooncake's raw batch write, same run.

    python -m baton.engine.bench.kv_transfer --prompt-lens 1024,4096,16384

This process is the prefill (manager, bootstrap server, pool); the decode runs in a child process.
Per prompt length and repeat, interleaved:
- raw: one `batch_transfer_sync_write` with one contiguous region per layer buffer (K and V);
- ours, contiguous pages: sender.send(all pages, is_last) -> poll() == Success, timed end to end
  (side-channel handshake done beforehand, as in serving: the decode asks before the prefill runs);
- ours, fragmented: the decode's pages come in shuffled runs of --fragment-run-pages pages.
Cases alternate their order between repeats; medians are reported; ratio = ours / raw throughput.

With --tp-pairs (e.g. 1:1,1:2,2:1, prefill:decode TP sizes) each pair runs instead: the
prefill's TP ranks here, each decode TP rank in its own child process, KV heads split as the engines
split them (disaggregation/head_slices.py). "ours" is one request through every rank's sender and
receiver, from the first send to the last Success on either side (a narrower decode's scatter of the
landed heads included; after one untimed run of each case); "raw" is Mooncake's batch write of the same bytes
between the same ranks as one contiguous region per layer buffer and rank pair (the ranks' writes in
parallel threads, as ours run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from baton.engine.bench.loopback_peer import PeerProcess, PeerSpec, make_pool, wait_final, wait_until
from baton.engine.disaggregation import create_transfer_backend
from baton.engine.disaggregation.base import KVArgs, KVGeometry, KVMetadata, KVPoll, MetadataBuffers, TransferConfig
from baton.engine.disaggregation.bootstrap_server import KVBootstrapServer


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-lens", default="1024,4096,16384", help="comma list of prompt lengths (tokens)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fragment-run-pages", type=int, default=32, help="decode page runs in the fragmented case")
    parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    parser.add_argument("--ib-device", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--tp-pairs", default=None,
                        help="prefill:decode TP sizes, e.g. 1:1,1:2,2:1: measure these pairs (one prompt length)")


def _fragmented(pages: np.ndarray, run: int, rng: np.random.Generator) -> np.ndarray:
    runs = [pages[i:i + run] for i in range(0, len(pages), run)]
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])


class _Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.lens = [int(x) for x in args.prompt_lens.split(",")]
        self.geo = KVGeometry(args.page_size, args.dtype, args.layers, args.kv_heads, args.head_dim)
        self.num_pages = -(-max(self.lens) // args.page_size)
        self.config = TransferConfig(host=args.host, protocol=args.protocol, ib_device=args.ib_device,
                                     bootstrap_timeout_s=60, waiting_timeout_s=600)
        self.pool = make_pool(self.geo, self.num_pages)
        self.metadata = MetadataBuffers(4)
        self.server = KVBootstrapServer(args.host, 0)
        self.addr = f"{args.host}:{self.server.port}"
        self.mgr = create_transfer_backend("mooncake", KVArgs.from_pool(self.pool, self.metadata), self.metadata,
                                           "prefill", self.config, self.addr)
        self.decode = PeerProcess(PeerSpec("decode", self.geo, self.num_pages, self.config))
        self.room = 1

    def ours(self, src: np.ndarray, dst: np.ndarray) -> float:
        room, self.room = self.room, self.room + 1
        self.decode.submit("recv", bootstrap_addr=self.addr, room=room, dst_pages=dst.tolist(), timeout_s=600.0)
        sender = self.mgr.create_sender(room)
        assert wait_until(lambda: sender.poll() != KVPoll.Bootstrapping, 60), sender.failure_reason()
        slot = self.metadata.alloc()
        sender.init(len(src), slot)
        start = time.perf_counter()
        sender.send(src, is_last=True, metadata=KVMetadata(1, 0.0, room))
        status = wait_final(sender, 600)
        seconds = time.perf_counter() - start
        received = self.decode.result(600)
        assert status == KVPoll.Success and received["status"] == KVPoll.Success, (sender.failure_reason(), received)
        self.metadata.free(slot)
        sender.clear()
        return seconds

    def raw(self, num_pages: int) -> float:
        item = np.asarray(self.mgr.args.kv_item_lens)
        dst = (np.asarray(self.decode.info["kv_ptrs"]) + item).tolist()  # start after the dummy page, like ours
        src = (np.asarray(self.mgr.args.kv_data_ptrs) + item).tolist()
        lengths = (item * num_pages).tolist()
        start = time.perf_counter()
        self.mgr.engine.batch_write(self.decode.info["session_id"], src, dst, lengths)
        return time.perf_counter() - start

    def run(self, repeats: int, run_pages: int) -> list[dict]:
        rng = np.random.default_rng(0)
        self.raw(1)  # opens the Mooncake segment to the decode once
        rows = []
        for n_tokens in self.lens:
            n = -(-n_tokens // self.geo.page_size)
            pages = np.arange(1, n + 1, dtype=np.int64)
            frag = _fragmented(pages, run_pages, rng)
            times: dict[str, list[float]] = {"raw": [], "contiguous": [], "fragmented": []}
            cases = {"raw": lambda: self.raw(n), "contiguous": lambda: self.ours(pages, pages),
                     "fragmented": lambda: self.ours(pages, frag)}
            for i in range(repeats):
                order = list(cases) if i % 2 == 0 else list(reversed(cases))  # no case always goes first
                for name in order:
                    times[name].append(cases[name]())
            nbytes = int(sum(self.mgr.args.kv_item_lens)) * n
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            rows.append({"prompt_tokens": n_tokens, "bytes": nbytes, "gbps": gbps,
                         "ratio_contiguous": gbps["contiguous"] / gbps["raw"],
                         "ratio_fragmented": gbps["fragmented"] / gbps["raw"],
                         "fragmented_runs": 1 + int(np.count_nonzero(np.diff(frag) != 1))})
        return rows

    def close(self) -> None:
        self.decode.close()
        self.mgr.close()
        self.server.close()


def format_table(rows: list[dict], geo: KVGeometry, protocol: str) -> str:
    lines = [f"== KV transfer, {protocol}: {geo.layer_num} layers x {geo.head_num} kv heads x {geo.head_dim} "
             f"{geo.dtype}, page_size {geo.page_size} (GB/s, median) ==",
             f"{'tokens':>7}{'MiB':>8}{'raw':>8}{'ours':>8}{'ratio':>7}{'ours frag':>11}{'ratio':>7}{'runs':>7}"]
    for r in rows:
        g = r["gbps"]
        lines.append(f"{r['prompt_tokens']:>7}{r['bytes'] / 2**20:>8.0f}{g['raw']:>8.2f}{g['contiguous']:>8.2f}"
                     f"{r['ratio_contiguous']:>7.2f}{g['fragmented']:>11.2f}{r['ratio_fragmented']:>7.2f}"
                     f"{r['fragmented_runs']:>7}")
    return "\n".join(lines)


class _TpPairBench:
    """One prefill:decode TP pair (module docstring)."""

    def __init__(self, args: argparse.Namespace, prefill_tp: int, decode_tp: int) -> None:
        from baton.engine.disaggregation.head_slices import decode_rank_plan, kv_head_range

        self.prefill_tp, self.decode_tp, self.heads = prefill_tp, decode_tp, args.kv_heads
        self.num_pages = -(-max(int(x) for x in args.prompt_lens.split(",")) // args.page_size)
        self.config = TransferConfig(host=args.host, protocol=args.protocol, ib_device=args.ib_device,
                                     bootstrap_timeout_s=60, waiting_timeout_s=600)
        base = KVGeometry(args.page_size, args.dtype, args.layers, args.kv_heads, args.head_dim)
        self.geo = base
        self.server = KVBootstrapServer(args.host, 0)
        self.addr = f"{args.host}:{self.server.port}"
        self.pools, self.metas, self.mgrs, self.decodes = [], [], [], []
        try:
            for rank in range(prefill_tp):
                geo = KVGeometry(base.page_size, base.dtype, base.layer_num,
                                 kv_head_range(self.heads, prefill_tp, rank)[1], base.head_dim)
                pool, meta = make_pool(geo, self.num_pages), MetadataBuffers(4)
                args_r = KVArgs.from_pool(pool, meta, tp_rank=rank, tp_size=prefill_tp, kv_heads_total=self.heads)
                self.pools.append(pool)
                self.metas.append(meta)
                self.mgrs.append(create_transfer_backend("mooncake", args_r, meta, "prefill", self.config, self.addr))
            for rank in range(decode_tp):
                geo = KVGeometry(base.page_size, base.dtype, base.layer_num,
                                 kv_head_range(self.heads, decode_tp, rank)[1], base.head_dim)
                self.decodes.append(PeerProcess(PeerSpec("decode", geo, self.num_pages, self.config, tp_rank=rank,
                                                         tp_size=decode_tp, kv_heads_total=self.heads)))
        except BaseException:
            self.close()
            raise
        self.plan = [(s.prefill_rank, r, s.num_heads) for r in range(decode_tp)
                     for s in decode_rank_plan(self.heads, prefill_tp, decode_tp, r) if s.num_heads]
        self.room = 1

    def ours(self, pages: np.ndarray) -> float:
        room, self.room = self.room, self.room + 1
        for d in self.decodes:
            d.submit("recv", bootstrap_addr=self.addr, room=room, dst_pages=pages.tolist(), timeout_s=600.0)
        senders = [m.create_sender(room) for m in self.mgrs]
        for s in senders:
            assert wait_until(lambda s=s: s.poll() != KVPoll.Bootstrapping, 60), s.failure_reason()
        slots = [meta.alloc() for meta in self.metas]
        for s, slot in zip(senders, slots):
            s.init(len(pages), slot)
        start = time.monotonic()
        for s in senders:
            s.send(pages, is_last=True, metadata=KVMetadata(1, 0.0, room))
        statuses = [wait_final(s, 600) for s in senders]
        sent = time.monotonic()
        received = [d.result(600) for d in self.decodes]
        seconds = max([sent] + [r["done_at"] for r in received]) - start  # a narrower decode's scatter included
        assert all(st == KVPoll.Success for st in statuses), [s.failure_reason() for s in senders]
        assert all(r["status"] == KVPoll.Success for r in received), received
        for s, slot, meta in zip(senders, slots, self.metas):
            meta.free(slot)
            s.clear()
        return seconds

    def raw(self, num_pages: int) -> float:
        """Each (prefill rank, decode rank) pair of the plan: one contiguous region per layer buffer
        with that slice's bytes; each prefill rank's batches in its own thread."""
        import threading

        geo = self.geo
        head_bytes = geo.page_size * geo.head_dim * np.dtype(geo.dtype).itemsize  # one head of one page
        batches: dict[int, list[tuple[str, list[int], list[int], list[int]]]] = {}
        used = [0] * self.decode_tp  # bytes taken so far in each decode rank's buffers
        for p, r, n in self.plan:
            src = np.asarray(self.mgrs[p].args.kv_data_ptrs)
            dst = np.asarray(self.decodes[r].info["kv_ptrs"]) + used[r]
            length = n * head_bytes * num_pages
            used[r] += length
            batches.setdefault(p, []).append((self.decodes[r].info["session_id"], src.tolist(), dst.tolist(),
                                              [length] * len(src)))

        def write(p: int) -> None:
            for session, srcs, dsts, lens in batches[p]:
                self.mgrs[p].engine.batch_write(session, srcs, dsts, lens)

        threads = [threading.Thread(target=write, args=(p,)) for p in list(batches)[1:]]
        start = time.perf_counter()
        for t in threads:
            t.start()
        write(next(iter(batches)))  # the first rank in this thread, as a lone rank writes
        for t in threads:
            t.join()
        return time.perf_counter() - start

    def run(self, n_tokens: int, repeats: int) -> dict:
        n = -(-n_tokens // self.geo.page_size)
        pages = np.arange(1, n + 1, dtype=np.int64)
        self.raw(n)  # untimed: opens the Mooncake segments and touches every destination page once
        self.ours(pages)
        times: dict[str, list[float]] = {"raw": [], "ours": []}
        for i in range(repeats):
            for name in (("raw", "ours") if i % 2 == 0 else ("ours", "raw")):
                times[name].append(self.raw(n) if name == "raw" else self.ours(pages))
        geo = self.geo
        nbytes = 2 * geo.layer_num * self.heads * geo.head_dim * np.dtype(geo.dtype).itemsize * n * geo.page_size
        gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
        return {"pair": f"{self.prefill_tp}:{self.decode_tp}", "prompt_tokens": n_tokens, "bytes": nbytes,
                "gbps": gbps, "ratio": gbps["ours"] / gbps["raw"]}

    def close(self) -> None:
        for d in self.decodes:
            d.close()
        for m in self.mgrs:
            m.close()
        self.server.close()


def run_tp_pairs(args: argparse.Namespace) -> list[dict]:
    n_tokens = int(args.prompt_lens.split(",")[0])
    rows = []
    for pair in args.tp_pairs.split(","):
        prefill_tp, decode_tp = (int(x) for x in pair.split(":"))
        bench = _TpPairBench(args, prefill_tp, decode_tp)
        try:
            rows.append(bench.run(n_tokens, args.repeats))
        finally:
            bench.close()
    return rows


def format_tp_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"== KV transfer between TP sizes, {args.protocol}: {args.layers} layers x {args.kv_heads} kv heads x "
             f"{args.head_dim} {args.dtype}, page_size {args.page_size}, {rows[0]['prompt_tokens']} tokens "
             f"({rows[0]['bytes'] / 2**20:.0f} MiB; GB/s, median) ==",
             f"{'P:D':>5}{'raw':>8}{'ours':>8}{'ratio':>7}"]
    for r in rows:
        lines.append(f"{r['pair']:>5}{r['gbps']['raw']:>8.2f}{r['gbps']['ours']:>8.2f}{r['ratio']:>7.2f}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    if args.tp_pairs:
        rows = run_tp_pairs(args)
        print(format_tp_table(rows, args))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    bench = _Bench(args)
    try:
        rows = bench.run(args.repeats, args.fragment_run_pages)
    finally:
        bench.close()
    print(format_table(rows, bench.geo, args.protocol))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    raise SystemExit(run_cli(parser.parse_args()))
