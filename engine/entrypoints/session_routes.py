"""SGLang's session routes (/open_session, /close_session) and the check of /generate's session_params.

/open_session answers the session id as a JSON string; engine/scheduler/sessions.py runs the sessions."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from baton.engine.entrypoints.http_common import ApiContext, parse, read_json
from baton.engine.io_struct import CloseSessionReqInput, OpenSessionReqInput, SessionParams
from baton.engine.tokenizer_manager import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenSessionRequest(_Body):
    capacity_of_str_len: StrictInt
    session_id: Optional[StrictStr] = None
    streaming: Optional[StrictBool] = None
    timeout: Optional[float] = None


class CloseSessionRequest(_Body):
    session_id: StrictStr


class SessionParamsBody(_Body):
    id: Optional[StrictStr] = None
    rid: Optional[StrictStr] = None
    offset: Optional[StrictInt] = None
    replace: Optional[StrictBool] = None
    drop_previous_output: Optional[StrictBool] = None


def session_params_of(value: Any) -> Optional[SessionParams]:
    """One prompt's `session_params` of /generate (None: not in a session); a wrong shape is a 400."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("session_params is an object: {id, rid, offset, replace, drop_previous_output}", 400)
    try:
        body = SessionParamsBody.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise RequestError(f"invalid field session_params.{where}: {first.get('msg')}", 400) from e
    return SessionParams(**body.model_dump())


def register_session_routes(app: FastAPI, ctx: ApiContext) -> None:
    @app.api_route("/open_session", methods=["GET", "POST"])
    async def open_session(request: Request):
        """Open a session; its id (the one given, or a new one) as a JSON string. 400: the id is open already."""
        body = parse(OpenSessionRequest, await read_json(request, ctx.server_args))
        return JSONResponse(await ctx.tm.open_session(OpenSessionReqInput(**body.model_dump())))

    @app.api_route("/close_session", methods=["GET", "POST"])
    async def close_session(request: Request):
        """Close a session: what it held goes back. 404: no such session is open."""
        body = parse(CloseSessionRequest, await read_json(request, ctx.server_args))
        await ctx.tm.close_session(CloseSessionReqInput(body.session_id))
        return Response(status_code=200)
