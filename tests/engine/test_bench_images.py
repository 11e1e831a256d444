"""`baton bench` with pictures: the image workload and the chat requests it sends, the options, compare's
image table (on test_bench.py's fake server), and one short run against a tiny vision-language engine."""
from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import hashlib
import io
import json

import pytest

from baton.cli import main as baton_main
from baton.engine.bench import cli as bench_cli
from baton.engine.bench.client import _chunk_text, completion_body, endpoint, run_requests
from baton.engine.bench.workload import WorkloadConfig, build_workload, workload_config_from_args
from engine_server import running_engine
from test_bench import FakeOpenAI, fake_engine_command, fake_server
from tiny_vl import make_tiny_vl_model


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return make_tiny_vl_model("qwen3_5", tmp_path_factory.mktemp("bench-vl"))


@pytest.fixture(scope="module")
def tokenizer(vl_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_path)


def _decoded(url: str):
    """(sha256 of the PNG, the picture) of a data URL; asserts it is a PNG."""
    from PIL import Image

    head, b64 = url.split(",", 1)
    assert head == "data:image/png;base64"
    png = base64.b64decode(b64)
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "RGB"
    return hashlib.sha256(png).hexdigest(), image


def _hashes(prompts) -> list[list[str]]:
    return [[_decoded(u)[0] for u in p.images] for p in prompts]


def test_distinct_pictures_differ_across_requests_and_rounds(tokenizer):
    config = WorkloadConfig(4, 16, 3, seed=5, images_per_request=2, image_size=(40, 24), image_reuse="distinct")
    prompts = build_workload(tokenizer, config)
    text_only = build_workload(tokenizer, dataclasses.replace(config, images_per_request=0))
    assert [p.text for p in prompts] == [p.text for p in text_only] and not any(p.images for p in text_only)
    assert all(_decoded(u)[1].size == (40, 24) for p in prompts for u in p.images)
    hashes = _hashes(prompts)
    assert all(len(h) == 2 for h in hashes) and len({h for hs in hashes for h in hs}) == 8
    assert _hashes(build_workload(tokenizer, config)) == hashes  # the seed makes them
    next_round = _hashes(build_workload(tokenizer, dataclasses.replace(config, seed=6)))
    assert not {h for hs in next_round for h in hs} & {h for hs in hashes for h in hs}


def test_shared_pictures_are_the_same_in_every_request_of_a_round(tokenizer):
    config = WorkloadConfig(3, 16, 3, seed=5, images_per_request=2, image_size=(40, 24), image_reuse="shared")
    hashes = _hashes(build_workload(tokenizer, config))
    assert hashes[0] == hashes[1] == hashes[2] and len(set(hashes[0])) == 2
    next_round = _hashes(build_workload(tokenizer, dataclasses.replace(config, seed=6)))
    distinct = _hashes(build_workload(tokenizer, dataclasses.replace(config, image_reuse="distinct")))
    assert not set(next_round[0]) & set(hashes[0]) and not {h for hs in distinct for h in hs} & set(hashes[0])


