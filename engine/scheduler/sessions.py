"""Sessions: a request continues an earlier request of its session without prefilling that history.

SGLang's /open_session, /close_session and `session_params` on /generate: a request in a session has
its prompt appended to the prompt and output of the request it continues.

    open_session -> S
    generate {id: S}                              A: a fresh start
    generate {id: S, rid: A}                      B: A's prompt + A's output + B's prompt
    generate {id: S, rid: A, offset: k,           C: (A's prompt + output)[:k] + C's prompt;
              replace: true}                         B and what continued it leave the session
    close_session S                               everything S held goes back to the pools

A session's requests form a tree (a request's parent is the one it continues), with SGLang's rules:
without `rid` a request starts afresh (a `replace` without `rid` first drops every request of the
session); only a finished request may be continued; `drop_previous_output` leaves the parent's output
out of the history. A streaming session (`streaming: true` at open, SGLang's append-only kind) runs
one request at a time, each continuing the last one that finished, without rid, replace, offset or
drop_previous_output.

What a session holds (session_holds.py): each finished request's KV, for the requests that continue
it, until the session closes, a `replace` drops the request, or (rows) a continuing request takes the
row over. With the radix cache the hold is a lock on the tree node where the request's KV ends: the
tree already shares a conversation's prefix between its turns and its branches, and a lock is the one
thing missing (a finished request's KV is otherwise evictable); a continuing request then needs no
path of its own, its admission matches the prefix as any. Without the radix cache nothing is shared,
so the session keeps the request's row itself and hands it over.

Held memory is still the pool's: when nothing could run otherwise (waiting requests that cannot start
with nothing running, or a decode step that does not fit), the holds of the least recently used
sessions go first, before any request is retracted; their next turns prefill what the cache no longer
has. Outputs never depend on a hold: the session keeps every request's token ids, a hold saves compute.

A session's requests run on one DP rank (the tokenizer manager picks it from the session id); a PD
engine refuses sessions (a prefill engine's KV leaves it with each request).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from baton.engine.core.req import Req
from baton.engine.io_struct import (AbortReq, CloseSessionReqInput, CloseSessionReqOutput, OpenSessionReqInput,
                                    OpenSessionReqOutput, SessionGenerateReqInput, SessionParams,
                                    TokenizedGenerateReqInput)
from baton.engine.sampling.sampling_params import SamplingParams
from baton.engine.scheduler.session_holds import Hold, RadixPins, RowHolds

if TYPE_CHECKING:
    from baton.engine.core.queues import SchedulerQueues
    from baton.engine.core.schedule_batch import ScheduleBatch
    from baton.engine.scheduler.release import ReqReleaser
    from baton.engine.scheduler.request_table import RequestTable

logger = logging.getLogger(__name__)


class SessionError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass(eq=False)
class SessionNode:
    req: Req
    parent: Optional["SessionNode"]
    children: list["SessionNode"] = field(default_factory=list)
    hold: Optional[Hold] = None  # its KV, kept for the requests that continue it


@dataclass(eq=False)
class Session:
    session_id: str
    capacity_of_str_len: int
    streaming: bool = False
    timeout: Optional[float] = None
    nodes: dict[str, SessionNode] = field(default_factory=dict)  # rid -> node (streaming: the last one)
    last_used: float = field(default_factory=time.monotonic)
    inflight: Optional[Req] = None  # streaming: the request running now

    def holds(self) -> Iterator[Hold]:
        return (n.hold for n in self.nodes.values() if n.hold is not None)


@dataclass
class SessionView:
    """What sessions use of the scheduler."""

    dp_rank: int
    bos_token_id: Optional[int]
    pd_mode: str  # "null" when colocated
    holds: Union[RadixPins, RowHolds]
    queues: "SchedulerQueues"
    table: "RequestTable"
    releaser: "ReqReleaser"
    admit: Callable[[TokenizedGenerateReqInput], None]  # RequestIntake.handle_generate_request
    abort: Callable[[AbortReq], None]  # RequestIntake.abort_request
    stream_output: Callable[[list[Req]], None]
    drain_results: Callable[[], None]
    in_flight: Callable[[], Any]  # the launched batches whose results are not processed yet (overlap)


class SessionController:
    def __init__(self, view: SessionView) -> None:
        self.view, self.holds = view, view.holds
        self.sessions: dict[str, Session] = {}
        self._owner: dict[int, tuple[Session, Req]] = {}  # id(req) -> its session, for requests in flight
        self.num_holds = 0

    @property
    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The scheduler's control table entries (a reply, or None)."""
        return {OpenSessionReqInput: self.open, CloseSessionReqInput: self.close, SessionGenerateReqInput: self.generate}

    # ------------------------------------------------------------------ open / close
    def open(self, msg: OpenSessionReqInput) -> OpenSessionReqOutput:
        self._reap()
        sid, error = msg.session_id, None
        if self.view.pd_mode != "null":
            error = (f"sessions need a colocated engine: a {self.view.pd_mode} engine's KV leaves it with each "
                     "request")
        elif not sid:
            error = "open_session needs a session_id"
        elif sid in self.sessions:
            error = f"session {sid!r} is already open"
        elif msg.timeout is not None and not msg.timeout > 0:
            error = f"timeout must be a positive number of seconds, not {msg.timeout}"
        if error is not None:
            return OpenSessionReqOutput(sid, False, error, self.view.dp_rank)
        self.sessions[sid] = Session(sid, msg.capacity_of_str_len, bool(msg.streaming), msg.timeout)
        logger.info("session %s opened (%d open)", sid, len(self.sessions))
        return OpenSessionReqOutput(sid, True, "", self.view.dp_rank)

    def close(self, msg: CloseSessionReqInput) -> CloseSessionReqOutput:
        """Every hold goes back now; requests still running finish as any (their memory is released then)."""
        self._reap()
        if msg.session_id not in self.sessions:
            return CloseSessionReqOutput(False, f"session {msg.session_id!r} is not open", self.view.dp_rank)
        self._close(msg.session_id)
        return CloseSessionReqOutput(True, "", self.view.dp_rank)

    def _close(self, sid: str) -> None:
        session = self.sessions.pop(sid)
        self._release_holds(session)
        logger.info("session %s closed (%d open)", sid, len(self.sessions))

    def _reap(self) -> None:
        """Close the sessions whose timeout has passed since their last request."""
        now = time.monotonic()
        for sid in [s.session_id for s in self.sessions.values()
                    if s.timeout is not None and now - s.last_used > s.timeout]:
            logger.info("session %s timed out", sid)
            self._close(sid)

    # ------------------------------------------------------------------ requests
    def generate(self, msg: SessionGenerateReqInput) -> None:
        """Build the request's prompt from its session's history and admit it; a bad session param
        ends it with a 4xx. A request that continues a held row takes it over once queued."""
        self._reap()
        recv, params = msg.req, msg.session_params
        try:
            session = self._session(params.id)
            parent = self._parent(session, params, recv.rid)
            if parent is not None:
                recv = self._continued(recv, parent.req, params)
            self._apply_replace(session, params, parent)
        except SessionError as e:
            self._refuse(recv, e)
            return
        if parent is not None:
            self._settle(parent.req)
        self.view.admit(recv)
        req = self.view.table.get(recv.rid)
        if req is None or req.finished():  # refused at intake, and answered
            return
        self._attach(session, req, parent)
        if parent is not None and parent.hold is not None and self._queued(req) \
                and self.holds.take_over(parent.hold, req):
            parent.hold = None
            self.num_holds -= 1

    def _session(self, sid: Optional[str]) -> Session:
        if sid is None:
            raise SessionError("session_params needs the session's id")
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError(f"session {sid!r} is not open", 404)
        session.last_used = time.monotonic()
        return session

    def _parent(self, session: Session, params: SessionParams, rid: str) -> Optional[SessionNode]:
        """The node the request continues (None: a fresh start), by SGLang's rules."""
        if session.streaming:
            return self._streaming_parent(session, params)
        if rid in session.nodes:
            raise SessionError(f"request id {rid!r} is in session {session.session_id!r} already: each request of "
                               "a session needs its own rid")
        if params.rid is None:
            return None
        node = session.nodes.get(params.rid)
        if node is None:
            raise SessionError(f"request {params.rid!r} is not in session {session.session_id!r}", 404)
        if not params.replace and not node.req.finished():
            raise SessionError(f"request {params.rid!r} has not finished: a request continues a finished one", 409)
        return node

    @staticmethod
    def _streaming_parent(session: Session, params: SessionParams) -> Optional[SessionNode]:
        if params.replace or params.offset or params.drop_previous_output:
            raise SessionError("a streaming session only appends: replace, offset and drop_previous_output are "
                               "refused")
        if session.inflight is not None and not session.inflight.finished():
            raise SessionError(f"streaming session {session.session_id!r} has a request running: send the next one "
                               "when it has finished", 409)
        return next(iter(session.nodes.values()), None)

    def _continued(self, recv: TokenizedGenerateReqInput, parent: Req,
                   params: SessionParams) -> TokenizedGenerateReqInput:
        """The request with its prompt after the parent's history (cut at `offset`)."""
        if recv.mm_inputs is not None or parent.mm_inputs is not None:
            raise SessionError("a request that continues a session takes text only (images start a session)")
        history = list(parent.origin_input_ids)
        if not params.drop_previous_output:
            history += parent.output_ids[:parent.sampling_params.max_new_tokens]
        if params.offset:
            if not -len(history) <= params.offset <= len(history):
                raise SessionError(f"offset {params.offset} is out of range: request {parent.rid!r} has "
                                   f"{len(history)} tokens of history")
            history = history[:params.offset]
        ids = recv.input_ids
        if ids and self.view.bos_token_id is not None and ids[0] == self.view.bos_token_id:
            ids = ids[1:]  # a turn appended to a history does not start the text again (as SGLang)
        return dataclasses.replace(recv, input_ids=history + list(ids))

    def _apply_replace(self, session: Session, params: SessionParams, parent: Optional[SessionNode]) -> None:
        """`replace`: the requests after `rid` (all of the session's without one) leave it; running
        ones are aborted, as SGLang does."""
        if not params.replace or session.streaming:
            return
        if parent is None:
            for node in [n for n in session.nodes.values() if n.parent is None]:
                self._drop(session, node)
            return
        if not parent.req.finished():
            self.view.abort(AbortReq(rid=parent.req.rid, message="replaced in its session", status_code=409))
        for child in list(parent.children):
            self._drop(session, child)
        parent.children.clear()

    def _drop(self, session: Session, node: SessionNode) -> None:
        for child in node.children:
            self._drop(session, child)
        if node.hold is not None:
            self._release(node)
        if not node.req.finished():
            self.view.abort(AbortReq(rid=node.req.rid, message="replaced in its session", status_code=409))
        if session.nodes.get(node.req.rid) is node:
            del session.nodes[node.req.rid]

    def _attach(self, session: Session, req: Req, parent: Optional[SessionNode]) -> None:
        """Record an admitted request in its session (a streaming one: once it finishes)."""
        for key in [k for k, (_, r) in self._owner.items() if r.finished() and r.req_pool_idx is None]:
            del self._owner[key]  # ended without memory (aborted while queued): no release will come
        self._owner[id(req)] = (session, req)
        if session.streaming:
            session.inflight = req
            return
        node = SessionNode(req, parent)
        session.nodes[req.rid] = node
        if parent is not None:
            parent.children.append(node)

    def _settle(self, parent: Req) -> None:
        """The overlap loop releases a finished request one result later: a parent still waiting for
        that release is settled now, so its KV is held before the request that continues it is admitted."""
        if any(r is parent for r in self.view.releaser.waiting):
            self.view.drain_results()
            self.view.releaser.flush()

    def _queued(self, req: Req) -> bool:
        waiting = self.view.queues.waiting
        return bool(waiting) and waiting[-1] is req

    def _refuse(self, recv: TokenizedGenerateReqInput, e: SessionError) -> None:
        req = Req(rid=recv.rid, origin_input_ids=list(recv.input_ids), sampling_params=SamplingParams(),
                  eos_token_ids=frozenset(), stream=bool(recv.stream))
        self.view.table.add(req)
        req.abort(e.message, e.status)
        self.view.stream_output([req])

    # ------------------------------------------------------------------ holds
    def keep(self, req: Req) -> bool:
        """ReqReleaser's hook: a session request that finished (stop or length) while its session is
        open leaves its KV held for its next turn. True when this released the request."""
        if not req.finished():  # retracted or preempted: it runs again
            return False
        session, _ = self._owner.pop(id(req), (None, None))
        if session is None or self.sessions.get(session.session_id) is not session \
                or req.finished_reason.kind == "abort":
            return False
        if session.streaming:
            for node in list(session.nodes.values()):
                self._drop(session, node)
            node = session.nodes[req.rid] = SessionNode(req, None)
        else:
            node = session.nodes.get(req.rid)
            if node is None or node.req is not req:  # dropped by a replace meanwhile
                return False
        node.hold = self.holds.hold(req)
        self.num_holds += node.hold is not None
        session.last_used = time.monotonic()
        return True

    def _release(self, node: SessionNode) -> None:
        self.holds.release(node.hold)
        node.hold = None
        self.num_holds -= 1

    def _release_holds(self, session: Session) -> None:
        for node in session.nodes.values():
            if node.hold is not None:
                self._release(node)

    def _holding_lru(self) -> list[Session]:
        return sorted((s for s in self.sessions.values() if any(True for _ in s.holds())), key=lambda s: s.last_used)

    def relieve_prefill(self, schedule: Callable[[], Any]) -> Any:
        """Called when no prefill batch could be formed. If nothing runs either (nothing will free
        memory) while requests wait, the least recently used sessions' holds go, one session at a
        time, until `schedule` forms a prefill batch. Returns that batch, or None."""
        q = self.view.queues
        if not self.num_holds or not q.waiting or not q.running_batch.is_empty() or q.chunked_req is not None \
                or self.view.in_flight() or self.view.releaser.waiting:
            return None
        self._reap()
        for session in self._holding_lru():
            logger.warning("session %s: its held KV goes to waiting requests that could not start", session.session_id)
            self._release_holds(session)
            if (batch := schedule()) is not None:
                return batch
        return None

    def relieve_decode(self, batch: "ScheduleBatch") -> None:
        """The running batch's next step does not fit: sessions' holds go (least recently used first)
        before any running request is retracted."""
        if not self.num_holds or batch.is_empty() or batch.check_decode_mem():
            return
        for session in self._holding_lru():
            logger.warning("session %s: its held KV goes to the running requests' next step", session.session_id)
            self._release_holds(session)
            if batch.check_decode_mem():
                return

    def release_all(self) -> None:
        """Before the prefix cache is flushed: every hold goes (the sessions stay open)."""
        for session in self.sessions.values():
            self._release_holds(session)

    # ------------------------------------------------------------------ accounting
    def held(self) -> tuple[int, int, int]:
        """(KV slots held outside the prefix cache, request rows held, slots of pinned tree nodes)."""
        holds = [h for s in self.sessions.values() for h in s.holds()]
        return sum(h.slots for h in holds), sum(h.row is not None for h in holds), self.holds.pinned_size(holds)

    def server_info(self) -> dict[str, int]:
        return {"num_sessions": len(self.sessions),
                "session_held_tokens": sum(h.length for s in self.sessions.values() for h in s.holds())}
