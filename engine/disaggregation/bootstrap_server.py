"""The prefill engine's bootstrap HTTP server (default port 8998) and its clients.

    PUT /route   {"engine_rank", "endpoint", "session_id", "geometry", "dp_size", "tp_rank", "tp_size",
                  "head_start"}
                 a prefill rank registers (one per DP rank and TP rank)
    GET /route?engine_rank=0[&tp_rank=0]  -> that JSON, or 404 until the rank has registered
    GET /health  -> {"status": "ok", "sessions": {"0": session_id, "0.1": ...}}
                 decode heartbeats; a changed session means a restarted rank. Keys: the DP rank,
                 with ".T" for TP rank T > 0
The standard library's threading HTTP server is enough here: a handful of small requests per
request-pair, no event loop to share with the engine.
"""
from __future__ import annotations

import http.client
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

from baton.engine.disaggregation.base import KVTransferError

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998
_MAX_ROUTE_BYTES = 1 << 16  # a route is a few hundred bytes


@dataclass(frozen=True)
class PrefillRankInfo:
    engine_rank: int  # the prefill's DP rank
    endpoint: str  # side-channel PULL address of the rank
    session_id: str  # Mooncake session "host:port"
    geometry: dict
    # the prefill engine's DP ranks: the KV of room R is on rank R % dp_size (the rank its front end
    # gave the request), so a decode asks rank 0 for this and then that rank for its route
    dp_size: int = 1
    # with tensor parallelism every TP rank registers its KV shard; a decode's TP rank T binds to
    # the prefill's TP rank T, so both engines must run the same tp_size
    tp_rank: int = 0
    tp_size: int = 1
    head_start: int = 0  # the first of the model's KV heads the rank holds (geometry: how many)

    @property
    def key(self) -> str:
        return rank_key(self.engine_rank, self.tp_rank)


def rank_key(engine_rank: int, tp_rank: int = 0) -> str:
    """A rank's key in /health's sessions: "D" for DP rank D (TP rank 0), "D.T" for its TP rank T."""
    return str(engine_rank) if tp_rank == 0 else f"{engine_rank}.{tp_rank}"


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urlparse(self.path)
        if url.path == "/health":
            sessions = {info.key: info.session_id for info in self.server.ranks.values()}
            self._reply(200, {"status": "ok", "sessions": sessions})
        elif url.path == "/route":
            query = parse_qs(url.query)
            try:
                rank, tp_rank = int(query.get("engine_rank", ["0"])[0]), int(query.get("tp_rank", ["0"])[0])
            except ValueError:
                self._reply(400, {"error": "engine_rank and tp_rank must be integers"})
                return
            info = self.server.ranks.get((rank, tp_rank))
            self._reply(200, asdict(info)) if info else self._reply(
                404, {"error": f"rank {rank_key(rank, tp_rank)} not registered"})
        else:
            self._reply(404, {"error": f"no route {url.path}"})

    def do_PUT(self) -> None:  # noqa: N802
        if urlparse(self.path).path != "/route":
            self._reply(404, {"error": "no such route"})
            return
        try:
            length = int(self.headers.get("Content-Length", 0))
            if not 0 <= length <= _MAX_ROUTE_BYTES:
                raise ValueError(f"a route is at most {_MAX_ROUTE_BYTES} bytes, not {length}")
            info = PrefillRankInfo(**json.loads(self.rfile.read(length)))
        except (ValueError, TypeError) as e:  # not JSON, not an object, other fields
            self._reply(400, {"error": f"not a prefill rank's route: {e}"})
            return
        self.server.ranks[(info.engine_rank, info.tp_rank)] = info
        self._reply(200, {"status": "ok"})

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # requests are too frequent to log
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    ranks: dict[tuple[int, int], PrefillRankInfo]  # (DP rank, TP rank) -> info

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone before its answer (a decode whose short timeout ran out while this process
        was busy in a long step) is one log line; anything else keeps the standard traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            logger.warning("bootstrap server: %s:%s left before its answer (%s)", client_address[0],
                           client_address[1], type(error).__name__)
            return
        super().handle_error(request, client_address)


class KVBootstrapServer:
    """Runs in a daemon thread of the prefill engine's DP rank 0; every rank registers with it. Port
    0 picks a free port (tests; one rank only)."""

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_BOOTSTRAP_PORT) -> None:
        self._server = _Server((host, port), _Handler)
        self._server.ranks = {}
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kv-bootstrap-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _request(method: str, url: str, body: Optional[dict], timeout_s: float) -> tuple[int, dict]:
    """(status, JSON body). Anything that is not an answer of this server (refused, timed out, cut
    off, not HTTP, not a JSON object) is an OSError, the one error its callers handle: a peer that
    answers garbage must not end the thread that asked."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                code, answer = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            code, answer = e.code, json.loads(e.read() or b"{}")
    except (http.client.HTTPException, ValueError) as e:  # IncompleteRead, BadStatusLine; JSONDecodeError
        raise OSError(f"{method} {url}: not an answer of a bootstrap server ({type(e).__name__}: {e})") from e
    if not isinstance(answer, dict):
        raise OSError(f"{method} {url}: not an answer of a bootstrap server (a JSON {type(answer).__name__})")
    return code, answer


def register_prefill_rank(bootstrap_addr: str, info: PrefillRankInfo, timeout_s: float) -> None:
    """Retries until the server answers (it may start after the rank), raising after timeout_s."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            if _request("PUT", f"http://{bootstrap_addr}/route", asdict(info), 2.0)[0] == 200:
                return
        except OSError as e:
            last = e
        time.sleep(0.1)  # retry pacing, not a wait for a condition
    raise KVTransferError(f"prefill rank {info.key} could not register with the bootstrap server "
                          f"at {bootstrap_addr} within {timeout_s:g}s: {last}")


def fetch_prefill_rank(bootstrap_addr: str, engine_rank: int = 0, timeout_s: float = 1.0,
                       tp_rank: int = 0) -> Optional[PrefillRankInfo]:
    """The rank's info, None while it has not registered; OSError when the server is unreachable."""
    code, body = _request("GET", f"http://{bootstrap_addr}/route?engine_rank={engine_rank}&tp_rank={tp_rank}", None,
                          timeout_s)
    if code != 200:
        return None
    try:
        return PrefillRankInfo(**body)
    except TypeError as e:  # another server's answer, or another version's fields
        raise OSError(f"bootstrap server at {bootstrap_addr} answered a route that is not one: {e}") from e


def check_health(bootstrap_addr: str, timeout_s: float) -> dict[str, str]:
    """rank_key -> session id of the live prefill ranks; OSError when the server is unreachable."""
    code, body = _request("GET", f"http://{bootstrap_addr}/health", None, timeout_s)
    if code != 200 or not isinstance(body.get("sessions"), dict):
        raise OSError(f"bootstrap server at {bootstrap_addr} answered {code} on /health without its sessions")
    return dict(body["sessions"])