def test_a_prompt_with_pictures_is_a_chat_of_its_text_then_its_image_parts(tokenizer):
    config = WorkloadConfig(2, 16, 3, images_per_request=2, image_size=(16, 16))
    with_images, text = build_workload(tokenizer, config)[0], build_workload(tokenizer, WorkloadConfig(2, 16, 3))[0]
    body = completion_body("m", with_images)
    assert endpoint(with_images) == "/v1/chat/completions" and "prompt" not in body
    (message,) = body["messages"]
    assert message["role"] == "user" and [p["type"] for p in message["content"]] == ["text", "image_url", "image_url"]
    assert message["content"][0]["text"] == with_images.text
    assert [p["image_url"]["url"] for p in message["content"][1:]] == list(with_images.images)
    assert body["ignore_eos"] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert endpoint(text) == "/v1/completions" and completion_body("m", text)["prompt"] == text.text
    # the role chunk that opens a chat stream carries no text: it must not end the TTFT
    assert _chunk_text({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) == ""
    assert _chunk_text({"choices": [{"index": 0, "delta": {"content": " w"}}]}) == " w"


def test_the_client_streams_image_prompts_as_chat_completions(tokenizer):
    prompts = build_workload(tokenizer, WorkloadConfig(3, 16, 4, images_per_request=1, image_size=(8, 8)))
    fake = FakeOpenAI()
    with fake_server(fake) as url:
        results, _ = asyncio.run(run_requests(url, "fake-model", prompts, concurrency=3))
    assert len(fake.bodies) == 3 and all("messages" in b for b in fake.bodies)
    # the server's prompt count (it alone knows a picture's tokens), and every content chunk timed
    assert all(r.success and r.output_tokens == 4 and r.prompt_len == 3 and len(r.itl) == 3 for r in results)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_cli_args(parser)
    return parser.parse_args(list(argv))


def test_the_cli_parses_the_image_options():
    args = _parse("compare", "--model-path", "m", "--images-per-request", "2", "--image-size", "64x32",
                  "--image-reuse", "distinct")
    config = workload_config_from_args(args)
    assert (config.images_per_request, config.image_size, config.image_reuse) == (2, (64, 32), "distinct")
    config = workload_config_from_args(_parse("serving", "--base-url", "u", "--tokenizer", "t"))
    assert (config.images_per_request, config.image_size, config.image_reuse) == (0, (448, 448), "shared")
    for bad in (["--image-size", "64"], ["--image-size", "0x8"], ["--image-reuse", "some"]):
        with pytest.raises(SystemExit):
            _parse("compare", "--model-path", "m", *bad)
    with pytest.raises(SystemExit, match="text workload only"):
        baton_main(["bench", "hf", "--model-path", "m", "--images-per-request", "1"])


def test_compare_with_pictures_skips_hf_and_prints_requests_and_ttft_ratios(vl_path, capsys):
    from baton.engine.bench.compare import parse_variant, run_compare

    config = WorkloadConfig(4, 12, 3, images_per_request=1, image_size=(16, 16), image_reuse="distinct")
    results = run_compare(vl_path, config, concurrency=2, variants=[parse_variant("a:"), parse_variant("b:--x")],
                          startup_timeout_s=60, command_factory=fake_engine_command, repeats=2)
    assert len(results["rounds"]) == 2 and all(r["hf"] == {} for r in results["rounds"])
    for round_ in results["rounds"]:
        assert all(v["completed"] == 4 and v["images_per_request"] == 1 for v in round_["variants"].values())
    b = results["summary"]["b"]
    expected = [r["variants"]["b"]["request_throughput"] / r["variants"]["a"]["request_throughput"]
                for r in results["rounds"]]
    assert b["ratios"]["req/s vs a"]["rounds"] == pytest.approx(expected)
    assert set(b["ratios"]) == {"req/s vs a", "TTFT mean vs a", "TTFT p50 vs a"} and len(b["ttft_p99_ms"]) == 2
    out = capsys.readouterr().out
    assert "HF baselines skipped" in out and out.count("== comparison, image workload") == 2
    assert "req/s/first" in out and "TTFT p50/first" in out and "== summary over rounds" in out


def _serve_bench(base_url: str, vl_path: str, reuse: str, out) -> dict:
    assert baton_main(["bench", "serving", "--base-url", base_url, "--tokenizer", vl_path, "--num-prompts", "4",
                       "--concurrency", "2", "--input-len", "16", "--output-len", "4", "--images-per-request", "1",
                       "--image-size", "64x48", "--image-reuse", reuse, "--json-out", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_serving_sends_pictures_to_a_vision_language_engine(vl_path, tmp_path, capsys):
    with running_engine(vl_path) as engine:
        shared = _serve_bench(engine.base_url, vl_path, "shared", tmp_path / "shared.json")
        distinct = _serve_bench(engine.base_url, vl_path, "distinct", tmp_path / "distinct.json")
    for r in (shared, distinct):
        assert (r["completed"], r["output_tokens"], r["images_per_request"]) == (4, 16, 1)
        assert r["request_throughput"] > 0 and 0 < r["ttft"]["p50_ms"] <= r["ttft"]["p99_ms"]
        assert r["input_tokens"] > 4 * 16, "the server's prompt count, the pictures' tokens in it"
    assert shared["workload"]["image_reuse"] == "shared" and distinct["workload"]["image_size"] == [64, 48]
    # requests 3 and 4 start after 1 and 2 are done: their picture is in the embeddings' cache
    assert shared["mm"]["mm_cache_hits"] >= 2 and shared["mm"]["mm_images_encoded"] <= 2
    assert distinct["mm"] == {"mm_images_encoded": 4, "mm_cache_hits": 0, "mm_cache_misses": 4}
    assert "embedding cache hits: 0, misses: 4" in capsys.readouterr().out
