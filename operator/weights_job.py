"""The weights Job's last step (spec.model.updateStrategy InPlace): ask the router to update every engine
from the cache folder the Job's init container just filled, and say how it went.

    python -m baton.operator.weights_job --url http://NAME-router.NS:8000/update_weights_from_disk \
        --model-path /model-cache/hf/org/name/REV --weight-version hf://org/name@REV

Runs in the engine image, which has no operator dependencies: the standard library only. The router's
API key comes from $BATON_ROUTER_API_KEY (the Secret spec.router.apiKeySecretRef names). Exit 0 when
the router answered 200 (every engine serves the new weights); else 1, with the reason on stderr and in
the termination message, which the operator copies into the WeightsUpdated condition.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

KEY_ENV = "BATON_ROUTER_API_KEY"
TERMINATION_LOG = "/dev/termination-log"
MAX_REASON = 1500  # a termination message holds 4 KiB; the router names each failed worker


def update(url: str, model_path: str, weight_version: str, api_key: str | None = None,
           timeout: float = 1800.0) -> tuple[bool, str]:
    """POST the update; (ok, what the router said). A refused connection or a timeout is a failure too."""
    body = json.dumps({"model_path": model_path, "weight_version": weight_version}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return True, _message(resp.read(), resp.status)
    except urllib.error.HTTPError as e:
        return False, f"the router answered {e.code}: {_message(e.read(), e.code)}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"cannot reach the router at {url}: {getattr(e, 'reason', e)}"


def _message(raw: bytes, status: int) -> str:
    try:
        answer = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:MAX_REASON] or f"HTTP {status}"
    if isinstance(answer, dict) and answer.get("message"):
        return str(answer["message"])[:MAX_REASON]
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message", answer["error"]))[:MAX_REASON]
    return json.dumps(answer)[:MAX_REASON]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.operator.weights_job", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the router's /update_weights_from_disk")
    p.add_argument("--model-path", required=True, help="the new weights' folder, as the engines mount it")
    p.add_argument("--weight-version", required=True, help="the version the engines report after it")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the router's answer")
    p.add_argument("--termination-log", default=TERMINATION_LOG, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ok, said = update(args.url, args.model_path, args.weight_version, os.environ.get(KEY_ENV), args.timeout)
    line = (f"weights updated to {args.weight_version}: {said}" if ok
            else f"updating the weights to {args.weight_version} failed: {said}")
    print(line, file=sys.stdout if ok else sys.stderr, flush=True)
    if not ok:
        try:
            with open(args.termination_log, "w") as f:
                f.write(line)
        except OSError:
            pass  # outside a pod: stderr said it
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
