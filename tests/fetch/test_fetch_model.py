"""`baton fetch-model` as the init container runs it (a subprocess, HF_ENDPOINT or AWS_ENDPOINT_URL in its
environment) against a real HTTP server in the Hub's layout (and an S3 bucket): files land whole and
verified, a second run fetches nothing, a part file or a dropped connection resumes with a Range, and a
missing repository, a private one without or with a wrong token, a hostile file name each fail with a clear
reason (in the termination message too) and never print the token."""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton.fetch.s3 import Credentials, sign
from baton.fetch.source import parse_source
from baton_testing.model_hub import Bucket, ModelHub, Repo

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_" + "s3cr3tT0kenValue" * 2
FILES = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}" * 1000,
         "model.safetensors": os.urandom(300_000), "sub/extra.txt": b"hello"}


def run_fetch(source: str, cache: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_"))}
    clean["PYTHONPATH"] = str(ROOT) + os.pathsep + clean.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "baton", "fetch-model", "--source", source, "--cache-dir",
                           str(cache), "--termination-log", str(cache.parent / "termination-log"), *extra],
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)


@pytest.fixture
def hub():
    with ModelHub() as server:
        server.repos["acme/tiny"] = Repo(dict(FILES), lfs=("model.safetensors",))
        server.repos["acme/private"] = Repo({"config.json": b"{}"}, token=TOKEN)
        yield server


