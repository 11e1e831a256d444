"""`baton bench kv-transfer`: our per-request KV transfer vs Mooncake's raw batch write, same run.

    python -m baton.engine.bench.kv_transfer --prompt-lens 1024,4096,16384

This process is the prefill (manager, bootstrap server, pool); the decode runs in a child process.
Per prompt length and repeat, interleaved:
- raw: one `batch_transfer_sync_write` with one contiguous region per layer buffer (K and V);
- ours, contiguous pages: sender.send(all pages, is_last) -> poll() == Success, timed end to end
  (side-channel handshake done beforehand, as in serving: the decode asks before the prefill runs);
- ours, fragmented: the decode's pages come in shuffled runs of --fragment-run-pages pages.
Cases alternate their order between repeats; medians are reported; ratio = ours / raw throughput.
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


def run_cli(args: argparse.Namespace) -> int:
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
