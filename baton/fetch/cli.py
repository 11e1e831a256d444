"""`baton fetch-model`: fetch an hf:// or s3:// model source into a cache folder once (the engine pods'
init container). Prints the model folder; a folder already complete for the same source is not fetched
again. Credentials come from the environment only (HF_TOKEN; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)
and are never printed. On failure the reason also goes to the pod's termination message, which the
operator puts in the InferenceService's ModelReady condition.

    baton fetch-model --source hf://Qwen/Qwen3-0.6B@main --cache-dir /model-cache
    HF_ENDPOINT=http://mirror:8080 baton fetch-model --source hf://org/name --cache-dir /tmp/c --include '*.json'
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import httpx

from baton.fetch import hub, s3
from baton.fetch.download import FetchError, completed, fetch_files, locked
from baton.fetch.source import InvalidSource, ModelSource, Scheme, parse_source

logger = logging.getLogger("baton.fetch")
TERMINATION_LOG = "/dev/termination-log"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True, help="hf://org/name[@revision] or s3://bucket/prefix")
    parser.add_argument("--cache-dir", required=True, type=Path, help="cache root; the model goes to a folder "
                        "under it named by the source (hf/<org>/<name>/<revision>, s3/<bucket>/<prefix>)")
    parser.add_argument("--include", action="append", default=[], metavar="GLOB",
                        help="fetch only the files matching (repeatable; default: all)")
    parser.add_argument("--endpoint", default=None, help="Hub or S3 endpoint (default: $HF_ENDPOINT or "
                        "https://huggingface.co; $AWS_ENDPOINT_URL or https://s3.<region>.amazonaws.com)")
    parser.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"), help="S3 region")
    parser.add_argument("--retries", type=int, default=5, help="tries after a network error (each resumes)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a retry")
    parser.add_argument("--termination-log", default=TERMINATION_LOG,
                        help="file the failure reason is written to (Kubernetes' termination message)")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def _s3_credentials() -> s3.Credentials | None:
    access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        return None
    return s3.Credentials(access, secret, os.environ.get("AWS_SESSION_TOKEN") or None)


def _fetch(src: ModelSource, args: argparse.Namespace, folder: Path) -> None:
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    if src.scheme is Scheme.HF:
        endpoint = args.endpoint or os.environ.get("HF_ENDPOINT") or hub.DEFAULT_ENDPOINT
        token = _token()
        with httpx.Client(timeout=timeout, follow_redirects=True) as client:
            commit, files = hub.list_files(client, endpoint, src, token, tuple(args.include))
            logger.info("%s: commit %s, %d files", src.uri, commit, len(files))
            fetch_files(client, folder, files, hub.auth_headers(token), src.uri, commit)
        return
    endpoint = args.endpoint or os.environ.get("AWS_ENDPOINT_URL") or s3.default_endpoint(args.region)
    creds = _s3_credentials()
    with httpx.Client(timeout=timeout, auth=s3.S3Signer(creds, args.region)) as client:
        files = s3.list_files(client, endpoint, src, creds is not None)
        logger.info("%s: %d objects", src.uri, len(files))
        fetch_files(client, folder, files, {}, src.uri, None)


def fetch(src: ModelSource, args: argparse.Namespace) -> Path:
    """The complete model folder, fetched now unless it already was."""
    folder = args.cache_dir / src.cache_key
    if completed(folder, src.uri):
        logger.info("%s: already complete in %s", src.uri, folder)
        return folder
    with locked(folder):
        if completed(folder, src.uri):  # another pod finished it while this one waited
            logger.info("%s: completed by another pod in %s", src.uri, folder)
            return folder
        for attempt in range(args.retries + 1):
            try:
                _fetch(src, args, folder)
                return folder
            except httpx.TransportError as e:  # FetchError (HTTP answers, checks) is not retried here
                if attempt == args.retries:
                    raise FetchError(f"{src.uri}: network error after {attempt + 1} tries: {e!r}") from None
                wait = min(2 ** attempt, 30)
                logger.warning("%s: %r; resuming in %d s", src.uri, e, wait)
                time.sleep(wait)
    raise AssertionError("unreachable")


def _say_failure(args: argparse.Namespace, message: str) -> None:
    print(f"baton fetch-model: {message}", file=sys.stderr)
    try:
        with open(args.termination_log, "w") as f:
            f.write(message[:4000])  # Kubernetes keeps at most 4096 bytes
    except OSError:
        pass


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        src = parse_source(args.source)
    except InvalidSource as e:
        _say_failure(args, str(e))
        return 2
    if not src.scheme.fetched:
        _say_failure(args, f"{args.source}: only hf:// and s3:// sources are fetched")
        return 2
    try:
        folder = fetch(src, args)
    except (FetchError, OSError) as e:
        _say_failure(args, str(e))
        return 1
    print(folder)
    return 0
