"""The OpenAI-compatible server, driven live with the official `openai` client (and raw HTTP for
what a client library will not send): completions and chat, streaming and not, concurrent slots
equal to solo runs, stop strings, logprobs, every error case, disconnects, slot save / restore,
and a load test through tools/load_test (MUSE_LOAD_REQUESTS for a larger one)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from muse_mlx.generate import generate_tokens  # noqa: E402
from muse_mlx.grammar import Grammars  # noqa: E402
from muse_mlx.model import load  # noqa: E402
from muse_mlx.sampling import Sampler, SamplerSettings  # noqa: E402
from muse_mlx.tokenizer import MuseTokenizer  # noqa: E402

KEY = "test-key"
CTX = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path, *extra, parallel=2, preexec_fn=None):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "muse_mlx.server", "--model", str(model_path), "--port", str(port),
                             "--parallel", str(parallel), "--ctx-size", str(CTX), "--reference", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server(f32_fixture, tmp_path_factory):
    saves = tmp_path_factory.mktemp("slots")
    proc, base = start_server(f32_fixture, "--api-key", KEY, "--slot-save-path", str(saves), "--queue", "32")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(f32_fixture):
    """Each prompt's solo run in-process (one slot, the CLI's decode loop), as text."""
    model = load(f32_fixture, backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    memo = {}

    def run(ids, n, settings=SamplerSettings(), as_ids=False, grammar=None):
        """grammar: (kind, text) the output follows (grammar.Grammars.compile's)."""
        key = (tuple(ids), n, settings, grammar)
        if key not in memo:
            cache = model.make_cache(max(CTX, len(ids) + n + 1))
            constraint = Grammars(tok).compile(*grammar, "g") if grammar else None
            breakers = tok.dry_breakers(settings.dry_sequence_breakers) if settings.dry else None
            memo[key] = list(generate_tokens(model, cache, list(ids), Sampler(settings, list(ids), (), constraint, breakers), n,
                                             tok.stop_ids))
        return memo[key] if as_ids else tok.decode(memo[key])
    return run


def prompt_ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_models_health_slots(server, client):
    assert [m.id for m in client.models.list().data]
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["slots_idle"] + health["slots_processing"] == 2
    slots = httpx.get(server + "/slots", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == CTX for s in slots)


def test_props(server):
    """llama-server's /props, the part that applies: the slots, each slot's context, the defaults
    of a request's sampling fields (what a request that names none gets), the chat template; behind
    the API key like the other routes but /health."""
    assert httpx.get(server + "/props").status_code == 401
    p = httpx.get(server + "/props", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert p["total_slots"] == 2 and p["default_generation_settings"]["n_ctx"] == CTX
    params = p["default_generation_settings"]["params"]
    assert params["temperature"] == 1.0 and params["top_k"] == 0 and params["repeat_last_n"] == 64
    assert params["repeat_penalty"] == 1.0 and params["logit_bias"] == []
    assert "{%" in p["chat_template"] and p["batch_invariant"] is False and p["build_info"].startswith("muse_mlx ")


def test_tokenize_and_detokenize(server, f32_fixture):
    """llama-server's /tokenize and /detokenize: the ids the in-process tokenizer gives (no BOS
    unless add_special), pieces whose bytes rebuild the text, ids back to the text; bad bodies 400."""
    h = {"Authorization": f"Bearer {KEY}"}
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    text = "The ring holds café ☕ and 7 rows."

    def post(route, body):
        return httpx.post(server + route, headers=h, json=body)
    r = post("/tokenize", {"content": text}).json()
    assert r["tokens"] == tok.encode(text, add_bos=False)
    with_bos = post("/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == tok.encode(text, add_bos=True)
    pieces = post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"]
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text
    assert post("/detokenize", {"tokens": r["tokens"]}).json()["content"] == text
    for route, body, param in (("/tokenize", {"content": 5}, "content"), ("/tokenize", {}, "content"),
                               ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
                               ("/detokenize", {"tokens": [1, 10**9]}, "tokens"), ("/detokenize", {"tokens": "1"}, "tokens"),
                               ("/detokenize", {"tokens": [True]}, "tokens")):
        r = post(route, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, body, r.text)
    r = httpx.post(server + "/tokenize", headers=h, content=b'{"content": "a\\udc80"}')   # a lone surrogate
    assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text
    assert httpx.post(server + "/tokenize", json={"content": "x"}).status_code == 401


def test_completion_streaming_and_not_equal_the_solo_run(client, solo):
    ids = prompt_ids(20, 1)
    r = client.completions.create(model="m", prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == solo(ids, 24)
    assert r.usage.prompt_tokens == 20 and r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    parts = list(client.completions.create(model="m", prompt=ids, max_tokens=24, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    # llama-server's timings: in the body, and in the stream's last chunk
    for t in (r.model_extra["timings"], parts[-1].model_extra["timings"]):
        assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (0, 20, 24)
        assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["prompt_cache_ms"] == 0
        assert t["prompt_per_second"] == pytest.approx(20 / t["prompt_ms"] * 1e3)
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 24)
    assert all("timings" not in p.model_extra for p in parts[:-1])


def test_chat_streaming_and_not(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a ring?"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 12
    parts = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == r.choices[0].message.content and parts[-1].usage.completion_tokens == r.usage.completion_tokens


def test_concurrent_requests_equal_their_solo_runs(client, solo):
    """Six requests on two slots at once, greedy: each text equals its solo run's (the packed
    step against one sequence at a time)."""
    jobs = [(prompt_ids(5 + 7 * i, 10 + i), 10 + 3 * i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda j: client.completions.create(model="m", prompt=j[0], max_tokens=j[1],
                                                                   temperature=0).choices[0].text, jobs))
    assert texts == [solo(ids, n) for ids, n in jobs]


def test_penalties_and_logit_bias_equal_the_solo_run(client, solo):
    """Greedy requests with llama.cpp's penalties (frequency, presence, repeat over the last 32
    tokens, the prompt's among them) and with a logit bias, sent at once to the two slots: each
    text equals its solo run with the same settings (the CLI's loop), and differs from the plain
    greedy run. (tests/test_sampling.py checks the arithmetic against the pinned llama.cpp.)"""
    start = prompt_ids(30, 21)
    ids = start + solo(start, 12, as_ids=True)   # the prompt holds tokens its greedy continuation takes again
    plain = solo(ids, 24)
    penalized = dict(frequency_penalty=1.5, presence_penalty=0.5, repeat_penalty=1.3, repeat_last_n=32)
    biased = {"logit_bias": {"101": 100}}
    bodies = [dict(frequency_penalty=1.5, presence_penalty=0.5, extra_body={"repeat_penalty": 1.3, "repeat_last_n": 32}),
              dict(extra_body=biased)]   # repeat_* are llama-server's fields: not in the client's signature
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda kw: client.completions.create(model="m", prompt=ids, max_tokens=24, temperature=0,
                                                                    **kw).choices[0].text, bodies))
    assert texts[0] == solo(ids, 24, SamplerSettings(**penalized)) != plain
    assert texts[1] == solo(ids, 24, SamplerSettings(logit_bias=((101, 100.0),))) != plain


def test_id_slot_pins_a_request_to_its_slot(server, solo):
    """llama-server's id_slot: a request asking for a slot runs there, and its answer names the slot
    (in the body, and in a stream's last chunk, as llama-server's); three requests asking for slot 0
    at once wait for it in turn while one asking for any slot is served; every text equals its solo
    run. A slot the server does not have is a 400."""
    h = {"Authorization": f"Bearer {KEY}"}
    ids = prompt_ids(9, 31)

    def post(body):
        return httpx.post(server + "/v1/completions", headers=h, timeout=120,
                          json={"prompt": ids, "max_tokens": 6, "temperature": 0, **body})
    for want in (1, 0, 1):
        r = post({"id_slot": want})
        assert r.status_code == 200 and r.json()["id_slot"] == want, r.text
        assert r.json()["choices"][0]["text"] == solo(ids, 6)
    with httpx.stream("POST", server + "/v1/completions", headers=h, timeout=120,
                      json={"prompt": ids, "max_tokens": 6, "temperature": 0, "id_slot": 1, "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert chunks[-1]["id_slot"] == 1 and "".join(c["choices"][0]["text"] for c in chunks) == solo(ids, 6)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(post, [{"id_slot": 0}, {"id_slot": 0}, {}, {"id_slot": 0}]))
    assert all(a.status_code == 200 and a.json()["choices"][0]["text"] == solo(ids, 6) for a in answers)
    assert [a.json()["id_slot"] for a in answers][:2] + [answers[3].json()["id_slot"]] == [0, 0, 0]
    for bad in (2, -2, "0", 1.0):
        r = post({"id_slot": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text


def test_seeded_sampling_is_reproducible_per_slot(client, solo):
    ids = prompt_ids(12, 3)
    kw = dict(model="m", prompt=ids, max_tokens=16, temperature=0.9, top_k=40, seed=11)
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda _: client.completions.create(**{k: v for k, v in kw.items() if k != "top_k"},
                                                                   extra_body={"top_k": 40}).choices[0].text, range(3)))
    assert len(set(texts)) == 1
    assert texts[0] == solo(ids, 16, SamplerSettings(temp=0.9, top_k=40, seed=11))


def test_stop_strings_are_matched_across_tokens_and_not_emitted(client, solo):
    ids = prompt_ids(15, 4)
    full = solo(ids, 30)
    stop = full[9:13]                       # four characters from the middle, probably across tokens
    r = client.completions.create(model="m", prompt=ids, max_tokens=30, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    parts = list(client.completions.create(model="m", prompt=ids, max_tokens=30, temperature=0, stop=stop,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full[:full.index(stop)]


def test_logprobs(client, f32_fixture):
    """Each token's log-prob and the top 3, against a float64 log-softmax of the model's own logits
    (in process, the prompt and the answer's tokens teacher-forced), most likely first."""
    from muse_mlx.tools.oracle import log_softmax

    ids = prompt_ids(10, 5)
    r = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text
    model = load(f32_fixture, backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    answer = list(generate_tokens(model, model.make_cache(CTX), ids, Sampler(SamplerSettings()), 6, tok.stop_ids))
    assert tok.decode(answer) == r.choices[0].text
    logits = np.array(model.prefill(ids + answer[:-1], model.make_cache(CTX), all_logits=True), dtype=np.float64)
    want = log_softmax(logits[len(ids) - 1:])
    for step, (token, chosen, top) in enumerate(zip(answer, lp.token_logprobs, lp.top_logprobs)):
        assert abs(chosen - want[step, token]) < 1e-5
        expected = {}   # keyed by text, as OpenAI's format is: of tokens of one text, the most likely
        for i in np.argsort(-want[step], kind="stable")[:3]:
            expected.setdefault(tok.decode([int(i)]), want[step, i])
        assert list(top) == list(expected), step
        assert np.allclose(list(top.values()), list(expected.values()), atol=1e-5)
    c = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)


def test_n_predict_is_max_tokens(server, solo):
    """llama-server's n_predict stands for max_tokens when max_tokens is not given (-1: until the
    slot is full); below -1 it is a 400."""
    h = {"Authorization": f"Bearer {KEY}"}
    ids = prompt_ids(7, 41)
    r = httpx.post(server + "/v1/completions", headers=h, timeout=120,
                   json={"prompt": ids, "n_predict": 20, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 20 and r["choices"][0]["text"] == solo(ids, 20)
    r = httpx.post(server + "/v1/completions", headers=h, timeout=120,
                   json={"prompt": prompt_ids(CTX - 4, 42), "n_predict": -1, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] <= 4
    r = httpx.post(server + "/v1/completions", headers=h, json={"prompt": ids, "n_predict": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict"
    r = httpx.post(server + "/v1/completions", headers=h, json={"prompt": ids, "max_tokens": 3, "n_predict": 9,
                                                                "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 3


def test_llama_server_completion_route(server, solo, f32_fixture):
    """llama-server's own /completion (and /completions): its answer's fields (content, tokens
    with return_tokens, stop, stop_type, tokens_predicted and _evaluated, generation_settings,
    timings), streamed as one object an event with no [DONE], the last with stop true; each text
    equal to the solo run's."""
    h = {"Authorization": f"Bearer {KEY}"}
    ids = prompt_ids(11, 61)

    def post(body, route="/completion"):
        return httpx.post(server + route, headers=h, timeout=120, json={"prompt": ids, "temperature": 0, **body})
    r = post({"n_predict": 12, "return_tokens": True})
    assert r.status_code == 200, r.text
    a = r.json()
    assert a["content"] == solo(ids, 12) and a["tokens"] == solo(ids, 12, as_ids=True)
    assert (a["stop"], a["stop_type"], a["stopping_word"]) == (True, "limit", "")
    assert (a["tokens_predicted"], a["tokens_evaluated"], a["tokens_cached"]) == (12, 11, 23)
    assert a["generation_settings"]["n_predict"] == 12 and a["generation_settings"]["temperature"] == 0
    assert a["timings"]["predicted_n"] == 12 and a["id_slot"] in (0, 1) and a["has_new_line"] == ("\n" in a["content"])
    assert "completion_probabilities" not in a
    b = post({"n_predict": 12}, "/completions").json()
    assert b["content"] == a["content"] and b["tokens"] == []
    with httpx.stream("POST", server + "/completion", headers=h, timeout=120,
                      json={"prompt": ids, "temperature": 0, "n_predict": 12, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert not any("[DONE]" in line for line in lines)
    chunks = [json.loads(line[5:]) for line in lines]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == a["content"]
    assert [t for c in chunks[:-1] for t in c["tokens"]] == a["tokens"]
    assert chunks[-1]["content"] == "" and chunks[-1]["stop_type"] == "limit" and chunks[-1]["tokens_predicted"] == 12
    # a stop string: the answer ends before it, and names it
    full = a["content"]
    word = full[5:9]
    w = post({"n_predict": 12, "stop": ["\x00never", word]}).json()
    assert (w["content"], w["stop_type"], w["stopping_word"]) == (full[:full.index(word)], "word", word)
    # the stop token: forced by a bias it ends the answer at once ("eos"); with ignore_eos it is sampled as any
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    eos = min(tok.stop_ids)
    e = post({"n_predict": 5, "logit_bias": [[eos, 100]]}).json()
    assert (e["stop_type"], e["tokens_predicted"], e["content"]) == ("eos", 0, "")
    e = post({"n_predict": 5, "logit_bias": [[eos, 100]], "ignore_eos": True, "return_tokens": True}).json()
    assert (e["stop_type"], e["tokens_predicted"], e["tokens"]) == ("limit", 5, [eos] * 5)
    # llama-server's list form of a logit bias is OpenAI's object form (a repeated id's biases added);
    # its false bans the token (the greedy run's first token never appears), on OpenAI's route too
    listed = post({"n_predict": 10, "logit_bias": [[101, 60], [101, 40]]}).json()["content"]
    assert listed == solo(ids, 10, SamplerSettings(logit_bias=((101, 100.0),))) != solo(ids, 10)
    first = solo(ids, 1, as_ids=True)[0]
    for route in ("/completion", "/v1/completions"):
        banned = post({"n_predict": 10, "logit_bias": [[first, False]], "return_tokens": True}, route).json()
        tokens = banned["tokens"] if route == "/completion" else None
        text = banned["content"] if tokens is not None else banned["choices"][0]["text"]
        assert text == solo(ids, 10, SamplerSettings(logit_bias=((first, float("-inf")),))) != solo(ids, 10)
        assert tokens is None or first not in tokens


def test_llama_server_completion_probabilities(server, f32_fixture):
    """/completion's n_probs: each token's entry (id, text, bytes, log-prob) and the top n, against
    a float64 log-softmax of the model's logits (teacher-forced in process), most likely first."""
    from muse_mlx.tools.oracle import log_softmax

    h = {"Authorization": f"Bearer {KEY}"}
    ids = prompt_ids(10, 62)
    a = httpx.post(server + "/completion", headers=h, timeout=120,
                   json={"prompt": ids, "temperature": 0, "n_predict": 5, "n_probs": 3, "return_tokens": True}).json()
    probs = a["completion_probabilities"]
    assert [p["id"] for p in probs] == a["tokens"] and len(probs) == 5
    model = load(f32_fixture, backend="reference")
    logits = np.array(model.prefill(ids + a["tokens"][:-1], model.make_cache(CTX), all_logits=True), dtype=np.float64)
    want = log_softmax(logits[len(ids) - 1:])
    for step, p in enumerate(probs):
        assert abs(p["logprob"] - want[step, p["id"]]) < 1e-5
        top = np.argsort(-want[step], kind="stable")[:3]
        assert [t["id"] for t in p["top_logprobs"]] == [int(i) for i in top]
        assert np.allclose([t["logprob"] for t in p["top_logprobs"]], want[step, top], atol=1e-5)
        assert p["top_logprobs"][0]["id"] == p["id"]   # greedy: the most likely is the one taken
        assert bytes(p["bytes"]).decode("utf-8", "replace") == p["token"]
    with httpx.stream("POST", server + "/completion", headers=h, timeout=120,
                      json={"prompt": ids, "temperature": 0, "n_predict": 5, "n_probs": 3, "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert [c["completion_probabilities"] for c in chunks[:-1]] == [[p] for p in probs]


def test_post_sampling_probabilities(server, client, f32_fixture):
    """llama-server's post_sampling_probs: each token's `prob` and `top_probs` are those of what the
    pick drew from. Greedy, the picked token alone at 1; at temperature 1.3 after top-k 4, the
    float64 softmax of the four best logits over 1.3 (teacher-forced in process), most likely first;
    on the chat route the same entries; on /v1/completions a 400 naming it."""
    from muse_mlx.tools.oracle import log_softmax

    h = {"Authorization": f"Bearer {KEY}"}
    ids = prompt_ids(10, 65)
    greedy = httpx.post(server + "/completion", headers=h, timeout=120, json={
        "prompt": ids, "temperature": 0, "n_predict": 4, "n_probs": 3, "post_sampling_probs": True}).json()
    for p in greedy["completion_probabilities"]:
        assert p["prob"] == 1.0 and [(t["id"], t["prob"]) for t in p["top_probs"]] == [(p["id"], 1.0)], p
    hot = httpx.post(server + "/completion", headers=h, timeout=120, json={
        "prompt": ids, "temperature": 1.3, "top_k": 4, "seed": 2, "n_predict": 6, "n_probs": 5,
        "post_sampling_probs": True, "return_tokens": True}).json()
    model = load(f32_fixture, backend="reference")
    logits = np.array(model.prefill(ids + hot["tokens"][:-1], model.make_cache(CTX), all_logits=True), dtype=np.float64)
    for step, p in enumerate(hot["completion_probabilities"]):
        row = logits[len(ids) - 1 + step]
        best = np.argsort(-row, kind="stable")[:4]
        want = np.exp(log_softmax(row[best] / 1.3))
        assert [t["id"] for t in p["top_probs"]] == [int(i) for i in best], step
        assert np.allclose([t["prob"] for t in p["top_probs"]], want, atol=1e-5)
        assert p["id"] in best and abs(p["prob"] - want[list(best).index(p["id"])]) < 1e-5
    chat = httpx.post(server + "/v1/chat/completions", headers=h, timeout=120, json={
        "messages": [{"role": "user", "content": "a ring?"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
        "top_logprobs": 2, "post_sampling_probs": True}).json()
    assert all(e["prob"] == 1.0 and len(e["top_probs"]) == 1 for e in chat["choices"][0]["logprobs"]["content"])
    r = httpx.post(server + "/v1/completions", headers=h, json={"prompt": ids, "post_sampling_probs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "post_sampling_probs", r.text


SAMPLING_FIELDS = ["temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability",
                   "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "seed", "repeat_penalty", "repeat_last_n",
                   "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
                   "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta",
                   "samplers", "adaptive_target", "adaptive_decay", "post_sampling_probs", "n_probs", "logit_bias",
                   "min_keep"]


def test_sampling_fields_fuzzed_never_a_server_error(server):
    """300 /completion requests, each with 1-4 sampling fields at random values (numbers of every size
    and sign, strings, lists, objects, booleans, null): each answer is a 200 or a 400 naming one of
    the fields it sent, never a 5xx; the server is healthy after."""
    h = {"Authorization": f"Bearer {KEY}"}
    rng = np.random.default_rng(1205)
    values = [0, 1, -1, 2, 3, 0.5, -0.5, 1e-30, 1e30, 2 ** 31, -(2 ** 63), 1.75, 100, "x", "", "ki", "kpt", "edskypmxt",
              [], ["top_k"], ["temperature", "adaptive_p"], ["\n", ":"], [""], ["a"] * 20, [[1, 2.5]], [[1, False]],
              {"1": 3}, {}, True, False, None, [1, "x"], "\u00e9" * 50]
    for i in range(300):
        fields = rng.choice(SAMPLING_FIELDS, int(rng.integers(1, 5)), replace=False)
        body = {"prompt": prompt_ids(5, i), "n_predict": 2, **{f: values[int(rng.integers(len(values)))] for f in fields}}
        r = httpx.post(server + "/completion", headers=h, timeout=120, json=body)
        assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["param"] in set(fields) | {"prompt"}, (body, r.text[:300])
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_a_time_limit_ends_at_a_newline(server, f32_fixture):
    """llama-server's t_max_predict_ms: once the time since the first token's logits passes it, the
    next token whose text holds a newline ends the request (stop_type limit, finish_reason length);
    without it (or at 0, or -1) the request runs its n_predict."""
    h = {"Authorization": f"Bearer {KEY}"}
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    newline = tok.encode("\n", add_bos=False)
    assert len(newline) == 1
    body = {"prompt": prompt_ids(6, 66), "n_predict": 12, "temperature": 0, "logit_bias": [[newline[0], 100]]}
    r = httpx.post(server + "/completion", headers=h, timeout=120, json={**body, "t_max_predict_ms": 1}).json()
    assert r["stop_type"] == "limit" and 1 <= r["tokens_predicted"] < 12 and r["content"].endswith("\n"), r
    for off in (0, -1, None):
        r = httpx.post(server + "/completion", headers=h, timeout=120, json={**body, "t_max_predict_ms": off}).json()
        assert r["tokens_predicted"] == 12, r
    words = {**body, "logit_bias": [[newline[0], -100]], "t_max_predict_ms": 1}   # no newline: no stop
    assert httpx.post(server + "/completion", headers=h, timeout=120, json=words).json()["tokens_predicted"] == 12


def test_mixed_prompts(server, solo, f32_fixture):
    """llama-server's prompt forms, on /completion and /v1/completions alike: ids and strings mixed
    in one list (only a string at its start takes the BOS), a list holding one prompt; several
    prompts in one request are refused by name."""
    h = {"Authorization": f"Bearer {KEY}"}
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    head, tail = prompt_ids(6, 63), prompt_ids(4, 64)
    mixed = head + [" a ring"] + tail
    ids = head + tok.encode(" a ring", False) + tail
    for route, field in (("/completion", "content"), ("/v1/completions", None)):
        for prompt in (mixed, [mixed]):
            r = httpx.post(server + route, headers=h, timeout=120,
                           json={"prompt": prompt, "temperature": 0, "max_tokens": 8})
            assert r.status_code == 200, r.text
            text = r.json()[field] if field else r.json()["choices"][0]["text"]
            assert text == solo(ids, 8)
    led = ["The ring", 7, 8]
    r = httpx.post(server + "/completion", headers=h, timeout=120,
                   json={"prompt": led, "temperature": 0, "n_predict": 4}).json()
    assert r["tokens_evaluated"] == len(tok.encode("The ring")) + 2
    for bad in (["one", "two"], [[1, 2], [3]], [1, "x", None], [1, 10**9], [], [True, 2]):
        r = httpx.post(server + "/completion", headers=h, json={"prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


@pytest.mark.parametrize("body, param", [
    ({"n_probs": 21}, "n_probs"), ({"n_probs": -1}, "n_probs"), ({"return_tokens": 1}, "return_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"cache_prompt": 0}, "cache_prompt"),
    ({"logit_bias": [[1, True]]}, "logit_bias"), ({"logit_bias": [[1]]}, "logit_bias"),
    ({"logit_bias": [["a", 1]]}, "logit_bias"), ({"logit_bias": [[1, 101]]}, "logit_bias"),
    ({"logit_bias": [[1, 60], [1, 60]]}, "logit_bias"), ({"logit_bias": [[10**6, 1]]}, "logit_bias"),
    ({"post_sampling_probs": 1}, "post_sampling_probs"), ({"mirostat": 3}, "mirostat"),
    ({"mirostat_tau": "5"}, "mirostat_tau"), ({"mirostat_eta": None, "mirostat": 1.5}, "mirostat"),
    ({"samplers": ["top_k", "bogus"]}, "samplers"), ({"samplers": "ki"}, "samplers"), ({"samplers": 3}, "samplers"),
    ({"adaptive_target": "0.5"}, "adaptive_target"), ({"min_keep": -1}, "min_keep"), ({"grammar_lazy": True}, "grammar_lazy"),
    ({"n_indent": 4}, "n_indent"), ({"lora": [{"id": 0, "scale": 1.0}]}, "lora"), ({"n_cmpl": 99}, "n_cmpl"), ({"t_max_predict_ms": 0.5}, "t_max_predict_ms"),
    ({"reasoning_budget_tokens": 0}, "reasoning_budget_tokens"), ({"preserved_tokens": ["<x>"]}, "preserved_tokens"),
    ({"typical_p": 1.5}, "typical_p"), ({"dry_multiplier": "0.8"}, "dry_multiplier"),
    ({"dry_allowed_length": -1}, "dry_allowed_length"), ({"dry_penalty_last_n": 1.5}, "dry_penalty_last_n"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers"), ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": ["a", ""]}, "dry_sequence_breakers"), ({"dry_base": "1.75"}, "dry_base"),
    ({"xtc_probability": 1.5}, "xtc_probability"), ({"top_n_sigma": "1"}, "top_n_sigma"),
    ({"xtc_threshold": -1}, "xtc_threshold"),
    ({"dynatemp_range": -0.5}, "dynatemp_range"), ({"n_predict": -2}, "n_predict"),
    ({"dynatemp_exponent": "2"}, "dynatemp_exponent"),
])
def test_llama_server_completion_bad_requests(server, body, param):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/completion", headers=h, json={"prompt": [1, 2, 3], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_llama_server_samplers_at_their_off_values_are_taken(server):
    h = {"Authorization": f"Bearer {KEY}"}
    off = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0, "top_n_sigma": -1.0,
           "dynatemp_range": 0.0, "post_sampling_probs": False, "cache_prompt": True, "n_predict": 2}
    r = httpx.post(server + "/completion", headers=h, timeout=120, json={"prompt": [1, 2, 3], **off})
    assert r.status_code == 200 and r.json()["tokens_predicted"] <= 2, r.text


def test_typical_p_top_n_sigma_xtc_and_dynatemp_equal_the_solo_run(client, solo):
    """llama-server's typical_p, top_n_sigma, xtc and dynatemp fields (OpenAI's client sends them as extra body):
    the sampled text equals the CLI loop's with the same settings, and differs from the run without them."""
    ids = prompt_ids(17, 23)
    for extra, settings in [({"typical_p": 0.4}, SamplerSettings(temp=1.5, seed=9, typical_p=0.4)),
                            ({"top_n_sigma": 0.8}, SamplerSettings(temp=1.5, seed=9, top_n_sigma=0.8)),
                            ({"xtc_probability": 0.9, "xtc_threshold": 0.02},
                             SamplerSettings(temp=1.5, seed=9, xtc_probability=0.9, xtc_threshold=0.02)),
                            ({"dynatemp_range": 1.4, "dynatemp_exponent": 3.0},
                             SamplerSettings(temp=1.5, seed=9, dynatemp_range=1.4, dynatemp_exponent=3.0))]:
        r = client.completions.create(model="m", prompt=ids, max_tokens=12, temperature=1.5, seed=9, extra_body=extra)
        assert r.choices[0].text == solo(ids, 12, settings) != solo(ids, 12, SamplerSettings(temp=1.5, seed=9))


def test_dry_equals_the_solo_run(client, solo):
    """llama-server's DRY fields: greedy and sampled text equal the CLI loop's with the same DRY (its
    breakers from the vocabulary), and differ from the runs without it (the random weights rarely
    extend a repeat of two tokens: allowed length 0 penalizes every token seen in the window)."""
    ids = prompt_ids(6, 31) * 4
    for extra, settings in [({"dry_multiplier": 30.0, "dry_allowed_length": 0},
                             SamplerSettings(dry_multiplier=30.0, dry_allowed_length=0)),
                            ({"dry_multiplier": 2.0, "dry_base": 3.0, "dry_allowed_length": 0, "dry_penalty_last_n": 200,
                              "dry_sequence_breakers": [" the", "e"]},
                             SamplerSettings(dry_multiplier=2.0, dry_base=3.0, dry_allowed_length=0,
                                             dry_penalty_last_n=200, dry_sequence_breakers=(" the", "e")))]:
        r = client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=0, extra_body=extra)
        assert r.choices[0].text == solo(ids, 16, settings) != solo(ids, 16)
    extra = {"dry_multiplier": 5.0, "dry_allowed_length": 0}
    settings = SamplerSettings(temp=1.2, seed=4, dry_multiplier=5.0, dry_allowed_length=0)
    r = client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=1.2, seed=4, extra_body=extra)
    assert r.choices[0].text == solo(ids, 16, settings) != solo(ids, 16, SamplerSettings(temp=1.2, seed=4))


def test_sampler_order_equals_the_solo_run(client, solo):
    """llama-server's `samplers` (names, or a string of characters) and adaptive-p: the sampled text
    equals the decode loop's with the same order, and an order that differs changes it."""
    ids = prompt_ids(11, 43)
    base = dict(temp=1.4, seed=6, top_k=12, top_p=0.6)
    for extra, order in [({"samplers": ["temperature", "top_p", "top_k"]}, ("temperature", "top_p", "top_k")),
                         ({"samplers": "kpt"}, ("top_k", "top_p", "temperature"))]:
        r = client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=1.4, seed=6, top_p=0.6,
                                      extra_body={"top_k": 12, **extra})
        assert r.choices[0].text == solo(ids, 16, SamplerSettings(**base, samplers=order))
    assert solo(ids, 16, SamplerSettings(**base, samplers=("temperature", "top_p", "top_k"))) != solo(
        ids, 16, SamplerSettings(**base))
    extra = {"samplers": ["top_k", "temperature", "adaptive_p"], "adaptive_target": 0.2, "adaptive_decay": 0.8,
             "top_k": 12}
    r = client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=1.4, seed=6, extra_body=extra)
    want = SamplerSettings(temp=1.4, seed=6, top_k=12, samplers=("top_k", "temperature", "adaptive_p"),
                           adaptive_target=0.2, adaptive_decay=0.8)
    assert r.choices[0].text == solo(ids, 16, want) != solo(ids, 16, SamplerSettings(
        temp=1.4, seed=6, top_k=12, samplers=("top_k", "temperature")))


def test_mirostat_equals_the_solo_run(client, solo):
    """llama-server's mirostat, mirostat_tau and mirostat_eta: the sampled text equals the decode loop's
    with the same Mirostat (its own draws from the seed) and differs from the run without it."""
    ids = prompt_ids(9, 41)
    for extra, settings in [({"mirostat": 2, "mirostat_tau": 2.0}, SamplerSettings(temp=1.3, seed=3, mirostat=2,
                                                                                  mirostat_tau=2.0)),
                            ({"mirostat": 1, "mirostat_eta": 0.4}, SamplerSettings(temp=1.3, seed=3, mirostat=1,
                                                                                  mirostat_eta=0.4))]:
        r = client.completions.create(model="m", prompt=ids, max_tokens=16, temperature=1.3, seed=3, extra_body=extra)
        assert r.choices[0].text == solo(ids, 16, settings) != solo(ids, 16, SamplerSettings(temp=1.3, seed=3))


def test_n_choices(client, server, solo):
    """OpenAI's n: n choices, choice i sampled with the seed plus i (so each equals its solo run with
    that seed), the prompt counted once in the usage; streamed, each chunk names its choice and the
    stream ends once every choice has; greedy choices are all the greedy run. Choices admitted when
    the first's prompt is prefilled take copies of it (and still equal their solo runs)."""
    ids = prompt_ids(13, 71)
    r = client.completions.create(model="m", prompt=ids, max_tokens=10, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.text for c in r.choices} == {solo(ids, 10)}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (13, 30, 43)
    r2 = client.completions.create(model="m", prompt=ids, max_tokens=10, temperature=0, extra_body={"n_cmpl": 2})
    assert [c.text for c in r2.choices] == [solo(ids, 10)] * 2   # llama-server's name for n
    # the first choice prefills the prompt; the second, with the other slot idle then, takes a copy of
    # it; the third waits for a slot and prefills it itself
    assert [c.model_extra["timings"]["cache_n"] for c in r.choices] == [0, 13, 0]
    kw = dict(model="m", prompt=ids, max_tokens=12, temperature=0.9, seed=5, n=3)
    r = client.completions.create(**kw)
    want = [solo(ids, 12, SamplerSettings(temp=0.9, seed=5 + i)) for i in range(3)]
    assert [c.text for c in r.choices] == want and len(set(want)) > 1
    parts = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for p in parts:
        for c in p.choices:
            texts[c.index] += c.text
    assert texts == want and parts[-1].usage.completion_tokens == r.usage.completion_tokens
    assert sorted(c.index for p in parts for c in p.choices if c.finish_reason) == [0, 1, 2]
    msgs = [{"role": "user", "content": "a ring?"}]
    c = client.chat.completions.create(model="m", messages=msgs, max_tokens=6, temperature=0.8, seed=2, n=2)
    parts = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=6, temperature=0.8, seed=2, n=2,
                                                stream=True))
    assert sorted(p.choices[0].index for p in parts if p.choices[0].delta.role == "assistant") == [0, 1]
    for i in range(2):
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices[0].index == i)
        assert text == c.choices[i].message.content
    r = httpx.post(server + "/completion", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": ids, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_context_policy(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt=prompt_ids(CTX + 1, 6), max_tokens=1)
    assert f"{CTX + 1:,} tokens" in str(exc.value) and f"{CTX:,} positions" in str(exc.value)
    r = client.completions.create(model="m", prompt=prompt_ids(CTX - 5, 7), max_tokens=50, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens <= 6


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "stop": 3}', "stop"),
    (b'{"prompt": "x", "stop": ["ok", "' + b"a" * 4097 + b'"]}', "at most 4,096 characters, got 4,097"),
    (b'{"prompt": 7}', "prompt"),
    (b'{"prompt": [1, 99999999]}', "token ids"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "x", "n": 9}', "n"), (b'{"prompt": "x", "n": 0}', "n"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', "'presence_penalty' must be in [-2.0, 2.0]"),
    (b'{"prompt": "x", "frequency_penalty": "high"}', "'frequency_penalty' must be a finite number"),
    (b'{"prompt": "x", "repeat_penalty": 0}', "'repeat_penalty' must be in (0.0, 100.0]"),
    (b'{"prompt": "x", "repeat_last_n": -1}', "'repeat_last_n' must be between 0"),
    (b'{"prompt": "x", "logit_bias": {"5": -101}}', "'logit_bias' must be in [-100.0, 100.0]"),
    (b'{"prompt": "x", "logit_bias": {"a5": 1}}', "'logit_bias': 'a5' is not a token id"),
    (b'{"prompt": "x", "logit_bias": {"' + b"9" * 5000 + b'": 1}}', "is not a token id"),
    (b'{"prompt": "x", "logit_bias": [5, 1]}', "'logit_bias' as a list must hold [token id, bias] pairs"),
    (b'{"prompt": "x", "logit_bias": "5"}', "'logit_bias' must be an object"),
    (b'{"prompt": "x", "best_of": 3}', "'best_of' is not served"),
    (b'{"prompt": "x", "echo": 1}', "'echo' must be a boolean"),
    (b'{"prompt": "x", "suffix": "end"}', "'suffix' is not served"),
    (b'{"prompt": "x", "logprobs": 99}', "logprobs"),
    (b'\xff\xfe', "UTF-8"),
    (b'{"prompt": "a\\udc80b"}', "a lone surrogate (0xdc80) at character 1"),
    (b'{"prompt": "' + b"x" * 2**20 + b'"}', "the prompt is at least"),
    (b'{"prompt": "x", "stop": ' + b"[" * 200 + b"]" * 200 + b'}', "the body nests more than 128 levels"),
    (b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b'}', "the body nests more than 128 levels"),
])
def test_bad_requests_are_400_with_an_openai_error(server, body, fragment):
    r = httpx.post(server + "/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_unserved_fields_at_their_neutral_values_are_taken(client):
    """A client's defaults for the fields this server does not serve (plain text, no tools) ask
    for nothing and are taken; the same fields asking for something are 400
    (above, and for chat below)."""
    r = client.completions.create(model="m", prompt=prompt_ids(5, 3), max_tokens=2, temperature=0,
                                  best_of=1, echo=False)
    assert r.usage.completion_tokens == 2
    c = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, response_format={"type": "text"})
    assert c.usage.completion_tokens <= 2
    c = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       temperature=0, tools=[], tool_choice="auto", extra_body={"reasoning_format": "none"})
    assert c.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError) as exc:   # the fixture's template has no tool-call format
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert "'tools' need a chat template with a tool-call format" in str(exc.value)


def test_chat_content_as_text_parts(client):
    """OpenAI's content as a list of text parts is the same prompt as the parts joined by newlines
    (llama.cpp's rule for string templates); an image part is a 400 naming it."""
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "a ring?"}]
    kw = dict(model="m", max_tokens=8, temperature=0)
    joined = client.chat.completions.create(messages=[{"role": "user", "content": "What is\na ring?"}], **kw)
    split = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    assert split.choices[0].message.content == joined.choices[0].message.content
    assert split.usage.prompt_tokens == joined.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}], **kw)
    assert "'image_url' content part is not served" in str(exc.value)


def test_apply_template_is_the_chat_prompt(server, client):
    """llama-server's /apply-template: the text a chat request is prefilled with; that text's tokens,
    sent as a completion, give the chat answer's prompt count and text. Bad messages are a 400."""
    h = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a ring?"}]
    r = httpx.post(server + "/apply-template", headers=h, json={"messages": msgs})
    assert r.status_code == 200, r.text
    text = r.json()["prompt"]
    assert "What is a ring?" in text and "Be brief." in text
    ids = httpx.post(server + "/tokenize", headers=h, json={"content": text}).json()["tokens"]
    chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=8, temperature=0)
    done = client.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == done.choices[0].text
    for body in ({}, {"messages": "hi"}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}):
        r = httpx.post(server + "/apply-template", headers=h, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_chat_template_file(f32_fixture, tmp_path):
    """--chat-template-file: the chat route renders with it (/apply-template's prompt is that
    template's text for the messages, an assistant turn's reasoning_content among them, rendered here
    by plain jinja2), /props shows it."""
    import jinja2

    template = ("{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}({{ m.reasoning_content }})"
                "{% endif %}{{ m.content }}\n{% endfor %}<|assistant|>")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    proc, base = start_server(f32_fixture, "--chat-template-file", str(path), "--no-warmup", parallel=1)
    try:
        msgs = [{"role": "user", "content": "What is a ring?"},
                {"role": "assistant", "content": "A loop.", "reasoning_content": "Think of a buffer."}]
        r = httpx.post(base + "/apply-template", json={"messages": msgs})
        assert r.status_code == 200 and r.json()["prompt"] == jinja2.Template(template).render(messages=msgs)
        assert "(Think of a buffer.)" in r.json()["prompt"]   # an assistant turn's reasoning, as llama-server passes it
        assert httpx.get(base + "/props").json()["chat_template"] == template
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_chat_template_kwargs_and_generation_prompt(server, client, f32_fixture):
    """llama-server's chat_template_kwargs (the template's own variables: the fixture template's
    reasoning_strength, current_date, knowledge_cutoff, as muse-glimmer's) and add_generation_prompt
    reach the template: /apply-template's prompt is plain jinja2's rendering of the same template and
    values, and the chat route prefills that prompt. Bad values are a 400 naming the field."""
    import jinja2

    h = {"Authorization": f"Bearer {KEY}"}
    template = httpx.get(server + "/props", headers=h).json()["chat_template"]
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    msgs = [{"role": "user", "content": "What is a ring?"}, {"role": "assistant", "content": "A loop."},
            {"role": "user", "content": "And a plane?"}]
    kw = {"reasoning_strength": "low", "current_date": "2026-12-05", "knowledge_cutoff": "2025-01-01"}
    prompts = {}
    for agp in (True, False):
        r = httpx.post(server + "/apply-template", headers=h,
                       json={"messages": msgs, "chat_template_kwargs": kw, "add_generation_prompt": agp})
        assert r.status_code == 200, r.text
        prompts[agp] = r.json()["prompt"]
        want = jinja2.Template(template).render(messages=msgs, bos_token=tok.vocab.tokens[tok.bos_id],
                                                add_generation_prompt=agp, **kw)
        assert prompts[agp] == want
    assert "Reasoning strength: low." in prompts[True] and "Current date: 2026-12-05." in prompts[True]
    assert prompts[True] != prompts[False]
    ids = httpx.post(server + "/tokenize", headers=h, json={"content": prompts[True]}).json()["tokens"]
    chat = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0,
                                          extra_body={"chat_template_kwargs": kw})
    plain = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0)
    assert chat.usage.prompt_tokens == len(ids) != plain.usage.prompt_tokens
    for body, param in [({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                        ({"messages": msgs[:1] + [{"role": "assistant", "content": "x", "reasoning_content": 5}]},
                         "messages")]:
        r = httpx.post(server + "/v1/chat/completions", headers=h, json={"messages": msgs, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_bad_requests(server):
    for body in (b'{}', b'{"messages": [{"role": "user"}]}', b'{"messages": "hi"}',
                 b'{"messages": [{"role": "user", "content": []}]}',
                 b'{"messages": [{"role": "user", "content": [{"text": "x"}]}]}',
                 b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
                 b'{"messages": [{"role": "user", "content": null}]}',
                 b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                 b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}'):
        r = httpx.post(server + "/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_auth_and_routes(server):
    assert httpx.post(server + "/v1/completions", json={"prompt": "x"}).status_code == 401
    r = httpx.post(server + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert httpx.post(server + "/slots/9?action=save", json={"filename": "x"},
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_aliases_and_several_keys(f32_fixture, tmp_path):
    """llama-server's -m, --alias (the first name the model's id in /v1/models and in answers) and its
    keys: --api-key's comma-separated list and --api-key-file's lines (comments skipped), any of them
    taken, as a Bearer token or X-Api-Key; others 401."""
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nfile-key\n\n#not-a-key\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "muse_mlx.server", "-m", str(f32_fixture), "--port", str(port),
                             "--ctx-size", str(CTX), "--reference", "--no-warmup", "--alias", "glimmer, muse",
                             "--api-key", 'one,"two,2"', "--api-key-file", str(keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        for key in ("one", "two,2", "file-key"):
            client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            (model,) = client.models.list().data
            assert model.id == "glimmer" and model.model_extra["aliases"] == ["glimmer", "muse"]
            r = client.completions.create(model="x", prompt="a", max_tokens=2, temperature=0)
            assert r.model == "glimmer"
        assert httpx.get(base + "/v1/models", headers={"X-Api-Key": "file-key"}).status_code == 200
        for bad in ("two", "#not-a-key", "# the team's keys", "one,two,2"):
            assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {bad}"}).status_code == 401, bad
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sampling_flags_are_the_requests_defaults(f32_fixture, solo):
    """llama-server's sampling flags and -n set the fields a request leaves out: with --temp 0 and
    -n 5 a bare completion is the 5-token greedy run; a request's own fields win; /props shows them."""
    proc, base = start_server(f32_fixture, "--temp", "0", "-n", "5", "--top-k", "7", "--no-warmup", parallel=1)
    try:
        ids = prompt_ids(3, 9)
        r = httpx.post(base + "/v1/completions", json={"prompt": ids}, timeout=120).json()
        assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["text"] == solo(ids, 5)
        r = httpx.post(base + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 1.0, "seed": 3},
                       timeout=120).json()
        assert r["usage"]["completion_tokens"] == 2
        assert r["choices"][0]["text"] == solo(ids, 2, SamplerSettings(temp=1.0, top_k=7, seed=3))
        params = httpx.get(base + "/props").json()["default_generation_settings"]["params"]
        assert params["temperature"] == 0.0 and params["top_k"] == 7
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_disconnected_stream_frees_its_slot(server):
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server + "/v1/completions", headers=h, timeout=60,
                      json={"prompt": prompt_ids(5, 8), "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    for _ in range(100):
        if all(s["state"] == "idle" for s in httpx.get(server + "/slots", headers=h).json()):
            return
        time.sleep(0.1)
    pytest.fail("the slot was not freed")


def test_slot_save_and_restore(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    client.completions.create(model="m", prompt=prompt_ids(30, 9), max_tokens=3, temperature=0)
    busy = [s for s in httpx.get(server + "/slots", headers=h).json() if s["n_past"] > 0]
    r = httpx.post(f"{server}/slots/{busy[0]['id']}?action=save", json={"filename": "s.kvpack"}, headers=h)
    assert r.status_code == 200 and r.json()["n_saved"] == busy[0]["n_past"], r.text
    other = 1 - busy[0]["id"]
    r = httpx.post(f"{server}/slots/{other}?action=restore", json={"filename": "s.kvpack"}, headers=h)
    assert r.status_code == 200 and r.json()["n_restored"] == busy[0]["n_past"], r.text
    r = httpx.post(f"{server}/slots/{other}?action=restore", json={"filename": "../etc"}, headers=h)
    assert r.status_code == 400
    r = httpx.post(f"{server}/slots/{other}?action=restore", json={"filename": "missing"}, headers=h)
    assert r.status_code == 400 and "not a pack" in r.json()["error"]["message"]
    # names no file can have (a NUL, a lone surrogate) or that would hide in a listing: 400 on one
    # kept-alive connection, which still answers after each (a 500 closes it)
    with httpx.Client(headers=h) as c:
        for name in ["a\x00b", "\udc80", "\ud800x", "a\nb", "a\u200bb", "\x7f", "x" * 201]:
            for action in ("save", "restore"):
                r = c.post(f"{server}/slots/{other}?action={action}", content=json.dumps({"filename": name}))
                assert r.status_code == 400 and r.json()["error"]["param"] == "filename", (name, r.text)
        assert c.get(server + "/health").status_code == 200


def test_slot_erase(server):
    """llama-server's erase: a slot holding a restored pack offers it to a prompt that extends it
    (the answer's timings show the pack's positions as cached); once erased it holds nothing, and
    the same prompt is prefilled whole."""
    h = {"Authorization": f"Bearer {KEY}"}
    ids = prompt_ids(20, 73)

    def complete(prompt, slot):
        r = httpx.post(server + "/completion", headers=h, timeout=120,
                       json={"prompt": prompt, "n_predict": 1, "temperature": 0, "id_slot": slot})
        assert r.status_code == 200, r.text
        return r.json()["timings"]
    complete(ids, 1)   # one token: the slot then holds the prompt's 20 positions
    r = httpx.post(f"{server}/slots/1?action=save", json={"filename": "erase.kvpack"}, headers=h)
    assert r.status_code == 200 and r.json()["n_saved"] == 20, r.text
    for erase in (False, True):
        r = httpx.post(f"{server}/slots/0?action=restore", json={"filename": "erase.kvpack"}, headers=h)
        assert r.status_code == 200 and r.json()["n_restored"] == 20, r.text
        if erase:
            r = httpx.post(f"{server}/slots/0?action=erase", headers=h)
            assert r.status_code == 200 and r.json() == {"id_slot": 0, "n_erased": 20}, r.text
            assert httpx.get(server + "/slots", headers=h).json()[0]["n_past"] == 0
        t = complete(ids + [5, 6], 0)
        assert (t["cache_n"], t["prompt_n"]) == ((0, 22) if erase else (20, 2))
    r = httpx.post(f"{server}/slots/0?action=wipe", headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "action"


def test_metrics(f32_fixture, server):
    """llama-server's /metrics with --metrics (a 501 without): parsed by prometheus_client's own
    parser, the counters move by what one known request did (11 prompt tokens in one prefill
    chunk, 7 generated by 6 decode steps: the last is not fed back), the throughput gauges cover
    the window since the last scrape, and the slot gauges show a running and a waiting request."""
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 501
    proc, base = start_server(f32_fixture, "--metrics", "--queue", "4", "--no-warmup", parallel=1)
    try:
        def scrape() -> dict:
            r = httpx.get(base + "/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
            return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
        before = scrape()
        assert before["llamacpp:n_decode_total"] == 0 and before["llamacpp:requests_processing"] == 0
        r = httpx.post(base + "/completion", json={"prompt": prompt_ids(11, 81), "n_predict": 7, "temperature": 0},
                       timeout=120).json()
        assert r["tokens_predicted"] == 7 and r["stop_type"] == "limit"
        m = scrape()
        delta = {k: m[k] - before[k] for k in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total",
                                               "llamacpp:n_decode_total", "llamacpp:prompt_tokens_cached_total")}
        assert delta == {"llamacpp:prompt_tokens_total": 11, "llamacpp:tokens_predicted_total": 7,
                         "llamacpp:n_decode_total": 7, "llamacpp:prompt_tokens_cached_total": 0}
        assert m["llamacpp:n_tokens_max"] == 18 and m["llamacpp:n_busy_slots_per_decode"] == 1.0
        assert m["llamacpp:prompt_tokens_seconds"] == pytest.approx(11 / m["llamacpp:prompt_seconds_total"])
        assert m["llamacpp:predicted_tokens_seconds"] > 0 and m["llamacpp:tokens_predicted_seconds_total"] > 0
        again = scrape()   # a new window: no request ended in it
        assert again["llamacpp:prompt_tokens_seconds"] == 0 and again["llamacpp:predicted_tokens_seconds"] == 0
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(httpx.post, base + "/completion", timeout=120,
                                json={"prompt": prompt_ids(5, 82 + i), "n_predict": 120, "temperature": 0})
                    for i in range(2)]
            for _ in range(200):
                m = scrape()
                if m["llamacpp:requests_processing"] == 1 and m["llamacpp:requests_deferred"] == 1:
                    break
                time.sleep(0.02)
            assert (m["llamacpp:requests_processing"], m["llamacpp:requests_deferred"]) == (1, 1)
            assert all(j.result().status_code == 200 for j in jobs)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_full_queue_answers_503_with_retry_after(f32_fixture):
    proc, base = start_server(f32_fixture, "--queue", "0", parallel=1)
    try:
        results = []

        def long():
            results.append(httpx.post(base + "/v1/completions", json={"prompt": prompt_ids(5, 1), "max_tokens": 150,
                                                                      "temperature": 0}, timeout=120).status_code)
        t = threading.Thread(target=long)
        t.start()
        for _ in range(100):   # wait until the slot is taken
            if httpx.get(base + "/health").json()["slots_processing"] == 1:
                break
            time.sleep(0.05)
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]["message"]
        t.join()
        assert results == [200]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_handoff_between_servers_ships_only_what_the_receiver_lacks(f32_fixture, tmp_path, solo):
    """Server A prefills a prompt but its last token and hands the slot to server B (blobs B lacks,
    then the manifest; B verifies and restores); B decodes on, and its greedy text is the solo
    run's. A second, longer prompt sharing the first's plane chunks ships only the rest."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a, a_url = start_server(f32_fixture, "--slot-save-path", str(a_dir), "--ctx-size", "1024", parallel=1)
    b, b_url = start_server(f32_fixture, "--slot-save-path", str(b_dir), "--ctx-size", "1024", "--api-key", "kb",
                            parallel=1)
    try:
        first = prompt_ids(300, 21)
        second = first + prompt_ids(200, 22)
        sent = []
        for name, ids in (("h1", first), ("h2", second)):
            r = httpx.post(a_url + "/v1/completions", json={"prompt": ids[:-1], "max_tokens": 0}, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text
            r = httpx.post(a_url + "/slots/0?action=handoff", timeout=300,
                           json={"filename": name, "to": b_url, "api_key": "kb", "slot": 0})
            assert r.status_code == 200, r.text
            sent.append(r.json())
            assert sent[-1]["receiver"]["n_restored"] == len(ids) - 1
            r = httpx.post(b_url + "/v1/completions", headers={"Authorization": "Bearer kb"}, timeout=120,
                           json={"prompt": ids, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo(ids, 12), r.text
        assert sent[0]["blobs_sent"] == sent[0]["blobs_in_pack"]
        assert sent[0]["payload_bytes_sent"] == sent[0]["payload_bytes_full"]
        assert sent[1]["blobs_sent"] < sent[1]["blobs_in_pack"]    # the first 256 positions' chunk was held
        assert sent[1]["payload_bytes_sent"] < sent[1]["payload_bytes_full"]
        r = httpx.post(a_url + "/slots/0?action=handoff", timeout=60,
                       json={"filename": "h3", "to": b_url, "api_key": "wrong"})
        assert r.status_code == 400 and "401" in r.json()["error"]["message"]
        r = httpx.put(b_url + "/kv/blobs/" + "0" * 64, content=b"not it", headers={"Authorization": "Bearer kb"})
        assert r.status_code == 400 and "hash" in r.json()["error"]["message"]
    finally:
        for p in (a, b):
            p.terminate()
            p.wait(timeout=30)


@pytest.mark.parametrize("depth, held", [(300, 0), (520, 300)], ids=["deep", "delta"])
def test_live_handoff_tool(f32_fixture, tmp_path, solo, depth, held):
    """tools/live_handoff (the H200's handoff cell between two live servers), on the fixture: B's
    greedy text is A's own and the solo run's; the full pack's payload is every NoPE layer's rows
    of the positions sent plus each ring's last window, counted here layer by layer from the
    file's geometry; with nothing held everything is sent, with a held prefix less; the receipt
    says "agrees" and the command exits 0."""
    import json

    from muse_mlx.artifact import open_artifact
    from muse_mlx.tools import live_handoff

    receipt = tmp_path / "cell.json"
    rc = live_handoff.main(["--model", str(f32_fixture), "--depth", str(depth), "--held", str(held), "--tokens", "8",
                            "--ctx-size", "1024", "--server-arg=--reference", "--workdir", str(tmp_path / "w"),
                            "--receipt", str(receipt)])
    r = json.loads(receipt.read_text())
    cell = r["metrics"]["cell"]
    assert rc == 0 and r["verdict"] == "agrees", cell
    ids = [int(t) for t in np.random.default_rng(5).integers(0, open_artifact(f32_fixture).geometry.n_vocab, depth)]
    assert cell["b_text"] == cell["a_text"] == solo(ids, 8)
    g = open_artifact(f32_fixture).geometry
    row = 2 * g.n_head_kv * g.head_dim * 2   # K and V of one position, f16
    rows = sum(min(depth - 1, g.sliding_window) if g.is_swa(il) else depth - 1 for il in range(g.n_layer))
    assert cell["payload_bytes_full"] == rows * row
    if held:
        assert 0 < cell["payload_bytes_sent"] < cell["payload_bytes_full"]
    else:
        assert cell["payload_bytes_sent"] == cell["payload_bytes_full"] < cell["wire_bytes"]
    t = cell["a_prefill_timings"]   # A's own account of its prefill: what it prefilled, and its checkpoints apart
    assert t["prompt_n"] + t["cache_n"] == depth - 1 and t["predicted_n"] == 0
    assert 0 < t["prompt_cache_ms"] < t["prompt_ms"] <= cell["a_prefill_s"] * 1e3


def test_automatic_prompt_reuse_equals_the_solo_runs(f32_fixture, solo, tmp_path):
    """--prompt-cache: a repeated prompt restores its exact end (no prefill); a longer one may only
    start from a checkpoint on a chunk multiple; each answer equals the solo run, and usage says
    how many prompt tokens came from the cache (OpenAI's prompt_tokens_details.cached_tokens)."""
    proc, base = start_server(f32_fixture, "--prompt-cache", str(tmp_path / "pc"), parallel=1)
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        ids = prompt_ids(140, 41)
        longer = ids + prompt_ids(30, 42)
        cached = []
        for p in (ids, ids, longer):
            r = c.completions.create(model="m", prompt=p, max_tokens=10, temperature=0)
            assert r.choices[0].text == solo(p, 10)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            t = r.model_extra["timings"]
            assert (t["cache_n"], t["prompt_n"]) == (cached[-1], len(p) - cached[-1])
            assert 0 < t["prompt_cache_ms"] <= t["prompt_ms"]   # the lookup, and the stores when it prefilled
        # the first prompt's end (140) is no multiple of the prefill chunk (512), so the longer
        # prompt may not start from it (its chunks would differ from a cold run's): it prefills all
        assert cached == [0, 140, 0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_pipelined_step_keeps_each_slot_s_tokens_equal_to_its_cache(f32_fixture, solo):
    """The scheduler in-process: the decode step feeds each token back before reading it, so a slot
    that stops (stop string, max_tokens, a stop reached mid-step) has its cache and `tokens` agree
    (every token fed back, the last one included when the step in flight fed it), its prompt
    first, then exactly what it emitted; and each stream equals its solo run."""
    from muse_mlx.slots import Request, Scheduler

    model = load(f32_fixture, backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    sched = Scheduler(model, tok, 3, CTX)
    sched.thread.start()
    jobs = [(prompt_ids(11, 40), 9, []), (prompt_ids(23, 41), 1, []), (prompt_ids(7, 42), 14, []),
            (prompt_ids(15, 43), 12, None)]   # None: a stop string from the middle of its solo text
    done, requests = [], []
    try:
        for ids, n, stops in jobs:
            if stops is None:
                stops = [solo(ids, n)[5:8]]
            events: list[dict] = []
            finished = threading.Event()

            def emit(e, events=events, finished=finished):
                events.append(e)
                if "finish_reason" in e or "error" in e:
                    finished.set()
            request = Request(list(ids), n, SamplerSettings(), emit, stop_strings=stops)
            sched.submit(request)
            requests.append(request)
            done.append((ids, n, stops, events, finished))
        for ids, n, stops, events, finished in done:
            assert finished.wait(120)
            assert not any("error" in e for e in events)
            text = "".join(e.get("text", "") for e in events)
            want = solo(ids, n)
            assert text == (want[:want.index(stops[0])] if stops else want)
        slots = sched.control(lambda: [(list(s.tokens), s.cache.offset, s.state) for s in sched.slots])
        for tokens, offset, state in slots:
            assert state == "idle" and len(tokens) == offset
        held = {tuple(t[:len(ids)]): t[len(ids):] for t, _, _ in slots for ids, *_ in jobs if t[:len(ids)] == list(ids)}
        for (ids, n, stops, events, _), req in zip(done, requests):
            emitted = [e["token"] for e in events if "token" in e]
            if tuple(ids) not in held:   # its slot has taken another request since
                continue
            rest, reason = held[tuple(ids)], events[-1]["finish_reason"]
            if reason == "length":   # max_tokens: the last token was never fed back
                assert rest == emitted[:-1]
            elif stops:              # a stop string: the token completing it was fed back
                assert rest == emitted
            else:                    # a stop token, fed back by the step in flight, not emitted
                assert rest[:-1] == emitted and rest[-1] in tok.stop_ids
    finally:
        sched.stop()
        sched.thread.join(30)


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # as from a terminal (a background job's is ignored)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 0), (signal.SIGTERM, -signal.SIGTERM)])
def test_the_server_stops_cleanly_after_serving(f32_fixture, sig, status):
    """Ctrl-C after requests were served: uvicorn's graceful shutdown, then the scheduler's thread
    joined, status 0 (a server stopped by its operator, as uvicorn and llama-server end); a TERM:
    the same shutdown, then uvicorn re-raises the signal, so the status says TERM. Never an
    abort: with MLX 0.32.4 a process that ran a prefill and a decode step on the scheduler's
    thread aborted in its C++ teardown at exit ("terminate called without an active exception",
    status 134), which cli.exit_now skips."""
    proc, base = start_server(f32_fixture, parallel=1, preexec_fn=_default_sigint)
    try:
        for max_tokens in (4, 3):
            r = httpx.post(base + "/v1/completions", json={"prompt": "A list is", "max_tokens": max_tokens}, timeout=120)
            assert r.status_code == 200, r.text
        proc.send_signal(sig)
        got = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert got == status, (got, err)
    assert "warm-up" in err and "terminate called" not in err and "Traceback" not in err, err


def test_the_warm_up_traces_the_decode_step_on_the_engine_thread_and_leaves_no_trace(tmp_path, f32_fixture, solo):
    """Scheduler.warm_up (the server's start, unless --no-warmup): on the engine's thread, a short
    prefill and one decode step over each slot count. With the kernel path (CPU stand-ins for the
    kernels) it traces the compiled step for B = 1, 2, 3, so a first short request adds no trace;
    the slots are empty after it, and what a request then decodes is its solo run's text."""
    import sys as _sys

    from muse_mlx.artifact import open_artifact
    from muse_mlx.config import KernelConfig
    from muse_mlx.model import Model
    from muse_mlx.ops.gpu import GpuOps
    from muse_mlx.slots import Request, Scheduler

    _sys.path.insert(0, os.path.dirname(__file__))
    from test_kernel_path_on_cpu import StandIns

    model = Model(open_artifact(f32_fixture), GpuOps(StandIns(KernelConfig(prefill_f16=0))))
    tok = MuseTokenizer(model.artifact.vocabulary)
    sched = Scheduler(model, tok, 3, CTX)
    sched.thread.start()
    try:
        assert sched.warm_up() > 0
        assert sorted(key[0] for key in model._compiled) == [1, 2, 3]   # B of each traced step
        traced = set(model._compiled)
        assert sched.control(lambda: [(s.cache.offset, s.tokens, s.state) for s in sched.slots]) == [(0, [], "idle")] * 3
        ids, events, finished = prompt_ids(5, 44), [], threading.Event()

        def emit(e):
            events.append(e)
            if "finish_reason" in e or "error" in e:
                finished.set()
        sched.submit(Request(list(ids), 6, SamplerSettings(), emit))
        assert finished.wait(120) and not any("error" in e for e in events)
        assert set(model._compiled) == traced
        # the same text as the MLX-ops reference's solo run, through the float32 stand-ins
        assert "".join(e.get("text", "") for e in events) == solo(ids, 6)
    finally:
        sched.stop()
        sched.thread.join(60)


@pytest.fixture
def in_process(f32_fixture, tmp_path):
    """The server's own app in this process (server.build: the reference backend, one slot of 64
    positions, a --slot-save-path), its engine thread started, a Starlette TestClient on it:
    (app, client, the slot-save folder); the engine thread stopped after."""
    import types

    from starlette.testclient import TestClient

    from muse_mlx import server

    saves = tmp_path / "saves"
    saves.mkdir()
    args = types.SimpleNamespace(model=str(f32_fixture), reference=True, ctx_size=64, parallel=1, queue=4,
                                 prompt_cache=None, slot_save_path=str(saves), api_key=None)
    app, scheduler = server.build(args)
    scheduler.thread.start()
    try:
        yield app, TestClient(app.starlette()), saves
    finally:
        scheduler.stop()
        scheduler.thread.join(60)


@pytest.mark.parity
def test_models_meta_is_llama_cpp_s(in_process, f32_fixture):
    """/v1/models's `meta` (llama-server's): the vocabulary's type, n_vocab, the model's context and
    width, its parameters and its tensors' bytes as the pinned llama.cpp counts them
    (llama_model_n_params, llama_model_size), and the slot's context."""
    from muse_mlx.tools.llamacpp import LlamaCpp

    app, client, _ = in_process
    (entry,) = client.get("/v1/models").json()["data"]
    meta = entry["meta"]
    with LlamaCpp(f32_fixture, n_ctx=64) as llama:
        L, model = llama.L, llama.model
        want = {"vocab_type": L.llama_vocab_type(llama.vocab), "n_vocab": llama.n_vocab,
                "n_ctx_train": L.llama_model_n_ctx_train(model), "n_embd": L.llama_model_n_embd(model),
                "n_params": L.llama_model_n_params(model), "size": L.llama_model_size(model)}
    assert {k: meta[k] for k in want} == want and meta["n_ctx"] == 64


def test_ctx_size_0_is_the_model_s_limit(f32_fixture):
    """--ctx-size 0 (llama-server's "from the model") gives each slot the model's context_length."""
    import types

    from muse_mlx import server

    args = types.SimpleNamespace(model=str(f32_fixture), reference=True, ctx_size=0, parallel=1, queue=4,
                                 prompt_cache=None, slot_save_path=None, api_key=None)
    app, scheduler = server.build(args)
    assert scheduler.context == scheduler.model.geometry.context_length > 0


def test_a_slot_save_the_disk_refuses_is_507_and_leaves_nothing(in_process, monkeypatch):
    """POST /slots/{id}?action=save onto a full disk (ENOSPC from the pack's writes): 507 with an
    OpenAI-style error naming the pack and the cause, no half-written pack left, and the server
    answering on; another OSError (the disk read-only) is a 500 of the same shape. The handoff's
    receiving side likewise: a blob (PUT /kv/blobs) or a pack (POST /kv/packs) the disk refuses is
    a 507 and leaves nothing. In process (the server's own app, an idle slot, so the engine thread
    runs no MLX step)."""
    import errno
    import shutil

    from muse_mlx import kvpack

    _, client, saves = in_process
    for code, status in ((errno.ENOSPC, 507), (errno.EROFS, 500)):
        def refused(path, data, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(kvpack, "_write_atomic", refused)
        r = client.post("/slots/0?action=save", json={"filename": f"p{code}"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert f"'p{code}'" in err["message"] and os.strerror(code) in err["message"]
        assert err["type"] == "server_error" and not any(saves.iterdir())
    monkeypatch.undo()
    r = client.post("/slots/0?action=save", json={"filename": "ok"})
    assert r.status_code == 200 and (saves / "ok" / "manifest.json").exists()
    # the handoff's receiving side: a blob, then a pack whose blobs cannot be copied in
    data = b"some blob bytes"
    name = hashlib.sha256(data).hexdigest()
    monkeypatch.setattr(kvpack, "_write_atomic", lambda path, data: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    r = client.put(f"/kv/blobs/{name}", content=data)
    assert r.status_code == 507 and "could not be stored" in r.json()["error"]["message"]
    assert not list((saves / ".incoming" / "blobs").iterdir())
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "copyfile", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    r = client.post("/kv/packs/copy", content=(saves / "ok" / "manifest.json").read_bytes())
    assert r.status_code == 507 and "'copy' could not be written" in r.json()["error"]["message"], r.text
    assert not (saves / "copy").exists()
    monkeypatch.undo()
    assert client.get("/health").status_code == 200


def test_a_body_past_its_limit_is_413_before_it_is_held(in_process):
    """A client cannot make the server hold more than a body's limit: a JSON request past
    server.JSON_MAX_BYTES (sent in pieces, no Content-Length) and a blob past the largest a pack of
    this model can hold get 413 with an OpenAI-style error, read no further than the limit, and the
    server answers on. A declared Content-Length past the limit is refused before any byte is read."""
    from muse_mlx import server

    app, client, saves = in_process
    sent = [0]

    def pieces(total, piece=2**20):
        while sent[0] < total:
            sent[0] += piece
            yield b" " * piece
    r = client.post("/v1/completions", content=pieces(server.JSON_MAX_BYTES + 2**21))
    assert r.status_code == 413 and "more than the 67,108,864 bytes" in r.json()["error"]["message"], r.text
    assert sent[0] <= server.JSON_MAX_BYTES + 2 * 2**20   # it stopped reading at the limit
    limit = app.blob_max_bytes
    r = client.put("/kv/blobs/" + "ab" * 32, content=b"\0" * (limit + 1))
    assert r.status_code == 413 and f"more than the {limit:,}" in r.json()["error"]["message"]
    assert not (saves / ".incoming").exists()
    r = client.post("/v1/completions", content=b"{}", headers={"content-length": str(10**12)})
    assert r.status_code == 413 and "1,000,000,000,000 bytes" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_handoff_blobs_leave_incoming_once_packed_and_unclaimed_ones_expire(in_process):
    """The receiving side of a handoff: the blobs a sender PUTs wait in .incoming; POST /kv/packs
    copies them into the pack, which verifies, and removes them from .incoming (GET /kv/blobs still
    lists them, from the pack). A blob no pack took is removed at the next put once it is older than
    the server's --kv-incoming-ttl (a fresh one stays; 0 keeps them all). Before: every blob
    received stayed in .incoming for good, a second copy of each pack handed over."""

    from muse_mlx import kvpack

    app, client, saves = in_process
    r = client.post("/v1/completions", json={"prompt": prompt_ids(40, 3), "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    busy = [s for s in client.get("/slots").json() if s["n_past"] > 0]
    r = client.post(f"/slots/{busy[0]['id']}?action=save", json={"filename": "src"})
    assert r.status_code == 200 and r.json()["n_saved"] > 0, r.text
    sent = sorted((saves / "src" / "blobs").glob("*.safetensors"))
    assert sent
    incoming = saves / ".incoming" / "blobs"
    for blob in sent:   # as a sender whose receiver held none of them
        assert client.put(f"/kv/blobs/{blob.stem}", content=blob.read_bytes()).status_code == 200
    assert sorted(f.name for f in incoming.iterdir()) == [b.name for b in sent]
    r = client.post("/kv/packs/copy", content=(saves / "src" / "manifest.json").read_bytes())
    assert r.status_code == 200, r.text
    kvpack.verify(saves / "copy")
    assert not list(incoming.iterdir())
    assert set(client.get("/kv/blobs").json()["blobs"]) >= {b.stem for b in sent}
    # a blob no pack takes: removed at a later put once older than the time to live
    stale, fresh = b"sent, then its sender stopped", b"sent just now"
    for data in (stale, fresh):
        assert client.put(f"/kv/blobs/{hashlib.sha256(data).hexdigest()}", content=data).status_code == 200
    old = time.time() - app.incoming_ttl_s - 60
    os.utime(incoming / f"{hashlib.sha256(stale).hexdigest()}.safetensors", (old, old))
    app.incoming_ttl_s = 0   # 0: kept
    assert client.put(f"/kv/blobs/{hashlib.sha256(fresh).hexdigest()}", content=fresh).status_code == 200
    assert len(list(incoming.iterdir())) == 2
    app.incoming_ttl_s = 3600.0
    assert client.put(f"/kv/blobs/{hashlib.sha256(fresh).hexdigest()}", content=fresh).status_code == 200
    assert [f.name for f in incoming.iterdir()] == [f"{hashlib.sha256(fresh).hexdigest()}.safetensors"]


def test_a_pack_put_whose_name_another_took_meanwhile_is_400_and_leaves_the_other(in_process, monkeypatch):
    """Two POST /kv/packs/{name} of one name in flight: each checks the name is free before its
    manifest arrives, so both may pass. The one that comes second answers 400 ("exists") and leaves
    the first's pack whole (before: its mkdir failed, it removed the first's pack as its own
    half-written one, and answered 500). The pack is assembled off the event loop, so the server
    answers other requests while blobs are copied and hashed."""
    import threading

    from muse_mlx import kvpack, server

    app, client, saves = in_process
    r = client.post("/v1/completions", json={"prompt": prompt_ids(40, 5), "max_tokens": 1, "temperature": 0})
    busy = [s for s in client.get("/slots").json() if s["n_past"] > 0]
    assert client.post(f"/slots/{busy[0]['id']}?action=save", json={"filename": "src"}).status_code == 200
    manifest = (saves / "src" / "manifest.json").read_bytes()
    real_read_body = server.read_body

    async def first_put_wins(request, limit, what="the request's body"):   # the other put, done meanwhile
        body = await real_read_body(request, limit, what)
        if what == "the manifest":
            (saves / "n").mkdir()
            (saves / "n" / "mine").write_text("the first put's")
        return body
    monkeypatch.setattr(server, "read_body", first_put_wins)
    r = client.post("/kv/packs/n", content=manifest)
    assert r.status_code == 400 and "exists" in r.json()["error"]["message"], r.text
    assert (saves / "n" / "mine").read_text() == "the first put's"
    monkeypatch.undo()
    threads = {}
    real_verify = kvpack.verify

    async def on_the_loop(request, limit, what="the request's body"):
        threads["loop"] = threading.current_thread()
        return await real_read_body(request, limit, what)

    def verify(path):
        threads["verify"] = threading.current_thread()
        return real_verify(path)
    monkeypatch.setattr(server, "read_body", on_the_loop)
    monkeypatch.setattr(kvpack, "verify", verify)
    r = client.post("/kv/packs/m", content=manifest)
    assert r.status_code == 200, r.text
    assert threads["verify"] is not threads["loop"], threads
    assert client.get("/health").status_code == 200


def test_a_prompt_is_tokenized_off_the_event_loop_and_one_too_long_by_its_bytes_is_not_tokenized(in_process,
                                                                                                  monkeypatch):
    """Tokenizing holds a thread ~1 s a MB: a text prompt is tokenized on a worker thread (the
    tokenizer releases the GIL there), and one whose bytes alone prove it longer than the slot
    (more than context x the longest token's bytes) is refused without being tokenized."""
    import threading

    from muse_mlx import server

    app, client, _ = in_process
    calls, real_encode, real_parse = [], app.tokenizer.encode, server.parse_json
    threads = {}

    def encode(text, add_bos=None):
        calls.append(threading.current_thread())
        return real_encode(text, add_bos)

    def parse_json(body):
        threads["loop"] = threading.current_thread()
        return real_parse(body)
    monkeypatch.setattr(app.tokenizer, "encode", encode)
    monkeypatch.setattr(server, "parse_json", parse_json)
    r = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and len(calls) == 1 and calls[0] is not threads["loop"], r.text
    n = app.scheduler.context * app.tokenizer.max_token_bytes + 1
    r = client.post("/v1/completions", json={"prompt": "é" * (n // 2 + 1), "max_tokens": 1})
    assert r.status_code == 400 and len(calls) == 1, r.text
    assert f"at least {-(-(n + 1) // app.tokenizer.max_token_bytes):,} tokens" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x" * app.scheduler.context, "max_tokens": 1})
    assert len(calls) == 2   # not provably too long by its bytes: tokenized (and judged by its tokens)


def cut_at_stops(text: str, job) -> str:
    """A job's full solo text as the server returns it with the job's stop strings: up to the first."""
    from muse_mlx.tools.load_test import STOPS

    if not job.stops:
        return text
    at = [text.find(s) for s in STOPS if s in text]
    return text[:min(at)] if at else text


def test_load_test_tool(f32_fixture, tmp_path, solo):
    """The load test (issue 16 item 4; tools/load_test, run on the H200 with full numbers) on the
    fixture: N requests (MUSE_LOAD_REQUESTS, default 24; mixed prompt and output lengths, greedy and
    seeded, streamed and not, some with stop strings) alone, then twice over 8 at a time on two
    slots: the command passes (no errors, every answer its solo run's, the server's memory within
    64 MiB after the first round), and every answer it recorded is this test's own in-process solo
    run of the job; a request the tool is given a different answer for is reported as a difference."""
    import json

    from muse_mlx.artifact import open_artifact
    from muse_mlx.tools import load_test

    n = int(os.environ.get("MUSE_LOAD_REQUESTS", "24"))
    receipt = tmp_path / "load.json"
    rc = load_test.main(["--model", str(f32_fixture), "--parallel", "2", "--requests", str(n), "--concurrency", "8",
                         "--prompt-len", "3:120", "--max-tokens", "0:40", "--ctx-size", str(CTX),
                         "--server-arg=--reference", "--receipt", str(receipt)])
    r = json.loads(receipt.read_text())
    assert rc == 0 and r["verdict"] == "passes", r["metrics"]
    jobs = load_test.make_jobs(n, open_artifact(f32_fixture).geometry.n_vocab, (3, 120), (0, 40), 42)
    assert [len(j.prompt) for j in jobs] == [j["prompt_tokens"] for j in r["inputs"]["jobs"]]
    assert any(j.sampled for j in jobs) and any(j.stream for j in jobs) and any(j.stops for j in jobs)
    assert any(j.penalized and j.sampled for j in jobs) and any(j.penalized and not j.sampled for j in jobs)
    assert len(r["samples"]["rounds"]) == 2
    for answers in (r["samples"]["solo"], *r["samples"]["rounds"]):
        for job, got in zip(jobs, answers, strict=True):
            settings = job.settings()
            assert settings.penalized == job.penalized and settings.temp == (0.8 if job.sampled else 0)
            assert got["error"] is None and got["text"] == cut_at_stops(solo(job.prompt, job.max_tokens, settings),
                                                                         job), (job, got)
    assert r["metrics"]["server_alive_after"] and r["metrics"]["rss_growth_after_warm_up_bytes"] is not None
    # the checker itself: a changed text, finish reason or count, and an error, are each reported
    outs = [load_test.Outcome(**o) for o in r["samples"]["solo"]]
    bad = [load_test.Outcome(**o) for o in r["samples"]["solo"]]
    bad[1].text += "x"
    bad[2].finish_reason = "other"
    bad[3].completion_tokens = (bad[3].completion_tokens or 0) + 1
    bad[4].error = "APIError: boom"
    assert [(d["job"], d["what"]) for d in load_test.differences(outs, bad)] == \
        [(1, "text"), (2, "finish_reason"), (3, "completion_tokens"), (4, "error")]


@pytest.mark.parametrize("name", ["gqa4-hd64-nocap", "partial-rope-pattern", "mha-window1"])
def test_load_test_tool_on_other_geometries(tmp_path, name):
    """The load test on Q8_0 models of geometries the server was not tuned on (test_model's: other
    layer counts, windows down to 1, head counts and dims, partial RoPE, sliding patterns, logit
    scales, no softcap), four slots, eight requests in flight, prompts past the windows: every
    answer, alone and under load, equals this test's in-process solo run of the job."""
    import json

    from gguf import GGMLQuantizationType as QT
    from test_model import OTHER_GEOMETRIES

    from muse_mlx.tools import load_test
    from muse_mlx.tools.fixtures import write_fixture

    g = OTHER_GEOMETRIES[name]
    path = write_fixture(tmp_path / f"{name}.gguf", g, seed=3, weight_type=QT.Q8_0)
    receipt = tmp_path / "load.json"
    rc = load_test.main(["--model", str(path), "--parallel", "4", "--requests", "10", "--concurrency", "8",
                         "--rounds", "1", "--prompt-len", "3:60", "--max-tokens", "0:24", "--seed", "7",
                         "--server-arg=--reference", "--receipt", str(receipt)])
    r = json.loads(receipt.read_text())
    assert rc == 0 and r["verdict"] == "passes", r["metrics"]
    model = load(path, backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    for job, alone, loaded in zip(load_test.make_jobs(10, g.n_vocab, (3, 60), (0, 24), 7), r["samples"]["solo"],
                                  r["samples"]["rounds"][0], strict=True):
        cache = model.make_cache(len(job.prompt) + job.max_tokens + 1)
        want = tok.decode(list(generate_tokens(model, cache, job.prompt, Sampler(job.settings(), job.prompt),
                                               job.max_tokens, tok.stop_ids)))
        assert alone["text"] == loaded["text"] == cut_at_stops(want, job), (name, job)



@pytest.mark.parametrize("which", ["server", "generate"])
@pytest.mark.parametrize("flags, expected", [([], 0), (["--batch-invariant"], 1),
                                             (["--kernel-config", "batch_invariant=1"], 1)])
def test_batch_invariant_flag_reaches_the_kernels(which, flags, expected, monkeypatch, f32_fixture):
    """--batch-invariant (server and generate, the two sides of a comparison) and --kernel-config
    batch_invariant=1 give the model's load KernelConfig.batch_invariant = 1; without them 0.
    (What the field does: tests/test_batch_invariant.py, tests/gpu.)"""
    from muse_mlx import generate, model, server

    seen = []

    class Loaded(Exception):
        pass

    def fake_load(path, backend="auto", kernel_config=None, **kw):
        seen.append(kernel_config)
        raise Loaded
    monkeypatch.setattr(model, "load", fake_load)
    argv = ["--model", str(f32_fixture), *flags]
    with pytest.raises(Loaded):
        if which == "server":
            server._command(argv + ["--no-warmup"])
        else:
            generate.run(argv + ["-p", "hi", "--max-tokens", "1"])
    assert len(seen) == 1 and seen[0].batch_invariant == expected


def test_the_server_never_samples_the_gguf_s_suppressed_tokens(f32_fixture, tmp_path, solo):
    """tokenizer.ggml.suppress_tokens reach the server's samplers as they reach generate's
    (tests/test_parity.py checks those against llama.cpp): the greedy answer equals the CLI loop's
    with the suppression, and differs from the plain greedy one."""
    from gguf import GGUFValueType as VT
    from ggufedit import rewrite

    ids = prompt_ids(12, 91)
    first = solo(ids, 1, as_ids=True)[0]
    path = rewrite(f32_fixture, tmp_path / "suppress.gguf",
                   set_keys={"tokenizer.ggml.suppress_tokens": ([first], VT.ARRAY, VT.INT32)})
    model = load(path, backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    want = tok.decode(generate_tokens(model, model.make_cache(CTX), ids, Sampler(SamplerSettings(), ids, (first,)), 10,
                                      tok.stop_ids))
    proc, base = start_server(path, "--no-warmup", parallel=1)
    try:
        r = httpx.post(base + "/completion", json={"prompt": ids, "n_predict": 10, "temperature": 0,
                                                    "return_tokens": True}, timeout=120).json()
        assert r["content"] == want != solo(ids, 10) and first not in r["tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_echo_scores_a_text_in_prefill_chunks(in_process, f32_fixture):
    """OpenAI's legacy scoring call: echo with logprobs and max_tokens 0 gives the prompt's text and
    each prompt token's log-prob (the first None) and top 3, against a float64 log-softmax of the
    model's logits over the prompt (in process); with the scheduler's prefill in chunks of 16, the
    40-token prompt's log-probs come from three chunks. Then echo with a continuation: the prompt's
    text, then the answer (equal to the greedy run), streamed and not; chat refuses echo."""
    from muse_mlx.tools.oracle import log_softmax

    app, client, _ = in_process
    app.scheduler.chunk = 16
    ids = prompt_ids(40, 92)
    model = load(f32_fixture, backend="reference")
    tok = MuseTokenizer(model.artifact.vocabulary)
    want = log_softmax(np.array(model.prefill(ids, model.make_cache(64), all_logits=True), dtype=np.float64))
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == tok.decode(ids) and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert len(lp["tokens"]) == 40 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, 40):
        assert abs(lp["token_logprobs"][i] - want[i - 1, ids[i]]) < 1e-5, i
        expected = {}
        for j in np.argsort(-want[i - 1], kind="stable")[:3]:
            expected.setdefault(tok.decode([int(j)]), want[i - 1, j])
        assert list(lp["top_logprobs"][i]) == list(expected)
        assert np.allclose(list(lp["top_logprobs"][i].values()), list(expected.values()), atol=1e-5)
    greedy = tok.decode(generate_tokens(model, model.make_cache(64), ids, Sampler(SamplerSettings()), 5, tok.stop_ids))
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0, "echo": True,
                                             "logprobs": 1}).json()
    assert r["choices"][0]["text"] == tok.decode(ids) + greedy
    assert len(r["choices"][0]["logprobs"]["tokens"]) == 40 + r["usage"]["completion_tokens"]
    with client.stream("POST", "/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0,
                                                        "echo": True, "logprobs": 1, "stream": True}) as s:
        chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert chunks[0]["choices"][0]["text"] == tok.decode(ids)
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == tok.decode(ids) + greedy
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True, "stream": True})
    texts = [json.loads(line[5:])["choices"][0]["text"] for line in r.text.splitlines()
             if line.startswith("data:") and "[DONE]" not in line]
    assert r.status_code == 200 and texts[0] == tok.decode(ids)   # no log-probs asked: the prompt at once
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


# ---- constrained output (grammar.py; the design in docs/server.md, "Constrained output") ----

YES_NO = 'root ::= ("yes" | "no") " " [a-z]+ (" " [a-z]+)* "."'
BOUNDED = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "pick": {"enum": ["red", "blue"]}},
           "required": ["n", "pick"], "additionalProperties": False}


def test_constrained_requests_equal_their_solo_runs_beside_a_free_one(server, client, solo):
    """A grammar (completions), a schema (llama-server's /completion) and a free request run at once
    in the two slots and the queue: each output equals its solo run (the CLI's decode loop with the
    same grammar), though a constrained slot's pick waits for its token's read while the others' do not."""
    h = {"Authorization": f"Bearer {KEY}"}
    a, b, c = prompt_ids(9, 41), prompt_ids(14, 42), prompt_ids(6, 43)
    schema = json.dumps(BOUNDED)

    def constrained():
        r = client.completions.create(model="m", prompt=a, max_tokens=30, temperature=0, extra_body={"grammar": YES_NO})
        return r.choices[0].text

    def free():
        return client.completions.create(model="m", prompt=b, max_tokens=30, temperature=0).choices[0].text

    def schema_route():
        r = httpx.post(server + "/completion", headers=h, timeout=120,
                       json={"prompt": c, "n_predict": 80, "temperature": 0, "json_schema": BOUNDED})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(3) as pool:
        got = [pool.submit(f) for f in (constrained, free, schema_route)]
        got = [g.result() for g in got]
    assert got[0] == solo(a, 30, grammar=("gbnf", YES_NO))
    assert re.fullmatch(r"(yes|no) [a-z]+( [a-z]+)*\.?", got[0]) or re.fullmatch(r"(yes|no)( [a-z]*)*", got[0])
    assert got[1] == solo(b, 30) and got[1] != got[0]
    assert got[2]["content"] == solo(c, 80, grammar=("json_schema", schema))
    value = json.loads(got[2]["content"])
    assert set(value) == {"n", "pick"} and 0 <= value["n"] <= 99 and value["pick"] in ("red", "blue")
    assert got[2]["stop_type"] == "eos"


def test_choices_under_one_grammar_keep_their_own_state(client, solo):
    """n = 3, sampled: each choice follows the grammar from its own state (copies, not one shared
    matcher) and equals its solo run with seed + i."""
    ids = prompt_ids(8, 44)
    settings = SamplerSettings(temp=0.9, seed=11)
    r = client.completions.create(model="m", prompt=ids, max_tokens=25, temperature=0.9, seed=11, n=3,
                                  extra_body={"grammar": YES_NO})
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    for i, text in enumerate(texts):
        assert text == solo(ids, 25, replace(settings, seed=11 + i), grammar=("gbnf", YES_NO)), i
        assert text.startswith(("yes ", "no "))
    assert len(set(texts)) > 1


def test_response_format_on_chat_streamed_and_not(client):
    """OpenAI's response_format: json_schema gives JSON the schema accepts, ending with `stop`;
    json_object streamed gives a JSON object; the grammar's end is the request's."""
    msgs = [{"role": "user", "content": "Pick a colour."}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=60, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "pick", "schema": BOUNDED, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"n", "pick"} and r.choices[0].finish_reason == "stop"
    with client.chat.completions.create(model="m", messages=msgs, max_tokens=60, temperature=0, stream=True,
                                        response_format={"type": "json_object"}) as stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert isinstance(json.loads(text), dict)
    r = client.completions.create(model="m", prompt="Is it", max_tokens=10, temperature=0,
                                  extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields,param,fragment", [
    ({"grammar": "root ::= foo"}, "grammar", "grammar does not compile"),
    ({"grammar": 5}, "grammar", "must be a string"),
    ({"json_schema": {"type": 5}}, "json_schema", "json_schema does not compile"),
    ({"json_schema": [1]}, "json_schema", "must be an object"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "grammar", "both constrain the output"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar", "both constrain"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": "json"}, "response_format", "must be"),
    ({"grammar": 'root ::= "' + "a" * 300_000 + '"'}, "grammar", "more than 256 KiB"),
    ({"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000}, "grammar", "does not compile"),
    ({"grammar": "root ::= a\na ::= a"}, "grammar", "admits no text"),
])
def test_bad_grammars_are_400_naming_the_field(server, fields, param, fragment):
    """Each refused before the request queues: a grammar that does not compile, or that no text can start."""
    for route in ("/v1/completions", "/completion"):
        r = httpx.post(server + route, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"prompt": "The", "max_tokens": 3, **fields})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"], err
    assert httpx.get(server + "/health").status_code == 200


def test_a_grammar_that_dead_ends_is_the_request_s_400(server, client):
    """A grammar that compiles and starts ("a") but admits no text after it ends its request when the
    dead end comes, with a 400 naming the grammar (non-streamed; streamed, an error event of that
    type); the slot is free again and the server answers the next request."""
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "The", "max_tokens": 8, "temperature": 0, "grammar": 'root ::= "a" b\nb ::= b "c"'}
    r = httpx.post(server + "/v1/completions", headers=h, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "grammar admits no text past what was generated" in err["message"]
    with httpx.stream("POST", server + "/v1/completions", headers=h, json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model="m", prompt="The", max_tokens=2, temperature=0).usage.completion_tokens == 2


# ---- OpenAI's Responses API (responses.py) ----

def test_responses_api_is_the_chat_route_under_its_names(client):
    """responses.create: `input` and `instructions` as the chat's messages (llama-server's
    conversion; a developer message is a system one, an earlier output message an assistant one),
    `max_output_tokens` as max_tokens: the same text and token counts as the chat route gives; a
    response cut by its limit is `incomplete` with OpenAI's reason."""
    kw = dict(model="m", temperature=0)
    r = client.responses.create(input="What is a ring?", instructions="Be brief.", max_output_tokens=8, **kw)
    chat = client.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "What is a ring?"}], max_tokens=8, **kw)
    assert r.output_text == chat.choices[0].message.content and r.object == "response"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "What is a ring?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A loop."}]},
             {"role": "user", "content": "And a plane?"}]
    r = client.responses.create(input=items, max_output_tokens=6, **kw)
    chat = client.chat.completions.create(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a ring?"},
        {"role": "assistant", "content": "A loop."}, {"role": "user", "content": "And a plane?"}], max_tokens=6, **kw)
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_api_stream_and_text_format(client):
    """The stream is the Responses API's events in order, numbered from 0, whose deltas are the
    answer's text; `text.format` (OpenAI's structured output) constrains it, and the client's own
    stream helper assembles a completed response from the events."""
    kw = dict(model="m", temperature=0, input="What is a ring?")
    whole = client.responses.create(max_output_tokens=8, **kw)
    events = list(client.responses.create(max_output_tokens=8, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == whole.output_text == events[-4].text
    schema = {"type": "object", "properties": {"pick": {"enum": ["red", "blue"]}}, "required": ["pick"],
              "additionalProperties": False}
    with client.responses.stream(max_output_tokens=60, text={"format": {"type": "json_schema", "name": "pick",
                                                                        "schema": schema}}, **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text)["pick"] in ("red", "blue")


@pytest.mark.parametrize("body, param", [
    ({}, "input"), ({"input": 5}, "input"), ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
])
def test_responses_api_bad_requests(server, body, param):
    r = httpx.post(server + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err


# ---- Anthropic's Messages API (messages_api.py), as llama-server serves it ----

@pytest.fixture(scope="module")
def claude(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)   # sends X-Api-Key


def test_messages_api_is_the_chat_route_under_its_names(claude, client):
    """messages.create through Anthropic's own client (its key as X-Api-Key): `system` (a string, or
    text blocks joined) and the turns as the chat's messages, the same text and token counts as the
    chat route; Anthropic's stop reasons (max_tokens; stop_sequence with the one matched, as the chat
    route's stop strings); count_tokens as the chat's prompt tokens."""
    greedy = {"temperature": 0}
    msgs = [{"role": "user", "content": "What is a ring?"}]
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Be brief."}, *msgs],
                                          max_tokens=8, temperature=0)
    for system in ("Be brief.", [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]):
        m = claude.messages.create(model="m", max_tokens=8, system=system, messages=msgs, extra_body=greedy)
        assert m.content[0].text == chat.choices[0].message.content and m.stop_reason == "max_tokens"
        assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert claude.messages.count_tokens(model="m", system="Be brief.", messages=msgs).input_tokens == \
        chat.usage.prompt_tokens
    free = client.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0)
    text = free.choices[0].message.content
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha())
    m = claude.messages.create(model="m", max_tokens=30, messages=msgs, stop_sequences=[stop], extra_body=greedy)
    cut = client.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0, stop=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == cut.choices[0].message.content


def test_messages_api_stream(server, claude):
    """The stream is Anthropic's events in order, whose deltas are the message's text; the client's
    stream helper assembles the same message."""
    kw = dict(model="m", max_tokens=8, messages=[{"role": "user", "content": "What is a ring?"}])
    whole = claude.messages.create(extra_body={"temperature": 0}, **kw)
    with claude.messages.stream(extra_body={"temperature": 0}, **kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text and final.stop_reason == "max_tokens"
    with httpx.stream("POST", server + "/v1/messages", headers={"X-Api-Key": KEY}, timeout=60,
                      json={**kw, "stream": True, "temperature": 0}) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"), ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "some"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "system"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["x" * 5000]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
])
def test_messages_api_bad_requests(server, body, param):
    r = httpx.post(server + "/v1/messages", headers={"X-Api-Key": KEY}, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(server + "/v1/messages", headers={"X-Api-Key": "nope"}, json=body).status_code == 401


# ---- muse-glimmer's chat format: tools, reasoning, the answer's grammar (docs/server.md) ----

@pytest.fixture(scope="module")
def muse_server(f32_fixture, tmp_path_factory):
    """A server whose chat template is the pinned muse-glimmer.jinja (the fixture's own has no tool
    calls or reasoning channel)."""
    import chat_oracle

    template = chat_oracle.template()
    if template is None:
        pytest.skip("needs the pinned sdist (.pinned/) for muse-glimmer.jinja")
    path = tmp_path_factory.mktemp("template") / "muse-glimmer.jinja"
    path.write_text(template)
    proc, base = start_server(f32_fixture, "--chat-template-file", str(path), "--ctx-size", "2048", parallel=1)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


MUSE_TOOLS = [{"type": "function", "function": {"name": "noargs", "description": "Does nothing", "parameters": {}}},
              {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city", "parameters": {
                  "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}}}]


def _message_bias(f32_fixture) -> dict:
    """A bias that makes the random fixture model end a free run of text (a call's recipient) at once
    with <|message|>: the grammar then leaves it only the markup of a call to a tool of no parameters."""
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    return {str(tok.vocab.tokens.index("<|message|>")): 100}


def test_a_required_tool_call_is_held_to_its_grammar_and_read_as_a_call(muse_server, f32_fixture):
    """tool_choice naming a tool: the answer is held to the call's grammar, read into tool_calls with
    finish_reason tool_calls, the same streamed (deltas added up) and not."""
    client = openai.OpenAI(base_url=muse_server + "/v1", api_key="x", max_retries=0, timeout=300)
    kw = dict(model="m", messages=[{"role": "user", "content": "Do it."}], tools=MUSE_TOOLS, max_tokens=200,
              temperature=0, tool_choice={"type": "function", "function": {"name": "noargs"}},
              logit_bias=_message_bias(f32_fixture))
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "noargs", "{}")
    assert call.id.startswith("call_") and choice.message.content == ""
    name, arguments, ids, finish = "", "", set(), None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                assert d.index == 0
                ids.add(d.id) if d.id else None
                name += d.function.name or ""
                arguments += d.function.arguments or ""
    assert (name, arguments, finish, len(ids)) == ("noargs", "{}", "tool_calls", 1)


def test_a_response_format_holds_the_answer_s_message(muse_server, f32_fixture):
    """With muse-glimmer's template a JSON schema holds the answer's message (after its
    ` to=user<|message|>` header, as llama.cpp's response-format rule), and the content read from it is
    the JSON alone."""
    client = openai.OpenAI(base_url=muse_server + "/v1", api_key="x", max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Answer."}], max_tokens=60,
                                       temperature=0, logit_bias=_message_bias(f32_fixture),
                                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"ok"}
    # the Responses API's answer is the content read the same way, streamed or not
    body = {"model": "m", "input": "Answer.", "max_output_tokens": 60, "temperature": 0, "extra_body": {"logit_bias": _message_bias(f32_fixture)},
            "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}
    got = client.responses.create(**body)
    assert got.output_text == r.choices[0].message.content
    with client.responses.stream(**body) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.choices[0].message.content


@pytest.mark.parity
def test_the_prompt_with_tools_and_calls_is_llama_cpp_s(muse_server, f32_fixture):
    """/apply-template (the chat route's prompt) for conversations with tools, an assistant's tool
    calls (arguments as JSON text) and their results, against the pinned llama.cpp's chat layer
    (common_chat_templates_apply through tests/chat_oracle.py)."""
    import chat_oracle

    oracle = chat_oracle.oracle()
    if oracle is None:
        pytest.skip("the chat oracle needs the pinned sdist, the parity extra and a C++ compiler")
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Zürich", "days": 2, "x": [1, {"a": null}], "t": true}'}}
    conversations = [
        [{"role": "user", "content": "Weather in Zürich?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 °C"}],
        [{"role": "user", "content": "Two?"},
         {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
          "tool_calls": [call, {**call, "id": "c2", "function": {"name": "noargs", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "rain"}, {"role": "tool", "name": "noargs", "content": "ok"},
         {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "Thanks"}],
    ]
    kwargs = {"current_date": "2026-12-05"}
    for tools in (MUSE_TOOLS, None):
        for messages in conversations:
            body = {"messages": messages, "chat_template_kwargs": kwargs}
            if tools:
                body["tools"] = tools
            r = httpx.post(muse_server + "/apply-template", json=body)
            assert r.status_code == 200, r.text
            request = {"template": chat_oracle.template(), "bos": tok.vocab.tokens[tok.bos_id], "eos": "<|eot|>",
                       "messages": messages, "chat_template_kwargs": kwargs}
            if tools:
                request["tools"] = tools
            assert r.json()["prompt"] == oracle.apply(request)["prompt"], (tools is not None, messages)


def test_a_last_assistant_message_is_continued(muse_server, f32_fixture):
    """llama-server's prefill_assistant (its default) and continue_final_message: the prompt is llama.cpp's
    chat layer's for the continuation (checked through /apply-template), the answer is that prompt's
    greedy continuation read with the message in it (its content starts with the message's), and what
    llama-server refuses is a 400 naming the field."""
    import chat_oracle

    oracle = chat_oracle.oracle()
    if oracle is None:
        pytest.skip("the chat oracle needs the pinned sdist, the parity extra and a C++ compiler")
    tok = MuseTokenizer(load(f32_fixture, backend="reference").artifact.vocabulary)
    user = {"role": "user", "content": "What is a ring?"}
    for last, extra in [({"role": "assistant", "content": "A ring is"}, {}),
                        ({"role": "assistant", "content": "", "reasoning_content": "Rings"}, {}),
                        ({"role": "assistant", "content": "So", "reasoning_content": "Hm"},
                         {"continue_final_message": "reasoning_content", "add_generation_prompt": False})]:
        body = {"messages": [user, last], **extra}
        prompt = httpx.post(muse_server + "/apply-template", json=body).json()["prompt"]
        want = oracle.apply({"template": chat_oracle.template(), "bos": tok.vocab.tokens[tok.bos_id], "eos": "<|eot|>",
                             "messages": [user, last], "add_generation_prompt": False,
                             "continue_final_message": extra.get("continue_final_message", True)})
        assert prompt == want["prompt"], last
        r = httpx.post(muse_server + "/v1/chat/completions", json={**body, "max_tokens": 6, "temperature": 0}).json()
        message = r["choices"][0]["message"]
        if extra or not last["content"]:
            assert (message.get("reasoning_content") or "").startswith(last["reasoning_content"]), message
        else:
            assert message["content"].startswith(last["content"]), message
    for body, param in [({"messages": [user, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
                         "messages"),
                        ({"messages": [user], "continue_final_message": True}, "continue_final_message"),
                        ({"messages": [user], "continue_final_message": "everything", "add_generation_prompt": False},
                         "continue_final_message"),
                        ({"messages": [user, {"role": "assistant", "content": "a"}], "tools": MUSE_TOOLS}, "messages")]:
        r = httpx.post(muse_server + "/v1/chat/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body, param", [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": MUSE_TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": MUSE_TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": MUSE_TOOLS, "grammar": "root ::= \"x\""}, "tools"),
    ({"tools": MUSE_TOOLS, "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": MUSE_TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"reasoning_format": "hidden"}, "reasoning_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": {"function": {}}}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"type": "object", "properties": {"a": ' * 40 + "{}" + "}}" * 40)}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"p": {"$ref": "#/$defs/missing"}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"p": {"type": "string", "pattern": "(a"}, "q": {"type": "integer", "minimum": "x"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_and_chat_options_are_400_naming_the_field(muse_server, body, param):
    r = httpx.post(muse_server + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_messages_api_tool_use(muse_server, f32_fixture):
    """Anthropic's tools through its own client: tool_choice naming a tool gives a tool_use block and
    stop_reason tool_use, streamed (the client's helper assembles the input from input_json_delta)
    and not; an earlier tool_use and its tool_result become the chat's tool call and tool message
    (count_tokens equals the chat route's prompt for the same conversation)."""
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=muse_server, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in MUSE_TOOLS]
    kw = dict(model="m", max_tokens=200, messages=[{"role": "user", "content": "Do it."}], tools=tools,
              tool_choice={"type": "tool", "name": "noargs"},
              extra_body={"temperature": 0, "logit_bias": _message_bias(f32_fixture)})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "noargs", {})]
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", "noargs", {})]
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                 {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                  "input": {"city": "Rome", "days": 2}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    counted = claude.messages.count_tokens(model="m", messages=history, tools=tools).input_tokens
    chat = [history[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "user", "content": "And tomorrow?"}, {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]
    prompt = httpx.post(muse_server + "/apply-template", json={"messages": chat, "tools": MUSE_TOOLS}).json()["prompt"]
    assert "<atem:parameter name=\"city\">Rome</atem:parameter>" in prompt and "sunny" in prompt
    assert counted == len(httpx.post(muse_server + "/tokenize", json={"content": prompt}).json()["tokens"])


def test_responses_api_function_calls(muse_server, f32_fixture):
    """OpenAI's Responses API with function tools through the official client: a named function's
    call is a function_call output item, streamed (output_item.added, arguments deltas and done) and
    not; earlier function_call and function_call_output items become the chat's tool call and tool
    message (the same prompt tokens as the chat route's for the same conversation)."""
    client = openai.OpenAI(base_url=muse_server + "/v1", api_key="x", max_retries=0, timeout=300)
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in MUSE_TOOLS]
    kw = dict(model="m", input="Do it.", tools=tools, tool_choice={"type": "function", "name": "noargs"},
              max_output_tokens=200, temperature=0, extra_body={"logit_bias": _message_bias(f32_fixture)})
    r = client.responses.create(**kw)
    assert [(o.type, o.name, o.arguments) for o in r.output] == [("function_call", "noargs", "{}")]
    assert r.output[0].call_id and r.status == "completed"
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == "{}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "noargs", "{}")]
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    got = client.responses.create(model="m", input=history, tools=tools, max_output_tokens=1, temperature=0)
    chat = client.chat.completions.create(model="m", tools=MUSE_TOOLS, max_tokens=1, temperature=0, messages=[
        history[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert got.usage.input_tokens == chat.usage.prompt_tokens