def test_fetches_every_file_then_skips(hub, tmp_path):
    r = run_fetch("hf://acme/tiny@main", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert r.returncode == 0, r.stderr
    folder = tmp_path / "cache" / "hf" / "acme" / "tiny" / "main"
    assert r.stdout.strip() == str(folder)
    assert {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".baton")} == FILES
    marker = json.loads((folder / ".baton-complete.json").read_text())
    assert marker["source"] == "hf://acme/tiny@main" and marker["revision"] == hub.repos["acme/tiny"].commit
    # files come from the commit the listing named, never a moving branch
    assert all(f"/resolve/{hub.repos['acme/tiny'].commit}/" in p for p, _ in hub.resolves())
    assert len(hub.resolves()) == len(FILES)

    before = len(hub.requests)
    again = run_fetch("hf://acme/tiny@main", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert again.returncode == 0 and again.stdout.strip() == str(folder)
    assert len(hub.requests) == before, "a complete folder is not fetched again (not even listed)"


def test_resumes_a_part_file_and_a_dropped_connection(hub, tmp_path):
    folder = tmp_path / "cache" / "hf" / "acme" / "tiny" / "main"
    folder.mkdir(parents=True)
    weights = FILES["model.safetensors"]
    (folder / "model.safetensors.part").write_bytes(weights[:100_000])  # an earlier pod died here
    hub.cut_once.add("tokenizer.json")  # and this one's connection drops halfway
    r = run_fetch("hf://acme/tiny", tmp_path / "cache", {"HF_ENDPOINT": hub.url}, "--retries", "2")
    assert r.returncode == 0, r.stderr
    assert (folder / "model.safetensors").read_bytes() == weights
    assert (folder / "tokenizer.json").read_bytes() == FILES["tokenizer.json"]
    ranges = {p.rsplit("/", 1)[1]: h.get("range") for p, h in hub.resolves() if h.get("range")}
    assert ranges["model.safetensors"] == "bytes=100000-"
    assert ranges["tokenizer.json"] == f"bytes={len(FILES['tokenizer.json']) // 2}-"
    total = sum(map(len, FILES.values()))
    assert hub.bytes_served == total - 100_000, "nothing is downloaded twice"
    assert not list(folder.rglob("*.part"))


def test_a_corrupt_part_is_refused_by_its_sha256(hub, tmp_path):
    folder = tmp_path / "cache" / "hf" / "acme" / "tiny" / "main"
    folder.mkdir(parents=True)
    (folder / "model.safetensors.part").write_bytes(b"\0" * 1000)  # not the file's first bytes
    r = run_fetch("hf://acme/tiny", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert r.returncode == 1
    assert "model.safetensors: sha256" in r.stderr and "deleted" in r.stderr
    assert not (folder / ".baton-complete.json").exists()
    retry = run_fetch("hf://acme/tiny", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert retry.returncode == 0, retry.stderr  # the next try (the init container's restart) starts over
    assert (folder / "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_missing_repository_says_404(hub, tmp_path):
    r = run_fetch("hf://acme/nothing@main", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert r.returncode == 1
    assert "no model repository 'acme/nothing' with revision 'main' (HTTP 404)" in r.stderr
    assert "HTTP 404" in (tmp_path / "termination-log").read_text()


def test_private_repository_wants_the_token_and_never_prints_it(hub, tmp_path):
    anonymous = run_fetch("hf://acme/private", tmp_path / "a", {"HF_ENDPOINT": hub.url})
    assert anonymous.returncode == 1
    assert "access denied (HTTP 401)" in anonymous.stderr and "HF_TOKEN" in anonymous.stderr

    wrong = run_fetch("hf://acme/private", tmp_path / "b", {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN[:-1]})
    assert wrong.returncode == 1 and "access denied (HTTP 403)" in wrong.stderr and "refused" in wrong.stderr

    right = run_fetch("hf://acme/private", tmp_path / "c", {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    assert right.returncode == 0, right.stderr
    assert (tmp_path / "c" / "hf" / "acme" / "private" / "main" / "config.json").read_bytes() == b"{}"
    for r in (anonymous, wrong, right):
        assert TOKEN[:12] not in r.stdout + r.stderr
    assert TOKEN[:12] not in (tmp_path / "termination-log").read_text()


def test_a_hostile_file_name_is_refused(hub, tmp_path):
    hub.repos["acme/tiny"].extra_listing = [{"rfilename": "../../escape.txt", "size": 1}]
    r = run_fetch("hf://acme/tiny", tmp_path / "cache", {"HF_ENDPOINT": hub.url})
    assert r.returncode == 1 and "'../../escape.txt'" in r.stderr and "refusing" in r.stderr
    assert not list(tmp_path.rglob("escape.txt"))
    assert not hub.resolves(), "refused before downloading anything"


def test_include_fetches_only_matching_files(hub, tmp_path):
    r = run_fetch("hf://acme/tiny", tmp_path / "cache", {"HF_ENDPOINT": hub.url}, "--include", "*.json")
    assert r.returncode == 0, r.stderr
    got = sorted(p.rsplit("/", 1)[1] for p, _ in hub.resolves())
    assert got == ["config.json", "tokenizer.json"]


def test_s3_prefix_is_fetched_with_signed_requests(tmp_path):
    with ModelHub() as server:
        server.buckets["models"] = Bucket({"qwen/config.json": b"{}", "qwen/w.safetensors": os.urandom(50_000),
                                           "other/x": b"no"}, access_key="AKIDTEST", secret_key="secret/key")
        env = {"AWS_ENDPOINT_URL": server.url, "AWS_ACCESS_KEY_ID": "AKIDTEST", "AWS_SECRET_ACCESS_KEY": "secret/key"}
        r = run_fetch("s3://models/qwen", tmp_path / "cache", env)
        assert r.returncode == 0, r.stderr
        folder = tmp_path / "cache" / "s3" / "models" / "qwen"
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".baton")) == \
            ["config.json", "w.safetensors"]
        assert (folder / "w.safetensors").read_bytes() == server.buckets["models"].objects["qwen/w.safetensors"]

        bad = run_fetch("s3://models/qwen", tmp_path / "other", {**env, "AWS_SECRET_ACCESS_KEY": "wrong"})
        assert bad.returncode == 1 and "access denied (HTTP 403)" in bad.stderr
        assert "wrong" not in bad.stderr.replace("were refused", "")


def test_sigv4_matches_aws_published_examples():
    """The GET Object and GET Bucket examples of AWS's Signature Version 4 documentation for S3."""
    creds = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    when = dt.datetime(2013, 5, 24, tzinfo=dt.timezone.utc)
    get = sign("GET", "https://examplebucket.s3.amazonaws.com/test.txt", {}, {"Range": "bytes=0-9"}, creds,
               "us-east-1", when)
    assert get["Authorization"].endswith("SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
                                         "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
    listing = sign("GET", "https://examplebucket.s3.amazonaws.com/", {"max-keys": "2", "prefix": "J"}, {}, creds,
                   "us-east-1", when)
    assert listing["Authorization"].endswith("Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7")


@pytest.mark.parametrize("uri,key", [("hf://Qwen/Qwen3-0.6B", "hf/Qwen/Qwen3-0.6B/main"),
                                     ("hf://a/b@refs/pr/1", "hf/a/b/refs/pr/1"),
                                     ("s3://my-bucket/models/x/", "s3/my-bucket/models/x"),
                                     ("s3://my-bucket", "s3/my-bucket/_")])
def test_cache_keys(uri, key):
    assert parse_source(uri).cache_key == key
